//! The donor child process (`kvq child fault-donor`) and the parent's side of
//! it: hello, remote pins, liveness, SIGKILL / SIGTERM mid-transfer.

use super::*;
use kv_bank::child_process::{ChildProcess, ChildStderr};

#[derive(Serialize, Deserialize)]
pub(super) struct ChildHello {
    pub(super) pid: u32,
    pub(super) manifest: Vec<u8>,
    pub(super) entries: Vec<(u64, u32)>,
}

impl ChildHello {
    /// This process's hello for `bank`, which retained `tokens`: its
    /// manifest and the (sequence hash, slot) of every retained block.
    pub(super) fn for_bank(bank: &BankManager, tokens: &[u32]) -> Result<Self, FaultError> {
        let bs = bank.manifest().layout().tokens_per_block() as usize;
        Ok(Self {
            pid: std::process::id(),
            manifest: bank
                .manifest()
                .to_wire()
                .map_err(|e| FaultError::Child(e.to_string()))?,
            entries: sealed_blocks(None, tokens, bs)
                .iter()
                .filter_map(|b| {
                    bank.lookup(&b.sequence_hash)
                        .map(|s| (b.sequence_hash.0, s))
                })
                .collect(),
        })
    }
}

/// A child role's exit code: 0, or 2 with the error on stderr.
pub(super) fn child_exit(role: &str, result: Result<(), FaultError>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{role}: {e}");
            2
        }
    }
}

/// The host-shm donor child's hello: the common fields plus its pin
/// service (`unix:<path>`), which the parent's hints name as the control
/// endpoint.
#[derive(Serialize, Deserialize)]
struct PinningChildHello {
    #[serde(flatten)]
    pub(super) hello: ChildHello,
    pub(super) endpoint: String,
}

/// Directory of the child donor's pin socket. The run's unique prefix names
/// it, so runs never share a socket, and the parent can remove what a
/// killed child left.
fn pin_socket_dir(prefix: &str) -> PathBuf {
    std::env::temp_dir().join(prefix)
}

/// How long a SIGTERMed child waits for targets to release their pins
/// before it cuts their connections and closes its bank.
const CHILD_PIN_DRAIN: Duration = Duration::from_millis(100);

/// Child side of the donor faults: `args` = `<shm prefix> <seed> <lease ms>`
/// (a leading [`CHILD_ROLE`] is skipped). Computes turn 0 of conversation
/// `seed`, retains it in a TP2 host-shm bank whose lease is renewed in the
/// background, serves source pins on it ([`kv_router_glue::PinService`] on a
/// Unix socket in a fresh temp directory), prints one JSON line (pid,
/// manifest, slots, pin endpoint), then waits. On SIGTERM it stops the pin
/// service (new pins refused, held ones given `CHILD_PIN_DRAIN`, then
/// dropped; socket and directory removed) and closes its bank (lease
/// revoked, segments unlinked) and returns 0; after 60 s without a signal
/// it does the same. Returns 2 on an error (printed to stderr).
pub fn child_main(args: &[String]) -> i32 {
    child_exit(CHILD_ROLE, child(args))
}

fn child(args: &[String]) -> Result<(), FaultError> {
    let args: Vec<&String> = args.iter().filter(|a| *a != CHILD_ROLE).collect();
    let [prefix, seed, lease_ms] = args.as_slice() else {
        return Err(FaultError::Child(format!(
            "expected <prefix> <seed> <lease ms>, got {args:?}"
        )));
    };
    let num = |field: &str, s: &str| {
        s.parse::<u64>()
            .map_err(|e| FaultError::Child(format!("`{field}` {s:?}: {e}")))
    };
    let (seed, lease_ms) = (num("seed", seed)?, num("lease_ms", lease_ms)?);
    let (rt, mut term) = child_runtime()?;
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let (conv, cache) = conversation(&model, seed)?;
    let slots = (conv.retained_tokens.len() / layout.tokens_per_block() as usize) as u64;
    let bank = Arc::new(host_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        slots,
        prefix,
        LeaseConfig::background(
            Duration::from_millis(lease_ms),
            Duration::from_millis((lease_ms / 4).max(1)),
        ),
    )?);
    retain(&bank, &cache, &conv.retained_tokens)?;
    let sock_dir = pin_socket_dir(prefix);
    std::fs::create_dir_all(&sock_dir)
        .map_err(|e| FaultError::Child(format!("{}: {e}", sock_dir.display())))?;
    let pins = kv_router_glue::PinService::bind(
        bank.clone(),
        &format!("unix:{}", sock_dir.join("pin.sock").display()),
        kv_router_glue::PinServiceConfig::default(),
    )
    .map_err(|e| FaultError::Child(e.to_string()))?;
    let hello = PinningChildHello {
        hello: ChildHello::for_bank(&bank, &conv.retained_tokens)?,
        endpoint: pins.endpoint().to_owned(),
    };
    let line = serde_json::to_string(&hello).map_err(|e| FaultError::Child(e.to_string()))?;
    println!("{line}");
    wait_for_sigterm(&rt, &mut term);
    // Pins first: once the service is down no target holds a pin, so the
    // close below frees the memory at once instead of timing out.
    pins.shutdown(CHILD_PIN_DRAIN);
    let _ = std::fs::remove_dir(&sock_dir);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))
}

/// The child's bank as the target sees it: mapped by descriptor under a
/// live lease, pinned through the child's pin service
/// ([`kv_router_glue::RemoteDonor`]: the child cannot evict or reuse the
/// slots while the pin is held, and a pin that did not hold throughout fails
/// the fetch). `pin` also checks the process and leases first, and the
/// delivery's liveness probe re-checks them after the last byte: a donor
/// that dies takes its pins with it.
struct RemoteDonor {
    pub(super) remote: kv_router_glue::RemoteDonor,
    pub(super) alive: Arc<dyn Fn() -> bool + Send + Sync>,
    /// Pins the child granted (the run's detail reports it, so a test can
    /// tell a fetch that really pinned the child's slots).
    pub(super) granted: AtomicU32,
}

impl DonorSource for RemoteDonor {
    fn manifest(&self) -> &BankManifest {
        self.remote.manifest()
    }
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        if !(self.alive)() {
            return Err(PinError::DonorUnavailable {
                detail: "donor process or lease gone".into(),
            });
        }
        let pin = self.remote.pin(hint)?;
        self.granted.fetch_add(1, Ordering::SeqCst);
        Ok(pin)
    }
}

pub(super) use kv_bank::reclaim::pid_alive;

/// Sends SIGTERM to `pid` (a child this process spawned and has not reaped,
/// so the pid is not reused).
///
/// # Errors
/// `ESRCH` when it already exited, `EINVAL` for pid 0 or above `i32::MAX`.
pub(super) fn terminate(pid: u32) -> std::io::Result<()> {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| std::io::Error::from(rustix::io::Errno::INVAL))?;
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).map_err(Into::into)
}

/// The hint a router would send for `entries` (sequence hash, donor slot;
/// the retained prefix, in order) of `manifest`'s bank: every rank reads
/// the same slots.
pub(super) fn retained_hint_envelope(
    manifest: &BankManifest,
    layout: &KvLayout,
    entries: &[(u64, u32)],
    request_id: &str,
    endpoint: &str,
) -> Result<HintEnvelope, FaultError> {
    let slots: Vec<u32> = entries.iter().map(|e| e.1).collect();
    let hint = FetchGpuHint {
        donor_engine_id: manifest.owner().engine_id,
        bank_generation: manifest.owner().generation,
        layout_fingerprint: layout.fingerprint(),
        tp_size: layout.tp_size(),
        sequence_hashes: entries.iter().map(|e| SequenceHash(e.0)).collect(),
        fetch_from: 0,
        parts: (0..layout.tp_size())
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: slots.clone(),
                expected_bytes: slots.len() as u64 * layout.rank_block_bytes() as u64,
            })
            .collect(),
        donor_control_endpoint: endpoint.to_string(),
    };
    HintEnvelope::fetch_gpu(request_id, "a0", &hint).map_err(|e| FaultError::Child(e.to_string()))
}

/// A started donor child whose first stdout line (its hello) was read.
pub(super) struct HelloChild {
    /// The process (killed and reaped through `guard` at the latest).
    pub(super) child: Arc<Mutex<Child>>,
    pub(super) guard: ChildProcess,
    /// Its pid as the parent sees it.
    pub(super) pid: u32,
}

/// Starts `cmd` through the workspace's one child-process harness
/// ([`kv_bank::child_process`]: stdin closed, stdout piped, stderr inherited,
/// SIGKILLed when this process dies) and parses the first JSON line it prints
/// within `wait` as its hello `T`.
pub(super) fn spawn_with_hello<T: serde::de::DeserializeOwned>(
    cmd: Command,
    wait: Duration,
) -> Result<(HelloChild, T), FaultError> {
    let mut proc = ChildProcess::spawn(cmd, ChildStderr::Inherit)
        .map_err(|e| FaultError::Child(e.to_string()))?;
    let hello = proc
        .next_json("hello", wait)
        .map_err(|e| FaultError::Child(e.to_string()))?;
    let (child, pid) = (proc.handle(), proc.pid());
    Ok((
        HelloChild {
            child,
            guard: proc,
            pid,
        },
        hello,
    ))
}

/// A child's current-thread runtime with its SIGTERM handler installed.
/// Install it before printing the hello, so that a SIGTERM sent as soon as
/// the parent read it is never the default (killing) action.
pub(super) fn child_runtime(
) -> Result<(tokio::runtime::Runtime, tokio::signal::unix::Signal), FaultError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| FaultError::Child(format!("runtime: {e}")))?;
    let term = rt
        .block_on(async {
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        })
        .map_err(|e| FaultError::Child(format!("SIGTERM handler: {e}")))?;
    Ok((rt, term))
}

/// Blocks until SIGTERM, or [`CHILD_MAX_LIFE`] if none comes.
pub(super) fn wait_for_sigterm(
    rt: &tokio::runtime::Runtime,
    term: &mut tokio::signal::unix::Signal,
) {
    rt.block_on(async {
        let _ = tokio::time::timeout(CHILD_MAX_LIFE, term.recv()).await;
    });
}

/// Waits up to `timeout` for the child to exit; kills it after that.
pub(super) fn wait_exit(
    child: &Mutex<Child>,
    timeout: Duration,
) -> Option<std::process::ExitStatus> {
    kv_bank::child_process::wait_exit(child, timeout)
}

pub(super) fn child_fault(
    fault: Fault,
    seed: u64,
    cmd: &ChildCommand,
    prefix: &str,
) -> Result<RunOutcome, FaultError> {
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let (conv, _) = conversation(&model, seed)?;
    let off = generate(&model, KvCache::new(layout), &conv.prompt)?;
    let mut start = Command::new(&cmd.exe);
    start.args(&cmd.args).args([
        prefix.to_string(),
        seed.to_string(),
        CHILD_LEASE_MS.to_string(),
    ]);
    let (HelloChild { child, guard, pid }, PinningChildHello { hello, endpoint }) =
        spawn_with_hello(start, Duration::from_secs(30))?;
    let manifest =
        BankManifest::from_wire(&hello.manifest).map_err(|e| FaultError::Child(e.to_string()))?;
    let remote = kv_router_glue::RemoteDonor::open_host_shm(manifest.clone(), &endpoint)
        .map_err(|e| FaultError::Child(format!("open_host_shm: {e}")))?;
    let parts = manifest.parts().to_vec();
    let alive: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || {
        pid_alive(pid)
            && parts
                .iter()
                .all(|d| check_descriptor_lease(d, kv_bank::LeaseInstant::now()).is_ok())
    });
    let donor = RemoteDonor {
        remote,
        alive: alive.clone(),
        granted: AtomicU32::new(0),
    };
    // The honest hint for the retained prefix the prompt can use.
    let bs = layout.tokens_per_block() as usize;
    let usable = (conv.prompt.len() - 1) / bs;
    let entries: Vec<(u64, u32)> = hello.entries.iter().take(usable).copied().collect();
    let env = retained_hint_envelope(
        &manifest,
        &layout,
        &entries,
        &format!("fault-{seed}"),
        &endpoint,
    )?;
    let strike_child = child.clone();
    let act: Action = if fault == Fault::DonorKilledMidTransfer {
        Arc::new(move || {
            let mut c = strike_child.lock().unwrap_or_else(|e| e.into_inner());
            let _ = c.kill();
            let _ = c.wait();
        })
    } else {
        Arc::new(move || {
            // A pid we spawned and have not reaped, so it cannot have been
            // reused; an error means it already exited.
            let _ = terminate(pid);
            wait_exit(&strike_child, Duration::from_secs(5));
        })
    };
    let target = Target::new(
        layout,
        (conv.prompt.len() / bs) as u32 + 2,
        Arc::new(FaultBackend::host(Strike::BeforeRank(1, act))),
    )?;
    let control = DeliveryControl {
        donor_alive: Some(alive),
        ..DeliveryControl::new()
    };
    let (served, completed, fallback) =
        target.serve(&model, &conv.prompt, Some(&env), &donor, &control)?;
    let status = wait_exit(&child, Duration::from_secs(5));
    drop(guard);
    let mut o = outcome(fault);
    o.completed = completed;
    o.fell_back = !completed && fallback.is_some();
    o.outputs_match = served == off;
    o.destination_untouched = target.rows_free();
    let granted = donor.granted.load(Ordering::SeqCst);
    drop(target);
    drop(donor);
    // A killed owner leaves its segments: they go once its lease lapsed.
    let mut reclaimed = 0;
    let end = Instant::now() + Duration::from_millis(CHILD_LEASE_MS * 4);
    while !shm_entries(prefix).is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(CHILD_LEASE_MS / 4));
        if let Ok(r) = kv_bank::reclaim_stale(prefix, kv_bank::reclaim::ScanTime::now()) {
            reclaimed += r.removed_names().len();
        }
    }
    // A killed child never removed its socket file.
    let _ = std::fs::remove_dir_all(pin_socket_dir(prefix));
    o.detail = format!(
        "{}; remote pins granted by the child {granted}; child exit {:?}; names reclaimed {reclaimed}",
        fallback.unwrap_or_else(|| "fetch completed".into()),
        status.map(|s| s.to_string())
    );
    Ok(o)
}
