"""When a rank dies, the others stop in bounded time and say which rank it was.

Every rank runs a :class:`Watchdog`: a daemon thread that bumps the rank's
heartbeat counter in the rendezvous store. A rank that fails with an
exception writes a one-line reason there before it exits. When a collective
fails or times out on a surviving rank (gloo reports a closed connection at
once; any backend gives up after the process-group timeout), the survivor
asks the store which rank reported a failure or stopped beating, and raises
:class:`RankFailure` naming it. Counters, not clocks, so machines need not
agree on the time.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from potluck.errors import PotluckError


class RankFailure(PotluckError):
    """Another rank (or this one) failed; the message names it."""

    exit_code = 4


def one_line(error: BaseException) -> str:
    """The error's type and first sentence, without torch's source-location prefix."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if first.startswith("[") and "] " in first:
        first = first.split("] ", 1)[1]
    return f"{type(error).__name__}: {first.split('. ')[0]}"[:300]


class Watchdog:
    """Heartbeats and failure notes of all ranks, in the rendezvous store."""

    def __init__(self, store: dist.Store, rank: int, devices: tuple[str, ...],
                 interval_s: float = 0.5) -> None:
        self.store = dist.PrefixStore("potluck", store)
        self.rank = rank
        self.devices = devices
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="potluck-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(f"alive/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store host is gone; diagnose() says so
                return
            self._stop.wait(self.interval_s)

    def name(self, rank: int) -> str:
        return f"rank {rank} ({self.devices[rank]})"

    def mark_failed(self, error: BaseException) -> None:
        """Leave a note for the others (best effort: the store may be gone)."""
        try:
            self.store.set(f"failed/{self.rank}", one_line(error))
        except Exception:  # noqa: BLE001
            pass

    def diagnose(self, error: BaseException) -> RankFailure:
        """Why a collective failed here: the rank that reported a failure or went silent."""
        try:
            reported = self._reported_failure()
            if reported:
                return RankFailure(reported)
            silent = self._silent_ranks()
            self.store.set(f"stopped/{self.rank}", "1")  # not silent: it noticed and stopped
        except Exception:  # noqa: BLE001 - the store lives on rank 0's machine
            return RankFailure(f"{self.name(0)} is unreachable (it hosts the rendezvous store); "
                               f"{self.name(self.rank)} stopped: {one_line(error)}")
        if silent:
            names = ", ".join(self.name(r) for r in silent)
            return RankFailure(f"{names} stopped responding; {self.name(self.rank)} stopped: "
                               f"{one_line(error)}")
        return RankFailure(f"{self.name(self.rank)}: a collective failed: {one_line(error)}")

    def _reported_failure(self) -> str | None:
        for rank in range(len(self.devices)):
            key = f"failed/{rank}"
            if rank != self.rank and self.store.check([key]):
                return f"{self.name(rank)} failed: {self.store.get(key).decode()}"
        return None

    def _silent_ranks(self) -> list[int]:
        ranks = [r for r in range(len(self.devices))
                 if r != self.rank and not self.store.check([f"stopped/{r}"])]
        before = [self.store.add(f"alive/{r}", 0) for r in ranks]
        time.sleep(4 * self.interval_s)
        after = [self.store.add(f"alive/{r}", 0) for r in ranks]
        return [r for r, b, a in zip(ranks, before, after, strict=True) if a == b]
