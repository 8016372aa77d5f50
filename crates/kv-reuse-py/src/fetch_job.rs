//! `Target.fetch_async`'s machinery: the target's fetch thread
//! ([`FetchJobs`], one per target, started at its first `fetch_async`, fed
//! through a channel and restarted in a forked child) and the handle a
//! caller waits on ([`FetchJob`]: the result taken once, with an optional
//! wait timeout that leaves the job in place; `cancel`, which skips a job
//! still queued and stops a running one's delivery at its next check).
//!
//! A job's life is one [`JobState`] word: the fetch thread moves it from
//! queued to running when it starts the job, `cancel` from queued to
//! cancelled; both are compare-and-swaps on the same word, so exactly one
//! of them wins and a cancelled job never pins or copies anything.
//!
//! A finished job's result waits in a slot the `FetchJob` shares with the
//! fetch thread ([`Finished`]), together with every Python reference the
//! job held while it ran (the target, the `donor_alive` callable, the
//! exception it raised): the `FetchJob` shows them to the garbage collector
//! (`__traverse__`) and releases them with the GIL. A result kept where
//! the collector cannot see it (a channel, as before) leaked: an untaken
//! fallback whose `__cause__` is the probe's exception reaches, through its
//! traceback, the script's globals that hold the job (and a donor bank),
//! and that cycle was never collected, so the bank's /dev/shm segments and
//! leases outlived the process.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_transfer::CancelToken;

use pyo3::exceptions::{PyBaseException, PyRuntimeError, PyTimeoutError};
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use crate::errors::{bad_argument, FetchFellBack};
use crate::fetch_outcome::FetchOutcome;
use crate::target::with_cause;

/// Where a job is: [`JobState::QUEUED`] until the fetch thread starts it
/// ([`JobState::RUNNING`], then [`JobState::DONE`] once its result is in
/// the job's slot) or `cancel` takes it first ([`JobState::CANCELLED`]).
pub(crate) struct JobState(AtomicU8);

impl JobState {
    const QUEUED: u8 = 0;
    const RUNNING: u8 = 1;
    const DONE: u8 = 2;
    const CANCELLED: u8 = 3;

    fn new() -> Self {
        Self(AtomicU8::new(Self::QUEUED))
    }

    /// The fetch thread's side: true when the job is to run (it was
    /// queued, not cancelled).
    fn start(&self) -> bool {
        self.take(Self::RUNNING)
    }

    /// `cancel`'s side: true when the job had not started and now never will.
    fn cancel(&self) -> bool {
        self.take(Self::CANCELLED)
    }

    fn take(&self, to: u8) -> bool {
        self.0
            .compare_exchange(Self::QUEUED, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Moves a running job to done (a cancelled one stays cancelled).
    fn finish(&self) {
        let _ = self.0.compare_exchange(
            Self::RUNNING,
            Self::DONE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    fn label(&self) -> &'static str {
        match self.0.load(Ordering::Acquire) {
            Self::QUEUED => "queued",
            Self::RUNNING => "running",
            Self::DONE => "done",
            _ => "cancelled",
        }
    }
}

/// Runs `fetch` on the fetch thread unless the job was cancelled first;
/// returns what it returned (or the cancellation, or a panic).
pub(crate) fn run_job(
    state: &JobState,
    fetch: impl FnOnce() -> PyResult<FetchOutcome>,
) -> PyResult<FetchOutcome> {
    if state.start() {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(fetch)).unwrap_or_else(|_| {
            Err(PyRuntimeError::new_err(
                "the fetch panicked on the target's fetch thread",
            ))
        })
    } else {
        // `fetch` is dropped unrun: its gate ends without opening.
        drop(fetch);
        Err(FetchFellBack::new_err((
            "the fetch was cancelled before it started: nothing was pinned or copied".to_string(),
            "queued",
            "cancelled",
        )))
    }
}

/// A job's end, left in its slot by the fetch thread for the `FetchJob`.
struct Finished {
    /// The outcome or error. Neither holds a Python object: a
    /// `FetchOutcome` is Rust values (its rows' guard included), and the
    /// fetch thread makes its errors without the GIL, lazily, from Rust
    /// values. So the collector has nothing to see here.
    out: PyResult<FetchOutcome>,
    /// What the `donor_alive` probe raised (chained as the error's
    /// `__cause__` when the result is taken): an exception object, whose
    /// traceback reaches the probe's frame and so its module's globals.
    cause: Option<Py<PyBaseException>>,
    /// The references the job held while the fetch ran: its target, and
    /// the `donor_alive` callable (a function of the engine's script holds
    /// that script's globals). Released with the result.
    held: Vec<Py<PyAny>>,
}

/// What a `FetchJob` shares with the fetch thread.
struct Slot {
    /// Set once by the fetch thread ([`JobDone::finish`], or the drop of a
    /// [`JobDone`] that never ran), emptied by `result()` or `__clear__`.
    finished: Option<Finished>,
    /// A `result()` call is waiting for the fetch.
    waiting: bool,
    /// Why `finished` is empty after the fetch ended: `result()` took it,
    /// or the garbage collector cleared it.
    gone: Option<&'static str>,
}

struct Shared {
    state: JobState,
    slot: Mutex<Slot>,
    /// Signalled when `finished` is set.
    ready: Condvar,
}

impl Shared {
    fn slot(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The fetch thread's end of a job: it leaves the job's result in the
/// `FetchJob`'s slot. Dropped without [`JobDone::finish`] (the job never
/// ran: the fetch thread is gone), it leaves an error there instead, so a
/// waiting `result()` never hangs.
pub(crate) struct JobDone(Arc<Shared>);

impl JobDone {
    /// The job's state, for [`run_job`].
    pub(crate) fn state(&self) -> &JobState {
        &self.0.state
    }

    /// Leaves `out` (with the probe's exception `cause` and the job's
    /// Python references `held`) for the `FetchJob`. Needs no GIL: the
    /// references move, none is released (when the `FetchJob` is gone, the
    /// last `Arc` drops them here, and pyo3 queues those decrefs).
    pub(crate) fn finish(
        self,
        out: PyResult<FetchOutcome>,
        cause: Option<Py<PyBaseException>>,
        held: Vec<Py<PyAny>>,
    ) {
        self.put(|| Finished { out, cause, held });
    }

    /// Fills the slot with `finished()` unless it was filled before.
    fn put(&self, finished: impl FnOnce() -> Finished) {
        let mut slot = self.0.slot();
        if slot.finished.is_none() && slot.gone.is_none() {
            slot.finished = Some(finished());
            // Under the slot's lock, after the result is in: whoever reads
            // `done` (`state` takes this lock) finds the result there, and
            // the collector sees it (no fetch-thread reference left).
            self.0.state.finish();
        }
        drop(slot);
        self.0.ready.notify_all();
    }
}

impl Drop for JobDone {
    fn drop(&mut self) {
        // A no-op after `finish` (the slot is full).
        self.put(|| Finished {
            out: Err(PyRuntimeError::new_err(
                "the target's fetch thread ended without a result",
            )),
            cause: None,
            held: Vec::new(),
        });
    }
}

/// A fetch running on its target's fetch thread (`Target.fetch_async`).
///
/// ```python
/// job = target.fetch_async(advice.hint, hashes, manifest, gate=gate)
/// if gate.wait():
///     ...  # enqueue the forward on the gate's stream
/// with job.result() as out:  # raises FetchFellBack: discard that forward
///     rows = out.rows
/// ```
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct FetchJob {
    shared: Arc<Shared>,
    /// The fetch's delivery token (`DeliveryControl::cancel`).
    cancel: CancelToken,
}

#[pymethods]
impl FetchJob {
    /// Cancels the fetch, for a request the engine gave up on. True when
    /// this call stopped the job before it started: it never runs (no pin, no copy), its gate
    /// ends without opening, and `result()` raises `FetchFellBack` with
    /// stage `queued` and cause `cancelled`; later jobs of the target no
    /// longer wait for it. False when it was running, done or cancelled
    /// already: a running
    /// delivery stops at its next check between copy batches (a pin round
    /// trip under way finishes or times out first) and `result()` raises
    /// `FetchFellBack` (cause `transfer_cancelled`), unless the fetch got
    /// past its last check, when it returns the outcome as usual. Either way
    /// the result is truthful: take it, or drop the job.
    fn cancel(&self) -> bool {
        self.cancel.cancel();
        self.shared.state.cancel()
    }

    /// `queued`, `running`, `done` (its result is waiting or was taken) or
    /// `cancelled` (before it started).
    #[getter]
    fn state(&self) -> &'static str {
        // Read under the slot's lock: after `done`, the result is in the
        // slot (the fetch thread holds nothing of it any more).
        let _slot = self.shared.slot();
        self.shared.state.label()
    }

    /// `<kv_reuse.FetchJob state='running'>`.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(crate::reprs::Repr::object(py, "FetchJob")
            .field("state", self.state())?
            .finish())
    }

    /// Waits for the fetch (GIL released) and returns its `FetchOutcome`,
    /// or raises what `Target.fetch` raises. A job's result is taken once:
    /// a second call raises `BadArgument` naming `result` (as does a call
    /// while another thread waits for it). A job dropped without its result
    /// still completes, and its rows are released.
    ///
    /// `timeout_s` (seconds, >= 0; `None`: wait as long as the fetch takes,
    /// which the target's pin and transfer timeouts bound): when the fetch
    /// has not finished by then, raises `TimeoutError` and leaves the
    /// result to a later call (the fetch goes on; its gate, if any, is
    /// unaffected). `BadArgument` names `timeout_s` when negative or not
    /// finite.
    #[pyo3(signature = (timeout_s = None))]
    fn result(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = "crate::errors::seconds_or_none")] timeout_s: Option<f64>,
    ) -> PyResult<FetchOutcome> {
        let limit = match timeout_s {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => {
                return Err(bad_argument(
                    "timeout_s",
                    format!("{t} is not a finite number of seconds >= 0"),
                ))
            }
        };
        {
            let mut slot = self.shared.slot();
            if let Some(gone) = slot.gone {
                return Err(bad_argument("result", gone));
            }
            if slot.waiting {
                return Err(bad_argument(
                    "result",
                    "another thread is waiting for this job's result",
                ));
            }
            slot.waiting = true;
        }
        let deadline = limit.map(|l| Instant::now() + l);
        let shared = &*self.shared;
        let finished = loop {
            // Slices of at most SIGNAL_SLICE without the GIL, so that a
            // Ctrl-C (or another signal handler's exception) is raised
            // within it instead of after the whole wait (helper-22 finding 9).
            let slice = deadline.map_or(SIGNAL_SLICE, |d| {
                d.saturating_duration_since(Instant::now())
                    .min(SIGNAL_SLICE)
            });
            // The lock is held only inside this closure (the wait releases
            // it), never while this thread waits for the GIL.
            let got = py.allow_threads(|| {
                let slot = shared.slot();
                let mut slot = if slot.finished.is_none() {
                    shared
                        .ready
                        .wait_timeout(slot, slice)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                } else {
                    slot
                };
                let got = slot.finished.take();
                if got.is_some() {
                    slot.waiting = false;
                    slot.gone = Some("this job's result was taken already");
                }
                got
            });
            if let Some(finished) = got {
                break finished;
            }
            let timed_out = deadline.is_some_and(|d| Instant::now() >= d);
            let interrupted = py.check_signals();
            if timed_out || interrupted.is_err() {
                // The result stays for the next call: the fetch has not
                // finished (an interrupt leaves it running, like a timeout).
                self.shared.slot().waiting = false;
                interrupted?;
                return Err(PyTimeoutError::new_err(format!(
                    "the fetch did not finish within timeout_s={}",
                    limit.map_or(0.0, |l| l.as_secs_f64())
                )));
            }
        };
        // `held` (the target, the probe's callable) is released here, with
        // the GIL.
        let Finished { out, cause, held } = finished;
        drop(held);
        out.map_err(|e| with_cause(py, e, cause))
    }

    /// Shows the garbage collector the Python objects a finished job
    /// holds until its result is taken: the `donor_alive` probe's
    /// exception (whose traceback holds the probe's frame, so the script's
    /// globals, which may hold this job), the callable, and the target. A
    /// job still queued or running holds none of them here (the fetch
    /// thread does, unseen, so such a job and its target are never
    /// garbage: a fetch's destination memory outlives the fetch). Visits
    /// every Python object the job holds.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // `try_lock`: the collector may run inside this job's own critical
        // section (an allocation while `result()` holds the lock) or
        // while the fetch thread stores the result. Visiting nothing then
        // is safe: unvisited references count as outside ones, so the job
        // and what it holds are simply kept this time.
        let Ok(slot) = self.shared.slot.try_lock() else {
            return Ok(());
        };
        if let Some(f) = &slot.finished {
            if let Some(cause) = &f.cause {
                visit.call(cause)?;
            }
            for obj in &f.held {
                visit.call(obj)?;
            }
        }
        Ok(())
    }

    /// Drops the finished result (and the references held with it), so
    /// that the collector can break a cycle through this job. Sound: the
    /// slot is filled only once the fetch ended, by the fetch thread, which
    /// keeps nothing of it, so this frees no memory a fetch writes into
    /// (a running fetch's target is held by the fetch thread, not here;
    /// the target's `kv_caches` are its own, released only in its drop,
    /// and another job's fetch holds the target itself). What it drops is
    /// a finished outcome (its rows go back to the pool: nobody can take
    /// them any more), an exception, a callable and a target reference. A
    /// later `result()` (from a finalizer that reached this job) raises
    /// `BadArgument`.
    fn __clear__(&self) {
        let finished = {
            let mut slot = self.shared.slot();
            let finished = slot.finished.take();
            if finished.is_some() {
                slot.gone = Some("this job's result was released by the garbage collector");
            }
            finished
        };
        // After the lock: their decrefs may run Python code that reaches
        // this job.
        drop(finished);
    }
}

/// Longest wait without the GIL between two checks for a pending signal
/// (Ctrl-C) in a blocking call that may wait long (`FetchJob.result`,
/// `StreamGate.wait` / `wait_layer`, `DonorDirectory.manifest`).
pub(crate) const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// Work for the target's fetch thread.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The target's fetch thread, started at its first `fetch_async` and fed
/// through a channel, one job after another; it ends when the target is
/// dropped (the channel closes) after the jobs queued before.
///
/// The sender remembers the process that started the thread: a forked
/// child (multiprocessing's default start method on Linux) inherits the
/// sender but not the thread, so its jobs would queue forever and their
/// `result()` never return; the child starts a thread of its own instead.
#[derive(Default)]
pub(crate) struct FetchJobs {
    tx: Mutex<Option<(u32, Sender<Job>)>>,
}

impl FetchJobs {
    pub(crate) fn submit(&self, job: Job) -> PyResult<()> {
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let pid = std::process::id();
        if tx
            .as_ref()
            .is_some_and(|(started_by, _)| *started_by != pid)
        {
            // Forgotten, not dropped: the channel's state was copied at the
            // fork, possibly mid-operation by the parent's thread, so this
            // process does not touch it again (a few bytes leaked once).
            if let Some(inherited) = tx.take() {
                std::mem::forget(inherited);
            }
        }
        if tx.is_none() {
            let (send, jobs) = std::sync::mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name("kv-target-fetch".into())
                .spawn(move || jobs.into_iter().for_each(|job| job()))
                .map_err(|e| {
                    PyRuntimeError::new_err(format!("cannot start the target's fetch thread: {e}"))
                })?;
            *tx = Some((pid, send));
        }
        tx.as_ref()
            .map(|(_, t)| t.send(job))
            .transpose()
            .map_err(|_| PyRuntimeError::new_err("the target's fetch thread is gone"))
            .map(drop)
    }
}

impl Drop for FetchJobs {
    fn drop(&mut self) {
        // As in `submit`: a sender inherited from the parent of a fork is
        // forgotten, not dropped (its channel's state was copied, possibly
        // mid-operation by the parent's thread, which this process lacks).
        let tx = self.tx.get_mut().unwrap_or_else(|e| e.into_inner());
        if tx
            .as_ref()
            .is_some_and(|(started_by, _)| *started_by != std::process::id())
        {
            std::mem::forget(tx.take());
        }
    }
}

impl FetchJob {
    /// A queued job's handle, its delivery stopped by `cancel`, and the
    /// fetch thread's end of it (for [`run_job`] and the result).
    pub(crate) fn new(cancel: CancelToken) -> (Self, JobDone) {
        let shared = Arc::new(Shared {
            state: JobState::new(),
            slot: Mutex::new(Slot {
                finished: None,
                waiting: false,
                gone: None,
            }),
            ready: Condvar::new(),
        });
        (
            Self {
                shared: shared.clone(),
                cancel,
            },
            JobDone(shared),
        )
    }
}
