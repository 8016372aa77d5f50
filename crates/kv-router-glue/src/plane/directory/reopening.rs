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
use std::time::Duration;

use tokio::sync::mpsc;

use super::{DirectoryPlane, DirectoryWatch};
use crate::PlaneError;

/// First wait before opening an ended watch again; doubles per failed try
/// up to [`REOPEN_MAX`].
pub const REOPEN_MIN: Duration = Duration::from_millis(100);
/// Longest wait between tries.
pub const REOPEN_MAX: Duration = Duration::from_secs(5);

/// Opens `directory`'s watch and keeps it open: when the backend's watch
/// ends, it is opened again after [`REOPEN_MIN`], doubling to
/// [`REOPEN_MAX`] between failed tries, with one warning per end. The
/// returned watch ends only when dropped (the task behind it stops then).
/// Must run inside a tokio runtime.
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
    let mut inner = directory.watch().await?;
    let (tx, rx) = mpsc::unbounded_channel();
    // What the backend already delivered is there at once, as on its own
    // watch (an in-process directory hands every current entry over
    // inside `watch`), not one task wake-up later.
    while let Some(change) = inner.try_next() {
        let _ = tx.send(change);
    }
    let task = tokio::spawn(async move {
        loop {
            while let Some(change) = inner.next().await {
                if tx.send(change).is_err() {
                    return;
                }
            }
            tracing::warn!("donor directory watch ended (a deleted bucket?): opening it again");
            let mut wait = REOPEN_MIN;
            inner = loop {
                tokio::time::sleep(wait).await;
                if tx.is_closed() {
                    return;
                }
                match directory.watch().await {
                    Ok(w) => break w,
                    Err(e) => {
                        tracing::debug!(error = %e, retry_in_ms = wait.as_millis() as u64, "donor directory watch not open yet");
                        wait = (wait * 2).min(REOPEN_MAX);
                    }
                }
            };
        }
    });
    Ok(DirectoryWatch {
        rx,
        _guard: Some(crate::event_plane::AbortOnDrop(task)),
    })
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
}
