"""Run the measurements on every rank: locally spawned processes, or ranks torchrun started.

Without a torchrun environment, ``profile`` spawns ``ranks`` local processes
(one per GPU, or two CPU ranks) joined by gloo (NCCL on GPUs). Under torchrun
(``RANK``/``WORLD_SIZE`` set), every node runs ``potluck profile`` and the
ranks measure the links between machines too; rank 0 gathers the results.
CPU ranks split the machine's cores between them, as training ranks do, and
time FP32 matmuls only (CPU ranks train in FP32: ``planner.gemm.effective_dtype``).

Every wait is bounded: the process group's collectives by
:data:`COLLECTIVE_TIMEOUT_S` (a rank whose peer died fails instead of waiting),
the whole run by a deadline (:func:`deadline_s`, from :func:`estimate_s`).
Spawned ranks tell the parent what they are doing through one small status
file each (no multiprocessing queue, so no semaphores to leak); past the
deadline the parent ends them and names the phase each was still in.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from potluck.errors import PotluckError
from potluck.model.spec import ModelSpec
from potluck.profiler import comm
from potluck.profiler.compute import DeviceMeasurement, measure_device
from potluck.units import positive_number, whole_number

Progress = Callable[[float, str], None]  # (fraction done, what is being measured)

# Rough seconds of each part, for the estimate printed before a run: starting the ranks
# (spawning processes that import torch), matmuls per dtype (the budget, plus the warm-up
# and a fourth sample each GEMM takes at least), memory bandwidth and the links.
STARTUP_S = 8.0
MATMUL_OVER_BUDGET = 2.0
BANDWIDTH_S = 1.0
LINKS_S = 3.0
DEADLINE_FACTOR = 3.0  # a busy machine may take this much longer than the estimate
DEADLINE_SLACK_S = 15.0
COLLECTIVE_TIMEOUT_S = 60.0
POLL_S = 0.2
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class ProfileOptions:
    model: ModelSpec
    ranks: int | None = None  # local ranks to spawn (default: the GPUs, or 2 CPU ranks)
    budget_s: float = 1.0  # seconds of matmul timing per dtype
    dtypes: tuple[str, ...] | None = None  # default: fp32 on CPUs, bf16/fp16/fp32 on GPUs
    p2p_bytes: float | None = None  # default: 16 MB on CPUs, 256 MB on GPUs
    timeout_s: float | None = None  # stop after this long (default: deadline_s)

    def __post_init__(self) -> None:
        positive_number(self.budget_s, "--budget")
        if self.timeout_s is not None:
            positive_number(self.timeout_s, "--timeout")
        if self.ranks is not None:
            whole_number(self.ranks, "--ranks")


@dataclass(frozen=True)
class ProfileResult:
    """Per-rank hosts and device measurements, rank 0's links, the all-reduce."""

    hosts: list[str]
    devices: list[DeviceMeasurement]
    pairs: list[comm.PairMeasurement] = field(default_factory=list)
    allreduce: comm.AllReduceMeasurement | None = None
    elapsed_s: float = 0.0


def default_ranks() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def default_dtypes(on_gpu: bool) -> tuple[str, ...]:
    return ("bf16", "fp16", "fp32") if on_gpu else ("fp32",)


def dtypes_of(options: ProfileOptions) -> tuple[str, ...]:
    return options.dtypes or default_dtypes(torch.cuda.is_available())


def estimate_s(options: ProfileOptions) -> float:
    """About how long a profile takes on an idle machine."""
    ranks = options.ranks or default_ranks()
    links = LINKS_S if ranks > 1 else 0.0
    matmuls = len(dtypes_of(options)) * options.budget_s * MATMUL_OVER_BUDGET
    return STARTUP_S + matmuls + BANDWIDTH_S + links


def deadline_s(options: ProfileOptions) -> float:
    """How long a profile may run before it is stopped as hung."""
    if options.timeout_s is not None:
        return options.timeout_s
    return DEADLINE_FACTOR * estimate_s(options) + DEADLINE_SLACK_S


def profile(options: ProfileOptions, progress: Progress | None = None) -> ProfileResult | None:
    """Measure this machine (or this torchrun job); ``None`` on ranks other than 0."""
    started = time.perf_counter()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        result = _measure(options, progress if os.environ["RANK"] == "0" else None)
    else:
        result = _spawn(options, progress)
    if result is None:
        return None
    return ProfileResult(result.hosts, result.devices, result.pairs, result.allreduce,
                         time.perf_counter() - started)


def _spawn(options: ProfileOptions, progress: Progress | None) -> ProfileResult:
    ranks = options.ranks or default_ranks()
    if ranks == 1:
        return _single(options, progress)
    limit_s = deadline_s(options)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.pickle"
        store = _launcher_store()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True",
               "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks)}
        processes = mp.start_processes(_spawned_rank, args=(env, options, folder, str(out)),
                                       nprocs=ranks, join=False, start_method="spawn")
        watch = StatusWatch(Path(folder), ranks, progress)
        try:
            _wait(processes, watch, limit_s)
        except mp.ProcessRaisedException as err:
            last = str(err).strip().splitlines()[-1]
            raise PotluckError(f"profiling failed: {last}") from None
        except mp.ProcessExitedException as err:
            raise PotluckError(f"profiling failed: a rank exited ({err})") from None
        finally:
            stop(processes.processes)
        watch.poll()
        return pickle.loads(out.read_bytes())


def _wait(processes, watch: StatusWatch, limit_s: float) -> None:
    """Join the ranks, reporting their progress; past ``limit_s``, stop them and say where
    each one was."""
    started = time.monotonic()
    while not processes.join(timeout=POLL_S):
        watch.poll()
        if time.monotonic() - started > limit_s:
            raise PotluckError(
                f"profiling stopped after {limit_s:.0f} s: {watch.describe()}; no file written "
                "(a busy machine: retry when it is quieter, or give --timeout SECONDS)")


def stop(processes: list) -> None:
    """End ``processes`` still running: terminate, then kill what outlives a grace period."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_GRACE_S)


class StatusWatch:
    """What each spawned rank last reported (one file per rank, rewritten atomically)."""

    def __init__(self, folder: Path, ranks: int, progress: Progress | None) -> None:
        self.folder, self.ranks, self.progress = folder, ranks, progress
        self.phases = ["starting"] * ranks
        self._reported = ""

    def poll(self) -> None:
        for rank in range(self.ranks):
            path = status_path(self.folder, rank)
            if path.is_file():
                fraction, _, label = path.read_text().partition("\t")
                self.phases[rank] = label
                if rank == 0 and label != self._reported and self.progress is not None:
                    self._reported = label
                    self.progress(float(fraction), label)

    def describe(self) -> str:
        return ", ".join(f"rank {rank} was still in {phase!r}"
                         for rank, phase in enumerate(self.phases))


def status_path(folder: Path, rank: int) -> Path:
    return folder / f"status-{rank}"


def status_writer(folder: str, rank: int) -> Progress:
    def write(fraction: float, label: str) -> None:
        path = status_path(Path(folder), rank)
        pending = path.with_suffix(".pending")
        pending.write_text(f"{fraction}\t{label}")
        os.replace(pending, path)

    return write


def _launcher_store() -> dist.TCPStore:
    """The ranks' rendezvous store, hosted here (as torchrun's agent does) on a port bound
    before any rank starts: no other process can take it in between."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _spawned_rank(rank: int, env: dict[str, str], options: ProfileOptions, folder: str,
                  out: str) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    result = _measure(options, status_writer(folder, rank))
    if result is not None:
        Path(out).write_bytes(pickle.dumps(result))


def _device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return torch.device("cpu")


def _single(options: ProfileOptions, progress: Progress | None) -> ProfileResult:
    device = _device()
    report = progress or _quiet
    report(0.1, "matmul and memory bandwidth")
    measured = measure_device(device, options.model, list(dtypes_of(options)), options.budget_s)
    report(1.0, "done")
    return ProfileResult([socket.gethostname()], [measured])


def _quiet(fraction: float, label: str) -> None:
    """No progress to report."""


def _measure(options: ProfileOptions, progress: Progress | None) -> ProfileResult | None:
    device = _device()
    report = progress or _quiet
    report(0.02, "joining the other ranks")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        host_names = comm.hosts()
        dtypes = list(dtypes_of(options))
        step = 0.55 / (len(dtypes) + 1)

        def phase(index: int, label: str) -> None:
            dist.barrier()  # ranks sharing a machine measure the same thing at once
            report(0.05 + index * step, label)

        measured = measure_device(device, options.model, dtypes, options.budget_s, sync=phase)
        devices: list[DeviceMeasurement | None] = [None] * dist.get_world_size()
        dist.all_gather_object(devices, measured)
        report(0.6, "point-to-point links")
        size = options.p2p_bytes or (256e6 if device.type == "cuda" else 16e6)
        pairs = comm.measure_pairs(device, host_names, size)
        report(0.85, "all-reduce")
        allreduce = comm.measure_allreduce(device, size)
        report(1.0, "done")
        if dist.get_rank() != 0:
            return None
        return ProfileResult(host_names, [d for d in devices if d is not None], pairs, allreduce)
    finally:
        dist.destroy_process_group()
