//! bench (in progress).
