"""Every communicator exists and has been used once before the first step.

On gloo CPU ranks a process group's sequence number counts its collectives and its sends
and receives (``ProcessGroup._get_sequence_number_for_group``), so a rank can tell, when
``start`` returns, which groups were used; the tests then train one step and check that
it made no group of its own and sent point to point only between pairs the warm-up had
already connected on the same group (NCCL keeps a two-rank communicator per pair for
unbatched sends: ``ProcessGroupNCCL::pointToPoint``).

No GPU here for the device: :func:`start` on a GPU plan runs against a fake of CUDA (one
of two GPUs) and of ``init_process_group`` (recording its arguments, then joining a gloo
world of one), to show that a GPU rank joins with its ``device_id``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from runtime_helpers import LR, TINY_LLAMA, make_plan, pipe

from potluck.cluster.spec import parse_cluster
from potluck.plans import CommSchedule, Plan, Schedule
from potluck.runtime.launch import session as session_module
from potluck.runtime.launch.local import run_local
from potluck.runtime.layout import Layout
from potluck.runtime.options import TrainOptions

HALVES = [(1, (0, 2)), (1, (2, 4))]
PLANS = {
    "dp=2 x pp=2, split channels": lambda: replace(
        make_plan(TINY_LLAMA, [pipe(HALVES, 1, 2), pipe(HALVES, 1, 2)]),
        comm=CommSchedule(split_p2p_channels=True)),
    "tp=2 x pp=2": lambda: make_plan(TINY_LLAMA, [pipe([(2, (0, 2)), (2, (2, 4))], 1, 2)]),
    "stages with tp 1 then 2 (leaders and a follower)": lambda: make_plan(
        TINY_LLAMA, [pipe([(1, (0, 1)), (2, (1, 4))], 1, 2)]),
    "interleaved, pp=2 x virtual 2": lambda: make_plan(
        TINY_LLAMA, [pipe([(1, ((0, 1), (2, 3))), (1, ((1, 2), (3, 4)))], 1, 4)],
        schedule=Schedule.INTERLEAVED),
}


@dataclass
class Seen:
    unused_at_start: list[str]  # groups of this process not used when start returned
    made_in_step: int  # process groups created after start
    step_pairs: set[tuple[str, frozenset[int]]]  # (group, ranks) of the step's single sends
    warm_pairs: set[tuple[str, frozenset[int]]]  # the same, of the warm-up's


def _groups() -> dict[str, dist.ProcessGroup]:
    return {name: pg for pg, name in dist.distributed_c10d._world.pg_names.items()}


def _pair(op_group: dist.ProcessGroup | None, me: int, peer: int) -> tuple[str, frozenset[int]]:
    group = op_group or dist.group.WORLD
    return dist.distributed_c10d._world.pg_names[group], frozenset((me, peer))


def _watching_rank(plan: Plan, options: TrainOptions) -> Seen:
    """Train ``plan`` on this rank, noting what start and the step do (this process only)."""
    from torch.distributed.pipelining import schedules

    from potluck.runtime import training

    seen = Seen([], 0, set(), set())
    started = []
    real_start, batch_p2p = training.start, schedules._batch_p2p
    make_group = dist.distributed_c10d._new_process_group_helper
    send, recv = dist.send, dist.recv

    def noting_start(*args, **kwargs):
        session = real_start(*args, **kwargs)
        seen.unused_at_start = sorted(name for name, pg in _groups().items()
                                      if pg._get_sequence_number_for_group() == 0)
        started.append(True)
        return session

    def noting_group(*args, **kwargs):
        seen.made_in_step += bool(started)
        return make_group(*args, **kwargs)

    def noting_send(tensor, dst=None, group=None, *args, **kwargs):
        seen.warm_pairs.add(_pair(group, dist.get_rank(), dst))
        return send(tensor, dst, group, *args, **kwargs)

    def noting_recv(tensor, src=None, group=None, *args, **kwargs):
        seen.warm_pairs.add(_pair(group, dist.get_rank(), src))
        return recv(tensor, src, group, *args, **kwargs)

    def noting_batch(ops, desc=None):
        if len({op.op for op in ops}) == 1:  # torch sends these one by one, unbatched
            seen.step_pairs |= {_pair(op.group, dist.get_rank(), op.peer) for op in ops}
        return batch_p2p(ops, desc=desc)

    training.start, schedules._batch_p2p = noting_start, noting_batch
    dist.distributed_c10d._new_process_group_helper = noting_group
    dist.send, dist.recv = noting_send, noting_recv
    training.train_rank(plan, options)
    return seen


@pytest.mark.parametrize("case", list(PLANS))
def test_every_group_is_used_before_the_first_step(case):
    plan = PLANS[case]()
    options = TrainOptions(steps=1, lr=LR, progress=False, timeout_s=45)
    for rank, seen in enumerate(run_local(_watching_rank, plan.devices, (plan, options),
                                          timeout_s=90)):
        assert seen.unused_at_start == [], f"rank {rank}"
        assert seen.made_in_step == 0, f"rank {rank}"
        assert seen.step_pairs <= seen.warm_pairs, f"rank {rank}"


def test_lane_neighbours_include_the_wrap_of_an_interleaved_pipeline():
    model = replace(TINY_LLAMA, num_layers=6)
    stages = [(1, ((0, 1), (3, 4))), (1, ((1, 2), (4, 5))), (1, ((2, 3), (5, 6)))]
    plan = make_plan(model, [pipe(stages, 1, 3)], schedule=Schedule.INTERLEAVED)
    assert Layout.for_local_ranks(plan, 0).lane_neighbours() == [(0, 1), (2, 0)]
    assert Layout.for_local_ranks(plan, 1).lane_neighbours() == [(0, 1), (1, 2)]
    one_chunk = make_plan(model, [pipe([(1, (0, 2)), (1, (2, 4)), (1, (4, 6))], 1, 3)])
    assert Layout.for_local_ranks(one_chunk, 2).lane_neighbours() == [(1, 2)]


# ---- a GPU rank joins with its device (fake CUDA) ---------------------------------------------


class FakeCuda:
    """Two visible GPUs; records the device made current and init_process_group's arguments,
    then joins a gloo world of one in their place."""

    def __init__(self) -> None:
        self.current: torch.device | None = None
        self.init_kwargs: dict = {}
        self.warmed_on: torch.device | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(dist, "init_process_group", self.init_process_group)
        monkeypatch.setattr(session_module, "warm_up", self.warm_up, raising=False)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "POTLUCK_DEVICE",
                     "POTLUCK_NODE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
            monkeypatch.delenv(name, raising=False)

    def set_device(self, device: torch.device) -> None:
        self.current = device

    def init_process_group(self, backend: str, **kwargs) -> None:
        self.init_kwargs = {"backend": backend, **kwargs}
        kwargs.pop("device_id", None)
        dist.distributed_c10d.init_process_group("gloo", **kwargs)

    def warm_up(self, layout: Layout, device: torch.device) -> None:
        self.warmed_on = device


def test_a_gpu_rank_joins_with_its_device_so_nccl_starts_eagerly(monkeypatch):
    cluster = parse_cluster("nodes:\n  - {name: box, gpu: a100-80g-sxm, gpus_per_node: 2}\n")
    plan = make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 2)], cluster=cluster,
                     device_ids=["box.0:1"])
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    session = session_module.start(plan, silence_s=30)
    try:
        gpu = torch.device("cuda", 1)
        assert cuda.current == gpu and session.device == gpu
        assert cuda.init_kwargs["backend"] == "nccl" and cuda.init_kwargs["device_id"] == gpu
        assert cuda.warmed_on == gpu
    finally:
        session.close()
