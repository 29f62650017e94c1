"""Pinned layouts: every layout that fits is planned, on machines of different types, and a
pinned layout that cannot run says why, with numbers (one test per reason)."""

from dataclasses import replace

import pytest

from potluck.cluster import Cluster, parse_cluster
from potluck.errors import ConfigError, InfeasibleError
from potluck.model import load_model
from potluck.model.counts import Recompute
from potluck.model.loading import model_from_hf_config
from potluck.planner.cost import usable_memory_bytes
from potluck.planner.exhaustive import fitting_shapes
from potluck.planner.search import Partition, SearchOptions, search
from potluck.plans import DType, Schedule, TrainingShape, check_plan
from potluck.plans.memory import Offload, Swap

V100_T4 = parse_cluster("""
nodes:
  - {name: v100, gpu: v100-16g, gpus_per_node: 4, count: 3, inter_bandwidth: 10Gb/s}
  - {name: t4, gpu: t4, gpus_per_node: 4, inter_bandwidth: 10Gb/s}
""", "v100-t4.yaml")
FP16 = TrainingShape(64, 1024, dtype=DType.FP16)


@pytest.fixture(scope="module")
def gpt2_medium():
    return model_from_hf_config({"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16,
                                 "vocab_size": 50257, "n_positions": 1024}, name="gpt2-medium")


def _plan(model, options, spec=V100_T4, shape=FP16):
    plan = search(spec, model, shape, options).best
    check_plan(plan)
    return plan


def test_dp_8_pipelines_of_2_stages_over_v100_and_t4_machines(gpt2_medium):
    """Six pipelines on the V100s and two on the T4s: no single family of identical
    pipelines holds all eight, which the search used to refuse as out of memory."""
    plan = _plan(gpt2_medium, SearchOptions(tp=1, pp=2, dp=8))
    assert plan.dp == 8 and {p.pp for p in plan.pipelines} == {2}
    assert plan.num_gpus == 16 and all(p.num_micro_batches >= 1 for p in plan.pipelines)


def test_one_pipeline_spans_two_gpu_types(gpt2_medium):
    plan = _plan(gpt2_medium, SearchOptions(tp=1, pp=16, dp=1))
    types = {s.devices[0].split(".")[0] for s in plan.pipelines[0].stages}
    assert types == {"v100", "t4"} and plan.pipelines[0].pp == 16


def test_one_gpu_of_a_group_of_three_machines(gpt2_medium):
    plan = _plan(gpt2_medium, SearchOptions(tp=1, pp=1, dp=1))
    assert plan.num_gpus == 1


def test_every_pinned_replica_runs(gpt2_medium):
    """32 micro-batches of 2 over 8 pipelines: the slow T4 pipelines still get one (1F1B runs
    fewer micro-batches than stages as fill and drain)."""
    plan = _plan(gpt2_medium, SearchOptions(tp=1, pp=2, dp=8, micro_batch_size=2))
    assert plan.dp == 8 and min(p.num_micro_batches for p in plan.pipelines) >= 1


def test_gpipe_holds_only_its_pipelines_share_in_memory():
    """GPipe keeps every micro-batch of its pipeline in flight, counted against its own
    devices: 8 of micro-batch 2 fit on an RTX 3090 unrecomputed, the whole batch's 32 not;
    the plan may give an A100 pipeline more, recomputing where they need it."""
    spec = parse_cluster("""
nodes:
  - {name: r3090, gpu: rtx3090, gpus_per_node: 4, count: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
""")
    options = SearchOptions(tp=1, pp=1, dp=4, micro_batch_size=2, schedule=Schedule.GPIPE)
    plan = _plan(load_model("gpt3-1.3b"), options, spec, TrainingShape(64, 2048))
    assert plan.dp == 4 and max(p.num_micro_batches for p in plan.pipelines) < 32
    cluster = Cluster(spec)
    assert all(m.total_bytes <= usable_memory_bytes(cluster.device(m.device).type)
               for m in plan.prediction.memory)
    for pipeline in plan.pipelines:
        if pipeline.stages[0].devices[0].startswith("r3090") and pipeline.num_micro_batches > 8:
            assert plan.stage_memory(plan.pipelines.index(pipeline), 0).resolved(
                plan.recompute).recompute is not Recompute.NONE


def test_a_pinned_stage_over_its_memory_names_device_and_gib():
    # ZeRO-3 or offload would fit it: pinned to what does not
    options = SearchOptions(tp=2, pp=2, dp=4, zero=1, offload=Offload.NONE, swap=Swap.NONE)
    with pytest.raises(InfeasibleError) as info:
        search(V100_T4, load_model("llama2-7b"), FP16, options)
    message = str(info.value)
    assert message.startswith("--tp 2 --pp 2 --dp 4: stage 1 of 2 (16 layers, tp 2) on v100-16g")
    assert "GiB at micro-batch 1 with recompute full" in message and "GiB usable" in message


def test_a_batch_too_small_for_dp_micro_batches_gives_the_nearest_sizes(gpt2_medium):
    with pytest.raises(ConfigError, match=r"--dp 16 x --micro-batch-size 8 = 128 sequences at least"
                       r"\); use a global batch of at least 128 or --micro-batch-size 4"):
        search(V100_T4, gpt2_medium, FP16, SearchOptions(dp=16, micro_batch_size=8))


def test_a_uniform_batch_not_divisible_by_dp_micro_batches_gives_the_nearest_sizes(gpt2_medium):
    with pytest.raises(ConfigError, match=r"multiple of --dp 6 x --micro-batch-size 2 = 12; "
                                          r"use 60 or 72"):
        search(V100_T4, gpt2_medium, FP16,
               SearchOptions(dp=6, micro_batch_size=2, partition=Partition.UNIFORM))


def test_tp_that_does_not_divide_the_heads(gpt2_medium):
    with pytest.raises(ConfigError, match="--tp 3 does not divide gpt2-medium's 16 attention heads"):
        search(V100_T4, gpt2_medium, FP16, SearchOptions(tp=3))


def test_too_few_groups_of_tp_gpus_inside_one_machine(gpt2_medium):
    spec = parse_cluster("""
nodes:
  - {name: big, gpu: rtx4090, gpus_per_node: 4}
  - {name: single, gpu: rtx4090, gpus_per_node: 1, count: 4}
""")
    with pytest.raises(ConfigError, match=r"needs 4 groups of 2 GPUs inside one machine, the "
                                          r"cluster's machines hold 2 \(big: 1 x 2\)"):
        search(spec, gpt2_medium, FP16, SearchOptions(tp=2, pp=2, dp=2))


def test_more_devices_than_the_cluster_has(gpt2_medium):
    with pytest.raises(ConfigError, match="asks for at least 24 devices, the cluster has 16"):
        search(V100_T4, gpt2_medium, FP16, SearchOptions(tp=4, pp=2, dp=3))


def test_fewer_micro_batches_per_pipeline_than_1f1b_stages_fill_and_drain(gpt2_medium):
    """Megatron-LM's and DeepSpeed's 1F1B run it (issue 29: it was refused because torch's
    Schedule1F1B refuses it); potluck runs the same order on torch's schedule runtime."""
    plan = search(V100_T4, gpt2_medium, FP16,
                  SearchOptions(tp=1, pp=8, dp=2, micro_batch_size=8)).best
    assert plan.layout() == "dp=2 pp=8 tp=1" and plan.schedule is Schedule.ONE_F_ONE_B
    assert [p.num_micro_batches for p in plan.pipelines] == [4, 4]
    check_plan(plan)


def test_more_interleaved_chunks_than_layers(gpt2_medium):
    with pytest.raises(InfeasibleError, match=r"16 stages x 2 chunks is more than the model's 24"):
        search(V100_T4, gpt2_medium, FP16,
               SearchOptions(tp=1, pp=16, dp=1, schedule=Schedule.INTERLEAVED))


def test_full_recomputation_holds_one_blocks_working_set_not_one_per_block():
    """All 24 blocks of GPT-3 1.3B on one RTX 3090 with full recomputation: 17.9 GiB by the
    cost model, 21.2 usable; the search's per-block memory slope once counted the block
    being recomputed for every block (24 GiB) and refused the layout."""
    spec = parse_cluster("""
nodes:
  - {name: r3090, gpu: rtx3090, gpus_per_node: 4, count: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
""")
    options = SearchOptions(tp=1, pp=1, dp=3, micro_batch_size=2, recompute=Recompute.FULL)
    plan = _plan(load_model("gpt3-1.3b"), options, spec, TrainingShape(64, 2048))
    on_3090 = [m for m in plan.prediction.memory if m.device.startswith("r3090")]
    assert on_3090 and all(m.total_bytes <= 0.95 * 24e9 for m in on_3090)


def test_every_pinned_layout_the_exhaustive_enumeration_fits_is_planned():
    spec = parse_cluster("""
nodes:
  - {name: a, gpu: a100-40g-pcie, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: t, gpu: t4, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
""")
    model = replace(load_model("gpt3-1.3b"), num_layers=8, name="gpt-1.3b-8l")
    shape = TrainingShape(16, 2048)
    shapes = fitting_shapes(spec, model, shape)
    assert len(shapes) >= 20  # the enumeration fits most shapes: the check is not vacuous
    for tp, pp, dp, micro_batch in sorted(shapes):
        options = SearchOptions(tp=tp, pp=pp, dp=dp, micro_batch_size=micro_batch, top_k=1)
        plan = _plan(model, options, spec, shape)
        assert (plan.dp, {p.pp for p in plan.pipelines}) == (dp, {pp})


FAST_AND_SLOW = parse_cluster("""
nodes:
  - {name: fast, gpu: a100-80g-pcie, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: slow, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
""", "fast-and-slow.yaml")


def test_zero3_pinned_on_fast_and_slow_gpus_plans_replicas_in_lockstep():
    """FSDP2 gathers each block once per micro-batch on every replica: the search splits the
    batch evenly under ZeRO-3 (it used to give the A100s 7 micro-batches, the 3090s 1)."""
    from potluck import api
    from potluck.runtime.grads.zero3 import check_zero3

    plans = api.plan(FAST_AND_SLOW, "llama2-7b", zero=3, dp=4).plans
    for plan in plans:
        check_plan(plan)
        check_zero3(plan)
    assert {p.zero for p in plans} == {3}


def test_zero3_with_zero_bubble_plans_one_replica_or_refuses_several():
    from potluck import api
    from potluck.runtime.grads.zero3 import check_zero3

    with pytest.raises(ConfigError, match="--dp 2: zero 3 does not run zero bubble"):
        api.plan(FAST_AND_SLOW, "llama2-7b", zero=3, schedule="zb", dp=2)
    for plan in api.plan(FAST_AND_SLOW, "llama2-7b", zero=3, schedule="zb").plans:
        check_plan(plan)
        check_zero3(plan)
