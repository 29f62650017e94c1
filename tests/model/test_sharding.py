"""Which models tensor parallelism may split: a mixture of experts never (its routed experts
stay whole), whatever transformers' tensor-parallel plan says of the experts. transformers
5.24 listed Mixtral's experts in the plan, 5.25 lists attention only; under the second a
refusal read off the plan let TP split attention and leave the experts whole on every rank,
and the run trained differently from one process."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

from potluck.errors import ConfigError
from potluck.model.loading import model_from_hf_config
from potluck.model.sharding import heads_problem, tp_refusal
from potluck.runtime.models.adapters import detect_family
from potluck.runtime.parallel.tensor_parallel import check_tp

ATTENTION = {f"layers.*.self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}
ATTENTION["layers.*.self_attn.o_proj"] = "rowwise"
EXPERTS_LISTED = {**ATTENTION, "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                  "layers.*.mlp.experts.down_proj": "rowwise",
                  "layers.*.mlp.experts": "moe_tp_experts"}
DENSE_MLP = {**ATTENTION, "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
             "layers.*.mlp.down_proj": "rowwise"}
PLANS = {"transformers-5.24": EXPERTS_LISTED, "transformers-5.25": ATTENTION}
TINY_MIXTRAL = dict(model_type="mixtral", hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=64, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_routed_experts_are_refused_whatever_the_plan_lists(plan: dict[str, str]):
    reason = tp_refusal("mixtral", plan, routed_experts=8)
    assert "routed experts" in reason


def test_a_dense_model_with_a_whole_head_plan_is_split():
    assert tp_refusal("llama", DENSE_MLP, routed_experts=0) == ""
    assert tp_refusal("llama", EXPERTS_LISTED, routed_experts=0)  # experts named, none counted


@pytest.mark.parametrize("version", PLANS)
def test_mixtral_spec_and_runtime_refuse_tp_under_either_transformers_plan(
        version: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(MixtralConfig, "base_model_tp_plan", PLANS[version])
    spec = model_from_hf_config(TINY_MIXTRAL, f"tiny-mixtral-{version}")
    assert spec.num_experts == 4 and "routed experts" in spec.tp_refusal
    assert not spec.splits_by(2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(MixtralConfig(**{
            key: value for key, value in TINY_MIXTRAL.items() if key != "model_type"}))
    assert model.config.base_model_tp_plan == PLANS[version]
    with pytest.raises(ConfigError, match="routed experts") as err:
        check_tp(model, detect_family(model), 2, seq_len=8)
    assert "\n" not in str(err.value)


TINY_GQA_LLAMA = dict(model_type="llama", hidden_size=48, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                      vocab_size=64)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_every_layer_splits_the_heads_by_the_one_rule(tp: int):
    """Six query heads and two key/value heads: TP 2 splits both, 3 and 4 do not; the spec,
    the search's pins, the plan checks and the runtime all ask :func:`heads_problem`."""
    from transformers import LlamaConfig

    from potluck.cluster import Cluster, parse_cluster
    from potluck.planner.checks import check_request
    from potluck.planner.options import SearchOptions
    from potluck.plans import Pipeline, Plan, Stage, TrainingShape, check_plan

    spec = model_from_hf_config(TINY_GQA_LLAMA, "tiny-gqa-llama")
    problem = heads_problem(tp, 6, 2)
    assert (problem is None) == (tp == 2) and spec.splits_by(tp) == (tp == 2)
    cluster = parse_cluster("nodes: [{name: a, gpu: a100-80g-sxm, gpus_per_node: 4}]")
    stage = Stage(tuple(f"a.0:{i}" for i in range(tp)), ((0, 2),))
    plan = Plan(cluster, spec, TrainingShape(4, 64), (Pipeline((stage,), 1, 4),))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{
            key: value for key, value in TINY_GQA_LLAMA.items() if key != "model_type"}))
    checks = [lambda: check_request(Cluster(cluster), spec, plan.training, SearchOptions(tp=tp)),
              lambda: check_plan(plan), lambda: check_tp(model, detect_family(model), tp, 12)]
    for check in checks:
        if problem is None:
            check()
            continue
        with pytest.raises(ConfigError, match="does not divide .*6 attention heads and 2 "
                                              "key/value heads; use a divisor of 2"):
            check()
