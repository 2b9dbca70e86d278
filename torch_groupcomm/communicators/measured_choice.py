"""A choice between two ways of running an op, made by timing both on a
group's first calls of each size class: which one is faster depends on the
machine (cores to spare for an extra copy, or a link that many streams
crowd), so it is measured where it runs rather than set from a rule.

Every rank makes the same calls in the same order, so each rank runs the
same way on each call; after the trials the group takes each way's best
time at its slowest rank (one small all-reduce: a call lasts until its last
rank is done) and every rank keeps the same way.
"""

from __future__ import annotations

import math
import time
from typing import Callable

# The first WARMUP calls of a class run untimed, alternating between the
# ways, then TRIALS: half on way 0, then half on way 1. Alternating trials
# read the flat all-to-all of 2 hosts of 2 ranks at 10 Gbit/s 2x-3x slower
# than it runs call after call (the other way's messages still on the link).
WARMUP = 2
TRIALS = 8
# Way 1 is the default: way 0 is kept only below this share of its time.
MARGIN = 0.9


class _SizeClass:
    __slots__ = ("calls", "best", "chosen")

    def __init__(self) -> None:
        self.calls = 0
        self.best = [math.inf, math.inf]
        self.chosen: int | None = None


class MeasuredChoice:
    """Per size class, way 0 or way 1, whichever the group timed faster
    (way 1 unless way 0 clearly was: ``MARGIN``).

    ``agree`` takes a list of two times to the group's slowest (every rank
    gets the same list); ``chosen`` hears of each class's choice once made.
    """

    def __init__(
        self,
        agree: Callable[[list[float]], list[float]],
        chosen: Callable[[int, int], None] = lambda size_class, way: None,
    ) -> None:
        self._agree = agree
        self._chosen = chosen
        self._classes: dict[int, _SizeClass] = {}

    def run(self, size_class: int, ways: tuple[Callable[[], None], Callable[[], None]]) -> None:
        """Run one of ``ways`` for a call of ``size_class``."""
        state = self._classes.setdefault(size_class, _SizeClass())
        if state.chosen is not None:
            ways[state.chosen]()
            return
        call = state.calls
        state.calls += 1
        # warm-up calls alternate; the trials run each way in a block, whose
        # first call is not timed (it may wait for the other way's last
        # messages still on the link)
        trial = call - WARMUP
        way = call % 2 if trial < 0 else trial * 2 // TRIALS
        start = time.perf_counter()
        ways[way]()
        took = time.perf_counter() - start
        if trial > 0 and trial != TRIALS // 2:
            state.best[way] = min(state.best[way], took)
        if state.calls == WARMUP + TRIALS:
            totals = self._agree(state.best)
            state.chosen = 0 if totals[0] < MARGIN * totals[1] else 1
            self._chosen(size_class, state.chosen)

    def choices(self) -> dict[int, int]:
        """The size classes decided so far, and their way."""
        return {c: s.chosen for c, s in self._classes.items() if s.chosen is not None}
