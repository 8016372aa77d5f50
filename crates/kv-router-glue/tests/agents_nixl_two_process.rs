//! A fetch over NIXL between two processes (DRAM): a donor process (this
//! test binary re-run as `donor_process`) opens a donor agent, stores a
//! prompt, registers its bank with its NIXL agent and hands its directory
//! record and a hint to the target (this process) through files (standing
//! in for a shared directory); the target addresses its NIXL READs from the
//! record alone (its `nixl_rank_regions`), reads the pinned slots and gets
//! the donor's bytes; the same record with two ranks' regions swapped
//! falls back at `verify` (block checksums). Then the donor process is SIGKILLed: the next
//! fetch (its record still in the directory, as after a crash) falls back
//! typed, completes nothing and leaves no target row taken and no read in
//! flight.
//!
//! Skips (printing why) when `libnixl_capi.so` is not loadable (run with the
//! environment of `cargo xtask install`), except under `CI=true`, where a
//! missing runtime fails the test.

mod agents_common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agents_common::*;
use kv_bank::{BankMemory, DestinationPool};
use kv_descriptor::{EngineId, HintEnvelope, Wire};
use kv_router_glue::*;
use kv_transfer::nixl::{runtime_status, NixlAgent, NixlBackend, NixlMode};
use kv_transfer::{DeliveryControl, HostBuffer};

/// Where the donor process writes its hand-off files.
const CHILD_DIR: &str = "KV_NIXL_DONOR_DIR";

fn runtime_or_skip(test: &str) -> bool {
    match runtime_status() {
        Ok(()) => true,
        Err(e) if kv_transfer::ci_requires() => panic!("CI and {e}"),
        Err(e) => {
            println!("SKIP {test}: {e}");
            false
        }
    }
}

/// The donor's side; runs only as the child of
/// `a_fetch_reads_another_process_over_nixl_and_falls_back_once_it_is_killed`
/// (ignored otherwise). Writes `record`, `hint`, then `ready`, and
/// serves pins until killed.
#[test]
#[ignore = "the donor process of the two-process NIXL test"]
fn donor_process() {
    let Some(out) = std::env::var_os(CHILD_DIR).map(PathBuf::from) else {
        panic!("{CHILD_DIR} unset: run by the two-process test only");
    };
    serial(|| async move {
        let ep = format!("unix:{}", out.join("d0.sock").display());
        let plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
        let dir = Arc::new(InProcessDirectory::new());
        let target_id = EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;
        let donor = DonorAgent::open(donor_config("decode-0", &ep), dir.clone(), plane.clone())
            .await
            .unwrap();
        let nixl = NixlAgent::new("kv-two-process-donor").unwrap();
        for r in 0..TP {
            nixl.register(donor.bank().rank(r).unwrap().memory().as_ref())
                .unwrap();
        }
        donor
            .publish_nixl_agent(nixl.name().into(), nixl.metadata().unwrap())
            .await
            .unwrap();
        store(&donor, &prompt(0)).await;
        router.pump().await;
        let env = router
            .advisor
            .advise("r1", &hashes(&prompt(0)), target_id)
            .hint
            .expect("hint attached");
        let record = donor.record(unix_now_ms()).unwrap();
        std::fs::write(out.join("record"), record.to_wire().unwrap()).unwrap();
        std::fs::write(out.join("hint"), env.to_wire().unwrap()).unwrap();
        std::fs::write(out.join("ready"), b"").unwrap();
        // Serve pins until the parent kills this process.
        tokio::time::sleep(Duration::from_secs(120)).await;
        drop((donor, nixl));
    });
}

fn spawn_donor(dir: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "donor_process", "--nocapture"])
        .env(CHILD_DIR, dir)
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

fn wait_ready(dir: &Path, child: &mut Child) {
    let t0 = Instant::now();
    while !dir.join("ready").exists() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the donor process exited early: {st}");
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "donor not ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What the donor process handed over: its record and a hint.
struct Handoff {
    record: DonorRecord,
    env: HintEnvelope,
}

fn read_handoff(dir: &Path) -> Handoff {
    Handoff {
        record: DonorRecord::decode(&std::fs::read(dir.join("record")).unwrap()).unwrap(),
        env: HintEnvelope::from_wire(&std::fs::read(dir.join("hint")).unwrap()).unwrap(),
    }
}

/// A target agent resolving from `dir`, its executor on a NIXL backend over
/// `agent` with TP host rows registered with it.
async fn nixl_target(
    dir: Arc<InProcessDirectory>,
    agent: &Arc<NixlAgent>,
) -> (TargetAgent, Vec<Arc<HostBuffer>>) {
    let rows: Vec<Arc<HostBuffer>> = (0..TP)
        .map(|_| Arc::new(HostBuffer::zeroed(ROWS as usize * rbb()).unwrap()))
        .collect();
    for r in &rows {
        agent.register(r.as_ref()).unwrap();
    }
    let exec = FetchExecutor::new(
        layout(),
        DestinationPool::new(ROWS),
        rows.iter()
            .map(|b| b.clone() as Arc<dyn BankMemory>)
            .collect(),
        ROWS,
        Arc::new(NixlBackend::new(agent.clone(), NixlMode::Runs)),
    )
    .unwrap();
    (TargetAgent::connect(exec, dir, None).await.unwrap(), rows)
}

/// A NIXL donor source that SIGKILLs the donor process right after its pin
/// was granted: the READ then runs against a dead NIXL agent.
struct KillAfterPin<'c> {
    inner: RemoteDonor,
    child: std::cell::RefCell<&'c mut Child>,
}

impl DonorSource for KillAfterPin<'_> {
    fn manifest(&self) -> &kv_descriptor::BankManifest {
        self.inner.manifest()
    }
    fn pin<'a>(
        &'a self,
        hint: &kv_descriptor::FetchGpuHint,
    ) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        let pin = self.inner.pin(hint)?;
        let mut child = self.child.borrow_mut();
        child.kill().unwrap();
        child.wait().unwrap();
        Ok(pin)
    }
}

#[test]
fn a_donor_killed_between_pin_and_nixl_read_falls_back_with_nothing_completed() {
    if !runtime_or_skip(
        "a_donor_killed_between_pin_and_nixl_read_falls_back_with_nothing_completed",
    ) {
        return;
    }
    let files = tempfile::tempdir().unwrap();
    let mut child = spawn_donor(files.path());
    wait_ready(files.path(), &mut child);
    let Handoff { record, env } = read_handoff(files.path());
    let h = hashes(&prompt(0));
    serial(|| async {
        let dir = Arc::new(InProcessDirectory::new());
        dir.put(&record).await.unwrap();
        let agent = Arc::new(NixlAgent::new("kv-two-process-target-kill").unwrap());
        let (tgt, _rows) = nixl_target(dir.clone(), &agent).await;
        let name = tgt.load_donor_nixl(record.engine_id(), &agent).unwrap();
        let regions = record
            .nixl_rank_regions()
            .expect("the donor publishes its rank regions")
            .iter()
            .map(|r| kv_transfer::NixlRemoteRegion {
                agent_name: name.clone(),
                base_addr: r.base_addr,
                len: r.len,
                kind: r.memory_kind(),
            })
            .collect();
        let donor = KillAfterPin {
            inner: RemoteDonor::open_nixl(
                record.manifest().clone(),
                regions,
                record.pin_endpoint(),
            )
            .unwrap(),
            child: std::cell::RefCell::new(&mut child),
        };
        let control = DeliveryControl::with_timeout(Duration::from_secs(5));
        let r = tgt
            .executor()
            .execute_for_prompt(&env, &h, &donor, &control);
        match r {
            Ok(out) => panic!("a false completion from a killed donor: {:?}", out.fetched),
            Err(
                e @ FetchError::Fallback {
                    stage: "transfer", ..
                },
            ) => {
                println!("fallback after SIGKILL mid-fetch: {e}")
            }
            Err(e) => panic!("expected a fallback at `transfer`, got {e:?}"),
        }
        // Rows of a read still in flight come back once it has ended.
        let t0 = Instant::now();
        while tgt.executor().pool().free_blocks() < ROWS as usize {
            tgt.executor().reclaim_quiesced();
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "rows never came back"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(tgt.executor().backend_in_flight(), 0);
    });
}

#[test]
fn a_fetch_reads_another_process_over_nixl_and_falls_back_once_it_is_killed() {
    if !runtime_or_skip("a_fetch_reads_another_process_over_nixl_and_falls_back_once_it_is_killed")
    {
        return;
    }
    let files = tempfile::tempdir().unwrap();
    let mut child = spawn_donor(files.path());
    wait_ready(files.path(), &mut child);
    let Handoff { record, env } = read_handoff(files.path());
    let h = hashes(&prompt(0));

    serial(|| async {
        let dir = Arc::new(InProcessDirectory::new());
        dir.put(&record).await.unwrap();
        let agent = Arc::new(NixlAgent::new("kv-two-process-target").unwrap());
        let (tgt, rows) = nixl_target(dir.clone(), &agent).await;

        // The regions come from the donor process's own record.
        let regions = record.nixl_rank_regions().expect("published");
        assert_eq!(regions.len(), TP as usize);
        assert!(regions
            .iter()
            .all(|r| r.base_addr != 0 && r.mem == NixlMemKind::Dram));
        let out = tgt
            .fetch_nixl(&env, &h, &agent, &DeliveryControl::new())
            .unwrap();
        assert_eq!(out.fetched.len(), BLOCKS);
        assert_eq!(out.report.counters.backend, "nixl");
        assert_eq!(
            out.report.counters.bytes,
            (BLOCKS * TP as usize * rbb()) as u64
        );
        assert_rows_hold(&rows, &out);
        drop(out);
        assert_eq!(tgt.executor().pool().free_blocks(), ROWS as usize);

        // The same record with its ranks' regions swapped (both registered
        // by the donor process's agent): the READs succeed, the bytes are
        // the other rank's, and the grant's checksums refuse them.
        let mut swapped = regions.to_vec();
        swapped.swap(0, 1);
        dir.put(
            &DonorRecord::new(DonorRecordParts {
                nixl_rank_regions: Some(swapped),
                ..record.to_parts()
            })
            .unwrap(),
        )
        .await
        .unwrap();
        match tgt.fetch_nixl(&env, &h, &agent, &DeliveryControl::new()) {
            Err(AgentError::Fetch(FetchError::Fallback {
                stage: "verify",
                cause: FallbackCause::BlockChecksum(BlockChecksumError::Mismatch { rank: 0, .. }),
            })) => {}
            Ok(_) => panic!("another rank's bytes completed as a fetch"),
            Err(e) => panic!("expected a checksum fallback at verify, got {e:?}"),
        }
        assert_eq!(tgt.executor().pool().free_blocks(), ROWS as usize);
        dir.put(&record).await.unwrap();

        // SIGKILL: no close, the record stays in the directory.
        child.kill().unwrap();
        child.wait().unwrap();
        let mut completed = 0;
        for _ in 0..3 {
            let control = DeliveryControl::with_timeout(Duration::from_secs(5));
            match tgt.fetch_nixl(&env, &h, &agent, &control) {
                Ok(_) => completed += 1,
                Err(AgentError::Fetch(e @ FetchError::Fallback { stage: "pin", .. })) => {
                    println!("fallback after SIGKILL: {e}")
                }
                Err(e) => panic!("expected a fetch fallback, got {e:?}"),
            }
        }
        assert_eq!(completed, 0, "no false completion from a killed donor");
        assert_eq!(tgt.executor().backend_in_flight(), 0);
        assert_eq!(
            tgt.executor().pool().free_blocks(),
            ROWS as usize,
            "every target row back in the pool"
        );
    });
}
