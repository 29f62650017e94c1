"""Layouts in a framework's rank order (``Placement.RANK_ORDER``): Megatron-LM and DeepSpeed put
replica d of stage s on the tp ranks from (s * dp + d) * tp on, over the devices in the cluster
file's order, and split the blocks evenly (the first stages one more)."""

from dataclasses import replace

import pytest

from potluck.cluster import parse_cluster
from potluck.errors import ConfigError, InfeasibleError
from potluck.model.loading import load_model, model_from_hf_config
from potluck.planner.search import SearchOptions, search
from potluck.plans import (
    DType,
    Execution,
    Placement,
    TrainingShape,
    check_plan,
    plan_from_dict,
    plan_to_dict,
    plan_to_json,
)
from potluck.schedules import Schedule

# two V100 machines, then one T4 machine, two GPUs each, as a hostfile would list them
MIXED = parse_cluster("""
nodes:
  - {name: a, gpu: v100-16g, gpus_per_node: 2, count: 2, inter_bandwidth: 10Gb/s}
  - {name: b, gpu: t4, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
""", "mixed.yaml")
RANK_ORDER = Execution(placement=Placement.RANK_ORDER)
SHAPE = TrainingShape(24, 512, DType.FP16, RANK_ORDER)


@pytest.fixture(scope="module")
def gpt2_small():
    return model_from_hf_config({"model_type": "gpt2", "n_layer": 6, "n_embd": 512, "n_head": 8,
                                 "vocab_size": 50257, "n_positions": 1024}, name="gpt2-6l")


def _plan(model, options, spec=MIXED, shape=SHAPE):
    plan = search(spec, model, shape, replace(options, top_k=1)).best
    check_plan(plan)
    return plan


def _stages(plan):
    return [[stage.devices for stage in pipeline.stages] for pipeline in plan.pipelines]


def test_tp1_pp3_dp2_each_stage_on_one_machine(gpt2_small):
    """Ranks 0-1 (machine a.0) are stage 0 of replicas 0 and 1, ranks 2-3 stage 1, 4-5 stage 2."""
    plan = _plan(gpt2_small, SearchOptions(tp=1, pp=3, dp=2))
    assert _stages(plan) == [[("a.0:0",), ("a.1:0",), ("b.0:0",)],
                             [("a.0:1",), ("a.1:1",), ("b.0:1",)]]
    assert [s.num_layers for s in plan.pipelines[0].stages] == [2, 2, 2]


def test_tp1_pp2_dp3_replicas_straddle_machines_with_one_even_split(gpt2_small):
    """Stage 0 is ranks 0-2 (a.0:0, a.0:1, a.1:0), stage 1 ranks 3-5 (a.1:1, b.0:0, b.0:1):
    replicas on different GPU types still split the blocks the same, even way."""
    plan = _plan(gpt2_small, SearchOptions(tp=1, pp=2, dp=3))
    assert _stages(plan) == [[("a.0:0",), ("a.1:1",)],
                             [("a.0:1",), ("b.0:0",)],
                             [("a.1:0",), ("b.0:1",)]]
    assert {tuple(s.num_layers for s in p.stages) for p in plan.pipelines} == {(3, 3)}
    assert [p.num_micro_batches for p in plan.pipelines] == [p.num_micro_batches
                                                             for p in plan.pipelines[:1]] * 3


def test_tp2_pp3_one_stage_per_machine_and_extra_layer_on_the_first_stages():
    """tp=2: each machine is one tensor-parallel group; 8 blocks over 3 stages: 3, 3, 2
    (DeepSpeed's partition_uniform gives the first stages the remainder)."""
    model = model_from_hf_config({"model_type": "gpt2", "n_layer": 8, "n_embd": 512, "n_head": 8,
                                  "vocab_size": 50257, "n_positions": 1024}, name="gpt2-8l")
    plan = _plan(model, SearchOptions(tp=2, pp=3, dp=1))
    assert _stages(plan) == [[("a.0:0", "a.0:1"), ("a.1:0", "a.1:1"), ("b.0:0", "b.0:1")]]
    assert [s.num_layers for s in plan.pipelines[0].stages] == [3, 3, 2]


def test_pinned_layout_smaller_than_the_cluster_runs_on_the_first_ranks(gpt2_small):
    plan = _plan(gpt2_small, SearchOptions(tp=1, pp=2, dp=1))
    assert _stages(plan) == [[("a.0:0",), ("a.0:1",)]]
    assert set(plan.unused_devices) == {"a.1:0", "a.1:1", "b.0:0", "b.0:1"}


def _expected(plan, devices):
    tp, pp, dp = plan.pipelines[0].stages[0].tp, plan.pipelines[0].pp, plan.dp
    return [[tuple(devices[(s * dp + d) * tp:(s * dp + d + 1) * tp]) for s in range(pp)]
            for d in range(dp)]


def test_search_returns_only_rank_order_layouts_over_a_hostfile(gpt2_small):
    """Every plan is the framework's rank order over a hostfile a user could write: the node
    groups in the cluster file's order or fastest first (here both: the V100s, then the
    T4s), cut after a group, the groups left out not launched."""
    devices = ["a.0:0", "a.0:1", "a.1:0", "a.1:1", "b.0:0", "b.0:1"]
    plans = search(MIXED, gpt2_small, SHAPE, SearchOptions(top_k=5)).plans
    assert len(plans) > 1
    for plan in plans:
        check_plan(plan)
        launched = len(plan.devices)
        assert launched in (4, 6) and set(plan.unused_devices) == set(devices[launched:])
        assert _stages(plan) == _expected(plan, devices[:launched])
        layers = {tuple(s.num_layers for s in p.stages) for p in plan.pipelines}
        assert len(layers) == 1 and max(*layers) - min(*layers) <= 1
        assert len({p.num_micro_batches for p in plan.pipelines}) == 1


def test_the_hostfile_may_put_the_fastest_machines_first():
    """T4s listed first in the cluster file: a framework user would list the V100s first
    (or alone), and the plan says which hostfile order it assumes."""
    spec = parse_cluster("""
nodes:
  - {name: slow, gpu: t4, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: fast, gpu: a100-80g-sxm, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
""", "slow-first.yaml")
    model = load_model("gpt3-350m")
    plan = search(spec, model, SHAPE, SearchOptions(top_k=1)).best
    assert plan.pipelines[0].stages[0].devices[0].startswith("fast.")
    assert any("hostfile order fast" in note for note in plan.notes)


def test_tp_groups_never_span_machines(gpt2_small):
    """tp=4 fits machine b, but in rank order ranks 0-3 are a.0's two GPUs and two of b's: no
    layout, and the reason says so."""
    spec = parse_cluster("""
nodes:
  - {name: a, gpu: v100-16g, gpus_per_node: 2}
  - {name: b, gpu: v100-16g, gpus_per_node: 4}
  - {name: c, gpu: v100-16g, gpus_per_node: 2}
""", "uneven.yaml")
    with pytest.raises(InfeasibleError, match="span two machines"):
        search(spec, gpt2_small, SHAPE, SearchOptions(tp=4))


def test_pins_that_multiply_to_no_hostfile_are_refused(gpt2_small):
    """The hostfiles hold 4 (the V100s) or 6 devices: pp=5 divides neither."""
    assert search(MIXED, gpt2_small, SHAPE, SearchOptions(pp=4)).best.num_gpus == 4
    with pytest.raises(InfeasibleError, match="multiplies to the 4 or 6 devices"):
        search(MIXED, gpt2_small, SHAPE, SearchOptions(pp=5))


TWO_MACHINES = parse_cluster(
    "nodes: [{name: a, gpu: v100-16g, gpus_per_node: 2, count: 2, inter_bandwidth: 10Gb/s}]",
    "two.yaml")


def test_rank_order_moves_the_gradient_ring_onto_the_machine_and_the_pipeline_off_it():
    """tp=1 pp=2 dp=2 at a large batch: potluck keeps each pipeline inside one machine and
    reduces gradients over the 10 Gb/s network; in rank order stage 0 is machine a.0 (ranks
    0-1) and stage 1 machine a.1, so the gradients stay on the machine and the activations
    cross the network instead: a different prediction, for that reason."""
    model = model_from_hf_config({"model_type": "gpt2", "n_layer": 8, "n_embd": 1024,
                                  "n_head": 16, "vocab_size": 50257, "n_positions": 1024,
                                  "tie_word_embeddings": False}, name="gpt2-8l-untied")
    options = SearchOptions(tp=1, pp=2, dp=2, micro_batch_size=8, top_k=1)
    planned_shape = TrainingShape(256, 1024, DType.FP16)
    planned = search(TWO_MACHINES, model, planned_shape, options).best
    ranked = search(TWO_MACHINES, model, replace(planned_shape, execution=RANK_ORDER),
                    options).best
    assert _stages(planned) == [[("a.0:0",), ("a.0:1",)], [("a.1:0",), ("a.1:1",)]]
    assert _stages(ranked) == [[("a.0:0",), ("a.1:0",)], [("a.0:1",), ("a.1:1",)]]
    assert ranked.prediction.breakdown.dp_s < planned.prediction.breakdown.dp_s
    assert ranked.prediction.breakdown.pp_s > planned.prediction.breakdown.pp_s
    assert ranked.prediction.iteration_time_s != pytest.approx(
        planned.prediction.iteration_time_s, rel=0.05)


def test_plan_json_round_trips_the_placement(gpt2_small):
    plan = _plan(gpt2_small, SearchOptions(tp=1, pp=3, dp=2))
    data = plan_to_dict(plan)
    assert data["training"]["execution"]["placement"] == "rank-order"
    assert plan_from_dict(data) == plan
    assert '"placement": "planned"' in plan_to_json(replace(plan, training=TrainingShape(24, 512)))


def test_a_layout_the_schedule_runs_only_at_a_larger_micro_batch_is_kept():
    """Interleaved over 3 stages: 10 micro-batches of 1 need a multiple of 3 rounds, 5 of 2
    run in one; the layout is the framework's, planned at micro-batch 2."""
    spec = parse_cluster("nodes: [{name: a, gpu: rtx3090, gpus_per_node: 3}]", "three.yaml")
    shape = TrainingShape(10, 128, DType.BF16, RANK_ORDER)
    best = search(spec, load_model("gpt3-125m"), shape,
                  SearchOptions(pp=3, schedule=Schedule.INTERLEAVED, top_k=1)).best
    assert best.layout() == "dp=1 pp=3 tp=1" and best.pipelines[0].micro_batch_size == 2


def test_a_batch_the_framework_cannot_split_is_said_and_its_1f1b_fills_and_drains():
    """One micro-batch of 8 over two stages: the framework's 1F1B runs it as fill and drain
    (issue 29: refused before, as torch's Schedule1F1B refuses it); two replicas of one
    stage cannot split the batch of 8 into micro-batches of 8."""
    spec = parse_cluster("nodes: [{name: a, gpu: t4, gpus_per_node: 1, count: 2}]", "two.yaml")
    shape = TrainingShape(8, 128, DType.FP16, RANK_ORDER)
    plan = search(spec, load_model("tiny-llama"), shape, SearchOptions(micro_batch_size=8)).best
    assert plan.layout() == "dp=1 pp=2 tp=1" and plan.pipelines[0].num_micro_batches == 1
    with pytest.raises(ConfigError, match=r"global batch 8 cannot be split over --dp 2 "):
        search(spec, load_model("tiny-llama"), shape, SearchOptions(micro_batch_size=8, dp=2))
