//! Unit tests of the CUDA backend's host logic (no device needed).

use super::*;
use crate::plan::CopyRun;

fn run(blocks: u32) -> CopyRun {
    CopyRun {
        src_block: 0,
        dst_block: 0,
        blocks,
        src_offset: 0,
        dst_offset: 0,
        len: u64::from(blocks),
    }
}

#[test]
fn launch_batches_cover_every_run_within_the_block_cap() {
    let runs: Vec<CopyRun> = [3, 4, 1, 9, 2].into_iter().map(run).collect();
    let b = launch_batches(&runs, 8);
    let sizes: Vec<Vec<u32>> = b
        .iter()
        .map(|s| s.iter().map(|r| r.blocks).collect())
        .collect();
    assert_eq!(sizes, [vec![3, 4, 1], vec![9], vec![2]]);
    assert_eq!(launch_batches(&runs, 1 << 16).len(), 1);
    assert!(launch_batches(&[], 8).is_empty());
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let v: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, x)| (k.to_string(), x.to_string()))
        .collect();
    move |k| v.iter().find(|(n, _)| n == k).map(|(_, x)| x.clone())
}

#[test]
fn upload_variant_and_pipeline_come_from_the_environment_by_name() {
    assert_eq!(
        upload_from_env(env(&[])).unwrap(),
        (GatherUpload::Pipelined2, Pipeline::default())
    );
    for (v, want) in [
        ("params", GatherUpload::Params),
        ("pipelined", GatherUpload::Pipelined),
        ("pipelined2", GatherUpload::Pipelined2),
        ("copy", GatherUpload::Copy),
    ] {
        assert_eq!(upload_from_env(env(&[(UPLOAD_ENV, v)])).unwrap().0, want);
    }
    // Neither value is the default (16 MiB, 4): the override shows.
    let (_, p) = upload_from_env(env(&[
        (PIPELINE_FIRST_ENV, "32768"),
        (PIPELINE_GROWTH_ENV, "3"),
    ]))
    .unwrap();
    assert_eq!((p.first_bytes(), p.growth()), (32 << 20, 3));
    assert_ne!(p.first_bytes(), Pipeline::default().first_bytes());
    for (pairs, name) in [
        ([(UPLOAD_ENV, "mapped")], UPLOAD_ENV),
        ([(PIPELINE_FIRST_ENV, "8M")], PIPELINE_FIRST_ENV),
        ([(PIPELINE_FIRST_ENV, "32")], PIPELINE_FIRST_ENV),
        ([(PIPELINE_GROWTH_ENV, "1")], PIPELINE_GROWTH_ENV),
    ] {
        let e = upload_from_env(env(&pairs)).unwrap_err().to_string();
        assert!(e.contains(name), "{e}");
    }
}
