//! kv-transfer (in progress).
