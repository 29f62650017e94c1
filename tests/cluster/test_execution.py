"""Execution presets, the cluster file's ``execution:`` section, and which one a plan gets."""

from dataclasses import replace

import pytest

from potluck import api
from potluck.cluster import parse_cluster
from potluck.cluster.execution import (
    PRESET_SUMMARIES,
    PRESETS,
    Execution,
    choose_execution,
    describe,
    differences,
    load_execution,
    parse_execution,
    preset,
)
from potluck.errors import ConfigError
from potluck.plans import plan_from_dict, plan_to_dict

NODES = "nodes: [{name: box, gpu: rtx3090, gpus_per_node: 2}]\n"


def test_potluck_is_the_default_runtime():
    assert PRESETS["potluck"] == Execution()
    assert choose_execution(None) == Execution()


def test_every_preset_is_documented_and_distinct():
    assert set(PRESET_SUMMARIES) == set(PRESETS)
    traits = list(PRESETS.values())
    assert len(set(traits)) == len(traits)


def test_megatron_lm_today_fuses_overlaps_and_reduces_in_fp32():
    today = preset("megatron-lm")
    assert today.fused_kernels and today.flash_attention
    assert today.overlap_grad_reduce and today.overlap_p2p
    assert not today.fp32_params and today.grad_reduce_bytes == 4


def test_megatron_lm_2021_differs_from_today_in_attention_and_overlap():
    behaviour = [name for name in differences(preset("megatron-lm"), preset("megatron-lm-2021"))
                 if not name.endswith("_s")]  # host-time figures aside
    assert behaviour == ["flash_attention", "overlap_grad_reduce", "overlap_p2p"]


def test_deepspeed_pipeline_engine_blocks_and_reduces_fp16_after_backward():
    deepspeed = preset("deepspeed")
    assert not (deepspeed.fused_kernels or deepspeed.flash_attention
                or deepspeed.overlap_grad_reduce or deepspeed.overlap_p2p or deepspeed.fp32_params)
    assert deepspeed.grad_reduce_bytes == 2


def test_fsdp_describes_composer_running_llm_foundrys_mpt():
    """FSDP1 FULL_SHARD with mixed_precision PURE: one-kernel LayerNorm and GELU, Triton flash
    attention, flash-attn's fused cross-entropy, FP32 shards gathered in bf16 and
    reduce-scattered in bf16 while the backward goes on, the root unit (embedding, final
    norm) gathered through the step; no compile, no communication scheduling."""
    fsdp = preset("fsdp")
    assert fsdp.fused_kernels and fsdp.flash_attention and fsdp.fused_loss
    assert fsdp.overlap_grad_reduce and fsdp.fp32_params and fsdp.grad_reduce_bytes == 2
    assert fsdp.zero3_root_unit and fsdp.compile is False
    assert fsdp.tp_overlap_chunks == 1 and fsdp.dp_priority_schedule is False


def test_torchtitan_describes_fsdp2_with_an_fp32_reduce_scatter():
    """torchtitan's Llama 3 configs: eager blocks (compile = false), SDPA flash attention,
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), eager FP32 cross-entropy,
    fully_shard(model) as the root unit."""
    titan = preset("torchtitan")
    assert not titan.fused_kernels and titan.flash_attention and not titan.fused_loss
    assert titan.fp32_params and titan.grad_reduce_bytes == 4 and titan.overlap_grad_reduce
    assert titan.zero3_root_unit and titan.compile is False
    behaviour = differences(preset("fsdp"), titan)
    assert behaviour == ["fused_kernels", "grad_reduce_bytes", "fused_loss"]


def test_potlucks_runtime_runs_torchtitans_traits_and_refuses_fsdps():
    """potluck's runtime is FSDP2 with torchtitan's mixed precision, but keeps each of the
    embedding, norm and head a unit of its own and runs no fused kernels or fused loss."""
    from potluck.runtime.launch.checks import check_execution

    plan = api.plan(parse_cluster(NODES), "gpt3-125m", global_batch=8, seq_len=256,
                    top_k=1).best
    titan = replace(preset("torchtitan"), zero3_root_unit=False)
    check_execution(replace(plan, training=replace(plan.training, execution=titan)))
    for refused in ("fsdp", "torchtitan"):
        traits = preset(refused)
        with pytest.raises(ConfigError, match="which potluck's runtime does not run"):
            check_execution(replace(plan, training=replace(plan.training, execution=traits)))


def test_section_reads_the_fsdp_traits():
    spec = parse_cluster(NODES + "execution: {preset: torchtitan, fused_loss: true, "
                                 "zero3_root_unit: false}\n")
    assert spec.execution == replace(preset("torchtitan"), fused_loss=True,
                                     zero3_root_unit=False)
    assert describe(spec.execution) == "torchtitan + fused_loss=true, zero3_root_unit=false"


def test_section_starts_from_its_preset_and_overrides_traits():
    spec = parse_cluster(NODES + "execution:\n  preset: megatron-lm-2021\n"
                         "  overlap_p2p: true\n  step_overhead_s: 2ms\n")
    assert spec.execution == replace(preset("megatron-lm-2021"), overlap_p2p=True,
                                     step_overhead_s=0.002)


def test_section_without_preset_overrides_potluck():
    spec = parse_cluster(NODES + "execution: {grad_reduce_bytes: 4}\n")
    assert spec.execution == Execution(grad_reduce_bytes=4)


def test_a_cluster_without_section_has_no_execution():
    assert parse_cluster(NODES).execution is None


@pytest.mark.parametrize(("section", "fragment"), [
    ("{fused_kernel: true}", "lab.yaml:2: execution.fused_kernel: unknown key; did you mean "
                             "'fused_kernels'?"),
    ("{preset: megatron}", "execution.preset: unknown execution preset 'megatron'; did you mean "
                           "'megatron-lm'?"),
    ("{overlap_p2p: 'yes'}", "execution.overlap_p2p: must be true or false, not 'yes'"),
    ("{grad_reduce_bytes: 3}", "execution.grad_reduce_bytes: must be 2"),
    ("{step_overhead_s: soon}", "execution.step_overhead_s: cannot read 'soon' as a duration"),
    ("[potluck]", "lab.yaml:2: execution must be a mapping"),
])
def test_section_errors_are_one_line_at_the_line(section, fragment):
    with pytest.raises(ConfigError) as err:
        parse_cluster(NODES + f"execution: {section}\n", "lab.yaml")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_describe_names_the_nearest_preset_and_what_differs():
    assert describe(preset("megatron-lm")) == "megatron-lm"
    assert describe(Execution()) == "potluck"
    changed = replace(preset("megatron-lm-2021"), overlap_p2p=True)
    assert describe(changed) == "megatron-lm-2021 + overlap_p2p=true"
    slower = replace(Execution(), grad_reduce_bytes=4, micro_batch_overhead_s=1e-4)
    assert describe(slower) == "potluck + grad_reduce_bytes=4, micro_batch_overhead_s=0.0001"


def test_flag_takes_a_preset_name_or_a_file(tmp_path):
    path = tmp_path / "framework.yaml"
    path.write_text("preset: deepspeed\nfused_kernels: true\n")
    assert choose_execution("deepspeed") == preset("deepspeed")
    assert choose_execution(str(path)) == load_execution(path)
    assert load_execution(path).fused_kernels and not load_execution(path).overlap_p2p


def test_an_unknown_flag_value_says_what_is_accepted():
    with pytest.raises(ConfigError, match="neither a preset nor a file; did you mean 'deepspeed'"):
        choose_execution("deepspeeed")
    with pytest.raises(ConfigError, match="execution file 'missing.yaml' not found"):
        choose_execution("missing.yaml")


def test_flag_beats_cluster_section_beats_default():
    spec = parse_cluster(NODES + "execution: {preset: megatron-lm}\n")
    assert api.as_execution(None, spec) == preset("megatron-lm")
    assert api.as_execution("deepspeed", spec) == preset("deepspeed")
    assert api.as_execution(None, parse_cluster(NODES)) == Execution()


def test_the_plan_carries_the_chosen_traits_and_round_trips():
    spec = parse_cluster(NODES + "execution: {preset: megatron-lm-2021}\n")
    from_section = api.plan(spec, "gpt3-125m", global_batch=8, seq_len=256, top_k=1).best
    assert from_section.training.execution == preset("megatron-lm-2021")
    flagged = api.plan(spec, "gpt3-125m", global_batch=8, seq_len=256, top_k=1,
                       execution="potluck").best
    assert flagged.training.execution == Execution()
    assert flagged.prediction.iteration_time_s != from_section.prediction.iteration_time_s
    data = plan_to_dict(from_section)
    assert data["training"]["execution"]["overlap_p2p"] is False
    assert "execution" not in data["cluster"]  # the plan's traits live in training only
    assert plan_from_dict(data).training.execution == preset("megatron-lm-2021")


def test_each_trait_is_read_from_a_section():
    wanted = Execution(fused_kernels=True, flash_attention=False, overlap_grad_reduce=False,
                       overlap_p2p=False, fp32_params=True, grad_reduce_bytes=4,
                       micro_batch_overhead_s=1e-4, step_overhead_s=0.003)
    for name in differences(Execution(), wanted):
        parsed = parse_execution({name: getattr(wanted, name)}, "x.yaml")
        assert getattr(parsed, name) == getattr(wanted, name)
    assert len(differences(Execution(), wanted)) == 8


def test_cost_plans_every_offer_with_the_chosen_traits():
    study = api.cost("gpt3-125m", "1B", max_gpus=1, global_batch=8, seq_len=512,
                     execution="deepspeed")
    assert study.candidates
    assert {c.plan.training.execution for c in study.candidates} == {preset("deepspeed")}


def test_named_and_numeric_traits_read_as_written():
    from potluck.plans import Placement

    spec = parse_cluster(NODES + "execution: {placement: rank-order, block_host_s: 150us, "
                                 "grad_accumulation_bytes: 10}\n")
    assert spec.execution.placement is Placement.RANK_ORDER
    assert spec.execution.block_host_s == pytest.approx(150e-6)
    assert spec.execution.grad_accumulation_bytes == 10.0
    with pytest.raises(ConfigError, match="execution.placement: must be one of planned, "
                                          "rank-order, not 'megatron'"):
        parse_cluster(NODES + "execution: {placement: megatron}\n")
    with pytest.raises(ConfigError, match="grad_accumulation_bytes: must be a non-negative"):
        parse_cluster(NODES + "execution: {grad_accumulation_bytes: -1}\n")


def test_communication_traits_are_auto_unless_forced():
    assert all(getattr(Execution(), name) is None for name in (
        "tp_overlap_chunks", "recompute_keeps_comm", "split_p2p_channels",
        "dp_priority_schedule", "sparse_embedding_grads"))
    spec = parse_cluster(NODES + "execution: {tp_overlap_chunks: 2, split_p2p_channels: false, "
                                 "sparse_embedding_grads: auto}\n")
    assert spec.execution.tp_overlap_chunks == 2
    assert spec.execution.split_p2p_channels is False
    assert spec.execution.sparse_embedding_grads is None
    assert describe(spec.execution) == "potluck + tp_overlap_chunks=2, split_p2p_channels=false"
    for name in ("megatron-lm", "megatron-lm-2021", "deepspeed"):  # frameworks that run none
        assert preset(name).tp_overlap_chunks == 1 and preset(name).split_p2p_channels is False


@pytest.mark.parametrize(("section", "fragment"), [
    ("{tp_overlap_chunks: 0}", "execution.tp_overlap_chunks: must be auto or a number of "
                               "sub-batches from 1 (off) to 8, not 0"),
    ("{tp_overlap_chunks: true}", "execution.tp_overlap_chunks: must be auto"),
    ("{dp_priority_schedule: sometimes}", "execution.dp_priority_schedule: must be auto, true "
                                          "or false, not 'sometimes'"),
    ("{fused_kernels: auto}", "execution.fused_kernels: must be true or false, not 'auto'"),
])
def test_communication_trait_errors_are_one_line(section, fragment):
    with pytest.raises(ConfigError) as err:
        parse_cluster(NODES + f"execution: {section}\n", "lab.yaml")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_compile_is_auto_true_or_false_and_round_trips_in_plans(tmp_path):
    from potluck.runtime.launch.checks import check_execution
    from potluck.runtime.parallel.compile import compiles

    assert Execution().compile is None  # auto: the runtime compiles on GPU ranks
    assert compiles(Execution(), use_gpu=True) and not compiles(Execution(), use_gpu=False)
    assert all(preset(name).compile is False for name in PRESETS if name != "potluck")
    spec = parse_cluster(NODES + "execution: {compile: true}\n")
    assert spec.execution == Execution(compile=True)
    assert compiles(spec.execution, use_gpu=False)  # a CPU run opts in
    assert describe(spec.execution) == "potluck + compile=true"
    path = tmp_path / "traits.yaml"
    path.write_text("compile: false\n")
    assert choose_execution(str(path)).compile is False
    assert parse_execution({"compile": "auto"}, "x.yaml").compile is None
    with pytest.raises(ConfigError, match="execution.compile: must be auto, true or false"):
        parse_cluster(NODES + "execution: {compile: yes please}\n")
    plan = api.plan(spec, "gpt3-125m", global_batch=8, seq_len=256, top_k=1).best
    data = plan_to_dict(plan)
    assert data["training"]["execution"]["compile"] is True
    assert plan_from_dict(data).training.execution.compile is True
    del data["training"]["execution"]["compile"]  # a plan written before the trait
    assert plan_from_dict(data).training.execution.compile is None
    check_execution(plan)  # the runtime follows it
