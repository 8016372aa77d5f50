//! kv-router-glue (in progress).
