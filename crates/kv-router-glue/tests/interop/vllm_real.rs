//! vLLM 0.33.0's own KV event publisher (`vllm/distributed/kv_events.py`,
//! unmodified, from the vLLM wheel) in a Python subprocess over a simulated
//! prefix cache (`tests/vllm_publisher/harness.py`), subscribed by
//! [`VllmSubscriber`] with its replay endpoint: a late joiner catches up to
//! exactly vLLM's cached blocks, live batches keep it exact, a hybrid model's
//! sliding-window frees do not drop full-attention blocks, byte-string hashes
//! work, and an engine restart on the same endpoints replaces the inventory.
//!
//! Needs `target/vllm-wheel/vllm-0.33.0-*.whl` (fetched with `pip download
//! vllm==0.33.0 --no-deps` when absent) and a venv with msgspec and pyzmq
//! (`target/vllm-venv`, created when absent). Skips with a `SKIP` line when
//! either cannot be had; under `CI=true` that is a failure.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::Duration;

use kv_descriptor::*;
use kv_lookup::{InventoryIndex, WorkerKey};
use kv_router_glue::vllm_events::*;

use crate::child::wait_until;

const VLLM_VERSION: &str = "0.33.0";

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"),
        PathBuf::from,
    )
}

fn harness() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vllm_publisher/harness.py")
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ))
    }
}

fn find_wheel(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with(&format!("vllm-{VLLM_VERSION}-")) && n.ends_with(".whl")
            })
        })
}

/// Python with msgspec + pyzmq and a sandbox holding vLLM's kv_events module.
fn prepare() -> Result<(PathBuf, PathBuf), String> {
    let target = target_dir();
    let wheels = target.join("vllm-wheel");
    if find_wheel(&wheels).is_none() {
        std::fs::create_dir_all(&wheels).map_err(|e| e.to_string())?;
        run(Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "-d"])
            .arg(&wheels)
            .arg(format!("vllm=={VLLM_VERSION}")))?;
    }
    let wheel = find_wheel(&wheels).ok_or("no vLLM wheel after pip download")?;
    let venv = target.join("vllm-venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    if run(Command::new(&python).args(["-c", "import msgspec, zmq"])).is_err() {
        run(Command::new(&python).args(["-m", "pip", "install", "-q", "msgspec", "pyzmq"]))?;
    }
    let sandbox = target.join("vllm-sandbox");
    run(Command::new(&python)
        .arg(harness())
        .arg("sandbox")
        .arg(&wheel)
        .arg(&sandbox))?;
    Ok((python, sandbox))
}

struct Py {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Py {
    fn spawn(python: &Path, sandbox: &Path) -> Self {
        let mut child = Command::new(python)
            .arg(harness())
            .arg("serve")
            .arg(sandbox)
            .arg("11")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the vLLM publisher harness");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    fn line(&self, prefix: &str) -> String {
        loop {
            let l = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .expect("harness answers");
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.trim().to_owned();
            }
        }
    }

    fn command(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.line("OK")
    }

    /// Sequence hashes of every block vLLM's cache holds now.
    fn inventory(&mut self) -> Vec<SequenceHash> {
        let v: Vec<Vec<u32>> = serde_json::from_str(&self.command("inventory")).unwrap();
        v.iter()
            .map(|prefix| *sequence_hashes(prefix, 16).last().unwrap())
            .collect()
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn assert_exact(index: &InventoryIndex, engine: EngineId, want: &[SequenceHash], what: &str) {
    let missing = want
        .iter()
        .filter(|h| index.holds(engine, **h) != vec![StorageTier::Device])
        .count();
    assert_eq!(
        missing,
        0,
        "{what}: {missing} of {} cached blocks not indexed",
        want.len()
    );
    assert_eq!(
        index.stats().held_blocks[0],
        want.len() as u64,
        "{what}: the index holds blocks vLLM does not"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_33_publisher_late_joiner_live_hybrid_bytes_and_restart() {
    let (python, sandbox) = match prepare() {
        Ok(p) => p,
        Err(why) => {
            assert!(
                !kv_transfer::ci_requires(),
                "vLLM {VLLM_VERSION} publisher unavailable under CI=true: {why}"
            );
            println!("SKIP vllm_0_33_publisher: {why}");
            return;
        }
    };
    let mut py = Py::spawn(&python, &sandbox);
    let eps = py.line("ENDPOINTS");
    let (pub_ep, replay_ep) = eps.split_once(' ').unwrap();
    // 50 batches before anyone subscribes.
    assert_eq!(py.command("steps 50"), "50");
    let index = Arc::new(InventoryIndex::new());
    let worker = VllmWorker {
        key: WorkerKey(1),
        engine: EngineId::fresh(),
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(0x33),
        tp_size: 1,
        tokens_per_block: 16,
    };
    let ingest = VllmIngest::new(index.clone(), worker).unwrap();
    let mut config = VllmSubscriberConfig::new(pub_ep, Some(replay_ep.to_owned()));
    config.idle_probe = Some(Duration::from_millis(300));
    let sub = VllmSubscriber::start(config, ingest).await.unwrap();
    assert_eq!(sub.stats().next_seq, 50);
    assert_eq!(sub.stats().replayed_batches, 50);
    let want = py.inventory();
    assert!(want.len() > 100, "the simulation caches a real inventory");
    assert_exact(&index, worker.engine, &want, "late joiner after catch-up");

    // Live, hybrid (sliding-window frees), byte-string hashes.
    for (cmd, next) in [("steps 30", 80), ("bytes 10", 90), ("hybrid 20", 110)] {
        assert_eq!(py.command(cmd), next.to_string());
        wait_until(&format!("next_seq {next}"), Duration::from_secs(20), || {
            sub.stats().next_seq == next
        });
        let want = py.inventory();
        assert_exact(&index, worker.engine, &want, cmd);
    }
    assert_eq!(sub.stats().lost_batches, 0);

    // The engine restarts on the same endpoints: seq from 0, empty cache.
    py.command("restart");
    assert_eq!(py.command("steps 12"), "12");
    wait_until("restart detected", Duration::from_secs(30), || {
        let st = sub.stats();
        st.restarts == 1 && st.next_seq == 12
    });
    let want = py.inventory();
    assert_exact(&index, worker.engine, &want, "after restart");
    let (_, stats) = sub.stop().await;
    assert_eq!(stats.ingest.replacements, 1);
    assert_eq!(stats.undecodable, 0);
}
