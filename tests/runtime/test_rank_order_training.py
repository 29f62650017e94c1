"""Whatever order the ranks are numbered in, a plan trains like one process: a plan in a
framework's rank order (``Placement.RANK_ORDER``), and any plan under torchrun's numbering
(machine by machine, :func:`potluck.runtime.launch.torchrun.torchrun_rank_order`) or a
shuffled one. The local launcher gives rank ``i`` the device ``rank_order[i]``, so these runs
number ranks exactly as those launchers would."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from runtime_helpers import TINY_GPT2, TINY_LLAMA, make_plan, pipe, reference_losses, run_plan

from potluck.cluster.spec import parse_cluster
from potluck.planner.search import SearchOptions, search
from potluck.plans import DType, Execution, Placement, Plan, Schedule, TrainingShape
from potluck.runtime.launch.torchrun import torchrun_rank_order

TWO_MACHINES = parse_cluster(
    "nodes:\n  - name: cpu\n    gpu: cpu\n    gpus_per_node: 2\n    count: 2\n", "cpu2.yaml")
RANK_ORDER = TrainingShape(4, 16, DType.FP32, Execution(placement=Placement.RANK_ORDER))
A0, A1, B0, B1 = "cpu.0:0", "cpu.0:1", "cpu.1:0", "cpu.1:1"
TOLERANCE = 2e-5


def test_rank_order_plan_matches_single_process():
    """tp=1 pp=2 dp=2: replica 0 on ranks 0 and 2, replica 1 on ranks 1 and 3, each stage's
    replicas on one machine."""
    options = SearchOptions(tp=1, pp=2, dp=2, micro_batch_size=1, top_k=1)
    plan = search(TWO_MACHINES, TINY_GPT2, RANK_ORDER, options).best
    assert [[s.devices for s in p.stages] for p in plan.pipelines] == [
        [("cpu.0:0",), ("cpu.1:0",)], [("cpu.0:1",), ("cpu.1:1",)]]
    expected = reference_losses(plan.model, plan.training.global_batch)
    assert run_plan(plan) == pytest.approx(expected, abs=2e-5)


def on_two_machines(pipelines: list, devices: list[str], **options) -> Plan:
    return make_plan(TINY_LLAMA, pipelines, cluster=TWO_MACHINES, device_ids=devices, **options)


def wrap_around() -> Plan:
    """Embedding and head on machine 0: its lane is ranks (0, 2, 3, 1) under torchrun."""
    stages = [(1, (0, 1)), (1, (1, 2)), (1, (2, 3)), (1, (3, 4))]
    return on_two_machines([pipe(stages, 1, 4)], [A0, B0, B1, A1])


def mixed_tp_wrap_around() -> Plan:
    """tp 1-2-1, the middle stage listing its devices against rank order; gpipe."""
    stages = [(1, (0, 1)), (2, (1, 3)), (1, (3, 4))]
    return on_two_machines([pipe(stages, 1, 3)], [A0, B1, B0, A1], schedule=Schedule.GPIPE)


def zero1_tp_replicas() -> Plan:
    """dp=2 x tp=2 with shares 3+2 and ZeRO-1: one replica's devices in rank order, the
    other's against it, so TP index by plan position would pair different shards."""
    plan = on_two_machines([pipe([(2, (0, 4))], 1, 3), pipe([(2, (0, 4))], 1, 2)],
                           [A0, A1, B1, B0])
    return replace(plan, zero=1)


def interleaved_beside_tp() -> Plan:
    """Interleaved 1F1B: a pp=2 pipeline whose stages run against rank order beside a tp=2
    replica (heterogeneous: full-layout gradient groups)."""
    chunked = [(1, ((0, 1), (2, 3))), (1, ((1, 2), (3, 4)))]
    return on_two_machines([pipe(chunked, 1, 4), pipe([(2, ((0, 2), (2, 4)))], 1, 2)],
                           [A1, A0, B1, B0], schedule=Schedule.INTERLEAVED)


def shuffled(plan: Plan) -> tuple[str, ...]:
    """A seeded random permutation (for :func:`interleaved_beside_tp` it puts both the
    pipeline and the tp=2 stage against rank order: ranks (2, 1) and (3, 0))."""
    order = list(plan.devices)
    random.Random(7).shuffle(order)
    return tuple(order)


CASES = {
    "wrap-around pipeline, torchrun order": (wrap_around, torchrun_rank_order),
    "mixed tp 1-2-1 wrap-around, torchrun order": (mixed_tp_wrap_around, torchrun_rank_order),
    "dp x tp with ZeRO-1, torchrun order": (zero1_tp_replicas, torchrun_rank_order),
    "interleaved beside tp=2, shuffled": (interleaved_beside_tp, shuffled),
}


@pytest.mark.parametrize("case", list(CASES))
def test_any_rank_order_trains_like_one_process(case):
    make, order = CASES[case]
    plan = make()
    rank_order = order(plan)
    assert rank_order != plan.devices and sorted(rank_order) == sorted(plan.devices)
    expected = reference_losses(TINY_LLAMA, plan.training.global_batch)
    assert run_plan(plan, rank_order=rank_order) == pytest.approx(expected, abs=TOLERANCE)
