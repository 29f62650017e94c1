"""A tied embedding's gradient: which rings sum it, and in which phase.

Two pipelines of two stages over the toy cluster of ``test_cost`` (two machines of two GPUs
on PCIe, 8 Gb/s between them): each pipeline's first stage on machine 0, its last stage on
machine 1, so the stages' data-parallel rings stay inside a machine (PCIe) and the tied
weight's sum crosses the network. The model is the toy GPT with its head tied to the
embedding (no learned positions: the embedding is the tied weight alone).
"""

from dataclasses import replace

import pytest
from test_cost import (
    BLOCK_PARAMS,
    NETWORK_BW,
    NETWORK_LATENCY,
    PCIE_BW,
    PCIE_LATENCY,
    SEQ,
    TOY,
    TOY_CLUSTER,
    VOCAB,
    H,
    ring_allreduce_s,
)

from potluck.cluster import Cluster, parse_cluster
from potluck.planner.cost import CostModel
from potluck.planner.evaluate import Collective, gradient_groups, predict, shared_ends
from potluck.plans import Execution, Pipeline, Plan, Stage, TiedGradSync, TrainingShape

TIED = replace(TOY, tied_embeddings=True)
TIED_WEIGHT = VOCAB * H
MEGATRON_ORDER = Execution(overlap_grad_reduce=False, tied_grad_sync=TiedGradSync.PIPELINE_ENDS)


def two_by_two(execution: Execution = Execution()) -> Plan:
    """Pipeline k: box.0:k runs blocks 0-1 (and the embedding), box.1:k blocks 2-3 (and the
    head); two micro-batches of one sequence each."""
    pipelines = tuple(
        Pipeline((Stage((f"box.0:{k}",), ((0, 2),)), Stage((f"box.1:{k}",), ((2, 4),))), 1, 2)
        for k in (0, 1))
    spec = parse_cluster(TOY_CLUSTER, "toy.yaml")
    return Plan(spec, TIED, TrainingShape(4, SEQ, execution=execution), pipelines)


def cost(plan: Plan) -> CostModel:
    return CostModel.for_plan(plan)


def test_megatron_order_sums_the_tied_weight_after_the_data_parallel_rings():
    """Megatron-LM's order (DeepSpeed's costs the same without overlap): the first stages'
    ring (inside machine 0, over PCIe) sums the embedding with the blocks once the backward
    passes end; then each pipeline's two ends sum the tied weight, two pairs crossing both
    cards at once (half of 8 Gb/s each). The first stages finish last (1F1B), so the exposed
    reduction is the one ring, then the pairs: their sum, not their maximum."""
    prediction = predict(two_by_two(MEGATRON_ORDER))
    first_stage = 2 * (2 * BLOCK_PARAMS + TIED_WEIGHT)  # BF16 bytes
    data_parallel = ring_allreduce_s(first_stage, 2, PCIE_BW, PCIE_LATENCY)  # 3.4 ms
    tied = ring_allreduce_s(2 * TIED_WEIGHT, 2, NETWORK_BW / 2, NETWORK_LATENCY)  # 33.7 ms
    assert prediction.breakdown.dp_s == pytest.approx(data_parallel + tied, rel=1e-9)


def test_potluck_sums_the_tied_weight_once_over_every_holder_after_the_backward():
    """potluck's runtime: the tied weight is a bucket of its own over all four holders, launched
    once the first stages' backward is over; the stages' rings leave it out and hide behind the
    last backward (PCIe). The holders' ring visits machine 0, then machine 1: it crosses each
    card once and, the only ring crossing them, has them to itself."""
    prediction = predict(two_by_two())
    tied = ring_allreduce_s(2 * TIED_WEIGHT, 4, NETWORK_BW, NETWORK_LATENCY)  # 25.5 ms
    assert prediction.breakdown.dp_s == pytest.approx(tied, rel=1e-9)


def test_each_setting_groups_the_tied_weight_as_its_framework_does():
    potluck = two_by_two()
    groups = gradient_groups(cost(potluck), potluck)
    assert [g.members for g in groups] == [[(0, 0), (1, 0)], [(0, 1), (1, 1)],
                                           [(0, 0), (1, 0), (0, 1), (1, 1)]]
    assert [[d.id for d in g.rings[0]] for g in groups][2] == [
        "box.0:0", "box.0:1", "box.1:0", "box.1:1"]  # one machine after the other
    # the stages' rings without the tied weight; the last stage's final LayerNorm (2h)
    assert [g.grad_bytes for g in groups] == [2 * 2 * BLOCK_PARAMS,
                                              2 * (2 * BLOCK_PARAMS + 2 * H), 2 * TIED_WEIGHT]
    assert [(g.phase, g.after_backward, g.gathers) for g in groups] == [
        (0, False, True), (0, False, True), (0, True, True)]

    megatron = two_by_two(MEGATRON_ORDER)
    groups = gradient_groups(cost(megatron), megatron)
    assert [g.members for g in groups] == [[(0, 0), (1, 0)], [(0, 1), (1, 1)],
                                           [(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert [g.grad_bytes for g in groups] == [
        2 * (2 * BLOCK_PARAMS + TIED_WEIGHT), 2 * (2 * BLOCK_PARAMS + 2 * H + TIED_WEIGHT),
        2 * TIED_WEIGHT, 2 * TIED_WEIGHT]
    # the pairs come after the stages' rings, and ZeRO-1 gathers nothing over them (both
    # ends hold the whole weight and apply the same update)
    assert [(g.phase, g.after_backward, g.gathers) for g in groups[2:]] == [(1, True, False)] * 2


def test_rings_share_a_card_only_while_both_run():
    """Two rings across both machines (1 GB/s cards): A moves 30 MB from t = 0, B 10 MB from
    t = 10 ms. A alone until 10 ms (10 MB), both at half speed until B is done at 30 ms (A:
    10 MB more), A alone again for its last 10 MB: 40 ms. Sharing for their whole lives
    would have ended A at 60 ms."""
    devices = Cluster(parse_cluster(TOY_CLUSTER, "toy.yaml")).device
    ring_a = [devices("box.0:0"), devices("box.1:0")]
    ring_b = [devices("box.0:1"), devices("box.1:1")]
    plan = two_by_two()
    ends = shared_ends(cost(plan), [Collective([ring_a], 0.0, 30e6, 0.0),
                                    Collective([ring_b], 0.01, 10e6, 0.0)])
    assert ends == pytest.approx([0.04, 0.03], rel=1e-9)
    # a collective ends no earlier than its members' gradients are complete
    late = shared_ends(cost(plan), [Collective([ring_a], 0.0, 1e6, 0.5)])
    assert late == pytest.approx([0.5])
