"""When host memory is what stops a plan: the search asked again without that limit.

A request can fail on host memory rather than on the GPUs: the optimizer offloaded to host
memory (ZeRO-Offload) or activations swapped there need each machine's RAM, and a cluster
file that does not give ``host_memory`` gets a default (twice the machine's GPU memory).
The search's own explanation (:func:`potluck.planner.checks.explain_infeasible`) cannot
tell this case apart, so :func:`search_explained` asks the search once more on the same
cluster with unlimited host memory: if that finds a plan, host memory is the limit, and the
message gives the host memory that plan needs on each machine short of it, what the machine
has, and the cluster-file key ``host_memory``. The second search runs only where host memory
can matter (offload or host swaps allowed) and the GPUs could hold the weights and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from potluck.cluster.nodes import MIN_DEFAULT_HOST_MEMORY_BYTES
from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster
from potluck.errors import InfeasibleError
from potluck.model.spec import ModelSpec
from potluck.planner.checks import states_fit_gpus
from potluck.planner.options import SearchOptions
from potluck.planner.search import SearchResult, search
from potluck.plans import HostMemory, Plan, TrainingShape
from potluck.plans.memory import Offload, Swap

UNLIMITED_HOST_BYTES = 1e15  # the what-if's host memory per machine: more than any plan uses
MACHINES_NAMED = 3  # machines a message names; the rest are counted
GB = 1e9


def search_explained(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                     options: SearchOptions,
                     progress: Callable[[float], None] | None = None) -> SearchResult:
    """:func:`~potluck.planner.search.search`, whose InfeasibleError names host memory, with
    numbers, where that is the limit."""
    try:
        return search(spec, model, training, options, progress)
    except InfeasibleError as err:
        reason = host_memory_limit(spec, model, training, options)
        if reason is None:
            raise
        raise InfeasibleError(reason) from err


def host_memory_limit(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                      options: SearchOptions) -> str | None:
    """Why no plan fits when host memory is the limit, or None when it is not (or cannot
    be: nothing may go to host memory, or the GPUs are too small anyway)."""
    if not _host_may_matter(spec, model, training, options):
        return None
    try:
        found = search(unlimited_host(spec), model, training, options)
    except InfeasibleError:
        return None
    return _message(spec, model, found.best)


def unlimited_host(spec: ClusterSpec) -> ClusterSpec:
    """``spec`` with every machine's host memory unlimited."""
    nodes = tuple(replace(group, host_memory_bytes=UNLIMITED_HOST_BYTES) for group in spec.nodes)
    return replace(spec, nodes=nodes)


def _host_may_matter(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                     options: SearchOptions) -> bool:
    if all(group.host_memory_bytes == UNLIMITED_HOST_BYTES for group in spec.nodes):
        return False
    offloads = options.offload is not Offload.NONE
    swaps_to_host = options.swap is None or options.swap.uses_host
    return (offloads or swaps_to_host) and states_fit_gpus(Cluster(spec), model, training)


def _message(spec: ClusterSpec, model: ModelSpec, plan: Plan) -> str | None:
    """The machines ``plan`` needs more host memory on than ``spec`` gives, in one line."""
    assert plan.prediction is not None  # the search predicts every plan it returns
    cluster = Cluster(spec)
    short = sorted((h for h in plan.prediction.host_memory
                    if h.needed_bytes > cluster.host_memory_bytes(h.node)),
                   key=lambda h: h.needed_bytes, reverse=True)
    if not short:
        return None
    machines = "; ".join(_machine_text(cluster, h) for h in short[:MACHINES_NAMED])
    more = len(short) - MACHINES_NAMED
    machines += f"; and {more} more machines" if more > 0 else ""
    return (f"no layout of {model.name} fits: host memory is the limit. The fastest layout "
            f"that fits the GPUs ({plan.layout()}, {_host_use(plan)}) needs {machines}; if the "
            f"machines have more, say so in the cluster (or offers) file: {_settings(short)}; "
            "else add GPUs or machines")


def _machine_text(cluster: Cluster, host: HostMemory) -> str:
    group = cluster.groups[host.node.rsplit(".", 1)[0]]
    if group.host_memory_bytes is not None:
        given = "its host_memory"
    elif cluster.host_memory_bytes(host.node) <= MIN_DEFAULT_HOST_MEMORY_BYTES:
        given = "no host_memory given: the least default"
    else:
        given = "no host_memory given: twice its GPUs' memory"
    return (f"{host.needed_bytes / GB:.0f} GB of host memory on {host.node} "
            f"({host.used_bytes / GB:.0f} GB offloaded or swapped, {host.reserve_bytes / GB:.0f} GB "
            f"for the OS and ranks), which has {cluster.host_memory_bytes(host.node) / GB:.0f} GB "
            f"({given})")


def _settings(short: list[HostMemory]) -> str:
    """``host_memory: 222GB`` for each node group short of it: its most needing machine."""
    needed: dict[str, float] = {}
    for host in short:
        group = host.node.rsplit(".", 1)[0]
        needed[group] = max(needed.get(group, 0.0), host.needed_bytes)
    return ", ".join(f"host_memory: {-(-needed[g] // GB):.0f}GB or more for node group {g}"
                     for g in needed)


def _host_use(plan: Plan) -> str:
    """What the plan puts in host memory, e.g. ``optimizer offloaded on 14 of 14 GPUs``."""
    offloading = sum(1 for k, pipeline in enumerate(plan.pipelines)
                     for i, stage in enumerate(pipeline.stages)
                     for _ in stage.devices
                     if plan.stage_memory(k, i).offload is Offload.OPTIMIZER)
    swapping = sum(1 for k, pipeline in enumerate(plan.pipelines)
                   for i, stage in enumerate(pipeline.stages) for _ in stage.devices
                   if plan.stage_memory(k, i).swap in (Swap.HOST, Swap.HYBRID))
    parts = [f"optimizer offloaded on {offloading} of {plan.num_gpus} GPUs" if offloading else "",
             f"activations swapped to host on {swapping}" if swapping else ""]
    return ", ".join(p for p in parts if p) or "nothing offloaded"
