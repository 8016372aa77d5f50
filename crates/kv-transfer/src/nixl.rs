//! NIXL backend: reads donor memory registered with a remote NIXL agent (UCX
//! plugin; DRAM and VRAM) into local registered memory.
//!
//! `nixl-sys` is built with `stub-api`: the real library `libnixl_capi.so`
//! is loaded at run time. [`runtime_status`] probes it without aborting (the
//! stub aborts on any other call when the library is missing), and
//! [`NixlAgent::new`] refuses to start without it.
//!
//! Runtime environment (PyPI wheel `nixl-cu13==1.5.1` unpacked under
//! `target/nixl`): `LD_LIBRARY_PATH` must contain
//! `target/nixl/.nixl_cu13.mesonpy.libs` (its RPATH finds the bundled UCX in
//! `nixl_cu13.libs`), and `NIXL_PLUGIN_DIR` must be
//! `target/nixl/.nixl_cu13.mesonpy.libs/plugins`.
//!
//! Three ways to issue a part ([`NixlMode`]): prepared descriptor lists (one
//! descriptor per slot/block, prepared once per region pair and reused by
//! every later fetch; NIXL merges consecutive descriptors of a request), the
//! plan's coalesced runs as an ad-hoc list, and the naive baseline of one
//! descriptor per block with merging disabled.
//!
//! Transport: which UCX transport moved a part's bytes is read from UCX's
//! protocol log when the process enabled it, and a device-to-device part
//! completes only when that transport is a known device-direct zero-copy
//! one; an unknown transport fails the part closed
//! ([`TransferError::TransportUnverified`]). See [`crate::nixl_transport`].

use std::collections::HashMap;

use kv_bank::{BankMemory, MemoryKind};
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap,
    OptArgs, RegistrationHandle, ThreadSync, XferDescList, XferDlistHandle, XferOp, XferStatus,
};
use parking_lot::Mutex;

use crate::delivery::{CopyBackend, PartOutcome, RankIo, SourceRegion};
use crate::nixl_transport::{part_host_payload, transport_label, ucx_rows};
use crate::plan::{PartPlan, RegionGeometry};
use crate::{DeliveryControl, NixlRemoteRegion, TransferError};

/// Environment variable naming the plugin directory of the NIXL runtime.
pub const PLUGIN_DIR_ENV: &str = "NIXL_PLUGIN_DIR";

/// Whether the NIXL runtime library can be loaded in this process.
///
/// # Errors
/// [`TransferError::NixlUnavailable`] naming what to put on `LD_LIBRARY_PATH`.
pub fn runtime_status() -> Result<(), TransferError> {
    if nixl_sys::is_stub() {
        return Err(TransferError::NixlUnavailable(
            "libnixl_capi.so not found: put target/nixl/.nixl_cu13.mesonpy.libs on LD_LIBRARY_PATH \
             and set NIXL_PLUGIN_DIR to its plugins/ folder"
                .into(),
        ));
    }
    Ok(())
}

fn nixl_err(op: &'static str) -> impl FnOnce(NixlError) -> TransferError {
    move |e| TransferError::Nixl {
        op,
        reason: e.to_string(),
    }
}

fn mem_type(kind: MemoryKind) -> (MemType, u64) {
    match kind {
        MemoryKind::Host => (MemType::Dram, 0),
        MemoryKind::Cuda { ordinal } => (MemType::Vram, u64::from(ordinal)),
    }
}

/// A region handed to NIXL for registration.
#[derive(Debug)]
struct RegionDesc {
    addr: u64,
    len: usize,
    mem: MemType,
    dev: u64,
}

impl MemoryRegion for RegionDesc {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for RegionDesc {
    fn mem_type(&self) -> MemType {
        self.mem
    }
    fn device_id(&self) -> u64 {
        self.dev
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PreparedKey {
    remote: String,
    src_base: u64,
    src_stride: u64,
    src_rows: u32,
    dst_base: u64,
    dst_stride: u64,
    dst_rows: u32,
    block_bytes: u64,
}

struct PreparedPair {
    local: XferDlistHandle,
    remote: XferDlistHandle,
}

// SAFETY: the handles are opaque pointers owned by the agent; they are used
// only under `NixlAgent::prepared`'s mutex and released (on drop) before the
// agent, which is declared after `prepared` in `NixlAgent`.
unsafe impl Send for PreparedPair {}

/// Per-agent UCX settings of a [`NixlAgent`] (NIXL's UCX backend
/// parameter `engine_config`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NixlAgentOptions {
    /// UCX settings without the `UCX_` prefix, e.g. `("TLS", "tcp")` or
    /// `("NET_DEVICES", "eth1")`, applied to this agent's UCX context only
    /// (after NIXL's own defaults, so they win). NIXL's `device_list`
    /// parameter is not used: for TCP devices it makes UCX fail with
    /// "No such device" (NIXL 1.5.1), while `NET_DEVICES` works.
    pub ucx_config: Vec<(String, String)>,
}

impl NixlAgentOptions {
    /// `engine_config` value: `KEY=VALUE` pairs joined with `,` (NIXL 1.5.1
    /// splits on `,` and hands each pair to `ucp_config_modify`; a `;` would
    /// end up inside the first value).
    ///
    /// # Errors
    /// [`TransferError::Nixl`] naming the pair when a key is empty or a key
    /// or value contains `,` or `=` (it would be split into other settings).
    fn engine_config(&self) -> Result<String, TransferError> {
        let mut pairs = Vec::with_capacity(self.ucx_config.len());
        for (k, v) in &self.ucx_config {
            if k.is_empty() || k.contains([',', '=']) || v.contains([',', '=']) {
                return Err(TransferError::Nixl {
                    op: "engine_config",
                    reason: format!(
                        "ucx_config entry ({k:?}, {v:?}): the key must be non-empty and \
                         neither key nor value may contain ',' or '='"
                    ),
                });
            }
            pairs.push(format!("{k}={v}"));
        }
        Ok(pairs.join(","))
    }
}

/// One NIXL agent with a UCX backend: registers local memory, exchanges
/// metadata, and owns prepared descriptor lists.
///
/// Field order matters: abandoned requests, prepared handles and
/// registrations are released before the agent itself.
pub struct NixlAgent {
    /// Remote agents loaded and not forgotten.
    remotes: Mutex<std::collections::HashSet<String>>,
    /// Reads abandoned in flight: kept, not released (a released UCX read
    /// still writes), until [`NixlAgent::reap_abandoned`] sees them end.
    abandoned: Mutex<Vec<nixl_sys::XferRequest>>,
    prepared: Mutex<HashMap<PreparedKey, PreparedPair>>,
    registrations: Mutex<Vec<RegistrationHandle>>,
    backend: Backend,
    agent: Agent,
    name: String,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent")
            .field("name", &self.name)
            .field("registrations", &self.registrations.lock().len())
            .field("prepared", &self.prepared.lock().len())
            .finish()
    }
}

impl NixlAgent {
    /// Creates agent `name` with a UCX backend.
    ///
    /// # Errors
    /// [`TransferError::NixlUnavailable`] without the runtime;
    /// [`TransferError::Nixl`] when the agent or the UCX backend cannot be created.
    pub fn new(name: &str) -> Result<Self, TransferError> {
        Self::with_options(name, &NixlAgentOptions::default())
    }

    /// Creates agent `name` with a UCX backend configured by `options`
    /// (network devices and UCX settings of this agent alone, unlike the
    /// process-wide `UCX_*` environment).
    ///
    /// ```no_run
    /// use kv_transfer::nixl::{NixlAgent, NixlAgentOptions};
    /// // TCP only, over one interface: what a cross-host test over veth needs.
    /// let opts = NixlAgentOptions {
    ///     ucx_config: vec![
    ///         ("TLS".into(), "tcp".into()),
    ///         ("NET_DEVICES".into(), "veth0".into()),
    ///     ],
    /// };
    /// let agent = NixlAgent::with_options("prefill-0", &opts)?;
    /// # Ok::<(), kv_transfer::TransferError>(())
    /// ```
    ///
    /// # Errors
    /// As [`NixlAgent::new`]; a malformed `ucx_config` entry fails
    /// `engine_config` before NIXL is called; a setting UCX rejects or a
    /// device that does not exist fails `create_backend(UCX)`.
    pub fn with_options(name: &str, options: &NixlAgentOptions) -> Result<Self, TransferError> {
        runtime_status()?;
        // The progress thread stays on: a donor agent is never polled by its
        // own process during a read, and without it remote reads never finish.
        // Rank parts call into one agent from several threads, so NIXL must
        // serialize them.
        let cfg = AgentConfig {
            enable_listen_thread: false,
            thread_sync: ThreadSync::Strict,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(name, &cfg).map_err(nixl_err("create_agent"))?;
        let (_mems, mut params) = agent
            .get_plugin_params("UCX")
            .map_err(nixl_err("get_plugin_params(UCX)"))?;
        if !options.ucx_config.is_empty() {
            params
                .set("engine_config", &options.engine_config()?)
                .map_err(nixl_err("params(engine_config)"))?;
        }
        let backend = agent
            .create_backend("UCX", &params)
            .map_err(nixl_err("create_backend(UCX)"))?;
        Ok(Self {
            remotes: Mutex::new(std::collections::HashSet::new()),
            abandoned: Mutex::new(Vec::new()),
            prepared: Mutex::new(HashMap::new()),
            registrations: Mutex::new(Vec::new()),
            backend,
            agent,
            name: name.to_string(),
        })
    }

    /// Agent name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn opt_args(&self) -> Result<OptArgs, TransferError> {
        let mut a = OptArgs::new().map_err(nixl_err("create_opt_args"))?;
        a.add_backend(&self.backend)
            .map_err(nixl_err("opt_args_add_backend"))?;
        Ok(a)
    }

    /// Registers `mem` (host → DRAM, CUDA → VRAM on its ordinal) until the
    /// agent is dropped. Register before publishing [`NixlAgent::metadata`].
    ///
    /// # Errors
    /// [`TransferError::Nixl`] naming `register_memory`.
    pub fn register(&self, mem: &dyn BankMemory) -> Result<(), TransferError> {
        let (m, dev) = mem_type(mem.kind());
        let desc = RegionDesc {
            addr: mem.base_addr(),
            len: mem.len(),
            mem: m,
            dev,
        };
        let h = self
            .agent
            .register_memory(&desc, Some(&self.opt_args()?))
            .map_err(nixl_err("register_memory"))?;
        self.registrations.lock().push(h);
        Ok(())
    }

    /// This agent's serialized metadata (what `ExportHandle::NixlAgent` carries).
    ///
    /// # Errors
    /// [`TransferError::Nixl`] naming `get_local_md`.
    pub fn metadata(&self) -> Result<Vec<u8>, TransferError> {
        self.agent.get_local_md().map_err(nixl_err("get_local_md"))
    }

    /// Loads a remote agent's metadata; returns its name.
    ///
    /// # Errors
    /// [`TransferError::Nixl`] naming `load_remote_md`.
    pub fn load_remote(&self, metadata: &[u8]) -> Result<String, TransferError> {
        let name = self
            .agent
            .load_remote_md(metadata)
            .map_err(nixl_err("load_remote_md"))?;
        self.remotes.lock().insert(name.clone());
        Ok(name)
    }

    /// Forgets a remote agent (its donor died, left or stalled): its UCX
    /// endpoints close, later reads from it fail with
    /// [`TransferError::DonorUnreachable`], and the descriptor lists prepared
    /// against it are released. Forgetting an unknown or already forgotten
    /// remote does nothing.
    ///
    /// # Errors
    /// [`TransferError::Nixl`] naming `invalidate_remote_md`.
    pub fn forget_remote(&self, remote: &str) -> Result<(), TransferError> {
        // Held across the call: a concurrent forget of the same remote
        // returns only once the endpoints are closed.
        let mut remotes = self.remotes.lock();
        if !remotes.remove(remote) {
            return Ok(());
        }
        self.prepared.lock().retain(|k, _| k.remote != remote);
        self.agent
            .invalidate_remote_md(remote)
            .map_err(nixl_err("invalidate_remote_md"))
    }

    /// Notifications received since the last call: remote agent name to
    /// messages. A donor learns here that a target finished reading.
    ///
    /// # Errors
    /// [`TransferError::Nixl`] naming `get_notifs`.
    pub fn take_notifications(&self) -> Result<HashMap<String, Vec<String>>, TransferError> {
        let mut map = NotificationMap::new().map_err(nixl_err("create_notif_map"))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(nixl_err("get_notifs"))?;
        map.take_notifs().map_err(nixl_err("take_notifs"))
    }

    /// Releases abandoned reads that have ended (completed or failed) and
    /// returns how many are still in flight: their destination rows must
    /// stay unused until this returns 0. Progresses UCX as a side effect.
    pub fn reap_abandoned(&self) -> usize {
        let mut abandoned = self.abandoned.lock();
        abandoned
            .retain(|req| matches!(self.agent.get_xfer_status(req), Ok(XferStatus::InProgress)));
        abandoned.len()
    }

    /// Number of prepared descriptor-list pairs cached.
    pub fn prepared_pairs(&self) -> usize {
        self.prepared.lock().len()
    }
}

/// How a NIXL part is issued; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NixlMode {
    /// Prepared per-row descriptor lists, reused across fetches; indices per block.
    Prepared,
    /// One descriptor per coalesced run, built per fetch.
    Runs,
    /// One descriptor per block, merging disabled: the naive baseline.
    PerBlock,
}

/// [`CopyBackend`] over a local [`NixlAgent`]: sources must be
/// [`SourceRegion::Nixl`], destinations local memory registered with the agent.
#[derive(Debug, Clone)]
pub struct NixlBackend {
    agent: std::sync::Arc<NixlAgent>,
    mode: NixlMode,
    notify: bool,
}

impl NixlBackend {
    /// Backend issuing parts in `mode`; each finished part sends the donor a
    /// notification `kv-transfer:rank=<r>:bytes=<n>`.
    pub fn new(agent: std::sync::Arc<NixlAgent>, mode: NixlMode) -> Self {
        Self {
            agent,
            mode,
            notify: true,
        }
    }

    /// The agent.
    pub fn agent(&self) -> &std::sync::Arc<NixlAgent> {
        &self.agent
    }

    fn unreachable(rank: u32, remote: &str, e: NixlError) -> TransferError {
        TransferError::DonorUnreachable {
            rank,
            reason: format!("remote agent `{remote}`: {e}"),
        }
    }

    /// Ends a read abandoned with `why` (cancelled, deadline) while in
    /// flight: returns `why` when it finished meanwhile, else keeps the
    /// request and returns [`TransferError::NotQuiesced`], so that its rows
    /// stay orphaned until [`NixlAgent::reap_abandoned`] sees it end.
    ///
    /// Releasing a NIXL request does not stop a UCX read already on the wire
    /// (UCX cancels only receives), and forgetting the remote does not close
    /// its endpoint at once either: over TCP, a read stalled by a cut link
    /// landed in its rows after both, once the link came back (kv-testkit
    /// fault `link_cut_mid_transfer`). Releasing it early also let such a
    /// write land after the rows' memory was freed (heap corruption). So the
    /// request is kept, and its rows are reused only once it has ended.
    fn abandon(
        &self,
        req: nixl_sys::XferRequest,
        remote: &str,
        rank: u32,
        why: TransferError,
    ) -> TransferError {
        match self.agent.agent.get_xfer_status(&req) {
            Ok(XferStatus::Success) => why,
            Ok(XferStatus::InProgress) | Err(_) => {
                self.agent.abandoned.lock().push(req);
                TransferError::NotQuiesced {
                    rank,
                    reason: format!("{why}; the read from `{remote}` is still in flight"),
                }
            }
        }
    }

    fn req_args(&self, part: &PartPlan, skip_merge: bool) -> Result<OptArgs, TransferError> {
        let mut a = self.agent.opt_args()?;
        if self.notify {
            let msg = format!(
                "kv-transfer:rank={}:bytes={}",
                part.tp_rank(),
                part.expected_bytes()
            );
            a.set_has_notification(true)
                .map_err(nixl_err("opt_args_set_has_notif"))?;
            a.set_notification_message(msg.as_bytes())
                .map_err(nixl_err("opt_args_set_notif_msg"))?;
        }
        if skip_merge {
            a.set_skip_descriptor_merge(true)
                .map_err(nixl_err("opt_args_set_skip_desc_merge"))?;
        }
        Ok(a)
    }

    fn prepare_rows(
        &self,
        remote: &str,
        base: u64,
        g: RegionGeometry,
        block_bytes: u64,
        kind: MemoryKind,
        rank: u32,
    ) -> Result<XferDlistHandle, TransferError> {
        let (m, dev) = mem_type(kind);
        let mut list = XferDescList::new(m).map_err(nixl_err("create_xfer_dlist"))?;
        for i in 0..u64::from(g.blocks) {
            list.add_desc(
                (base + i * g.stride_bytes) as usize,
                block_bytes as usize,
                dev,
            );
        }
        self.agent
            .agent
            .prepare_xfer_dlist(remote, &list, Some(&self.agent.opt_args()?))
            .map_err(|e| match (remote.is_empty(), e) {
                (false, e @ NixlError::NotFound) => Self::unreachable(rank, remote, e),
                (_, e) => nixl_err("prep_xfer_dlist")(e),
            })
    }

    fn post(
        &self,
        part: &PartPlan,
        remote: &NixlRemoteRegion,
        io: &RankIo<'_>,
    ) -> Result<(nixl_sys::XferRequest, u64, u64), TransferError> {
        let rank = part.tp_rank();
        let (dst_base, dst_kind) = (io.dst.base_addr(), io.dst.kind());
        match self.mode {
            NixlMode::Prepared => {
                let key = PreparedKey {
                    remote: remote.agent_name.clone(),
                    src_base: remote.base_addr,
                    src_stride: part.src().stride_bytes,
                    src_rows: part.src().blocks,
                    dst_base,
                    dst_stride: part.dst().stride_bytes,
                    dst_rows: part.dst().blocks,
                    block_bytes: part
                        .runs()
                        .first()
                        .map_or(0, |r| r.len / u64::from(r.blocks)),
                };
                let mut cache = self.agent.prepared.lock();
                if !cache.contains_key(&key) {
                    let local = self.prepare_rows(
                        "",
                        dst_base,
                        part.dst(),
                        key.block_bytes,
                        dst_kind,
                        rank,
                    )?;
                    let rem = self.prepare_rows(
                        &remote.agent_name,
                        remote.base_addr,
                        part.src(),
                        key.block_bytes,
                        remote.kind,
                        rank,
                    )?;
                    cache.insert(key.clone(), PreparedPair { local, remote: rem });
                }
                let pair = &cache[&key];
                let (mut li, mut ri) = (Vec::new(), Vec::new());
                for r in part.runs() {
                    for k in 0..r.blocks {
                        li.push((r.dst_block + k) as i32);
                        ri.push((r.src_block + k) as i32);
                    }
                }
                let req = self
                    .agent
                    .agent
                    .make_xfer_req(
                        XferOp::Read,
                        &pair.local,
                        &li,
                        &pair.remote,
                        &ri,
                        Some(&self.req_args(part, false)?),
                    )
                    .map_err(|e| Self::unreachable(rank, &remote.agent_name, e))?;
                Ok((req, li.len() as u64, li.len() as u64 * key.block_bytes))
            }
            NixlMode::Runs | NixlMode::PerBlock => {
                let per_block = self.mode == NixlMode::PerBlock;
                let (lm, ldev) = mem_type(dst_kind);
                let (rm, rdev) = mem_type(remote.kind);
                let mut local = XferDescList::new(lm).map_err(nixl_err("create_xfer_dlist"))?;
                let mut rem = XferDescList::new(rm).map_err(nixl_err("create_xfer_dlist"))?;
                let (mut n, mut bytes) = (0u64, 0u64);
                for r in part.runs() {
                    let pieces = if per_block { r.blocks } else { 1 };
                    let piece = r.len / u64::from(pieces);
                    for k in 0..u64::from(pieces) {
                        local.add_desc(
                            (dst_base + r.dst_offset + k * piece) as usize,
                            piece as usize,
                            ldev,
                        );
                        rem.add_desc(
                            (remote.base_addr + r.src_offset + k * piece) as usize,
                            piece as usize,
                            rdev,
                        );
                        n += 1;
                        bytes += piece;
                    }
                }
                let req = self
                    .agent
                    .agent
                    .create_xfer_req(
                        XferOp::Read,
                        &local,
                        &rem,
                        &remote.agent_name,
                        Some(&self.req_args(part, per_block)?),
                    )
                    .map_err(|e| Self::unreachable(rank, &remote.agent_name, e))?;
                Ok((req, n, bytes))
            }
        }
    }
}

impl CopyBackend for NixlBackend {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn in_flight(&self) -> usize {
        self.agent.reap_abandoned()
    }

    fn copy_part(
        &self,
        part: &PartPlan,
        io: &RankIo<'_>,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        let SourceRegion::Nixl(remote) = io.src else {
            return Err(TransferError::UnsupportedMemory {
                backend: self.name(),
                rank: part.tp_rank(),
                src: format!("mapped {}", io.src.kind()),
                dst: io.dst.kind().to_string(),
            });
        };
        if part.runs().is_empty() {
            return Ok(PartOutcome {
                bytes: 0,
                copies: 0,
                host_payload_bytes: 0,
                transport: "unknown".into(),
            });
        }
        let (req, descs, bytes) = self.post(part, remote, io)?;
        let agent = &self.agent.agent;
        let mut in_flight = agent
            .post_xfer_req(&req, None)
            .map_err(|e| Self::unreachable(part.tp_rank(), &remote.agent_name, e))?;
        // Poll without sleeping: UCX advances a transfer only inside progress
        // calls (here `get_xfer_status`), so a sleep between polls caps the
        // bandwidth at one fragment per sleep (~0.4 GB/s with 20 µs naps).
        while in_flight {
            match agent.get_xfer_status(&req) {
                Ok(XferStatus::Success) => in_flight = false,
                Ok(XferStatus::InProgress) => {
                    if let Err(e) = control.check() {
                        return Err(self.abandon(req, &remote.agent_name, part.tp_rank(), e));
                    }
                    std::thread::yield_now();
                }
                Err(e) => return Err(Self::unreachable(part.tp_rank(), &remote.agent_name, e)),
            }
        }
        // The read has ended: a refusal here leaves nothing in flight.
        let rows = ucx_rows(io.dst.kind(), remote.kind);
        let transport = transport_label(rows.as_deref());
        let host = part_host_payload(
            part.tp_rank(),
            io.dst.kind(),
            remote.kind,
            rows.as_deref(),
            bytes,
        )?;
        Ok(PartOutcome {
            bytes,
            copies: descs,
            host_payload_bytes: host,
            transport,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_config_joins_pairs_and_rejects_separators() {
        let o = |pairs: &[(&str, &str)]| NixlAgentOptions {
            ucx_config: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        assert_eq!(o(&[]).engine_config().unwrap(), "");
        assert_eq!(
            o(&[("TLS", "tcp"), ("NET_DEVICES", "veth1")])
                .engine_config()
                .unwrap(),
            "TLS=tcp,NET_DEVICES=veth1"
        );
        for bad in [("TLS", "tcp,cma"), ("", "x"), ("A=B", "c")] {
            let e = o(&[bad]).engine_config().unwrap_err().to_string();
            assert!(e.contains("ucx_config entry"), "{e}");
        }
    }
}
