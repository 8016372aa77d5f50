//! nixl (in progress).
