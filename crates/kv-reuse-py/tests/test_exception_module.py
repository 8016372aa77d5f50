"""The exceptions belong to ``kv_reuse``, where users import them from: a
traceback read ``kv_reuse._native.AdviseRefused: ...``, the path of the
compiled module. They still pickle (by the ``kv_reuse`` name) and are the
very classes ``kv_reuse`` exports."""

import pickle
import traceback

import pytest

import kv_reuse

TARGET = "00000000-0000-4000-8000-0000000000c1"


def public_classes():
    return [(n, getattr(kv_reuse, n)) for n in kv_reuse.__all__ if isinstance(getattr(kv_reuse, n), type)]


def test_every_public_class_and_exception_names_kv_reuse_as_its_module():
    errors = [n for n, c in public_classes() if issubclass(c, BaseException)]
    assert len(errors) == 14 and "AdviseRefused" in errors  # the whole set (docs/python.md, "Errors")
    assert [(n, c.__module__) for n, c in public_classes() if c.__module__ != "kv_reuse"] == []
    assert [n for n, c in public_classes() if c.__qualname__ != n] == []


def test_every_public_function_names_kv_reuse_as_its_module():
    functions = [(n, f) for n, f in ((n, getattr(kv_reuse, n)) for n in kv_reuse.__all__)
                 if callable(f) and not isinstance(f, type)]
    assert sorted(n for n, _ in functions) == sorted([
        "decode_kv_event", "encode_kv_event", "layer_group_ranges", "leak_counters",
        "reclaim_stale", "sequence_hashes"])
    assert [(n, f.__module__) for n, f in functions if f.__module__ != "kv_reuse"] == []
    assert pickle.loads(pickle.dumps(kv_reuse.sequence_hashes)) is kv_reuse.sequence_hashes


def test_an_exception_prints_and_pickles_as_kv_reuses():
    with pytest.raises(kv_reuse.BadArgument) as raised:
        kv_reuse.Layout(0, 2, 8, "f32", 64, 2)
    err = raised.value
    assert type(err) is kv_reuse.BadArgument
    assert traceback.format_exception_only(type(err), err) == [
        "kv_reuse.BadArgument: num_layers: 0 is not in 1..=4294967295\n"]
    assert repr(err) == "BadArgument('num_layers: 0 is not in 1..=4294967295')"
    for name, cls in public_classes():
        if not issubclass(cls, BaseException):
            continue
        # FetchFellBack carries (message, stage, cause label) as its args.
        made = cls("fell back", "pin", "pin_refused") if cls is kv_reuse.FetchFellBack else cls(f"a {name}")
        back = pickle.loads(pickle.dumps(made))
        assert type(back) is cls and back.args == made.args, name
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is kv_reuse.BadArgument and back.args == err.args
    assert isinstance(back, kv_reuse.KvReuseError)


def test_a_refusal_from_a_client_is_kv_reuses_advise_refused(nats):
    with kv_reuse.RouterClient(nats.url, timeout_s=1.0) as client:
        with pytest.raises(kv_reuse.AdviseRefused) as raised:
            client.advise("", [1], TARGET)  # refused before sending: an empty request_id
    err = raised.value
    assert kv_reuse.AdviseRefused is type(err)
    assert traceback.format_exception_only(type(err), err)[0].startswith("kv_reuse.AdviseRefused: ")
    assert type(pickle.loads(pickle.dumps(err))) is kv_reuse.AdviseRefused
