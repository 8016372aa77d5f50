//! cuda (in progress).
