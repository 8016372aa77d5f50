//! The reference transformer: a tiny deterministic decoder-only model that
//! computes real K/V in a [`KvLayout`] so that ON (prefix imported as bytes)
//! and OFF (everything recomputed) can be compared bit for bit.
//!
//! Architecture (Llama-shaped, f32 everywhere): token embedding, `num_layers`
//! blocks of {RMSNorm, grouped-query causal attention with RoPE, RMSNorm,
//! SwiGLU MLP}, final RMSNorm, untied LM head, greedy argmax decoding (ties to
//! the lowest token id). Weights are drawn from ChaCha8 seeded with
//! [`ModelConfig::seed`], uniform in `±1/sqrt(fan_in)`.
//!
//! Why outputs are bit-identical whatever the split point: every token is
//! processed by the same sequence of f32 operations in the same order (one
//! token at a time, sums in position order), and a token's computation reads
//! only its own activations and the K/V of earlier positions. K/V of a
//! position depends only on the tokens up to it, so bytes copied from another
//! cache holding the same prefix are exactly the bytes recompute would write.
//!
//! Cache memory order is [`TensorOrder::BlockMajor`]
//! `[block, layer, k|v, token_in_block, head_on_rank, head_dim]`, one buffer per
//! TP rank; rank `r` holds KV heads `r*h/tp .. (r+1)*h/tp`. One block of one
//! rank is therefore one contiguous run of [`KvLayout::rank_block_bytes`]
//! bytes, which is what a retained bank slot holds.

use kv_descriptor::{DType, KvLayout, TensorOrder};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

mod kv_cache;
pub use self::kv_cache::KvCache;

/// Why the model refused an input. Nothing is modified on error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A configuration field is out of range.
    #[error("invalid model config `{field}`: {reason}")]
    Config {
        /// Offending field of [`ModelConfig`].
        field: &'static str,
        /// What is wrong, with the value seen.
        reason: String,
    },
    /// A token id is not below the vocabulary size.
    #[error("token {token} at index {index} is outside the vocabulary of {vocab}")]
    TokenOutOfVocab {
        /// Index in the input slice.
        index: usize,
        /// The token id.
        token: u32,
        /// Vocabulary size.
        vocab: u32,
    },
    /// Imported or exported blocks do not fit the cache.
    #[error("invalid block transfer `{field}`: {reason}")]
    Blocks {
        /// Offending argument (`first_block`, `parts`, `parts[r].len`, `layout`).
        field: &'static str,
        /// What is wrong, with the values seen.
        reason: String,
    },
    /// Nothing to compute (empty prompt on an empty cache).
    #[error("empty input: `{field}` must hold at least one token")]
    Empty {
        /// Offending argument.
        field: &'static str,
    },
}

/// Shape and seed of the reference model. All sizes in elements or tokens.
///
/// ```
/// use kv_testkit::model::ModelConfig;
/// let c = ModelConfig::default();
/// let l = c.layout(2).unwrap(); // TP2: one KV head per rank
/// assert_eq!(l.heads_per_rank(), 1);
/// assert_eq!(l.rank_block_bytes(), 2 * 3 * 16 * 1 * 16 * 4);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Vocabulary size (token ids `0..vocab`).
    pub vocab: u32,
    /// Hidden size; must equal `num_heads x head_dim`.
    pub d_model: u32,
    /// Transformer blocks.
    pub num_layers: u32,
    /// Query heads; a multiple of `num_kv_heads`.
    pub num_heads: u32,
    /// KV heads (grouped-query attention).
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// SwiGLU hidden size.
    pub ffn_hidden: u32,
    /// Tokens per KV block.
    pub tokens_per_block: u32,
    /// RoPE base (Llama: 10,000).
    pub rope_theta: f32,
    /// Weight seed.
    pub seed: u64,
}

impl Default for ModelConfig {
    /// vocab 256, d_model 64, 3 layers, 4 query heads over 2 KV heads of 16,
    /// SwiGLU 128, 16-token blocks, seed 7.
    fn default() -> Self {
        Self {
            vocab: 256,
            d_model: 64,
            num_layers: 3,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            ffn_hidden: 128,
            tokens_per_block: 16,
            rope_theta: 10_000.0,
            seed: 7,
        }
    }
}

impl ModelConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the field: a zero size, `d_model` not
    /// `num_heads x head_dim`, `num_heads` not a multiple of `num_kv_heads`,
    /// a non-positive `rope_theta`.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field, reason: String| Err(ModelError::Config { field, reason });
        for (field, v) in [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("ffn_hidden", self.ffn_hidden),
            ("tokens_per_block", self.tokens_per_block),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if self.head_dim % 2 != 0 {
            return bad(
                "head_dim",
                format!("RoPE needs an even head_dim, got {}", self.head_dim),
            );
        }
        if self.d_model != self.num_heads * self.head_dim {
            return bad(
                "d_model",
                format!(
                    "{} != num_heads {} x head_dim {}",
                    self.d_model, self.num_heads, self.head_dim
                ),
            );
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return bad(
                "num_heads",
                format!(
                    "{} is not a multiple of num_kv_heads {}",
                    self.num_heads, self.num_kv_heads
                ),
            );
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return bad(
                "rope_theta",
                format!("must be positive, got {}", self.rope_theta),
            );
        }
        Ok(())
    }

    /// The cache layout at TP size `tp_size` (f32, block-major).
    ///
    /// # Errors
    /// [`ModelError::Config`] with field `tp_size` when the layout is refused
    /// (e.g. `num_kv_heads` not divisible by `tp_size`).
    pub fn layout(&self, tp_size: u32) -> Result<KvLayout, ModelError> {
        KvLayout::new(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            DType::F32,
            self.tokens_per_block,
            TensorOrder::BlockMajor,
            tp_size,
        )
        .map_err(|e| ModelError::Config {
            field: "tp_size",
            reason: e.to_string(),
        })
    }
}

/// Maps arbitrary `u32` token ids (e.g. [`crate::trace::synthetic_tokens`])
/// into `0..vocab` by remainder.
///
/// ```
/// assert_eq!(kv_testkit::model::to_vocab(&[5, 300, 256], 256), vec![5, 44, 0]);
/// ```
pub fn to_vocab(tokens: &[u32], vocab: u32) -> Vec<u32> {
    tokens.iter().map(|t| t % vocab.max(1)).collect()
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    mlp_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// The reference model: immutable weights, shared by any number of caches.
///
/// ```
/// use kv_testkit::model::{ModelConfig, ReferenceModel};
/// let m = ReferenceModel::new(ModelConfig::default()).unwrap();
/// let mut cache = m.new_cache(1).unwrap();
/// let out = m.generate(&mut cache, &[1, 2, 3, 4, 5], 4).unwrap();
/// assert_eq!(out.tokens.len(), 4);
/// assert_eq!(cache.len_tokens(), 5 + 3); // the last generated token is not fed back
/// ```
pub struct ReferenceModel {
    cfg: ModelConfig,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    lm_head: Vec<f32>,
}

/// What [`ReferenceModel::generate`] produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// Greedy tokens, first one from the prompt's last position.
    pub tokens: Vec<u32>,
    /// Logits (`vocab` values) that chose the first token.
    pub first_logits: Vec<f32>,
}

fn uniform(rng: &mut ChaCha8Rng, n: usize, fan_in: u32) -> Vec<f32> {
    let s = 1.0 / (fan_in as f32).sqrt();
    (0..n).map(|_| rng.gen_range(-s..s)).collect()
}

fn norm_weights(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| 1.0 + rng.gen_range(-0.1f32..0.1)).collect()
}

/// `out[o] = sum_i w[o * x.len() + i] * x[i]`, summed in index order.
fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    let n = x.len();
    for (o, y) in out.iter_mut().enumerate() {
        let row = &w[o * n..(o + 1) * n];
        let mut acc = 0.0f32;
        for (a, b) in row.iter().zip(x) {
            acc += a * b;
        }
        *y = acc;
    }
}

/// RMSNorm (Zhang & Sennrich 2019), eps 1e-5 as in Llama.
fn rms_norm(x: &[f32], w: &[f32], out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + 1e-5).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

impl ReferenceModel {
    /// Builds the model, drawing weights from `cfg.seed`.
    ///
    /// # Errors
    /// [`ModelError::Config`] from [`ModelConfig::validate`].
    pub fn new(cfg: ModelConfig) -> Result<Self, ModelError> {
        cfg.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let d = cfg.d_model as usize;
        let kvd = (cfg.num_kv_heads * cfg.head_dim) as usize;
        let f = cfg.ffn_hidden as usize;
        let v = cfg.vocab as usize;
        let embed = uniform(&mut rng, v * d, 1);
        let layers = (0..cfg.num_layers)
            .map(|_| Layer {
                attn_norm: norm_weights(&mut rng, d),
                wq: uniform(&mut rng, d * d, cfg.d_model),
                wk: uniform(&mut rng, kvd * d, cfg.d_model),
                wv: uniform(&mut rng, kvd * d, cfg.d_model),
                wo: uniform(&mut rng, d * d, cfg.d_model),
                mlp_norm: norm_weights(&mut rng, d),
                w_gate: uniform(&mut rng, f * d, cfg.d_model),
                w_up: uniform(&mut rng, f * d, cfg.d_model),
                w_down: uniform(&mut rng, d * f, cfg.ffn_hidden),
            })
            .collect();
        let final_norm = norm_weights(&mut rng, d);
        let lm_head = uniform(&mut rng, v * d, cfg.d_model);
        Ok(Self {
            cfg,
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// An empty cache laid out for TP size `tp_size`.
    ///
    /// # Errors
    /// [`ModelError::Config`] (`tp_size`) when the KV heads do not split evenly.
    pub fn new_cache(&self, tp_size: u32) -> Result<KvCache, ModelError> {
        Ok(KvCache::new(self.cfg.layout(tp_size)?))
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        match tokens.iter().position(|&t| t >= self.cfg.vocab) {
            Some(index) => Err(ModelError::TokenOutOfVocab {
                index,
                token: tokens[index],
                vocab: self.cfg.vocab,
            }),
            None => Ok(()),
        }
    }

    fn check_cache(&self, cache: &KvCache) -> Result<(), ModelError> {
        let l = cache.layout();
        if l.num_layers() != self.cfg.num_layers
            || l.num_kv_heads() != self.cfg.num_kv_heads
            || l.head_dim() != self.cfg.head_dim
            || l.tokens_per_block() != self.cfg.tokens_per_block
            || l.dtype() != DType::F32
            || l.tensor_order() != TensorOrder::BlockMajor
        {
            return Err(ModelError::Blocks {
                field: "layout",
                reason: format!("cache layout {l:?} is not this model's"),
            });
        }
        Ok(())
    }

    /// Appends `tokens` to the cache (computing and writing their K/V) and
    /// returns the logits (`vocab` values) after the last one.
    ///
    /// # Errors
    /// [`ModelError::TokenOutOfVocab`], [`ModelError::Empty`] for no tokens,
    /// [`ModelError::Blocks`] (`layout`) for another model's cache. On error
    /// the cache is unchanged.
    pub fn prefill(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::Empty { field: "tokens" });
        }
        self.check_tokens(tokens)?;
        self.check_cache(cache)?;
        let mut logits = Vec::new();
        for (i, &t) in tokens.iter().enumerate() {
            let h = self.forward(cache, t);
            if i + 1 == tokens.len() {
                logits = self.logits(&h);
            }
        }
        Ok(logits)
    }

    /// Prefills `prompt` (possibly empty if the cache already holds the whole
    /// prompt but one token is required to produce logits: then the error is
    /// [`ModelError::Empty`]) and greedily decodes `max_new` tokens.
    ///
    /// Each generated token except the last is fed back (its K/V written), so
    /// afterwards the cache holds `prompt + tokens[..max_new - 1]`.
    ///
    /// # Errors
    /// As [`ReferenceModel::prefill`]; `max_new == 0` is [`ModelError::Empty`]
    /// (`max_new`).
    pub fn generate(
        &self,
        cache: &mut KvCache,
        prompt: &[u32],
        max_new: usize,
    ) -> Result<Generation, ModelError> {
        if max_new == 0 {
            return Err(ModelError::Empty { field: "max_new" });
        }
        let first_logits = self.prefill(cache, prompt)?;
        let mut tokens = vec![argmax(&first_logits)];
        while tokens.len() < max_new {
            let h = self.forward(cache, *tokens.last().expect("non-empty"));
            tokens.push(argmax(&self.logits(&h)));
        }
        Ok(Generation {
            tokens,
            first_logits,
        })
    }

    fn logits(&self, h: &[f32]) -> Vec<f32> {
        let mut x = vec![0.0; h.len()];
        rms_norm(h, &self.final_norm, &mut x);
        let mut out = vec![0.0; self.cfg.vocab as usize];
        matvec(&self.lm_head, &x, &mut out);
        out
    }

    /// Rotates pairs `(2i, 2i+1)` of one head by `pos x theta^(-2i/head_dim)`.
    fn rope(&self, v: &mut [f32], pos: usize) {
        let hd = v.len();
        for i in 0..hd / 2 {
            let freq = (self.cfg.rope_theta as f64).powf(-2.0 * i as f64 / hd as f64);
            let (s, c) = ((pos as f64) * freq).sin_cos();
            let (s, c) = (s as f32, c as f32);
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            v[2 * i] = a * c - b * s;
            v[2 * i + 1] = a * s + b * c;
        }
    }

    /// Runs one token at position `cache.len_tokens()`, appends its K/V, and
    /// returns its final hidden state (before the final norm).
    fn forward(&self, cache: &mut KvCache, token: u32) -> Vec<f32> {
        let c = &self.cfg;
        let (d, hd) = (c.d_model as usize, c.head_dim as usize);
        let (nh, nkv) = (c.num_heads as usize, c.num_kv_heads as usize);
        let group = nh / nkv;
        let pos = cache.len_tokens();
        cache.grow_to(pos + 1);
        let mut h = self.embed[token as usize * d..(token as usize + 1) * d].to_vec();
        let mut x = vec![0.0; d];
        let mut q = vec![0.0; d];
        let mut k = vec![0.0; nkv * hd];
        let mut v = vec![0.0; nkv * hd];
        let mut attn = vec![0.0; d];
        let mut o = vec![0.0; d];
        let mut scores = vec![0.0f32; pos + 1];
        let mut gate = vec![0.0; c.ffn_hidden as usize];
        let mut up = vec![0.0; c.ffn_hidden as usize];
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&h, &layer.attn_norm, &mut x);
            matvec(&layer.wq, &x, &mut q);
            matvec(&layer.wk, &x, &mut k);
            matvec(&layer.wv, &x, &mut v);
            for head in 0..nh {
                self.rope(&mut q[head * hd..(head + 1) * hd], pos);
            }
            for head in 0..nkv {
                self.rope(&mut k[head * hd..(head + 1) * hd], pos);
                cache.write(li, 0, pos, head, &k[head * hd..(head + 1) * hd]);
                cache.write(li, 1, pos, head, &v[head * hd..(head + 1) * hd]);
            }
            for head in 0..nh {
                let kvh = head / group;
                let qh = &q[head * hd..(head + 1) * hd];
                let mut max = f32::NEG_INFINITY;
                for (p, s) in scores.iter_mut().enumerate() {
                    let kp = cache.read(li, 0, p, kvh);
                    let mut dot = 0.0f32;
                    for (a, b) in qh.iter().zip(kp) {
                        dot += a * b;
                    }
                    *s = dot * scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let out = &mut attn[head * hd..(head + 1) * hd];
                out.fill(0.0);
                for (p, s) in scores.iter().enumerate() {
                    let w = s / sum;
                    for (y, vv) in out.iter_mut().zip(cache.read(li, 1, p, kvh)) {
                        *y += w * vv;
                    }
                }
            }
            matvec(&layer.wo, &attn, &mut o);
            for (a, b) in h.iter_mut().zip(&o) {
                *a += b;
            }
            rms_norm(&h, &layer.mlp_norm, &mut x);
            matvec(&layer.w_gate, &x, &mut gate);
            matvec(&layer.w_up, &x, &mut up);
            for (g, u) in gate.iter_mut().zip(&up) {
                // SiLU(g) * u (SwiGLU, Shazeer 2020).
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            matvec(&layer.w_down, &gate, &mut o);
            for (a, b) in h.iter_mut().zip(&o) {
                *a += b;
            }
        }
        cache.len_tokens = pos + 1;
        h
    }
}

/// Greedy choice: index of the largest logit, ties to the lowest index.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(n: usize, salt: u64) -> Vec<u32> {
        to_vocab(
            &crate::trace::synthetic_tokens(&[salt, salt + 1, salt + 2], n),
            256,
        )
    }

    /// Recompute everything vs import `split` sealed blocks then prefill the rest.
    fn check_split(tp: u32, split_blocks: usize, total: usize) {
        let m = ReferenceModel::new(ModelConfig::default()).unwrap();
        let p = prompt(total, 11);
        let mut full = m.new_cache(tp).unwrap();
        let off = m.generate(&mut full, &p, 6).unwrap();

        // Donor: a different cache that computed a longer conversation sharing the prefix.
        let mut donor = m.new_cache(tp).unwrap();
        let mut longer = p.clone();
        longer.extend([9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6, 7]);
        m.prefill(&mut donor, &longer).unwrap();
        let parts = donor.export_blocks(0, split_blocks).unwrap();

        let mut on = m.new_cache(tp).unwrap();
        on.import_blocks(0, &parts).unwrap();
        let split_tokens = split_blocks * 16;
        let got = m.generate(&mut on, &p[split_tokens..], 6).unwrap();
        assert_eq!(got.tokens, off.tokens, "tp{tp} split {split_blocks}");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got.first_logits),
            bits(&off.first_logits),
            "tp{tp} split {split_blocks}"
        );
        let sealed = full.sealed_blocks();
        assert_eq!(
            on.export_blocks(0, sealed).unwrap(),
            full.export_blocks(0, sealed).unwrap()
        );
    }

    #[test]
    fn imported_prefix_is_bit_identical_to_recompute_tp1_and_tp2() {
        for tp in [1, 2] {
            for split in [1, 2, 5, 7] {
                check_split(tp, split, 120);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(12))]

        /// Any prompt, any sealed split point, TP1 or TP2: importing the
        /// prefix from another cache that computed a longer sequence gives the
        /// same first logits (bitwise) and greedy tokens as recompute.
        #[test]
        fn any_split_is_bit_identical(
            salt in 0u64..1_000,
            len in 17usize..90,
            split_frac in 0.0f64..1.0,
            tp in 1u32..=2,
        ) {
            let m = ReferenceModel::new(ModelConfig::default()).unwrap();
            let p = prompt(len, salt);
            let sealed = (len - 1) / 16;
            let split = 1 + ((sealed - 1) as f64 * split_frac) as usize;
            let off = m.generate(&mut m.new_cache(tp).unwrap(), &p, 3).unwrap();
            let mut donor = m.new_cache(tp).unwrap();
            let mut longer = p.clone();
            longer.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]);
            m.prefill(&mut donor, &longer).unwrap();
            let mut on = m.new_cache(tp).unwrap();
            on.import_blocks(0, &donor.export_blocks(0, split).unwrap()).unwrap();
            let got = m.generate(&mut on, &p[split * 16..], 3).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(bits(&got.first_logits), bits(&off.first_logits));
            proptest::prop_assert_eq!(got.tokens, off.tokens);
        }
    }

    #[test]
    fn tp1_and_tp2_compute_the_same_values() {
        let m = ReferenceModel::new(ModelConfig::default()).unwrap();
        let p = prompt(50, 3);
        let mut a = m.new_cache(1).unwrap();
        let mut b = m.new_cache(2).unwrap();
        let ga = m.generate(&mut a, &p, 5).unwrap();
        let gb = m.generate(&mut b, &p, 5).unwrap();
        assert_eq!(ga, gb);
        // Rank 0 of TP2 holds KV head 0 only: its block is half the TP1 block.
        assert_eq!(
            b.export_blocks(0, 1).unwrap()[0].len() * 2,
            a.export_blocks(0, 1).unwrap()[0].len()
        );
    }

    #[test]
    fn outputs_depend_on_prefix_and_seed() {
        let m = ReferenceModel::new(ModelConfig::default()).unwrap();
        let mut a = m.new_cache(1).unwrap();
        let mut b = m.new_cache(1).unwrap();
        let la = m.prefill(&mut a, &prompt(40, 1)).unwrap();
        let lb = m.prefill(&mut b, &prompt(40, 100)).unwrap();
        assert_ne!(la, lb);
        let m2 = ReferenceModel::new(ModelConfig {
            seed: 8,
            ..ModelConfig::default()
        })
        .unwrap();
        let mut c = m2.new_cache(1).unwrap();
        assert_ne!(m2.prefill(&mut c, &prompt(40, 1)).unwrap(), la);
        // Generation is not degenerate: greedy outputs are not one repeated token.
        let g = m
            .generate(&mut m.new_cache(1).unwrap(), &prompt(40, 1), 12)
            .unwrap();
        let distinct: std::collections::HashSet<_> = g.tokens.iter().collect();
        assert!(distinct.len() > 2, "{:?}", g.tokens);
    }

    #[test]
    fn wrong_prefix_bytes_change_the_output() {
        let m = ReferenceModel::new(ModelConfig::default()).unwrap();
        let p = prompt(64, 5);
        let off = m.generate(&mut m.new_cache(1).unwrap(), &p, 4).unwrap();
        let mut other = m.new_cache(1).unwrap();
        m.prefill(&mut other, &prompt(64, 50)).unwrap();
        let mut on = m.new_cache(1).unwrap();
        on.import_blocks(0, &other.export_blocks(0, 2).unwrap())
            .unwrap();
        let got = m.generate(&mut on, &p[32..], 4).unwrap();
        assert_ne!(got.first_logits, off.first_logits);
    }

    #[test]
    fn bad_inputs_are_refused_without_changes() {
        let m = ReferenceModel::new(ModelConfig::default()).unwrap();
        let mut c = m.new_cache(1).unwrap();
        let e = m.prefill(&mut c, &[1, 2, 256]).unwrap_err();
        assert_eq!(
            e,
            ModelError::TokenOutOfVocab {
                index: 2,
                token: 256,
                vocab: 256
            }
        );
        assert_eq!(c.len_tokens(), 0);
        assert!(matches!(
            m.prefill(&mut c, &[]),
            Err(ModelError::Empty { field: "tokens" })
        ));
        m.prefill(&mut c, &prompt(20, 1)).unwrap();
        let parts = c.export_blocks(0, 1).unwrap();
        assert!(c
            .export_blocks(0, 2)
            .unwrap_err()
            .to_string()
            .contains("first_block"));
        let mut d = m.new_cache(1).unwrap();
        let e = d.import_blocks(1, &parts).unwrap_err();
        assert!(e.to_string().contains("first_block"), "{e}");
        let e = d.import_blocks(0, &[&parts[0][..100]]).unwrap_err();
        assert!(e.to_string().contains("parts[r].len"), "{e}");
        let e = m
            .new_cache(2)
            .unwrap()
            .import_blocks(0, &parts)
            .unwrap_err();
        assert!(e.to_string().contains("`parts`"), "{e}");
        assert_eq!(d.len_tokens(), 0);
        let e = m.new_cache(3).unwrap_err();
        assert!(e.to_string().contains("tp_size"), "{e}");
        let e = ModelConfig {
            d_model: 60,
            ..ModelConfig::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("d_model"), "{e}");
        let other = ReferenceModel::new(ModelConfig {
            num_layers: 2,
            ..ModelConfig::default()
        })
        .unwrap();
        let e = other
            .prefill(&mut m.new_cache(1).unwrap(), &[1])
            .unwrap_err();
        assert!(e.to_string().contains("layout"), "{e}");
    }
}
