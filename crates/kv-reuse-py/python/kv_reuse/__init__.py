"""Decode-to-prefill KV cache reuse for Python workers and routers.

Roles: :class:`DonorBank` (decode worker: retain, store, events, pins),
:class:`Router` (index + advisor), :class:`RouterClient` (advise over NATS),
:class:`WorkerPublisher` (a worker's registration, KV events and manifest on
NATS for the router service), :class:`DonorDirectory` (manifests by engine id),
:class:`Target` (prefill worker: check a hint against the prompt and fetch). Errors derive from :class:`KvReuseError`.
The compiled module needs neither CUDA nor NIXL to import.
"""

from ._native import (  # noqa: F401
    Advice,
    AdviseRefused,
    BadArgument,
    BankFailed,
    CostTerms,
    CudaUnavailable,
    DescriptorRefused,
    DonorBank,
    DonorDirectory,
    FetchFellBack,
    FetchJob,
    FetchOutcome,
    HintRefused,
    KvReuseError,
    Layout,
    LookupFailed,
    PendingStore,
    PinServer,
    PinServiceFailed,
    PromptMismatch,
    PublishFailed,
    Router,
    RouterClient,
    RouterUnavailable,
    Settings,
    SettingsRefused,
    StreamGate,
    Target,
    WorkerPublisher,
    layer_group_ranges,
    leak_counters,
    reclaim_stale,
    encode_kv_event,
    decode_kv_event,
    sequence_hashes,
)

__all__ = [n for n in dir() if not n.startswith("_")]

# The functions are the compiled module's, so help() and reprs named
# ``kv_reuse._native``; users call them from here. Classes and exceptions are
# declared with this module name in Rust; a pyfunction takes its module from
# the one it is added to, so the functions are renamed here. Pickling a
# function reference looks it up by this name, which exists.
for _f in (layer_group_ranges, leak_counters, reclaim_stale, encode_kv_event, decode_kv_event, sequence_hashes):
    _f.__module__ = __name__
del _f
