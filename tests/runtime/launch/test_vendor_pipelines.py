"""Pipelines whose stages span vendors (HETHUB-style: NVIDIA GPUs, AMD GPUs, CPUs holding a few
layers): their lanes stay on the gloo world, their PipelineStages receive host tensors and
their stage modules copy to the rank's device and back (:class:`HostStaged`). On CPU ranks
(``--emulate``) the copies are no-ops but the host-staged path runs; a fake CUDA device shows
where each tensor lives."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from runtime_helpers import TINY_LLAMA, make_plan, pipe, run_plan

from potluck.cluster.spec import parse_cluster
from potluck.plans import CommSchedule, Schedule
from potluck.plans.vendors import vendors_problem
from potluck.runtime.launch.gpus import island_backend, world_backend
from potluck.runtime.layout import Layout
from potluck.runtime.parallel.pipeline import HostStaged

VENDORS = parse_cluster("nodes:\n  - {name: nv, gpu: rtx3090, gpus_per_node: 2}\n"
                        "  - {name: amd, gpu: mi250, gpus_per_node: 2}\n"
                        "  - {name: cpu, gpu: cpu, gpus_per_node: 2}\n", "vendors.yaml")
TWO_STAGES = [(1, (0, 3)), (1, (3, 4))]  # the CPU box holds one layer, as HeterPS places them
CUDA = torch.device("cuda", 0)


CASES = {
    "1f1b": (TWO_STAGES, {}, None),
    # two chunks per rank, weight passes of their own, gradients on the lanes' second group
    "zero bubble, virtual 2, split channels": (
        [(1, ((0, 1), (2, 3))), (1, ((1, 2), (3, 4)))], {"schedule": Schedule.ZERO_BUBBLE},
        CommSchedule(split_p2p_channels=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_pipeline_over_a_gpu_and_a_cpu_trains_as_the_plain_gloo_pipeline(case):
    """Bit for bit: staging moves the activations and gradients, never rounds them."""
    stages, options, comm = CASES[case]
    mixed = make_plan(TINY_LLAMA, [pipe(stages, 1, 4)], cluster=VENDORS,
                      device_ids=["nv.0:0", "cpu.0:0"], **options)
    plain = make_plan(TINY_LLAMA, [pipe(stages, 1, 4)], **options)
    if comm is not None:
        mixed, plain = replace(mixed, comm=comm), replace(plain, comm=comm)
    assert Layout.for_local_ranks(mixed, 0).lane_on_host
    assert not Layout.for_local_ranks(plain, 0).lane_on_host
    assert run_plan(mixed, emulate=True, dilation=1.0) == run_plan(plain)


def test_an_nvidia_to_amd_pipeline_runs_its_stages_over_nccl_and_its_lanes_over_gloo(
        monkeypatch):
    """Each stage's tensor-parallel group is one vendor's (nccl: RCCL on AMD); the lanes
    (ranks 0-2 and 1-3) join two vendors, so they stay on the gloo world."""
    plan = make_plan(TINY_LLAMA, [pipe([(2, (0, 2)), (2, (2, 4))], 1, 2)], cluster=VENDORS,
                     device_ids=["nv.0:0", "nv.0:1", "amd.0:0", "amd.0:1"])
    assert vendors_problem(plan) is None
    assert world_backend(plan, emulate=False) == "gloo"
    made: list[tuple[tuple[int, ...], str | None]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None: made.append(
        (tuple(ranks), backend)) or object())
    layout = Layout.for_local_ranks(plan, 0)
    layout.create_groups(island_backend(plan, emulate=False))
    backends = dict(made)
    assert backends[(0, 1)] == backends[(2, 3)] == "nccl"
    assert backends[(0, 2)] is None and backends[(1, 3)] is None
    assert layout.lane_on_host


class FakeCuda:
    """Which storages a fake ``Tensor.to("cuda")`` put "on the device": ``to`` a CUDA device
    copies and remembers the copy, ``to`` the CPU copies a remembered one back."""

    def __init__(self) -> None:
        self.on_device: set[int] = set()

    def where(self, tensor: torch.Tensor) -> str:
        return "device" if tensor.untyped_storage().data_ptr() in self.on_device else "host"


TO = torch.Tensor.to


@pytest.fixture
def fake(monkeypatch) -> FakeCuda:
    fake = FakeCuda()

    def to(tensor, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and device.type == "cuda":
            moved = TO(tensor, "cpu", copy=True)
            fake.on_device.add(moved.untyped_storage().data_ptr())
            return moved
        if device is not None and fake.where(tensor) == "device":
            return TO(tensor, "cpu", copy=True)
        return TO(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return fake


class Recorder(torch.nn.Module):
    """A stage that doubles its input and remembers where the input was."""

    def __init__(self, fake: FakeCuda) -> None:
        super().__init__()
        self.fake, self.seen = fake, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.fake.where(x))
        output = 2 * x
        self.fake.on_device.add(output.untyped_storage().data_ptr())  # computed on the GPU
        return output


@pytest.mark.parametrize("last", [False, True])
def test_a_host_staged_stage_computes_on_the_device_and_hands_its_lane_host_tensors(
        fake, last):
    """The received (host) activation reaches the module on the device; the output leaves in
    host memory, except the last stage's, which the loss takes on the device; the gradient
    comes back to the host input."""
    inner = Recorder(fake)
    received = torch.arange(4.0, requires_grad=True)
    output = HostStaged(inner, CUDA, last=last)(received)
    assert inner.seen == ["device"]
    assert fake.where(output) == ("device" if last else "host")
    output.sum().backward()
    assert torch.equal(received.grad, torch.full((4,), 2.0))
