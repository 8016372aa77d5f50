//! [`watch_reopening`]: a [`DirectoryWatch`] that opens its backend's
//! watch again whenever it ends, for a reader that must keep seeing donors
//! and has nothing to report a gap to: a prefill worker's
//! [`crate::TargetAgent`] and the wheel's `DonorDirectory`. A backend watch
//! ends when its bucket is deleted; before this, such a reader went on
//! answering from what it had, and never saw a donor that started later
//! (trial h47, 1). The router's follower re-opens on its own instead, so
//! that `/healthz` can say the watch is down meanwhile.
//!
//! Each re-opened watch delivers every current entry again, which a
//! [`crate::DonorCache`] takes as renewals: nothing is lost or doubled.
//! What changed while it was down (a delete) arrives then, or, for an
//! entry deleted meanwhile, never: its lease lapses instead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{DirectoryPlane, DirectoryWatch};
use crate::PlaneError;

/// First wait before opening an ended watch again; doubles per failed try
/// up to [`REOPEN_MAX`].
pub const REOPEN_MIN: Duration = Duration::from_millis(100);
/// Longest wait between tries.
pub const REOPEN_MAX: Duration = Duration::from_secs(5);

/// Opens `directory`'s watch, and opens it again whenever the backend's
/// watch ends: after [`REOPEN_MIN`], doubling to [`REOPEN_MAX`] between
/// failed tries, with one warning per end. Changes are read from the
/// backend's own watch (no task in between: an in-process put is there at
/// once, as before). [`DirectoryWatch::next`] waits through a re-open;
/// [`DirectoryWatch::try_next`] moves it on at each call. Must run inside
/// a tokio runtime (re-opens started by `try_next` run on it).
///
/// # Errors
/// The first [`DirectoryPlane::watch`]'s error: a directory that cannot
/// be watched at all is the caller's to report.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use std::sync::Arc;
/// use kv_router_glue::{watch_reopening, InProcessDirectory};
/// let directory = Arc::new(InProcessDirectory::new());
/// let mut watch = watch_reopening(directory.clone()).await.unwrap();
/// assert!(watch.try_next().is_none());
/// # });
/// ```
pub async fn watch_reopening(
    directory: Arc<dyn DirectoryPlane>,
) -> Result<DirectoryWatch, PlaneError> {
    let mut watch = directory.watch().await?;
    watch.reopen = Some(Box::new(Reopen {
        directory,
        runtime: tokio::runtime::Handle::current(),
        opening: None,
        wait: REOPEN_MIN,
        next_try: None,
    }));
    Ok(watch)
}

/// The re-opening state of a [`watch_reopening`] watch.
pub(super) struct Reopen {
    directory: Arc<dyn DirectoryPlane>,
    /// Where `try_next`'s background tries run.
    runtime: tokio::runtime::Handle,
    /// A try started by `poll_open`, its result to come.
    opening: Option<oneshot::Receiver<Result<DirectoryWatch, PlaneError>>>,
    /// Wait before the next try.
    wait: Duration,
    /// When `poll_open` may start the next try; `None` until the end is
    /// first seen (then warned about).
    next_try: Option<Instant>,
}

impl Reopen {
    /// Notes a try that failed: the next waits twice as long.
    fn failed(&mut self, why: &dyn std::fmt::Display) {
        tracing::debug!(error = %why, retry_in_ms = self.wait.as_millis() as u64, "donor directory watch not open yet");
        self.next_try = Some(Instant::now() + self.wait);
        self.wait = (self.wait * 2).min(REOPEN_MAX);
    }

    /// Starts the wait after an end, with its warning; the first call per end.
    fn ended(&mut self) -> Instant {
        *self.next_try.get_or_insert_with(|| {
            tracing::warn!("donor directory watch ended (a deleted bucket?): opening it again");
            let at = Instant::now() + self.wait;
            self.wait = (self.wait * 2).min(REOPEN_MAX);
            at
        })
    }

    /// A watch opened again, for the next end to start over.
    fn opened(&mut self, watch: DirectoryWatch) -> DirectoryWatch {
        self.wait = REOPEN_MIN;
        self.next_try = None;
        watch
    }

    /// Waits until the backend's watch is open again.
    pub(super) async fn open_again(&mut self) -> DirectoryWatch {
        loop {
            if let Some(rx) = self.opening.take() {
                match rx.await {
                    Ok(Ok(w)) => return self.opened(w),
                    Ok(Err(e)) => self.failed(&e),
                    Err(e) => self.failed(&e),
                }
                continue;
            }
            let at = self.ended();
            tokio::time::sleep_until(at.into()).await;
            match self.directory.watch().await {
                Ok(w) => return self.opened(w),
                Err(e) => self.failed(&e),
            }
        }
    }

    /// Without waiting: the watch opened again if a try finished with it,
    /// else `None`, starting a try in the background when it is time.
    pub(super) fn poll_open(&mut self) -> Option<DirectoryWatch> {
        if let Some(rx) = self.opening.as_mut() {
            match rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => return None,
                Ok(Ok(w)) => {
                    self.opening = None;
                    return Some(self.opened(w));
                }
                Ok(Err(e)) => {
                    self.opening = None;
                    self.failed(&e);
                }
                Err(e @ oneshot::error::TryRecvError::Closed) => {
                    self.opening = None;
                    self.failed(&e);
                }
            }
        }
        if Instant::now() < self.ended() {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        let directory = self.directory.clone();
        self.runtime.spawn(async move {
            let _ = tx.send(directory.watch().await);
        });
        self.opening = Some(rx);
        // Not yet due again: the try in flight decides.
        self.next_try = Some(Instant::now() + REOPEN_MAX);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plane::directory::tests_support::record;
    use crate::{DirectoryChange, InProcessDirectory};

    /// A watch whose backend ended is opened again: the current record is
    /// delivered once more and a record put afterwards is seen, where a
    /// plain watch ends.
    #[tokio::test]
    async fn an_ended_watch_is_opened_again_and_sees_later_records() {
        let directory = Arc::new(InProcessDirectory::new());
        let mut plain = directory.watch().await.unwrap();
        let mut watch = watch_reopening(directory.clone()).await.unwrap();
        let first = kv_descriptor::OwnerLease::fresh(kv_descriptor::Role::Decode);
        directory.put(&record(first, u64::MAX - 1)).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(2), watch.next()).await;
        assert!(matches!(got, Ok(Some(DirectoryChange::Put(_)))), "{got:?}");
        directory.end_watches();
        assert!(tokio::time::timeout(Duration::from_secs(2), async {
            while plain.next().await.is_some() {}
        })
        .await
        .is_ok());
        // Re-opened: the current record again, then a later one.
        let again = tokio::time::timeout(Duration::from_secs(2), watch.next()).await;
        assert!(
            matches!(again, Ok(Some(DirectoryChange::Put(_)))),
            "{again:?}"
        );
        let second = kv_descriptor::OwnerLease::fresh(kv_descriptor::Role::Decode);
        directory.put(&record(second, u64::MAX - 1)).await.unwrap();
        let later = tokio::time::timeout(Duration::from_secs(2), watch.next()).await;
        match later {
            Ok(Some(DirectoryChange::Put(r))) => assert_eq!(r.engine_id(), second.engine_id),
            other => panic!("{other:?}"),
        }
    }

    /// A reader that only polls (`try_next`, as `TargetAgent::refresh`
    /// does) gets the watch opened again too, and a put after that is
    /// there at once, not a task hop later.
    #[tokio::test]
    async fn a_polling_reader_gets_the_watch_opened_again() {
        let directory = Arc::new(InProcessDirectory::new());
        let mut watch = watch_reopening(directory.clone()).await.unwrap();
        let first = kv_descriptor::OwnerLease::fresh(kv_descriptor::Role::Decode);
        directory.put(&record(first, u64::MAX - 1)).await.unwrap();
        assert!(matches!(watch.try_next(), Some(DirectoryChange::Put(_))));
        directory.end_watches();
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        let again = loop {
            if let Some(c) = watch.try_next() {
                break c;
            }
            assert!(std::time::Instant::now() < deadline, "not opened again");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert!(matches!(again, DirectoryChange::Put(r) if r.engine_id() == first.engine_id));
        let second = kv_descriptor::OwnerLease::fresh(kv_descriptor::Role::Decode);
        directory.put(&record(second, u64::MAX - 1)).await.unwrap();
        match watch.try_next() {
            Some(DirectoryChange::Put(r)) => assert_eq!(r.engine_id(), second.engine_id),
            other => panic!("{other:?}"),
        }
    }
}
