//! Fault `link_cut_mid_transfer`: the donor is another host, a process in
//! its own network namespace ([`crate::netns`]) reachable only over a veth
//! pair, and the prefill target reads its bank through NIXL with UCX over
//! TCP. The link is cut between the two rank parts of one delivery.
//!
//! One run is three fetches of the same retained prefix, each into fresh
//! staging rows registered with the target's NIXL agent:
//!
//! 1. **control**: link up; the fetch must complete with outputs equal to
//!    recompute (proves the TCP path works, so a fallback below is the
//!    fault's doing and not a broken harness);
//! 2. **cut**: rank 0's part lands, the link goes down, rank 1's read
//!    stalls until the delivery's deadline ([`CUT_DEADLINE`]): the request
//!    must fall back, recompute correctly, report no completion and free
//!    every row;
//! 3. **late write**: a UCX read cannot be recalled once issued, so the
//!    abandoned read's rows must stay out of the pool (orphaned) while it is
//!    in flight; the link comes back, the read ends (within
//!    [`QUIESCE_WINDOW`]; it may land, into those rows only) and then, and
//!    only then, the rows return to the pool.
//!
//! Both NIXL agents are limited to `TLS=tcp` and their veth device
//! ([`NixlAgentOptions`]): on one machine UCX would otherwise choose `cma`
//! (cross-memory attach), which ignores the network.

use kv_bank::MemoryKind;
use kv_transfer::nixl::{runtime_status, NixlAgent, NixlAgentOptions, NixlBackend, NixlMode};
use kv_transfer::{NixlRemoteRegion, SourceRegion};

use super::*;
use crate::netns::{NetnsError, NetnsLink};

/// The `kvq child` role of the donor in the other namespace ([`net_child_main`]).
pub const NET_CHILD_ROLE: &str = "net-donor";
/// Deadline of the cut fetch, from its start.
pub const CUT_DEADLINE: Duration = Duration::from_millis(1500);
/// How long the abandoned read may take to end once the link is back.
pub const QUIESCE_WINDOW: Duration = Duration::from_secs(10);

/// UCX limited to TCP over `dev`.
fn tcp_over(dev: &str) -> NixlAgentOptions {
    NixlAgentOptions {
        ucx_config: vec![
            ("TLS".into(), "tcp".into()),
            ("NET_DEVICES".into(), dev.into()),
        ],
    }
}

/// NIXL (UCX) keeps process-wide state after its first agent (an async
/// thread, its fds): made once before the first leak snapshot.
pub(super) fn warm_nixl_globals() {
    static WARM: std::sync::Once = std::sync::Once::new();
    WARM.call_once(|| {
        if runtime_status().is_ok() {
            let _ = NixlAgent::with_options("kvq-warm", &tcp_over("lo"));
        }
    });
}

/// Whether the fault can run here: the NIXL runtime loads and this
/// process's [`NetnsLink::shared`] link exists (it is created now if not).
pub(super) fn available() -> bool {
    runtime_status().is_ok() && NetnsLink::shared().is_ok()
}

#[derive(Serialize, Deserialize)]
struct NetHello {
    #[serde(flatten)]
    bank: ChildHello,
    agent_metadata: Vec<u8>,
    /// Per rank: (base address in the donor process, bytes).
    regions: Vec<(u64, u64)>,
}

/// Child side: `args` = `<shm prefix> <seed> <net device>` (a leading
/// [`NET_CHILD_ROLE`] is skipped). Runs inside the donor's namespace:
/// retains turn 0 of conversation `seed` in a TP2 host bank, registers each
/// rank with a NIXL agent limited to TCP over `<net device>`, prints one
/// JSON line (pid, manifest, slots, agent metadata, regions) and waits for
/// SIGTERM (or 60 s), then closes its bank. Returns 2 on an error.
pub fn net_child_main(args: &[String]) -> i32 {
    child_exit(NET_CHILD_ROLE, net_child(args))
}

fn net_child(args: &[String]) -> Result<(), FaultError> {
    let args: Vec<&String> = args.iter().filter(|a| *a != NET_CHILD_ROLE).collect();
    let [prefix, seed, dev] = args.as_slice() else {
        return Err(FaultError::Child(format!(
            "expected <prefix> <seed> <net device>, got {args:?}"
        )));
    };
    let seed: u64 = seed
        .parse()
        .map_err(|e| FaultError::Child(format!("`seed` {seed:?}: {e}")))?;
    let (rt, mut term) = child_runtime()?;
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let (conv, cache) = conversation(&model, seed)?;
    let slots = (conv.retained_tokens.len() / layout.tokens_per_block() as usize) as u64;
    let bank = host_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        slots,
        prefix,
        LeaseConfig::default(),
    )?;
    retain(&bank, &cache, &conv.retained_tokens)?;
    let agent = NixlAgent::with_options(
        &format!("kvq-net-donor-{}", std::process::id()),
        &tcp_over(dev),
    )
    .map_err(|e| FaultError::Child(e.to_string()))?;
    let mut regions = Vec::new();
    for r in 0..TP {
        let mem = bank.rank(r).map_err(bank_err("rank"))?.memory().clone();
        agent
            .register(mem.as_ref())
            .map_err(|e| FaultError::Child(e.to_string()))?;
        regions.push((mem.base_addr(), mem.len() as u64));
    }
    let hello = NetHello {
        bank: ChildHello::for_bank(&bank, &conv.retained_tokens)?,
        agent_metadata: agent
            .metadata()
            .map_err(|e| FaultError::Child(e.to_string()))?,
        regions,
    };
    let line = serde_json::to_string(&hello).map_err(|e| FaultError::Child(e.to_string()))?;
    println!("{line}");
    wait_for_sigterm(&rt, &mut term);
    // Deregister before the bank's memory goes away.
    drop(agent);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))
}

/// The donor as the target sees it across the link: a manifest and each
/// rank's region behind the donor's NIXL agent (nothing mapped here).
struct NetDonor {
    manifest: BankManifest,
    remotes: Vec<NixlRemoteRegion>,
    pid: u32,
}

struct NetPin<'a>(&'a [NixlRemoteRegion]);

impl DonorPin for NetPin<'_> {
    fn rank_memory(&self, _rank: u32) -> Option<&dyn BankMemory> {
        None
    }
    fn rank_source(&self, rank: u32) -> Option<SourceRegion<'_>> {
        self.0.get(rank as usize).map(SourceRegion::Nixl)
    }
}

impl DonorSource for NetDonor {
    fn manifest(&self) -> &BankManifest {
        &self.manifest
    }
    fn pin<'a>(&'a self, _hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        if !pid_alive(self.pid) {
            return Err(PinError::DonorUnavailable {
                detail: "donor process gone".into(),
            });
        }
        Ok(Box::new(NetPin(&self.remotes)))
    }
}

/// Runs the fault once; see the module docs.
pub(super) fn link_cut(
    seed: u64,
    cmd: &ChildCommand,
    prefix: &str,
) -> Result<RunOutcome, FaultError> {
    let in_ci = kv_transfer::ci_requires();
    if let Err(e) = runtime_status() {
        return Err(if in_ci {
            FaultError::Child(format!("CI=true and {e}"))
        } else {
            FaultError::Skipped(e.to_string())
        });
    }
    let link = match NetnsLink::shared() {
        Ok(l) => l,
        Err(NetnsError::Unavailable(why)) => return Err(FaultError::Skipped(why)),
        Err(e) => return Err(FaultError::Child(e.to_string())),
    };
    // A previous run that failed half way may have left it cut.
    link.restore()
        .map_err(|e| FaultError::Child(e.to_string()))?;
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let bs = layout.tokens_per_block() as usize;
    let (conv, _) = conversation(&model, seed)?;
    let off = generate(&model, KvCache::new(layout), &conv.prompt)?;

    let mut start = link.command_in_ns(&cmd.exe);
    start.args(cmd.args_for_role(NET_CHILD_ROLE)).args([
        prefix.to_string(),
        seed.to_string(),
        link.ns_dev.clone(),
    ]);
    // `ip netns exec` execs the donor, so the pid is the donor's.
    let (HelloChild { child, guard, .. }, hello): (HelloChild, NetHello) =
        spawn_with_hello(start, Duration::from_secs(30))?;
    let manifest = BankManifest::from_wire(&hello.bank.manifest)
        .map_err(|e| FaultError::Child(e.to_string()))?;

    let nixl_err = |e: TransferError| FaultError::Child(format!("target agent: {e}"));
    let agent = Arc::new(
        NixlAgent::with_options(
            &format!("kvq-net-target-{prefix}"),
            &tcp_over(&link.host_dev),
        )
        .map_err(nixl_err)?,
    );
    let remote = agent.load_remote(&hello.agent_metadata).map_err(nixl_err)?;
    let donor = NetDonor {
        manifest: manifest.clone(),
        remotes: hello
            .regions
            .iter()
            .map(|&(base_addr, len)| NixlRemoteRegion {
                agent_name: remote.clone(),
                base_addr,
                len,
                kind: MemoryKind::Host,
            })
            .collect(),
        pid: hello.bank.pid,
    };
    let usable = (conv.prompt.len() - 1) / bs;
    let entries: Vec<(u64, u32)> = hello.bank.entries.iter().take(usable).copied().collect();
    let env = retained_hint_envelope(
        &manifest,
        &layout,
        &entries,
        &format!("fault-{seed}"),
        "netns",
    )?;
    let rows = (conv.prompt.len() / bs) as u32 + 2;
    // Targets read through the agent; the cut one takes the link down when
    // rank 1's part starts.
    let target = |cut: bool| -> Result<Target, FaultError> {
        let strike = if cut {
            Strike::BeforeRank(
                1,
                Arc::new(move || {
                    let _ = link.cut();
                }),
            )
        } else {
            Strike::Never
        };
        let nixl = Arc::new(NixlBackend::new(agent.clone(), NixlMode::Runs));
        let t = Target::new(layout, rows, Arc::new(FaultBackend::new(nixl, strike, TP)))?;
        for b in &t.staging {
            agent.register(b.as_ref()).map_err(nixl_err)?;
        }
        Ok(t)
    };

    // 1. Control: the link carries the fetch.
    let control_target = target(false)?;
    let (c_served, c_completed, c_fallback) = control_target.serve(
        &model,
        &conv.prompt,
        Some(&env),
        &donor,
        &DeliveryControl::with_timeout(Duration::from_secs(10)),
    )?;
    let control_ok = c_completed && c_served == off;

    // 2. Cut between rank 0's and rank 1's part.
    let cut_target = target(true)?;
    let started = Instant::now();
    let (served, completed, fallback) = cut_target.serve(
        &model,
        &conv.prompt,
        Some(&env),
        &donor,
        &DeliveryControl::with_timeout(CUT_DEADLINE),
    )?;
    let fell_back_after = started.elapsed();
    // The abandoned read keeps its rows out of the pool while in flight.
    let orphaned_at_fallback = cut_target.pool.orphaned_blocks();
    let in_flight_at_fallback = cut_target.executor.backend_in_flight();

    // 3. The link comes back: the stalled read ends (it may land, in rows
    // nobody else can hold), then its rows return to the pool.
    for b in &cut_target.staging {
        b.write_bytes(0, &vec![POISON; b.len()])
            .map_err(|e| FaultError::Child(format!("re-poison: {e}")))?;
    }
    link.restore()
        .map_err(|e| FaultError::Child(e.to_string()))?;
    let until = Instant::now() + QUIESCE_WINDOW;
    while cut_target.executor.backend_in_flight() > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    let quiesced_after = started.elapsed();
    let late_write = !cut_target.poison_intact();
    let reclaimed = cut_target.executor.reclaim_quiesced();
    let rows_free = cut_target.rows_free();

    let mut o = outcome(Fault::LinkCutMidTransfer);
    o.completed = completed;
    o.fell_back = control_ok && !completed && fallback.is_some();
    o.outputs_match = served == off && c_served == off;
    // Untouched: while the read was in flight its rows were out of the pool
    // (orphaned, so no other fetch could be handed one), and once it ended
    // they all came back.
    o.destination_untouched = (in_flight_at_fallback == 0 || orphaned_at_fallback > 0) && rows_free;
    o.detail = format!(
        "control fetch over tcp: completed {c_completed}{}; cut: {} after {} ms; \
         reads in flight at fallback {in_flight_at_fallback}, rows orphaned {orphaned_at_fallback}; \
         late write after restore: {late_write} (into orphaned rows); quiesced after {} ms, \
         rows reclaimed {reclaimed}; rows free {rows_free}",
        c_fallback.map(|f| format!(" ({f})")).unwrap_or_default(),
        fallback.unwrap_or_else(|| "fetch completed".into()),
        fell_back_after.as_millis(),
        quiesced_after.as_millis(),
    );
    drop(control_target);
    drop(cut_target);
    drop(donor);
    // A pid we spawned and have not reaped (`ip netns exec` execs the
    // program, so the pid is the donor's); an error means it already exited.
    let _ = terminate(hello.bank.pid);
    let status = wait_exit(&child, Duration::from_secs(5));
    drop(guard);
    // The agent goes after the donor: its endpoint to a closed peer then
    // closes at once instead of flushing into a dead link.
    drop(agent);
    if !matches!(status, Some(s) if s.success()) {
        o.detail.push_str(&format!("; donor exit {status:?}"));
    }
    Ok(o)
}
