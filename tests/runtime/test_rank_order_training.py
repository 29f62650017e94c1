"""A plan in a framework's rank order (``Placement.RANK_ORDER``) trains like any other plan: the
runtime runs the plan's placement, whoever chose it."""

from __future__ import annotations

import pytest
from runtime_helpers import TINY_GPT2, reference_losses, run_plan

from potluck.cluster.spec import parse_cluster
from potluck.planner.search import SearchOptions, search
from potluck.plans import DType, Execution, Placement, TrainingShape

TWO_MACHINES = parse_cluster(
    "nodes:\n  - name: cpu\n    gpu: cpu\n    gpus_per_node: 2\n    count: 2\n", "cpu2.yaml")
RANK_ORDER = TrainingShape(4, 16, DType.FP32, Execution(placement=Placement.RANK_ORDER))


def test_rank_order_plan_matches_single_process():
    """tp=1 pp=2 dp=2: replica 0 on ranks 0 and 2, replica 1 on ranks 1 and 3, each stage's
    replicas on one machine."""
    options = SearchOptions(tp=1, pp=2, dp=2, micro_batch_size=1, top_k=1)
    plan = search(TWO_MACHINES, TINY_GPT2, RANK_ORDER, options).best
    assert [[s.devices for s in p.stages] for p in plan.pipelines] == [
        [("cpu.0:0",), ("cpu.1:0",)], [("cpu.0:1",), ("cpu.1:1",)]]
    expected = reference_losses(plan.model, plan.training.global_batch)
    assert run_plan(plan) == pytest.approx(expected, abs=2e-5)
