"""When a rank dies or hangs, every rank stops within seconds and says which it was.

Every rank runs a :class:`Watchdog`: a daemon thread with its own connection to the
rendezvous store (a main thread blocked in a store wait, as NCCL's set-up is while it
fetches its id, holds the shared connection and would stop the heartbeat). Every
``interval_s`` it

- bumps this rank's heartbeat counter;
- reads the job's failure note (:class:`JobNotes`): the first failure anyone published,
  a rank whose own code raised (:meth:`Watchdog.mark_failed`), a watcher that found a
  rank silent, or the local launcher that saw a rank exit;
- watches the next two ranks that have not stopped: a counter that stays put for
  ``silence_s`` seconds and as many of this rank's own beats means that rank died or
  hangs, and the watcher publishes so, and marks it silent (:meth:`JobNotes.silent`): the
  local launcher then kills it, a hung rank being as lost as a dead one. Counters, not
  clocks: machines need not agree on the time, and a watcher that was paused itself
  blames nobody.

On a note the thread gives the main thread ``notice_s`` to meet the failure itself: with
gloo a survivor's collective fails as soon as the dead rank's sockets close, and
:meth:`Watchdog.diagnose` names the culprit from the same note (or from the counters), so
the error takes the ordinary path. A main thread that has met it (its collective failed,
or its own code raised) then gets ``silence_s`` to end the process. Otherwise the thread
ends the process itself, since a survivor blocked in an NCCL host sync never sees an
error in Python: it aborts the process groups (waiting a bounded time), logs the note (at
debug level under the local launcher, which reads the same note from the store it hosts
and reports it) and exits with :class:`RankFailure`'s exit code. A rank that stops on
purpose (it finished, or it stops after a failure) marks itself stopped first, so its
silence is never read as a death.

``silence_s`` is 30 s unless ``POTLUCK_SILENCE_S`` says otherwise; every rank of a job
should get the same value.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from potluck.errors import ConfigError, PotluckError

log = logging.getLogger(__name__)
DEFAULT_SILENCE_S = 30.0
SILENCE_ENV = "POTLUCK_SILENCE_S"
LAUNCHER_REPORTS_ENV = "POTLUCK_LAUNCHER_REPORTS"  # set by the local launcher for its ranks
WATCHED = 2  # ranks each rank watches: the store's load grows with the world, not its square
ABORT_WAIT_S = 5.0
NOTICE_S = 5.0  # how long the main thread may take to meet a published failure itself
STOP_WAIT_S = 5.0
_FAILURE = "failure"
_REPLAN = "replan"
_SILENT = "silent"  # set once any rank is marked silent; silent/<rank> says which


class RankFailure(PotluckError):
    """Another rank (or this one) failed; the message names it. ``lost_devices``: the
    devices whose ranks died without a word (killed, or gone with their machine), as the
    local launcher saw them; empty when a rank raised an error of its own."""

    exit_code = 4

    def __init__(self, message: str, lost_devices: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.lost_devices = lost_devices

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.lost_devices))


def one_line(error: BaseException) -> str:
    """The error's type and first sentence, without torch's source-location prefix."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if first.startswith("[") and "] " in first:
        first = first.split("] ", 1)[1]
    return f"{type(error).__name__}: {first.split('. ')[0]}"[:300]


def silence_from_env() -> float:
    """How long a rank may stay silent before the others stop: ``POTLUCK_SILENCE_S``."""
    value = os.environ.get(SILENCE_ENV)
    if not value:
        return DEFAULT_SILENCE_S
    try:
        silence_s = float(value)
    except ValueError:
        silence_s = math.nan
    if not (math.isfinite(silence_s) and silence_s > 0):
        raise ConfigError(f"{SILENCE_ENV}={value} must be a number of seconds such as 30")
    return silence_s


class JobNotes:
    """What the ranks of a job and the local launcher tell each other through the store:
    heartbeat counters, which ranks stopped on purpose, the first failure, and an elastic
    run's request to stop at a checkpoint for a replan."""

    def __init__(self, store: dist.Store) -> None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's restarts
        self.store = dist.PrefixStore(f"potluck/{attempt}", store)

    def beat(self, rank: int) -> None:
        self.store.add(f"alive/{rank}", 1)

    def beats(self, rank: int) -> int:
        return self.store.add(f"alive/{rank}", 0)

    def mark_stopped(self, rank: int) -> None:
        self.store.set(f"stopped/{rank}", "1")

    def stopped(self, rank: int) -> bool:
        return self.store.check([f"stopped/{rank}"])

    def mark_silent(self, rank: int) -> None:
        """Say that ``rank`` stopped responding (its launcher kills it)."""
        self.store.set(f"{_SILENT}/{rank}", "1")
        self.store.set(_SILENT, "1")

    def silent(self, world_size: int) -> list[int]:
        """The ranks marked silent (one store call while there are none)."""
        if not self.store.check([_SILENT]):
            return []
        return [rank for rank in range(world_size) if self.store.check([f"{_SILENT}/{rank}"])]

    def publish(self, message: str) -> str:
        """Publish a failure unless another came first; the note that stands."""
        return self.store.compare_set(_FAILURE, "", message).decode()

    def failure(self) -> str | None:
        if not self.store.check([_FAILURE]):
            return None
        return self.store.get(_FAILURE).decode()

    def request_replan(self) -> None:
        """Ask the ranks of an elastic run to stop at their next checkpoint."""
        self.store.set(_REPLAN, "1")

    def stop_at(self, step: int, coordinator: bool) -> bool:
        """Whether the job stops after checkpoint ``step`` for a replan: the coordinator
        (rank 0) reads the request and writes the answer for that step, every rank reads
        that answer, so all of them agree however late the request came."""
        key = f"replan-at/{step}"
        if coordinator:
            self.store.set(key, "1" if self.store.check([_REPLAN]) else "0")
        return self.store.get(key) == b"1"


@dataclass
class _Sighting:
    """A watched rank's counter, and when (in this rank's beats and seconds) it last moved."""

    count: int
    beat: int
    at_s: float


class Watchdog:
    """This rank's heartbeat, and its watch over the next ranks (see the module docstring).
    ``end(note)`` ends the process (tests pass their own)."""

    def __init__(self, store: dist.Store, rank: int, devices: tuple[str, ...], *,
                 silence_s: float = DEFAULT_SILENCE_S, interval_s: float = 0.5,
                 notice_s: float = NOTICE_S, end: Callable[[str], None] | None = None) -> None:
        self.notes = JobNotes(store)
        self.rank = rank
        self.devices = devices
        self.silence_s = silence_s
        self.interval_s = interval_s
        self.notice_s = notice_s
        self._end = end or self._end_process
        self._beats = 0
        self._beats_needed = math.ceil(silence_s / interval_s)
        self._sightings: dict[int, _Sighting] = {}
        self._stopped: set[int] = set()
        self._last_contact_s = time.monotonic()
        self._main_knows_at: float | None = None  # when the main thread met a failure
        self._note_seen_at: float | None = None  # when this thread first read a failure note
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="potluck-heartbeat", daemon=True)

    @classmethod
    def connect(cls, store: dist.Store, rank: int, devices: tuple[str, ...], *,
                silence_s: float = DEFAULT_SILENCE_S) -> Watchdog:
        """A watchdog on its own connection to ``store``'s server (where it has one)."""
        return cls(_own_connection(store, silence_s), rank, devices, silence_s=silence_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating on purpose: marked first, so the others do not read it as a death."""
        try:
            self.notes.mark_stopped(self.rank)
        except Exception:  # noqa: BLE001 - the store is gone; nobody is left to watch
            pass
        self._stop.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT_S)

    @property
    def failure_seen(self) -> bool:
        """Whether this rank met a failure (its own or another's)."""
        return self._main_knows_at is not None

    def name(self, rank: int) -> str:
        return f"rank {rank} ({self.devices[rank]})"

    def mark_failed(self, error: BaseException) -> None:
        """Publish this rank's failure for the others (best effort: the store may be gone)."""
        self._main_knows_at = self._main_knows_at or time.monotonic()
        reason = str(error) if isinstance(error, PotluckError) else one_line(error)
        try:
            self.notes.publish(f"{self.name(self.rank)} failed: {reason}")
        except Exception:  # noqa: BLE001
            pass

    def diagnose(self, error: BaseException) -> RankFailure:
        """Why a collective failed here: the failure published, or the rank that went silent."""
        self._main_knows_at = self._main_knows_at or time.monotonic()
        try:
            note = self.notes.failure() or self._publish_silent(self._silent_ranks(), error)
            self.notes.mark_stopped(self.rank)  # not silent: it noticed and stops
        except Exception:  # noqa: BLE001 - the store lives on rank 0's machine
            return RankFailure(f"{self.name(0)} is unreachable (it hosts the rendezvous store); "
                               f"{self.name(self.rank)} stopped: {one_line(error)}")
        return RankFailure(note)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                note = self._beat()
            except Exception as err:  # noqa: BLE001 - the store did not answer
                note = self._unreachable(err)
            if note is not None and self._ends_now():
                self._end(note)
                return
            self._stop.wait(self.interval_s)

    def _beat(self) -> str | None:
        """Beat once; the failure note this rank must stop for, if any."""
        self.notes.beat(self.rank)
        self._beats += 1
        self._last_contact_s = time.monotonic()
        return self.notes.failure() or self._watch()

    def _ends_now(self) -> bool:
        """Once the main thread has had ``notice_s`` to meet the failure and has not, or
        ``silence_s`` to stop after meeting it and is still running."""
        now = time.monotonic()
        self._note_seen_at = self._note_seen_at or now
        knew = self._main_knows_at
        if knew is None:
            return now - self._note_seen_at >= self.notice_s
        return now - knew >= self.silence_s

    def _unreachable(self, error: BaseException) -> str | None:
        if time.monotonic() - self._last_contact_s < self.silence_s:
            return None
        return (f"the rendezvous store (on {self.name(0)}'s machine) is unreachable: "
                f"{one_line(error)}")

    def _watch(self) -> str | None:
        """Publish a watched rank that went silent; the note that then stands."""
        now = time.monotonic()
        for rank in self._watched():
            if not self._silent(rank, self.notes.beats(rank), now):
                continue
            if self.notes.stopped(rank):  # finished: watch the next rank instead
                self._stopped.add(rank)
                continue
            self.notes.mark_silent(rank)
            return self.notes.publish(f"{self.name(rank)} stopped responding (no heartbeat "
                                      f"for {self.silence_s:.0f} s)")
        return None

    def _watched(self) -> list[int]:
        world = len(self.devices)
        after = ((self.rank + k) % world for k in range(1, world))
        return [rank for rank in after if rank not in self._stopped][:WATCHED]

    def _silent(self, rank: int, count: int, now: float) -> bool:
        seen = self._sightings.get(rank)
        if seen is None or seen.count != count:
            self._sightings[rank] = _Sighting(count, self._beats, now)
            return False
        return self._beats - seen.beat >= self._beats_needed and now - seen.at_s >= self.silence_s

    def _silent_ranks(self) -> list[int]:
        ranks = [r for r in range(len(self.devices))
                 if r != self.rank and not self.notes.stopped(r)]
        before = [self.notes.beats(r) for r in ranks]
        time.sleep(4 * self.interval_s)
        after = [self.notes.beats(r) for r in ranks]
        return [r for r, b, a in zip(ranks, before, after, strict=True) if a == b]

    def _publish_silent(self, silent: list[int], error: BaseException) -> str:
        if silent:
            names = ", ".join(self.name(r) for r in silent)
            return self.notes.publish(f"{names} stopped responding; {self.name(self.rank)} "
                                      f"stopped: {one_line(error)}")
        return self.notes.publish(f"{self.name(self.rank)}: a collective failed: "
                                  f"{one_line(error)}")

    def _end_process(self, note: str) -> None:
        """Stop this process for ``note``: its main thread may be stuck in C++."""
        try:
            self.notes.mark_stopped(self.rank)
        except Exception:  # noqa: BLE001
            pass
        quiet = os.environ.get(LAUNCHER_REPORTS_ENV) == "1"
        log.log(logging.DEBUG if quiet else logging.ERROR, "%s; %s stops", note,
                self.name(self.rank))
        abort_process_groups(ABORT_WAIT_S)
        sys.stderr.flush()
        os._exit(RankFailure.exit_code)


def root_store(store: dist.Store) -> dist.Store:
    """The store under ``store``'s prefixes (the process group's): where the launcher and
    every rank's notes meet."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _own_connection(store: dist.Store, timeout_s: float) -> dist.Store:
    """A new client of the TCP store under ``store``'s prefixes; ``store`` itself when it is
    not a TCP store (a world of one)."""
    store = root_store(store)
    if not isinstance(store, dist.TCPStore):
        return store
    return dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def abort_process_groups(wait_s: float = ABORT_WAIT_S) -> None:
    """Abort every process group (under NCCL that ends kernels and host syncs that wait on a
    dead peer), waiting at most ``wait_s``: the process exits next either way."""
    def abort() -> None:
        try:
            if dist.is_initialized():
                dist.distributed_c10d._abort_process_group()
        except Exception as err:  # noqa: BLE001 - nothing more to do
            log.debug("aborting the process groups failed: %s", one_line(err))

    aborter = threading.Thread(target=abort, name="potluck-abort", daemon=True)
    aborter.start()
    aborter.join(wait_s)
