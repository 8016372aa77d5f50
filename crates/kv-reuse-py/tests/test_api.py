"""Settings, hashes and refusals of bad input, in one process."""

import inspect
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import kv_reuse
from conftest import TOKENS_PER_BLOCK

# From kv_descriptor::sequence_hashes (Rust) for tokens [3, 10, 17, ...]
# (i * 7 + 3 for i in 0..40), printed by a Rust program.
GOLDEN = {
    4: [13907820230272612835, 2341016269666256101, 15763145379756034831,
        11211077233592904461, 18256284028764983410, 8580351062018703371,
        8182953225833106100, 8681733599673050835, 10672936405883033760,
        10265190568937748507],
    16: [15611300789162007147, 2993060222284537841],
}


def test_sequence_hashes_equal_the_rust_function():
    tokens = [i * 7 + 3 for i in range(40)]
    for tpb, want in GOLDEN.items():
        assert kv_reuse.sequence_hashes(tokens, tpb) == want
    # Chained: a longer prompt extends, a partial tail has no hash.
    assert kv_reuse.sequence_hashes(tokens[:19], 4) == GOLDEN[4][:4]


def test_sequence_hashes_refuse_zero_block_size():
    with pytest.raises(kv_reuse.BadArgument, match="tokens_per_block"):
        kv_reuse.sequence_hashes([1, 2], 0)


def test_settings_from_dict_env_and_argv_with_precedence():
    s = kv_reuse.Settings(
        {"minimum_transfer_prefix_blocks": 6},
        env={"KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS": "7"},
        argv=["--minimum-transfer-prefix-blocks", "8"],
    )
    value, origin = s.entries()["minimum_transfer_prefix_blocks"]
    assert value.startswith("8"), (value, origin)
    assert '"minimum_transfer_prefix_blocks":8' in s.to_json().replace(" ", "")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"values": {"no_such_key": 1}}, "no_such_key"),
        ({"values": {"minimum_transfer_prefix_blocks": "many"}}, "minimum_transfer_prefix_blocks"),
        ({"env": {"KV_REUSE_TRANSFER_SOURCE_PREFILL_TOKEN_US": "-1"}}, "transfer_source_prefill_token_us"),
        ({"argv": ["--no-such-flag"]}, "no-such-flag"),
    ],
)
def test_settings_refusals_name_the_key(kwargs, field):
    kwargs.setdefault("env", {})
    with pytest.raises(kv_reuse.SettingsRefused, match=field):
        kv_reuse.Settings(**kwargs)


@pytest.mark.parametrize(
    "values, error, named",
    [
        # A dotted key is one (unknown) key, not TOML's table `a` with key `b`.
        ({"a.b": 1}, kv_reuse.SettingsRefused, "unknown setting `a.b` (from values)"),
        # A key cannot smuggle in a setting: all of it is one unknown key.
        ({"enable_decode_to_prefill_reuse = true\nminimum_transfer_prefix_blocks": 6},
         kv_reuse.SettingsRefused,
         "unknown setting `enable_decode_to_prefill_reuse = true\nminimum_transfer_prefix_blocks`"),
        # Quotes, newlines and control characters stay inside the key's one string value.
        ({"minimum_transfer_prefix_blocks": '6"\nenable_decode_to_prefill_reuse = true\n"\x00\x7f'},
         kv_reuse.SettingsRefused, "for `minimum_transfer_prefix_blocks`: expected "),
        # NaN and infinities are TOML's `nan` / `inf`, refused by the registry by key.
        ({"transfer_source_prefill_token_us": float("nan")}, kv_reuse.SettingsRefused,
         "`transfer_source_prefill_token_us` = NaN is out of range"),
        ({"transfer_source_prefill_token_us": float("-inf")}, kv_reuse.SettingsRefused,
         "`transfer_source_prefill_token_us` = -inf is out of range"),
        # Past TOML's 64-bit integers: named, not an OverflowError.
        ({"minimum_transfer_prefix_blocks": 2**64}, kv_reuse.BadArgument,
         'values["minimum_transfer_prefix_blocks"]: is past the 64-bit integers of TOML'),
        ({"a\tb": [6]}, kv_reuse.BadArgument, 'values["a\\tb"]: must be bool, int, float or str'),
    ],
    ids=["dotted-key", "key-injection", "value-injection", "nan", "-inf", "int-past-64-bits", "list-value"],
)
def test_settings_dict_keys_and_values_are_refused_by_name(values, error, named):
    with pytest.raises(error, match=re.escape(named)):
        kv_reuse.Settings(values, env={})


def test_settings_dict_float_bool_and_int_values_load():
    s = kv_reuse.Settings({"transfer_source_prefill_token_us": 25.5,
                           "enable_decode_to_prefill_reuse": True,
                           "minimum_transfer_prefix_blocks": 3}, env={})
    entries = s.entries()
    assert entries["transfer_source_prefill_token_us"][0] == "25.5"
    assert entries["enable_decode_to_prefill_reuse"][0] == "true"
    assert entries["minimum_transfer_prefix_blocks"][0] == "3"


def test_negative_or_oversized_ints_are_refused_naming_the_argument(layout):
    bank = kv_reuse.DonorBank(layout, slots=4)
    store = bank.store(list(range(TOKENS_PER_BLOCK)))
    rows = np.zeros((1, layout.rank_block_elems), dtype=np.float32)
    target = kv_reuse.Target(layout, rows=4)
    settings = kv_reuse.Settings(env={})
    router = kv_reuse.Router(settings, TOKENS_PER_BLOCK)
    u32, u64 = r"0\.\.=4294967295", r"0\.\.=18446744073709551615"
    cases = [
        # An index names its object's bound, not its type's width.
        (lambda: store.write(-1, rows), rf"^rank: -1 is not below tp_size {layout.tp_size}$"),
        (lambda: store.write(2**32, rows), rf"^rank: 4294967296 is not below tp_size {layout.tp_size}$"),
        (lambda: store.write(2**70, rows), r"^rank: 1180591620717411303424 is not below tp_size"),
        (lambda: store.ack(-1), rf"^rank: -1 is not below tp_size {layout.tp_size}$"),
        (lambda: store.ack(layout.tp_size), rf"^rank: {layout.tp_size} is not below tp_size {layout.tp_size}$"),
        (lambda: bank.store([0] * (TOKENS_PER_BLOCK - 1) + [-5]), rf"^tokens\[{TOKENS_PER_BLOCK - 1}\]: -5 is not in {u32}$"),
        (lambda: bank.store([2**32] * TOKENS_PER_BLOCK), rf"^tokens\[0\]: 4294967296 is not in {u32}$"),
        (lambda: bank.slots([1, 2**64]), rf"^hashes\[1\]: 18446744073709551616 is not in {u64}$"),
        # Counts name their real range, not their type's.
        (lambda: kv_reuse.DonorBank(layout, slots=-1), r"^slots: -1 is not in 1\.\.=16777216$"),
        (lambda: kv_reuse.DonorBank(layout, slots=2, gpus=[0, -1]), rf"^gpus\[1\]: -1 is not in {u32}$"),
        (lambda: kv_reuse.sequence_hashes([1, -1], 4), rf"^tokens\[1\]: -1 is not in {u32}$"),
        (lambda: kv_reuse.sequence_hashes([1], -4), r"^tokens_per_block: -4 is not in 1\.\.=18446744073709551615$"),
        (lambda: target.fetch(b"", [1, -2], b""), rf"^prompt_hashes\[1\]: -2 is not in {u64}$"),
        (lambda: target.fetch(b"", [1], b"", dst_blocks=[0, -1]), rf"^dst_blocks\[1\]: -1 is not in {u32}$"),
        (lambda: target.fetch(b"", [1], b"", dst_token_offset=-64), rf"^dst_token_offset: -64 is not in {u64}$"),
        (lambda: target.read_row(-1, 0), rf"^rank: -1 is not below tp_size {layout.tp_size}$"),
        (lambda: target.read_row(0, -3), r"^row: -3 is not below rows 4$"),
        (lambda: target.read_row(0, 2**40), r"^row: 1099511627776 is not below rows 4$"),
        (lambda: kv_reuse.Target(layout, rows=2**32), r"^rows: 4294967296 is not in 1\.\.=4294967295$"),
        (lambda: kv_reuse.Layout(2, 2, -8, "f32", 64, 2), r"^head_dim: -8 is not in 1\.\.=4294967295$"),
        (lambda: kv_reuse.Router(settings, -64), r"^tokens_per_block: -64 is not in 1\.\.=4294967295$"),
        (lambda: kv_reuse.Router(settings, 0), r"^tokens_per_block: 0 is not in 1\.\.=4294967295$"),
        (lambda: kv_reuse.Router(settings, TOKENS_PER_BLOCK, max_probes=0), r"^max_probes: 0 is not in 1\.\.=4294967295$"),
        (lambda: router.register_worker(-1, bank.engine_id, "decode", layout), rf"^key: -1 is not in {u64}$"),
        # A worker whose blocks hash another block size could never match: refused, not silently off.
        (lambda: router.register_worker(9, bank.engine_id, "decode",
                                         kv_reuse.Layout(2, 2, 8, "f32", TOKENS_PER_BLOCK // 4, 2)),
         rf"^layout: {TOKENS_PER_BLOCK // 4} tokens per block, this router hashes blocks of {TOKENS_PER_BLOCK}$"),
        (lambda: router.report_donor(bank.manifest(), "unix:/x", {7: -1}), rf"^slots\[7\]: -1 is not in {u32}$"),
        # The bank has 4 slots (the fixture): slot 4 is past it.
        (lambda: router.report_donor(bank.manifest(), "unix:/x", {7: 3, 8: 4}), r"^slots\[8\]: 4 is past the manifest's 4 slots$"),
        (lambda: router.advise("r", [1, -1], target.engine_id), rf"^sequence_hashes\[1\]: -1 is not in {u64}$"),
        # A huge int is shown cut short.
        (lambda: target.fetch(b"", [10**100], b""),
         "^prompt_hashes\\[0\\]: " + re.escape(str(10**100)[:24] + "... (101 digits)") + f" is not in {u64}$"),
    ]
    for call, msg in cases:
        with pytest.raises(kv_reuse.BadArgument, match=msg):
            call()
    # Not an int at all: a TypeError, named too.
    with pytest.raises(TypeError, match=r"^rank: "):
        store.write("0", rows)
    with pytest.raises(TypeError, match=r"^prompt_hashes\[1\]: "):
        target.fetch(b"", [1, "x"], b"")
    # Nothing was half-done: in-range ints still store and look up.
    for rank in range(layout.tp_size):
        store.write(rank, rows)
    assert [store.ack(r) for r in range(layout.tp_size)] == [False, True]
    assert bank.slots(store.sequence_hashes) == [0]


@pytest.mark.parametrize("call", ["wait()", "wait_layer(3)"])
def test_ctrl_c_interrupts_a_stream_gate_wait_that_no_fetch_will_end(call):
    """A gate no fetch ever takes, waited on without ``timeout_s``, blocked
    forever, and a SIGINT could not stop it (the wait slept without the GIL
    and never ran signal handlers). Now it raises KeyboardInterrupt, as
    ``FetchJob.result`` does. In a subprocess, so a wait that never ends
    fails this test rather than hanging the suite; 10 s is only a bound for
    "does not hang"."""
    code = (
        "import sys, kv_reuse\n"
        "gate = kv_reuse.StreamGate(0, 0, layer_groups=4)\n"
        "print('waiting', flush=True)\n"
        f"gate.{call}\n"
        "print('returned', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "waiting\n"
        time.sleep(0.3)  # into the wait (an earlier SIGINT would raise as well)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0 and "returned" not in out, (out, err)
    assert err.rstrip().splitlines()[-1] == "KeyboardInterrupt", err


def test_stream_gate_refusals_name_the_argument_and_an_argument_error_ends_the_gate(layout):
    u32, u64 = r"0\.\.=4294967295", r"0\.\.=18446744073709551615"
    with pytest.raises(kv_reuse.BadArgument, match=rf"^stream: -1 is not in {u64}$"):
        kv_reuse.StreamGate(-1, 0)
    with pytest.raises(kv_reuse.BadArgument, match=rf"^device: 4294967296 is not in {u32}$"):
        kv_reuse.StreamGate(0, 2**32)
    gate = kv_reuse.StreamGate(0x1234, 3)
    assert (gate.stream, gate.device, gate.ended, gate.blocks) == (0x1234, 3, False, None)
    for bad in (0, -1, float("nan"), 3601):
        with pytest.raises(kv_reuse.BadArgument, match="^timeout_s: "):
            gate.wait(timeout_s=bad)
    # Not taken by a fetch yet: a bounded wait times out with False.
    started = time.monotonic()
    assert gate.wait(timeout_s=0.05) is False
    assert time.monotonic() - started >= 0.04
    # A fetch that fails on its arguments still ends the gate: a thread
    # waiting on it is released.
    target = kv_reuse.Target(layout, rows=4)
    with pytest.raises(kv_reuse.DescriptorRefused):
        target.fetch(b"", [1], b"", gate=gate)
    assert gate.ended and gate.wait() is False
    assert "ended=True" in repr(gate)


def test_layout_reads_back_what_it_was_given():
    l = kv_reuse.Layout(32, 8, 128, "bfloat16", 16, 2)
    assert (l.num_layers, l.num_kv_heads, l.heads_per_rank, l.head_dim, l.dtype, l.tokens_per_block, l.tp_size) \
        == (32, 8, 4, 128, "bf16", 16, 2)
    assert l.rank_block_bytes == 32 * 2 * 16 * 4 * 128 * 2
    assert repr(l) == "Layout(num_layers=32, num_kv_heads=8, head_dim=128, dtype='bf16', tokens_per_block=16, tp_size=2)"
    # The repr is the constructor call that makes the same layout.
    assert repr(eval(repr(l), {"Layout": kv_reuse.Layout})) == repr(l)


def test_layer_groups_are_checked_and_cut_like_the_backend(layout):
    assert [(r.start, r.stop) for r in kv_reuse.layer_group_ranges(10, 4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [r.start for r in kv_reuse.layer_group_ranges(32, 8)] == [0, 4, 8, 12, 16, 20, 24, 28]
    assert kv_reuse.layer_group_ranges(2, 8) == [range(0, 1), range(1, 2)]
    with pytest.raises(kv_reuse.BadArgument, match="^layers: "):
        kv_reuse.layer_group_ranges(-1, 2)
    for bad in (0, 1025, -3):
        with pytest.raises(kv_reuse.BadArgument, match="^layer_groups: "):
            kv_reuse.StreamGate(0x1234, 0, layer_groups=bad)
    # 1 (or None) is the whole fetch at once; wait_layer is then wait.
    assert kv_reuse.StreamGate(0x1234, 0, layer_groups=1).layer_groups is None
    gate = kv_reuse.StreamGate(0x1234, 0, layer_groups=4)
    assert gate.layer_groups == 4 and gate.groups_issued == [] and "layer_groups=4" in repr(gate)
    with pytest.raises(kv_reuse.BadArgument, match="^layer: "):
        gate.wait_layer(-1)
    # Not taken by a fetch: a bounded wait_layer times out with False.
    assert gate.wait_layer(0, timeout_s=0.05) is False
    # A fetch that fails on its arguments ends a layered gate too.
    target = kv_reuse.Target(layout, rows=4)
    with pytest.raises(kv_reuse.DescriptorRefused):
        target.fetch(b"", [1], b"", gate=gate)
    assert gate.ended and gate.wait_layer(3) is False and gate.wait() is False


def test_layer_group_ranges_refuses_what_a_stream_gate_refuses_and_never_aborts():
    # groups as StreamGate's layer_groups (1..=1024); 2**32 - 1 groups of
    # 2**32 - 1 layers once asked for a 34 GB Vec and aborted the process.
    for layers, groups, named in [(4, 0, "groups"), (4, 1025, "groups"), (0, 2, "layers"),
                                  (2**32 - 1, 2**32 - 1, "groups")]:
        with pytest.raises(kv_reuse.BadArgument, match=f"^{named}: "):
            kv_reuse.layer_group_ranges(layers, groups)
    assert len(kv_reuse.layer_group_ranges(2**32 - 1, 1024)) == 1024
    assert kv_reuse.layer_group_ranges(3, 1) == [range(0, 3)]


def test_layout_refuses_unknown_dtype():
    with pytest.raises(kv_reuse.BadArgument, match="dtype"):
        kv_reuse.Layout(2, 2, 8, "int7", TOKENS_PER_BLOCK, 2)


def test_read_row_past_the_rows_names_the_row_and_the_row_count(layout):
    # Not kv_bank's byte range: the row asked for and the target's rows.
    target = kv_reuse.Target(layout, rows=4)
    assert len(target.read_row(1, 3)) == layout.rank_block_bytes
    for row in (4, 5, 2**32 - 1):
        with pytest.raises(kv_reuse.BadArgument, match=rf"^row: {row} is not below rows 4$"):
            target.read_row(0, row)


def test_report_donor_refuses_an_endpoint_that_does_not_parse_naming_it(layout):
    # As serve_pins: a hint carrying it would only fail at the target's pin
    # exchange, as a fallback far from the call that took it.
    bank = kv_reuse.DonorBank(layout, slots=2)
    router = kv_reuse.Router(kv_reuse.Settings(env={}), TOKENS_PER_BLOCK)
    for endpoint, why in (("foo", r"^endpoint: endpoint \"foo\": scheme must be `unix:<path>` or `tcp:<host>:<port>`$"),
                          ("unix:", r"^endpoint: endpoint \"unix:\": socket path must hold 1\.\.=107 bytes$"),
                          ("unix:/" + "x" * 107, r"^endpoint: endpoint \"unix:/x+\": socket path must hold"),
                          ("tcp:10.0.0.1", r"^endpoint: endpoint \"tcp:10\.0\.0\.1\": `tcp:` needs `<host>:<port>`"),
                          # A relative socket path names another socket in each
                          # target's working directory (or none).
                          ("unix:rel/sock", r"^endpoint: endpoint \"unix:rel/sock\": socket path \"rel/sock\" is relative"),
                          ("unix:./pin.sock", r"^endpoint: endpoint \"unix:\./pin\.sock\": socket path \"\./pin\.sock\" is relative")):
        with pytest.raises(kv_reuse.BadArgument, match=why):
            router.report_donor(bank.manifest(), endpoint, {})
    # Endpoints that parse are taken (the donor need not be up yet): an
    # absolute socket path, with or without `unix:`, and `tcp:`.
    router.report_donor(bank.manifest(), "unix:/tmp/kv-reuse-not-listening.sock", {})
    router.report_donor(bank.manifest(), "/tmp/kv-reuse-not-listening.sock", {})
    router.report_donor(bank.manifest(), "tcp:10.0.0.1:7301", {})


def test_layout_refuses_every_invalid_count_as_bad_argument_naming_it():
    # A zero was DescriptorRefused while -1 was BadArgument: one class for
    # every invalid count, naming the argument.
    names = ["num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "tp_size"]
    good = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "tokens_per_block": 64, "tp_size": 2}
    for name in names:
        # A bool is an int to Python: True passed as 1 (`tp_size=True` made a TP-1 layout).
        # The range named is the real one: 0 is refused too.
        for bad, why in ((0, r"0 is not in 1\.\.=4294967295"), (-1, r"-1 is not in 1\.\.=4294967295"),
                         (2**32, r"4294967296 is not in 1\.\.=4294967295"),
                         (True, r"True is a bool, not an int"), (False, r"False is a bool, not an int")):
            kw = dict(good, **{name: bad})
            with pytest.raises(kv_reuse.BadArgument, match=rf"^{name}: {why}$"):
                kv_reuse.Layout(kw["num_layers"], kw["num_kv_heads"], kw["head_dim"], "f32",
                                kw["tokens_per_block"], kw["tp_size"])
    # A tp_size that does not divide the heads is that argument's refusal too.
    with pytest.raises(kv_reuse.BadArgument, match=r"^tp_size: num_kv_heads 3 is not divisible by tp_size 2"):
        kv_reuse.Layout(2, 3, 8, "f32", 64, 2)
    # Only the layout as a whole past kv_descriptor's size bound is a descriptor refusal.
    with pytest.raises(kv_reuse.DescriptorRefused, match="one rank's block part would be"):
        kv_reuse.Layout(2**31, 2, 2**31, "f32", 64, 2)


def test_a_bool_is_refused_for_every_single_int_argument_naming_it(layout):
    # One extraction helper takes every single int argument: a bool is
    # refused for all of them, not only Layout's counts.
    settings = kv_reuse.Settings(env={})
    bank = kv_reuse.DonorBank(layout, slots=2)
    target = kv_reuse.Target(layout, rows=2)
    router = kv_reuse.Router(settings, TOKENS_PER_BLOCK)
    cases = [
        ("rows", lambda: kv_reuse.Target(layout, rows=True)),
        ("slots", lambda: kv_reuse.DonorBank(layout, slots=True)),
        ("tokens_per_block", lambda: kv_reuse.Router(settings, True)),
        ("max_probes", lambda: kv_reuse.Router(settings, TOKENS_PER_BLOCK, max_probes=True)),
        ("key", lambda: router.register_worker(False, bank.engine_id, "decode", layout)),
        ("tokens_per_block", lambda: kv_reuse.sequence_hashes([1, 2], True)),
        ("rank", lambda: target.read_row(False, 0)),
        ("row", lambda: target.read_row(0, True)),
    ]
    for name, call in cases:
        with pytest.raises(kv_reuse.BadArgument, match=rf"^{name}: (True|False) is a bool, not an int$"):
            call()
    # The same calls with ints work.
    assert len(target.read_row(0, 1)) == layout.rank_block_bytes
    assert kv_reuse.Target(layout, rows=1).free_rows == 1


def test_seconds_arguments_refuse_bools_and_name_ints_past_a_float(layout):
    # One extraction helper (errors::seconds) takes every seconds argument:
    # a bool is a TypeError naming it, an int too large for a float is
    # +-infinity and the argument's range check names it (pyo3's own
    # extraction raised an unnamed OverflowError).
    gate = kv_reuse.StreamGate(0x1234, 3)
    target = kv_reuse.Target(layout, rows=2)
    bools = [
        ("lease_s", lambda: kv_reuse.DonorBank(layout, slots=2, lease_s=True)),
        ("store_timeout_s", lambda: kv_reuse.DonorBank(layout, slots=2, store_timeout_s=True)),
        ("timeout_s", lambda: gate.wait(timeout_s=True)),
        ("pin_timeout_s", lambda: target.fetch(b"", [1], b"", pin_timeout_s=False)),
    ]
    for name, call in bools:
        with pytest.raises(TypeError, match=rf"argument '{name}': (True|False) is a bool, not a number of seconds"):
            call()
    huge = [
        ("lease_s", lambda: kv_reuse.DonorBank(layout, slots=2, lease_s=10**400)),
        ("store_timeout_s", lambda: kv_reuse.DonorBank(layout, slots=2, store_timeout_s=-10**400)),
        ("timeout_s", lambda: gate.wait(timeout_s=10**400)),
    ]
    for name, call in huge:
        with pytest.raises(kv_reuse.BadArgument, match=rf"^{name}: -?inf is not in"):
            call()
    # Ints and floats in range still work, and None where it is allowed.
    assert gate.wait(timeout_s=0.01) is False
    bank = kv_reuse.DonorBank(layout, slots=2, lease_s=15, store_timeout_s=1)
    assert bank.manifest()


def test_slot_counts_host_ids_and_socket_paths_are_refused_naming_them(layout, tmp_path):
    # kv_bank named a slot count past MAX_SLOTS as `budget_bytes` and an empty
    # host id as `location.host_id`; a NUL in a socket path failed late as
    # PinServiceFailed. Each is now BadArgument naming the argument.
    for slots in (0, 2**24 + 1, 2**40):
        with pytest.raises(kv_reuse.BadArgument, match=rf"^slots: {slots} is not in 1\.\.=16777216$"):
            kv_reuse.DonorBank(layout, slots=slots)
    for host, why in (("", "must be 1..=255 bytes, got 0"), ("h" * 256, "must be 1..=255 bytes, got 256"),
                      ("a\x00b", "holds a control character"), ("a\nb", "holds a control character")):
        with pytest.raises(kv_reuse.BadArgument, match=rf"^host_id: (.* )?{re.escape(why)}$"):
            kv_reuse.DonorBank(layout, slots=2, host_id=host)
    bank = kv_reuse.DonorBank(layout, slots=2, host_id="h" * 255)
    with pytest.raises(kv_reuse.BadArgument, match=r"socket path holds a NUL byte"):
        bank.serve_pins(f"unix:{tmp_path}/p\x00.sock")


def test_store_refuses_wrong_dtype_shape_strides_and_non_arrays(layout):
    # Bank and store are locals (not fixture values, which pytest keeps
    # until after the leak check), so they are gone when the test returns.
    bank = kv_reuse.DonorBank(layout, slots=4)
    store = bank.store(list(range(TOKENS_PER_BLOCK * 2)))
    n = layout.rank_block_elems
    with pytest.raises(kv_reuse.BadArgument, match=r"blocks: dtype <f8"):
        store.write(0, np.zeros((2, n), dtype=np.float64))
    with pytest.raises(kv_reuse.BadArgument, match=r"blocks: shape \[3, %d\]" % n):
        store.write(0, np.zeros((3, n), dtype=np.float32))
    with pytest.raises(kv_reuse.BadArgument, match="blocks: strides"):
        store.write(0, np.zeros((n, 2), dtype=np.float32).T)
    with pytest.raises(kv_reuse.BadArgument, match="blocks: has no __array_interface__"):
        store.write(0, [[0.0] * n] * 2)
    with pytest.raises(kv_reuse.BadArgument, match="rank"):
        store.write(layout.tp_size, np.zeros((2, n), dtype=np.float32))
    # A refused write left nothing half-done: the right arrays still store.
    for rank in range(layout.tp_size):
        store.write(rank, np.ones((2, n), dtype=np.float32))
    assert [store.ack(r) for r in range(layout.tp_size)] == [False, True]
    assert bank.slots(store.sequence_hashes) != [None, None]


def test_store_refuses_a_partial_block(layout):
    bank = kv_reuse.DonorBank(layout, slots=2)
    with pytest.raises(kv_reuse.BadArgument, match="tokens"):
        bank.store(list(range(TOKENS_PER_BLOCK - 1)))


def test_a_forged_hint_is_refused_as_a_descriptor(layout):
    target = kv_reuse.Target(layout, rows=4)
    with pytest.raises(kv_reuse.DescriptorRefused):
        target.fetch(b"\x81\xa1x\x01", [1, 2], b"\x80")
    assert issubclass(kv_reuse.DescriptorRefused, kv_reuse.KvReuseError)


def test_pin_server_is_a_context_manager_and_refuses_a_bad_endpoint(layout, tmp_path):
    bank = kv_reuse.DonorBank(layout, slots=2)
    with bank.serve_pins("unix:" + str(tmp_path / "p.sock")) as server:
        assert server.endpoint.endswith("p.sock")
    assert server.endpoint is None and server.active_pins == 0
    server.close()  # idempotent
    # `match`, not `as e`: a kept traceback would hold this frame (and the
    # bank) past the leak check.
    # TCP pins need a pre-shared key this API does not take: an argument
    # error naming it, not the pin service's refusal naming `auth_key`.
    with pytest.raises(kv_reuse.BadArgument, match=r'^endpoint: "tcp://10\.0\.0\.1:9": TCP pin endpoints are not served from Python'):
        bank.serve_pins("tcp://10.0.0.1:9")
    # An endpoint that does not parse is an argument error, named, before anything binds.
    with pytest.raises(kv_reuse.BadArgument, match=r"^endpoint: endpoint \"foo\": scheme must be"):
        bank.serve_pins("foo")
    # So is a relative socket path (targets would look for it in their own
    # working directory): nothing is bound under this process's.
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        with pytest.raises(kv_reuse.BadArgument, match=r"^endpoint: endpoint \"unix:rel\.sock\": socket path \"rel\.sock\" is relative"):
            bank.serve_pins("unix:rel.sock")
        assert not os.path.exists("rel.sock")
    finally:
        os.chdir(cwd)


def test_reclaim_and_lease_refusals_name_the_argument(layout):
    with pytest.raises(kv_reuse.BadArgument, match="prefix"):
        kv_reuse.reclaim_stale("a/b")
    with pytest.raises(kv_reuse.BadArgument, match="prefix"):
        kv_reuse.reclaim_stale("")
    with pytest.raises(kv_reuse.BadArgument, match=r"^prefix: must be non-empty without `/` or control characters, got"):
        kv_reuse.reclaim_stale("kvbank\x00")
    with pytest.raises(kv_reuse.BadArgument, match=r"lease_s: 0.01 is not in"):
        kv_reuse.DonorBank(layout, slots=2, lease_s=0.01)
    # A live bank of this process is never reclaimed.
    bank = kv_reuse.DonorBank(layout, slots=2, lease_s=0.2)
    time.sleep(0.5)
    assert kv_reuse.reclaim_stale(f"kvbank-{os.getpid()}-") == []
    assert bank.manifest()
    del bank


def bank_failed(call):
    """The message of the ``BankFailed`` that ``call()`` raises (the message
    only: an ExceptionInfo kept in a frame would hold the bank past the leak
    check)."""
    try:
        call()
    except kv_reuse.BankFailed as e:
        return str(e)
    raise AssertionError("BankFailed not raised")


def test_a_write_after_store_timeout_s_is_refused_naming_it(layout):
    """A ``write`` once ``store_timeout_s`` passed copied into a store that
    could never complete (only the next ``ack`` raised, quoting the time
    that passed, ``timed out after 600 ms``, not the 200 ms setting). It is
    refused now, without copying, and rolls the store back; the messages
    name the store and ``store_timeout_s``, also for a store that a later
    ``store()`` swept (kv_bank forgot it)."""
    one = np.ones((1, layout.rank_block_elems), dtype=np.float32)
    bank = kv_reuse.DonorBank(layout, slots=2, store_timeout_s=0.2)
    store = bank.store(list(range(TOKENS_PER_BLOCK)))
    store.write(0, one)  # in time
    time.sleep(0.6)
    msg = bank_failed(lambda: store.write(1, one))
    assert re.fullmatch(r"store (\d+) timed out: store_timeout_s=0\.2 passed before every rank acked "
                        r"\(ranks \[0, 1\] had not; \d+ ms since `store`\); it was rolled back, "
                        r"`write` refused", msg), msg
    assert int(msg.split()[1]) > 0
    stats = bank.stats
    assert (stats["store_bytes_from_host"], stats["stores_rolled_back"]) == (layout.rank_block_bytes, 1)
    timed_out = r"store \d+ timed out: store_timeout_s=0\.2 passed before every rank acked; it was rolled back, "
    assert re.fullmatch(timed_out + "`ack` refused", bank_failed(lambda: store.ack(0)))
    assert bank.slots(store.sequence_hashes) == [None]
    # Swept by a later `store` (it runs kv_bank's expiry): the same words.
    swept = bank.store(list(range(TOKENS_PER_BLOCK, 2 * TOKENS_PER_BLOCK)))
    time.sleep(0.6)
    bank.store(list(range(2 * TOKENS_PER_BLOCK, 3 * TOKENS_PER_BLOCK))).abort()
    assert re.fullmatch(timed_out + "`write` refused", bank_failed(lambda: swept.write(0, one)))
    assert bank.stats["store_bytes_from_host"] == layout.rank_block_bytes


def test_store_timeout_is_the_donors_choice_and_refused_out_of_range(layout):
    with pytest.raises(kv_reuse.BadArgument, match=r"store_timeout_s: 0 is not in"):
        kv_reuse.DonorBank(layout, slots=2, store_timeout_s=0)
    n = layout.rank_block_elems
    bank = kv_reuse.DonorBank(layout, slots=2, store_timeout_s=0.05)
    store = bank.store(list(range(TOKENS_PER_BLOCK)))
    for rank in range(layout.tp_size):
        store.write(rank, np.ones((1, n), dtype=np.float32))
    time.sleep(0.3)
    # Past its 50 ms the store is rolled back: nothing is published.
    with pytest.raises(kv_reuse.BankFailed, match="timed out"):
        for rank in range(layout.tp_size):
            store.ack(rank)
    assert bank.slots(store.sequence_hashes) == [None]
    # The same store within a generous timeout publishes.
    bank = kv_reuse.DonorBank(layout, slots=2, store_timeout_s=30.0)
    store = bank.store(list(range(TOKENS_PER_BLOCK)))
    for rank in range(layout.tp_size):
        store.write(rank, np.ones((1, n), dtype=np.float32))
    time.sleep(0.3)
    assert [store.ack(r) for r in range(layout.tp_size)][-1] is True
    assert bank.slots(store.sequence_hashes) != [None]


def test_kv_event_codec_round_trips_a_donor_event_and_names_bad_json(layout):
    import json

    bank = kv_reuse.DonorBank(layout, slots=4)
    st = bank.store(list(range(TOKENS_PER_BLOCK * 2)))
    for r in range(layout.tp_size):
        st.write(r, np.zeros((2, layout.rank_block_elems), dtype=np.float32))
        st.ack(r)
    (ev,) = bank.drain_events()
    fields = json.loads(kv_reuse.decode_kv_event(ev))
    assert fields["publisher"] == bank.engine_id and fields["tier"] == "retained_gpu_direct"
    assert [b["slot"] for b in fields["data"]["stored"]["blocks"]] == [0, 1]
    assert kv_reuse.encode_kv_event(json.dumps(fields)) == ev
    with pytest.raises(kv_reuse.BadArgument, match="event_json"):
        kv_reuse.encode_kv_event(json.dumps({**fields, "publisher": "not-a-uuid"}))
    with pytest.raises(kv_reuse.DescriptorRefused):
        kv_reuse.decode_kv_event(ev[:-1])


def test_an_ack_without_writes_is_refused_and_never_publishes_the_evicted_blocks_kv(layout, enabled, tmp_path):
    """A rank's ack is checked, not trusted: store A (5.0) fills the bank,
    store B evicts A's slots, and acking B without writing it would publish
    A's KV under B's sequence hashes (a cross-request leak)."""
    import json

    from test_store import rows_for

    n = layout.rank_block_elems
    bank = kv_reuse.DonorBank(layout, slots=4)
    a = bank.store(list(range(TOKENS_PER_BLOCK * 4)))
    for r in range(layout.tp_size):
        a.write(r, np.full((4, n), 5.0, np.float32))
    assert [a.ack(r) for r in range(layout.tp_size)] == [False, True]
    b_tokens = list(range(1000, 1000 + TOKENS_PER_BLOCK * 4))
    b_hashes = kv_reuse.sequence_hashes(b_tokens, TOKENS_PER_BLOCK)
    b = bank.store(b_tokens)  # evicts A's 4 slots
    assert b.sequence_hashes == b_hashes
    for r in range(layout.tp_size):
        # The message names what a Python caller calls (write, abort), not
        # kv_bank's Rust calls (write_pending, fail) or arguments (index).
        with pytest.raises(kv_reuse.BankFailed,
                           match=rf"^store \d+: `rank` {r} acked with 4 unwritten rows \(first: row 0 of "
                                 rf"`blocks`\); `write\({r}, blocks\)` before acking, or `abort\(\)` the store$"):
            b.ack(r)
    # The router is never told: A's Stored and Removed only, no Stored event
    # for B, and B is not in the bank.
    raw = bank.drain_events()
    events = [json.loads(kv_reuse.decode_kv_event(e)) for e in raw]
    assert [list(e["data"]) for e in events] == [["stored"], ["removed"]], events
    assert bank.slots(b_hashes) == [None] * 4
    assert bank.stats["stores_ready"] == 1
    endpoint = "unix:" + str(tmp_path / "pin.sock")
    caches = [np.full((16, n), -1.0, dtype=np.float32) for _ in range(layout.tp_size)]
    with bank.serve_pins(endpoint):
        target = kv_reuse.Target(layout, rows=16, kv_caches=caches)
        router = kv_reuse.Router(enabled, TOKENS_PER_BLOCK)
        router.register_worker(1, bank.engine_id, "decode", layout)
        router.register_worker(2, target.engine_id, "prefill", layout)
        for e in raw:
            router.apply_event(e)
        router.report_donor(bank.manifest(), endpoint, {})
        assert not router.advise("req-b", b_hashes, target.engine_id).admitted

        # The store stayed pending: rank 0 writes and acks, rank 1 is still refused.
        b.write(0, rows_for(layout, 0, range(4)))
        assert b.ack(0) is False
        # Rank 0 acked: its part is sealed, a second write is refused.
        with pytest.raises(kv_reuse.BankFailed,
                           match=r"^store \d+: `rank` 0 already acked, its rows are sealed \(`write` refused\)$"):
            b.write(0, np.full((4, n), 7.0, np.float32))
        with pytest.raises(kv_reuse.BankFailed, match=r"`rank` 1 acked with 4 unwritten rows"):
            b.ack(1)
        assert bank.drain_events() == []
        # Once rank 1 wrote, its ack publishes B, and a fetch returns B's own KV.
        b.write(1, rows_for(layout, 1, range(4)))
        assert b.ack(1) is True
        for e in bank.drain_events():
            router.apply_event(e)
        router.report_donor(bank.manifest(), endpoint, dict(zip(b_hashes, bank.slots(b_hashes))))
        advice = router.advise("req-b2", b_hashes, target.engine_id)
        assert advice.admitted, advice
        with target.fetch(advice.hint, b_hashes, bank.manifest()) as out:
            assert len(out.rows) == 4
            for r in range(layout.tp_size):
                for block, row in enumerate(out.rows):
                    assert caches[r][row].tobytes() == rows_for(layout, r, [block])[0].tobytes(), (r, block)


def test_layouts_are_values_equal_and_hashed_by_their_arguments():
    a = kv_reuse.Layout(2, 2, 8, "f32", 64, 2)
    b = kv_reuse.Layout(2, 2, 8, "float32", 64, 2)  # the same dtype by its other name
    assert a == b and not (a != b) and hash(a) == hash(b)
    assert len({a, b}) == 1 and {a: "x"}[b] == "x"
    for other in (kv_reuse.Layout(2, 2, 8, "f32", 64, 1), kv_reuse.Layout(2, 2, 8, "bf16", 64, 2),
                  kv_reuse.Layout(3, 2, 8, "f32", 64, 2), kv_reuse.Layout(2, 2, 8, "f32", 32, 2)):
        assert a != other and not (a == other)
    assert a != "Layout(2, 2, 8, 'f32', 64, 2)" and a != None  # noqa: E711


def test_serve_pins_never_removes_a_file_that_is_not_a_socket(layout, tmp_path):
    # A mistyped endpoint naming someone's file deleted it (helper-22 finding 3).
    bank = kv_reuse.DonorBank(layout, slots=2)
    config = tmp_path / "config.yaml"
    config.write_text("keep: me\n")
    sub = tmp_path / "dir"
    sub.mkdir()
    link = tmp_path / "link.sock"
    link.symlink_to(config)
    for path, found in ((config, "regular file"), (sub, "directory"), (link, "symbolic link")):
        endpoint = f"unix:{path}"
        why = f"pin service endpoint {endpoint}: {path} is a {found}, not a socket; refusing to replace it"
        with pytest.raises(kv_reuse.PinServiceFailed, match=re.escape(why)):
            bank.serve_pins(endpoint)
    assert config.read_text() == "keep: me\n" and sub.is_dir() and link.is_symlink()
    # A stale socket (nobody accepts on it) is still replaced.
    import socket
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    with bank.serve_pins(f"unix:{stale}") as server:
        assert server.endpoint == f"unix:{stale}"
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(stale))
        probe.close()


def test_nats_urls_buckets_and_namespaces_are_refused_naming_them_before_connecting(layout):
    # Each was a RouterUnavailable / PublishFailed, or named another argument.
    url, uuid = "nats://127.0.0.1:1", "00000000-0000-4000-8000-000000000001"
    for bad, why in (("", "is empty"), ("http://x", "")):
        with pytest.raises(kv_reuse.BadArgument, match="^nats_url: " + re.escape(f'"{bad}": {why}')):
            kv_reuse.RouterClient(bad)
        with pytest.raises(kv_reuse.BadArgument, match="^nats_url: "):
            kv_reuse.DonorDirectory(bad)
        with pytest.raises(kv_reuse.BadArgument, match="^nats_url: "):
            kv_reuse.WorkerPublisher.target(bad, "p", layout, uuid)
        with pytest.raises(kv_reuse.BadArgument, match="^nats_url: "):
            kv_reuse.WorkerPublisher.donor(bad, "d", layout, 4, "unix:/tmp/x.sock")
    # A password in a refused URL is not echoed.
    with pytest.raises(kv_reuse.BadArgument, match=r'^nats_url: "http://u:\*\*\*@x"') as info:
        kv_reuse.RouterClient("http://u:s3cret@x")
    assert "s3cret" not in str(info.value)
    del info
    with pytest.raises(kv_reuse.BadArgument, match=r'^namespace: invalid subject `namespace` token "a\.b"'):
        kv_reuse.WorkerPublisher.donor(url, "d", layout, 4, "unix:/tmp/x.sock", namespace="a.b")
    with pytest.raises(kv_reuse.BadArgument, match=r'^namespace: invalid subject `namespace` token "a\.b"'):
        kv_reuse.WorkerPublisher.target(url, "p", layout, uuid, namespace="a.b")
    with pytest.raises(kv_reuse.BadArgument, match=r'^worker_key: "d\.x" is not one NATS subject token'):
        kv_reuse.WorkerPublisher.donor(url, "d.x", layout, 4, "unix:/tmp/x.sock")
    only = "may hold only ASCII letters, digits, `_` and `-`"
    for bucket, why in (("a.b", only), ("a b", only), ("", "is empty")):
        with pytest.raises(kv_reuse.BadArgument, match="^bucket: " + re.escape(f'"{bucket}": {why}') + "$"):
            kv_reuse.WorkerPublisher.donor(url, "d", layout, 4, "unix:/tmp/x.sock", bucket=bucket)
        with pytest.raises(kv_reuse.BadArgument, match="^bucket: " + re.escape(f'"{bucket}": {why}') + "$"):
            kv_reuse.DonorDirectory(url, bucket=bucket)


def test_every_count_names_the_range_it_really_takes():
    """A count that must be at least 1 (or has a cap) said the range of its
    type: ``Layout(-1, ...)`` ``num_layers: -1 is not in 0..=4294967295``
    though 0 is refused too, ``DonorBank(slots=-1)`` ``not in
    0..=18446744073709551615`` though slots are 1..=16777216,
    ``layer_group_ranges(-1, 4)`` the same. Each names its real range for
    every value outside it: negative, zero, past the cap, past the type."""
    layout = kv_reuse.Layout(2, 2, 8, "f32", TOKENS_PER_BLOCK, 2)
    u32 = r"1\.\.=4294967295"
    cases = [
        (lambda: kv_reuse.Layout(-1, 2, 8, "f32", 64, 2), rf"^num_layers: -1 is not in {u32}$"),
        (lambda: kv_reuse.Layout(2, 2, 8, "f32", 2**40, 2), rf"^tokens_per_block: 1099511627776 is not in {u32}$"),
        (lambda: kv_reuse.DonorBank(layout, slots=-1), r"^slots: -1 is not in 1\.\.=16777216$"),
        (lambda: kv_reuse.DonorBank(layout, slots=0), r"^slots: 0 is not in 1\.\.=16777216$"),
        (lambda: kv_reuse.DonorBank(layout, slots=2**64), r"^slots: 18446744073709551616 is not in 1\.\.=16777216$"),
        (lambda: kv_reuse.layer_group_ranges(-1, 4), rf"^layers: -1 is not in {u32}$"),
        (lambda: kv_reuse.layer_group_ranges(0, 4), rf"^layers: 0 is not in {u32}$"),
        (lambda: kv_reuse.layer_group_ranges(4, -1), r"^groups: -1 is not in 1\.\.=1024$"),
        (lambda: kv_reuse.StreamGate(0, 0, layer_groups=-1), r"^layer_groups: -1 is not in 1\.\.=1024$"),
        (lambda: kv_reuse.sequence_hashes([1], 0), r"^tokens_per_block: 0 is not in 1\.\.=18446744073709551615$"),
        (lambda: kv_reuse.Target(layout, rows=-1), rf"^rows: -1 is not in {u32}$"),
        (lambda: kv_reuse.Target(layout, rows=0), rf"^rows: 0 is not in {u32}$"),
        (lambda: kv_reuse.Router(kv_reuse.Settings(env={}), 64, max_probes=-1), rf"^max_probes: -1 is not in {u32}$"),
        (lambda: kv_reuse.RouterClient("nats://127.0.0.1:1", busy_poll_us=-1),
         r"^busy_poll_us: -1 is not in 0\.\.=1000000$"),
        (lambda: kv_reuse.RouterClient("nats://127.0.0.1:1", busy_poll_us=10**6 + 1),
         r"^busy_poll_us: 1000001 is not in 0\.\.=1000000$"),
        (lambda: kv_reuse.WorkerPublisher.donor("nats://127.0.0.1:1", "d", layout, 4, "unix:/tmp/kv-none.sock",
                                                event_ring=-1),
         r"^event_ring: -1 is not in 1\.\.=18446744073709551615$"),
    ]
    for call, want in cases:
        with pytest.raises(kv_reuse.BadArgument, match=want):
            call()


def test_a_str_where_ints_are_due_says_so():
    """``sequence_hashes("abcd", 2)`` (a prompt's text for its token ids)
    said ``tokens: Can't extract 'str' to 'Vec'``."""
    with pytest.raises(TypeError, match=r"^tokens: must be a sequence of ints, not str$"):
        kv_reuse.sequence_hashes("abcd", 2)
    layout = kv_reuse.Layout(2, 2, 8, "f32", TOKENS_PER_BLOCK, 2)
    bank = kv_reuse.DonorBank(layout, slots=2)
    with pytest.raises(TypeError, match=r"^hashes: must be a sequence of ints, not str$"):
        bank.slots("12")
    # Other non-sequences keep their own words, naming the argument.
    with pytest.raises(TypeError, match=r"^tokens: "):
        kv_reuse.sequence_hashes(7, 2)


def test_register_worker_names_role_name_as_the_caller_wrote_it():
    router = kv_reuse.Router(kv_reuse.Settings(env={}), TOKENS_PER_BLOCK)
    layout = kv_reuse.Layout(2, 2, 8, "f32", TOKENS_PER_BLOCK, 2)
    engine = "00000000-0000-4000-8000-000000000009"
    with pytest.raises(kv_reuse.BadArgument, match=r"^role_name: `x` is not decode or prefill$"):
        router.register_worker(1, engine, role_name="x", layout=layout)


def test_a_target_too_large_to_allocate_names_rows_and_the_bytes():
    """``Target(layout, 2**31)`` said ``BankFailed: host memory: allocation
    of 17592186044416 bytes failed``, naming no argument. 2**31 rows of
    32 MiB blocks need 64 PiB, past any address space, so the allocation
    fails whatever the host's overcommit policy."""
    big = kv_reuse.Layout(64, 8, 128, "f32", 64, 1)
    assert big.rank_block_bytes == 2**25
    with pytest.raises(kv_reuse.BankFailed) as e:
        kv_reuse.Target(big, rows=2**31)
    msg = str(e.value)
    del e
    assert msg.startswith(f"rows: {2**31} rows of {2**25} bytes on each of 1 TP ranks need {2**56} bytes "
                          "of host memory"), msg
    assert "lower `rows` or pass the engine's `kv_caches`" in msg, msg


def _stub():
    import ast

    path = os.path.join(os.path.dirname(kv_reuse.__file__), "_native.pyi")
    return ast.parse(open(path, encoding="utf-8").read())


def test_the_stubs_declare_every_public_attribute_of_the_native_classes():
    """``_native.pyi`` lacked ``FetchOutcome.stages_us`` (there at run
    time): every public name of the module and every public attribute of
    its classes is declared."""
    import ast

    from kv_reuse import _native

    tree = _stub()
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    top |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    top |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    missing = []
    for name in dir(_native):
        if name.startswith("_"):
            continue
        if name not in top:
            missing.append(name)
            continue
        cls = getattr(_native, name)
        if isinstance(cls, type) and not issubclass(cls, BaseException):
            declared = {f.name for f in classes[name].body if isinstance(f, ast.FunctionDef)}
            missing += [f"{name}.{a}" for a in vars(cls) if not a.startswith("_") and a not in declared]
    assert missing == []


def test_signatures_show_the_defaults_the_stubs_declare():
    """``inspect.signature(RouterClient)`` showed ``subject=Ellipsis`` and
    ``Router`` ``max_probes=None`` where the stubs say ``"kv_reuse.advise"``
    and 16384 (also ``busy_poll_us``, ``event_ring``, ``first_block``):
    every default the run-time signature shows is the stub's."""
    import ast
    import inspect

    from kv_reuse import _native

    def defaults(fn):
        a = fn.args
        pos = a.posonlyargs + a.args
        out = dict(zip([p.arg for p in pos[len(pos) - len(a.defaults):]], map(ast.literal_eval, a.defaults)))
        out.update((p.arg, ast.literal_eval(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)
        return out

    compared, wrong = 0, []
    for node in _stub().body:
        if isinstance(node, ast.FunctionDef):
            pairs = [(node.name, getattr(_native, node.name), node)]
        elif isinstance(node, ast.ClassDef) and not issubclass(getattr(_native, node.name), BaseException):
            cls = getattr(_native, node.name)
            pairs = [(f"{node.name}.{f.name}", cls if f.name == "__init__" else getattr(cls, f.name), f)
                     for f in node.body if isinstance(f, ast.FunctionDef)]
        else:
            continue
        for name, obj, fn in pairs:
            try:
                params = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                continue  # a property or a slot wrapper
            for p, want in defaults(fn).items():
                if p in params and params[p].default is not inspect.Parameter.empty:
                    compared += 1
                    if params[p].default != want:
                        wrong.append((name, p, want, params[p].default))
    assert wrong == []
    assert compared > 20  # the comparison found the signatures
    client = inspect.signature(kv_reuse.RouterClient).parameters
    assert (client["subject"].default, client["busy_poll_us"].default) == ("kv_reuse.advise", 0)
    assert inspect.signature(kv_reuse.Router).parameters["max_probes"].default == 16384
    # None still means the default, and a non-int is named once.
    kv_reuse.Router(kv_reuse.Settings(env={}), TOKENS_PER_BLOCK, max_probes=None)
    with pytest.raises(TypeError, match=r"^argument 'max_probes': 'str' object cannot be interpreted as an integer$"):
        kv_reuse.Router(kv_reuse.Settings(env={}), TOKENS_PER_BLOCK, max_probes="16")


def test_no_docstring_python_shows_carries_rust_internals():
    # help() showed a review note ("helper-22 finding 1"), rustdoc links
    # ("[`DonorDirectory::close`]") and Rust module paths (crate::...): the
    # Rust doc comments of pyo3 items are the Python docstrings.
    internal = re.compile(r"helper-\d|\bfinding \d|\[`[^`]+`\](?!\()|crate::")
    hits = []
    for name in dir(kv_reuse):
        obj = getattr(kv_reuse, name)
        items = [(name, obj)]
        if inspect.isclass(obj):
            items += [(f"{name}.{a}", getattr(obj, a, None)) for a in vars(obj)
                      if not a.startswith("__") or a == "__init__"]
        for shown, item in items:
            doc = getattr(item, "__doc__", None)
            if isinstance(doc, str) and internal.search(doc):
                hits.append((shown, internal.findall(doc)))
    assert hits == []
