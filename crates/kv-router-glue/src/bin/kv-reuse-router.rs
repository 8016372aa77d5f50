//! `kv-reuse-router`: the router service of decode-to-prefill KV reuse as a
//! process (`docs/router-service.md`).
//!
//! It connects to NATS, follows worker announcements, KV events and the
//! donor directory into a kv-lookup index (optionally also vLLM's ZMQ KV
//! events), answers advise requests on `--advise-subject` (default
//! `kv_reuse.advise`, queue group `kv_reuse_router`), serves `GET /metrics`
//! and `GET /healthz`, and drains on SIGTERM/SIGINT (exit 0). When it serves,
//! it prints one line to stdout:
//! `{"event":"ready","metrics_addr":"127.0.0.1:PORT","subject":"kv_reuse.advise"}`.

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::builder::RangedU64ValueParser;
use clap::{value_parser, Parser};
use kv_lookup::InventoryIndex;
use kv_router_glue::metrics::{Health, MetricsServer, ReuseMetrics};
use kv_router_glue::service::{
    DedicatedAdviseServer, DedicatedOptions, RouterInventory, RouterService, ServiceError,
    VllmEndpointSpec,
};
use kv_router_glue::vllm_events::VllmEventError;
use kv_router_glue::{
    Advisor, CostModel, DecisionLog, DirectoryPlane, EnvSnapshot, EventPlane, InventoryError,
    InventorySync, LiveCostModel, NatsAuth, NatsDirectory, NatsInventory, NatsOptions, NatsPlane,
    NatsTls, PlaneError, RemoteDonorDirectory, ReuseArgs, SettingsError, SettingsLoader,
    DEFAULT_INVENTORY_TIMEOUT, NATS_MIN_MAX_AGE,
};
use tokio_util::sync::CancellationToken;

/// The router service of decode-to-prefill KV reuse.
///
/// Follows workers over NATS (announcements on `kv.<NAMESPACE>.workers.announce`,
/// the KV events on the subjects they announce, the donor directory in a
/// JetStream key-value bucket) and answers advise requests on NATS subject
/// `--advise-subject` (queue group `kv_reuse_router`; msgpack schema in
/// docs/wire-formats.md). Prints one JSON `ready` line on stdout once serving;
/// SIGTERM or SIGINT stops taking requests, answers those in flight and exits 0.
///
/// Reuse settings (the `--enable-decode-to-prefill-reuse` ... flags below) are
/// layered: defaults < `--settings` TOML file < `KV_REUSE_*` environment < flags.
///
/// Logs go to stderr; `KV_ROUTER_LOG` sets the filter (tracing-subscriber
/// syntax, default `info,async_nats=warn,zeromq=error`; a malformed one exits 2). Exit
/// codes: 0 after a drain (SIGTERM, SIGINT) or a signal during startup; 1 for
/// a run-time failure (NATS, the directory bucket or a vLLM endpoint
/// unreachable, a second signal cutting the drain, a follower task that
/// ended while serving); 2 for a configuration
/// error (flag, environment variable, settings file). SIGHUP is logged and
/// ignored (settings are read once: restart to change them). Details:
/// docs/router-service.md.
#[derive(Parser, Debug)]
#[command(
    name = "kv-reuse-router",
    version,
    about,
    long_about,
    allow_negative_numbers = true
)]
struct Cli {
    /// NATS servers: one URL or a comma-separated list, each `nats://`,
    /// `tls://`, `ws://` or `wss://` (no scheme: `nats://`); the client
    /// reaches one, moves to another when it is lost, and learns the
    /// cluster's other servers from the one it reaches. Credentials may be
    /// written in it (`nats://user:password@host`, `nats://token@host`; the
    /// same on every server), instead of the `--nats-user` / `--nats-token`
    /// / `--nats-creds` flags, not as well.
    // `hide_env_values`: `--help` would print the variable's value as set,
    // and a URL may carry a password (`nats://user:pw@host`).
    #[arg(
        long,
        env = "KV_ROUTER_NATS_URL",
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222",
        value_parser = NatsUrlParser
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

    /// Namespace token of the worker subjects (`kv.<NAMESPACE>.workers.announce`):
    /// one NATS subject token, non-empty, without `.`, `*`, `>` or whitespace.
    #[arg(long, default_value = "default", value_parser = namespace_token)]
    namespace: String,

    #[command(flatten)]
    advise: advise_subject::AdviseArgs,

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

    /// JetStream key-value bucket of the donor directory: ASCII letters,
    /// digits, `_` and `-` only (the NATS rule for bucket names).
    #[arg(long, default_value = "kv_donors", value_parser = bucket_name)]
    directory_bucket: String,

    /// `max_age` of the directory bucket when this router creates it, ms
    /// (donors' record TTL; an existing bucket keeps its own); 100 (the
    /// server's minimum) to 86,400,000 (one day).
    #[arg(
        long,
        default_value_t = 30_000,
        value_parser = value_parser!(u64).range(DIRECTORY_TTL_MS)
    )]
    directory_ttl_ms: u64,

    /// Workers' announce period, ms; 10 to 60,000 (the workers' own range).
    #[arg(
        long,
        default_value_t = 1_000,
        value_parser = value_parser!(u64).range(ANNOUNCE_PERIOD_MS)
    )]
    announce_period_ms: u64,

    /// Announce periods a worker may miss before it is dropped; 1 to 1,000.
    /// A dropped worker is taken back when it announces again; while the
    /// router's own NATS connection is down nobody's silence counts
    /// (docs/router-service.md, "Silence and NATS outages"). Dropped and
    /// replaced incarnations are remembered for 100 such windows, at least
    /// 5 min, at most 4,096 of each ("Memory of dropped workers").
    #[arg(
        long,
        default_value_t = 3,
        value_parser = value_parser!(u32).range(MISSED_PERIODS)
    )]
    missed_periods: u32,

    /// The engines' tokens per KV block, to check the reuse settings at
    /// start: with it, the router refuses to start (exit 2) when no fetch of
    /// such blocks could save time, and warns about each donor layout of
    /// another block size. Without it (the default) each donor layout is
    /// checked when its first directory record arrives (a warning, and
    /// `donor_layouts_unprofitable` in /metrics). Decisions always price
    /// the donor layout's own block size. At least 1.
    #[arg(long, value_parser = value_parser!(u32).range(1..))]
    tokens_per_block: Option<u32>,

    /// Most index probes one donor lookup may spend; at least 1.
    #[arg(long, default_value_t = 16_384, value_parser = value_parser!(u32).range(1..))]
    max_probes: u32,

    /// Decisions kept in the in-memory decision log; 1 to 1,000,000.
    #[arg(
        long,
        default_value_t = 1_024,
        value_parser = RangedU64ValueParser::<usize>::new().range(DECISION_LOG)
    )]
    decision_log: usize,

    /// After each advise answer, poll for the next request without sleeping
    /// for this many µs (0: never spin); 0 to 1,000,000 (one second, the
    /// Python client's bound too). Saves a thread wake-up per request
    /// while requests come closer than this; spends up to this much of one
    /// core per request. Only with cores to spare.
    #[arg(
        long,
        default_value_t = 0,
        value_parser = value_parser!(u64).range(ADVISE_BUSY_POLL_US)
    )]
    advise_busy_poll_us: u64,

    #[command(flatten)]
    reuse: ReuseArgs,
}

/// `--directory-ttl-ms`: 0 would create a bucket whose records never
/// expire (NATS `max_age` 0 is "no limit"), so a dead donor's record would
/// stay; nats-server refuses a `max_age` below 100 ms; one day is the
/// donors' longest lease (`lease_s` in `kv_reuse.WorkerPublisher.donor`).
const DIRECTORY_TTL_MS: RangeInclusive<u64> = NATS_MIN_MAX_AGE.as_millis() as u64..=86_400_000;
/// `--announce-period-ms`: 0 ticked the drop check as fast as possible and
/// dropped every worker between two announcements; the range is the
/// workers' own (`announce_period_s` 0.01 to 60 s).
const ANNOUNCE_PERIOD_MS: RangeInclusive<u64> = 10..=60_000;
/// `--missed-periods`: 0 was silently taken as 1; a bound keeps a dead
/// worker from being advised for hours (1,000 x 60 s is already 16 h).
const MISSED_PERIODS: RangeInclusive<i64> = 1..=1_000;
/// `--decision-log`: 0 was silently taken as 1; the upper bound keeps the
/// log's memory to a few hundred MB.
const DECISION_LOG: RangeInclusive<u64> = 1..=1_000_000;
/// `--advise-busy-poll-us`: 0 is off; above one second a spin outlasts any
/// reply worth waiting for and burns a core (the Python client's
/// `busy_poll_us` bound is the same).
const ADVISE_BUSY_POLL_US: RangeInclusive<u64> = 0..=1_000_000;

/// The log filter without `KV_ROUTER_LOG`: info, except async-nats' own
/// info lines, which repeat each client event our event callback logs
/// (with the servers, rate-limited), and so doubled every failed reconnect
/// attempt while NATS was down (trial h33, nit 7); and ZeroMQ's below
/// error, which logged one warning per reconnect attempt to a lost
/// `--vllm-events` endpoint and its raw peer identities (trial h39, 7): the
/// subscriber warns itself, naming the endpoint, once when it is lost and
/// once per 10 s while it stays lost.
const DEFAULT_LOG: &str = "info,async_nats=warn,zeromq=error";

/// Why the router did not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
enum RouterError {
    /// A flag whose value passed parsing but cannot be used (an unreadable
    /// TLS or credentials file), found before connecting.
    #[error("`{flag}` {reason}")]
    Config { flag: &'static str, reason: String },
    #[error("settings: {0}")]
    Settings(#[from] SettingsError),
    #[error("NATS: {0}")]
    Plane(#[from] PlaneError),
    /// Only a bad `--namespace` token (the inventory subjects are built from it).
    #[error("inventory sync: {0}")]
    Inventory(#[from] InventoryError),
    /// A `--vllm-events` stream the index refused or whose endpoint did
    /// not answer at start.
    #[error("`--vllm-events` {endpoint}: {source}")]
    Vllm {
        endpoint: String,
        source: VllmEventError,
    },
    /// `--metrics-addr` cannot be bound (in use, not an address of this
    /// host, a privileged port), found before connecting.
    #[error("`--metrics-addr` {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("advise service: {0}")]
    Service(#[from] ServiceError),
    #[error("signal handler: {0}")]
    Signal(std::io::Error),
    /// A second SIGTERM / SIGINT while the advise subscription drained
    /// (a drain waits up to 5 s + 5 s for a server that stopped answering,
    /// 1 s + 1 s when the connection is already down).
    #[error("{0} during the drain: stopped before the advise subscription was drained")]
    DrainCut(&'static str),
    /// A follower task ended while serving (`router_bin/stop.rs`).
    #[error("a follower of announcements, KV events, the donor directory or a vLLM stream ended while serving ({0}); exiting for a restart")]
    FollowerEnded(String),
}

impl RouterError {
    /// 2 for configuration errors, 1 for anything at run time (NATS, the
    /// directory bucket or a vLLM endpoint unreachable, a failed subscription).
    fn exit_code(&self) -> u8 {
        match self {
            RouterError::Config { .. }
            | RouterError::Settings(_)
            | RouterError::Metrics { .. }
            | RouterError::Inventory(_)
            | RouterError::Plane(PlaneError::InvalidSubject { .. })
            | RouterError::Plane(PlaneError::InvalidBucket { .. })
            | RouterError::Plane(PlaneError::TtlBelowFloor { .. }) => 2,
            _ => 1,
        }
    }
}

fn main() -> ExitCode {
    // A `KV_ROUTER_*` name the router does not read is a typo, refused
    // like an unknown `KV_REUSE_*` one rather than silently ignored.
    let cmd = <Cli as clap::CommandFactory>::command();
    let (known, flags) = (env_names::known(&cmd), env_names::flags_without_env(&cmd));
    if let Err(e) = env_names::check(std::env::vars_os().map(|(name, _)| name), &known, &flags) {
        eprintln!("kv-reuse-router: {e}");
        return ExitCode::from(2);
    }
    // `KV_REUSE_*` next, through the loader that names the variable:
    // clap reads them too (the flags' `env`), and its message named only
    // the flag (`invalid value '0' for '--minimum-transfer-prefix-blocks'`
    // for `KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS=0`; helper-20 finding
    // 17). `run` reads them again through the same loader.
    let env = EnvSnapshot::capture();
    if let Err(e) = SettingsLoader::new().env(&env) {
        // The loader's message names the setting; say which variable.
        let var = env.vars().find(|&(name, raw)| {
            let one = EnvSnapshot::from_pairs([(name, raw)]);
            SettingsLoader::new().env(&one).is_err()
        });
        match var {
            Some((name, _)) => eprintln!("kv-reuse-router: `{name}`: {e}"),
            None => eprintln!("kv-reuse-router: {e}"),
        }
        return ExitCode::from(2);
    }
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => match parse_errors::explain(&e, &args) {
            Some(text) => {
                eprint!("{text}");
                return ExitCode::from(2);
            }
            None => e.exit(),
        },
    };
    // A filter that does not parse is a configuration error like a bad
    // `KV_REUSE_*` value (exit 2 naming the variable), not a silent `info`:
    // an operator who asked for debug logs would otherwise never learn why
    // they do not come.
    // Empty counts as unset: an empty filter parsed to "errors only" and
    // hid every warning (trial h47, 7), what `KV_ROUTER_LOG=` from a
    // template with the value left out gives.
    let filter = match std::env::var(env_names::LOG_VAR) {
        Err(std::env::VarError::NotPresent) => tracing_subscriber::EnvFilter::new(DEFAULT_LOG),
        Ok(v) if v.is_empty() => tracing_subscriber::EnvFilter::new(DEFAULT_LOG),
        Err(e) => {
            eprintln!("kv-reuse-router: `KV_ROUTER_LOG`: {e}");
            return ExitCode::from(2);
        }
        Ok(v) => match tracing_subscriber::EnvFilter::builder().parse(&v) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("kv-reuse-router: `KV_ROUTER_LOG` {v:?} is not a log filter: {e}");
                return ExitCode::from(2);
            }
        },
    };
    // Colour only on a terminal: escape codes in a log file or a journal
    // are noise. `with_ansi` overrides tracing-subscriber's own NO_COLOR
    // check, so it is repeated here.
    let ansi = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
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
    match runtime.block_on(run_until_signal(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv-reuse-router: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// The flag behind a [`kv_router_glue::NatsOptionsError`] field (`nats_options` maps
/// the flags to these fields).
fn nats_option_flag(field: &str) -> &'static str {
    match field {
        "auth" => "--nats-creds",
        "nats_url" => "--nats-url",
        "inbox_prefix" => "--nats-inbox-prefix",
        "tls.root_certificates" => "--nats-tls-ca",
        "tls.client_certificate" => "--nats-tls-cert",
        "tls.client_key" => "--nats-tls-key",
        _ => "--nats-*",
    }
}

/// The NATS options as the connection will use them, checked before
/// connecting: an unreadable or malformed credentials file, an unreadable
/// TLS file and credentials both in `--nats-url` and in the `--nats-user`,
/// `--nats-token` or `--nats-creds` flags are configuration errors (exit 2)
/// naming the flag, not a failed connection (exit 1).
fn checked_nats_options(cli: &Cli) -> Result<NatsOptions, RouterError> {
    let options = nats_options(cli);
    options
        .clone()
        .connect_options(&cli.nats_url)
        .map_err(|e| RouterError::Config {
            flag: nats_option_flag(e.field),
            reason: e.reason,
        })?;
    Ok(options)
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

/// [`run`], stopped cleanly (log line, exit 0) by SIGTERM or SIGINT before
/// it is ready: without this a signal during startup (the NATS connect
/// waits up to 5 s) killed the process with status 143 and no log.
/// Once `run` has its own handlers it drains on the signal itself.
async fn run_until_signal(cli: Cli) -> Result<(), RouterError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(RouterError::Signal)?;
    let mut int = signal(SignalKind::interrupt()).map_err(RouterError::Signal)?;
    // SIGHUP's default action kills the process; a daemon is sent one by
    // habit (a reload, a closed terminal). The settings are read once at
    // start, so it is logged and changes nothing.
    let mut hup = signal(SignalKind::hangup()).map_err(RouterError::Signal)?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            tracing::info!(
                signal = "SIGHUP",
                "ignored: settings are read once at start; restart the router to change them"
            );
        }
    });
    let handled = Arc::new(AtomicBool::new(false));
    let startup_signal = async {
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            if !handled.load(Ordering::SeqCst) {
                return name;
            }
        }
    };
    tokio::select! {
        r = run(cli, handled.clone()) => r,
        name = startup_signal => {
            tracing::info!(signal = name, "stopped during startup");
            Ok(())
        }
    }
}

/// The router: settings, connections, followers, advise server, metrics;
/// sets `handled` once its own signal handlers are installed, then drains
/// on SIGTERM or SIGINT.
async fn run(cli: Cli, handled: Arc<AtomicBool>) -> Result<(), RouterError> {
    let mut loader = SettingsLoader::new();
    if let Some(path) = &cli.settings {
        loader = loader.toml_file(path)?;
    }
    let loaded = loader
        .env(&EnvSnapshot::capture())?
        .reuse_args(&cli.reuse)
        .build()?;
    // One event per setting (key, value, unit and origin as fields), so a
    // log collector keeps each whole; a multi-line message arrived split.
    for (key, value, unit, origin) in loaded.in_force() {
        tracing::info!(key, value = %value, unit, origin = %origin, "setting in force");
    }
    advise_subject::warn_if_shared(&cli.namespace, &cli.advise.advise_subject);
    // Checked against a block size only when the operator gave one; each
    // donor layout's own is checked as it becomes known (RouterInventory).
    let model = match cli.tokens_per_block {
        Some(tpb) => CostModel::new(loaded.settings.clone(), tpb)?,
        None => CostModel::for_announced_layouts(loaded.settings.clone())?,
    };

    let options = checked_nats_options(&cli)?;
    // Bound before any connection, served once the health probe's inputs
    // exist: an address in use or not this host's is a flag error (exit 2)
    // whether or not NATS is reachable, as the other flags' errors.
    let metrics_listener = tokio::net::TcpListener::bind(cli.metrics_addr)
        .await
        .map_err(|source| RouterError::Metrics {
            addr: cli.metrics_addr,
            source,
        })?;
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
    // The vLLM streams before NATS: an endpoint that does not answer exits
    // 1 with nothing done on NATS. It used to be found only after the
    // router had subscribed and applied inventory snapshots, whose log
    // lines buried the one error.
    let vllm = vllm_streams::start(&cli.vllm_events, &index, &service).await?;

    let plane = Arc::new(NatsPlane::connect(&cli.nats_url, options.clone()).await?);
    // The plane's own connection: the directory reads under the router's
    // credentials (a second, anonymous connection is refused by a server
    // that requires them), and a creation the server refuses for want of a
    // permission fails naming it rather than timing out.
    let directory: Arc<dyn DirectoryPlane> = Arc::new(
        NatsDirectory::from_plane(
            &plane,
            &cli.nats_url,
            &cli.directory_bucket,
            Duration::from_millis(cli.directory_ttl_ms),
        )
        .await?,
    );
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
    let mut followers = inventory
        .follow(
            plane.clone() as Arc<dyn EventPlane>,
            directory,
            &cli.namespace,
            Duration::from_millis(cli.announce_period_ms.max(1)),
            stop_following.clone(),
        )
        .await?;
    vllm_streams::supervise(&cli.vllm_events, &vllm, &mut followers);

    let metrics = Arc::new(ReuseMetrics::new());
    let observing = observe::spawn(metrics.clone(), inventory.clone(), stop_following.clone());
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
            subject: cli.advise.advise_subject.clone(),
            metrics: Some(metrics.clone()),
            probe: None,
            busy_poll: std::time::Duration::from_micros(cli.advise_busy_poll_us),
        },
    )
    .await?;
    let draining = Arc::new(AtomicBool::new(false));
    let probe = {
        let (draining, plane, inventory) = (draining.clone(), plane.clone(), inventory.clone());
        let advise = server.client().clone();
        Arc::new(move || {
            if draining.load(Ordering::SeqCst) {
                Health::Unavailable("draining")
            } else if !plane.is_connected()
                || advise.connection_state() != async_nats::connection::State::Connected
            {
                Health::Unavailable("nats disconnected")
            } else if let Some(down) = inventory.follower_down() {
                // The index or donor directory is going stale until the
                // follower's stream is open again.
                Health::Unavailable(down)
            } else {
                Health::Serving
            }
        })
    };
    let http = MetricsServer::serve_with_health(metrics_listener, metrics.clone(), probe).map_err(
        |source| RouterError::Metrics {
            addr: cli.metrics_addr,
            source,
        },
    )?;

    // Handlers before the ready line: a harness may signal right after it.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(RouterError::Signal)?;
    let mut int = signal(SignalKind::interrupt()).map_err(RouterError::Signal)?;
    handled.store(true, Ordering::SeqCst);

    // The journal's record of what this process uses: the stdout ready
    // line says only the metrics address.
    tracing::info!(
        nats_url = ?kv_router_glue::redact_url(&cli.nats_url),
        namespace = %cli.namespace,
        directory_bucket = %cli.directory_bucket,
        metrics_addr = %http.local_addr(),
        subject = %cli.advise.advise_subject,
        vllm_streams = cli.vllm_events.len(),
        "serving"
    );
    let ready = serde_json::json!({
        "event": "ready",
        "metrics_addr": http.local_addr().to_string(),
        "subject": cli.advise.advise_subject,
    });
    {
        let mut out = std::io::stdout().lock();
        // A closed stdout (harness gone) must not stop a serving router.
        let _ = writeln!(out, "{ready}");
        let _ = out.flush();
    }

    let signal_name = stop::until_signal(&mut term, &mut int, &mut followers)
        .await
        .map_err(RouterError::FollowerEnded)?;
    tracing::info!(signal = signal_name, "draining");
    draining.store(true, Ordering::SeqCst);
    // A second signal cuts the drain short (exit 1): with NATS hung the
    // drain waits out its timeouts, and an operator pressing Ctrl-C again
    // expects the process to go (helper-20 finding 15).
    let report = tokio::select! {
        r = server.stop() => r?,
        second = async {
            tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            }
        } => {
            tracing::warn!(signal = second, "second signal: stopping without finishing the drain");
            return Err(RouterError::DrainCut(second));
        }
    };
    if !report.drain_confirmed {
        tracing::warn!("the drain did not reach NATS: requests routed here before the stop may have gone unanswered (their callers time out and recompute)");
    }
    // Requests arriving after this (none reach us once unsubscribed) would
    // be refused as draining.
    service.drain();
    stop_following.cancel();
    drop(followers);
    let _ = observing.await;
    vllm_streams::stop(&cli.vllm_events, vllm).await;
    http.shutdown().await;
    tracing::info!(
        received = report.received,
        decided = report.decided,
        refused = report.refused,
        no_reply = report.no_reply,
        reply_errors = report.reply_errors,
        after_shutdown = report.after_shutdown,
        drain_confirmed = report.drain_confirmed,
        "stopped"
    );
    // The followers' counters as fields of their own line: a log pipeline
    // reads each as a field, where a Debug dump of the struct
    // (`FollowStats { ... }`) was one opaque string (trial h33, nit 8).
    stop::log_follow_stats(&inventory.stats());
    Ok(())
}

/// `name:value` pairs joined by `,` (`none` for no pair), as one field's
/// value: with `=` and spaces (`a=1 b=2`) a logfmt reader took the pairs
/// for more fields of the line (trial h39, 8).
fn field_pairs(pairs: impl IntoIterator<Item = (String, String)>) -> String {
    let joined = pairs
        .into_iter()
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(",");
    if joined.is_empty() {
        "none".into()
    } else {
        joined
    }
}

#[path = "router_bin/vllm_streams.rs"]
mod vllm_streams;

#[path = "router_bin/observe.rs"]
mod observe;
#[path = "router_bin/stop.rs"]
mod stop;

#[path = "router_bin/advise_subject.rs"]
mod advise_subject;
#[path = "router_bin/env_names.rs"]
mod env_names;
#[path = "router_bin/flag_values.rs"]
mod flag_values;
#[path = "router_bin/parse_errors.rs"]
mod parse_errors;
use flag_values::{bucket_name, inbox_prefix, namespace_token, NatsUrlParser};

#[cfg(test)]
#[path = "router_bin/tests.rs"]
mod tests;
