//! [`TargetAgent`]: the prefill worker's side of reuse across processes.

use kv_descriptor::{HintEnvelope, SequenceHash};
use kv_transfer::DeliveryControl;
use parking_lot::Mutex;

use super::AgentError;
use crate::{
    check_prompt_prefix, unix_now_ms, CacheUpdate, DirectoryPlane, DirectoryWatch, FetchError,
    FetchExecutor, FetchOutcome, HeardCache, PinAuthKey, RemoteDonor, TCP_ENDPOINT_PREFIX,
};

/// A prefill worker's reuse agent: its [`FetchExecutor`] and a
/// [`HeardCache`] (bounded in time) fed by a directory watch that is
/// opened again whenever it ends ([`crate::watch_reopening`]: a deleted
/// bucket left the agent blind to every donor started later).
///
/// Donor memory is mapped per fetch (host shm, or a CUDA IPC import on the
/// destination GPU; kv-bank's import cache shares one mapping between
/// concurrent fetches and closes it when the last one drops): a donor that
/// closed leaves nothing mapped here once the fetch returned. (The Python
/// wheel's `Target` keeps its CUDA IPC imports between fetches instead,
/// lease-checked at each one, to save the ~1 ms open.) A donor
/// on another host is read over NIXL instead ([`TargetAgent::fetch_nixl`]:
/// its NIXL agent loaded from the record, nothing mapped here).
pub struct TargetAgent {
    executor: FetchExecutor,
    destination_gpus: Option<Vec<u32>>,
    pin_auth_key: Option<PinAuthKey>,
    state: Mutex<State>,
    clock: Box<dyn Fn() -> u64 + Send + Sync>,
}

struct State {
    cache: HeardCache,
    watch: DirectoryWatch,
}

impl std::fmt::Debug for TargetAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetAgent")
            .field("executor", &self.executor)
            .field("donors", &self.state.lock().cache.cache().len())
            .finish()
    }
}

impl TargetAgent {
    /// An agent fetching with `executor`, resolving donors from `directory`
    /// (watched from now on). `destination_gpus[r]` is the CUDA ordinal that
    /// reads rank `r` (the executor's region of rank `r`); `None` on a CPU
    /// target, which then refuses GPU donors.
    ///
    /// # Errors
    /// [`AgentError::InvalidConfig`] naming `destination_gpus` when empty
    /// (a count other than the donor's TP size is refused per fetch, as
    /// [`crate::RemoteDonorError::MapCount`]); [`AgentError::Plane`] when the watch cannot start.
    pub async fn connect(
        executor: FetchExecutor,
        directory: std::sync::Arc<dyn DirectoryPlane>,
        destination_gpus: Option<Vec<u32>>,
    ) -> Result<Self, AgentError> {
        Self::connect_with_clock(executor, directory, destination_gpus, unix_now_ms).await
    }

    /// [`TargetAgent::connect`] reading time (Unix epoch ms) from `clock`,
    /// so lease lapse is testable without sleeping.
    ///
    /// # Errors
    /// As [`TargetAgent::connect`].
    pub async fn connect_with_clock(
        executor: FetchExecutor,
        directory: std::sync::Arc<dyn DirectoryPlane>,
        destination_gpus: Option<Vec<u32>>,
        clock: impl Fn() -> u64 + Send + Sync + 'static,
    ) -> Result<Self, AgentError> {
        if destination_gpus.as_ref().is_some_and(|g| g.is_empty()) {
            return Err(AgentError::InvalidConfig {
                field: "destination_gpus",
                reason: "empty: give one ordinal per TP rank, or None on a CPU target".into(),
            });
        }
        let watch = crate::watch_reopening(directory).await?;
        Ok(Self {
            executor,
            destination_gpus,
            pin_auth_key: None,
            state: Mutex::new(State {
                cache: HeardCache::default(),
                watch,
            }),
            clock: Box::new(clock),
        })
    }

    /// Proves `key` on every `tcp:` pin endpoint this agent dials (the
    /// donor's [`crate::DonorAgentConfig::pin_auth_key`]). Without it a TCP
    /// donor refuses the pin ([`crate::PinError::Auth`] inside
    /// [`AgentError::Fetch`]) and the request recomputes.
    pub fn with_pin_auth_key(mut self, key: PinAuthKey) -> Self {
        self.pin_auth_key = Some(key);
        self
    }

    /// The executor (its pool, in-flight reads).
    pub fn executor(&self) -> &FetchExecutor {
        &self.executor
    }

    /// Applies every directory change delivered so far; returns what each did.
    pub fn refresh(&self) -> Vec<CacheUpdate> {
        let mut st = self.state.lock();
        let now = (self.clock)();
        let mut out = Vec::new();
        while let Some(c) = st.watch.try_next() {
            out.push(st.cache.apply(c, now).update);
        }
        out
    }

    /// Resolves `donor` from the directory (a lapsed lease or stale
    /// generation is refused, as for [`TargetAgent::fetch`]) and loads the
    /// NIXL agent its record publishes into `agent` (this worker's NIXL
    /// agent, `load_remote`); returns the remote agent's name, which
    /// `kv_transfer::NixlRemoteRegion::agent_name` then names for reads
    /// from that donor. Loading the same metadata again is harmless.
    ///
    /// # Errors
    /// [`AgentError::Resolve`] for an unknown, lapsed or stale donor;
    /// [`AgentError::NoNixlAgent`] when its record carries none;
    /// [`AgentError::Nixl`] when the runtime refuses the metadata;
    /// [`AgentError::NixlAgentMismatch`] when it loads as another agent
    /// (the remote is forgotten again). Each means: recompute.
    pub fn load_donor_nixl(
        &self,
        donor: kv_descriptor::EngineId,
        agent: &kv_transfer::nixl::NixlAgent,
    ) -> Result<String, AgentError> {
        self.refresh();
        let record = {
            let st = self.state.lock();
            st.cache.cache().get(donor, (self.clock)())?.clone()
        };
        let (Some(published), Some(metadata)) =
            (record.nixl_agent_name(), record.nixl_agent_metadata())
        else {
            return Err(AgentError::NoNixlAgent { donor });
        };
        let loaded = agent.load_remote(metadata).map_err(AgentError::Nixl)?;
        if loaded != published {
            // Do not keep an agent this record did not vouch for.
            let _ = agent.forget_remote(&loaded);
            return Err(AgentError::NixlAgentMismatch {
                published: published.to_string(),
                loaded,
            });
        }
        Ok(loaded)
    }

    /// Runs `envelope` for a request whose prompt's sealed blocks hash to
    /// `prompt`: the hint is checked against the prompt, its donor resolved
    /// from the directory (a lapsed lease or stale generation is refused),
    /// the donor's memory mapped and the fetch executed.
    ///
    /// # Errors
    /// Every error is a fallback (recompute): [`AgentError::Fetch`] for a
    /// malformed hint, a prompt mismatch or a failed fetch;
    /// [`AgentError::Resolve`] for an unknown, lapsed or stale donor;
    /// [`AgentError::InvalidConfig`] naming `destination_gpus` for a GPU
    /// donor on a CPU target; [`AgentError::OpenDonor`] when its memory
    /// cannot be mapped (its bank closed meanwhile).
    pub fn fetch(
        &self,
        envelope: &HintEnvelope,
        prompt: &[SequenceHash],
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, AgentError> {
        let record = self.resolve_hint(envelope, prompt)?;
        let manifest = record.manifest().clone();
        let gpu = manifest.parts().iter().any(|d| d.location().is_gpu());
        let donor = if gpu {
            let Some(g) = &self.destination_gpus else {
                return Err(AgentError::InvalidConfig {
                    field: "destination_gpus",
                    reason: "the donor's bank is on a GPU and this target has no GPU".into(),
                });
            };
            RemoteDonor::open_cuda_ipc(manifest, g, record.pin_endpoint())?
        } else {
            RemoteDonor::open_host_shm(manifest, record.pin_endpoint())?
        };
        let donor = match &self.pin_auth_key {
            Some(key) if record.pin_endpoint().starts_with(TCP_ENDPOINT_PREFIX) => {
                donor.with_auth_key(key.clone())
            }
            _ => donor,
        };
        Ok(self
            .executor
            .execute_for_prompt(envelope, prompt, &donor, control)?)
    }
    /// [`TargetAgent::fetch`] from a donor read over NIXL (a donor on
    /// another host, or any donor whose bank memory its NIXL agent
    /// registered), from its directory record alone: the donor's NIXL
    /// agent is loaded into `agent` ([`TargetAgent::load_donor_nixl`]),
    /// rank `r`'s source is the record's `nixl_rank_regions[r]` (the memory
    /// the donor's agent registered, published by
    /// [`crate::DonorAgent::publish_nixl_agent`]), the slots are pinned over
    /// the record's pin endpoint, and the executor (which must run on a
    /// `kv_transfer::nixl::NixlBackend` over `agent`, its rows registered
    /// with `agent`) READs the pinned slots into its rows and verifies them
    /// like any other source. VRAM reads complete only over a device-direct
    /// UCX transport (else `HostStaged` / `TransportUnverified`: recompute).
    ///
    /// # Errors
    /// Every error is a fallback (recompute): those of
    /// [`TargetAgent::fetch`] (stale generation, unknown or lapsed donor,
    /// failed pin or read: [`AgentError::Fetch`] holds the transfer error,
    /// e.g. `DonorUnreachable` for a donor gone mid-read); those of
    /// [`TargetAgent::load_donor_nixl`] ([`AgentError::NoNixlAgent`],
    /// [`AgentError::Nixl`], [`AgentError::NixlAgentMismatch`]);
    /// [`AgentError::NoNixlRegions`] when the record names a NIXL agent but
    /// not its rank regions (a donor that predates them): checked before
    /// the agent is loaded or anything pinned.
    pub fn fetch_nixl(
        &self,
        envelope: &HintEnvelope,
        prompt: &[SequenceHash],
        agent: &kv_transfer::nixl::NixlAgent,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, AgentError> {
        let record = self.resolve_hint(envelope, prompt)?;
        let donor = record.engine_id();
        if record.nixl_agent_name().is_some() && record.nixl_rank_regions().is_none() {
            return Err(AgentError::NoNixlRegions { donor });
        }
        let agent_name = self.load_donor_nixl(donor, agent)?;
        // The record guarantees regions whenever it names an agent.
        let Some(published) = record.nixl_rank_regions() else {
            return Err(AgentError::NoNixlRegions { donor });
        };
        let regions = published
            .iter()
            .map(|r| kv_transfer::NixlRemoteRegion {
                agent_name: agent_name.clone(),
                base_addr: r.base_addr,
                len: r.len,
                kind: r.memory_kind(),
            })
            .collect();
        let remote =
            RemoteDonor::open_nixl(record.manifest().clone(), regions, record.pin_endpoint())?;
        let remote = match &self.pin_auth_key {
            Some(key) if record.pin_endpoint().starts_with(TCP_ENDPOINT_PREFIX) => {
                remote.with_auth_key(key.clone())
            }
            _ => remote,
        };
        Ok(self
            .executor
            .execute_for_prompt(envelope, prompt, &remote, control)?)
    }

    /// Checks `envelope` (exactly one `kv.fetch_gpu` action) against
    /// `prompt`, then resolves its donor's record, whose generation must be
    /// the hint's (else `FetchError::StaleGeneration`).
    fn resolve_hint(
        &self,
        envelope: &HintEnvelope,
        prompt: &[SequenceHash],
    ) -> Result<crate::DonorRecord, AgentError> {
        let mut hints = envelope.fetch_gpu_actions().map_err(FetchError::from)?;
        if hints.len() != 1 {
            return Err(
                FetchError::Malformed(kv_descriptor::DescriptorError::InvalidField {
                    field: "hint.actions",
                    reason: format!(
                        "expected exactly one kv.fetch_gpu action, got {}",
                        hints.len()
                    ),
                })
                .into(),
            );
        }
        let hint = hints.remove(0);
        // Cheapest first: a hint for another prompt maps nothing.
        check_prompt_prefix(&hint, prompt)?;
        self.refresh();
        let record = {
            let st = self.state.lock();
            st.cache
                .cache()
                .get(hint.donor_engine_id, (self.clock)())?
                .clone()
        };
        if record.generation() != hint.bank_generation {
            return Err(FetchError::StaleGeneration {
                hint: hint.bank_generation,
                manifest: record.generation(),
            }
            .into());
        }
        Ok(record)
    }
}
