//! [`NatsDirectory`]: the donor directory as a NATS JetStream key-value
//! bucket. Key: the engine id ([`super::directory_key`]); value: the
//! [`super::DonorRecord`] wire bytes; bucket `max_age` = the lease TTL, so
//! an entry the donor stopped re-putting expires by itself; `history` 1.
//! The server must run with JetStream (`nats-server -js`).
//!
//! A bucket deleted while a directory is open ends its watches; a
//! directory that creates its bucket when absent ([`NatsDirectory::from_client`],
//! the router's and the donors') creates it again, with the configuration
//! it would have created at start, when [`DirectoryPlane::watch`] finds it
//! absent: otherwise a deleted bucket kept every router's follower at
//! `donor directory watch down` until a restart. One without the permission
//! (`$JS.API.STREAM.CREATE.KV_<bucket>`) gets an error, each watch, until
//! someone who has it creates the bucket.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use kv_descriptor::{EngineId, Wire};
use tokio::sync::mpsc;

use super::{decode_change, directory_key, DirectoryChange, DirectoryPlane, DirectoryWatch};
use crate::event_plane::{AbortOnDrop, PermissionRefusals, Refusal};
use crate::{NatsOptions, NatsPlane, PlaneError, PlaneFuture};

/// nats-server's floor for a key-value bucket's `max_age`: it refuses to
/// create a bucket whose `max_age` is shorter (0 means "no limit", which a
/// directory must not have: a dead donor's record would never expire).
pub const NATS_MIN_MAX_AGE: Duration = Duration::from_millis(100);

/// A JetStream key-value directory.
pub struct NatsDirectory {
    /// Kept across a re-creation of the bucket: its puts, deletes and
    /// watches address the bucket's subjects and its stream `KV_<bucket>`
    /// by name, which a bucket created again keeps.
    store: kv::Store,
    bucket: String,
    /// To create the bucket again (`create`).
    js: jetstream::Context,
    /// The server list, credentials shown as `***` (error messages only).
    shown_url: String,
    /// `max_age` the bucket is created with when absent, at open and when
    /// a watch finds it deleted; `None` for a reader that never creates it
    /// ([`NatsDirectory::open_existing`]).
    create: Option<Duration>,
    /// The permission violations the server sends the connection, when it
    /// is a [`NatsPlane`]'s: a creation the server refuses then fails at
    /// once naming the permission ([`PlaneError::BucketCreateRefused`]).
    refusals: Option<PermissionRefusals>,
}

impl std::fmt::Debug for NatsDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsDirectory")
            .field("bucket", &self.bucket)
            .finish()
    }
}

impl NatsDirectory {
    /// Connects to `url` without credentials and opens bucket `bucket`
    /// ([`NatsDirectory::connect_with`] with [`NatsOptions::default`]).
    ///
    /// # Errors
    /// As [`NatsDirectory::connect_with`].
    pub async fn connect(url: &str, bucket: &str, lease_ttl: Duration) -> Result<Self, PlaneError> {
        Self::connect_with(url, NatsOptions::default(), bucket, lease_ttl).await
    }

    /// Connects to `url` with `options` (credentials file, user and
    /// password, token, TLS: the same connect path as [`NatsPlane::connect`])
    /// and opens bucket `bucket` ([`NatsDirectory::from_plane`]).
    ///
    /// # Errors
    /// [`PlaneError::InvalidBucket`] before connecting, for a name NATS
    /// would refuse; [`PlaneError::TtlBelowFloor`] before connecting, for a
    /// `lease_ttl` below [`NATS_MIN_MAX_AGE`]; [`PlaneError::Connect`] naming `url` when the server is
    /// unreachable, refuses the credentials (its reason then says
    /// `authorization violation`) or demands TLS the options do not give;
    /// as [`NatsDirectory::from_plane`] once connected.
    pub async fn connect_with(
        url: &str,
        options: NatsOptions,
        bucket: &str,
        lease_ttl: Duration,
    ) -> Result<Self, PlaneError> {
        check_bucket(bucket)?;
        check_ttl(lease_ttl)?;
        let plane = NatsPlane::connect(url, options).await?;
        Self::from_plane(&plane, url, bucket, lease_ttl).await
    }

    /// [`NatsDirectory::from_client`] on `plane`'s connection, which also
    /// sees the server's permission violations: when the bucket is absent
    /// and the connection's user may not create it, the error is
    /// [`PlaneError::BucketCreateRefused`] naming the subject, as soon as
    /// the server refuses, instead of a `timed out` 10 s later.
    ///
    /// # Errors
    /// As [`NatsDirectory::from_client`], and
    /// [`PlaneError::BucketCreateRefused`].
    pub async fn from_plane(
        plane: &NatsPlane,
        url: &str,
        bucket: &str,
        lease_ttl: Duration,
    ) -> Result<Self, PlaneError> {
        check_bucket(bucket)?;
        check_ttl(lease_ttl)?;
        let refusals = Some(plane.refusals().clone());
        Self::open(
            plane.client().clone(),
            refusals,
            url,
            bucket,
            Some(lease_ttl),
        )
        .await
    }

    /// Opens bucket `bucket` on an existing connection (e.g. the process's
    /// [`NatsPlane::client`], so the directory shares its credentials).
    /// An existing bucket is opened as it is (its own `max_age`); only an
    /// absent one is created with `max_age` = `lease_ttl`, `history` 1. Why
    /// open first: under per-role permissions (docs/nats-permissions.conf)
    /// only an operator creates the bucket, and a role without
    /// `$JS.API.STREAM.CREATE` must still be able to use it. A
    /// [`DirectoryPlane::watch`] that finds the bucket deleted creates it
    /// again the same way (module docs).
    ///
    /// # Errors
    /// [`PlaneError::InvalidBucket`] for a name NATS would refuse
    /// ([`crate::bucket_name_problem`]), [`PlaneError::TtlBelowFloor`] for a
    /// `lease_ttl` below [`NATS_MIN_MAX_AGE`] (whether or not the bucket
    /// exists), before any request;
    /// [`PlaneError::BucketUnavailable`] naming `url` (only used in the
    /// message) when the server has no JetStream or the bucket can be
    /// neither opened nor created. A bare client does not show this
    /// directory the server's permission violations (async-nats reports
    /// them only to the event callback the client was made with): a
    /// creation refused for want of `$JS.API.STREAM.CREATE.KV_<bucket>`
    /// times out, and the error says that this is what a missing
    /// permission looks like. [`NatsDirectory::from_plane`] names it.
    pub async fn from_client(
        client: async_nats::Client,
        url: &str,
        bucket: &str,
        lease_ttl: Duration,
    ) -> Result<Self, PlaneError> {
        check_bucket(bucket)?;
        check_ttl(lease_ttl)?;
        Self::open(client, None, url, bucket, Some(lease_ttl)).await
    }

    /// Opens bucket `bucket` on an existing connection only if it exists:
    /// never creates it. For a reader (a prefill worker's directory watch):
    /// a mistyped bucket name would otherwise create an empty bucket that no
    /// donor writes, and every lookup would find nothing, with no error.
    ///
    /// # Errors
    /// [`PlaneError::InvalidBucket`] for a name NATS would refuse, before
    /// any request; [`PlaneError::NoSuchBucket`] when the server has no
    /// such bucket; [`PlaneError::Connect`] naming `url` (only used in the
    /// message) when the server has no JetStream or the bucket cannot be
    /// opened.
    pub async fn open_existing(
        client: async_nats::Client,
        url: &str,
        bucket: &str,
    ) -> Result<Self, PlaneError> {
        check_bucket(bucket)?;
        Self::open(client, None, url, bucket, None).await
    }

    /// Opens `bucket`; when it is absent, creates it with `max_age` =
    /// `create` if that is given, else refuses with
    /// [`PlaneError::NoSuchBucket`].
    async fn open(
        client: async_nats::Client,
        refusals: Option<PermissionRefusals>,
        url: &str,
        bucket: &str,
        create: Option<Duration>,
    ) -> Result<Self, PlaneError> {
        let shown_url = crate::redact_url(url);
        let bucket_err = |reason: String| PlaneError::BucketUnavailable {
            url: shown_url.clone(),
            bucket: bucket.to_string(),
            reason,
        };
        let js = jetstream::new(client);
        let opened = js.get_key_value(bucket).await;
        let store = match (opened, create) {
            (Ok(store), _) => store,
            (Err(e), None) => {
                if stream_not_found(&e) {
                    return Err(PlaneError::NoSuchBucket {
                        bucket: bucket.to_string(),
                    });
                }
                let hint = no_jetstream_hint(&js).await;
                return Err(bucket_err(format!("{hint}{e}")));
            }
            (Err(_), Some(lease_ttl)) => {
                match create_bucket(&js, refusals.as_ref(), bucket, lease_ttl).await {
                    Ok(store) => store,
                    Err(Failed::Refused(Refusal { subject, server })) => {
                        return Err(PlaneError::BucketCreateRefused {
                            url: shown_url,
                            bucket: bucket.to_string(),
                            subject,
                            server,
                        })
                    }
                    Err(Failed::Other(reason)) => return Err(bucket_err(reason)),
                }
            }
        };
        Ok(Self {
            store,
            bucket: bucket.to_string(),
            js,
            shown_url,
            create,
            refusals,
        })
    }

    /// Creates the bucket again with `max_age`, as [`NatsDirectory::open`]
    /// would have at start, after a watch found it absent; logs one warning
    /// saying so.
    ///
    /// # Errors
    /// [`PlaneError::BucketCreateRefused`] when the server refused it for
    /// want of a permission, [`PlaneError::BucketUnavailable`] when it
    /// cannot be created for another reason (no JetStream, a timeout),
    /// saying that it was deleted.
    async fn create_again(&self, max_age: Duration) -> Result<(), PlaneError> {
        match create_bucket(&self.js, self.refusals.as_ref(), &self.bucket, max_age).await {
            Ok(_) => {
                tracing::warn!(
                    bucket = %self.bucket,
                    max_age_ms = max_age.as_millis() as u64,
                    "donor directory bucket was deleted: created it again, as at start"
                );
                Ok(())
            }
            Err(Failed::Refused(Refusal { subject, server })) => {
                Err(PlaneError::BucketCreateRefused {
                    url: self.shown_url.clone(),
                    bucket: self.bucket.clone(),
                    subject,
                    server,
                })
            }
            Err(Failed::Other(reason)) => Err(PlaneError::BucketUnavailable {
                url: self.shown_url.clone(),
                bucket: self.bucket.clone(),
                reason: format!(
                    "it was deleted, and creating it again failed \
                     (retried at each watch; the bucket is watched again once \
                     anyone creates it): {reason}"
                ),
            }),
        }
    }
}

/// Why [`create_bucket`] failed.
enum Failed {
    /// The server refused one of its requests for want of a permission.
    Refused(Refusal),
    /// Anything else, as the reason of a [`PlaneError::BucketUnavailable`]
    /// (the no-JetStream hint first when it applies).
    Other(String),
}

/// Creates `bucket` with `max_age` ([`bucket_config`]). With `refusals`
/// (the connection's permission violations) a refusal of the creation's
/// requests ends the wait as soon as the server sends it: the server drops
/// a request its user may not publish and says so only on the connection,
/// so the request alone would time out.
async fn create_bucket(
    js: &jetstream::Context,
    refusals: Option<&PermissionRefusals>,
    bucket: &str,
    max_age: Duration,
) -> Result<kv::Store, Failed> {
    let create_subject = format!("$JS.API.STREAM.CREATE.KV_{bucket}");
    // `create_key_value` asks the account's limits first, then creates.
    let subjects = ["$JS.API.INFO", create_subject.as_str()];
    // Listening before the requests go out: the refusal comes back at once.
    let mut listener = refusals.map(PermissionRefusals::listen);
    let refused = async {
        match listener.as_mut() {
            Some(l) => l.refused(&subjects).await,
            None => std::future::pending().await,
        }
    };
    let created = tokio::select! {
        created = js.create_key_value(bucket_config(bucket, max_age)) => created,
        refusal = refused => return Err(Failed::Refused(refusal)),
    };
    match created {
        Ok(store) => Ok(store),
        Err(e) => {
            let hint = no_jetstream_hint(js).await;
            // Without the refusals (a bare client's directory), a missing
            // permission shows only as this timeout.
            let permission = if e.kind() == jetstream::context::CreateKeyValueErrorKind::TimedOut {
                format!(
                    " (a connection whose user may not publish to `{create_subject}` \
                     times out like this: the server drops the request and reports \
                     the permissions violation only on the connection)"
                )
            } else {
                String::new()
            };
            Err(Failed::Other(format!("{hint}{e}{permission}")))
        }
    }
}

/// The configuration a directory creates its bucket with: `max_age` (a
/// record whose donor stopped re-putting expires) and one value per key.
fn bucket_config(bucket: &str, max_age: Duration) -> kv::Config {
    kv::Config {
        bucket: bucket.to_string(),
        history: 1,
        max_age,
        ..Default::default()
    }
}

/// True when a watch could not start because the bucket's stream
/// (`KV_<bucket>`) does not exist (JetStream error 10059 on its consumer's
/// creation): the bucket was deleted.
fn watch_stream_not_found(e: &kv::WatchError) -> bool {
    use jetstream::stream::{ConsumerError, ConsumerErrorKind};
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<ConsumerError>())
        .is_some_and(|c| {
            matches!(c.kind(), ConsumerErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
        })
}

/// True when opening a bucket failed because its stream (`KV_<bucket>`)
/// does not exist (JetStream error 10059), as opposed to no JetStream, a
/// permission refusal or a timeout.
fn stream_not_found(e: &jetstream::context::KeyValueError) -> bool {
    use jetstream::context::{GetStreamError, GetStreamErrorKind};
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<GetStreamError>())
        .is_some_and(|g| {
            matches!(g.kind(), GetStreamErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
        })
}

/// The connection works but a bucket could not be opened or created: say
/// what the operator must change when the cause is a server without
/// JetStream (empty otherwise).
async fn no_jetstream_hint(js: &jetstream::Context) -> &'static str {
    let no_js = matches!(
        js.query_account().await,
        Err(a) if a.kind() == jetstream::context::AccountErrorKind::JetStreamUnavailable
    );
    if no_js {
        "the server has no JetStream (start nats-server with -js, or a `jetstream` block in its config); "
    } else {
        ""
    }
}

impl DirectoryPlane for NatsDirectory {
    fn put<'a>(&'a self, record: &'a super::DonorRecord) -> PlaneFuture<'a, ()> {
        Box::pin(async move {
            let key = directory_key(record.engine_id());
            let err = |reason: String| PlaneError::Publish {
                subject: format!("{}/{key}", self.bucket),
                reason,
            };
            let bytes = record.to_wire().map_err(|e| err(e.to_string()))?;
            self.store
                .put(&key, bytes.into())
                .await
                .map_err(|e| err(e.to_string()))?;
            Ok(())
        })
    }

    fn delete<'a>(&'a self, engine: EngineId) -> PlaneFuture<'a, ()> {
        Box::pin(async move {
            let key = directory_key(engine);
            self.store
                .delete(&key)
                .await
                .map_err(|e| PlaneError::Publish {
                    subject: format!("{}/{key}", self.bucket),
                    reason: e.to_string(),
                })
        })
    }

    fn watch<'a>(&'a self) -> PlaneFuture<'a, DirectoryWatch> {
        Box::pin(async move {
            let err = |e: kv::WatchError| PlaneError::Subscribe {
                subject: self.bucket.clone(),
                reason: e.to_string(),
            };
            // `watch_with_history(">")` delivers the last value of every key
            // first, then every change.
            let mut w = match (self.store.watch_with_history(">").await, self.create) {
                (Ok(w), _) => w,
                (Err(e), Some(max_age)) if watch_stream_not_found(&e) => {
                    self.create_again(max_age).await?;
                    self.store.watch_with_history(">").await.map_err(err)?
                }
                (Err(e), _) => return Err(err(e)),
            };
            let (tx, rx) = mpsc::unbounded_channel();
            let task = tokio::spawn(async move {
                while let Some(Ok(entry)) = w.next().await {
                    let change = match entry.operation {
                        kv::Operation::Put => decode_change(&entry.key, &entry.value),
                        kv::Operation::Delete | kv::Operation::Purge => {
                            match entry.key.parse::<uuid::Uuid>() {
                                Ok(u) => DirectoryChange::Delete(EngineId(u)),
                                Err(_) => continue,
                            }
                        }
                    };
                    if tx.send(change).is_err() {
                        break;
                    }
                }
            });
            Ok(DirectoryWatch::new(rx, Some(AbortOnDrop(task))))
        })
    }
}

/// [`crate::bucket_name_problem`] as a [`PlaneError::InvalidBucket`].
fn check_bucket(bucket: &str) -> Result<(), PlaneError> {
    match super::bucket_name_problem(bucket) {
        None => Ok(()),
        Some(reason) => Err(PlaneError::InvalidBucket {
            bucket: bucket.to_string(),
            reason,
        }),
    }
}

/// A `lease_ttl` below [`NATS_MIN_MAX_AGE`] as a [`PlaneError::TtlBelowFloor`].
fn check_ttl(lease_ttl: Duration) -> Result<(), PlaneError> {
    if lease_ttl < NATS_MIN_MAX_AGE {
        return Err(PlaneError::TtlBelowFloor {
            field: "lease_ttl",
            ttl: lease_ttl,
            floor: NATS_MIN_MAX_AGE,
        });
    }
    Ok(())
}
