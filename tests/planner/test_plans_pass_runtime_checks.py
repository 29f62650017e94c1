"""Every plan the search returns runs: it passes the plan checks and every runtime check that
needs no process (the one owner of "can this plan run", docs/DESIGN.md).

A matrix of small clusters (fast and slow GPUs, mixed groups), tiny models (GPT with dropout,
LLaMA with grouped heads, a mixture of experts) and pins (ZeRO 0-3, every schedule, TP,
swap, offload, expert parallelism, forced communication methods). A pin the search refuses
is fine; a plan it returns that the runtime would refuse is a bug in the rule's owner.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from potluck.cluster import parse_cluster
from potluck.cluster.execution import Execution
from potluck.errors import PotluckError
from potluck.model import load_model
from potluck.model.hf import hf_config_for
from potluck.model.loading import model_from_hf_config
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import Plan, Schedule, TrainingShape, check_plan, mixed_tp
from potluck.plans.memory import Offload, Swap
from potluck.runtime.grads.zero3 import check_zero3
from potluck.runtime.launch.checks import check_local
from potluck.runtime.models.adapters import detect_family
from potluck.runtime.options import TrainOptions
from potluck.runtime.parallel.tensor_parallel import check_tp
from potluck.schedules import schedule_for

CLUSTERS = {
    "fast+slow": parse_cluster("""
nodes:
  - {name: fast, gpu: a100-80g-pcie, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: slow, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
""", "fast-slow.yaml"),
    "three-types": parse_cluster("""
nodes:
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 1, inter_bandwidth: 10Gb/s}
  - {name: r4090, gpu: rtx4090, gpus_per_node: 1, inter_bandwidth: 10Gb/s}
  - {name: r3090, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
""", "three.yaml"),
    "t4+l4-box": parse_cluster("""
nodes:
  - {name: t4, gpu: t4, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: l4, gpu: l4, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
""", "t4-l4.yaml"),
}
MODELS = {
    "gpt3-125m": replace(load_model("gpt3-125m"), num_layers=4, name="gpt3-125m-4l"),
    "tiny-llama": load_model("tiny-llama"),
    "tiny-gpt2": load_model("tiny-gpt2"),
    "moe": model_from_hf_config({
        "model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1024}, "tiny-moe"),
}
FORCED = {"overlap": Execution(tp_overlap_chunks=2), "keeps": Execution(recompute_keeps_comm=True),
          "split-p2p": Execution(split_p2p_channels=True),
          "priority": Execution(dp_priority_schedule=True)}
PINS = {
    "free": {}, "zero1": {"zero": 1}, "zero2": {"zero": 2}, "zero3": {"zero": 3},
    "zero3-dp4": {"zero": 3, "dp": 4}, "gpipe": {"schedule": Schedule.GPIPE},
    "interleaved": {"schedule": Schedule.INTERLEAVED}, "zb": {"schedule": Schedule.ZERO_BUBBLE},
    "zb-zero3": {"schedule": Schedule.ZERO_BUBBLE, "zero": 3}, "tp2": {"tp": 2},
    "tp2-pp2": {"tp": 2, "pp": 2}, "swap": {"swap": Swap.HOST},
    "offload": {"offload": Offload.OPTIMIZER, "zero": 2},
}
GROUPS = {  # (cluster, model): the pins searched
    **{(c, m): [*PINS, *(f"forced-{f}" for f in FORCED)]
       for c in ("fast+slow", "three-types") for m in ("gpt3-125m", "tiny-llama")},
    ("t4+l4-box", "tiny-gpt2"): ["free", "tp2", "zero3", "interleaved", "forced-overlap"],
    ("fast+slow", "moe"): ["free", "ep2", "zero3", "zb"],
}
SEQ_LEN = 128
GLOBAL_BATCH = 16


def _options(pin: str) -> SearchOptions:
    if pin == "ep2":
        return SearchOptions(ep=2, top_k=3)
    return SearchOptions(top_k=3, **PINS.get(pin, {}))


def _execution(pin: str) -> Execution:
    return FORCED[pin.removeprefix("forced-")] if pin.startswith("forced-") else Execution()


def _module(model_name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config_for(MODELS[model_name]))


def check_runs(plan: Plan, module: torch.nn.Module) -> None:
    """Every runtime check that needs no process: the launch checks (plan, execution, explicit
    TP executor), ZeRO-3's, each pipeline's torch schedule, each TP degree on the module."""
    check_plan(plan)
    check_local(plan, TrainOptions(emulate=True))
    check_zero3(plan)
    schedule = schedule_for(plan.schedule)
    for pipeline in plan.pipelines:
        schedule.check(pipeline.num_micro_batches, pipeline.pp, plan.virtual_stages,
                       mixed_tp=mixed_tp(pipeline))
        if schedule.single_stage_class(pipeline.pp, pipeline.num_micro_batches):
            assert pipeline.num_micro_batches >= 1
    for tp in {s.tp for p in plan.pipelines for s in p.stages}:
        check_tp(module, detect_family(module), tp, plan.training.seq_len)


@pytest.mark.parametrize(("cluster", "model"), GROUPS, ids=["-".join(g) for g in GROUPS])
def test_every_plan_the_search_returns_passes_the_runtime_checks(cluster, model):
    """Each pin searched, every plan it returns checked; most pins must give plans, so the
    test cannot pass by refusing everything."""
    module = _module(model)
    planned = 0
    for pin in GROUPS[(cluster, model)]:
        shape = TrainingShape(GLOBAL_BATCH, SEQ_LEN, execution=_execution(pin))
        try:
            result = search(CLUSTERS[cluster], MODELS[model], shape, _options(pin))
        except PotluckError:
            continue  # a pin the search refuses here
        for plan in result.plans:
            try:
                check_runs(plan, module)
            except PotluckError as err:
                raise AssertionError(f"pin {pin}: {plan.layout()} is refused: {err}") from err
        planned += 1
    assert planned >= len(GROUPS[(cluster, model)]) // 2 + 1
