"""Which groups of a plan may join devices of several vendors (NVIDIA, AMD, CPUs): the
rule every layer calls (the runtime's launch and layout, the islands planner). It reads
where each parameter unit lives (:mod:`potluck.placement`), which is why it is not in
:mod:`potluck.plans.feasibility` (``placement`` imports the plans package)."""

from __future__ import annotations

from collections.abc import Sequence

from potluck import placement
from potluck.cluster.topology import Cluster, spans_vendors
from potluck.plans.data import Plan

VENDOR_LABELS = {"cpu": "CPU ranks", "nvidia": "NVIDIA GPUs", "amd": "AMD GPUs"}


def vendors_problem(plan: Plan) -> str | None:
    """Why ``plan``'s devices of several vendors (NVIDIA, AMD, CPUs) cannot run in one job,
    if they cannot. No collective backend joins two vendors (NCCL and RCCL do not talk, and
    potluck's GPU ranks keep their tensors on the GPU), so every group that runs a collective
    holds one vendor: each stage (its tensor-parallel group), the ranks that sum a unit's
    gradients every step (data parallelism, ZeRO's shards, a tied embedding's copies) and each
    expert-parallel group. Vendors meet only where tensors can be staged through host memory
    over gloo: a pipeline's stage-to-stage transfers (HETHUB-style pipelines whose stages are
    NVIDIA GPUs, AMD GPUs or CPUs holding a few layers, :func:`pipeline_spans_vendors`), and
    islands that synchronize rarely (diloco, bounded) through host memory (some island's
    transport host). The runtime asks this of real runs (an emulated run is gloo on every
    rank)."""
    vendor = _device_vendors(plan)
    if len(set(vendor.values())) < 2:
        return None
    for k, pipeline in enumerate(plan.pipelines):
        for j, stage in enumerate(pipeline.stages):
            if len({vendor[d] for d in stage.devices}) > 1:
                return (f"pipeline {k}'s stage {j} mixes {_vendors(stage.devices, vendor)} in "
                        "one tensor-parallel group, but no backend joins two vendors; give "
                        "each stage one vendor's devices")
    problem = _step_groups_problem(plan, vendor)
    if problem:
        return problem
    if plan.islands.split and not plan.islands.host_staged and _crosses_vendors(plan, vendor):
        return ("islands of different vendors cross over the backend, which joins no two "
                "vendors; set their transport to host")
    return None


def pipeline_spans_vendors(plan: Plan, pipeline: int) -> bool:
    """Whether pipeline ``pipeline``'s stages are of several vendors
    (:func:`potluck.cluster.topology.spans_vendors`): its stage-to-stage transfers are then
    staged through host memory over gloo (the runtime's host-staged lanes, the cost model's
    :func:`potluck.planner.network.host_staging_s`)."""
    cluster = Cluster(plan.cluster)
    return spans_vendors(cluster.device(d) for d in plan.pipelines[pipeline].devices)


def _device_vendors(plan: Plan) -> dict[str, str]:
    cluster = Cluster(plan.cluster)
    return {d: cluster.device(d).type.vendor.value for d in plan.devices}


def _step_groups_problem(plan: Plan, vendor: dict[str, str]) -> str | None:
    """The first group that sums every step across vendors: a unit's gradient group in an
    island (or the whole job), or an expert-parallel group."""
    for k, members in enumerate(placement.island_members(plan)):
        where = f"island {k}: " if plan.islands.split else ""
        for unit in placement.parameter_units(plan.model):
            devices = _unit_devices(plan, unit, members)
            if len({vendor[d] for d in devices}) > 1:
                why = ("the tied embedding's copies" if unit == placement.TIED
                       else "data parallelism, ZeRO")
                return (f"{where}the ranks that sum {unit}'s gradients every step ({why}) "
                        f"mix {_vendors(devices, vendor)} in one "
                        "synchronous job, but no backend joins two vendors; split it into "
                        "islands of one vendor each with sync diloco or bounded and transport "
                        "host, or use one vendor (or dry-run it on CPU with --emulate)")
    for first in range(0, plan.dp, plan.ep) if plan.ep > 1 else ():
        for s in range(plan.pipelines[first].pp):
            devices = [d for p in plan.expert_group(first)
                       for d in plan.pipelines[p].stages[s].devices]
            if len({vendor[d] for d in devices}) > 1:
                return (f"stage {s} of pipelines {first}-{first + plan.ep - 1} (an "
                        f"expert-parallel group) mixes {_vendors(devices, vendor)}, but no "
                        "backend joins two vendors; give each expert group one vendor's devices")
    return None


def _unit_devices(plan: Plan, unit: str, pipelines: Sequence[int]) -> list[str]:
    """The devices of every stage of ``pipelines`` that holds ``unit``."""
    return [d for p, s in placement.holders(plan, unit) if p in pipelines
            for d in plan.pipelines[p].stages[s].devices]


def _crosses_vendors(plan: Plan, vendor: dict[str, str]) -> bool:
    """Whether some unit's cross-island group (its holders in every island) mixes vendors."""
    everyone = range(plan.dp)
    return any(len({vendor[d] for d in _unit_devices(plan, unit, everyone)}) > 1
               for unit in placement.parameter_units(plan.model))


def _vendors(devices: Sequence[str], vendor: dict[str, str]) -> str:
    """``NVIDIA GPUs (a.0:0, ...) and AMD GPUs (m.0:0)``: each vendor's first devices."""
    by_vendor: dict[str, list[str]] = {}
    for d in devices:
        by_vendor.setdefault(vendor[d], []).append(d)
    parts = [f"{VENDOR_LABELS[v]} ({', '.join(ds[:2])}{', ...' if len(ds) > 2 else ''})"
             for v, ds in by_vendor.items()]
    return " with ".join(parts)
