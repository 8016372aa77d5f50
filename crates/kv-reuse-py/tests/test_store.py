"""The store contract when part of the tokens is already retained:
``PendingStore.sequence_hashes`` is exactly the blocks the bank lacked, in
order, ``write`` takes exactly that many rows, and every byte lands at its
block's slot (read back by a fetch into numpy caches); the store payload
counters by source."""

import numpy as np
import pytest

import kv_reuse
from conftest import TOKENS_PER_BLOCK
from donor_proc import pattern
from test_arrays import FakeCuda
from test_roles import router_for_bank


def rows_for(layout, rank, blocks):
    """Rank ``rank``'s rows of the given block indices (``pattern`` values)."""
    return np.stack([pattern(layout, rank, b) for b in blocks])


def fetch_back(bank, layout, enabled, hashes, tmp_path):
    """Fetches ``hashes`` from ``bank`` into fresh numpy caches; returns, per
    rank, the bytes of each block's row in fetch order."""
    n = layout.rank_block_elems
    endpoint = "unix:" + str(tmp_path / "pin.sock")
    caches = [np.full((16, n), -1.0, dtype=np.float32) for _ in range(layout.tp_size)]
    with bank.serve_pins(endpoint):
        target = kv_reuse.Target(layout, rows=16, kv_caches=caches)
        router = router_for_bank(bank, endpoint, hashes, layout, enabled, target)
        advice = router.advise("req-store", hashes, target.engine_id)
        assert advice.admitted, advice
        with target.fetch(advice.hint, hashes, bank.manifest()) as out:
            assert len(out.rows) == len(hashes)
            return [[caches[r][row].tobytes() for row in out.rows] for r in range(layout.tp_size)]


def test_a_store_whose_first_half_is_retained_lands_every_byte_at_its_block(layout, enabled, tmp_path):
    bank = kv_reuse.DonorBank(layout, slots=16)
    tokens = list(range(TOKENS_PER_BLOCK * 6))
    all_hashes = kv_reuse.sequence_hashes(tokens, TOKENS_PER_BLOCK)
    first = bank.store(tokens[: TOKENS_PER_BLOCK * 3])
    assert first.sequence_hashes == all_hashes[:3]
    for r in range(layout.tp_size):
        first.write(r, rows_for(layout, r, [0, 1, 2]))
    assert [first.ack(r) for r in range(layout.tp_size)] == [False, True]

    second = bank.store(tokens)
    # Exactly the blocks to write, in order; the retained half is counted.
    assert second.sequence_hashes == all_hashes[3:]
    assert (second.already_retained, second.excluded) == (3, 0)
    n = layout.rank_block_elems
    # One row per store hash (the retained ones too) is not the contract.
    with pytest.raises(kv_reuse.BadArgument, match=r"blocks: shape \[6, %d\], expected \[3, %d\]" % (n, n)):
        second.write(0, rows_for(layout, 0, range(6)))
    for r in range(layout.tp_size):
        second.write(r, rows_for(layout, r, [3, 4, 5]))
    assert [second.ack(r) for r in range(layout.tp_size)] == [False, True]
    assert None not in bank.slots(all_hashes)

    got = fetch_back(bank, layout, enabled, all_hashes, tmp_path)
    for r in range(layout.tp_size):
        for block in range(6):
            assert got[r][block] == pattern(layout, r, block).tobytes(), (r, block)
    rbb = layout.rank_block_bytes
    stats = bank.stats
    assert stats["store_bytes_from_host"] == 6 * layout.tp_size * rbb
    assert stats["store_bytes_from_device"] == 0
    assert (stats["stores_ready"], stats["blocks_stored"]) == (2, 6)


def test_a_store_of_retained_blocks_only_writes_nothing_and_acks_at_once(layout):
    bank = kv_reuse.DonorBank(layout, slots=4)
    tokens = list(range(TOKENS_PER_BLOCK * 2))
    first = bank.store(tokens)
    for r in range(layout.tp_size):
        first.write(r, rows_for(layout, r, [0, 1]))
        first.ack(r)
    before = bank.stats
    again = bank.store(tokens)
    assert (again.sequence_hashes, again.already_retained) == ([], 2)
    n = layout.rank_block_elems
    with pytest.raises(kv_reuse.BadArgument, match=r"blocks: shape \[2, %d\], expected \[0, %d\]" % (n, n)):
        again.write(0, rows_for(layout, 0, [0, 1]))
    for r in range(layout.tp_size):
        again.write(r, np.zeros((0, n), dtype=np.float32))
    assert [again.ack(r) for r in range(layout.tp_size)] == [True, True]
    with pytest.raises(kv_reuse.BadArgument, match="rank"):
        again.ack(layout.tp_size)
    assert bank.stats == before
    assert bank.drain_events() != []  # the first store's Stored event only
    assert bank.drain_events() == []


def test_a_cuda_tensor_on_a_host_bank_is_refused_naming_blocks(layout):
    bank = kv_reuse.DonorBank(layout, slots=4)
    store = bank.store(list(range(TOKENS_PER_BLOCK * 2)))
    n = layout.rank_block_elems
    for fake in (FakeCuda((2, n)), FakeCuda((2, n), device=0)):
        with pytest.raises(kv_reuse.BadArgument, match="blocks: a CUDA tensor on the host path"):
            store.write(0, fake)
    assert bank.stats["store_bytes_from_host"] == 0


class Bf16LikeCuda:
    """A CUDA tensor whose ``__cuda_array_interface__`` raises TypeError (as
    torch's does for bf16) and that offers DLPack on cuda:0; never
    dereferenced: the host bank refuses it before touching memory."""

    @property
    def __cuda_array_interface__(self):
        raise TypeError("Can't get __cuda_array_interface__ for bfloat16")

    def __dlpack__(self, stream=None):
        raise AssertionError("a host bank must refuse before reading the tensor")

    def __dlpack_device__(self):
        return (2, 0)


def test_a_cuda_tensor_whose_array_interface_raises_is_read_as_dlpack(layout):
    bank = kv_reuse.DonorBank(layout, slots=4)
    store = bank.store(list(range(TOKENS_PER_BLOCK * 2)))
    with pytest.raises(kv_reuse.BadArgument, match="blocks: a CUDA tensor on the host path"):
        store.write(0, Bf16LikeCuda())
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]: a CUDA tensor on the host path"):
        kv_reuse.Target(layout, rows=4, kv_caches=[Bf16LikeCuda(), Bf16LikeCuda()])


def test_a_store_left_without_every_ack_is_rolled_back_and_a_completed_one_is_kept(layout):
    bank = kv_reuse.DonorBank(layout, slots=16)
    tokens = list(range(TOKENS_PER_BLOCK * 4))
    hashes = kv_reuse.sequence_hashes(tokens, TOKENS_PER_BLOCK)
    with pytest.raises(RuntimeError, match="engine crashed"):
        with bank.store(tokens) as st:
            st.write(0, rows_for(layout, 0, range(4)))
            raise RuntimeError("engine crashed mid-store")
    # Rolled back on every rank: nothing retained, no event, the blocks are new again.
    assert bank.slots(hashes) == [None] * 4
    assert bank.drain_events() == []
    # A rolled-back store refuses writes and acks in the Python API's words
    # (not kv_bank's `store_id` argument).
    st = bank.store(tokens)
    assert st.abort() is True
    with pytest.raises(kv_reuse.BankFailed,
                       match=r"^store \d+ is no longer pending \(it completed, was aborted or timed out\)$"):
        st.write(0, rows_for(layout, 0, range(4)))
    with pytest.raises(kv_reuse.BankFailed, match=r"^store \d+ is no longer pending"):
        st.ack(0)
    with bank.store(tokens) as st:
        assert st.sequence_hashes == hashes and st.already_retained == 0
        for rank in range(layout.tp_size):
            st.write(rank, rows_for(layout, rank, range(4)))
        assert [st.ack(r) for r in range(layout.tp_size)][-1] is True
        assert st.abort() is False  # completed: never taken back
    assert None not in bank.slots(hashes)
    assert len(bank.drain_events()) == 1
