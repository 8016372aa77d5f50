//! The tasks that feed [`RouterInventory`]: the announcement, event and
//! directory followers of [`RouterInventory::follow`], and re-opening a
//! follower stream that ended (the parent's module docs, "Re-opening"). A
//! child of `follow.rs`, so it reads `Tracked` and the counters directly.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::super::follow_stats::bump;
use super::{
    RouterInventory, CONNECTION_POLL, FOLLOW_BATCH_MAX, REOPEN_BACKOFF_MAX, REOPEN_BACKOFF_MIN,
};
use crate::{
    announce_subject, unix_now_ms, DirectoryPlane, EventPlane, KvEventReceiver, KvStreamItem,
    PlaneError, Subject,
};

impl RouterInventory {
    /// Runs the followers on `plane` and `directory` until `shutdown`:
    /// announcements (and the event subscriptions they name), the silence
    /// tick every `announce_period`, and the directory watch. A stream that
    /// ends is opened again (module docs, "Re-opening"). The returned tasks
    /// run until `shutdown`; a panic in one (or in the task of one event
    /// subject, which the announcement follower re-raises) ends that task
    /// with the panic, for the caller to stop on.
    ///
    /// # Errors
    /// The plane's or directory's subscribe error at start (nothing runs).
    pub async fn follow(
        self: &Arc<Self>,
        plane: Arc<dyn EventPlane>,
        directory: Arc<dyn DirectoryPlane>,
        namespace: &str,
        announce_period: Duration,
        shutdown: CancellationToken,
    ) -> Result<JoinSet<()>, PlaneError> {
        let announce = announce_subject(namespace)?;
        let mut announcements = plane.subscribe(&announce).await?;
        let mut watch = directory.watch().await?;
        let mut tasks = JoinSet::new();
        let (me, stop) = (self.clone(), shutdown.clone());
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    c = watch.next() => match c {
                        Some(c) => me.on_directory(c).await,
                        None => {
                            let flag = (&me.directory_down, &me.counters.directory_watch_reopened);
                            let reopened = reopen("donor directory watch", flag, &stop, || directory.watch()).await;
                            match reopened {
                                Some(w) => watch = w,
                                None => return,
                            }
                        }
                    },
                }
            }
        });
        let (me, stop) = (self.clone(), shutdown.clone());
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(announce_period);
            let mut poll = tokio::time::interval(CONNECTION_POLL);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut streams: JoinSet<()> = JoinSet::new();
            loop {
                tokio::select! {
                    // Biased: the connection's state is taken in before a
                    // silence tick that comes at the same time.
                    biased;
                    _ = stop.cancelled() => return,
                    _ = poll.tick() => { me.on_connection(plane.is_connected(), unix_now_ms()).await; }
                    _ = tick.tick() => {
                        // Checked again right before: a disconnection since
                        // the last poll must not count as silence.
                        let now = unix_now_ms();
                        me.on_connection(plane.is_connected(), now).await;
                        me.tick(now).await;
                    }
                    m = announcements.next() => {
                        let Some(m) = m else {
                            let flag = (&me.announcements_down, &me.counters.announcements_resubscribed);
                            match reopen("worker announcements", flag, &stop, || plane.subscribe(&announce)).await {
                                Some(s) => announcements = s,
                                None => return,
                            }
                            continue;
                        };
                        if let Some((subject, own)) = me.announce(&m.payload, unix_now_ms()).await {
                            // One receiver per subject; its own task so a slow
                            // subscribe does not hold up announcements.
                            let (me, stop, plane) = (me.clone(), stop.clone(), plane.clone());
                            streams.spawn(async move { me.follow_events(plane, subject, own, stop).await });
                        }
                    }
                    // Reaps the tasks of released subjects as they end. One
                    // that panicked (a bug) panics this follower with its
                    // payload, so that its end reaches the router's
                    // supervisor (`router_bin/stop.rs`, exit 1): swallowed,
                    // it silenced one subject while /healthz stayed 200.
                    Some(ended) = streams.join_next() => {
                        if let Err(e) = ended {
                            if e.is_panic() {
                                std::panic::resume_unwind(e.into_panic());
                            }
                        }
                    }
                }
            }
        });
        Ok(tasks)
    }

    /// Follows `subject`'s KV events until `stop` or `own`'s token (the
    /// subject released); `own.0` is this follower's generation.
    async fn follow_events(
        self: Arc<Self>,
        plane: Arc<dyn EventPlane>,
        subject: Subject,
        (generation, released): (u64, CancellationToken),
        stop: CancellationToken,
    ) {
        let subscribed = tokio::select! {
            biased;
            _ = released.cancelled() => return,
            s = KvEventReceiver::subscribe(plane, &subject, Duration::from_secs(1)) => s,
        };
        let rx = match subscribed {
            Ok(rx) => rx,
            Err(e) => {
                tracing::warn!(%subject, error = %e, "cannot follow KV events");
                // Let a later announcement try again; counted released, so
                // that followed minus released stays what is subscribed.
                let mut st = self.state.lock().await;
                if st.is_current(&subject, generation) {
                    st.subjects.remove(subject.as_str());
                    bump(&self.counters.event_subjects_released);
                }
                return;
            }
        };
        {
            let mut st = self.state.lock().await;
            if !st.is_current(&subject, generation) {
                // Released while subscribing; dropping `rx` unsubscribes.
                return;
            }
            st.sync.add_stream_resume(&subject, rx.resume_handle());
            st.subjects
                .get_mut(subject.as_str())
                .expect("current")
                .followed = true;
        }
        tracing::info!(%subject, "following KV events");
        self.follow_receiver(rx, subject, generation, released, stop)
            .await;
    }

    /// The event loop of one subject's receiver `rx`, until `stop` or the
    /// plane closes. Group commit: each item awaited comes with every item
    /// the receiver already holds ([`KvEventReceiver::try_next`], up to
    /// [`FOLLOW_BATCH_MAX`] in all), taken in together
    /// ([`RouterInventory::on_events`]); nothing waits for more, so a lone
    /// event is applied as soon as it arrives.
    pub(super) async fn follow_receiver(
        self: Arc<Self>,
        mut rx: KvEventReceiver,
        subject: Subject,
        generation: u64,
        released: CancellationToken,
        stop: CancellationToken,
    ) {
        let mut batch: Vec<KvStreamItem> = Vec::new();
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = released.cancelled() => return,
                item = rx.next() => match item {
                    Some(item) => {
                        batch.push(item);
                        while batch.len() < FOLLOW_BATCH_MAX {
                            match rx.try_next().await {
                                Some(more) => batch.push(more),
                                None => break,
                            }
                        }
                        self.on_events(batch.drain(..)).await;
                    }
                    None => {
                        let mut st = self.state.lock().await;
                        if st.is_current(&subject, generation) {
                            st.sync.remove_stream_resume(&subject);
                        }
                        return;
                    }
                },
            }
        }
    }
}

/// Opens an ended follower stream (`what`, for the log) again with `open`,
/// waiting [`REOPEN_BACKOFF_MIN`] doubling to [`REOPEN_BACKOFF_MAX`] before
/// each try; `down` is set from the end until it is open and `reopened`
/// counts the success. `None` when `stop` comes first.
async fn reopen<'a, T, F>(
    what: &'static str,
    (down, reopened): (&AtomicBool, &AtomicU64),
    stop: &CancellationToken,
    mut open: impl FnMut() -> F,
) -> Option<T>
where
    F: std::future::Future<Output = Result<T, PlaneError>> + 'a,
{
    down.store(true, Ordering::SeqCst);
    tracing::warn!(stream = what, "follower stream ended; opening it again");
    let mut wait = REOPEN_BACKOFF_MIN;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep(wait) => {}
        }
        match open().await {
            Ok(s) => {
                down.store(false, Ordering::SeqCst);
                bump(reopened);
                tracing::info!(stream = what, "follower stream open again");
                return Some(s);
            }
            Err(e) => {
                wait = (wait * 2).min(REOPEN_BACKOFF_MAX);
                tracing::warn!(stream = what, error = %e, retry_in_ms = wait.as_millis() as u64, "cannot open follower stream");
            }
        }
    }
}
