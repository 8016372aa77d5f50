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

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_transfer::CancelToken;

use pyo3::exceptions::{PyRuntimeError, PyTimeoutError};
use pyo3::prelude::*;

use crate::errors::{bad_argument, FetchFellBack};
use crate::fetch_outcome::FetchOutcome;

/// Where a job is: [`JobState::QUEUED`] until the fetch thread starts it
/// ([`JobState::RUNNING`], then [`JobState::DONE`] once its result is sent)
/// or `cancel` takes it first ([`JobState::CANCELLED`]).
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

    fn finish(&self) {
        self.0.store(Self::DONE, Ordering::Release);
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
/// sends what it returned (or the cancellation, or a panic) on `tx`.
pub(crate) fn run_job(
    state: &JobState,
    tx: &std::sync::mpsc::SyncSender<PyResult<FetchOutcome>>,
    fetch: impl FnOnce() -> PyResult<FetchOutcome>,
) {
    let started = state.start();
    let out = if started {
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
    };
    if started {
        // Before the send, so a caller holding the result reads `done`.
        state.finish();
    }
    let _ = tx.send(out);
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
    rx: Mutex<Option<Receiver<PyResult<FetchOutcome>>>>,
    state: Arc<JobState>,
    /// The fetch's delivery token (`DeliveryControl::cancel`).
    cancel: CancelToken,
}

#[pymethods]
impl FetchJob {
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
        self.state.cancel()
    }

    /// `queued`, `running`, `done` (its result is waiting or was taken) or
    /// `cancelled` (before it started).
    #[getter]
    fn state(&self) -> &'static str {
        self.state.label()
    }

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
        let rx = self
            .rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| bad_argument("result", "this job's result was taken already"))?;
        let deadline = limit.map(|l| Instant::now() + l);
        let mut rx = rx;
        loop {
            // Slices of at most SIGNAL_SLICE without the GIL, so that a
            // Ctrl-C (or another signal handler's exception) is raised
            // within it instead of after the whole wait (helper-22 finding 9).
            let slice = deadline.map_or(SIGNAL_SLICE, |d| {
                d.saturating_duration_since(Instant::now())
                    .min(SIGNAL_SLICE)
            });
            let (back, got) = py.allow_threads(move || {
                let got = rx.recv_timeout(slice);
                (rx, got)
            });
            rx = back;
            match got {
                Ok(outcome) => return outcome,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(PyRuntimeError::new_err(
                        "the target's fetch thread ended without a result",
                    ))
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            let timed_out = deadline.is_some_and(|d| Instant::now() >= d);
            let interrupted = py.check_signals();
            if timed_out || interrupted.is_err() {
                // Put back for the next call: the fetch has not finished
                // (an interrupt leaves it running, like a timeout).
                *self.rx.lock().unwrap_or_else(|e| e.into_inner()) = Some(rx);
                interrupted?;
                return Err(PyTimeoutError::new_err(format!(
                    "the fetch did not finish within timeout_s={}",
                    limit.map_or(0.0, |l| l.as_secs_f64())
                )));
            }
        }
    }
}

/// Longest wait without the GIL between two checks for a pending signal
/// (Ctrl-C) in a blocking call that may wait long (`FetchJob.result`,
/// `DonorDirectory.manifest`).
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
    /// The handle of a job whose outcome arrives on `rx`, its life in
    /// `state` (shared with [`run_job`]), its delivery stopped by `cancel`.
    pub(crate) fn new(
        rx: Receiver<PyResult<FetchOutcome>>,
        state: Arc<JobState>,
        cancel: CancelToken,
    ) -> Self {
        Self {
            rx: Mutex::new(Some(rx)),
            state,
            cancel,
        }
    }

    /// A fresh job state, for [`FetchJob::new`] and [`run_job`].
    pub(crate) fn new_state() -> Arc<JobState> {
        Arc::new(JobState::new())
    }
}
