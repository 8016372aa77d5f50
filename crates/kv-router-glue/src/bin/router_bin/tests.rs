//! The binary's flag parsing and configuration checks (no NATS needed);
//! the process itself is tested in `tests/router_binary/` (`main.rs`).

use super::*;

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("kv-reuse-router").chain(args.iter().copied()))
}

/// A `KV_ROUTER_NATS_*` variable set in the test's environment (it
/// would change clap's defaults, so the NATS flag tests skip).
fn nats_env_set() -> Option<&'static str> {
    [
        "KV_ROUTER_NATS_USER",
        "KV_ROUTER_NATS_PASSWORD",
        "KV_ROUTER_NATS_TOKEN",
        "KV_ROUTER_NATS_INBOX_PREFIX",
    ]
    .into_iter()
    .find(|v| std::env::var_os(v).is_some())
}

#[test]
fn nats_flags_pick_the_auth_and_tls() {
    // Only these tests' own flags: a KV_ROUTER_NATS_* variable in the
    // test's environment would change clap's defaults.
    if let Some(v) = nats_env_set() {
        eprintln!("SKIP nats flag test: {v} is set in this environment");
        return;
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
    let o =
        nats_options(&parse(&["--nats-tls-cert", "/c.pem", "--nats-tls-key", "/k.pem"]).unwrap());
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
fn out_of_range_or_malformed_values_are_refused_naming_the_flag() {
    // (flag, refused values, accepted values: the bounds themselves).
    let cases: &[(&str, &[&str], &[&str])] = &[
        ("--max-probes", &["0", "-1"], &["1", "4294967295"]),
        ("--missed-periods", &["0", "1001", "-1"], &["1", "1000"]),
        (
            "--announce-period-ms",
            &["0", "9", "60001", "-1"],
            &["10", "60000"],
        ),
        (
            "--directory-ttl-ms",
            &["0", "99", "86400001", "-1"],
            &["100", "86400000"],
        ),
        ("--decision-log", &["0", "1000001", "-1"], &["1", "1000000"]),
        (
            "--advise-busy-poll-us",
            &["1000001", "99999999999", "-1"],
            &["0", "1000000"],
        ),
        ("--tokens-per-block", &["0", "-1"], &["1", "4294967295"]),
        (
            "--namespace",
            &["a.b", "", "a*", "a>", "a b"],
            &["default", "prod-1_x"],
        ),
        (
            "--directory-bucket",
            &["bad bucket.name", "", "kv.donors", "kv*"],
            &["kv_donors", "KV-2"],
        ),
        // These exited 1 as an unreachable server ("cannot connect to
        // NATS at not a url"), not 2 naming the flag; a list is checked
        // server by server.
        (
            "--nats-url",
            &[
                "not a url",
                "http://127.0.0.1:4222",
                "",
                "nats://",
                "nats://127.0.0.1:1,,nats://127.0.0.1:2",
                "nats://127.0.0.1:1,http://127.0.0.1:2",
            ],
            &[
                "nats://127.0.0.1:4222",
                "127.0.0.1:4222",
                "tls://n1:4222",
                "nats://127.0.0.1:1,nats://127.0.0.1:2",
                "nats://n1:4222, nats://n2:4222",
            ],
        ),
    ];
    // `--flag -1` (separate word) used to be read as an unknown flag `-1`
    // ("unexpected argument '-1' found"), naming no flag: negative numbers
    // are values (`allow_negative_numbers`), refused by the flag's range.
    // A refused URL is shown with its password replaced.
    let e = parse(&["--nats-url", "http://router:s3cr3t@127.0.0.1:4222"]).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{e}");
    let text = e.to_string();
    assert!(!text.contains("s3cr3t"), "{text}");
    assert!(
        text.contains("'http://router:***@127.0.0.1:4222'"),
        "{text}"
    );
    assert!(text.contains("--nats-url"), "{text}");
    for (flag, refused, accepted) in cases {
        for v in *refused {
            let e = parse(&[flag, v]).expect_err(&format!("{flag} {v:?} must be refused"));
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{e}");
            // Exit status 2, like every flag error.
            assert_eq!(e.exit_code(), 2);
            assert!(e.to_string().contains(flag), "{flag} {v:?}: {e}");
        }
        for v in *accepted {
            parse(&[flag, v]).unwrap_or_else(|e| panic!("{flag} {v:?}: {e}"));
        }
    }
}

/// Every `--flag` the operator docs name in backticks is a flag of
/// this binary or of the other tools listed here: docs/security.md
/// called the bucket flag `--bucket` (it is `--directory-bucket`).
#[test]
fn flags_named_in_the_operator_docs_exist() {
    use clap::CommandFactory;
    // Flags of other programs the same pages quote, and `--nats-*`
    // family prefixes written with a trailing dash.
    const OTHER_TOOLS: &[&str] = &[
        "--tlsverify",        // nats-server
        "--kv-events-config", // vllm serve
        "--time",             // unshare
        "--prefix",           // kv-bank-reclaim
        "--every",            // kv-bank-reclaim
        "--quick",            // kvq bench advise
        "--json",             // cargo xtask bench advise
        "--busy-poll-us",     // kvq bench advise
        "--bin",              // cargo build
        "--features",         // cargo build
        "--no-default-features",
        "--key", // "--key=value", the generic form of a setting flag
    ];
    let mut cmd = Cli::command();
    // Adds the generated `--help` and `--version`.
    cmd.build();
    let ours: Vec<String> = cmd
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    let docs = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/");
    let mut unknown = Vec::new();
    for page in ["router-service.md", "security.md", "operator-guide.md"] {
        let text = std::fs::read_to_string(format!("{docs}{page}")).unwrap();
        // Inline code spans: every odd piece between backticks.
        for code in text.split('`').skip(1).step_by(2) {
            for (i, _) in code.match_indices("--") {
                let flag: String = code[i..]
                    .chars()
                    .take_while(|c| *c == '-' || c.is_ascii_alphanumeric())
                    .collect();
                let family = flag.ends_with('-');
                if flag.len() > 2
                    && !family
                    && !ours.contains(&flag)
                    && !OTHER_TOOLS.contains(&flag.as_str())
                {
                    unknown.push(format!("{page}: {flag}"));
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "flags in the docs that kv-reuse-router lacks: {unknown:?}"
    );
}

#[test]
fn unreadable_nats_files_are_configuration_errors_naming_the_flag() {
    if let Some(v) = nats_env_set() {
        eprintln!("SKIP nats file test: {v} is set in this environment");
        return;
    }
    let garbage = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(garbage.path(), "not a creds file").unwrap();
    let garbage = garbage.path().to_str().unwrap();
    for (args, flag) in [
        (
            &["--nats-tls-ca", "/nonexistent/ca.pem"][..],
            "--nats-tls-ca",
        ),
        (&["--nats-tls-ca", "/"][..], "--nats-tls-ca"),
        (
            &[
                "--nats-tls-cert",
                "/nonexistent/c.pem",
                "--nats-tls-key",
                "/nonexistent/k.pem",
            ][..],
            "--nats-tls-cert",
        ),
        (
            &[
                "--nats-tls-cert",
                garbage,
                "--nats-tls-key",
                "/nonexistent/k.pem",
            ][..],
            "--nats-tls-key",
        ),
        (
            &["--nats-creds", "/nonexistent/r.creds"][..],
            "--nats-creds",
        ),
        (&["--nats-creds", garbage][..], "--nats-creds"),
    ] {
        match checked_nats_options(&parse(args).unwrap()) {
            Err(e @ RouterError::Config { flag: f, .. }) => {
                assert_eq!(f, flag, "{args:?}: {e}");
                assert_eq!(e.exit_code(), 2);
                assert!(e.to_string().contains(flag), "{e}");
            }
            other => panic!("{args:?}: expected a config error, got {other:?}"),
        }
    }
    // Readable files pass (their content is the TLS handshake's business).
    checked_nats_options(&parse(&["--nats-tls-ca", garbage]).unwrap()).unwrap();
    checked_nats_options(&parse(&[]).unwrap()).unwrap();
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

/// Trial h42, 4: two `--vllm-events` of one endpoint or one worker name
/// exit 2 naming both occurrences; distinct ones pass.
#[tokio::test]
async fn vllm_streams_of_one_endpoint_or_one_worker_name_are_refused() {
    let spec = |s: &str| s.parse::<VllmEndpointSpec>().unwrap();
    let a = spec("tcp://127.0.0.1:15684,fingerprint=1,worker=decode-0");
    let b = spec("tcp://127.0.0.1:15694,fingerprint=1,worker=decode-0");
    let c = spec("tcp://127.0.0.1:15704,fingerprint=1,worker=decode-1");
    let d = spec("tcp://127.0.0.1:15704,fingerprint=1,worker=decode-2");
    assert!(vllm_streams::check_distinct(&[a.clone(), c.clone()])
        .await
        .is_ok());
    let e = vllm_streams::check_distinct(&[a, c.clone(), b])
        .await
        .unwrap_err();
    assert_eq!(e.exit_code(), 2);
    let text = e.to_string();
    assert!(
        text.contains("occurrences 1 and 3") && text.contains("worker `decode-0`"),
        "{text}"
    );
    // One replay endpoint behind two PUB endpoints (trial h44, 1).
    let r1 = spec("tcp://127.0.0.1:15784,replay=tcp://127.0.0.1:15785,fingerprint=1,worker=a");
    let r2 = spec("tcp://127.0.0.1:15794,replay=tcp://127.0.0.1:15785,fingerprint=1,worker=b");
    let e = vllm_streams::check_distinct(&[r1, r2]).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("the same replay endpoint tcp://127.0.0.1:15785"),
        "{e}"
    );
    let e = vllm_streams::check_distinct(&[c, d]).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("occurrences 1 and 2 subscribe to the same endpoint tcp://127.0.0.1:15704"),
        "{e}"
    );
}

/// Trial h44, 1: endpoints were compared as text, so one engine written
/// two ways (`localhost`, a leading zero in the port, an upper-case name,
/// an IPv4-mapped IPv6 address) passed as two, every block indexed twice.
/// They are compared by the addresses they connect to; a `replay=` naming
/// a PUB endpoint is refused too.
#[tokio::test]
async fn vllm_endpoints_are_compared_by_address_not_as_written() {
    let spec = |s: &str| s.parse::<VllmEndpointSpec>().unwrap();
    let base = "tcp://127.0.0.1:15884,fingerprint=1,worker=a";
    for other in [
        "tcp://localhost:15884",
        "tcp://LOCALHOST:15884",
        "tcp://127.0.0.1:015884",
        "tcp://[::ffff:127.0.0.1]:15884",
        // The unspecified address: a connect reaches loopback (trial h47, 6).
        "tcp://0.0.0.0:15884",
    ] {
        let specs = [spec(base), spec(&format!("{other},fingerprint=1,worker=b"))];
        let e = vllm_streams::check_distinct(&specs).await.unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            e.to_string(),
            format!(
                "`--vllm-events` occurrences 1 and 2 subscribe to the same endpoint {other} \
                 (the same address as tcp://127.0.0.1:15884)"
            )
        );
    }
    // Another port, another loopback address, a name that never resolves
    // (`.invalid`, RFC 6761) next to another: distinct.
    for (x, y) in [
        ("tcp://localhost:15884", "tcp://localhost:15885"),
        ("tcp://127.0.0.1:15884", "tcp://127.0.0.2:15884"),
        ("tcp://a.invalid:15884", "tcp://b.invalid:15884"),
    ] {
        let specs = [
            spec(&format!("{x},fingerprint=1,worker=a")),
            spec(&format!("{y},fingerprint=1,worker=b")),
        ];
        assert!(
            vllm_streams::check_distinct(&specs).await.is_ok(),
            "{x} {y}"
        );
    }
    // Unresolved names are compared lowercased, without a trailing dot.
    let specs = [
        spec("tcp://a.invalid:15884,fingerprint=1,worker=a"),
        spec("tcp://A.Invalid.:15884,fingerprint=1,worker=b"),
    ];
    let e = vllm_streams::check_distinct(&specs).await.unwrap_err();
    assert!(
        e.to_string().contains("subscribe to the same endpoint"),
        "{e}"
    );
    // Replay endpoints the same way.
    let specs = [
        spec("tcp://127.0.0.1:15884,replay=tcp://localhost:15885,fingerprint=1,worker=a"),
        spec("tcp://127.0.0.1:15894,replay=tcp://127.0.0.1:015885,fingerprint=1,worker=b"),
    ];
    let e = vllm_streams::check_distinct(&specs).await.unwrap_err();
    assert!(
        e.to_string().contains(
            "name the same replay endpoint tcp://127.0.0.1:015885 (the same address as tcp://localhost:15885)"
        ),
        "{e}"
    );
    // A replay endpoint that is a PUB endpoint, its own or another's.
    for (specs, whose, text) in [
        (
            vec![spec(
                "tcp://127.0.0.1:15884,replay=tcp://localhost:15884,fingerprint=1",
            )],
            "occurrence 1",
            "tcp://localhost:15884 (the same address as tcp://127.0.0.1:15884)",
        ),
        (
            vec![
                spec("tcp://127.0.0.1:15884,fingerprint=1,worker=a"),
                spec("tcp://127.0.0.1:15894,replay=tcp://127.0.0.1:15884,fingerprint=1,worker=b"),
            ],
            "occurrences 1 and 2",
            "tcp://127.0.0.1:15884",
        ),
    ] {
        let e = vllm_streams::check_distinct(&specs).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "`--vllm-events` {whose}: `replay={text}` is a PUB endpoint (`tcp://...` before \
                 the first comma), not the engine's ROUTER replay endpoint"
            )
        );
    }
}
