"""Type stubs of the compiled kv_reuse module (crates/kv-reuse-py/src)."""

from types import TracebackType
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, Type

class KvReuseError(Exception):
    """Base of every kv_reuse error."""

class SettingsRefused(KvReuseError):
    """A setting was refused; the message names the key."""

class BadArgument(KvReuseError):
    """An argument was refused; the message starts with the argument's name (``rank``,
    ``kv_caches[1]``, ``values["key"]``). Every int argument is refused so when it is
    negative or past its width (u32 or u64), an element of a sequence as ``name[i]``
    (``prompt_hashes[3]: -1 is not in 0..=18446744073709551615``), and a count with a
    narrower range names that range (``slots: -1 is not in 1..=16777216``); a non-int is a
    TypeError naming it."""

class BankFailed(KvReuseError):
    """The donor bank (or host rows) refused an operation."""

class DescriptorRefused(KvReuseError):
    """A manifest, event or hint did not decode or validate."""

class LookupFailed(KvReuseError):
    """The router index refused a worker or an event."""

class PinServiceFailed(KvReuseError):
    """The pin service could not bind or serve."""

class HintRefused(KvReuseError):
    """The hint was refused before anything was touched."""

class PromptMismatch(HintRefused):
    """The hint is for another prompt."""

class PublishFailed(KvReuseError):
    """A worker publisher or directory could not reach NATS / JetStream, or a publish failed."""

class CudaUnavailable(KvReuseError):
    """The GPU path (``gpus=``) was asked for where no CUDA driver or device is."""

class FetchFellBack(KvReuseError):
    """The fetch fell back after validation; ``args`` = (message, stage, cause). Recompute."""

def sequence_hashes(tokens: Sequence[int], tokens_per_block: int) -> List[int]:
    """u64 sequence hashes of the whole blocks of ``tokens`` (kv_descriptor::sequence_hashes)."""

def leak_counters() -> Dict[str, int]:
    """This process's resource counters: open_fds, shm_entries, shm_mappings, pins, ..."""

def reclaim_stale(prefix: str = "kvbank") -> List[str]:
    """Unlinks host shm banks of dead owners (lapsed leases) named ``prefix*``; returns the names."""

def encode_kv_event(event_json: str) -> bytes:
    """Wire bytes (kv-descriptor's KvEvent, named-field MessagePack) of the event given as
    JSON of its fields; for publishers other than a DonorBank. BadArgument names ``event_json``."""
def decode_kv_event(event: bytes) -> str:
    """JSON of the fields of one KvEvent's wire bytes. DescriptorRefused for anything else."""

class Layout:
    """A block-major KV layout; dtype is "f32", "fp16", "bf16" or "fp8_e4m3"."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        tokens_per_block: int,
        tp_size: int,
    ) -> None: ...
    @property
    def rank_block_bytes(self) -> int: ...
    @property
    def rank_block_elems(self) -> int: ...
    @property
    def typestr(self) -> str: ...
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def heads_per_rank(self) -> int:
        """``num_kv_heads / tp_size``."""
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str:
        """``f32``, ``fp16``, ``bf16`` or ``fp8_e4m3``."""
    def __eq__(self, other: object) -> bool:
        """Equal when built from the same arguments (a value; hashable alike)."""
    def __hash__(self) -> int: ...

class Settings:
    """Validated reuse settings: ``values`` under ``env`` (None = os env) under ``argv``.

    ``values`` keys and values are taken literally (a key ``a.b`` is one unknown key, a
    newline or quote in a key or value injects nothing). SettingsRefused names the key
    (unknown, bad or out of range: NaN and infinities included); BadArgument names
    ``values`` (a non-str key) or ``values["key"]`` (not bool/int/float/str, an int past
    64 bits)."""

    def __init__(
        self,
        values: Optional[Mapping[str, Any]] = None,
        argv: Optional[Sequence[str]] = None,
        env: Optional[Mapping[str, str]] = None,
    ) -> None: ...
    def to_json(self) -> str: ...
    def entries(self) -> Dict[str, Tuple[str, str]]: ...
    def describe(self) -> str: ...

class PendingStore:
    """Blocks reserved in a donor bank, written and acknowledged per TP rank.

    Its rows are exactly the blocks the bank lacked: ``DonorBank.store`` skips
    the sealed blocks already retained and stops at the exclusion lineage;
    ``sequence_hashes`` lists the rest in prefix order, and ``write`` takes one
    row per entry of it (row ``i`` = block ``sequence_hashes[i]``)."""

    @property
    def sequence_hashes(self) -> List[int]:
        """The blocks this store writes (new to the bank), in prefix order; empty
        when the bank held them all (``write`` then takes 0 rows, ``ack`` is True)."""
    @property
    def already_retained(self) -> int:
        """Sealed blocks of the tokens the bank already held (not rewritten)."""
    @property
    def excluded(self) -> int:
        """Sealed blocks refused by the exclusion lineage (not stored)."""
    def write(self, rank: int, blocks: Any) -> None:
        """``blocks``: C-contiguous tensor of shape (len(sequence_hashes),
        rank_block_elems), dtype ``Layout.typestr``, row ``i`` = block
        ``sequence_hashes[i]``. A host tensor (numpy ``__array_interface__`` or
        DLPack) is copied into shm, or host-to-device on a CUDA bank
        (``DonorBank.stats["store_bytes_from_host"]``); on a CUDA bank a CUDA
        tensor on the rank's GPU (DLPack with ``stream=1``, or
        ``__cuda_array_interface__``) is copied device to device, synchronized
        before return (``stats["store_bytes_from_device"]``, no host payload).
        BadArgument names ``blocks`` (dtype, shape, strides, a CUDA tensor on a
        host bank, another GPU, a non-default CAI stream) or ``rank``;
        BankFailed when ``rank`` already acked (its part is sealed), or once ``store_timeout_s``
        passed (nothing is copied, the store is rolled back; the message names the store and
        ``store_timeout_s``)."""
    def ack(self, rank: int) -> bool:
        """True once every rank acknowledged (at once for an empty store).
        Refused (BankFailed naming the rank and its first unwritten row) until
        ``write`` succeeded for every row of ``rank``: the store stays pending
        and nothing is published; write and ack again, or ``abort``. BankFailed naming the
        store and ``store_timeout_s`` once that passed (the store is rolled back)."""
    def abort(self) -> bool:
        """Rolls the store back on every rank if not every rank acked; True when it did.
        Its slots return to the bank at once (a ``write`` still copying on another thread
        keeps its rows until it returns). A store dropped unacked is aborted the same way;
        one rolled back by ``store_timeout_s`` instead stays quarantined for one more
        timeout (BankFailed "bank full" then names the quarantined slots and when they
        return)."""
    def __enter__(self) -> "PendingStore": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class PinServer:
    """A running pin service; a context manager that closes it."""

    @property
    def endpoint(self) -> Optional[str]: ...
    @property
    def active_pins(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> "PinServer": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class DonorBank:
    """A decode worker's retained bank: host shared memory, or CUDA device memory with ``gpus``."""

    def __init__(
        self,
        layout: Layout,
        slots: int,
        host_id: str = "kv-reuse-py",
        gpus: Optional[Sequence[int]] = None,
        lease_s: float = 15.0,
        store_timeout_s: float = 5.0,
    ) -> None:
        """``gpus``: one CUDA ordinal per TP rank (CUDA IPC bank); CudaUnavailable without CUDA.
        ``lease_s``: owner lease; a dead donor's segments are reclaimable after it.
        ``store_timeout_s``: an open store not acked by every rank within it is rolled back,
        and its slots are quarantined for one more timeout (``abort()`` frees them at once).
        A host bank reserves its ``slots x tp_size x rank_block_bytes`` bytes of /dev/shm
        here: BankFailed naming ``slots`` (with the free space) when they do not fit.
        Its /dev/shm names go when it is dropped, or at interpreter exit (an atexit hook
        registered at import removes those of every bank still alive, names only: a daemon
        thread holding the script's globals keeps finalization from dropping the bank).
        A forked child inherits the bank but not its ownership: ``store`` / ``write`` there
        raise BankFailed, and dropping it leaves the parent's segments alone."""
    @property
    def engine_id(self) -> str: ...
    @property
    def pins_outstanding(self) -> int: ...
    @property
    def stats(self) -> Dict[str, int]:
        """kv_bank BankStats: stores_ready, stores_rolled_back, blocks_stored,
        blocks_evicted, blocks_excluded, pins, store_bytes_from_host (the store's
        host payload), store_bytes_from_device (device-to-device store bytes)."""
    def manifest(self) -> bytes: ...
    def store(self, tokens: Sequence[int]) -> PendingStore: ...
    def slots(self, hashes: Sequence[int]) -> List[Optional[int]]: ...
    def drain_events(self) -> List[bytes]: ...
    def serve_pins(self, endpoint: str) -> PinServer:
        """Serves source pins on ``endpoint`` (``unix:/path``); a context manager. BadArgument names
        ``endpoint`` when it does not parse or its socket path is relative, PinServiceFailed when
        binding fails."""

class CostTerms:
    """Every term of the router's cost estimate for one request (µs unless named otherwise):
    ``saving_us = recompute_saved_us - transfer_cost_us - lookup_us``; admitted only when
    ``transfer_blocks >= minimum_blocks`` and ``saving_us >= minimum_saving_us``."""

    @property
    def path(self) -> Literal["gpu", "host"]:
        """The transfer path priced: the donor's bank in device or in host memory."""
    @property
    def reused_tokens(self) -> int:
        """Tokens not recomputed (``transfer_blocks x tokens_per_block``)."""
    @property
    def prefill_token_us(self) -> float:
        """Prefill cost per token used, µs."""
    @property
    def recompute_saved_us(self) -> float:
        """``reused_tokens x prefill_token_us``, µs."""
    @property
    def transfer_blocks(self) -> int:
        """Blocks the fetch would move."""
    @property
    def block_us(self) -> float:
        """Per-block transfer cost used for ``path``, µs."""
    @property
    def transfer_cost_us(self) -> float:
        """``transfer_blocks x block_us``, µs."""
    @property
    def lookup_us(self) -> float:
        """Time the donor lookup took, charged against the saving, µs."""
    @property
    def saving_us(self) -> float:
        """``recompute_saved_us - transfer_cost_us - lookup_us``, µs."""
    @property
    def minimum_saving_us(self) -> float:
        """Threshold: ``minimum_estimated_ttft_saving_ms x 1000``, µs."""
    @property
    def minimum_blocks(self) -> int:
        """Threshold: ``minimum_transfer_prefix_blocks``."""

# Stub-only alias (no runtime name): the codes of `Advice.reason`.
_RefuseCode = Literal[
    "no_donor",
    "too_few_blocks",
    "saving_below_minimum",
    "reuse_disabled",
    "gpu_path_disabled",
    "hint_unavailable",
    "cancelled",
]

class Advice:
    """The router's decision for one request (``Router.advise`` and ``RouterClient.advise``
    give the same fields)."""

    @property
    def admitted(self) -> bool:
        """True when a fetch hint is attached."""
    @property
    def reason(self) -> Optional[_RefuseCode]:
        """None when admitted; else a stable code to branch on."""
    @property
    def detail(self) -> Optional[str]:
        """None when admitted; else the refusal in words (free text, for logs)."""
    @property
    def terms(self) -> Optional[CostTerms]:
        """The cost estimate; None when none was made (reuse off, no donor, cancelled, a donor
        record the hint could not be built from)."""
    @property
    def hint(self) -> Optional[bytes]:
        """The hint envelope (MessagePack) for ``Target.fetch``, when admitted."""
    @property
    def donor_engine_id(self) -> Optional[str]:
        """The donor the hint names (engine id, a UUID string), when admitted: the key of its
        ``DonorDirectory.manifest``, which ``Target.fetch`` takes with the hint."""
    @property
    def verdict(self) -> str:
        """Deprecated: the Rust ``Debug`` text of the verdict (``Admit``,
        ``Refuse(NoDonor("..."))``), kept unchanged for readers that log it; its form is not
        stable. Use ``admitted``, ``reason`` and ``detail``."""

class Router:
    """An in-process router: index + donor directory + advisor."""

    def __init__(self, settings: Settings, tokens_per_block: int, max_probes: int = 16384) -> None: ...
    def register_worker(self, key: int, engine: str, role_name: str, layout: Layout) -> None: ...
    def apply_event(self, event: bytes) -> None: ...
    def report_donor(self, manifest: bytes, endpoint: str, slots: Mapping[int, int]) -> None:
        """Records a donor (manifest, pin endpoint, ``{sequence_hash: slot}``), replacing its whole
        earlier report: ``slots`` maps every block the donor holds (merged across stores). BadArgument names
        ``endpoint`` when it does not parse (the parse ``DonorBank.serve_pins`` runs; a ``tcp:``
        endpoint of a Rust donor with a pre-shared key parses, though ``serve_pins`` refuses ``tcp:``)
        or its socket path is relative (each target would resolve it in its own working
        directory), ``slots`` / ``slots[h]``
        for an int out of range; DescriptorRefused for a manifest that does not decode."""
    def advise(self, request_id: str, sequence_hashes: Sequence[int], target: str) -> Advice: ...

class RouterUnavailable(KvReuseError):
    """No router service answered (unreachable, no replica, timeout): advise locally or recompute."""

class AdviseRefused(KvReuseError):
    """The router service refused the request; the message names the field or cause."""

class RouterClient:
    """A client of the router service: advise as NATS request/reply on ``kv_reuse.advise``.
    One client may serve several threads at once. It belongs to the process that made it: in a
    forked child ``advise`` raises RouterUnavailable (`` `advise` refused in process ...``),
    ``connected`` is False and ``close()`` touches nothing of the parent's."""

    def __init__(
        self,
        nats_url: str,
        timeout_s: float = 2.0,
        subject: str = "kv_reuse.advise",
        *,
        busy_poll_us: int = 0,
        user: Optional[str] = None,
        password: Optional[str] = None,
        token: Optional[str] = None,
        creds: Optional[str] = None,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        inbox_prefix: Optional[str] = None,
    ) -> None:
        """Connects (GIL released); raises RouterUnavailable or BadArgument. ``busy_poll_us``
        (0 to 1,000,000): each advise polls for its reply that long before sleeping.
        ``subject`` must be one a request can be published to: a wildcard (``*``, ``>``), an
        empty token or whitespace raises BadArgument naming ``subject``."""
    @property
    def connected(self) -> bool: ...
    @property
    def busy_poll_us(self) -> int: ...
    def advise(self, request_id: str, sequence_hashes: Sequence[int], target: str) -> Advice:
        """Same Advice as Router.advise (GIL released). Raises AdviseRefused, RouterUnavailable,
        DescriptorRefused (reply does not decode), BadArgument naming ``sequence_hashes[i]``. An
        empty ``sequence_hashes`` gets Router.advise's ``no_donor`` advice without a round trip."""
    def advise_tokens(
        self, request_id: str, token_ids: Sequence[int], tokens_per_block: int, target: str
    ) -> Advice:
        """``advise`` keyed by token ids; the service hashes whole blocks of ``tokens_per_block``.
        Token ids that fill no whole block get ``advise([])``'s advice, without a round trip."""
    def close(self) -> None: ...
    def __enter__(self) -> "RouterClient": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class WorkerPublisher:
    """A worker's presence on NATS for the router service: a donor agent (bank, pins, record,
    KV events, announcement, inventory) or a prefill target's announcement. Context manager.
    In a forked child its calls raise PublishFailed (`` `tick` refused in process ...``),
    ``open`` is False and ``close()`` touches nothing of the parent's."""

    @staticmethod
    def donor(
        nats_url: str,
        worker_key: str,
        layout: Layout,
        slots: int,
        pin_endpoint: str,
        *,
        host_id: str = "kv-reuse-py",
        gpus: Optional[Sequence[int]] = None,
        gpu_uuids: Optional[Sequence[str]] = None,
        namespace: str = "default",
        bucket: str = "kv_donors",
        lease_s: float = 15.0,
        record_ttl_s: Optional[float] = None,
        store_timeout_s: float = 5.0,
        announce_period_s: float = 1.0,
        event_ring: int = 4096,
        timeout_s: float = 5.0,
        user: Optional[str] = None,
        password: Optional[str] = None,
        token: Optional[str] = None,
        creds: Optional[str] = None,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        inbox_prefix: Optional[str] = None,
    ) -> "WorkerPublisher":
        """Opens the bank (``bank``), serves pins on ``pin_endpoint``, puts the record in bucket
        ``bucket``, announces every ``announce_period_s`` s (every third of ``record_ttl_s`` when shorter; GIL released). One NATS connection,
        authenticated by ``user``/``password``, ``token`` or ``creds`` (a ``.creds`` file), TLS with
        ``tls_ca`` (and a client certificate ``tls_cert`` + ``tls_key``). ``lease_s`` (0.1 to 86400 s)
        and ``record_ttl_s`` (default ``lease_s``, 0.1 s to ``lease_s``; the bucket's max_age when
        this creates it) may not be below nats-server's 100 ms max_age floor. Raises BadArgument
        (naming the argument; ``pin_endpoint`` also for a relative socket path), BankFailed,
        PinServiceFailed, PublishFailed."""
    @staticmethod
    def target(
        nats_url: str,
        worker_key: str,
        layout: Layout,
        engine_id: str,
        *,
        host_id: str = "kv-reuse-py",
        gpus: Optional[Sequence[int]] = None,
        gpu_uuids: Optional[Sequence[str]] = None,
        namespace: str = "default",
        announce_period_s: float = 1.0,
        timeout_s: float = 5.0,
        user: Optional[str] = None,
        password: Optional[str] = None,
        token: Optional[str] = None,
        creds: Optional[str] = None,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        inbox_prefix: Optional[str] = None,
    ) -> "WorkerPublisher":
        """Announces prefill engine ``engine_id`` (``Target.engine_id``). Raises BadArgument,
        PublishFailed."""
    @property
    def role(self) -> str: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def bank(self) -> Optional[DonorBank]:
        """The donor's bank (None for a target and after ``close()``); do not drain its events
        yourself. A reference kept past ``close()`` keeps the closed bank's lease files mapped."""
    @property
    def pin_endpoint(self) -> Optional[str]: ...
    @property
    def open(self) -> bool: ...
    def publish_events(self) -> int:
        """Publishes queued KV events now; returns how many (0 for a target)."""
    def tick(self) -> None:
        """One period's work now (events, record renewal, announcement)."""
    def publish_prefix_stored(self, tokens: Sequence[int], first_block: int = 0) -> int:
        """A target's own prefix cache holds the sealed blocks of ``tokens``; blocks
        ``first_block ..`` are new: one Stored KV event (tier device, the first block a child of
        block ``first_block - 1``), so the router service's advise for this target fetches only
        past them (``FetchOutcome.fetch_from``). Returns the blocks named (0, no event, when none
        is past ``first_block``; a partial tail block is not named). GIL released. Raises
        BadArgument naming ``first_block`` (past the sealed blocks, negative) or ``tokens[i]``;
        PublishFailed for a donor, a failed publish, or after ``close()``."""
    def publish_prefix_removed(self, sequence_hashes: Sequence[int]) -> int:
        """A target's own prefix cache dropped ``sequence_hashes``: one Removed KV event (tier
        device); returns how many were named (0, no event, for none). GIL released. Raises
        BadArgument naming ``sequence_hashes[i]``; PublishFailed for a donor, a failed publish,
        or after ``close()``."""
    def publish_nixl_agent(self, name: str, metadata: bytes) -> None: ...
    def close(self, drain_s: float = 1.0) -> None:
        """Deletes the record, stops pins (waiting ``drain_s``), closes the bank and lets go of it
        (its lease files are unmapped now unless the caller still holds ``bank`` or one of its
        stores). Idempotent."""
    def __enter__(self) -> "WorkerPublisher": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class DonorDirectory:
    """The donor directory (JetStream KV bucket of donor records) watched from a prefill worker.
    In a forked child (where the watch does not run) ``manifest`` and ``donors`` raise
    PublishFailed."""

    def __init__(
        self,
        nats_url: str,
        bucket: str = "kv_donors",
        timeout_s: float = 5.0,
        *,
        create: bool = False,
        user: Optional[str] = None,
        password: Optional[str] = None,
        token: Optional[str] = None,
        creds: Optional[str] = None,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        inbox_prefix: Optional[str] = None,
    ) -> None:
        """Connects (credentials and TLS as ``WorkerPublisher.donor``) and watches (GIL released).
        Without ``create=True`` a bucket that does not exist is refused (BadArgument naming
        ``bucket``) instead of created empty; raises BadArgument, PublishFailed."""
    def manifest(self, engine_id: str, wait_s: float = 0.0) -> Optional[bytes]:
        """The donor's manifest (wire form) or None, waiting up to ``wait_s`` s for it."""
    @property
    def donors(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> "DonorDirectory": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class FetchOutcome:
    """A completed fetch; its rows return to the pool on ``release()`` / end of ``with``."""

    @property
    def rows(self) -> List[int]: ...
    @property
    def fetch_from(self) -> int: ...
    @property
    def fetched(self) -> List[int]: ...
    @property
    def bytes(self) -> int: ...
    @property
    def host_payload_bytes(self) -> int: ...
    @property
    def transport(self) -> str: ...
    @property
    def import_us(self) -> int:
        """Microseconds importing the donor's segments (cached CUDA IPC mappings after the first fetch)."""
    @property
    def transfer_us(self) -> int:
        """Microseconds of the delivery itself (the copies and their completion)."""
    @property
    def total_us(self) -> int:
        """Microseconds of the whole fetch; the rest past import and transfer is pin, verify and commit."""
    @property
    def stages_us(self) -> Dict[str, int]:
        """The executor's stages in microseconds, in the order they ran: ``reserve`` (hint
        checks, destination rows), ``plan`` (the copy plan), ``pin`` (the donor's pin grant, a
        round trip), ``transfer`` (copies issued and completed, donor probed),
        ``verify_commit`` (pin release, checksums, commit)."""
    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...
    def __enter__(self) -> "FetchOutcome": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class Target:
    """A prefill target: its own host rows, or the engine's KV tensors (``kv_caches``)."""

    def __init__(
        self,
        layout: Layout,
        rows: int,
        kv_caches: Optional[Sequence[Any]] = None,
        gpus: Optional[Sequence[int]] = None,
        kv_layout: str = "block_major",
    ) -> None:
        """``kv_caches``: one writable C-contiguous tensor per TP rank, shape (rows,
        rank_block_elems), dtype ``Layout.typestr``, row = engine block id: numpy / DLPack
        host tensors, or with ``gpus`` (one CUDA ordinal per rank) CUDA tensors via
        ``__cuda_array_interface__`` / DLPack. ``kv_layout``: "block_major" (rows, rank_block_elems),
        "vllm_kv_first" (L, 2, rows, T, H, D), "vllm_block_first" (L, rows, 2, T, H, D), H = this
        rank's KV heads, or "hf": per rank 2*L tensors (K0, V0, K1, ...) or L (K, V) pairs, each
        [1, H, capacity >= rows*T, D], dense last axis, any token / head strides, one K-to-V
        distance in every layer (views of one buffer); block b = tokens b*T..(b+1)*T.
        BadArgument names the tensor (``kv_caches[r][i]``), ``kv_layout`` or ``gpus`` and the
        cause; a tensor whose memory overlaps an earlier one's (the same tensor twice) is
        refused naming the later one (``kv_caches[1]: overlaps the memory of kv_caches[0]``)."""
    @property
    def imported_donors(self) -> int:
        """Donors whose CUDA IPC banks are kept imported between fetches (at most 8)."""
    def forget_donors(self) -> int:
        """Drops every kept donor import; returns how many were kept."""
    @property
    def engine_id(self) -> str: ...
    @property
    def free_rows(self) -> int: ...
    def fetch(
        self,
        hint: bytes,
        prompt_hashes: Sequence[int],
        manifest: Optional[bytes],
        donor_alive: Optional[Callable[[], bool]] = None,
        pin_timeout_s: Optional[float] = None,
        dst_blocks: Optional[Sequence[int]] = None,
        dst_token_offset: Optional[int] = None,
        gate: Optional["StreamGate"] = None,
    ) -> FetchOutcome:
        """Pin, copy, verify (GIL released). ``donor_alive`` is called before the first and
        after the last byte of each TP rank (2 * tp_size calls; False or raising = donor gone); ``pin_timeout_s`` bounds each
        pin exchange (default 2 s); ``dst_blocks``: the engine's block ids for the fetched
        blocks (default: the pool picks; BadArgument names ``dst_blocks`` for a wrong count and
        ``dst_blocks[i]`` for an id not below ``rows`` or repeated); ``dst_token_offset`` (kv_layout="hf" only, a multiple
        of T): the fetched blocks land at tokens N, N+T, ... (default: their prompt positions,
        fetch_from*T); BadArgument names it when misaligned, past the capacity or with
        ``dst_blocks``. Raises PromptMismatch / HintRefused before anything is touched (the
        hint is checked against ``prompt_hashes``, then against ``manifest`` (donor engine,
        generation, layout, slots), before ``dst_blocks`` and before the donor is imported:
        a hint for another prompt is PromptMismatch even when its donor is gone, one for
        another donor or generation HintRefused whatever ``dst_blocks`` holds; ``manifest``
        None, which ``DonorDirectory.manifest`` answers once the donor's record is gone, is
        HintRefused after the prompt check), else FetchFellBack.
        ``gate`` (CUDA targets): its stream waits for the copies as soon as they are issued and
        the gate opens, while this call (on another thread) completes; work enqueued behind it
        must be discarded if this call raises. BadArgument names ``gate`` (not a target GPU,
        host target, already used)."""
    def fetch_async(
        self,
        hint: bytes,
        prompt_hashes: Sequence[int],
        manifest: Optional[bytes],
        donor_alive: Optional[Callable[[], bool]] = None,
        pin_timeout_s: Optional[float] = None,
        dst_blocks: Optional[Sequence[int]] = None,
        dst_token_offset: Optional[int] = None,
        gate: Optional["StreamGate"] = None,
    ) -> "FetchJob":
        """``fetch`` on the target's own fetch thread, which needs no GIL (only a
        ``donor_alive`` probe takes it): the arguments are checked here (PromptMismatch,
        HintRefused, BadArgument raise from this call), then it returns at once. With
        ``gate``, the engine thread enqueues its forward while the fetch completes without
        taking the GIL from it. Fetches of one target run in call order."""
    def read_row(self, rank: int, row: int) -> bytes:
        """A copy of destination row ``row`` of rank ``rank`` (block-major host rows).
        BadArgument names ``rank`` (not below tp_size) or ``row`` (not below ``rows``, on
        another layout, rows in CUDA memory)."""

class FetchJob:
    """A fetch running on its target's fetch thread (``Target.fetch_async``)."""

    def result(self, timeout_s: Optional[float] = None) -> FetchOutcome:
        """Waits (GIL released) and returns the outcome, or raises what ``Target.fetch``
        raises (FetchFellBack, ...). Taken once: a second call raises BadArgument naming
        ``result``. A job dropped without its result still completes; its rows are released.
        ``timeout_s``: raises TimeoutError when the fetch is not done by then, leaving the
        result to a later call. Ctrl-C raises KeyboardInterrupt within ~50 ms and likewise
        leaves the job running and its result to a later call."""
    def cancel(self) -> bool:
        """Cancels the fetch. True: this call stopped it before it started; it never runs (no pin, no copy;
        ``result()`` raises FetchFellBack with stage ``queued``, cause ``cancelled``; its
        gate ends unopened). False: it was running, done or cancelled already; a running delivery stops at
        its next check (``result()`` raises FetchFellBack, cause ``transfer_cancelled``)
        unless it got past its last check. Take the result or drop the job either way."""
    @property
    def state(self) -> str:
        """``queued``, ``running``, ``done`` or ``cancelled`` (before it started)."""

class StreamGate:
    """An engine CUDA stream that a fetch releases as soon as its copies are issued.

    ``StreamGate(torch.cuda.current_stream(d).cuda_stream, d)``: pass it to
    ``Target.fetch(..., gate=g)`` on a fetch thread; ``g.wait()`` returns True
    once the stream waits for the copies (enqueue the forward then), False when
    the fetch ended without that (take its result first). One fetch per gate.
    The stream must belong to device ``d``'s primary context and outlive the
    fetch. BadArgument names ``stream`` / ``device`` for a negative or too
    large int.

    ``layer_groups`` (1..=1024; None or 1: the whole fetch at once): the fetch
    is released layer group by layer group (``layer_group_ranges(layers,
    layer_groups)``); ``wait()`` returns True once the first group is issued, and
    the engine calls ``wait_layer(l)`` before layer ``l`` reads its KV (a forward
    pre-hook on each group's first layer), so its first layers run while later
    ones are still copied. BadArgument names ``layer_groups`` outside 1..=1024."""
    def __init__(self, stream: int, device: int, layer_groups: Optional[int] = None) -> None: ...
    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Blocks (GIL released) until enqueued (True) or the fetch ended / ``timeout_s`` passed (False).
        Without ``timeout_s`` a gate no fetch takes waits forever: Ctrl-C (any signal handler's
        exception) is raised within ~50 ms, as in ``FetchJob.result``."""
    def wait_layer(self, layer: int, timeout_s: Optional[float] = None) -> bool:
        """Layered gates: blocks (GIL released) until layer ``layer``'s group is issued, makes
        the stream wait for it (and every earlier group), True; False when the fetch ended
        without it (discard what was computed) or ``timeout_s`` passed. Without layer groups:
        ``wait(timeout_s)``. Ctrl-C raises KeyboardInterrupt within ~50 ms, as in ``wait``."""
    @property
    def layer_groups(self) -> Optional[int]: ...
    @property
    def groups_issued(self) -> List[Tuple[int, int]]:
        """Layered gates: ``(start, end)`` of each group issued so far (a part that could not be
        cut by layer: one group ``(0, 2**32 - 1)``)."""
    @property
    def times_us(self) -> Dict[str, int]:
        """µs from construction to ``armed``, ``enqueued``, ``ended``, ``first_group``, ``last_group``
        (points not reached are absent)."""
    @property
    def enqueued(self) -> bool: ...
    @property
    def ended(self) -> bool: ...
    @property
    def fetch_from(self) -> Optional[int]:
        """The hint's first fetched block, once a fetch took the gate."""
    @property
    def blocks(self) -> Optional[int]:
        """Blocks the fetch delivers from ``fetch_from`` on, once a fetch took the gate."""
    @property
    def stream(self) -> int: ...
    @property
    def device(self) -> int: ...

def layer_group_ranges(layers: int, groups: int) -> List[range]:
    """The layer groups a fetch to a ``StreamGate(..., layer_groups=groups)`` is cut into for a
    ``layers``-layer model: ``min(groups, layers)`` contiguous ranges, larger first."""
