"""The multi-turn workload and the history buckets.

Sessions are spread over four history sizes, fractions 1/16, 1/4, 1/2 and 1 of
``history_max`` (2K / 8K / 16K / 32K at ``history_max = 32768``): each starts
with a random context sized so that after ``turns`` turns of ``turn_tokens``
user tokens plus ``gen_tokens`` generated tokens its history ends near its
size. Rounds are interleaved: round t runs turn t of every session, in a
seeded random order. Token ids are seeded random ids below the vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import List, Optional, Tuple

FRACTIONS = (1 / 16, 1 / 4, 1 / 2, 1.0)


class WorkloadError(ValueError):
    """A workload parameter was refused; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass
class Session:
    """One conversation: its id, the final history size it aims at, its history so far."""

    id: str
    target_history: int
    history: List[int]


@dataclasses.dataclass(frozen=True)
class Workload:
    """Parameters (token counts; ranges inclusive)."""

    sessions: int = 8
    turns: int = 6
    history_max: int = 32768
    turn_tokens: Tuple[int, int] = (150, 256)
    gen_tokens: Tuple[int, int] = (64, 128)
    vocab: int = 128256
    seed: int = 0

    def validate(self) -> None:
        """Raises ``WorkloadError`` naming the first bad field."""
        if self.sessions < 1:
            raise WorkloadError("sessions", "at least 1")
        if self.turns < 2:
            raise WorkloadError("turns", "at least 2 (the first turn has no donor)")
        for name, (lo, hi) in (("turn_tokens", self.turn_tokens), ("gen_tokens", self.gen_tokens)):
            if not 1 <= lo <= hi:
                raise WorkloadError(name, f"range {lo}..{hi} is empty or below 1")
        if self.history_max < 16 * (self.turn_tokens[1] + self.gen_tokens[1]) // 4:
            raise WorkloadError("history_max", f"{self.history_max} is too small for the turn sizes")

    def buckets(self) -> List[int]:
        """Bucket upper edges in tokens (2K/8K/16K/32K at 32768)."""
        return [int(self.history_max * f) for f in FRACTIONS]

    def bucket_of(self, history: int) -> int:
        """The smallest bucket whose edge, plus 10 %, holds ``history`` (else the largest)."""
        for b in self.buckets():
            if history <= b * 1.1:
                return b
        return self.buckets()[-1]

    def build(self) -> List[Session]:
        """The sessions with their initial contexts."""
        self.validate()
        rng = random.Random(self.seed)
        growth = self.turns * (sum(self.turn_tokens) + sum(self.gen_tokens)) // 2
        out = []
        for i in range(self.sessions):
            target = int(self.history_max * FRACTIONS[i % len(FRACTIONS)])
            initial = max(self.turn_tokens[0], target - growth)
            out.append(Session(f"s{i}", target, [rng.randrange(self.vocab) for _ in range(initial)]))
        return out

    def rounds(self, sessions: List[Session]):
        """Yields (turn index, session, user-turn tokens, tokens to generate), interleaved."""
        rng = random.Random(self.seed + 1)
        for t in range(self.turns):
            order = list(sessions)
            rng.shuffle(order)
            for s in order:
                n = rng.randint(*self.turn_tokens)
                yield t, s, [rng.randrange(self.vocab) for _ in range(n)], rng.randint(*self.gen_tokens)


def percentile(xs: List[float], q: float) -> Optional[float]:
    """Nearest-rank percentile ``q`` in [0, 100] of ``xs`` (None when empty)."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]
