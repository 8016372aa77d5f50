//! oracle (in progress).
