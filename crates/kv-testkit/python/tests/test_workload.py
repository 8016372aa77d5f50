"""Workload tests: pure Python, no torch."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_serving.workload import Workload, WorkloadError, percentile  # noqa: E402


def test_default_buckets_and_sessions_reach_them():
    w = Workload()
    assert w.buckets() == [2048, 8192, 16384, 32768]
    sessions = w.build()
    assert len(sessions) == 8
    assert sorted({s.target_history for s in sessions}) == [2048, 8192, 16384, 32768]
    # The largest sessions start close enough to grow to ~32K in 6 turns.
    growth = 6 * (150 + 256 + 64 + 128) // 2
    assert max(len(s.history) for s in sessions) == 32768 - growth
    assert w.bucket_of(2200) == 2048 and w.bucket_of(2300) == 8192 and w.bucket_of(40000) == 32768


def test_rounds_interleave_sessions_and_respect_ranges():
    w = Workload(sessions=4, turns=3, history_max=4096, vocab=1000)
    sessions = w.build()
    rounds = list(w.rounds(sessions))
    assert len(rounds) == 12
    assert [t for t, *_ in rounds] == [0] * 4 + [1] * 4 + [2] * 4
    for t in range(3):
        assert sorted(s.id for tt, s, *_ in rounds if tt == t) == ["s0", "s1", "s2", "s3"]
    assert all(150 <= len(u) <= 256 and 64 <= g <= 128 for _, _, u, g in rounds)
    assert all(0 <= x < 1000 for _, _, u, _ in rounds for x in u)
    # Seeded: the same workload again gives the same turns.
    again = list(Workload(sessions=4, turns=3, history_max=4096, vocab=1000).rounds(sessions))
    assert [u for *_, u, _ in again] == [u for *_, u, _ in rounds]


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"sessions": 0}, "sessions"),
        ({"turns": 1}, "turns"),
        ({"turn_tokens": (10, 5)}, "turn_tokens"),
        ({"gen_tokens": (0, 5)}, "gen_tokens"),
        ({"history_max": 100}, "history_max"),
    ],
)
def test_bad_parameters_name_the_field(kw, field):
    with pytest.raises(WorkloadError) as e:
        Workload(**kw).build()
    assert e.value.field == field


def test_percentile_nearest_rank():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 99) == 5.0
    assert percentile(xs, 0) == 1.0
    assert percentile([], 50) is None
