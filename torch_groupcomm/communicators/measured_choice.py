"""A choice between two ways of running an op, made by timing both on a
group's first calls of each size class: which one is faster depends on the
machine (cores to spare for an extra copy, or a link that many streams
crowd), so it is measured where it runs rather than set from a rule.

Every rank makes the same calls in the same order, so each rank runs the
same way on each call; after the trials the group sums each rank's best
time per way (one small all-reduce) and every rank keeps the same one.
"""

from __future__ import annotations

import math
import time
from typing import Callable

# The first WARMUP calls of a class run untimed, then TRIALS timed ones;
# both alternate between the ways, the first way first.
WARMUP = 2
TRIALS = 6
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

    ``agree`` sums a list of two times over the group's ranks (every rank
    gets the same sums); ``chosen`` hears of each class's choice once made.
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
        way = call % 2
        start = time.perf_counter()
        ways[way]()
        took = time.perf_counter() - start
        if call >= WARMUP:
            state.best[way] = min(state.best[way], took)
        if state.calls == WARMUP + TRIALS:
            totals = self._agree(state.best)
            state.chosen = 0 if totals[0] < MARGIN * totals[1] else 1
            self._chosen(size_class, state.chosen)

    def choices(self) -> dict[int, int]:
        """The size classes decided so far, and their way."""
        return {c: s.chosen for c, s in self._classes.items() if s.chosen is not None}
