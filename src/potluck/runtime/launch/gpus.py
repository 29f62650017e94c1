"""How a plan's ranks use GPUs: one backend for the world, how ranks start, which CUDA device.

Pure functions of the plan and the environment's strings (no torch import), so the
checks before launch and every rank decide the same way:

- :func:`world_backend`: nccl when every rank of the plan is a GPU of one vendor (RCCL on
  AMD: ROCm's torch names it ``nccl``), gloo when every rank is a CPU or the run is
  emulated. Ranks of several vendors (NVIDIA, AMD, CPUs) run where every group that sums
  holds one vendor, vendors meeting only through host memory: host-staged islands and
  pipelines whose stages span vendors (the plan's rule,
  :func:`~potluck.plans.vendors.vendors_problem`); then the world's default group is
  gloo, which spans everything, and the groups of one GPU vendor take ``nccl``
  (:func:`island_backend`, a backend per ``new_group``). torch 2.13's
  ``torch/distributed/distributed_c10d.py`` allows it: ``BackendConfig.__init__`` maps a
  single backend name to every device its ``Backend.backend_capability`` lists (gloo: cpu and
  cuda tensors; nccl: cuda only), so a gloo world takes a GPU rank's tensors too, where the
  device map ``"cpu:gloo,cuda:nccl"`` would send them to NCCL, which joins no two vendors;
  ``_new_process_group_helper`` returns ``NON_GROUP_MEMBER`` to a rank outside a new group
  before it makes any backend, so a CPU rank takes part in creating a GPU island's NCCL
  groups without NCCL of its own (no ``device_id`` is bound to a gloo world, so no
  communicator split runs on non-members).
- :func:`start_method`: ranks of a GPU run are spawned (a fresh interpreter each, so no
  CUDA state of any process can reach them); CPU ranks are forked from a fork server
  that has imported torch, transformers and potluck, never the caller's module.
- :func:`cuda_ordinal`: the cluster file numbers a machine's GPUs as ``nvidia-smi`` does
  (physical, PCI bus order; ranks start with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA
  agrees); CUDA numbers only the devices ``CUDA_VISIBLE_DEVICES`` lists, in its order.
"""

from __future__ import annotations

from enum import Enum

from potluck.cluster.catalog import Vendor
from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.plans import Plan
from potluck.plans.vendors import vendors_problem

DEVICE_ORDER = ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's numbering is nvidia-smi's
_LISTED_BY_NAME = ("GPU-", "MIG-")


class StartMethod(str, Enum):
    """How the local launcher starts a rank (``multiprocessing``'s names)."""

    FORK_SERVER = "forkserver"
    SPAWN = "spawn"


def world_backend(plan: Plan, emulate: bool) -> str:
    """The backend of the world's default group (see the module docstring)."""
    if emulate:
        return "gloo"
    vendors = _vendors(plan)
    if vendors == {Vendor.CPU}:
        return "gloo"
    if len(vendors) == 1:
        return "nccl"
    problem = vendors_problem(plan)
    if problem:
        raise ConfigError(problem)
    return "gloo"


def island_backend(plan: Plan, emulate: bool) -> str | None:
    """The backend of the groups of GPU ranks where the world is gloo across vendors (the
    islands' own groups: NCCL on NVIDIA, RCCL on AMD, which ROCm's torch names ``nccl``);
    None where every group takes the world's backend."""
    if emulate or len(_vendors(plan)) < 2 or world_backend(plan, emulate) != "gloo":
        return None
    return "nccl"


def rank_on_gpu(plan: Plan, device_id: str, emulate: bool) -> bool:
    """Whether the rank that runs ``device_id`` computes on a GPU."""
    return not emulate and not Cluster(plan.cluster).device(device_id).type.is_cpu


def start_method(plan: Plan, emulate: bool) -> StartMethod:
    """Spawn the ranks of a run with a GPU rank; fork the others from a fork server."""
    world_backend(plan, emulate)  # a plan no backend serves is refused before any rank starts
    gpus = any(rank_on_gpu(plan, d, emulate) for d in plan.devices)
    return StartMethod.SPAWN if gpus else StartMethod.FORK_SERVER


def _vendors(plan: Plan) -> set[Vendor]:
    cluster = Cluster(plan.cluster)
    return {cluster.device(d).type.vendor for d in plan.devices}


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

