"""The simulator runs a plan in a framework's rank order (``Placement.RANK_ORDER``) and agrees
with the cost model on it."""

from __future__ import annotations

import pytest

from potluck.cluster import parse_cluster
from potluck.model.loading import model_from_hf_config
from potluck.planner.search import SearchOptions, search
from potluck.plans import DType, Execution, Placement, TiedGradSync, TrainingShape
from potluck.sim import simulate

MIXED = parse_cluster("""
nodes:
  - {name: a, gpu: v100-16g, gpus_per_node: 2, count: 2, inter_bandwidth: 10Gb/s}
  - {name: b, gpu: t4, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
""", "mixed.yaml")


@pytest.mark.parametrize("tied_sync", list(TiedGradSync))
def test_simulator_runs_a_rank_order_plan(tied_sync: TiedGradSync):
    """Replicas on different GPU types, gradient rings across machines that start at different
    times, the tied embedding summed over all its holders with the stages' rings (potluck) or
    between each pipeline's ends after them (Megatron-LM): both price the same phases."""
    model = model_from_hf_config({"model_type": "gpt2", "n_layer": 6, "n_embd": 512, "n_head": 8,
                                  "vocab_size": 50257, "n_positions": 1024}, name="gpt2-6l")
    assert model.tied_embeddings
    execution = Execution(placement=Placement.RANK_ORDER, tied_grad_sync=tied_sync)
    shape = TrainingShape(24, 512, DType.FP16, execution)
    plan = search(MIXED, model, shape, SearchOptions(tp=1, pp=2, dp=3, top_k=1)).best
    assert [p.stages[1].devices for p in plan.pipelines] == [("a.1:1",), ("b.0:0",), ("b.0:1",)]
    result = simulate(plan)
    assert result.iteration_time_s > 0
    assert result.iteration_time_s == pytest.approx(result.predicted_time_s, rel=0.1)
