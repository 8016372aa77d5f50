//! The discrete-event simulation itself: events, workers, the router's
//! lookup and admission, the executor's re-check, and [`run`].

use super::*;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Arrive(usize),
    Enqueue(usize, usize),
    PrefillDone(usize),
    DecodeDone(usize, usize),
}

struct Hint {
    pub(super) donor: usize,
    pub(super) fetch_from: usize,
    pub(super) blocks: usize,
}

struct PrefillWorker {
    pub(super) engine: EngineId,
    pub(super) cache: LruBlocks,
    pub(super) queue: VecDeque<usize>,
    pub(super) running: Option<usize>,
    pub(super) busy_until_us: f64,
    pub(super) queued_est_us: f64,
}

struct DecodeWorker {
    pub(super) engine: EngineId,
    pub(super) bank: LruBlocks,
    pub(super) active: u32,
    pub(super) next_event_id: u64,
}

/// Time as integer nanoseconds for a total order in the event heap.
fn ns(us: f64) -> u64 {
    (us * 1000.0).round() as u64
}

fn validate(w: &Workload, opts: &ReplayOptions) -> Result<(), ReplayError> {
    let c = &opts.cluster;
    let opt = |field, reason: &str| {
        Err(ReplayError::Option {
            field,
            reason: reason.to_string(),
        })
    };
    if c.prefill_workers == 0 || c.decode_workers == 0 {
        return opt(
            "cluster.prefill_workers",
            "prefill and decode workers must be at least 1",
        );
    }
    if c.prefill_workers + c.decode_workers > 4096 {
        return opt(
            "cluster.prefill_workers",
            "at most 4,096 workers in all (kv-lookup MAX_WORKERS)",
        );
    }
    if c.tokens_per_block != w.tokens_per_block {
        return Err(ReplayError::Option {
            field: "cluster.tokens_per_block",
            reason: format!(
                "{} but the workload was hashed at {}",
                c.tokens_per_block, w.tokens_per_block
            ),
        });
    }
    let t = &opts.timing;
    for (field, v) in [
        ("timing.prefill_us_per_token", t.prefill_us_per_token),
        ("timing.prefill_us_per_token_sq", t.prefill_us_per_token_sq),
        ("timing.transfer_us_per_block", t.transfer_us_per_block),
        ("timing.fetch_setup_us", t.fetch_setup_us),
        ("timing.lookup_us", t.lookup_us),
        ("timing.decode_us_per_token", t.decode_us_per_token),
    ] {
        if !(v >= 0.0 && v.is_finite()) {
            return Err(ReplayError::Option {
                field,
                reason: format!("must be finite and non-negative, got {v}"),
            });
        }
    }
    let bs = w.tokens_per_block as usize;
    for (index, r) in w.requests.iter().enumerate() {
        let bad = |field, reason: String| {
            Err(ReplayError::Request {
                index,
                field,
                reason,
            })
        };
        if r.prompt_tokens == 0 {
            return bad("prompt_tokens", "must be at least 1".into());
        }
        let want = (r.prompt_tokens as usize + r.output_tokens as usize) / bs;
        if r.blocks.len() != want {
            return bad(
                "blocks",
                format!(
                    "{} blocks, (prompt + output) / tokens_per_block = {want}",
                    r.blocks.len()
                ),
            );
        }
        if let Some(p) = r.parent {
            if p >= index {
                return bad("parent", format!("{p} is not an earlier request"));
            }
        }
    }
    Ok(())
}

/// The simulation state of one run.
struct Sim<'a> {
    pub(super) reqs: &'a [ReplayRequest],
    pub(super) opts: ReplayOptions,
    pub(super) cost: CostModel,
    pub(super) reuse: bool,
    pub(super) bs: usize,
    pub(super) fp: kv_descriptor::LayoutFingerprint,
    pub(super) index: InventoryIndex,
    pub(super) prefill: Vec<PrefillWorker>,
    pub(super) decode: Vec<DecodeWorker>,
    pub(super) heap: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    pub(super) seq: u64,
    pub(super) arrival_us: Vec<f64>,
    pub(super) est_us: Vec<f64>,
    pub(super) hints: Vec<Option<Hint>>,
    /// Lookup latency charged to each request (0 when none ran).
    pub(super) lookup_us: Vec<f64>,
    pub(super) ttft_ms: Vec<f64>,
    pub(super) m: RunMetrics,
}

impl<'a> Sim<'a> {
    pub(super) fn push(&mut self, at_us: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((ns(at_us), self.seq, ev)));
    }

    /// Prompt blocks that may come from a cache: all full prompt blocks,
    /// except that the last prompt token is always computed (it yields the
    /// first output token).
    pub(super) fn reusable(&self, r: &ReplayRequest) -> usize {
        ((r.prompt_tokens as usize - 1) / self.bs).min(r.blocks.len())
    }

    pub(super) fn arrive(&mut self, i: usize, now: f64) {
        let reqs = self.reqs;
        let r = &reqs[i];
        let t = self.opts.timing;
        let bs = self.bs;
        self.arrival_us[i] = now;
        let max_b = self.reusable(r);
        let prompt = &r.blocks[..max_b];
        // Router: earliest estimated finish over prefill workers.
        let mut best = (f64::INFINITY, 0usize, 0usize, 0.0);
        for (w, pw) in self.prefill.iter().enumerate() {
            let hit = pw.cache.prefix_len(prompt);
            let backlog = (pw.busy_until_us - now).max(0.0) + pw.queued_est_us;
            let cached = (hit * bs) as u64;
            let est = t.prefill_us(cached, u64::from(r.prompt_tokens) - cached);
            if backlog + est < best.0 {
                best = (backlog + est, w, hit, est);
            }
        }
        let (_, w, hit, est) = best;
        self.est_us[i] = est;
        if self.reuse && max_b > 0 {
            self.plan_fetch(i, w, hit, prompt);
        }
        self.prefill[w].queued_est_us += est;
        if self.lookup_us[i] > 0.0 {
            // The request reaches the worker once the router's lookup is done.
            self.push(now + self.lookup_us[i], Ev::Enqueue(i, w));
        } else {
            self.enqueue(i, w, now);
        }
    }

    pub(super) fn enqueue(&mut self, i: usize, w: usize, now: f64) {
        let pw = &mut self.prefill[w];
        pw.queue.push_back(i);
        if pw.running.is_none() {
            self.start_next(w, now);
        }
    }

    /// Bounded donor lookup and admission for request `i` routed to `w`,
    /// whose native cache holds `hit` blocks of `prompt`.
    pub(super) fn plan_fetch(&mut self, i: usize, w: usize, hit: usize, prompt: &[StoredBlock]) {
        let hashes: Vec<SequenceHash> = prompt.iter().map(|b| b.sequence_hash).collect();
        let out = self
            .index
            .lookup(&hashes, self.prefill[w].engine, LookupBudget::default());
        self.lookup_us[i] = self.opts.timing.lookup_us;
        let Ok(d) = out.donor else {
            return;
        };
        let k = d.blocks as usize;
        if k <= hit {
            return;
        }
        self.m.donor_found += 1;
        let blocks = (k - hit) as u64;
        let decision = self.cost.admit(
            "replay",
            CostInputs {
                reused_tokens: blocks * self.bs as u64,
                transfer_blocks: blocks,
                path: TransferPath::Gpu,
                lookup_us: self.opts.timing.lookup_us,
            },
        );
        if decision.admitted() {
            let donor = self
                .decode
                .iter()
                .position(|x| x.engine == d.engine)
                .expect("every donor the index returns was registered");
            self.hints[i] = Some(Hint {
                donor,
                fetch_from: hit,
                blocks: k,
            });
        } else {
            self.m.refused_by_cost += 1;
        }
    }

    /// Starts the next queued request on idle prefill worker `w`: resolves its
    /// native hit and hint against the truth at this instant, charges the time.
    pub(super) fn start_next(&mut self, w: usize, now: f64) {
        let t = self.opts.timing;
        let bs = self.bs;
        let Some(i) = self.prefill[w].queue.pop_front() else {
            return;
        };
        let reqs = self.reqs;
        let r = &reqs[i];
        let max_b = self.reusable(r);
        let pw = &mut self.prefill[w];
        pw.queued_est_us -= self.est_us[i];
        if pw.queue.is_empty() {
            pw.queued_est_us = 0.0; // drop accumulated rounding error
        }
        let prompt = &r.blocks[..max_b];
        let native = pw.cache.prefix_len(prompt);
        let mut reused = native;
        let mut service = 0.0;
        if let Some(h) = self.hints[i].take() {
            if native >= h.blocks {
                // The native cache caught up while queued: nothing to fetch.
            } else if native >= h.fetch_from
                && prompt[native..h.blocks]
                    .iter()
                    .all(|b| self.decode[h.donor].bank.contains(&b.sequence_hash))
            {
                let blocks = h.blocks - native;
                service += t.fetch_setup_us + blocks as f64 * t.transfer_us_per_block;
                self.m.fetches += 1;
                self.m.donor_hit_tokens += (blocks * bs) as u64;
                self.m.bytes_moved += (blocks * bs) as u64 * t.kv_bytes_per_token;
                reused = h.blocks;
            } else {
                service += t.fetch_setup_us;
                self.m.fetch_fallbacks += 1;
            }
        }
        let cached = (reused * bs) as u64;
        let computed = u64::from(r.prompt_tokens) - cached;
        self.m.native_hit_tokens += (native * bs) as u64;
        self.m.prefill_tokens += computed;
        service += t.prefill_us(cached, computed);
        pw.running = Some(i);
        pw.busy_until_us = now + service;
        self.push(now + service, Ev::PrefillDone(w));
    }

    pub(super) fn prefill_done(&mut self, w: usize, now: f64) {
        let i = self.prefill[w].running.take().expect("a running request");
        let reqs = self.reqs;
        let r = &reqs[i];
        self.ttft_ms[i] = (now - self.arrival_us[i]) / 1000.0;
        let prompt_blocks = r.prompt_tokens as usize / self.bs;
        self.prefill[w].cache.insert(&r.blocks[..prompt_blocks]);
        let d = (0..self.decode.len())
            .min_by_key(|&d| (self.decode[d].active, d))
            .expect("at least one decode worker");
        self.decode[d].active += 1;
        let done = now + f64::from(r.output_tokens) * self.opts.timing.decode_us_per_token;
        self.push(done, Ev::DecodeDone(i, d));
        self.start_next(w, now);
    }

    pub(super) fn decode_done(&mut self, i: usize, d: usize, now: f64) -> Result<(), ReplayError> {
        let dw = &mut self.decode[d];
        dw.active -= 1;
        self.m.makespan_s = self.m.makespan_s.max(now / 1e6);
        if !self.reuse {
            return Ok(());
        }
        let (added, evicted) = dw.bank.insert(&self.reqs[i].blocks);
        // Removals first: the index must never see more than the bank holds.
        let removed = (!evicted.is_empty()).then_some(KvEventData::Removed {
            sequence_hashes: evicted,
        });
        let stored = (!added.is_empty()).then_some(KvEventData::Stored {
            parent: None,
            blocks: added,
        });
        for data in [removed, stored].into_iter().flatten() {
            let e = KvEvent {
                publisher: dw.engine,
                event_id: dw.next_event_id,
                role: Role::Decode,
                layout_fingerprint: self.fp,
                tp_size: 1,
                tier: StorageTier::RetainedGpuDirect,
                data,
            };
            dw.next_event_id += 1;
            self.index
                .apply_event(&e)
                .map_err(|e| ReplayError::Option {
                    field: "cluster",
                    reason: e.to_string(),
                })?;
        }
        Ok(())
    }
}

/// Replays `workload` once, with reuse OFF (`reuse = false`) or ON.
///
/// # Errors
/// [`ReplayError`] naming the option or request field that is out of range;
/// nothing runs then.
pub fn run(
    workload: &Workload,
    opts: &ReplayOptions,
    reuse: bool,
) -> Result<RunMetrics, ReplayError> {
    validate(workload, opts)?;
    let c = opts.cluster;
    let layout = KvLayout::new(
        32,
        8,
        128,
        DType::Bf16,
        c.tokens_per_block,
        TensorOrder::BlockMajor,
        1,
    )
    .map_err(|e| ReplayError::Option {
        field: "cluster.tokens_per_block",
        reason: e.to_string(),
    })?;
    let reqs = &workload.requests;
    let n = reqs.len();
    let cost = CostModel::new(opts.admission.clone(), c.tokens_per_block).map_err(|e| {
        ReplayError::Option {
            field: "admission",
            reason: e.to_string(),
        }
    })?;
    let mut sim = Sim {
        reqs,
        opts: opts.clone(),
        cost,
        reuse,
        bs: c.tokens_per_block as usize,
        fp: layout.fingerprint(),
        index: InventoryIndex::with_capacity(if reuse {
            c.decode_bank_blocks as usize * c.decode_workers as usize
        } else {
            0
        }),
        prefill: (0..c.prefill_workers)
            .map(|_| PrefillWorker {
                engine: EngineId::fresh(),
                cache: LruBlocks::new(c.prefill_cache_blocks as usize),
                queue: VecDeque::new(),
                running: None,
                busy_until_us: 0.0,
                queued_est_us: 0.0,
            })
            .collect(),
        decode: (0..c.decode_workers)
            .map(|_| DecodeWorker {
                engine: EngineId::fresh(),
                bank: LruBlocks::new(c.decode_bank_blocks as usize),
                active: 0,
                next_event_id: 1,
            })
            .collect(),
        heap: BinaryHeap::new(),
        seq: 0,
        arrival_us: vec![0.0; n],
        est_us: vec![0.0; n],
        hints: (0..n).map(|_| None).collect(),
        lookup_us: vec![0.0; n],
        ttft_ms: vec![0.0; n],
        m: RunMetrics {
            reuse,
            requests: n as u64,
            prompt_tokens: reqs.iter().map(|r| u64::from(r.prompt_tokens)).sum(),
            prefill_tokens: 0,
            native_hit_tokens: 0,
            donor_hit_tokens: 0,
            bytes_moved: 0,
            donor_found: 0,
            refused_by_cost: 0,
            fetch_fallbacks: 0,
            fetches: 0,
            ttft_ms: Vec::new(),
            ttft_p50_ms: 0.0,
            ttft_p90_ms: 0.0,
            ttft_p99_ms: 0.0,
            ttft_mean_ms: 0.0,
            later_turn_ttft_mean_ms: 0.0,
            makespan_s: 0.0,
        },
    };
    let workers = sim
        .prefill
        .iter()
        .map(|p| (p.engine, Role::Prefill))
        .chain(sim.decode.iter().map(|d| (d.engine, Role::Decode)));
    for (k, (engine, role)) in workers.enumerate() {
        let info = WorkerInfo {
            engine,
            role,
            layout_fingerprint: sim.fp,
            tp_size: 1,
        };
        sim.index
            .register_worker(WorkerKey(k as u64), info)
            .map_err(|e| ReplayError::Option {
                field: "cluster",
                reason: e.to_string(),
            })?;
    }
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, r) in reqs.iter().enumerate() {
        match r.parent {
            Some(p) => children[p].push(i),
            None => sim.push(r.arrival_us, Ev::Arrive(i)),
        }
    }
    let bar = if opts.progress {
        let b = ProgressBar::new(n as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} ({eta})",
            )
            .expect("static template"),
        );
        b.set_message(format!(
            "{} reuse {}",
            workload.name,
            if reuse { "ON " } else { "OFF" }
        ));
        b
    } else {
        ProgressBar::hidden()
    };
    while let Some(Reverse((now_ns, _, ev))) = sim.heap.pop() {
        let now = now_ns as f64 / 1000.0;
        match ev {
            Ev::Arrive(i) => sim.arrive(i, now),
            Ev::Enqueue(i, w) => sim.enqueue(i, w, now),
            Ev::PrefillDone(w) => {
                sim.prefill_done(w, now);
                bar.inc(1);
            }
            Ev::DecodeDone(i, d) => {
                sim.decode_done(i, d, now)?;
                for &c in &children[i] {
                    sim.push(now + reqs[c].arrival_us, Ev::Arrive(c));
                }
            }
        }
    }
    bar.finish_and_clear();
    let ttft = std::mem::take(&mut sim.ttft_ms);
    let mut m = sim.m;
    m.ttft_p50_ms = percentile(&ttft, 0.50).unwrap_or(0.0);
    m.ttft_p90_ms = percentile(&ttft, 0.90).unwrap_or(0.0);
    m.ttft_p99_ms = percentile(&ttft, 0.99).unwrap_or(0.0);
    m.ttft_mean_ms = ttft.iter().sum::<f64>() / n.max(1) as f64;
    let later: Vec<f64> = reqs
        .iter()
        .zip(&ttft)
        .filter(|(r, _)| r.turn > 0)
        .map(|(_, t)| *t)
        .collect();
    m.later_turn_ttft_mean_ms = if later.is_empty() {
        0.0
    } else {
        later.iter().sum::<f64>() / later.len() as f64
    };
    m.ttft_ms = ttft;
    Ok(m)
}
