//! kv-testkit (in progress).
