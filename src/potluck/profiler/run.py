"""Run the measurements on every rank: locally spawned processes, or ranks torchrun started.

Without a torchrun environment, ``profile`` spawns ``ranks`` local processes
(one per GPU, or two CPU ranks) joined by gloo (NCCL on GPUs). Under torchrun
(``RANK``/``WORLD_SIZE`` set), every node runs ``potluck profile`` and the
ranks measure the links between machines too; rank 0 gathers the results.
CPU ranks split the machine's cores between them, as training ranks do.
"""

from __future__ import annotations

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

Progress = Callable[[float], None]


@dataclass(frozen=True)
class ProfileOptions:
    model: ModelSpec
    ranks: int | None = None  # local ranks to spawn (default: the GPUs, or 2 CPU ranks)
    budget_s: float = 1.0  # seconds of matmul timing per dtype
    dtypes: tuple[str, ...] | None = None  # default: fp32 and bf16 on CPUs, bf16/fp16/fp32 on GPUs
    p2p_bytes: float | None = None  # default: 16 MB on CPUs, 256 MB on GPUs


@dataclass(frozen=True)
class ProfileResult:
    """Per-rank hosts and device measurements, rank 0's links, the all-reduce."""

    hosts: list[str]
    devices: list[DeviceMeasurement]
    pairs: list[comm.PairMeasurement] = field(default_factory=list)
    allreduce: comm.AllReduceMeasurement | None = None
    elapsed_s: float = 0.0


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


def _default_ranks() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _spawn(options: ProfileOptions, progress: Progress | None) -> ProfileResult:
    ranks = options.ranks or _default_ranks()
    if ranks == 1:
        return _single(options, progress)
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.pickle"
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks)}
        processes = mp.start_processes(_spawned_rank, args=(env, options, queue, str(out)),
                                       nprocs=ranks, join=False, start_method="spawn")
        try:
            while not processes.join(timeout=0.2):
                _drain(queue, progress)
        except mp.ProcessRaisedException as err:
            last = str(err).strip().splitlines()[-1]
            raise PotluckError(f"profiling failed: {last}") from None
        except mp.ProcessExitedException as err:
            raise PotluckError(f"profiling failed: a rank exited ({err})") from None
        _drain(queue, progress)
        return pickle.loads(out.read_bytes())


def _drain(queue, progress: Progress | None) -> None:
    while not queue.empty():
        fraction = queue.get()
        if progress is not None:
            progress(fraction)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_rank(rank: int, env: dict[str, str], options: ProfileOptions, queue,
                  out: str) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    result = _measure(options, queue.put if rank == 0 else None)
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


def _dtypes(options: ProfileOptions, device: torch.device) -> list[str]:
    if options.dtypes:
        return list(options.dtypes)
    return ["bf16", "fp16", "fp32"] if device.type == "cuda" else ["fp32", "bf16"]


def _single(options: ProfileOptions, progress: Progress | None) -> ProfileResult:
    device = _device()
    if progress:
        progress(0.1)
    measured = measure_device(device, options.model, _dtypes(options, device), options.budget_s)
    if progress:
        progress(1.0)
    return ProfileResult([socket.gethostname()], [measured])


def _measure(options: ProfileOptions, progress: Progress | None) -> ProfileResult | None:
    device = _device()
    report = progress or (lambda fraction: None)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        host_names = comm.hosts()
        report(0.05)
        measured = measure_device(device, options.model, _dtypes(options, device), options.budget_s,
                                  sync=dist.barrier)
        devices: list[DeviceMeasurement | None] = [None] * dist.get_world_size()
        dist.all_gather_object(devices, measured)
        report(0.6)
        size = options.p2p_bytes or (256e6 if device.type == "cuda" else 16e6)
        pairs = comm.measure_pairs(device, host_names, size)
        report(0.85)
        allreduce = comm.measure_allreduce(device, size)
        report(1.0)
        if dist.get_rank() != 0:
            return None
        return ProfileResult(host_names, [d for d in devices if d is not None], pairs, allreduce)
    finally:
        dist.destroy_process_group()
