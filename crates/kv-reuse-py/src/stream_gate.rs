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
//! Invariants: a gate serves one fetch (a second is refused, `BadArgument`
//! naming `gate`); `wait` returns on every path of that fetch, because the
//! fetch marks the gate ended when it returns or raises, before or after the
//! copies; True means every rank part delivering to the gate's device was
//! enqueued behind the wait.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::errors::{bad_argument, uint};

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
}

impl GateState {
    /// Every rank part delivering to the gate's device was enqueued.
    fn is_open(&self) -> bool {
        self.armed && self.parts > 0 && self.enqueued >= self.parts
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
#[pyclass(module = "kv_reuse", frozen)]
pub(crate) struct StreamGate {
    stream: u64,
    device: u32,
    shared: Arc<GateShared>,
}

#[pymethods]
impl StreamGate {
    #[new]
    fn new(stream: &Bound<'_, PyAny>, device: &Bound<'_, PyAny>) -> PyResult<Self> {
        let shared = Arc::new(GateShared::default());
        shared.lock().created = Some(Instant::now());
        Ok(Self {
            stream: uint("stream", stream)?,
            device: uint("device", device)?,
            shared,
        })
    }

    /// Blocks (GIL released) until the fetch's copies to this device are
    /// issued and the stream waits for them (True), or the fetch ended
    /// without that (False: it raised before any copy, delivers to another
    /// device only, or ran on a backend without streams), or `timeout_s`
    /// passed (False). After False, take the fetch's result before reading
    /// the rows. Raises `BadArgument` naming `timeout_s` unless it is in
    /// (0, 3600] seconds.
    #[pyo3(signature = (timeout_s = None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        let limit = match timeout_s {
            None => None,
            Some(s) if s.is_finite() && s > 0.0 && s <= 3600.0 => {
                Some(Instant::now() + Duration::from_secs_f64(s))
            }
            Some(s) => {
                return Err(bad_argument(
                    "timeout_s",
                    format!("{s} is not in (0, 3600] seconds"),
                ))
            }
        };
        let shared = self.shared.clone();
        Ok(py.allow_threads(move || {
            let mut s = shared.lock();
            loop {
                if s.is_open() {
                    return true;
                }
                if s.ended {
                    return false;
                }
                s = match limit {
                    None => shared.changed.wait(s).unwrap_or_else(|e| e.into_inner()),
                    Some(at) => {
                        let left = at.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return false;
                        }
                        shared
                            .changed
                            .wait_timeout(s, left)
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                    }
                };
            }
        }))
    }

    /// True once the stream waits for every copy of the fetch to this device.
    #[getter]
    fn enqueued(&self) -> bool {
        self.shared.lock().is_open()
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
    /// stream waits for every copy), `ended` (the fetch returned or
    /// raised); a point not reached is absent.
    #[getter]
    fn times_us(&self) -> std::collections::BTreeMap<&'static str, u64> {
        let s = self.shared.lock();
        let created = s.created.unwrap_or_else(Instant::now);
        [
            ("armed", s.armed_at),
            ("enqueued", s.enqueued_at),
            ("ended", s.ended_at),
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

    fn __repr__(&self) -> String {
        let s = self.shared.lock();
        format!(
            "StreamGate(stream={:#x}, device={}, armed={}, enqueued={}/{}, ended={})",
            self.stream, self.device, s.armed, s.enqueued, s.parts, s.ended
        )
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
                if s.is_open() {
                    s.enqueued_at = Some(Instant::now());
                }
            }
            shared.changed.notify_all();
        });
        // SAFETY: `StreamGate`'s documented contract (module docs, class
        // docs): `stream` is a live stream of device `device`'s primary
        // context until the fetch returned, and the fetch holds this control
        // only until it returns.
        Ok(unsafe { kv_transfer::ConsumerStream::new(self.device, self.stream, notice) })
    }
}
