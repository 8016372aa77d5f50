//! `DonorDirectory`: a prefill worker's read side of the donor directory
//! (the JetStream KV bucket of `DonorRecord`s that `WorkerPublisher.donor`
//! puts): a kv_router_glue [`NatsDirectory`] watch feeding a
//! [`HeardCache`] (a `DonorCache`, which refuses stale generations and
//! lapsed leases, bounded in time: an engine not heard of for 5 min without
//! a usable record is forgotten for good, as in the router), so that a
//! hint's donor manifest is resolved by engine id instead of being passed
//! around. A watch that ends (its bucket deleted) is opened again with
//! back-off (`watch_reopening`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use kv_descriptor::Wire;
use kv_router_glue::{
    redact_url, unix_now_ms, watch_reopening, HeardCache, NatsDirectory, NatsPlane,
};

use crate::errors::{descriptor, PublishFailed};
use crate::nats_auth::NatsCredentials;
use crate::nats_runtime::{check_bucket, check_nats_url, runtime, seconds_in, within};
use crate::process_bound::ProcessBound;
use crate::reprs::Repr;

/// The donor directory as seen from a prefill worker (module docs).
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct DonorDirectory {
    cache: Arc<Mutex<HeardCache>>,
    running: Mutex<Option<(tokio::runtime::Runtime, tokio::task::JoinHandle<()>)>>,
    /// The process that watches: in a forked child the watch does not run
    /// (its runtime's worker is the parent's), so the cache would never
    /// change again; reads there are refused (crate::process_bound).
    home: ProcessBound,
    /// `nats_url` with any password or token as `***`, for the repr (the
    /// raw URL is not kept).
    shown_url: String,
    bucket: String,
}

impl DonorDirectory {
    /// `PublishFailed` once closed, or naming `call` in a forked child: the
    /// watch no longer runs, so what the cache holds may be stale.
    fn check_open(&self, call: &str) -> PyResult<()> {
        self.home.check(call, PublishFailed::new_err)?;
        if self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
        {
            return Err(PublishFailed::new_err(
                "the donor directory is closed: its watch stopped, so its records may be stale",
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl DonorDirectory {
    /// Watches bucket `bucket` on the NATS server at `nats_url` (every live
    /// record first, then each change). `timeout_s` bounds connecting.
    /// Releases the GIL while it connects.
    ///
    /// `create` (keyword only, default False): a missing bucket is refused
    /// (`BadArgument` naming `bucket`) instead of created. A reader that
    /// created it on a mistyped name would watch an empty bucket no donor
    /// writes, `manifest` answering None forever with no error; the router
    /// and every `WorkerPublisher.donor` create the bucket when they start.
    /// `create=True` creates an absent bucket (a prefill worker that may
    /// start before any router or donor).
    ///
    /// The NATS keywords (`**nats`, keyword only): `user` + `password`,
    /// `token` or `creds` (a `.creds` file) authenticate, `tls_ca` (PEM CA
    /// file) turns TLS on, `tls_cert` + `tls_key` present a client
    /// certificate: the target role of docs/nats-permissions.conf.
    ///
    /// Raises `BadArgument` naming `nats_url` (not a NATS URL), `bucket`
    /// (not a key-value bucket name, or absent without `create=True`),
    /// `timeout_s` or a credentials argument (incomplete or mixed),
    /// `PublishFailed` when NATS or JetStream cannot be reached or refuses
    /// the credentials.
    #[new]
    #[pyo3(signature = (nats_url, bucket = "kv_donors", timeout_s = 5.0, *, create = false, **nats))]
    fn new(
        py: Python<'_>,
        nats_url: &str,
        bucket: &str,
        #[pyo3(from_py_with = "crate::errors::seconds")] timeout_s: f64,
        create: bool,
        nats: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        check_nats_url(nats_url)?;
        check_bucket(bucket)?;
        let timeout = seconds_in("timeout_s", timeout_s, 0.01..=3_600.0)?;
        let options = NatsCredentials::from_kwargs(nats)?.options(
            nats_url,
            "kv-reuse-py-directory",
            timeout,
        )?;
        let cache = Arc::new(Mutex::new(HeardCache::default()));
        let feed = cache.clone();
        let url = nats_url.to_owned();
        let watched = bucket.to_owned();
        let running = py.allow_threads(|| {
            let rt = runtime("directory")?;
            let watch = rt.block_on(async {
                let dir = within(&url, timeout, async {
                    let nats = NatsPlane::connect(&url, options).await?;
                    if create {
                        // The bucket's max_age only matters if this creates
                        // it; the router and the donors create it with their own.
                        NatsDirectory::from_plane(&nats, &url, &watched, Duration::from_secs(30))
                            .await
                    } else {
                        NatsDirectory::open_existing(nats.client().clone(), &url, &watched).await
                    }
                })
                .await?;
                // Opened again whenever it ends (its bucket deleted), or no
                // donor started since would ever be seen. With `create`
                // the directory creates a deleted bucket again; without,
                // it waits for whoever does (a router, a donor).
                let watch = within(&url, timeout, watch_reopening(Arc::new(dir))).await?;
                Ok::<_, PyErr>(watch)
            })?;
            let task = rt.spawn(async move {
                let mut watch = watch;
                while let Some(change) = watch.next().await {
                    feed.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .apply(change, unix_now_ms());
                }
            });
            Ok::<_, PyErr>((rt, task))
        })?;
        Ok(Self {
            cache,
            running: Mutex::new(Some(running)),
            home: ProcessBound::here("DonorDirectory"),
            shown_url: redact_url(nats_url),
            bucket: bucket.to_owned(),
        })
    }

    /// The manifest (wire form, what `Target.fetch` takes) of donor engine
    /// `engine_id` (UUID string), waiting up to `wait_s` seconds for its
    /// record to arrive; None when it has none (never published, deleted on
    /// close, lease lapsed). Releases the GIL while it waits.
    ///
    /// Raises `BadArgument` naming `engine_id` or `wait_s`, `PublishFailed`
    /// after `close()` (its watch stopped: the records it
    /// holds would be stale, a deleted or lapsed donor still answered).
    #[pyo3(signature = (engine_id, wait_s = 0.0))]
    fn manifest<'py>(
        &self,
        py: Python<'py>,
        engine_id: &str,
        #[pyo3(from_py_with = "crate::errors::seconds")] wait_s: f64,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let engine = crate::layout::engine_id(engine_id, "engine_id")?;
        let wait = seconds_in("wait_s", wait_s, 0.0..=3_600.0)?;
        self.check_open("manifest")?;
        let deadline = Instant::now() + wait;
        let found = loop {
            // Slices without the GIL, so that Ctrl-C is raised within one
            // (`SIGNAL_SLICE`), not after all of `wait_s`.
            let slice_end = (Instant::now() + crate::fetch_job::SIGNAL_SLICE).min(deadline);
            let got = py.allow_threads(|| loop {
                let got = self
                    .cache
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .cache()
                    .get(engine, unix_now_ms())
                    .ok()
                    .map(|r| r.manifest().to_wire());
                if got.is_some() || Instant::now() >= slice_end {
                    break got;
                }
                std::thread::sleep(Duration::from_millis(10));
            });
            if got.is_some() || Instant::now() >= deadline {
                break got;
            }
            py.check_signals()?;
        };
        found
            .transpose()
            .map_err(descriptor)
            .map(|b| b.map(|b| PyBytes::new(py, &b)))
    }

    /// Donors whose record `manifest` would answer now (count): a record
    /// whose lease lapsed does not count, though the bucket keeps it until
    /// its own `max_age`. Raises `PublishFailed` after `close()`, as
    /// `manifest` does.
    #[getter]
    fn donors(&self) -> PyResult<usize> {
        self.check_open("donors")?;
        Ok(self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .cache()
            .live(unix_now_ms()))
    }

    /// Stops watching; later `manifest` calls and `donors` raise
    /// `PublishFailed`. Idempotent.
    fn close(&self, py: Python<'_>) {
        let running = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((rt, task)) = running.and_then(|r| self.home.keep_here(r)) {
            py.allow_threads(|| {
                task.abort();
                rt.shutdown_timeout(Duration::from_secs(1));
            });
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    /// `<kv_reuse.DonorDirectory nats_url='nats://host:4222'
    /// bucket='kv_donors' open=True donors=2>` (`donors` only while open:
    /// a closed directory's count would be stale). No password or token.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let open = self.check_open("__repr__").is_ok();
        let r = Repr::object(py, "DonorDirectory")
            .field("nats_url", self.shown_url.as_str())?
            .field("bucket", self.bucket.as_str())?
            .field("open", open)?;
        Ok(if open {
            r.field("donors", self.donors()?)?
        } else {
            r
        }
        .finish())
    }
}

impl Drop for DonorDirectory {
    fn drop(&mut self) {
        let home = self.home;
        if let Some((rt, task)) = self
            .running
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .and_then(|r| home.keep_here(r))
        {
            task.abort();
            rt.shutdown_background();
        }
    }
}
