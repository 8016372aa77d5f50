//! `StreamGate`: lets the engine launch its forward pass while a fetch is
//! still running (the copies overlap the forward's host-side launch).
//!
//! A fetch given a gate (`Target.fetch(..., gate=g)`, called from another
//! Python thread) makes the gate's CUDA stream wait for its copies as soon as
//! they are issued (`kv_transfer::ConsumerStream`: an event recorded after the
//! copies, `cuStreamWaitEvent`) and opens the gate; `g.wait()` in the engine's
//! thread returns True then, and the engine enqueues its forward on that
//! stream. The fetch's host side (copy completion, donor probe, pin release,
//! verification, commit) goes on meanwhile; the engine must still take the
//! fetch's result before it uses anything computed on the fetched rows, and
//! discard that work when the fetch raised (`FetchFellBack`): no false
//! completion.
//!
//! With `layer_groups=G` (G >= 2) the fetch is released layer group by
//! layer group instead (`kv_transfer::ConsumerStream::with_layer_groups`):
//! a converting part is launched per group, and the engine calls
//! `g.wait_layer(l)` before layer `l` reads its KV, which makes the stream
//! wait for that layer's group only, so the forward's first layers run
//! while later layers are still being copied (vLLM's connector calls this
//! point `wait_for_layer_load`).
//!
//! Invariants: a gate serves one fetch (a second is refused, `BadArgument`
//! naming `gate`); `wait` and `wait_layer` return on every path of that
//! fetch, because the fetch marks the gate ended when it returns or raises,
//! before or after the copies; True from `wait` means every rank part
//! delivering to the gate's device was enqueued behind the wait (layered:
//! every part's first group was issued); True from `wait_layer(l)` means
//! the stream now waits for layer `l`'s group of every such part (and for
//! every earlier group).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::errors::{bad_argument, uint, uint_in};
use crate::fetch_job::SIGNAL_SLICE;

/// What the fetch told the gate so far.
#[derive(Debug, Default)]
struct GateState {
    /// A fetch took the gate.
    armed: bool,
    /// Rank parts that deliver to the gate's device (set when armed).
    parts: u32,
    /// Of those, parts whose copies the stream now waits for.
    enqueued: u32,
    /// The fetch returned or raised.
    ended: bool,
    /// First fetched block and blocks fetched (set when armed).
    fetch_from: u32,
    blocks: u32,
    /// When the gate was made, a fetch took it, its copies were all
    /// enqueued, and the fetch ended.
    created: Option<Instant>,
    armed_at: Option<Instant>,
    enqueued_at: Option<Instant>,
    ended_at: Option<Instant>,
    /// Layer groups issued so far (layered gates), in arrival order, and
    /// whether the stream was made to wait for each.
    groups: Vec<(kv_transfer::LayersReady, bool)>,
    /// Parts whose first layer group was issued.
    first_groups: u32,
    /// When the first and the last layer group arrived.
    first_group_at: Option<Instant>,
    last_group_at: Option<Instant>,
}

impl GateState {
    /// Every rank part delivering to the gate's device was enqueued.
    fn is_open(&self, layered: bool) -> bool {
        let issued = if layered {
            self.first_groups
        } else {
            self.enqueued
        };
        self.armed && self.parts > 0 && issued >= self.parts
    }

    /// Groups of every part that cover `layer` were issued.
    fn covers(&self, layer: u32) -> bool {
        let n = self
            .groups
            .iter()
            .filter(|(g, _)| g.layers().contains(&layer))
            .count() as u32;
        self.armed && self.parts > 0 && n >= self.parts
    }
}

#[derive(Debug, Default)]
pub(crate) struct GateShared {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl GateShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks until `ready` returns Some (its value: [`Waited::Ready`]), or
    /// the fetch ended ([`Waited::Ended`]) or `until` passed
    /// ([`Waited::TimedOut`]); `ready` is tried first on every wake-up, so
    /// a condition met by the fetch's last notice wins over its end.
    fn wait_for<T>(
        &self,
        until: Instant,
        mut ready: impl FnMut(&mut GateState) -> Option<T>,
    ) -> Waited<T> {
        let mut s = self.lock();
        loop {
            if let Some(t) = ready(&mut s) {
                return Waited::Ready(t);
            }
            if s.ended {
                return Waited::Ended;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Waited::TimedOut;
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// [`GateShared::wait_for`] from Python: without the GIL, in slices of
    /// at most [`SIGNAL_SLICE`] between which pending signals run their
    /// handlers (`py.check_signals()`), so a Ctrl-C raises
    /// `KeyboardInterrupt` within a slice. A gate no fetch ever takes would
    /// otherwise block `wait()` forever, deaf to SIGINT. `None` when the
    /// fetch ended without `ready` or `limit` passed.
    fn wait_from_python<T: Send>(
        &self,
        py: Python<'_>,
        limit: Option<Instant>,
        mut ready: impl FnMut(&mut GateState) -> Option<T> + Send,
    ) -> PyResult<Option<T>> {
        loop {
            let slice = Instant::now() + SIGNAL_SLICE;
            let until = limit.map_or(slice, |l| l.min(slice));
            match py.allow_threads(|| self.wait_for(until, &mut ready)) {
                Waited::Ready(t) => return Ok(Some(t)),
                Waited::Ended => return Ok(None),
                Waited::TimedOut if limit.is_some_and(|l| Instant::now() >= l) => return Ok(None),
                Waited::TimedOut => py.check_signals()?,
            }
        }
    }
}

/// How a [`GateShared::wait_for`] ended.
enum Waited<T> {
    Ready(T),
    Ended,
    TimedOut,
}

/// `layer_group_ranges(layers, groups)`: the layer groups (Python `range`s,
/// in layer order) a fetch released to a `StreamGate(..., layer_groups=groups)`
/// is cut into for a model of `layers` layers, as `kv_transfer::layer_group_ranges`
/// cuts them: `min(groups, layers)` contiguous ranges, sizes differing by at
/// most one, larger first. An engine hooks the first layer of each.
/// Raises `BadArgument` naming `layers` / `groups` for a negative int, for
/// `layers` 0, and for `groups` outside 1..=1024 (what `StreamGate`'s
/// `layer_groups` accepts: a larger count once asked the allocator for
/// 8 bytes a group, 34 GB for 2^32 - 1, and aborted the interpreter).
///
/// ```text
/// >>> [r.start for r in kv_reuse.layer_group_ranges(32, 8)]
/// [0, 4, 8, 12, 16, 20, 24, 28]
/// ```
#[pyfunction]
pub(crate) fn layer_group_ranges<'py>(
    py: Python<'py>,
    layers: &Bound<'py, PyAny>,
    groups: &Bound<'py, PyAny>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let layers: u32 = uint_in("layers", layers, 1..=u64::from(u32::MAX))?;
    let groups: u32 = uint_in("groups", groups, 1..=u64::from(MAX_LAYER_GROUPS))?;
    let range = py.import("builtins")?.getattr("range")?;
    kv_transfer::layer_group_ranges(layers, groups)
        .into_iter()
        .map(|r| range.call1((r.start, r.end)))
        .collect()
}

/// The instant `timeout_s` seconds from now (None: no limit); `BadArgument`
/// naming `timeout_s` unless it is in (0, 3600].
fn deadline(timeout_s: Option<f64>) -> PyResult<Option<Instant>> {
    match timeout_s {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s <= 3600.0 => {
            Ok(Some(Instant::now() + Duration::from_secs_f64(s)))
        }
        Some(s) => Err(bad_argument(
            "timeout_s",
            format!("{s} is not in (0, 3600] seconds"),
        )),
    }
}

/// Marks the gate ended when dropped: every return path of a fetch, a
/// panic unwinding through it included.
pub(crate) struct GateEnd(Arc<GateShared>);

impl Drop for GateEnd {
    fn drop(&mut self) {
        {
            let mut s = self.0.lock();
            s.ended = true;
            s.ended_at = Some(Instant::now());
        }
        self.0.changed.notify_all();
    }
}

/// A CUDA stream of the engine that a fetch releases as soon as its copies
/// are issued: `StreamGate(stream, device)`, `stream` the raw `CUstream`
/// handle (torch: `torch.cuda.current_stream(device).cuda_stream`), `device`
/// its CUDA ordinal.
///
/// ```text
/// gate = kv_reuse.StreamGate(torch.cuda.current_stream().cuda_stream, 0)
/// fut = pool.submit(target.fetch, hint, hashes, manifest, gate=gate)
/// if gate.wait():                      # copies issued, the stream waits for them
///     cache.set_length((gate.fetch_from + gate.blocks) * T)
///     logits = model(...)              # enqueued behind the copies
/// out = fut.result()                   # FetchFellBack: discard logits, recompute
/// ```
///
/// The stream must be a stream of that device's primary context (torch's
/// streams are) and stay alive until the fetch returned; the handle is passed
/// to the CUDA driver as it is. Raises `BadArgument` naming `stream` or
/// `device` for a negative int or one past u64 / u32.
///
/// `layer_groups` (int, 1..=1024; None or 1: the whole fetch at once): cut a
/// converting fetch into that many layer groups
/// (`kv_reuse.layer_group_ranges(layers, layer_groups)`), each released on
/// its own; the engine then calls `wait_layer(l)` before layer `l` reads
/// its KV (a forward pre-hook on each group's first layer does):
///
/// ```text
/// gate = kv_reuse.StreamGate(stream, 0, layer_groups=8)
/// fut = pool.submit(target.fetch, hint, hashes, manifest, gate=gate)
/// if gate.wait():                      # the first group is issued
///     starts = {r.start for r in kv_reuse.layer_group_ranges(32, 8)}
///     hooks = [layers[i].register_forward_pre_hook(lambda m, a, i=i: gate.wait_layer(i))
///              for i in starts]
///     logits = model(...)              # layer l reads its KV after its group landed
/// ```
///
/// Raises `BadArgument` naming `layer_groups` outside 1..=1024.
#[pyclass(module = "kv_reuse", frozen)]
pub(crate) struct StreamGate {
    stream: u64,
    device: u32,
    /// Layer groups asked for (>= 2), None for the whole fetch at once.
    layer_groups: Option<u32>,
    shared: Arc<GateShared>,
}

/// Most layer groups a gate may ask for.
const MAX_LAYER_GROUPS: u32 = 1024;

#[pymethods]
impl StreamGate {
    #[new]
    #[pyo3(signature = (stream, device, layer_groups = None))]
    fn new(
        stream: &Bound<'_, PyAny>,
        device: &Bound<'_, PyAny>,
        layer_groups: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let layer_groups = match layer_groups {
            None => None,
            Some(v) => uint_in::<u32>("layer_groups", v, 1..=u64::from(MAX_LAYER_GROUPS))
                .map(|g| Some(g).filter(|&g| g > 1))?,
        };
        let shared = Arc::new(GateShared::default());
        shared.lock().created = Some(Instant::now());
        Ok(Self {
            stream: uint("stream", stream)?,
            device: uint("device", device)?,
            layer_groups,
            shared,
        })
    }

    /// Blocks (GIL released) until the fetch's copies to this device are
    /// issued and the stream waits for them (True), or the fetch ended
    /// without that (False: it raised before any copy, delivers to another
    /// device only, or ran on a backend without streams), or `timeout_s`
    /// passed (False). After False, take the fetch's result before reading
    /// the rows. Without `timeout_s` a gate that no fetch takes waits
    /// forever, so the wait wakes every ~50 ms to run pending signal
    /// handlers: Ctrl-C raises `KeyboardInterrupt` (as in
    /// `FetchJob.result`), and the gate stays usable. Raises `BadArgument`
    /// naming `timeout_s` unless it is in (0, 3600] seconds.
    #[pyo3(signature = (timeout_s = None))]
    fn wait(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = "crate::errors::seconds_or_none")] timeout_s: Option<f64>,
    ) -> PyResult<bool> {
        let limit = deadline(timeout_s)?;
        let layered = self.layer_groups.is_some();
        Ok(self
            .shared
            .wait_from_python(py, limit, |s| s.is_open(layered).then_some(()))?
            .is_some())
    }

    /// Layered gates: blocks (GIL released) until layer `layer`'s group of
    /// every rank part delivering to this device was issued, makes the
    /// stream wait for it (and for every earlier group not waited for yet),
    /// and returns True; False when the fetch ended without issuing it (it
    /// raised: take its result, discard what was computed) or `timeout_s`
    /// passed. Call it on the engine's thread right before the layer's
    /// kernels are enqueued. Without layer groups it is `wait(timeout_s)`.
    /// Ctrl-C raises `KeyboardInterrupt` within ~50 ms, as in `wait`.
    /// Raises `BadArgument` naming `timeout_s` as `wait`, and
    /// `KvReuseError` when the driver refuses the stream wait.
    #[pyo3(signature = (layer, timeout_s = None))]
    fn wait_layer(
        &self,
        py: Python<'_>,
        layer: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = "crate::errors::seconds_or_none")] timeout_s: Option<f64>,
    ) -> PyResult<bool> {
        let layer: u32 = uint("layer", layer)?;
        if self.layer_groups.is_none() {
            return self.wait(py, timeout_s);
        }
        let limit = deadline(timeout_s)?;
        let due: Option<Vec<kv_transfer::LayersReady>> =
            self.shared.wait_from_python(py, limit, |s| {
                // This layer's groups and every earlier one not waited for.
                s.covers(layer).then(|| {
                    s.groups
                        .iter_mut()
                        .filter(|(g, waited)| !*waited && g.layers().start <= layer)
                        .map(|(g, waited)| {
                            *waited = true;
                            g.clone()
                        })
                        .collect()
                })
            })?;
        let Some(due) = due else {
            return Ok(false);
        };
        // SAFETY: `StreamGate`'s documented contract: `stream` is a live
        // stream of device `device`'s primary context while the engine
        // uses the gate (it is the stream the engine enqueues on).
        let on =
            unsafe { kv_transfer::ConsumerStream::new(self.device, self.stream, Arc::new(|_| {})) };
        for g in &due {
            g.enqueue_wait(&on)
                .map_err(|e| crate::errors::KvReuseError::new_err(e.to_string()))?;
        }
        Ok(true)
    }

    /// Layer groups asked for (None: the whole fetch at once).
    #[getter]
    fn layer_groups(&self) -> Option<u32> {
        self.layer_groups
    }

    /// Layered gates: the layer ranges `(start, end)` of the groups issued
    /// so far, in arrival order (a part that could not be cut by layer is
    /// one group `(0, 2**32 - 1)`); `[]` otherwise.
    #[getter]
    fn groups_issued(&self) -> Vec<(u32, u32)> {
        let s = self.shared.lock();
        s.groups
            .iter()
            .map(|(g, _)| (g.layers().start, g.layers().end))
            .collect()
    }

    /// True once the stream waits for every copy of the fetch to this
    /// device (layered: once every part issued its first group).
    #[getter]
    fn enqueued(&self) -> bool {
        self.shared.lock().is_open(self.layer_groups.is_some())
    }

    /// True once the fetch returned or raised.
    #[getter]
    fn ended(&self) -> bool {
        self.shared.lock().ended
    }

    /// The first prompt block the fetch delivers (its hint's `fetch_from`),
    /// once a fetch took the gate; None before.
    #[getter]
    fn fetch_from(&self) -> Option<u32> {
        let s = self.shared.lock();
        s.armed.then_some(s.fetch_from)
    }

    /// Blocks the fetch delivers (from `fetch_from` on), once a fetch took
    /// the gate; None before.
    #[getter]
    fn blocks(&self) -> Option<u32> {
        let s = self.shared.lock();
        s.armed.then_some(s.blocks)
    }

    /// µs from the gate's construction to each point reached so far:
    /// `armed` (a fetch took it: its arguments parsed), `enqueued` (the
    /// stream waits for every copy; layered: every part issued all its
    /// groups), `ended` (the fetch returned or raised), and for layered
    /// gates `first_group` / `last_group` (the first and the last layer
    /// group issued); a point not reached is absent.
    #[getter]
    fn times_us(&self) -> std::collections::BTreeMap<&'static str, u64> {
        let s = self.shared.lock();
        let created = s.created.unwrap_or_else(Instant::now);
        [
            ("armed", s.armed_at),
            ("enqueued", s.enqueued_at),
            ("ended", s.ended_at),
            ("first_group", s.first_group_at),
            ("last_group", s.last_group_at),
        ]
        .into_iter()
        .filter_map(|(k, t)| {
            t.map(|t| (k, t.saturating_duration_since(created).as_micros() as u64))
        })
        .collect()
    }

    /// The raw `CUstream` handle given.
    #[getter]
    fn stream(&self) -> u64 {
        self.stream
    }

    /// The CUDA ordinal given.
    #[getter]
    fn device(&self) -> u32 {
        self.device
    }

    /// `<kv_reuse.StreamGate stream=0x1234 device=0 layer_groups=None
    /// armed=False enqueued=0 parts=0 groups=0 ended=False>`: the object
    /// form, as the gate wraps a live CUDA stream and holds the state of the
    /// fetch that took it (`armed`; `enqueued` of the `parts` delivering to
    /// its device; layer `groups` released; `ended`), which no constructor
    /// call rebuilds. The handle in hex as CUDA tools print it, the rest as
    /// Python writes it (it printed Rust's `Some(4)` and `true`).
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (armed, enqueued, parts, groups, ended) = {
            let s = self.shared.lock();
            (s.armed, s.enqueued, s.parts, s.groups.len(), s.ended)
        };
        Ok(crate::reprs::Repr::object(py, "StreamGate")
            .shown("stream", &format!("{:#x}", self.stream))
            .field("device", self.device)?
            .field("layer_groups", self.layer_groups)?
            .field("armed", armed)?
            .field("enqueued", enqueued)?
            .field("parts", parts)?
            .field("groups", groups)?
            .field("ended", ended)?
            .finish())
    }
}

impl StreamGate {
    /// The guard that marks the gate ended when the fetch leaves; taken
    /// first thing in a fetch so an argument error ends it too.
    pub(crate) fn end_guard(&self) -> GateEnd {
        GateEnd(self.shared.clone())
    }

    /// Takes the gate for one fetch of `blocks` blocks from `fetch_from`,
    /// whose rank parts deliver to devices `gpus` (one ordinal per rank);
    /// returns the consumer stream for the fetch's `DeliveryControl`.
    ///
    /// Errors (`BadArgument` naming `gate`): the gate served a fetch
    /// already; no rank delivers to the gate's device.
    pub(crate) fn arm(
        &self,
        gpus: &[u32],
        fetch_from: u32,
        blocks: u32,
    ) -> PyResult<kv_transfer::ConsumerStream> {
        let parts = gpus.iter().filter(|&&g| g == self.device).count() as u32;
        if parts == 0 {
            return Err(bad_argument(
                "gate",
                format!(
                    "device {} is none of the target's GPUs {gpus:?}",
                    self.device
                ),
            ));
        }
        {
            let mut s = self.shared.lock();
            if s.armed || s.ended {
                return Err(bad_argument(
                    "gate",
                    "serves one fetch; it served one already",
                ));
            }
            *s = GateState {
                armed: true,
                parts,
                fetch_from,
                blocks,
                created: s.created,
                armed_at: Some(Instant::now()),
                ..GateState::default()
            };
        }
        let shared = self.shared.clone();
        let notice = Arc::new(move |_rank: u32| {
            {
                let mut s = shared.lock();
                s.enqueued += 1;
                if s.is_open(false) {
                    s.enqueued_at = Some(Instant::now());
                }
            }
            shared.changed.notify_all();
        });
        // SAFETY: `StreamGate`'s documented contract (module docs, class
        // docs): `stream` is a live stream of device `device`'s primary
        // context until the fetch returned, and the fetch holds this control
        // only until it returns.
        let consumer =
            unsafe { kv_transfer::ConsumerStream::new(self.device, self.stream, notice) };
        let Some(groups) = self.layer_groups else {
            return Ok(consumer);
        };
        let shared = self.shared.clone();
        let on_group = Arc::new(move |g: kv_transfer::LayersReady| {
            {
                let mut s = shared.lock();
                let now = Some(Instant::now());
                if g.layers().start == 0 {
                    s.first_groups += 1;
                }
                s.first_group_at = s.first_group_at.or(now);
                s.last_group_at = now;
                s.groups.push((g, false));
            }
            shared.changed.notify_all();
        });
        consumer
            .with_layer_groups(groups, on_group)
            .map_err(|e| bad_argument("layer_groups", e.to_string()))
    }
}
