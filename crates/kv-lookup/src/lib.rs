//! kv-lookup (in progress).
