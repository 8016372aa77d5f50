//! Decoders never panic: random bytes, mutated valid encodings, hostile
//! nesting, and a replay of the cargo-fuzz corpus (so the fuzz findings are
//! regression tests on stable Rust too).

#[path = "../../../fuzz/src/checks.rs"]
mod checks;
#[path = "../../../fuzz/src/seeds.rs"]
mod seeds;

use std::path::Path;

use kv_descriptor::*;
use proptest::prelude::*;

/// One edit of an encoding.
#[derive(Debug, Clone)]
enum Mutation {
    Set(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
    /// Copy a run of the input over another place (splices structure).
    Splice {
        from: usize,
        to: usize,
        len: usize,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Byte values biased to MessagePack markers that change structure.
    let byte = prop_oneof![
        any::<u8>(),
        prop::sample::select(vec![
            0x00, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xc0, 0xc2, 0xc3, 0xc4, 0xcc, 0xcf, 0xd9, 0xdc,
            0xdd, 0xde, 0xdf, 0xff
        ])
    ];
    prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), byte).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Remove),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<usize>(), 1usize..16).prop_map(|(from, to, len)| Mutation::Splice {
            from,
            to,
            len
        }),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len().max(1);
    match *m {
        Mutation::Set(i, b) if !bytes.is_empty() => bytes[i % n] = b,
        Mutation::Insert(i, b) => bytes.insert(i % (bytes.len() + 1), b),
        Mutation::Remove(i) if !bytes.is_empty() => {
            bytes.remove(i % n);
        }
        Mutation::Truncate(i) => bytes.truncate(i % n),
        Mutation::Splice { from, to, len } if !bytes.is_empty() => {
            let from = from % n;
            let run: Vec<u8> = bytes[from..(from + len).min(bytes.len())].to_vec();
            let to = to % n;
            for (k, b) in run.into_iter().enumerate() {
                if to + k < bytes.len() {
                    bytes[to + k] = b;
                }
            }
        }
        _ => {}
    }
}

fn all_seeds() -> Vec<Vec<u8>> {
    seeds::by_target()
        .into_iter()
        .flat_map(|(_, s)| s)
        .collect()
}

#[test]
fn seeds_are_accepted_by_their_decoder() {
    // Guards the mutation tests: mutating garbage would prove little.
    for s in seeds::descriptors() {
        BankDescriptor::from_wire(&s).unwrap();
    }
    for s in seeds::manifests() {
        BankManifest::from_wire(&s).unwrap();
    }
    assert_eq!(
        HintEnvelope::from_wire(&seeds::hints()[0])
            .unwrap()
            .fetch_gpu_actions()
            .unwrap(),
        vec![seeds::fetch_hint()]
    );
    for s in seeds::events() {
        KvEvent::from_wire(&s).unwrap();
    }
    // Every pin stream cuts into frames that all decode, one direction or the other.
    for s in seeds::pin_streams() {
        let mut rest = &s[..];
        let mut frames = 0;
        while !rest.is_empty() {
            let (body, used) = split_pin_frame(rest).unwrap().expect("whole frames only");
            assert!(
                PinClientMessage::from_wire(body).is_ok()
                    || PinDonorMessage::from_wire(body).is_ok()
            );
            rest = &rest[used..];
            frames += 1;
        }
        assert!(frames >= 1);
    }
}

#[test]
fn hostile_nesting_is_refused_without_overflowing_the_stack() {
    for marker in [0x91u8, 0x81] {
        // 100k levels of one-element arrays (or maps keyed by the next level).
        let bytes = vec![marker; 100_000];
        let e = HintEnvelope::from_wire(&bytes).unwrap_err();
        assert!(matches!(e, DescriptorError::Decode { .. }), "{e:?}");
        checks::all(&bytes);
    }
    // Deep nesting inside an otherwise valid envelope's payload.
    let mut v = rmpv::Value::Nil;
    for _ in 0..(MAX_WIRE_DEPTH + 4) {
        v = rmpv::Value::Array(vec![v]);
    }
    let mut env = HintEnvelope::fetch_gpu("m", "a", &seeds::fetch_hint()).unwrap();
    env.actions[0].payload.insert("extra".into(), v);
    let bytes = env.to_wire().unwrap();
    let e = HintEnvelope::from_wire(&bytes).unwrap_err();
    assert!(e.to_string().contains("depth"), "{e}");
}

#[test]
fn huge_declared_lengths_do_not_allocate() {
    // array32 / map32 / bin32 / str32 claiming 4 Gi entries with no data.
    for head in [
        [0xdd, 0xff, 0xff, 0xff, 0xff],
        [0xdf, 0xff, 0xff, 0xff, 0xff],
        [0xc6, 0xff, 0xff, 0xff, 0xff],
        [0xdb, 0xff, 0xff, 0xff, 0xff],
    ] {
        checks::all(&head);
        assert!(KvEvent::from_wire(&head).is_err());
    }
}

#[test]
fn fuzz_corpus_replays_cleanly() {
    // Replays whatever cargo-fuzz left (corpus and crash artifacts), so a
    // crash found on nightly stays a failing test on stable until fixed.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut replayed = 0;
    for sub in ["corpus", "artifacts"] {
        let Ok(targets) = std::fs::read_dir(root.join(sub)) else {
            continue;
        };
        for target in targets.flatten() {
            let name = target.file_name().to_string_lossy().into_owned();
            for file in std::fs::read_dir(target.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let data = std::fs::read(file.path()).unwrap();
                match name.as_str() {
                    "descriptor" => checks::descriptor(&data),
                    "manifest" => checks::manifest(&data),
                    "hint" => checks::hint(&data),
                    "event" => checks::event(&data),
                    "pin_control" => checks::pin_control(&data),
                    _ => checks::all(&data),
                }
                replayed += 1;
            }
        }
    }
    println!("replayed {replayed} corpus files");
    // The committed seed corpus is at least the seeds.
    assert!(
        replayed >= all_seeds().len(),
        "only {replayed} corpus files under {}",
        root.display()
    );
}

#[test]
fn regression_inputs_reach_the_check_they_guard() {
    // `regress-layout-overflow`: a seed whose layouts say 2^31 layers and
    // 2^31 tokens per block (the product passes u64). It panicked the
    // decoder in debug builds; now the layout is refused by name. Guards
    // against a corpus edit that stops the input reaching that check.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let read =
        |target: &str| std::fs::read(dir.join(target).join("regress-layout-overflow")).unwrap();
    let e = BankDescriptor::from_wire(&read("descriptor")).unwrap_err();
    assert!(e.to_string().contains("invalid `layout`"), "{e}");
    let e = BankManifest::from_wire(&read("manifest")).unwrap_err();
    assert!(e.to_string().contains("invalid `layout`"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        checks::all(&bytes);
    }

    #[test]
    fn mutated_encodings_never_panic(seed in 0usize..64, edits in proptest::collection::vec(mutation(), 1..6)) {
        let seeds = all_seeds();
        let mut bytes = seeds[seed % seeds.len()].clone();
        for m in &edits {
            apply(&mut bytes, m);
        }
        checks::all(&bytes);
    }

    /// Any accepted mutation of a descriptor still carries a matching checksum
    /// of its validated content (checked inside `checks::descriptor`), and a
    /// single-byte change to a descriptor is never silently accepted as the
    /// same descriptor with different bytes.
    #[test]
    fn single_byte_edits_of_descriptors(seed in 0usize..4, at in any::<usize>(), value in any::<u8>()) {
        let orig = &seeds::descriptors()[seed];
        let mut bytes = orig.clone();
        let i = at % bytes.len();
        prop_assume!(bytes[i] != value);
        bytes[i] = value;
        if let Ok(d) = BankDescriptor::from_wire(&bytes) {
            // Only a re-spelling of the same content may pass (e.g. an integer
            // re-encoded in another width is impossible in one byte, a map key
            // order change too): the decoded value must equal the original.
            prop_assert_eq!(d, BankDescriptor::from_wire(orig).unwrap());
        }
    }
}
