//! The operator table of `docs/settings.md`, generated from the registry.

use super::{ENV_PREFIX, REMOVED_SETTINGS, SETTINGS};

/// The operator table of every setting (Markdown), generated from [`SETTINGS`].
/// `docs/settings.md` is this text; a test keeps them equal.
pub fn settings_markdown() -> String {
    let mut out = String::from(
        "# Reuse settings\n\n\
         <!-- Generated from kv_router_glue::SETTINGS by `settings_markdown()`; \
         the test `docs_match_registry` fails when this file is stale. -->\n\n\
         Precedence: defaults < TOML file < environment (`KV_REUSE_<KEY>`, captured once at start) \
         < CLI flags (`--key value`, `--key=value`, a bare `--key` for true; exact keys, dashes or \
         underscores, never prefixes). Unknown, removed and out-of-range keys are refused with the key named, and the file or environment variable they came from. \
         Everything is off by default.\n\n\
         | key | env | unit | default | range | meaning |\n\
         | --- | --- | --- | --- | --- | --- |\n",
    );
    for s in SETTINGS {
        out.push_str(&format!(
            "| `{}` | `{}{}` | {} | `{}` | {} | {} |\n",
            s.key,
            ENV_PREFIX,
            s.key.to_ascii_uppercase(),
            s.unit,
            s.default,
            s.kind.range_text(),
            s.doc
        ));
    }
    out.push_str(
        "\n## Removed keys (refused with this explanation)\n\n| key | why |\n| --- | --- |\n",
    );
    for (k, why) in REMOVED_SETTINGS {
        out.push_str(&format!("| `{k}` | {why} |\n"));
    }
    out
}
