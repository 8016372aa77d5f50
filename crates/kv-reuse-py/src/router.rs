//! The router role in-process: an inventory index fed with KV events, a
//! directory of donors (manifest, control endpoint, slot of each block), and
//! the advisor that emits fetch hints.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kv_descriptor::{BankManifest, EngineId, KvEvent, Role, SequenceHash, Wire};
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
use kv_router_glue::{
    Advisor, CostModel, DecisionLog, DonorDirectory, LiveCostModel, ResolveError, ResolvedDonor,
};

use crate::advice::Advice;
use crate::donor::pin_endpoint;
use crate::errors::{bad_argument, descriptor, lookup, uint, uint_in, uints};
use crate::layout::{engine_id, Layout};
use crate::reprs::Repr;
use crate::settings::Settings;

/// Donors known to this router by what they reported: the manifest, the
/// control endpoint and a sequence-hash -> slot table (the donor's
/// `DonorBank.slots`). A stand-in until the cross-process directory lands.
#[derive(Default)]
struct ReportedDirectory {
    donors: RwLock<HashMap<EngineId, ReportedDonor>>,
}

/// A donor's manifest, control endpoint and sequence-hash -> slot table.
type ReportedDonor = (BankManifest, String, HashMap<u64, u32>);

impl DonorDirectory for ReportedDirectory {
    fn resolve(
        &self,
        donor: EngineId,
        hashes: &[SequenceHash],
    ) -> Result<ResolvedDonor, ResolveError> {
        let donors = self.donors.read().unwrap_or_else(|e| e.into_inner());
        let (manifest, endpoint, slots) = donors
            .get(&donor)
            .ok_or(ResolveError::UnknownDonor { donor })?;
        let slot_ids = hashes
            .iter()
            .enumerate()
            .map(|(index, h)| {
                slots
                    .get(&h.0)
                    .copied()
                    .ok_or(ResolveError::BlockGone { index, hash: *h })
            })
            .collect::<Result<Vec<u32>, _>>()?;
        Ok(ResolvedDonor {
            manifest: manifest.clone(),
            slot_ids,
            control_endpoint: endpoint.clone(),
        })
    }
}

/// An in-process router: index + donor directory + advisor.
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct Router {
    index: Arc<InventoryIndex>,
    directory: Arc<ReportedDirectory>,
    advisor: Advisor,
    /// As given, for the repr.
    tokens_per_block: u32,
    max_probes: u32,
}

fn role(s: &str) -> PyResult<Role> {
    match s {
        "decode" => Ok(Role::Decode),
        "prefill" => Ok(Role::Prefill),
        other => Err(bad_argument(
            "role_name",
            format!("`{other}` is not decode or prefill"),
        )),
    }
}

/// A lookup's probe budget by default (and for `Router(max_probes=None)`).
const MAX_PROBES: u32 = 16384;
// The literal of `Router`'s signature, so that `inspect.signature` shows it.
const _: () = assert!(MAX_PROBES == 16384);

/// `max_probes` as given: an int in 1..=u32::MAX, or None for the default.
fn max_probes_arg(v: &Bound<'_, PyAny>) -> PyResult<u32> {
    crate::errors::uint_in_or("max_probes", v, 1..=u64::from(u32::MAX), MAX_PROBES)
}

#[pymethods]
impl Router {
    /// A router deciding with `settings` for blocks of `tokens_per_block`.
    ///
    /// Raises `SettingsRefused` when the cost model cannot use the settings,
    /// `BadArgument` naming `tokens_per_block` or `max_probes` when 0 (no
    /// block could be hashed, no lookup could probe: every advise would be
    /// refused), negative or past u32.
    #[new]
    #[pyo3(signature = (settings, tokens_per_block, max_probes = 16384))]
    fn new(
        settings: &Settings,
        tokens_per_block: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = "max_probes_arg")] max_probes: u32,
    ) -> PyResult<Self> {
        let tokens_per_block: u32 = uint_in(
            "tokens_per_block",
            tokens_per_block,
            1..=u64::from(u32::MAX),
        )?;
        let model = CostModel::new(settings.inner.settings.clone(), tokens_per_block)
            .map_err(crate::errors::settings)?;
        let index = Arc::new(InventoryIndex::new());
        let directory = Arc::new(ReportedDirectory::default());
        let advisor = Advisor::new(
            index.clone(),
            directory.clone(),
            LiveCostModel::new(model),
            Arc::new(DecisionLog::new(256)),
            max_probes,
        );
        Ok(Self {
            index,
            directory,
            advisor,
            tokens_per_block,
            max_probes,
        })
    }

    /// Registers worker `key` (engine id, `"decode"` or `"prefill"`, layout).
    ///
    /// Raises `BadArgument` naming `key` (negative, past u64), `engine`,
    /// `role_name`, or `layout` when its tokens per block differ from the
    /// router's (its blocks' hashes could never match a prompt's, so
    /// reuse would be off for it without a word); `LookupFailed` when the
    /// index refuses the worker.
    fn register_worker(
        &self,
        key: &Bound<'_, PyAny>,
        engine: &str,
        role_name: &str,
        layout: Layout,
    ) -> PyResult<()> {
        let key: u64 = uint("key", key)?;
        let given = layout.inner.tokens_per_block();
        // This router's model is always built with a block size.
        let ours = self.advisor.model().current().tokens_per_block();
        if let Some(ours) = ours.filter(|&ours| ours != given) {
            return Err(bad_argument(
                "layout",
                format!("{given} tokens per block, this router hashes blocks of {ours}"),
            ));
        }
        let info = WorkerInfo {
            engine: engine_id(engine, "engine")?,
            role: role(role_name)?,
            layout_fingerprint: layout.inner.fingerprint(),
            tp_size: layout.inner.tp_size(),
        };
        self.index
            .register_worker(WorkerKey(key), info)
            .map_err(lookup)
            .map(|_| ())
    }

    /// Applies one KV event (MessagePack, as `DonorBank.drain_events` gives).
    fn apply_event(&self, event: &[u8]) -> PyResult<()> {
        let e = KvEvent::from_wire(event).map_err(descriptor)?;
        self.index.apply_event(&e).map_err(lookup).map(|_| ())
    }

    /// Records a donor: its manifest (wire form), control endpoint and the
    /// slot of each block it holds (`{sequence_hash: slot}`), replacing any
    /// earlier report of that donor whole: `slots` must map every block the
    /// donor holds (merge each store's slots into one dict), not the last
    /// store's only, or the blocks left out are refused as no longer held.
    ///
    /// Raises `DescriptorRefused` for a manifest that does not decode,
    /// `BadArgument` naming `endpoint` (not a pin endpoint that parses:
    /// scheme, path length, the parse `DonorBank.serve_pins` runs; a
    /// `unix:` socket path that is relative, which each target would
    /// resolve against its own working directory; a `tcp:` endpoint
    /// parses, since a Rust donor may serve one with a pre-shared key,
    /// although `serve_pins` itself refuses `tcp:`), `slots` (a hash key
    /// negative or past u64) or `slots[h]` (a slot negative, past u32 or
    /// past the manifest's slot count). Nothing is recorded when it raises.
    fn report_donor(
        &self,
        manifest: &[u8],
        endpoint: &str,
        slots: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        // A hint carrying it would only fail at the target's pin exchange,
        // as a fallback far from this call.
        pin_endpoint("endpoint", endpoint)?;
        let slots = slots
            .iter()
            .map(|(h, s)| {
                let hash: u64 = uint("slots", &h)?;
                Ok((hash, uint(&format!("slots[{hash}]"), &s)?))
            })
            .collect::<PyResult<HashMap<u64, u32>>>()?;
        let m = BankManifest::from_wire(manifest).map_err(descriptor)?;
        // A slot past the bank would be refused only at the donor's pin
        // check, as a fallback far from this call.
        if let Some((hash, slot)) = slots.iter().find(|(_, &s)| s >= m.slot_count()) {
            return Err(bad_argument(
                &format!("slots[{hash}]"),
                format!("{slot} is past the manifest's {} slots", m.slot_count()),
            ));
        }
        let engine = m.owner().engine_id;
        self.directory
            .donors
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(engine, (m, endpoint.to_owned(), slots));
        Ok(())
    }

    /// Advises request `request_id` (prompt block hashes `sequence_hashes`)
    /// routed to prefill engine `target`. Releases the GIL for the lookup.
    ///
    /// Raises `BadArgument` naming `target` (not a UUID) or
    /// `sequence_hashes[i]` (negative, past u64).
    fn advise(
        &self,
        py: Python<'_>,
        request_id: &str,
        sequence_hashes: &Bound<'_, PyAny>,
        target: &str,
    ) -> PyResult<Advice> {
        let hashes: Vec<SequenceHash> = uints::<u64>("sequence_hashes", sequence_hashes)?
            .into_iter()
            .map(SequenceHash)
            .collect();
        let target = engine_id(target, "target")?;
        let advice = py.allow_threads(|| self.advisor.advise(request_id, &hashes, target));
        Advice::new(py, &advice.decision, advice.hint.as_ref())
    }

    /// `<kv_reuse.Router tokens_per_block=64 max_probes=16384 workers=2
    /// donors=1>`: the workers registered and the donors reported.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let donors = self
            .directory
            .donors
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len();
        Ok(Repr::object(py, "Router")
            .field("tokens_per_block", self.tokens_per_block)?
            .field("max_probes", self.max_probes)?
            .field("workers", self.index.stats().workers)?
            .field("donors", donors)?
            .finish())
    }
}
