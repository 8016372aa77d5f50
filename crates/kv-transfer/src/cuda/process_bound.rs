//! This crate's own CUDA objects after `fork()`: [`ProcessBound`].
//!
//! The copy backend keeps, per device, its stream(s), events, the NVRTC
//! gather module and its functions, a device table and its page-locked
//! staging buffer, and the context references they hold; a layer group's
//! [`crate::LayersReady`] keeps an event. cudarc frees each in its own `Drop`
//! (`cuStreamDestroy`, `cuEventDestroy`, `cuModuleUnload`, `cuMemFree*`,
//! `cuDevicePrimaryCtxRelease`), which cannot be intercepted from outside.
//! A child forked after the parent made them (Python's `os.fork`,
//! multiprocessing's default start method on Linux) holds copies of them,
//! and would make those calls when it drops its copy, or launch work on the
//! parent's stream when it used one; CUDA does not support either after
//! `fork()` (a call can fail, or block on a lock a parent thread held at the
//! fork). kv-bank keeps its device memory and IPC imports out of CUDA in
//! such a child by one rule, [`kv_bank::cuda_usable_here`]; the objects
//! here follow the same rule through [`ProcessBound`]: in the process that
//! made them they are used and dropped as usual, in any other their use is
//! refused and their drop forgets them. The child leaks its copy on purpose:
//! the driver state they name is the parent's, which the child cannot free
//! anyway, and the parent still frees its own.

use std::borrow::Cow;

use kv_bank::{BankError, CreatorProcess};

use crate::TransferError;

/// CUDA objects made by one process, usable and dropped (their CUDA calls
/// made) only there (module docs). Dereferences to them; the creating
/// process's check is [`ProcessBound::usable`], which every entry point that
/// would call CUDA on them makes first.
pub(crate) struct ProcessBound<T> {
    /// Always `Some` until the drop takes it out, to drop or forget it.
    value: Option<T>,
    made_by: CreatorProcess,
    /// What the making process did, for the refusal ("this copy backend's
    /// device 0 was set up"); borrowed where it is static, so a value made
    /// per fetch (a layer group's event) allocates no text.
    what: Cow<'static, str>,
}

impl<T> ProcessBound<T> {
    /// `value`, made by the calling process; `what` says what it is for
    /// the refusal in another process ([`kv_bank::cuda_usable_here`]).
    pub(crate) fn new(value: T, what: impl Into<Cow<'static, str>>) -> Self {
        Self::made_by(value, CreatorProcess::current(), what)
    }

    /// `value` as made by process `made_by` (tests stand a parent before a
    /// fork in for it without forking).
    pub(crate) fn made_by(
        value: T,
        made_by: CreatorProcess,
        what: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            value: Some(value),
            made_by,
            what: what.into(),
        }
    }

    /// `Ok` in the process that made the value: CUDA may be called on it.
    ///
    /// # Errors
    /// [`TransferError::CudaUnavailable`] in any other process (a child
    /// forked from the maker), naming both processes.
    pub(crate) fn usable(&self) -> Result<(), TransferError> {
        kv_bank::cuda_usable_here(self.made_by, &self.what).map_err(cuda_unavailable)
    }
}

impl<T> std::ops::Deref for ProcessBound<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.value.as_ref().expect("only the drop takes the value")
    }
}

impl<T> std::ops::DerefMut for ProcessBound<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.value.as_mut().expect("only the drop takes the value")
    }
}

impl<T> Drop for ProcessBound<T> {
    /// Drops the value (cudarc's drops call CUDA) only where it was made;
    /// elsewhere forgets it (module docs: the leak is deliberate).
    fn drop(&mut self) {
        if let Some(value) = self.value.take() {
            drop(self.made_by.keep_here(value));
        }
    }
}

/// kv-bank's refusal (`cuda_driver_here`, `cuda_usable_here`) as this
/// crate's error: [`BankError::CudaUnavailable`] becomes
/// [`TransferError::CudaUnavailable`] with the same reason (it is not a
/// bank operation that failed); any other bank error stays one.
pub(crate) fn cuda_unavailable(e: BankError) -> TransferError {
    match e {
        BankError::CudaUnavailable { reason } => TransferError::CudaUnavailable { reason },
        other => TransferError::Bank(other),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    /// Counts its drops: stands for a cudarc object whose drop calls CUDA.
    struct Destroyed(Arc<AtomicUsize>);

    impl Drop for Destroyed {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn objects_are_used_and_destroyed_only_in_the_process_that_made_them() {
        let drops = Arc::new(AtomicUsize::new(0));
        let here = ProcessBound::new(Destroyed(drops.clone()), "made here");
        assert!(here.usable().is_ok());
        drop(here);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "dropped where it was made");

        // Any other pid stands for the parent that made them before a fork.
        let parent = CreatorProcess::of_pid(std::process::id() ^ 1);
        let inherited = ProcessBound::made_by(
            Destroyed(drops.clone()),
            parent,
            "this copy backend's device 0 was set up",
        );
        let e = inherited.usable().unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, TransferError::CudaUnavailable { .. }), "{e:?}");
        assert!(
            text.starts_with(&format!(
                "CUDA unavailable: this copy backend's device 0 was set up by process {}, and \
                 this process ({}) is a child forked from it",
                parent.pid(),
                std::process::id()
            )),
            "{text}"
        );
        drop(inherited);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "an inherited object was destroyed (its CUDA calls made) in a forked child"
        );
        // Forgotten, not dropped: its reference to the counter is leaked.
        assert_eq!(Arc::strong_count(&drops), 2);
    }

    #[test]
    fn kv_banks_refusal_becomes_this_crates_cuda_unavailable() {
        let e = cuda_unavailable(BankError::CudaUnavailable {
            reason: "cuInit failed: X".into(),
        });
        assert_eq!(e.to_string(), "CUDA unavailable: cuInit failed: X");
        let e = cuda_unavailable(BankError::Cuda {
            op: "cuMemAlloc",
            reason: "OOM".into(),
        });
        assert!(
            matches!(e, TransferError::Bank(BankError::Cuda { .. })),
            "{e:?}"
        );
    }
}
