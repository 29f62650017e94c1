"""``plan --objective cost``: the cheapest plan per token over subsets of the user's devices."""

from __future__ import annotations

from dataclasses import replace

import pytest

from potluck import api
from potluck.cluster.spec import parse_cluster
from potluck.economics.cheapest import machine_counts, plan_cheapest, restrict
from potluck.economics.figures import plan_figures
from potluck.economics.prices import Pricing
from potluck.errors import ConfigError, InfeasibleError
from potluck.planner.evaluate import predict
from potluck.plans import check_plan

TOKENS = 10**9
SHAPE = {"global_batch": 32, "seq_len": 1024}

# Four RTX 4090s at the catalog price, and four RTX 3090s, slower, rented at 3 USD/h each.
WITH_DEAR_3090S = """
name: lab
nodes:
  - {name: fast, gpu: rtx4090, gpus_per_node: 4, inter_bandwidth: 100Gb/s}
  - {name: old, gpu: rtx3090, gpus_per_node: 4, price_per_hour: 3.0, inter_bandwidth: 100Gb/s}
"""


def _usd_per_million_tokens(plan) -> float:
    return plan_figures(plan, Pricing(), TOKENS).usd_per_million_tokens


def _hours(plan) -> float:
    return plan_figures(plan, Pricing(), TOKENS).hours_to_train


@pytest.fixture
def lab():
    return parse_cluster(WITH_DEAR_3090S)


def test_a_slow_dear_device_is_left_out_and_the_plan_says_why(lab):
    fastest = api.plan(lab, "gpt3-350m", **SHAPE).best
    old = {d for d in fastest.devices if d.startswith("old.")}
    assert old, "precondition: the fastest plan uses the 3090s"
    cheapest = api.plan(lab, "gpt3-350m", objective="cost", **SHAPE).best
    assert not any(d.startswith("old.") for d in cheapest.devices)
    assert old <= set(cheapest.unused_devices)
    assert _usd_per_million_tokens(cheapest) < _usd_per_million_tokens(fastest)
    (note,) = [n for n in cheapest.notes if "old" in n]
    assert "4 of 4 rtx3090 GPUs of old left out" in note and "do not pay for themselves" in note


def test_the_cheapest_plan_runs_on_the_users_whole_cluster_file(lab):
    cheapest = api.plan(lab, "gpt3-350m", objective="cost", **SHAPE).best
    assert cheapest.cluster == lab
    check_plan(cheapest)
    assert len(cheapest.devices) + len(cheapest.unused_devices) == lab.num_gpus


def test_plans_come_cheapest_per_token_first(lab):
    plans = api.plan(lab, "gpt3-350m", objective="cost", **SHAPE).plans
    costs = [_usd_per_million_tokens(p) for p in plans]
    assert len(plans) > 1 and costs == sorted(costs)


def test_a_dear_device_the_model_needs_to_fit_is_kept():
    # llama2-7b needs ~108 GB for weights, gradients and Adam states: neither group holds it
    # alone with its optimizer on the GPUs (offloaded to host memory, the cheap one would).
    spec = parse_cluster("""
nodes:
  - {name: cheap, gpu: rtx4090, gpus_per_node: 4}
  - {name: dear, gpu: rtx4090, gpus_per_node: 2, price_per_hour: 5.0}
""")
    plan = api.plan(spec, "llama2-7b", objective="cost", offload="none", **SHAPE).best
    assert {d.split(".")[0] for d in plan.devices} == {"cheap", "dear"}
    assert not plan.unused_devices and not any("left out" in note for note in plan.notes)


def test_a_second_machine_behind_a_slow_network_is_left_out():
    spec = parse_cluster("nodes:\n  - {name: g, gpu: rtx4090, gpus_per_node: 4, count: 2, "
                         "inter_bandwidth: 1Gb/s}\n")
    plan = api.plan(spec, "gpt3-350m", objective="cost", **SHAPE).best
    assert {d.split(":")[0] for d in plan.devices} == {"g.0"}
    assert set(plan.unused_devices) == {f"g.1:{i}" for i in range(4)}
    assert any("4 of 8 rtx4090 GPUs of g left out" in n for n in plan.notes)


def test_a_deadline_buys_speed_at_a_higher_price_per_token(lab):
    unhurried = api.plan(lab, "gpt3-350m", objective="cost", **SHAPE).best
    fastest = api.plan(lab, "gpt3-350m", **SHAPE).best
    assert _hours(fastest) < _hours(unhurried), "precondition: the cheapest plan is not the fastest"
    deadline = (_hours(fastest) + _hours(unhurried)) / 2
    rushed = api.plan(lab, "gpt3-350m", objective="cost", tokens=TOKENS, deadline_hours=deadline,
                      **SHAPE).best
    assert _hours(rushed) <= deadline
    assert _usd_per_million_tokens(rushed) >= _usd_per_million_tokens(unhurried)
    assert _usd_per_million_tokens(rushed) <= _usd_per_million_tokens(fastest)


@pytest.mark.parametrize("objective", ["time", "cost"])
def test_a_deadline_no_plan_meets_is_one_clear_error(lab, objective):
    message = r"no plan trains 1,000,000,000 tokens within 0.01 h: the fastest"
    with pytest.raises(InfeasibleError, match=message):
        api.plan(lab, "gpt3-350m", objective=objective, tokens="1B", deadline_hours=0.01, **SHAPE)


def test_a_deadline_needs_tokens(lab):
    with pytest.raises(ConfigError, match="--deadline-hours needs --tokens"):
        api.plan(lab, "gpt3-350m", objective="cost", deadline_hours=5, **SHAPE)


def test_an_unknown_objective_is_rejected(lab):
    with pytest.raises(ConfigError, match="--objective must be time or cost"):
        api.plan(lab, "gpt3-350m", objective="speed", **SHAPE)


def test_restrict_keeps_the_first_machines_of_the_chosen_groups():
    spec = parse_cluster("""
nodes:
  - {name: a, gpu: rtx4090, gpus_per_node: 2, count: 4}
  - {name: b, gpu: a100-80g-sxm, gpus_per_node: 2}
links:
  - {between: [a, b], bandwidth: 1Gb/s}
""")
    only_a = restrict(spec, (("a", 2),))
    assert [(g.name, g.count) for g in only_a.nodes] == [("a", 2)]
    assert [t.name for t in only_a.device_types] == ["rtx4090"]
    assert only_a.links == ()
    both = restrict(spec, (("a", 1), ("b", 1)))
    assert both.links == spec.links


def test_machine_counts_try_powers_of_two_and_all():
    assert machine_counts(1) == [1]
    assert machine_counts(3) == [1, 2, 3]
    assert machine_counts(8) == [1, 2, 4, 8]


def test_the_rehomed_plan_keeps_the_prediction_of_its_training_shape(lab):
    model = api.as_model("gpt3-350m")
    shape = api.training_shape(model, **SHAPE)
    unfused = replace(shape, execution=replace(shape.execution,
                                               fused_kernels=not shape.execution.fused_kernels))
    plan = plan_cheapest(lab, model, unfused).best
    assert plan.training == unfused
    again = predict(plan)
    assert plan.prediction.tokens_per_s == pytest.approx(again.tokens_per_s)
