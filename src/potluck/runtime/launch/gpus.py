"""How a plan's ranks use GPUs: one backend for the world, how ranks start, which CUDA device.

Pure functions of the plan and the environment's strings (no torch import), so the
checks before launch and every rank decide the same way:

- :func:`world_backend`: nccl when every rank of the plan is a GPU, gloo when every
  rank is a CPU or the run is emulated. A plan that mixes CPU ranks with GPUs is
  refused: nccl needs a GPU on every rank, and potluck's GPU ranks keep their tensors
  on the GPU, which gloo's send and receive do not take.
- :func:`start_method`: ranks of a GPU run are spawned (a fresh interpreter each, so no
  CUDA state of any process can reach them); CPU ranks are forked from a fork server
  that has imported torch, transformers and potluck, never the caller's module.
- :func:`cuda_ordinal`: the cluster file numbers a machine's GPUs as ``nvidia-smi`` does
  (physical, PCI bus order; ranks start with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA
  agrees); CUDA numbers only the devices ``CUDA_VISIBLE_DEVICES`` lists, in its order.
"""

from __future__ import annotations

from enum import Enum

from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.plans import Plan

DEVICE_ORDER = ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's numbering is nvidia-smi's
_LISTED_BY_NAME = ("GPU-", "MIG-")


class StartMethod(str, Enum):
    """How the local launcher starts a rank (``multiprocessing``'s names)."""

    FORK_SERVER = "forkserver"
    SPAWN = "spawn"


def world_backend(plan: Plan, emulate: bool) -> str:
    """The one torch.distributed backend every rank of ``plan`` joins with."""
    if emulate:
        return "gloo"
    cluster = Cluster(plan.cluster)
    cpus = [d for d in plan.devices if cluster.device(d).type.is_cpu]
    if not cpus:
        return "nccl"
    if len(cpus) == len(plan.devices):
        return "gloo"
    gpus = [d for d in plan.devices if d not in cpus]
    raise ConfigError(
        f"the plan mixes CPU ranks ({_some(cpus)}) with GPUs ({_some(gpus)}), but one "
        "backend must serve every rank (nccl needs a GPU on each); make the plan from the "
        "GPUs only, or dry-run it on CPU with --emulate")


def start_method(plan: Plan, emulate: bool) -> StartMethod:
    """Spawn the ranks of a GPU run; fork the others from a fork server."""
    return StartMethod.SPAWN if world_backend(plan, emulate) == "nccl" else \
        StartMethod.FORK_SERVER


def cuda_ordinal(device_id: str, gpu_index: int, visible: str | None) -> int:
    """The CUDA device index of GPU ``gpu_index`` of its machine (the cluster file's
    number) when ``CUDA_VISIBLE_DEVICES`` is ``visible`` (None: unset)."""
    if visible is None:
        return gpu_index
    listed = _visible_numbers(visible)
    if gpu_index not in listed:
        raise ConfigError(
            f"{device_id} is GPU {gpu_index} of its machine, but CUDA_VISIBLE_DEVICES="
            f"{visible} hides it; list the plan's GPUs there (nvidia-smi's numbers) or "
            "unset it")
    return listed.index(gpu_index)


def check_visible_count(device_id: str, ordinal: int, count: int) -> None:
    """One line when this process sees too few GPUs for ``device_id``'s CUDA index."""
    if ordinal >= count:
        raise ConfigError(
            f"the plan runs {device_id} on cuda:{ordinal}, but this process sees {count} "
            "GPU(s); check the cluster file's gpus_per_node and CUDA_VISIBLE_DEVICES")


def _visible_numbers(visible: str) -> list[int]:
    """The GPU numbers ``CUDA_VISIBLE_DEVICES`` lists, as CUDA reads them: a negative one
    ends the list."""
    numbers: list[int] = []
    if not visible.strip():
        return numbers  # set but empty: no GPU
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith(_LISTED_BY_NAME):
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES={visible} names GPUs by UUID or MIG instance, but "
                "potluck maps the cluster file's GPU numbers; list GPU numbers there "
                "(nvidia-smi's) or unset it")
        try:
            number = int(entry)
        except ValueError:
            raise ConfigError(f"CUDA_VISIBLE_DEVICES={visible} is not a list of GPU numbers "
                              "such as 0,1; fix it or unset it") from None
        if number < 0:
            break
        if number in numbers:
            raise ConfigError(f"CUDA_VISIBLE_DEVICES={visible} lists GPU {number} twice "
                              "(CUDA then shows no GPU); list each GPU once")
        numbers.append(number)
    return numbers


def _some(device_ids: list[str]) -> str:
    return ", ".join(device_ids[:3]) + (", ..." if len(device_ids) > 3 else "")
