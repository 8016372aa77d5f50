//! `kv-reuse-router`: the router service of decode-to-prefill KV reuse as a
//! process (`docs/router-service.md`).
//!
//! It connects to NATS, follows worker announcements, KV events and the
//! donor directory into a kv-lookup index (optionally also vLLM's ZMQ KV
//! events), answers advise requests on `kv_reuse.advise` (queue group
//! `kv_reuse_router`), serves `GET /metrics` and `GET /healthz`, and drains
//! on SIGTERM/SIGINT (exit 0). When it serves, it prints one line to stdout:
//! `{"event":"ready","metrics_addr":"127.0.0.1:PORT","subject":"kv_reuse.advise"}`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kv_descriptor::Role;
use kv_lookup::InventoryIndex;
use kv_router_glue::metrics::{Health, MetricsServer, ReuseMetrics};
use kv_router_glue::service::{
    DedicatedAdviseServer, DedicatedOptions, RouterInventory, RouterService, ServiceError,
    VllmEndpointSpec, ADVISE_SUBJECT,
};
use kv_router_glue::vllm_events::{VllmEventError, VllmIngest, VllmSubscriber};
use kv_router_glue::{
    Advisor, CostModel, DecisionLog, EnvSnapshot, EventPlane, InventoryError, InventorySync,
    LiveCostModel, NatsAuth, NatsDirectory, NatsInventory, NatsOptions, NatsPlane, NatsTls,
    PlaneError, RemoteDonorDirectory, ReuseArgs, SettingsError, SettingsLoader,
    DEFAULT_INVENTORY_TIMEOUT,
};
use tokio_util::sync::CancellationToken;

/// The router service of decode-to-prefill KV reuse.
///
/// Follows workers over NATS (announcements on `kv.<NAMESPACE>.workers.announce`,
/// the KV events on the subjects they announce, the donor directory in a
/// JetStream key-value bucket) and answers advise requests on NATS subject
/// `kv_reuse.advise` (queue group `kv_reuse_router`; msgpack schema in
/// docs/wire-formats.md). Prints one JSON `ready` line on stdout once serving;
/// SIGTERM or SIGINT stops taking requests, answers those in flight and exits 0.
///
/// Reuse settings (the `--enable-decode-to-prefill-reuse` ... flags below) are
/// layered: defaults < `--settings` TOML file < `KV_REUSE_*` environment < flags.
#[derive(Parser, Debug)]
#[command(name = "kv-reuse-router", version, about, long_about)]
struct Cli {
    /// NATS server URL.
    #[arg(
        long,
        env = "KV_ROUTER_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,

    /// NATS credentials file (`.creds`: user JWT and NKey seed) for the
    /// router role; default: no credentials. Exclusive with
    /// `--nats-user` and `--nats-token`.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["nats_user", "nats_token"])]
    nats_creds: Option<PathBuf>,

    /// NATS user of the router role (the server's `authorization.users`,
    /// docs/nats-permissions.conf); needs `--nats-password`.
    #[arg(
        long,
        env = "KV_ROUTER_NATS_USER",
        requires = "nats_password",
        conflicts_with = "nats_token"
    )]
    nats_user: Option<String>,

    /// Password of `--nats-user`. Prefer the environment variable: a flag
    /// is visible to every user of the host in the process list.
    #[arg(
        long,
        env = "KV_ROUTER_NATS_PASSWORD",
        requires = "nats_user",
        hide_env_values = true
    )]
    nats_password: Option<String>,

    /// NATS bearer token (the server's `authorization.token`); from the
    /// environment variable rather than the flag, as for the password.
    #[arg(long, env = "KV_ROUTER_NATS_TOKEN", hide_env_values = true)]
    nats_token: Option<String>,

    /// PEM file of the CA certificates that sign the NATS server's
    /// certificate (replaces the system roots); implies TLS.
    #[arg(long, value_name = "PATH")]
    nats_tls_ca: Option<PathBuf>,

    /// PEM client certificate for a server that verifies clients; needs
    /// `--nats-tls-key`; implies TLS.
    #[arg(long, value_name = "PATH", requires = "nats_tls_key")]
    nats_tls_cert: Option<PathBuf>,

    /// PEM private key of `--nats-tls-cert`.
    #[arg(long, value_name = "PATH", requires = "nats_tls_cert")]
    nats_tls_key: Option<PathBuf>,

    /// Refuse to connect without TLS even when the server does not ask
    /// for it (implied by `--nats-tls-ca` and `--nats-tls-cert`).
    #[arg(long)]
    nats_tls_required: bool,

    /// Prefix of the router's NATS reply subjects (default `_INBOX`); with
    /// the example permissions, `_INBOX_router` (docs/nats-permissions.conf).
    #[arg(long, env = "KV_ROUTER_NATS_INBOX_PREFIX", value_parser = inbox_prefix)]
    nats_inbox_prefix: Option<String>,

    /// Namespace token of the worker subjects (`kv.<NAMESPACE>.workers.announce`).
    #[arg(long, default_value = "default")]
    namespace: String,

    /// TOML file of reuse settings (keys as in docs/settings.md).
    #[arg(long, value_name = "PATH")]
    settings: Option<PathBuf>,

    /// A vLLM engine's ZMQ KV event stream to ingest, repeatable:
    /// `ENDPOINT[,replay=EP][,fingerprint=N][,role=decode|prefill][,tp=N][,block=N][,worker=NAME]`
    /// (`fingerprint` required; see docs/router-service.md).
    #[arg(long = "vllm-events", value_name = "ENDPOINT[,KEY=VALUE]...")]
    vllm_events: Vec<VllmEndpointSpec>,

    /// Address of the HTTP endpoint serving `GET /metrics` (Prometheus /
    /// OpenMetrics text) and `GET /healthz` (200 serving, 503 draining or
    /// NATS disconnected); port 0 picks a free one (printed in the ready line).
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: SocketAddr,

    /// JetStream key-value bucket of the donor directory.
    #[arg(long, default_value = "kv_donors")]
    directory_bucket: String,

    /// `max_age` of the directory bucket when this router creates it, ms
    /// (donors' record TTL; an existing bucket keeps its own).
    #[arg(long, default_value_t = 30_000)]
    directory_ttl_ms: u64,

    /// Workers' announce period, ms.
    #[arg(long, default_value_t = 1_000)]
    announce_period_ms: u64,

    /// Announce periods a worker may miss before it is dropped.
    #[arg(long, default_value_t = 3)]
    missed_periods: u32,

    /// Tokens per KV block of the cost model (the engines' block size).
    #[arg(long, default_value_t = 16)]
    tokens_per_block: u32,

    /// Most index probes one donor lookup may spend.
    #[arg(long, default_value_t = 16_384)]
    max_probes: u32,

    /// Decisions kept in the in-memory decision log.
    #[arg(long, default_value_t = 1_024)]
    decision_log: usize,

    /// After each advise answer, poll for the next request without sleeping
    /// for this many µs (0: never spin). Saves a thread wake-up per request
    /// while requests come closer than this; spends up to this much of one
    /// core per request. Only with cores to spare.
    #[arg(long, default_value_t = 0)]
    advise_busy_poll_us: u64,

    #[command(flatten)]
    reuse: ReuseArgs,
}

/// Why the router did not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
enum RouterError {
    #[error("settings: {0}")]
    Settings(#[from] SettingsError),
    #[error("NATS: {0}")]
    Plane(#[from] PlaneError),
    /// Only a bad `--namespace` token (the inventory subjects are built from it).
    #[error("inventory sync: {0}")]
    Inventory(#[from] InventoryError),
    #[error("vLLM events `{endpoint}`: {source}")]
    Vllm {
        endpoint: String,
        source: VllmEventError,
    },
    #[error("`--metrics-addr` {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("advise service: {0}")]
    Service(#[from] ServiceError),
    #[error("signal handler: {0}")]
    Signal(std::io::Error),
}

impl RouterError {
    /// 2 for configuration errors, 1 for anything at run time.
    fn exit_code(&self) -> u8 {
        match self {
            RouterError::Settings(_) | RouterError::Metrics { .. } | RouterError::Inventory(_) => 2,
            _ => 1,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KV_ROUTER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kv-reuse-router: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv-reuse-router: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// `--nats-inbox-prefix`'s check (clap names the flag in the error).
fn inbox_prefix(v: &str) -> Result<String, String> {
    match kv_router_glue::inbox_prefix_problem(v) {
        None => Ok(v.to_owned()),
        Some(why) => Err(why.to_owned()),
    }
}

/// The router's NATS connection options from its `--nats-*` flags (clap
/// has already refused conflicting or incomplete combinations).
fn nats_options(cli: &Cli) -> NatsOptions {
    let auth = match (
        &cli.nats_creds,
        &cli.nats_user,
        &cli.nats_password,
        &cli.nats_token,
    ) {
        (Some(path), ..) => NatsAuth::CredentialsFile(path.clone()),
        (None, Some(user), Some(password), _) => NatsAuth::UserPassword {
            user: user.clone(),
            password: password.clone(),
        },
        (None, None, _, Some(token)) => NatsAuth::Token(token.clone()),
        _ => NatsAuth::None,
    };
    let client_certificate = cli.nats_tls_cert.clone().zip(cli.nats_tls_key.clone());
    let tls = NatsTls {
        // Either file turns TLS on by itself (`NatsTls::in_force`).
        require: cli.nats_tls_required,
        root_certificates: cli.nats_tls_ca.clone(),
        client_certificate,
    };
    NatsOptions {
        name: "kv-reuse-router".into(),
        auth,
        tls,
        inbox_prefix: cli.nats_inbox_prefix.clone(),
        ..NatsOptions::default()
    }
}

async fn run(cli: Cli) -> Result<(), RouterError> {
    let mut loader = SettingsLoader::new();
    if let Some(path) = &cli.settings {
        loader = loader.toml_file(path)?;
    }
    let loaded = loader
        .env(&EnvSnapshot::capture())?
        .reuse_args(&cli.reuse)
        .build()?;
    tracing::info!("settings in force:\n{}", loaded.describe());
    let model = CostModel::new(loaded.settings.clone(), cli.tokens_per_block)?;

    let options = nats_options(&cli);
    let plane = Arc::new(NatsPlane::connect(&cli.nats_url, options.clone()).await?);
    // The plane's own connection: the directory reads under the router's
    // credentials (a second, anonymous connection is refused by a server
    // that requires them).
    let directory = NatsDirectory::from_client(
        plane.client().clone(),
        &cli.nats_url,
        &cli.directory_bucket,
        Duration::from_millis(cli.directory_ttl_ms),
    )
    .await?;

    let index = Arc::new(InventoryIndex::new());
    let remote = Arc::new(RemoteDonorDirectory::new());
    let advisor = Advisor::new(
        index.clone(),
        remote.clone(),
        LiveCostModel::new(model),
        Arc::new(DecisionLog::new(cli.decision_log)),
        cli.max_probes,
    );
    let service = Arc::new(RouterService::new(Arc::new(advisor)));
    // Snapshots over the router's own connection (its credentials), so a
    // restarted router finds donors that stayed idle (docs/agents.md).
    let sync = InventorySync::new(
        Arc::new(NatsInventory::from_client(plane.client().clone())),
        &cli.namespace,
        DEFAULT_INVENTORY_TIMEOUT,
    )?;
    let inventory = Arc::new(RouterInventory::new(
        index.clone(),
        remote.clone(),
        service.clone(),
        sync,
        cli.announce_period_ms,
        cli.missed_periods,
    ));
    let stop_following = CancellationToken::new();
    let followers = inventory
        .follow(
            plane.clone() as Arc<dyn EventPlane>,
            &directory,
            &cli.namespace,
            Duration::from_millis(cli.announce_period_ms.max(1)),
            stop_following.clone(),
        )
        .await?;

    let mut vllm = Vec::new();
    for spec in &cli.vllm_events {
        let vllm_err = |source| RouterError::Vllm {
            endpoint: spec.endpoint.clone(),
            source,
        };
        let ingest = VllmIngest::new(index.clone(), spec.worker).map_err(vllm_err)?;
        let sub = VllmSubscriber::start(spec.subscriber_config(), ingest)
            .await
            .map_err(vllm_err)?;
        if spec.worker.role == Role::Prefill {
            service.add_target(spec.worker.engine);
        }
        tracing::info!(endpoint = %spec.endpoint, worker = %spec.worker_name, engine = %spec.worker.engine, "ingesting vLLM KV events");
        vllm.push(sub);
    }

    let metrics = Arc::new(ReuseMetrics::new());
    // Advise requests on their own thread and connection (same name,
    // credentials and TLS as the plane's), so no other router task sits
    // between a request and its reply (docs/router-service.md, "Latency").
    let server = DedicatedAdviseServer::start(
        &cli.nats_url,
        NatsOptions {
            name: "kv-reuse-router-advise".into(),
            ..options
        },
        service.clone(),
        DedicatedOptions {
            metrics: Some(metrics.clone()),
            probe: None,
            busy_poll: std::time::Duration::from_micros(cli.advise_busy_poll_us),
        },
    )
    .await?;
    let draining = Arc::new(AtomicBool::new(false));
    let probe = {
        let (draining, plane) = (draining.clone(), plane.clone());
        let advise = server.client().clone();
        Arc::new(move || {
            if draining.load(Ordering::SeqCst) {
                Health::Unavailable("draining")
            } else if !plane.is_connected()
                || advise.connection_state() != async_nats::connection::State::Connected
            {
                Health::Unavailable("nats disconnected")
            } else {
                Health::Serving
            }
        })
    };
    let http = MetricsServer::bind_with_health(cli.metrics_addr, metrics.clone(), probe)
        .await
        .map_err(|source| RouterError::Metrics {
            addr: cli.metrics_addr,
            source,
        })?;

    // Handlers before the ready line: a harness may signal right after it.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(RouterError::Signal)?;
    let mut int = signal(SignalKind::interrupt()).map_err(RouterError::Signal)?;

    let ready = serde_json::json!({
        "event": "ready",
        "metrics_addr": http.local_addr().to_string(),
        "subject": ADVISE_SUBJECT,
    });
    {
        let mut out = std::io::stdout().lock();
        // A closed stdout (harness gone) must not stop a serving router.
        let _ = writeln!(out, "{ready}");
        let _ = out.flush();
    }

    let signal_name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(signal = signal_name, "draining");
    draining.store(true, Ordering::SeqCst);
    let report = server.stop().await?;
    // Requests arriving after this (none reach us once unsubscribed) would
    // be refused as draining.
    service.drain();
    stop_following.cancel();
    drop(followers);
    for (spec, sub) in cli.vllm_events.iter().zip(vllm) {
        let (_, stats) = sub.stop().await;
        tracing::info!(endpoint = %spec.endpoint, stats = ?stats, "vLLM KV events stopped");
    }
    http.shutdown().await;
    tracing::info!(
        received = report.received,
        decided = report.decided,
        refused = report.refused,
        after_shutdown = report.after_shutdown,
        follow = ?inventory.stats(),
        "stopped"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("kv-reuse-router").chain(args.iter().copied()))
    }

    #[test]
    fn nats_flags_pick_the_auth_and_tls() {
        // Only these tests' own flags: a KV_ROUTER_NATS_* variable in the
        // test's environment would change clap's defaults.
        for v in [
            "KV_ROUTER_NATS_USER",
            "KV_ROUTER_NATS_PASSWORD",
            "KV_ROUTER_NATS_TOKEN",
            "KV_ROUTER_NATS_INBOX_PREFIX",
        ] {
            if std::env::var_os(v).is_some() {
                eprintln!("SKIP nats flag test: {v} is set in this environment");
                return;
            }
        }
        let o = nats_options(&parse(&[]).unwrap());
        assert!(matches!(o.auth, NatsAuth::None));
        assert!(!o.tls.in_force() && o.tls.root_certificates.is_none());
        let o = nats_options(&parse(&["--nats-user", "router", "--nats-password", "pw"]).unwrap());
        assert!(
            matches!(&o.auth, NatsAuth::UserPassword { user, password } if user == "router" && password == "pw")
        );
        let o = nats_options(&parse(&["--nats-token", "t0k"]).unwrap());
        assert!(matches!(&o.auth, NatsAuth::Token(t) if t == "t0k"));
        let o = nats_options(&parse(&["--nats-creds", "/r.creds"]).unwrap());
        assert!(
            matches!(&o.auth, NatsAuth::CredentialsFile(p) if p == std::path::Path::new("/r.creds"))
        );
        let o = nats_options(&parse(&["--nats-tls-ca", "/ca.pem"]).unwrap());
        assert!(o.tls.in_force());
        assert_eq!(
            o.tls.root_certificates.as_deref(),
            Some(std::path::Path::new("/ca.pem"))
        );
        let o = nats_options(
            &parse(&["--nats-tls-cert", "/c.pem", "--nats-tls-key", "/k.pem"]).unwrap(),
        );
        assert!(o.tls.in_force() && o.tls.client_certificate.is_some());
        assert!(
            nats_options(&parse(&["--nats-tls-required"]).unwrap())
                .tls
                .require
        );
        let o = nats_options(&parse(&["--nats-inbox-prefix", "_INBOX_router"]).unwrap());
        assert_eq!(o.inbox_prefix.as_deref(), Some("_INBOX_router"));
    }

    #[test]
    fn conflicting_or_incomplete_nats_flags_are_refused_naming_them() {
        for (args, named) in [
            (&["--nats-user", "u"][..], "--nats-password"),
            (&["--nats-password", "p"][..], "--nats-user"),
            (
                &["--nats-creds", "/r.creds", "--nats-token", "t"][..],
                "--nats-token",
            ),
            (
                &[
                    "--nats-user",
                    "u",
                    "--nats-password",
                    "p",
                    "--nats-token",
                    "t",
                ][..],
                "--nats-token",
            ),
            (&["--nats-tls-cert", "/c.pem"][..], "--nats-tls-key"),
            (&["--nats-tls-key", "/k.pem"][..], "--nats-tls-cert"),
            (
                &["--nats-inbox-prefix", "_INBOX.>"][..],
                "--nats-inbox-prefix",
            ),
        ] {
            let e = parse(args).expect_err(&format!("{args:?} must be refused"));
            assert!(e.to_string().contains(named), "{args:?}: {e}");
        }
    }
}
