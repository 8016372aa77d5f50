use std::collections::BTreeSet;

use proptest::prelude::*;

use crate::*;

/// A value different from the default for every setting, in range.
fn non_default(spec: &SettingSpec) -> SettingValue {
    match (spec.kind, spec.default) {
        (SettingKind::Bool, SettingValue::Bool(b)) => SettingValue::Bool(!b),
        (SettingKind::U32 { min, .. }, SettingValue::U32(d)) => {
            SettingValue::U32(if d == min { min + 1 } else { min })
        }
        (SettingKind::F64 { min, .. }, SettingValue::F64(d)) => {
            SettingValue::F64(if d == min { min + 1.5 } else { min + 0.25 })
        }
        other => panic!("kind and default disagree for {}: {other:?}", spec.key),
    }
}

fn toml_literal(v: SettingValue) -> String {
    match v {
        SettingValue::F64(x) => format!("{x:?}"),
        other => other.to_string(),
    }
}

/// Both switches on, so that the cross-field rule never hides what a test checks.
fn with_switches(extra: &[(&str, String)]) -> Vec<String> {
    let mut args = vec![
        "--enable-decode-to-prefill-reuse=true".to_string(),
        "--enable-decode-to-prefill-gpu-reuse=true".to_string(),
    ];
    for (k, v) in extra {
        args.push(format!("--{k}={v}"));
    }
    args
}

#[test]
fn registry_lists_exactly_the_struct_fields() {
    let json: serde_json::Value =
        serde_json::from_str(&ReuseSettings::default().to_json().unwrap()).unwrap();
    let fields: BTreeSet<String> = json.as_object().unwrap().keys().cloned().collect();
    let registered: BTreeSet<String> = SETTINGS.iter().map(|s| s.key.to_string()).collect();
    assert_eq!(
        fields, registered,
        "a ReuseSettings field is missing from SETTINGS (or the reverse)"
    );
    assert_eq!(registered.len(), 8);
}

#[test]
fn every_setting_is_known_to_every_loader_and_the_round_trip() {
    for spec in SETTINGS {
        let v = non_default(spec);
        // CLI, both spellings.
        let mut args = vec!["--enable-decode-to-prefill-reuse".to_string()];
        args.push(format!("--{}", spec.key.replace('_', "-")));
        args.push(v.to_string());
        let s = SettingsLoader::new()
            .args(&args)
            .unwrap()
            .settings_unchecked();
        assert_eq!((spec.get)(&s), v, "cli --key value: {}", spec.key);
        let s = SettingsLoader::new()
            .args([format!("--{}={v}", spec.key)])
            .unwrap()
            .settings_unchecked();
        assert_eq!((spec.get)(&s), v, "cli --key=value: {}", spec.key);
        // Environment.
        let env = EnvSnapshot::from_pairs([(
            format!("{ENV_PREFIX}{}", spec.key.to_ascii_uppercase()),
            v.to_string(),
        )]);
        let s = SettingsLoader::new()
            .env(&env)
            .unwrap()
            .settings_unchecked();
        assert_eq!((spec.get)(&s), v, "env: {}", spec.key);
        // TOML.
        let text = format!("{} = {}", spec.key, toml_literal(v));
        let s = SettingsLoader::new()
            .toml_str(&text, "t.toml")
            .unwrap()
            .settings_unchecked();
        assert_eq!((spec.get)(&s), v, "toml: {}", spec.key);
        // JSON round trip of a full valid configuration with this value.
        let mut full = ReuseSettings {
            enable_decode_to_prefill_reuse: true,
            enable_decode_to_prefill_gpu_reuse: true,
            ..ReuseSettings::default()
        };
        (spec.set)(&mut full, v);
        if spec.key == "enable_decode_to_prefill_reuse" {
            full.enable_decode_to_prefill_gpu_reuse = false;
        }
        let back = ReuseSettings::from_json(&full.to_json().unwrap()).unwrap();
        assert_eq!(back, full, "json: {}", spec.key);
        // Docs.
        let docs = settings_markdown();
        assert!(
            docs.contains(&format!("| `{}` |", spec.key)),
            "docs: {}",
            spec.key
        );
    }
}

#[test]
fn docs_match_registry() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/settings.md");
    let want = settings_markdown();
    if std::env::var_os("KV_UPDATE_DOCS").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let got = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        got, want,
        "docs/settings.md is stale: rerun with KV_UPDATE_DOCS=1"
    );
}

#[test]
fn defaults_are_off_and_valid() {
    let s = ReuseSettings::default();
    s.validate().unwrap();
    assert!(!s.enable_decode_to_prefill_reuse && !s.enable_decode_to_prefill_gpu_reuse);
    assert_eq!(s.minimum_transfer_prefix_blocks, 4);
    assert_eq!(s.transfer_source_prefill_token_us, 30.0);
    let model = CostModel::new(s, 16).unwrap();
    let d = model.admit(
        "r",
        CostInputs {
            reused_tokens: 100_000,
            transfer_blocks: 6_250,
            path: TransferPath::Host,
            lookup_us: 0.0,
        },
    );
    assert_eq!(d.verdict, Verdict::Refuse(RefuseReason::ReuseDisabled));
}

#[test]
fn cli_forms_exact_keys_and_errors() {
    let s = SettingsLoader::new()
        .args([
            "--enable_decode_to_prefill_reuse",
            "--minimum-transfer-prefix-blocks",
            "12",
            "--transfer-source-lookup-budget-ms=0.5",
            "--transfer-source-prefill-token-us",
            "41.5",
            "--transfer-source-prefill-token-us=42.5", // a later flag wins
        ])
        .unwrap()
        .build()
        .unwrap()
        .settings;
    assert!(s.enable_decode_to_prefill_reuse);
    assert_eq!(s.minimum_transfer_prefix_blocks, 12);
    assert_eq!(s.transfer_source_lookup_budget_ms, 0.5);
    assert_eq!(s.transfer_source_prefill_token_us, 42.5);

    // A bare boolean followed by an explicit literal takes the literal.
    let s = SettingsLoader::new()
        .args(["--enable-decode-to-prefill-reuse", "false"])
        .unwrap()
        .build()
        .unwrap()
        .settings;
    assert!(!s.enable_decode_to_prefill_reuse);

    // Prefixes are never expanded, unique or not: one rule for every parser.
    for prefix in [
        "--minimum-transfer=12",
        "--transfer-source=3",
        "--enable-decode-to-prefill",
    ] {
        let e = SettingsLoader::new().args([prefix]).unwrap_err();
        let name = prefix[2..].split('=').next().unwrap();
        assert_eq!(
            e,
            SettingsError::UnknownKey {
                key: name.to_string(),
                origin: "cli".into()
            },
            "{prefix}"
        );
    }
    let e = SettingsLoader::new()
        .args(["--no-such-setting=1"])
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown setting `no-such-setting` (from cli)"
    );
    let e = SettingsLoader::new()
        .args(["--decode-to-prefill-reuse-mode=eager"])
        .unwrap_err();
    assert!(
        matches!(&e, SettingsError::Removed { key, .. } if key == "decode_to_prefill_reuse_mode"),
        "{e}"
    );
    let e = SettingsLoader::new()
        .args(["--minimum-transfer-prefix-blocks"])
        .unwrap_err();
    assert_eq!(
        e,
        SettingsError::MissingValue {
            key: "minimum_transfer_prefix_blocks"
        }
    );
    let e = SettingsLoader::new().args(["12"]).unwrap_err();
    assert!(matches!(e, SettingsError::UnexpectedArgument { .. }));
    let e = SettingsLoader::new()
        .args(["--minimum-transfer-prefix-blocks=0"])
        .unwrap_err();
    assert!(
        matches!(
            e,
            SettingsError::OutOfRange {
                key: "minimum_transfer_prefix_blocks",
                ..
            }
        ),
        "{e}"
    );
    let e = SettingsLoader::new()
        .args(["--transfer-source-prefill-token-us=NaN"])
        .unwrap_err();
    assert!(
        matches!(
            e,
            SettingsError::OutOfRange {
                key: "transfer_source_prefill_token_us",
                ..
            }
        ),
        "{e}"
    );
    let e = SettingsLoader::new()
        .args(["--enable-decode-to-prefill-reuse=maybe"])
        .unwrap_err();
    assert!(
        matches!(
            e,
            SettingsError::InvalidValue {
                key: "enable_decode_to_prefill_reuse",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn env_errors_name_the_variable_or_key() {
    let e = SettingsLoader::new()
        .env(&EnvSnapshot::from_pairs([("KV_REUSE_MINIMUM_BLOCKS", "3")]))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown setting `minimum_blocks` (from KV_REUSE_MINIMUM_BLOCKS)"
    );
    let e = SettingsLoader::new()
        .env(&EnvSnapshot::from_pairs([(
            "KV_REUSE_TRANSFER_SOURCE_LOOKUP_BUDGET_MS",
            "5000",
        )]))
        .unwrap_err();
    assert!(
        matches!(
            e,
            SettingsError::OutOfRange {
                key: "transfer_source_lookup_budget_ms",
                ..
            }
        ),
        "{e}"
    );
    let e = SettingsLoader::new()
        .env(&EnvSnapshot::from_pairs([(
            "KV_REUSE_TRANSFER_SOURCE_FORCE",
            "1",
        )]))
        .unwrap_err();
    assert!(matches!(e, SettingsError::Removed { .. }), "{e}");
    // Other prefixes are not ours and are ignored by the snapshot.
    assert_eq!(
        EnvSnapshot::from_pairs([("PATH", "/bin")]),
        EnvSnapshot::default()
    );
}

#[test]
fn captured_snapshot_wins_over_later_environment_changes() {
    // The only test that touches the process environment.
    let var = "KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS";
    std::env::set_var(var, "11");
    let snap = EnvSnapshot::capture();
    std::env::set_var(var, "99");
    let s = SettingsLoader::new().env(&snap).unwrap().build().unwrap();
    std::env::remove_var(var);
    assert_eq!(s.settings.minimum_transfer_prefix_blocks, 11);
    assert_eq!(
        s.origins[var
            .trim_start_matches(ENV_PREFIX)
            .to_ascii_lowercase()
            .as_str()],
        SettingOrigin::Env(var.into())
    );
}

#[test]
fn toml_file_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reuse.toml");
    std::fs::write(
        &path,
        "enable_decode_to_prefill_reuse = true\nminimum_estimated_ttft_saving_ms = 5\ntransfer_source_estimated_block_us = 120.5\n",
    )
    .unwrap();
    let s = SettingsLoader::new()
        .toml_file(&path)
        .unwrap()
        .build()
        .unwrap();
    assert!(s.settings.enable_decode_to_prefill_reuse);
    assert_eq!(s.settings.minimum_estimated_ttft_saving_ms, 5.0);
    assert_eq!(s.settings.transfer_source_estimated_block_us, 120.5);
    assert_eq!(
        s.origins["minimum_estimated_ttft_saving_ms"],
        SettingOrigin::File(path.display().to_string())
    );

    let e = SettingsLoader::new()
        .toml_str("[reuse]\nx = 1", "a.toml")
        .unwrap_err();
    assert!(
        matches!(&e, SettingsError::UnknownKey { key, origin } if key == "reuse" && origin == "a.toml"),
        "{e}"
    );
    // A file's boolean is TOML's own: the message does not offer the text
    // spellings only flags and environment variables take.
    let e = SettingsLoader::new()
        .toml_str("enable_decode_to_prefill_reuse = \"yes\"", "a.toml")
        .unwrap_err();
    // Named with its file (trial h33, nit 5), as an unknown key is.
    assert!(e.to_string().ends_with("(from a.toml)"), "{e}");
    match e.root() {
        SettingsError::InvalidValue {
            key: "enable_decode_to_prefill_reuse",
            value,
            expected,
        } => {
            assert_eq!(value, "\"yes\"");
            assert!(expected.starts_with("true or false, unquoted"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    let e = SettingsLoader::new()
        .toml_str("minimum_transfer_prefix_blocks = 2.5", "a.toml")
        .unwrap_err();
    assert!(
        matches!(
            e.root(),
            SettingsError::InvalidValue {
                key: "minimum_transfer_prefix_blocks",
                ..
            }
        ),
        "{e}"
    );
    let e = SettingsLoader::new()
        .toml_str("minimum_transfer_prefix_blocks = -1", "a.toml")
        .unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.starts_with("`minimum_transfer_prefix_blocks` = -1 is out of range")
            && shown.ends_with("(from a.toml)"),
        "{shown}"
    );
    assert!(
        matches!(
            e.root(),
            SettingsError::OutOfRange {
                key: "minimum_transfer_prefix_blocks",
                ..
            }
        ),
        "{e}"
    );
    let e = SettingsLoader::new()
        .toml_str("transfer_source_cpu_estimated_block_us = 3.0", "a.toml")
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("renamed to transfer_source_estimated_block_us"),
        "{e}"
    );
    let e = SettingsLoader::new()
        .toml_str("= nope", "a.toml")
        .unwrap_err();
    assert!(matches!(e, SettingsError::Toml { .. }), "{e}");
    // Where: line and column (1-based), as an editor shows them.
    let e = SettingsLoader::new()
        .toml_str("minimum_transfer_prefix_blocks = 4\nbad key\n", "b.toml")
        .unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.starts_with("invalid TOML in b.toml: line 2, column "),
        "{shown}"
    );
    let e = SettingsLoader::new()
        .toml_file(dir.path().join("missing.toml"))
        .unwrap_err();
    assert!(matches!(e, SettingsError::Io { .. }), "{e}");
}

#[test]
fn layers_apply_in_precedence_order() {
    let loaded = SettingsLoader::new()
        .toml_str(
            "minimum_transfer_prefix_blocks = 6\ntransfer_source_prefill_token_us = 50",
            "f.toml",
        )
        .unwrap()
        .env(&EnvSnapshot::from_pairs([
            ("KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS", "7"),
            ("KV_REUSE_TRANSFER_SOURCE_LOOKUP_BUDGET_MS", "3"),
        ]))
        .unwrap()
        .args(["--minimum-transfer-prefix-blocks=9"])
        .unwrap()
        .build()
        .unwrap();
    let s = &loaded.settings;
    assert_eq!(s.minimum_transfer_prefix_blocks, 9);
    assert_eq!(s.transfer_source_prefill_token_us, 50.0);
    assert_eq!(s.transfer_source_lookup_budget_ms, 3.0);
    assert_eq!(
        loaded.origins["minimum_transfer_prefix_blocks"],
        SettingOrigin::Cli("--minimum-transfer-prefix-blocks=9".into())
    );
    assert_eq!(
        loaded.origins["transfer_source_prefill_token_us"],
        SettingOrigin::File("f.toml".into())
    );
    assert_eq!(
        loaded.origins["enable_decode_to_prefill_reuse"],
        SettingOrigin::Default
    );
    let text = loaded.describe();
    assert!(text.contains("minimum_transfer_prefix_blocks"), "{text}");
    assert_eq!(text.lines().count(), 8);
}

#[test]
fn gpu_switch_needs_master_switch() {
    let e = SettingsLoader::new()
        .args(["--enable-decode-to-prefill-gpu-reuse"])
        .unwrap()
        .build()
        .unwrap_err();
    assert!(
        matches!(
            e,
            SettingsError::Inconsistent {
                key: "enable_decode_to_prefill_gpu_reuse",
                ..
            }
        ),
        "{e}"
    );
    let ok = SettingsLoader::new()
        .args(with_switches(&[]))
        .unwrap()
        .build()
        .unwrap();
    assert!(ok.settings.enable_decode_to_prefill_gpu_reuse);
}

#[test]
fn json_rejects_unknown_removed_and_out_of_range() {
    let e = ReuseSettings::from_json(r#"{"bogus": 1}"#).unwrap_err();
    assert!(
        matches!(&e, SettingsError::UnknownKey { key, .. } if key == "bogus"),
        "{e}"
    );
    let e = ReuseSettings::from_json(r#"{"decode_to_prefill_reuse_mode": "eager"}"#).unwrap_err();
    assert!(matches!(e, SettingsError::Removed { .. }), "{e}");
    let e = ReuseSettings::from_json(r#"{"transfer_source_gpu_estimated_block_us": -1.0}"#)
        .unwrap_err();
    assert!(
        matches!(
            e,
            SettingsError::OutOfRange {
                key: "transfer_source_gpu_estimated_block_us",
                ..
            }
        ),
        "{e}"
    );
    let e =
        ReuseSettings::from_json(r#"{"minimum_transfer_prefix_blocks": 5000000000}"#).unwrap_err();
    assert!(
        matches!(
            e,
            SettingsError::OutOfRange {
                key: "minimum_transfer_prefix_blocks",
                ..
            }
        ),
        "{e}"
    );
    let e = ReuseSettings::from_json("[1]").unwrap_err();
    assert!(matches!(e, SettingsError::Json { .. }), "{e}");
}

fn arb_settings() -> impl Strategy<Value = ReuseSettings> {
    (
        any::<bool>(),
        any::<bool>(),
        0.0..60_000.0f64,
        1u32..=(1 << 20),
        0.001..1e6f64,
        0.001..1e6f64,
        0.01..1000.0f64,
        0.001..1e5f64,
    )
        .prop_map(|(a, g, ms, b, hb, gb, l, p)| ReuseSettings {
            enable_decode_to_prefill_reuse: a,
            enable_decode_to_prefill_gpu_reuse: a && g,
            minimum_estimated_ttft_saving_ms: ms,
            minimum_transfer_prefix_blocks: b,
            transfer_source_estimated_block_us: hb,
            transfer_source_gpu_estimated_block_us: gb,
            transfer_source_lookup_budget_ms: l,
            transfer_source_prefill_token_us: p,
        })
}

proptest! {
    #[test]
    fn json_and_cli_round_trips_preserve_every_valid_configuration(s in arb_settings()) {
        prop_assert_eq!(ReuseSettings::from_json(&s.to_json().unwrap()).unwrap(), s.clone());
        let args: Vec<String> = s.entries().iter().map(|(k, v)| format!("--{k}={v}")).collect();
        let back = SettingsLoader::new().args(&args).unwrap().build().unwrap().settings;
        prop_assert_eq!(back, s);
    }
}

/// A host flattens [`ReuseArgs`] into its own clap parser: its flags,
/// positionals and a host flag that is a prefix of a setting key stay the
/// host's; the settings flags reach the loader with their origins.
#[test]
fn a_host_parser_flattens_reuse_args_and_keeps_its_own_flags() {
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Host {
        #[arg(long)]
        port: u16,
        /// A host flag that is a prefix of two setting keys.
        #[arg(long)]
        enable: bool,
        model: String,
        #[command(flatten)]
        reuse: ReuseArgs,
    }

    let host = Host::try_parse_from([
        "serve",
        "--port=8000",
        "--enable",
        "--enable_decode_to_prefill_reuse=true",
        "--transfer-source-lookup-budget-ms",
        "2.5",
        "model.gguf",
        "--enable-decode-to-prefill-gpu-reuse",
    ])
    .unwrap();
    assert_eq!(
        (host.port, host.enable, host.model.as_str()),
        (8000, true, "model.gguf")
    );
    let loaded = SettingsLoader::new()
        .reuse_args(&host.reuse)
        .build()
        .unwrap();
    let s = &loaded.settings;
    assert!(s.enable_decode_to_prefill_reuse && s.enable_decode_to_prefill_gpu_reuse);
    assert_eq!(s.transfer_source_lookup_budget_ms, 2.5);
    assert_eq!(
        loaded.origins["transfer_source_lookup_budget_ms"],
        SettingOrigin::Cli("--transfer-source-lookup-budget-ms".into())
    );
    assert_eq!(
        loaded.origins["minimum_transfer_prefix_blocks"],
        SettingOrigin::Default
    );

    // Refusals keep the key and the reason, through the host's parser too.
    let e = Host::try_parse_from([
        "serve",
        "--port=1",
        "m",
        "--minimum-transfer-prefix-blocks=0",
    ])
    .unwrap_err();
    let ours = std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<SettingsError>())
        .cloned();
    assert!(
        matches!(
            ours,
            Some(SettingsError::OutOfRange {
                key: "minimum_transfer_prefix_blocks",
                ..
            })
        ),
        "{e}"
    );
    let e = Host::try_parse_from([
        "serve",
        "--port=1",
        "m",
        "--decode-to-prefill-reuse-mode=on",
    ])
    .unwrap_err();
    assert!(e.to_string().contains("reuse modes were removed"), "{e}");

    // Every setting is in the host's --help under its own heading, with its env variable.
    let help = <Host as clap::CommandFactory>::command()
        .render_long_help()
        .to_string();
    assert!(help.contains("Decode-to-prefill KV reuse"), "{help}");
    for spec in SETTINGS {
        let flag = format!("--{}", spec.key.replace('_', "-"));
        let env = format!("{ENV_PREFIX}{}", spec.key.to_ascii_uppercase());
        assert!(
            help.contains(&flag) && help.contains(&env),
            "{flag} / {env} missing:\n{help}"
        );
    }
    assert!(
        !help.contains("decode-to-prefill-reuse-mode"),
        "removed keys stay hidden"
    );
}
