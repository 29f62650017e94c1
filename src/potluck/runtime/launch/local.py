"""Starting the ranks of a plan on this machine.

:func:`run_local` starts one process per rank of a plan on this machine (as
torchrun would, with ``RANK``/``WORLD_SIZE``/``MASTER_*`` and
``POTLUCK_DEVICE`` set), returns every rank's result, and watches them: when
a rank fails or dies, the launcher publishes it in the store, the others stop
on their own (their watchdogs read the note:
:mod:`~potluck.runtime.launch.watchdog`) within a grace period or are
terminated; the error raised names the rank that failed first and why (a rank
that stopped for a watchdog's note is reported with that note). A rank the watchdogs
found silent (hung, or stopped with SIGSTOP, as a lost machine looks) is killed at once
and reported like a rank that died, so an elastic run plans around its device. A run that
exceeds ``timeout_s`` is stopped the same way. The launcher hosts the
rendezvous store itself (as torchrun's agent does), so it outlives every rank;
no rank outlives the launcher or the fork server that starts the ranks
(:mod:`~potluck.runtime.launch.lifeline`), and when the fork server dies the
error says so instead of blaming a rank. The ranks log torch's C++ warnings
only when ``TORCH_CPP_LOG_LEVEL`` asks for them: a store client whose server is
gone warns with a C++ stack before raising the same error as an exception.

Ranks start from a fork server (a clean process that has imported torch, transformers
and potluck's runtime, :data:`PRELOAD`, but never the caller's module, which may touch
CUDA when imported; a launcher that dies while it starts a rank leaves one line there, not
a traceback: :mod:`~potluck.runtime.launch.fork_server_hook`) or, for a GPU run
(:func:`~potluck.runtime.launch.gpus.start_method`) and for a function of ``__main__``,
by spawn: a fork of a process that initialized CUDA cannot use CUDA.

A plan that spans several machines starts with one torchrun command per
machine instead (:mod:`potluck.runtime.launch.torchrun`).
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from potluck.errors import PotluckError
from potluck.runtime.launch import lifeline
from potluck.runtime.launch.gpus import DEVICE_ORDER, StartMethod
from potluck.runtime.launch.lifeline import RankHandle
from potluck.runtime.launch.watchdog import LAUNCHER_REPORTS_ENV, JobNotes, RankFailure, one_line

log = logging.getLogger(__name__)
T = TypeVar("T")
GRACE_S = 15.0
STOP_WAIT_S = 5.0
RANK_CPP_LOG_LEVEL = "ERROR"
FORK_SERVER_GONE_EXIT = 255  # what multiprocessing reads when the fork server closes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class _Report:
    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    details: str = ""
    exit_code: int | None = None


def _rank_main(fn: Callable[..., Any], args: tuple, rank: int, env: dict[str, str],
               threads: int, reports: Any, launcher_pid: int) -> None:
    faulthandler.enable(all_threads=True)  # a C++ crash (SIGSEGV, SIGABRT) shows each stack
    lifeline.die_with_launcher(launcher_pid)
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        reports.put(_Report(rank, True, fn(*args)))
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
        message = str(err) if isinstance(err, PotluckError) else one_line(err)
        reports.put(_Report(rank, False, error_type=type(err).__name__, message=message,
                            details=traceback.format_exc()))
        raise SystemExit(getattr(err, "exit_code", 1)) from None


def rank_env(rank: int, world_size: int, device: str, port: int,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
           "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE":
           str(world_size), "POTLUCK_DEVICE": device, LAUNCHER_REPORTS_ENV: "1"}
    env.update(extra or {})
    return env


PRELOAD = ("potluck.runtime.launch.fork_server_hook", "torch", "torch.distributed.pipelining",
           "torch.distributed.tensor.parallel",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.configuration_auto",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.mistral.modeling_mistral",
           "transformers.masking_utils", "potluck.runtime.training")
RANK_ENV_DEFAULTS = (("TORCH_CPP_LOG_LEVEL", RANK_CPP_LOG_LEVEL), DEVICE_ORDER)


def start_context(method: StartMethod) -> Any:
    """The ``multiprocessing`` context that starts ranks. A fork server starts them in a
    fraction of a second from a clean process that has imported :data:`PRELOAD` but never
    run a kernel (a plain fork of a process that has run torch ops can hang in its thread
    pool, and one that initialized CUDA cannot use it); spawn where there is none."""
    if method is StartMethod.SPAWN or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def _method(fn: Callable[..., Any], requested: StartMethod | None) -> StartMethod:
    """Spawn for a function of ``__main__`` (a fork server without the caller's script
    cannot unpickle it); else as requested, a fork server by default."""
    if fn.__module__ == "__main__":
        return StartMethod.SPAWN
    return requested or StartMethod.FORK_SERVER


def run_local(fn: Callable[..., T], devices: Sequence[str], args: tuple = (), *,
              timeout_s: float = 3600.0, env: dict[str, str] | None = None,
              threads_per_rank: int | None = None, grace_s: float = GRACE_S,
              start_method: StartMethod | None = None,
              watch: Callable[[JobNotes], None] | None = None) -> list[T]:
    """Run ``fn(*args)`` on one process per device; their results, by rank. After the first
    failure the others have ``grace_s`` to stop on their own. ``start_method``: spawn for
    GPU ranks (:func:`~potluck.runtime.launch.gpus.start_method`); a fork server if None.
    ``watch(notes)`` is called about ten times a second while the ranks run (an elastic
    run's supervisor asks them to stop at a checkpoint through ``notes``)."""
    world = len(devices)
    # This process hosts the rendezvous store (as torchrun's agent does), so it outlives
    # any rank and the survivors can still ask it who failed.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**_rank_defaults(), **(env or {}), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    port = store.port
    context = start_context(_method(fn, start_method))
    reports = context.Queue()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world)
    ranks: list[RankHandle] = []
    try:
        with lifeline.starting_processes(), _rank_environment():
            for rank, device in enumerate(devices):
                process = context.Process(
                    target=_rank_main, name=f"potluck-rank{rank}",
                    args=(fn, args, rank, rank_env(rank, world, device, port, env), threads,
                          reports, os.getpid()))
                process.start()
                ranks.append(RankHandle(process))
        return _collect([r.process for r in ranks], reports, devices, timeout_s, grace_s,
                        context.get_start_method() == "forkserver", JobNotes(store), watch)
    finally:
        lifeline.stop(ranks, STOP_WAIT_S)


def _rank_defaults() -> dict[str, str]:
    """:data:`RANK_ENV_DEFAULTS` as this process has them (its own value, else the default),
    for each rank to set first thing: a fork server started earlier, maybe by another pool
    of this process, passes on its own environment, not this one (CUDA, which a fork server
    never initializes, reads ``CUDA_DEVICE_ORDER`` once, when first used)."""
    return {name: os.environ.get(name, value) for name, value in RANK_ENV_DEFAULTS}


@contextmanager
def _rank_environment() -> Iterator[None]:
    """Start ranks (and the fork server, which passes its environment on) with
    :data:`RANK_ENV_DEFAULTS` where the user set none: torch's C++ log level at ERROR (c10
    reads it once, when torch is imported) and CUDA numbering GPUs in PCI bus order, as the
    cluster file does (CUDA reads it once, when first used, which a rank's imports may do:
    setting either inside a rank is too late)."""
    added = [name for name, _ in RANK_ENV_DEFAULTS if name not in os.environ]
    os.environ.update({name: value for name, value in RANK_ENV_DEFAULTS if name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _collect(processes: list, reports: Any, devices: Sequence[str], timeout_s: float,
             grace_s: float, fork_server: bool, notes: JobNotes,
             watch: Callable[[JobNotes], None] | None = None) -> list:
    results: dict[int, Any] = {}
    failures: dict[int, _Report] = {}
    deadline = time.monotonic() + timeout_s
    first_failure_at: float | None = None
    while len(results) + len(failures) < len(processes):
        _drain(reports, results, failures, devices, notes)
        _kill_silent(processes, results, failures, devices, notes)
        _note_deaths(processes, results, failures, devices, notes)
        if watch is not None and not failures:
            watch(notes)
        now = time.monotonic()
        if failures and first_failure_at is None:
            first_failure_at = now
            _raise_if_fork_server_died(failures, fork_server)
        if first_failure_at is not None and now - first_failure_at > grace_s:
            break
        if now > deadline:
            raise RankFailure(f"the run did not finish within {timeout_s:.0f} s; stopped all ranks")
    if failures:
        raise _root_cause(failures, devices)
    return [results[rank] for rank in range(len(processes))]


def _drain(reports: Any, results: dict, failures: dict, devices: Sequence[str],
           notes: JobNotes) -> None:
    """Take one report: a result (that rank stopped on purpose) or a failure, which the
    other ranks' watchdogs then read from the store."""
    try:
        report: _Report = reports.get(timeout=0.1)
    except queue.Empty:
        return
    if report.ok:
        results[report.rank] = report.value
        notes.mark_stopped(report.rank)
    else:
        failures[report.rank] = report
        log.debug("rank %d failed:\n%s", report.rank, report.details)
        if report.error_type != "RankFailure":
            notes.publish(_described(report, devices))


def _note_deaths(processes: list, results: dict, failures: dict, devices: Sequence[str],
                 notes: JobNotes) -> None:
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code is None or rank in results or rank in failures:
            continue
        if code == 0:
            continue  # its report is still in the queue
        time.sleep(0.2)  # a failing rank reports before it exits; give the queue a moment
        if rank not in failures:
            failures[rank] = _death(rank, code, notes)
            if failures[rank].error_type == "Exit":
                notes.publish(_described(failures[rank], devices))


def _kill_silent(processes: list, results: dict, failures: dict, devices: Sequence[str],
                 notes: JobNotes) -> None:
    """Kill the ranks the watchdogs found silent (SIGKILL ends a stopped process too); each
    is then a death, its device lost."""
    for rank in notes.silent(len(processes)):
        if rank in results or rank in failures:
            continue
        processes[rank].kill()
        note, name = notes.failure() or "", f"rank {rank} ({devices[rank]}) "
        said = note.removeprefix(name) if note.startswith(name) else "stopped responding"
        failures[rank] = _Report(rank, False, error_type="Exit", exit_code=-9,
                                 message=f"{said}; the launcher killed it")


def _death(rank: int, code: int, notes: JobNotes) -> _Report:
    """A rank that exited without a report: its watchdog stopped it for the job's failure
    note, or it died."""
    note = notes.failure() if code == RankFailure.exit_code else None
    if note is not None:
        return _Report(rank, False, error_type="RankFailure", message=note, exit_code=code)
    how = lifeline.killed_by(-code) if code < 0 else f"exited with code {code}"
    return _Report(rank, False, error_type="Exit", message=how, exit_code=code)


def _root_cause(failures: dict[int, _Report], devices: Sequence[str]) -> PotluckError:
    """The first failure that is not just another rank noticing it."""
    primary = [r for r in failures.values() if r.error_type != "RankFailure"]
    report = min(primary or failures.values(), key=lambda r: r.rank)
    if report.error_type == "RankFailure":
        return RankFailure(report.message)
    if report.error_type in ("ConfigError", "InfeasibleError", "TrainingError"):
        from potluck import errors

        return getattr(errors, report.error_type)(report.message)
    lost = tuple(devices[r.rank] for r in sorted(primary, key=lambda r: r.rank)
                 if r.error_type == "Exit")
    return RankFailure(_described(report, devices), lost)


def _described(report: _Report, devices: Sequence[str]) -> str:
    """'rank 1 (cpu.0:1) failed: ValueError: ...' or 'rank 1 (cpu.0:1) was killed by ...'."""
    detail = report.message if report.error_type == "Exit" else f"failed: {report.message}"
    return f"rank {report.rank} ({devices[report.rank]}) {detail}"


def _raise_if_fork_server_died(failures: dict[int, _Report], fork_server: bool) -> None:
    """The fork server's death ends every rank, and ``multiprocessing`` reads each one's
    exit code as 255: then name the fork server (it may take a moment to become waitable
    after its sockets closed)."""
    if not fork_server or all(r.exit_code != FORK_SERVER_GONE_EXIT for r in failures.values()):
        return
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        death = lifeline.fork_server_death()
        if death is not None:
            raise RankFailure(f"{death}; every rank stopped with it (rerun the command)")
        time.sleep(0.1)
