//! The process that owns a NATS connection: [`ProcessBound`], kept by
//! `RouterClient`, `WorkerPublisher` and `DonorDirectory`.
//!
//! After `fork()` (Python's `os.fork`, multiprocessing's default start
//! method on Linux) a child holds copies of these objects whose threads do
//! not exist there (a runtime's worker, the advise client's keep-alive) and
//! whose socket is the parent's. Used in the child they would block forever
//! on a runtime nothing drives (`WorkerPublisher.close` in a child hung),
//! write into the parent's NATS protocol stream, or join a thread that is
//! not there (dropping an inherited `RouterClient` raised `PanicException:
//! threads should not terminate unexpectedly`). So in any other process
//! every call that would use the connection is refused, naming the call
//! and both processes, and `close()` and the drop only forget the inherited
//! state: its memory is the child's own copy, leaked once, and nothing of
//! the parent's (connection, record, bank) is touched. kv-bank's banks and
//! pin services do the same for their shared memory (`CreatorProcess`).

use kv_bank::CreatorProcess;
use pyo3::PyErr;

/// Which process made a connection-owning object, and what to call it in
/// a refusal.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcessBound {
    creator: CreatorProcess,
    what: &'static str,
}

impl ProcessBound {
    /// Bound to the calling process; `what` names the class in refusals.
    pub(crate) fn here(what: &'static str) -> Self {
        Self {
            creator: CreatorProcess::current(),
            what,
        }
    }

    /// True in the creating process.
    pub(crate) fn is_home(&self) -> bool {
        self.creator.is_current()
    }

    /// `Ok` in the creating process; in a forked child the error `err`
    /// makes of a message naming `call`, this process and the creator.
    pub(crate) fn check(&self, call: &str, err: impl FnOnce(String) -> PyErr) -> Result<(), PyErr> {
        if self.creator.is_current() {
            return Ok(());
        }
        Err(err(format!(
            "`{call}` refused in process {}: this {what} was created in process {}, which owns \
             its NATS connection and threads (a forked child shares the socket and has none of \
             the threads); create a new {what} in this process",
            std::process::id(),
            self.creator.pid(),
            what = self.what,
        )))
    }

    /// `Some(value)` in the creating process, for the caller to shut down;
    /// in another process forgets `value` (its drop would stop threads or
    /// flush a connection that belong to the creator) and returns `None`.
    pub(crate) fn keep_here<T>(&self, value: T) -> Option<T> {
        self.creator.keep_here(value)
    }
}
