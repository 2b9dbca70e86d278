"""CPU steal: the time a hypervisor gave this machine's cores to other guests
while they had work to do.

On a shared VM a timed round that loses its cores to a neighbour takes
longer for reasons neither backend controls; the two backends' rounds
alternate, but a burst that lands on a few rounds still moves a median.
The bench reports each row's steal next to its times so that a reader can
tell a cell measured on a quiet machine from one measured on a busy one.
Linux only (``/proc/stat``); elsewhere nothing is reported.
"""

from __future__ import annotations

from pathlib import Path

_STAT = Path("/proc/stat")
_STEAL_FIELD = 8  # "cpu user nice system idle iowait irq softirq steal ..."


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, all) CPU time of every core since boot, in clock ticks; None
    where ``/proc/stat`` has no steal field."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) <= _STEAL_FIELD or fields[0] != "cpu":
        return None
    # guest time is already counted in user and nice: the first 8 fields are all of it
    ticks = [int(f) for f in fields[1 : _STEAL_FIELD + 1]]
    return ticks[-1], sum(ticks)


def share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The fraction of the cores' time between two ``cpu_ticks()`` readings
    that was stolen; None without both readings or with no time between."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
