"""Islands of other vendors or of CPUs in one job: accepted when every link between vendors is
a host-staged island boundary (the world gloo, each GPU island's groups over nccl, the
cross-island groups gloo), refused in one line otherwise."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

import pytest
import torch.distributed as dist
from dist_harness import run_ranks
from island_workers import split
from runtime_helpers import TINY_GPT2, TINY_LLAMA, make_plan, pipe

from potluck.cluster.spec import parse_cluster
from potluck.errors import ConfigError
from potluck.plans import Island, Transport, load_plan, save_plan
from potluck.plans.vendors import vendors_problem
from potluck.runtime.launch.gpus import StartMethod, island_backend, start_method, world_backend
from potluck.runtime.layout import Layout

VENDORS = parse_cluster("nodes:\n  - {name: nv, gpu: rtx3090, gpus_per_node: 2}\n"
                        "  - {name: amd, gpu: mi250, gpus_per_node: 2}\n"
                        "  - {name: cpu, gpu: cpu, gpus_per_node: 2}\n", "vendors.yaml")
ONE_STAGE = [(1, (0, 4))]
TIMEOUT = timedelta(seconds=30)


def _replicas(devices):
    return make_plan(TINY_LLAMA, [pipe(ONE_STAGE, 1, 1)] * len(devices), cluster=VENDORS,
                     device_ids=devices)


def _host(plan):
    islands = tuple(Island(i.pipelines, Transport.HOST) for i in plan.islands.islands)
    return replace(plan, islands=replace(plan.islands, islands=islands))


NV_AMD = ["nv.0:0", "nv.0:1", "amd.0:0", "amd.0:1"]


def _vendor_islands(devices=NV_AMD):
    return _host(split(_replicas(devices), (0, 1), (2, 3), inner_steps=2))


def test_host_staged_islands_of_one_vendor_each_run_over_a_gloo_world():
    for devices in (NV_AMD, ["nv.0:0", "nv.0:1", "cpu.0:0", "cpu.0:1"]):
        plan = _vendor_islands(devices)
        assert vendors_problem(plan) is None
        assert world_backend(plan, emulate=False) == "gloo"
        assert island_backend(plan, emulate=False) == "nccl"
        assert start_method(plan, emulate=False) is StartMethod.SPAWN
    one_vendor = _replicas(["nv.0:0", "nv.0:1"])
    assert world_backend(one_vendor, emulate=False) == "nccl"
    assert island_backend(one_vendor, emulate=False) is None
    assert island_backend(_vendor_islands(), emulate=True) is None


@pytest.mark.parametrize("plan, words", [
    (make_plan(TINY_LLAMA, [pipe([(2, (0, 4))], 1, 1)], cluster=VENDORS,
               device_ids=["nv.0:0", "amd.0:0"]),
     "pipeline 0's stage 0 mixes NVIDIA GPUs (nv.0:0) with AMD GPUs (amd.0:0) in one "
     "tensor-parallel group"),
    (make_plan(TINY_LLAMA, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 1)] * 2, cluster=VENDORS,
               device_ids=["nv.0:0", "cpu.0:0", "amd.0:0", "cpu.0:1"]),
     "the ranks that sum embed's gradients every step (data parallelism, ZeRO) mix NVIDIA "
     "GPUs (nv.0:0) with AMD GPUs (amd.0:0)"),
    (make_plan(TINY_GPT2, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 1)], cluster=VENDORS,
               device_ids=["nv.0:0", "cpu.0:0"]),
     "the ranks that sum embed+head's gradients every step (the tied embedding's copies) mix "
     "NVIDIA GPUs (nv.0:0) with CPU ranks (cpu.0:0)"),
    (_replicas(NV_AMD), "mix NVIDIA GPUs (nv.0:0, nv.0:1) with AMD GPUs (amd.0:0, amd.0:1) "
                        "in one synchronous job"),
    (_host(split(_replicas(NV_AMD), (0, 2), (1, 3), inner_steps=2)), "island 0: the ranks"),
    (split(_replicas(NV_AMD), (0, 1), (2, 3), inner_steps=2), "set their transport to host"),
])
def test_what_cannot_join_two_vendors_is_one_line(plan, words):
    with pytest.raises(ConfigError) as err:
        world_backend(plan, emulate=False)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert world_backend(plan, emulate=True) == "gloo"  # a dry run on CPU still runs it


def test_each_gpu_islands_groups_take_nccl_and_the_crossing_ones_gloo(monkeypatch):
    """NVIDIA island (ranks 0-1), CPU island (ranks 2-3): the NVIDIA island's groups over
    nccl, the CPU island's over the (gloo) world's backend, the cross-island ones gloo."""
    made: list[tuple[tuple[int, ...], str | None]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None: made.append(
        (tuple(ranks), backend)) or object())
    plan = _vendor_islands(["nv.0:0", "nv.0:1", "cpu.0:0", "cpu.0:1"])
    Layout.for_local_ranks(plan, 0).create_groups(island_backend(plan, emulate=False))
    backends = dict(made)
    assert backends[(0, 1)] == "nccl" and backends[(2, 3)] is None
    assert backends[(0, 1, 2, 3)] == "gloo"



def _join_a_gpu_islands_group(rank: int, world_size: int) -> None:
    """Rank 0 stands for a GPU island of one rank (its group over gloo here, nccl there);
    rank 1, a CPU rank, asks for nccl as the layout does on every rank."""
    group = dist.new_group([0], backend="gloo" if rank == 0 else "nccl", timeout=TIMEOUT)
    assert (group is dist.GroupMember.NON_GROUP_MEMBER) == (rank == 1)
    dist.barrier()


def test_a_cpu_rank_takes_part_in_making_a_gpu_islands_nccl_group_without_nccl():
    """What the mixed world relies on (torch's ``_new_process_group_helper``): a rank
    outside a new group gets ``NON_GROUP_MEMBER`` before any backend is made, so torch built
    without NCCL (this one) still makes the call."""
    run_ranks(_join_a_gpu_islands_group, 2)



def _without_vendors(value):
    """A plan file's JSON as written before device types had a vendor."""
    if isinstance(value, dict):
        return {k: _without_vendors(v) for k, v in value.items() if k != "vendor"}
    if isinstance(value, list):
        return [_without_vendors(v) for v in value]
    return value


def test_a_plan_file_without_vendors_still_runs_its_cpu_ranks_over_gloo(tmp_path):
    """The CPU type is the CPU's whatever the file says (a file without vendors: nvidia)."""
    plan = _replicas(["cpu.0:0", "cpu.0:1"])
    save_plan(plan, tmp_path / "plan.json")
    old = _without_vendors(json.loads((tmp_path / "plan.json").read_text()))
    assert '"vendor"' not in json.dumps(old)
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert world_backend(load_plan(tmp_path / "old.json"), emulate=False) == "gloo"
