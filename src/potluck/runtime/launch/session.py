"""Joining the job: process group, this rank's device, the layout, the watchdog.

:func:`start` reads the launcher's environment (torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, plus
potluck's ``POTLUCK_DEVICE`` or ``POTLUCK_NODE``), checks the world against
the plan before anything can hang, initializes torch.distributed with one
backend for the whole world (nccl when every rank is a GPU of one vendor, gloo when every
rank is a CPU or emulated, or when host-staged islands join vendors, whose GPU islands then
create their own groups over nccl: :mod:`~potluck.runtime.launch.gpus`),
gathers every rank's device id, starts the watchdog, creates the layout's
process groups and uses each once (:mod:`~potluck.runtime.launch.warmup`), so
every communicator exists before the first step. A GPU rank joins with its
device (``device_id``): NCCL then creates the world's communicator at once and
splits the groups' from it. A script run without a launcher is a world of one rank.

A GPU rank runs on the CUDA device that is its plan GPU among those
``CUDA_VISIBLE_DEVICES`` shows (:func:`~potluck.runtime.launch.gpus.cuda_ordinal`);
CUDA numbers them in PCI bus order, as the cluster file does.

Which device a rank runs: ``POTLUCK_DEVICE`` if set; else, with
``POTLUCK_NODE=<group>.<index>``, the ``LOCAL_RANK``-th device the plan uses on
that machine (what the per-node torchrun commands set); else the plan's
``RANK``-th device (the local launcher's numbering).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError, PotluckError
from potluck.planner.gemm import effective_dtype
from potluck.plans import DType, Plan
from potluck.runtime.launch.gpus import (
    DEVICE_ORDER,
    check_visible_count,
    cuda_ordinal,
    island_backend,
    rank_on_gpu,
    world_backend,
)
from potluck.runtime.launch.precision import TorchPrecision, apply_precision, torch_precision
from potluck.runtime.launch.torchrun import node_devices
from potluck.runtime.launch.warmup import warm_up
from potluck.runtime.launch.watchdog import (
    RankFailure,
    Watchdog,
    abort_process_groups,
    silence_from_env,
)
from potluck.runtime.layout import Layout

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class Session:
    """This rank's place in a running plan."""

    plan: Plan
    layout: Layout
    device: torch.device
    watchdog: Watchdog | None

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def use_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def compute_dtype(self) -> DType:
        """The dtype this rank computes in: its device's (fp16 without bf16, fp32 without
        TF32, as the planner assumes) on a GPU; fp32 on CPU ranks, emulated ones included."""
        return self._dtype_of(self.layout.role.device) if self.use_gpu else DType.FP32

    @property
    def precision(self) -> TorchPrecision:
        """Autocast and TF32 settings of :attr:`compute_dtype`."""
        return torch_precision(self.compute_dtype)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """bf16/fp16 autocast for 16-bit dtypes; none for fp32 and tf32."""
        return self.precision.autocast

    @property
    def any_fp16(self) -> bool:
        """Whether some GPU rank of the plan computes in fp16 (then every rank scales the
        loss, with one scale)."""
        return self.use_gpu and any(self._dtype_of(d) is DType.FP16 for d in self.plan.devices)

    @property
    def all_bf16(self) -> bool:
        """Whether every GPU rank of the plan computes in bf16."""
        return self.use_gpu and all(self._dtype_of(d) is DType.BF16 for d in self.plan.devices)

    def _dtype_of(self, device_id: str) -> DType:
        return self._dtypes[device_id]

    @cached_property
    def _dtypes(self) -> dict[str, DType]:
        """Each device's compute dtype: the plan's, or fp16 where the device lacks bf16."""
        cluster = Cluster(self.plan.cluster)
        return {d: effective_dtype(cluster.device(d).type, self.plan.training.dtype)
                for d in self.plan.devices}

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a failed collective into a RankFailure that names the culprit; leave a
        note for the other ranks when this one fails."""
        try:
            yield
        except PotluckError as err:
            if self.watchdog is not None and not isinstance(err, RankFailure):
                self.watchdog.mark_failed(err)
            raise
        except Exception as err:
            if self.watchdog is None:
                raise
            if _is_collective_error(err):
                raise self.watchdog.diagnose(err) from err
            self.watchdog.mark_failed(err)
            raise

    def close(self) -> None:
        """Leave the job: marked stopped first (not a death); after a failure the process
        groups are aborted, since destroying them can wait for a dead peer."""
        failed = self.watchdog is not None and self.watchdog.failure_seen
        if self.watchdog is not None:
            self.watchdog.stop()
        if not dist.is_initialized():
            return
        if failed:
            abort_process_groups()
        else:
            dist.destroy_process_group()


def _is_collective_error(err: BaseException) -> bool:
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout"))


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def local_device_id(plan: Plan, rank: int, local_rank: int) -> str:
    """The device this rank runs, from the environment (see the module docstring)."""
    explicit = os.environ.get("POTLUCK_DEVICE")
    if explicit:
        return explicit
    node = os.environ.get("POTLUCK_NODE")
    if node:
        on_node = node_devices(plan, node)
        if local_rank >= len(on_node):
            raise ConfigError(f"node {node} runs {len(on_node)} ranks of the plan, "
                              f"not {local_rank + 1}; check --nproc-per-node")
        return on_node[local_rank]
    return plan.devices[rank]


def gpu_ordinal(plan: Plan, device_id: str) -> int:
    """The CUDA index of the plan's GPU ``device_id`` in this process; one ConfigError line
    when this machine has no GPU or does not show that one."""
    device = Cluster(plan.cluster).device(device_id)
    if not torch.cuda.is_available():
        raise ConfigError(
            f"the plan runs {device_id} ({device.type.name}) but this machine has no CUDA GPU; "
            "dry-run it on CPU with --emulate"
        )
    ordinal = cuda_ordinal(device_id, device.local_index, os.environ.get("CUDA_VISIBLE_DEVICES"))
    check_visible_count(device_id, ordinal, torch.cuda.device_count())
    return ordinal


def _gpu(plan: Plan, device_id: str) -> torch.device:
    """This rank's GPU, made current (CUDA numbering the GPUs as the cluster file does,
    unless ``CUDA_DEVICE_ORDER`` is set)."""
    os.environ.setdefault(*DEVICE_ORDER)
    device = torch.device("cuda", gpu_ordinal(plan, device_id))
    torch.cuda.set_device(device)
    return device


def start(plan: Plan, *, emulate: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
          silence_s: float | None = None) -> Session:
    """Join (or, alone, create) the job that runs ``plan``; returns this rank's session.
    The others stop when this rank is silent for ``silence_s`` (default: ``POTLUCK_SILENCE_S``
    or 30 s; :mod:`~potluck.runtime.launch.watchdog`)."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    silence_s = silence_s or silence_from_env()
    if world != plan.num_gpus:
        raise ConfigError(
            f"the plan uses {plan.num_gpus} devices ({plan.layout()}) but {world} rank(s) were "
            f"started; start exactly {plan.num_gpus} or make a plan for this world"
        )
    device_id = local_device_id(plan, rank, local_rank)
    backend = world_backend(plan, emulate)
    device = _gpu(plan, device_id) if rank_on_gpu(plan, device_id, emulate) else \
        torch.device("cpu")
    _init_process_group(rank, world, backend, timeout_s, device)
    devices: list[str | None] = [None] * world
    dist.all_gather_object(devices, device_id)
    layout = Layout(plan, rank, tuple(str(d) for d in devices))
    watchdog = Watchdog.connect(dist.distributed_c10d._get_default_store(), rank,
                                layout.device_of_rank, silence_s=silence_s)
    watchdog.start()  # before the groups: every rank leaves the all-gather together
    session = Session(plan, layout, device, watchdog)
    with session.guard():
        layout.create_groups(island_backend(plan, emulate))
        warm_up(layout, device)
    apply_precision(session.precision)
    return session


def _init_process_group(rank: int, world: int, backend: str, timeout_s: float,
                        device: torch.device) -> None:
    """Join the world; a GPU rank names its device, so NCCL initializes eagerly
    (``init_process_group``'s ``device_id``)."""
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    common: dict[str, Any] = {"rank": rank, "world_size": world, "timeout": timeout}
    if backend == "nccl":
        common["device_id"] = device
    if world == 1 and "MASTER_ADDR" not in os.environ:  # a plain script: an in-process store
        dist.init_process_group(backend, store=dist.HashStore(), **{**common, "rank": 0})
        return
    store = _attempt_store(timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, **common)
        return
    dist.init_process_group(backend, **common)


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's elastic agent, a client of its store under this restart's own prefix.
    The agents keep one store for every rendezvous round, so a restarted rank would
    otherwise read the addresses its dead predecessors published, and fail to connect to
    them; None elsewhere (``env://`` as usual)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.PrefixStore(f"potluck/attempt_{restart}", agent_store(timeout))


def agent_store(timeout: timedelta) -> dist.TCPStore:
    """A client of the store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's agents' store)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, wait_for_workers=False, timeout=timeout)
