//! The process that created a value whose effects reach beyond it: a
//! shared-memory name, a lease file, a thread that serves it.
//!
//! `fork()` (Python's `os.fork`, multiprocessing's default start method on
//! Linux) copies every value into the child but none of the threads, and
//! the child does not own what the parent created: the shm names and lease
//! files are the parent's, still in use by it and by its importers. When the
//! child drops its copy (a helper that simply exits runs every destructor),
//! cleanup that unlinks names or revokes leases would destroy the parent's
//! live bank, and joining a thread that exists only in the parent panics
//! (`threads should not terminate unexpectedly`: std's join finds that the
//! thread never finished). Values with such effects record their
//! [`CreatorProcess`] and, in any other process, only release what is
//! private to that process (unmap, close), leaving names, leases and
//! threads alone.

use std::thread::JoinHandle;

/// The process that created a value (its pid at creation).
///
/// ```
/// let me = kv_bank::CreatorProcess::current();
/// assert!(me.is_current());
/// assert_eq!(me.pid(), std::process::id());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreatorProcess {
    pid: u32,
}

impl CreatorProcess {
    /// The calling process.
    pub fn current() -> Self {
        Self {
            pid: std::process::id(),
        }
    }

    /// A creator with pid `pid`: a process other than this one (a parent
    /// before a fork) without forking, for tests of what a value does
    /// outside its creator (here and in the crates above, e.g.
    /// kv-transfer's CUDA objects). Values record [`CreatorProcess::current`].
    ///
    /// ```
    /// let parent = kv_bank::CreatorProcess::of_pid(std::process::id() ^ 1);
    /// assert!(!parent.is_current());
    /// ```
    pub fn of_pid(pid: u32) -> Self {
        Self { pid }
    }

    /// The creator's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// True in the creating process; false in a child forked from it after
    /// the value was made (`getpid()` differs there: a process's pid never
    /// changes otherwise).
    pub fn is_current(&self) -> bool {
        std::process::id() == self.pid
    }

    /// Joins `handle`, a thread started by the creating process, and returns
    /// its result; in another process (a forked child, which has no such
    /// thread) returns `None` without joining. The handle is then forgotten,
    /// not dropped: dropping it would detach a thread id that means nothing
    /// in this process (a few bytes are leaked, once per value).
    pub fn join_or_forget<T>(&self, handle: JoinHandle<T>) -> Option<std::thread::Result<T>> {
        self.keep_here(handle).map(JoinHandle::join)
    }

    /// `value`, state the creating process made, back in that process; in
    /// another (a forked child) it is forgotten, never dropped, and `None`
    /// returned: its drop would act on state the child only has a copy of
    /// (a thread, a channel mid-operation, CUDA objects), so the child leaks
    /// its copy on purpose (the parent still frees its own).
    ///
    /// ```
    /// use kv_bank::CreatorProcess;
    /// assert_eq!(CreatorProcess::current().keep_here(7), Some(7));
    /// assert_eq!(CreatorProcess::of_pid(std::process::id() ^ 1).keep_here(7), None);
    /// ```
    pub fn keep_here<T>(&self, value: T) -> Option<T> {
        if self.is_current() {
            Some(value)
        } else {
            std::mem::forget(value);
            None
        }
    }
}
