"""The critical path of a simulated pipeline: what the iteration actually waited for.

Starting from the op that ends last, follow each op's *cause* (the
predecessor, or the op before it on its stream, whose end let it start) back
to the beginning. The path's time splits into compute on stages and transfers
between them; their shares say at a glance whether a device or a link is the
bottleneck, which busy/idle figures alone cannot (under 1F1B on a slow link
every device idles while the links hold the iteration back).
"""

from __future__ import annotations

from collections import defaultdict

from potluck.sim.engine import Timings
from potluck.sim.program import MARKER, OpInfo
from potluck.sim.result import PathShare, ShareKind


def critical_path(info: list[OpInfo], owner: list[int], timings: Timings,
                  position: int) -> tuple[PathShare, ...]:
    """Shares of the critical path of pipeline ``position`` of a program, largest first."""
    ops = [op for op in range(len(info)) if owner[op] == position and info[op].kind is not MARKER]
    op = max(ops, key=lambda o: timings.end_s[o])
    totals: dict[tuple[ShareKind, int, int], float] = defaultdict(float)
    while op >= 0:
        what = info[op]
        cause = timings.cause[op]
        if what.kind is not MARKER:
            kind = ShareKind.COMPUTE if what.peer == -1 else ShareKind.TRANSFER
            totals[(kind, what.stage, what.peer)] += timings.end_s[op] - timings.start_s[op]
        start_s = timings.start_s[op]
        waited_from = timings.end_s[cause] if cause >= 0 else 0.0
        if start_s > waited_from + 1e-12:  # held back by a release time or a latency
            totals[(ShareKind.WAIT, what.stage, what.peer)] += start_s - waited_from
        op = cause
    length = sum(totals.values())
    shares = [PathShare(kind, stage, peer, seconds, seconds / length)
              for (kind, stage, peer), seconds in totals.items() if seconds > 0]
    return tuple(sorted(shares, key=lambda s: -s.seconds))
