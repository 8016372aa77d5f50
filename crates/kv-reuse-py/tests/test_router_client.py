"""RouterClient: advise over NATS request/reply (kv_reuse.advise) against a
real nats-server. Replicas here are raw-protocol repliers (nats_fake.py);
the round trip through the `kv-reuse-router` binary runs when it is built."""

import json
import os
import re
import subprocess
import time

import pytest

import kv_reuse
from nats_fake import (ROUTER_SOURCE, NatsServer, Replier, find_nats_server, find_router_binary,
                       msgpack, skip_or_fail)
from test_gil import Ticker

TARGET = "00000000-0000-4000-8000-000000000002"


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(kv_reuse.BadArgument, match="timeout_s"):
        kv_reuse.RouterClient("nats://127.0.0.1:1", timeout_s=0)
    with pytest.raises(kv_reuse.BadArgument, match="subject"):
        kv_reuse.RouterClient("nats://127.0.0.1:1", subject="a b")
    # A wildcard is a subscriber's pattern: a request published there
    # reaches no replica, and every advise failed later with "no responders".
    for subject, why in (("kv_reuse.>", "it contains a wildcard"), ("kv_reuse.*", "it contains a wildcard"),
                         ("kv_reuse..advise", "it has an empty token"), ("", "it is empty")):
        with pytest.raises(kv_reuse.BadArgument,
                           match=rf'^subject: "{re.escape(subject)}" is not a NATS subject to publish to: {why}'):
            kv_reuse.RouterClient("nats://127.0.0.1:1", subject=subject)
    with pytest.raises(kv_reuse.BadArgument, match="password"):
        kv_reuse.RouterClient("nats://127.0.0.1:1", user="router")
    for bad in (-1, 1_000_001, 2**64):
        with pytest.raises(kv_reuse.BadArgument, match="busy_poll_us"):
            kv_reuse.RouterClient("nats://127.0.0.1:1", busy_poll_us=bad)


def test_an_unreachable_server_raises_router_unavailable():
    with pytest.raises(kv_reuse.RouterUnavailable, match=r"nats_url nats://127\.0\.0\.1:1"):
        kv_reuse.RouterClient("nats://127.0.0.1:1", timeout_s=0.5)


def test_no_replica_listening_raises_router_unavailable(nats):
    with kv_reuse.RouterClient(nats.url, timeout_s=1.0) as client:
        assert client.connected
        t0 = time.monotonic()
        # "no responders" once (async-nats' kind and source both said it).
        with pytest.raises(kv_reuse.RouterUnavailable, match=r"^advise on kv_reuse\.advise: no responders$"):
            client.advise("req-1", [1, 2, 3], TARGET)
        # NATS answers "no responders" at once; not the full timeout.
        assert time.monotonic() - t0 < 0.9
        with pytest.raises(kv_reuse.BadArgument, match="target"):
            client.advise("req-1", [1], "not-a-uuid")
        with pytest.raises(kv_reuse.AdviseRefused, match="request_id"):
            client.advise("", [1], TARGET)
    assert not client.connected
    with pytest.raises(kv_reuse.RouterUnavailable, match="closed"):
        client.advise("req-2", [1], TARGET)


def test_a_refusal_from_the_service_raises_advise_refused(nats):
    reply = msgpack({"request_id": "req-drain", "result": {"refused": "draining"}})
    replica = Replier(nats.url, "kv_reuse.advise", lambda _: reply)
    replica.start()
    try:
        with kv_reuse.RouterClient(nats.url) as client:
            with pytest.raises(kv_reuse.AdviseRefused, match="draining"):
                client.advise("req-drain", [11, 22], TARGET)
    finally:
        replica.stop()
    # The request went out as MessagePack naming the request and its keys.
    assert len(replica.requests) == 1
    assert b"req-drain" in replica.requests[0] and b"sequence_hashes" in replica.requests[0]


def test_a_prompt_of_no_block_gets_the_in_process_advice_without_a_round_trip(nats):
    # docs/python.md: a prompt of no whole block is answered by the client
    # itself, with the advice the in-process Router.advise gives it (the
    # index's EmptyRequest), not an exception: a short prompt is routine.
    # It used to raise BadArgument here (and earlier went out and came back
    # as whatever the service said about the target).
    reply = msgpack({"request_id": "req-ok", "result": {"refused": "draining"}})
    replica = Replier(nats.url, "kv_reuse.advise", lambda _: reply)
    replica.start()
    try:
        with kv_reuse.RouterClient(nats.url) as client:
            for advice in (client.advise("req-empty", [], TARGET),
                           client.advise_tokens("req-short", list(range(15)), 16, TARGET),
                           client.advise_tokens("req-none", [], 16, TARGET)):
                assert (advice.admitted, advice.reason, advice.terms, advice.hint) == (
                    False, "no_donor", None, None)
                assert advice.detail == "`sequence_hashes` is empty"
            # The request's own fields are still checked first.
            with pytest.raises(kv_reuse.AdviseRefused, match="request_id"):
                client.advise("", [], TARGET)
            with pytest.raises(kv_reuse.AdviseRefused, match="tokens_per_block"):
                client.advise_tokens("req-zero", [], 0, TARGET)
            with pytest.raises(kv_reuse.BadArgument, match="^target"):
                client.advise("req-empty", [], "not-a-uuid")
            # One block is enough to be sent (the replica answers draining).
            with pytest.raises(kv_reuse.AdviseRefused, match="draining"):
                client.advise_tokens("req-ok", list(range(16)), 16, TARGET)
    finally:
        replica.stop()
    # None of the prompts of no block reached the replica.
    assert len(replica.requests) == 1 and b"req-ok" in replica.requests[0]


def test_a_busy_polling_client_gets_the_same_replies(nats):
    """busy_poll_us only changes how the caller waits: each reply is still
    the one for its request (the client checks the reply's request_id), and
    a silent replica still times out after the spin."""
    answered = []

    def answer(_req):
        rid = f"req-bp-{len(answered)}"
        answered.append(rid)
        return msgpack({"request_id": rid, "result": {"refused": "draining"}})

    replica = Replier(nats.url, "kv_reuse.advise", answer)
    replica.start()
    try:
        with kv_reuse.RouterClient(nats.url, timeout_s=1.0, busy_poll_us=200_000) as client:
            assert client.busy_poll_us == 200_000
            for i in range(3):
                with pytest.raises(kv_reuse.AdviseRefused, match="draining"):
                    client.advise(f"req-bp-{i}", [i + 1], TARGET)
    finally:
        replica.stop()
    assert answered == ["req-bp-0", "req-bp-1", "req-bp-2"]
    silent = Replier(nats.url, "kv_reuse.advise", None)
    silent.start()
    try:
        with kv_reuse.RouterClient(nats.url, timeout_s=0.3, busy_poll_us=1_000) as client:
            t0 = time.monotonic()
            with pytest.raises(kv_reuse.RouterUnavailable):
                client.advise("req-bp-silent", [1], TARGET)
            assert 0.25 < time.monotonic() - t0 < 1.5
    finally:
        silent.stop()
    with kv_reuse.RouterClient(nats.url) as client:
        assert client.busy_poll_us == 0


def test_advise_tokens_sends_token_ids_and_refuses_a_zero_block_size(nats):
    reply = msgpack({"request_id": "req-tok", "result": {"refused": "draining"}})
    replica = Replier(nats.url, "kv_reuse.advise", lambda _: reply)
    replica.start()
    try:
        with kv_reuse.RouterClient(nats.url) as client:
            with pytest.raises(kv_reuse.AdviseRefused, match="tokens_per_block"):
                client.advise_tokens("req-tok", [1, 2, 3], 0, TARGET)
            with pytest.raises(kv_reuse.AdviseRefused, match="draining"):
                client.advise_tokens("req-tok", list(range(32)), 16, TARGET)
    finally:
        replica.stop()
    # Only the valid request reached the replica, keyed by tokens.
    assert len(replica.requests) == 1
    assert b"token_ids" in replica.requests[0] and b"tokens_per_block" in replica.requests[0]


def test_a_garbled_reply_is_a_descriptor_error(nats):
    replica = Replier(nats.url, "kv_reuse.advise", lambda _: b"\xc1garbage")
    replica.start()
    try:
        with kv_reuse.RouterClient(nats.url) as client:
            with pytest.raises(kv_reuse.DescriptorRefused, match="advise_reply"):
                client.advise("req-g", [1], TARGET)
    finally:
        replica.stop()


def terms(path, blocks, minimum_blocks=4, minimum_saving_us=2000.0, lookup_us=12.5):
    """A CostTerms map as the router service encodes it (docs/wire-formats.md,
    "Advise"): 64-token blocks, 30 µs a token, 400 µs a block."""
    recompute, transfer = blocks * 64 * 30.0, blocks * 400.0
    return {"path": path, "reused_tokens": blocks * 64, "prefill_token_us": 30.0,
            "recompute_saved_us": recompute, "transfer_blocks": blocks, "block_us": 400.0,
            "transfer_cost_us": transfer, "lookup_us": lookup_us,
            "saving_us": recompute - transfer - lookup_us,
            "minimum_saving_us": minimum_saving_us, "minimum_blocks": minimum_blocks}


# Every refusal kind of kv_router_glue's RefuseReason as the service sends it:
# (verdict's reason on the wire, terms, Advice.reason, a part of Advice.detail).
SERVICE_REFUSALS = [
    ("reuse_disabled", None, "reuse_disabled", "enable_decode_to_prefill_reuse is off"),
    ("gpu_path_disabled", terms("gpu", 6), "gpu_path_disabled", "enable_decode_to_prefill_gpu_reuse is off"),
    ("too_few_blocks", terms("host", 2), "too_few_blocks",
     "2 blocks to fetch, fewer than minimum_transfer_prefix_blocks = 4"),
    ("saving_below_minimum", terms("host", 6, minimum_saving_us=1e7), "saving_below_minimum",
     "estimated saving 9107.5 µs is below minimum_estimated_ttft_saving_ms (10000000.0 µs)"),
    ({"no_donor": "no worker holds block 0"}, None, "no_donor", "no worker holds block 0"),
    ({"hint_unavailable": "block 3 is gone"}, None, "hint_unavailable", "block 3 is gone"),
    ("cancelled", None, "cancelled", "cancelled during its donor lookup"),
]


def test_a_decided_reply_gives_the_same_typed_fields_as_the_router(nats):
    """The service's reply carries the whole decision (verdict and cost
    terms): RouterClient's Advice has the same reason code, detail and
    terms as Router.advise, for every kind of refusal, including those a
    CPU-only in-process router cannot provoke (gpu_path_disabled,
    cancelled)."""
    replies = [
        msgpack({"request_id": f"req-d{i}", "result": {"decided": {
            "decision": {"request_id": f"req-d{i}", "terms": t, "verdict": {"refuse": wire}},
            "hint": None}}})
        for i, (wire, t, _, _) in enumerate(SERVICE_REFUSALS)
    ]
    replica = Replier(nats.url, "kv_reuse.advise", lambda _: replies.pop(0))
    replica.start()
    try:
        with kv_reuse.RouterClient(nats.url) as client:
            for i, (wire, sent, reason, detail) in enumerate(SERVICE_REFUSALS):
                advice = client.advise(f"req-d{i}", [1, 2], TARGET)
                assert not advice.admitted and advice.hint is None
                assert advice.reason == reason
                assert detail in advice.detail, advice.detail
                assert advice.verdict.startswith("Refuse(")
                if sent is None:
                    assert advice.terms is None
                    continue
                got = {k: getattr(advice.terms, k) for k in sent}
                assert got == sent
                assert advice.terms.saving_us == (advice.terms.recompute_saved_us
                                                  - advice.terms.transfer_cost_us
                                                  - advice.terms.lookup_us)
    finally:
        replica.stop()
    assert replies == []


def test_advise_releases_the_gil_while_a_replica_is_silent(nats):
    replica = Replier(nats.url, "kv_reuse.advise", None)
    replica.start()
    ticker = Ticker()
    ticker.start()
    try:
        with kv_reuse.RouterClient(nats.url, timeout_s=0.5) as client:
            time.sleep(0.02)
            t0, ticks0 = time.monotonic(), ticker.ticks
            with pytest.raises(kv_reuse.RouterUnavailable, match="no reply within"):
                client.advise("req-silent", [1, 2], TARGET)
            elapsed, ticks = time.monotonic() - t0, ticker.ticks - ticks0
    finally:
        ticker.stop.set()
        ticker.join()
        replica.stop()
    assert elapsed >= 0.45, elapsed
    assert ticks >= 50, (ticks, elapsed)


def test_a_round_trip_through_the_router_binary(nats):
    binary = find_router_binary()
    if binary is None:
        why = "not built (target/debug/kv-reuse-router, $KVQ_ROUTER_BIN)"
        if os.path.exists(ROUTER_SOURCE):
            skip_or_fail("kv-reuse-router", why)
        line = f"SKIP kv-reuse-router: {why}; its source is not in this checkout"
        print(line)
        pytest.skip(line)
    router = subprocess.Popen(
        [binary, "--nats-url", nats.url, "--metrics-addr", "127.0.0.1:0",
         "--enable-decode-to-prefill-reuse"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(router.stdout.readline())
        assert ready, "kv-reuse-router printed no ready line"
        with kv_reuse.RouterClient(nats.url, timeout_s=5.0) as client:
            # No prefill worker announced itself: the service refuses the
            # target, through the binary's real decoder and reply.
            with pytest.raises(kv_reuse.AdviseRefused, match="unknown target engine " + TARGET):
                client.advise("req-bin", [1, 2, 3], TARGET)
            with pytest.raises(kv_reuse.AdviseRefused, match="unknown target engine " + TARGET):
                client.advise_tokens("req-bin-tok", list(range(64)), 16, TARGET)
    finally:
        router.terminate()
        router.wait(timeout=15)
        router.stdout.close()
