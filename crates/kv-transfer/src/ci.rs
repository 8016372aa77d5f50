//! Whether this run is under CI, where a test whose runtime (NIXL, a GPU,
//! `nats-server`) is missing must fail instead of printing `SKIP`.
//!
//! One definition for every crate's tests and for `xtask`: CI systems set
//! `CI` to `true` (GitHub Actions, GitLab), `1` or `yes` (others, and people
//! reproducing CI by hand); before this module the crates' tests accepted
//! only `true` while `xtask` also accepted `1`, so `CI=1 cargo xtask test`
//! let NIXL and NATS tests skip silently.

/// Variable that marks a CI run.
pub const CI_ENV: &str = "CI";

/// True when `$CI` is `true`, `1` or `yes` (ASCII case-insensitive,
/// surrounding whitespace ignored): a missing test runtime is then a failure.
/// Unset, empty, `0`, `false` or any other value mean "not CI".
pub fn ci_requires() -> bool {
    std::env::var(CI_ENV).is_ok_and(|v| ci_value_requires(&v))
}

/// The parsing behind [`ci_requires`], for one value of `$CI`.
pub fn ci_value_requires(value: &str) -> bool {
    let v = value.trim();
    ["true", "1", "yes"]
        .iter()
        .any(|accepted| v.eq_ignore_ascii_case(accepted))
}

#[cfg(test)]
mod tests {
    use super::ci_value_requires;

    #[test]
    fn ci_values_true_1_yes_in_any_case_require_the_runtime() {
        for v in ["true", "TRUE", "True", "1", "yes", "YES", "Yes", " true\n"] {
            assert!(ci_value_requires(v), "{v:?} must mean CI");
        }
        for v in ["", "0", "false", "no", "off", "truthy", "2", "y"] {
            assert!(!ci_value_requires(v), "{v:?} must not mean CI");
        }
    }
}
