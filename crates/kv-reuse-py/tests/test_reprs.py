"""What an operator sees printing a kv_reuse object: every class a repr
naming it (they showed ``<kv_reuse.RouterClient object at 0x7f...>``),
values as ``Name(field=value, ...)``, objects that own a connection, a
bank or a socket as ``<kv_reuse.Name field=value ...>``, everything in
Python's spelling (``True``, ``None``, quoted strings), and never a
password or token."""

import os
import re

import numpy as np
import pytest

import kv_reuse
from conftest import TOKENS_PER_BLOCK
from nats_fake import NatsServer, find_nats_server, skip_or_fail

TARGET = "00000000-0000-4000-8000-0000000000b1"


def test_settings_show_the_keys_that_were_set_as_the_values_that_make_them():
    assert repr(kv_reuse.Settings(env={})) == "Settings(values={}, env={})"
    s = kv_reuse.Settings({"minimum_transfer_prefix_blocks": 6, "enable_decode_to_prefill_reuse": True},
                          env={"KV_REUSE_MINIMUM_ESTIMATED_TTFT_SAVING_MS": "3"},
                          argv=["--enable-decode-to-prefill-gpu-reuse"])
    # Registry order (describe()'s), from the dict, the environment and argv alike; a
    # float setting as a float.
    assert repr(s) == ("Settings(values={'enable_decode_to_prefill_reuse': True, "
                       "'enable_decode_to_prefill_gpu_reuse': True, "
                       "'minimum_estimated_ttft_saving_ms': 3.0, 'minimum_transfer_prefix_blocks': 6}, env={})")
    # The repr is the call that makes the same settings.
    again = eval(repr(s), {"Settings": kv_reuse.Settings})
    assert again.to_json() == s.to_json()
    assert repr(again) == repr(s)


def test_a_settings_repr_rebuilds_the_same_settings_whatever_the_environment(monkeypatch):
    # Trial h39, 12: the repr left `env={}` out, and `Settings()` reads the process
    # environment: a KV_REUSE_* variable there added a key, a mistyped one raised.
    s = kv_reuse.Settings({"enable_decode_to_prefill_reuse": True}, env={})
    text = repr(s)
    assert text == "Settings(values={'enable_decode_to_prefill_reuse': True}, env={})"
    monkeypatch.setenv("KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS", "9")
    # The environment is read by a Settings made without `env`...
    assert kv_reuse.Settings({"enable_decode_to_prefill_reuse": True}).to_json() != s.to_json()
    # ...but not by the repr's call.
    assert eval(text, {"Settings": kv_reuse.Settings}).to_json() == s.to_json()
    monkeypatch.delenv("KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS")
    monkeypatch.setenv("KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOKCS", "9")
    with pytest.raises(kv_reuse.SettingsRefused):
        kv_reuse.Settings({"enable_decode_to_prefill_reuse": True})
    assert eval(text, {"Settings": kv_reuse.Settings}).to_json() == s.to_json()


def test_a_stream_gate_is_shown_in_python_spelling():
    # It showed Rust's `layer_groups=Some(4)` and `armed=false`; then a value's
    # `StreamGate(..., enqueued=0/0, ...)`, which no call rebuilds (trial h39, 12):
    # it wraps a live CUDA stream and a fetch's state, so the object form.
    assert repr(kv_reuse.StreamGate(0x1234, 3)) == (
        "<kv_reuse.StreamGate stream=0x1234 device=3 layer_groups=None armed=False "
        "enqueued=0 parts=0 groups=0 ended=False>")
    assert repr(kv_reuse.StreamGate(0x1234, 0, layer_groups=4)).startswith(
        "<kv_reuse.StreamGate stream=0x1234 device=0 layer_groups=4 armed=False ")


def stored_bank(layout, blocks):
    """A host bank holding the `blocks` blocks of one prompt: (bank, prompt hashes)."""
    bank = kv_reuse.DonorBank(layout, slots=16)
    tokens = list(range(TOKENS_PER_BLOCK * blocks))
    store = bank.store(tokens)
    assert re.fullmatch(rf"<kv_reuse\.PendingStore store_id=\d+ blocks={blocks} already_retained=0 excluded=0>",
                        repr(store)), repr(store)
    for rank in range(layout.tp_size):
        store.write(rank, np.ones((blocks, layout.rank_block_elems), np.float32))
        store.ack(rank)
    again = bank.store(tokens[:TOKENS_PER_BLOCK * 2])
    assert re.fullmatch(r"<kv_reuse\.PendingStore store_id=\d+ blocks=0 already_retained=2 excluded=0>",
                        repr(again)), repr(again)
    return bank, kv_reuse.sequence_hashes(tokens, TOKENS_PER_BLOCK)


def test_the_in_process_roles_show_their_ids_sizes_and_state(layout, tmp_path):
    bank, prompt = stored_bank(layout, 10)
    assert repr(bank) == (f"<kv_reuse.DonorBank engine_id='{bank.engine_id}' slots=16 gpus=None "
                          f"closed=False layout={layout!r}>")
    router = kv_reuse.Router(kv_reuse.Settings({"enable_decode_to_prefill_reuse": True}, env={}),
                             TOKENS_PER_BLOCK, max_probes=99)
    assert repr(router) == f"<kv_reuse.Router tokens_per_block={TOKENS_PER_BLOCK} max_probes=99 workers=0 donors=0>"
    target = kv_reuse.Target(layout, rows=16)
    assert repr(target) == (f"<kv_reuse.Target engine_id='{target.engine_id}' rows=16 free_rows=16 "
                            f"kv_layout='block_major' gpus=None layout={layout!r}>")
    endpoint = f"unix:{tmp_path}/pins.sock"
    router.register_worker(1, bank.engine_id, "decode", layout)
    router.register_worker(2, target.engine_id, "prefill", layout)
    for e in bank.drain_events():
        router.apply_event(e)
    router.report_donor(bank.manifest(), endpoint, dict(zip(prompt, bank.slots(prompt))))
    assert repr(router).endswith(" workers=2 donors=1>")
    advice = router.advise("req-repr", prompt, target.engine_id)
    assert advice.admitted, advice
    with bank.serve_pins(endpoint) as pins:
        assert repr(pins) == f"<kv_reuse.PinServer endpoint='{endpoint}' active_pins=0>"
        with target.fetch(advice.hint, prompt, bank.manifest()) as out:
            # Ten rows: the first 8, then `...` as reprlib cuts a list; no hash of `fetched`.
            assert len(out.rows) == 10
            rows = ", ".join(map(str, out.rows[:8]))
            assert repr(out) == (f"FetchOutcome(fetch_from=0, rows=[{rows}, ...], bytes={out.bytes}, "
                                 f"host_payload_bytes={out.host_payload_bytes}, transport={out.transport!r}, "
                                 f"total_us={out.total_us}, released=False)")
            assert str(out.fetched[0]) not in repr(out)
            assert " free_rows=6 " in repr(target)
        assert repr(out).endswith(", released=True)")
        # A prefix of 4 blocks (the least the default settings admit): every row shown.
        short = router.advise("req-repr-4", prompt[:4], target.engine_id)
        job = target.fetch_async(short.hint, prompt[:4], bank.manifest())
        assert re.fullmatch(r"<kv_reuse\.FetchJob state='(queued|running|done)'>", repr(job)), repr(job)
        with job.result() as out:
            assert len(out.rows) == 4
            assert repr(out).startswith(f"FetchOutcome(fetch_from=0, rows={out.rows!r}, bytes=")
        assert repr(job) == "<kv_reuse.FetchJob state='done'>"
    assert repr(pins) == "<kv_reuse.PinServer endpoint=None active_pins=0>"


SECRET = "pw-repr-4d1c"


def test_the_nats_clients_show_their_server_and_no_secret(layout, tmp_path):
    """RouterClient, DonorDirectory and both WorkerPublisher roles, logged in
    to servers that check the secret (a password: in the URL and as a
    keyword; a token in the URL), show the server with the secret as ***,
    their subject, bucket or worker, and whether they are open."""
    binary = find_nats_server()
    if binary is None:
        skip_or_fail("nats-server", "no nats-server >= 2.10.0 (cargo xtask install)")
    by_password = NatsServer(binary, tmp_path / "js-user", ("--user", "donor", "--pass", SECRET))
    by_token = NatsServer(binary, tmp_path / "js-token", ("--auth", SECRET))
    try:
        port = by_password.port
        in_url = (f"nats://donor:{SECRET}@127.0.0.1:{port}", f"nats://donor:***@127.0.0.1:{port}", {})
        keywords = (by_password.url, by_password.url, {"user": "donor", "password": SECRET})
        token = (f"nats://{SECRET}@127.0.0.1:{by_token.port}", f"nats://***@127.0.0.1:{by_token.port}", {})
        for i, (url, shown, creds) in enumerate((in_url, keywords, token)):
            # `with` blocks: a failed check closes what it opened (no leak error beside it).
            with kv_reuse.RouterClient(url, timeout_s=3.0, busy_poll_us=50, **creds) as client:
                assert repr(client) == (f"<kv_reuse.RouterClient nats_url='{shown}' subject='kv_reuse.advise' "
                                        "timeout_s=3.0 busy_poll_us=50 connected=True>")
            assert repr(client).endswith(" connected=False>")

            with kv_reuse.DonorDirectory(url, bucket=f"kv_repr{i}", create=True, **creds) as directory:
                assert repr(directory) == (f"<kv_reuse.DonorDirectory nats_url='{shown}' bucket='kv_repr{i}' "
                                           "open=True donors=0>")
            assert repr(directory) == (f"<kv_reuse.DonorDirectory nats_url='{shown}' bucket='kv_repr{i}' "
                                       "open=False>")

            with kv_reuse.WorkerPublisher.target(url, "prefill-0", layout, TARGET, **creds) as pub:
                assert repr(pub) == (f"<kv_reuse.WorkerPublisher role='prefill' worker_key='prefill-0' "
                                     f"engine_id='{TARGET}' nats_url='{shown}' open=True>")
            assert repr(pub).endswith(" open=False>")

            with kv_reuse.WorkerPublisher.donor(url, "decode-0", layout, 4, f"unix:{tmp_path}/d{i}.sock",
                                                bucket=f"kv_repr{i}", **creds) as pub:
                assert repr(pub) == (f"<kv_reuse.WorkerPublisher role='decode' worker_key='decode-0' "
                                     f"engine_id='{pub.engine_id}' nats_url='{shown}' open=True>")
                bank = pub.bank
                assert repr(bank).startswith(f"<kv_reuse.DonorBank engine_id='{pub.engine_id}' slots=4 "
                                             "gpus=None closed=False ")
            assert " closed=True " in repr(bank)  # closed by its publisher
            del bank  # its lease files go with the last reference
            for shown_repr in (repr(client), repr(directory), repr(pub)):
                assert SECRET not in shown_repr, shown_repr
    finally:
        by_password.stop()
        by_token.stop()
