"""Islands in the planner: the exchange between islands, the convergence penalty, and the
choice of where to split and how to synchronize."""

import math
from dataclasses import replace
from pathlib import Path

import pytest

from potluck import api
from potluck.cluster import Cluster, load_cluster, parse_cluster
from potluck.errors import ConfigError
from potluck.model import PRESETS
from potluck.planner.evaluate import predict
from potluck.planner.islands import convergence
from potluck.planner.islands.choose import INNER_STEPS, _settings, outer_step
from potluck.planner.islands.exchange import (
    exposed_per_step_s,
    outer_exchange,
    pseudo_gradient_bytes,
)
from potluck.planner.islands.split import candidate_splits
from potluck.plans import (
    Compression,
    Island,
    Islands,
    Pipeline,
    Plan,
    Stage,
    SyncMethod,
    TrainingShape,
    check_plan,
)

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
TWO_LABS = DATA / "slow_two_labs.yaml"
GPT2 = PRESETS["gpt3-125m"]
TWO_DESKTOPS = parse_cluster(
    "nodes: [{name: desk, gpu: rtx4090, gpus_per_node: 1, count: 2, inter_bandwidth: 1Gb/s}]")


def _islands(count: int, h: int = 100, **kwargs) -> Islands:
    kwargs.setdefault("sync", SyncMethod.DILOCO)
    return Islands(islands=tuple(Island((k,)) for k in range(count)), inner_steps=h, **kwargs)


def _two_desktops(islands: Islands = Islands()) -> Plan:
    """One pipeline of the whole model on each desktop."""
    pipelines = tuple(Pipeline((Stage((f"desk.{k}:0",), ((0, GPT2.num_layers),)),), 4, 2)
                      for k in (0, 1))
    return Plan(TWO_DESKTOPS, GPT2, TrainingShape(16, 1024), pipelines, islands=islands)


def test_the_exchange_moves_every_parameter_at_the_compressions_width():
    fp32 = pseudo_gradient_bytes(GPT2, Compression.NONE)
    assert pseudo_gradient_bytes(GPT2, Compression.BF16) == fp32 / 2
    assert fp32 / 4 < pseudo_gradient_bytes(GPT2, Compression.INT8) < fp32 / 3.9


def test_the_exchange_of_two_desktops_is_one_ring_all_reduce_over_their_link():
    plan = _two_desktops(_islands(2, compression=Compression.FP16))
    exchange = outer_exchange(Cluster(TWO_DESKTOPS), plan, step_s=1.0)
    assert exchange.link.bandwidth_bytes_per_s == pytest.approx(1e9 / 8)
    # two ranks: each sends half and receives half twice, i.e. the whole once
    expected_s = exchange.bytes_per_outer_step / (1e9 / 8) + 2 * exchange.link.latency_s
    assert exchange.exchange_s == pytest.approx(expected_s)
    assert exchange.exposed_per_step_s == pytest.approx(exchange.exchange_s / 100)


def test_fragments_and_staleness_hide_the_exchange_behind_inner_steps():
    blocking = exposed_per_step_s(_islands(2, h=10), 40.0, step_s=1.0)
    assert blocking == pytest.approx(4.0)  # 40 s once every 10 steps
    streamed = exposed_per_step_s(_islands(2, h=10, fragments=2), 40.0, step_s=1.0)
    assert streamed == pytest.approx(2 * (20.0 - 5.0) / 10)  # each fragment overlaps 5 steps
    hidden = exposed_per_step_s(_islands(2, h=10, fragments=4), 8.0, step_s=1.0)
    assert hidden == 0.0
    for staleness in (1, 2):  # the link carries one push at a time: 2 in flight hide no more
        stale = _islands(2, h=10, sync=SyncMethod.BOUNDED, staleness=staleness)
        assert exposed_per_step_s(stale, 40.0, step_s=1.0) == pytest.approx((40.0 - 10.0) / 10)


def test_a_split_plans_step_sums_gradients_inside_each_island_only():
    together = predict(_two_desktops())
    split = predict(_two_desktops(_islands(2, h=100)))
    assert together.breakdown.dp_s > 1.0  # 125M parameters over 1 Gb/s, every step
    assert split.breakdown.dp_s == 0.0  # one pipeline per island: nothing to sum per step
    assert 0.0 < split.breakdown.outer_s < together.breakdown.dp_s / 10
    assert split.iteration_time_s < together.iteration_time_s


def test_the_token_factor_reaches_synchronous_trainings_loss():
    params, tokens = 7e9, 1.4e11
    factor = convergence.token_factor(0.01, params, tokens)
    assert factor > 1.0
    reached = 1.01 * convergence.chinchilla_loss(params, tokens * factor)
    assert reached == pytest.approx(convergence.chinchilla_loss(params, tokens))
    assert math.isinf(convergence.token_factor(0.5, params, tokens))  # below Chinchilla's E


N_1B3 = 1.3e9  # a model size of Charles et al. 2025's table 4


def _gap(m: int, h: int, params: float = N_1B3, **kwargs) -> float:
    return convergence.loss_gap(_islands(m, h, **kwargs), params)[0]


def test_the_published_points_are_reproduced_at_their_h():
    """Charles et al. 2025 (arXiv:2503.09799) table 4 at 1.3B and H = 30: M = 2 +0.2 %,
    M = 4 +0.5 %, M = 8 +1.3 %; table 5 at 4B: M = 4 +0.18 %, M = 2 below data parallelism
    (charged as no gap)."""
    assert [_gap(m, 30) for m in (2, 4, 8)] == pytest.approx([0.002, 0.005, 0.013])
    assert _gap(4, 30, params=4e9) == pytest.approx(0.0018)
    assert _gap(2, 30, params=4e9) == 0.0


def test_the_penalty_grows_with_islands_and_inner_steps_and_shrinks_with_size():
    assert _gap(2, 100) < _gap(3, 100) < _gap(4, 100) < _gap(8, 100)
    assert _gap(4, 10) < _gap(4, 30) < _gap(4, 100) < _gap(4, 250) < _gap(4, 500)
    assert _gap(4, 30, params=35e6) > _gap(4, 30, params=550e6) > _gap(4, 30, params=2.4e9)


def test_outside_the_sources_range_the_penalty_says_so():
    assert not convergence.loss_gap(_islands(8, 100), N_1B3)[1]
    beyond_m = convergence.loss_gap(_islands(16, 100), N_1B3)
    assert beyond_m[0] == _gap(8, 100) and "go up to 8" in beyond_m[1][0]
    assert convergence.loss_gap(_islands(8, 100), 7e9)[1]  # M = 8 was measured up to 2.4B
    assert convergence.loss_gap(_islands(2, 2000), N_1B3)[1]  # H beyond the sources' 1000


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.BF16, Compression.FP16])
def test_sixteen_bit_exchanges_cost_no_convergence(compression):
    """OpenDiLoCo (arXiv:2407.07852): FP16 all-reduce without performance degradation."""
    assert _gap(4, 100, compression=compression) == _gap(4, 100)
    assert _gap(4, 100, compression=Compression.INT8) > _gap(4, 100)


def test_bounded_staleness_costs_at_least_what_diloco_costs():
    assert _gap(2, 50, sync=SyncMethod.BOUNDED, staleness=2) > _gap(2, 50)


def test_two_labs_joined_at_1_gbps_train_as_two_diloco_islands_faster_to_target():
    result = api.plan(TWO_LABS, "llama2-7b", global_batch=64, seq_len=2048)
    best = result.best
    check_plan(best)
    assert best.islands.split and best.islands.count == 2
    assert best.islands.sync is SyncMethod.DILOCO
    nodes = [{d.split(":")[0].split(".")[0] for k in best.islands.members(i, best.dp)
              for d in best.pipelines[k].devices} for i in range(2)]
    assert nodes == [{"laba"}, {"labb"}]
    line = next(n for n in best.notes if n.startswith("time to target"))
    assert float(line.rsplit("(", 1)[1].rstrip("x)")) > 1.0  # faster than synchronous
    assert not result.plans[1].islands.split  # the synchronous alternative follows


def test_diloco_averages_below_the_least_published_h_and_steps_nesterov_from_it():
    """The published outer step from H = 50 on; plain averaging below (at H = 1 it is
    synchronous data parallelism). The choice tries every H, each with its outer step."""
    assert outer_step(10) == (1.0, 0.0) and outer_step(49) == (1.0, 0.0)
    assert outer_step(50) == (0.7, 0.9) and outer_step(500) == (0.7, 0.9)
    tried = {(i.inner_steps, i.outer_lr, i.outer_momentum) for i in _settings(SyncMethod.DILOCO)}
    assert {(h, *outer_step(h)) for h in INNER_STEPS} == tried
    best = api.plan(TWO_LABS, "llama2-7b", global_batch=64, seq_len=2048).best
    islands = best.islands
    assert (islands.outer_lr, islands.outer_momentum) == outer_step(islands.inner_steps)


def test_a_cluster_without_slow_links_is_planned_without_islands():
    box = parse_cluster("nodes: [{name: box, gpu: a100-80g-sxm, gpus_per_node: 8, nvlink: all}]")
    assert not candidate_splits(Cluster(box))
    assert not api.plan(box, "gpt3-125m", global_batch=16, seq_len=1024).best.islands.split


def test_sync_pinned_gives_no_islands_even_across_slow_links():
    options = api.search_options(sync="sync")
    best = api.plan(TWO_DESKTOPS, "gpt3-125m", options=options, global_batch=16, seq_len=1024).best
    assert not best.islands.split


def test_diloco_on_one_machine_is_a_one_line_error():
    box = parse_cluster("nodes: [{name: box, gpu: rtx4090, gpus_per_node: 2}]")
    with pytest.raises(ConfigError, match="has one machine; use --sync sync or auto") as err:
        api.plan(box, "gpt3-125m", options=api.search_options(sync="diloco"), global_batch=16,
                 seq_len=1024)
    assert "\n" not in str(err.value)


def test_even_splits_on_a_slow_network_and_none_on_a_fast_one():
    desktops = load_cluster(DATA / "slow_desktops.yaml")
    assert [s.count for s in candidate_splits(Cluster(desktops))] == [2, 4, 8]
    fast = replace(desktops, nodes=(replace(desktops.nodes[0], inter_bandwidth_bytes_per_s=1e10),))
    assert not candidate_splits(Cluster(fast))
    assert [s.count for s in candidate_splits(Cluster(fast), forced=True)] == [2, 4, 8]


def test_simulating_a_split_plan_adds_the_amortized_outer_exchange():
    from potluck.sim import simulate

    plan = _two_desktops(_islands(2, h=50))
    result = simulate(plan)
    assert result.outer_s == pytest.approx(predict(plan).breakdown.outer_s, rel=0.05)
    assert result.outer_s > 0.0
    assert result.iteration_time_s == pytest.approx(result.predicted_time_s, rel=0.1)


def test_the_timeline_draws_the_amortized_outer_exchange_at_the_steps_end(tmp_path):
    from potluck.sim import simulate
    from potluck.sim.timeline import OUTER, _rows, write_timeline

    result = simulate(_two_desktops(_islands(2, h=50)))
    rows = _rows(result)
    assert rows and all(row.bars[OUTER] == [(result.iteration_time_s - result.outer_s,
                                             result.outer_s)] for row in rows)
    write_timeline(result, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_potluck_plan_says_the_islands_their_exchange_penalty_and_time_to_target():
    import os
    import subprocess
    import sys

    src = Path(__file__).resolve().parents[2] / "src"
    run = subprocess.run(
        [sys.executable, "-m", "potluck", "plan", "-c", str(TWO_LABS), "-m", "llama2-7b",
         "--global-batch", "64", "--seq-len", "2048", "--target-tokens", "100B"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(src), "COLUMNS": "250"})
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "islands: 2 (laba.0, laba.1 | labb.0, labb.1); links inside at least 100 Gb/s, " \
           "between at most 1 Gb/s" in out
    assert "outer step: diloco every H=" in out and "GB per island" in out
    assert "convergence: loss +" in out
    assert "time to target (1e+11 tokens):" in out and "h synchronous (" in out
    bad = subprocess.run(
        [sys.executable, "-m", "potluck", "plan", "-c", str(TWO_LABS), "-m", "llama2-7b",
         "--sync", "often"], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(src)})
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "--sync" in bad.stderr


SLOW_CLUSTERS = {
    "two-groups": parse_cluster("""
nodes:
  - {name: fast, gpu: a100-80g-pcie, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
  - {name: slow, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs, inter_bandwidth: 10Gb/s}
links:
  - {between: [fast, slow], bandwidth: 0.5Gb/s, latency: 40ms}
""", "two-groups.yaml"),
    "desktops": parse_cluster(
        "nodes: [{name: desk, gpu: rtx4090, gpus_per_node: 1, count: 4, inter_bandwidth: 1Gb/s}]",
        "desktops.yaml"),
}


@pytest.mark.parametrize("cluster", SLOW_CLUSTERS)
@pytest.mark.parametrize("pins", [{}, {"zero": 1}, {"zero": 2}, {"schedule": "gpipe"},
                                  {"sync": "bounded"}])
def test_every_split_plan_the_planner_returns_passes_the_runtime_checks(cluster, pins):
    from test_plans_pass_runtime_checks import MODELS, _module, check_runs

    options = api.search_options(**{"sync": "diloco", **pins}, top_k=2)
    result = api.plan(SLOW_CLUSTERS[cluster], MODELS["tiny-llama"], options=options,
                      global_batch=16, seq_len=128)
    assert result.best.islands.split
    assert result.best.islands.sync.value == pins.get("sync", "diloco")
    if cluster == "desktops":
        assert any("split evenly" in note for note in result.best.notes)
    if pins.get("sync") == "bounded":
        assert any("push(es) stale" in note for note in result.best.notes)
    for plan in result.plans:
        check_runs(plan, _module("tiny-llama"))


def test_zero3_pinned_keeps_auto_synchronous_and_refuses_a_forced_split():
    desktops = SLOW_CLUSTERS["desktops"]
    auto = api.plan(desktops, "tiny-llama", options=api.search_options(zero=3), global_batch=16,
                    seq_len=128)
    assert not auto.best.islands.split
    with pytest.raises(ConfigError, match="--zero 3 do not go together"):
        api.plan(desktops, "tiny-llama", options=api.search_options(zero=3, sync="diloco"),
                 global_batch=16, seq_len=128)


def test_the_faster_island_takes_more_rows_of_each_batch():
    """The lab's 3090s and the cloud's H100s: batch shares follow the islands' speed, all of
    the global batch shared out."""
    spec = load_cluster(DATA / "slow_lab_cloud.yaml")
    best = api.plan(spec, "gpt3-1.3b", options=api.search_options(sync="diloco"),
                    global_batch=64, seq_len=2048).best
    rows = [sum(best.pipelines[k].batch_share for k in best.islands.members(i, best.dp))
            for i in range(best.islands.count)]
    assert sum(rows) == 64
    cloud = next(i for i in range(2) if best.pipelines[best.islands.members(i, best.dp)[0]]
                 .devices[0].startswith("cloud"))
    assert rows[cloud] > rows[1 - cloud]


def test_batch_rows_follow_speeds_and_sum_to_the_global_batch():
    from potluck.planner.islands.choose import batch_rows

    assert batch_rows(64, [3.0, 1.0]) == [48, 16]
    assert batch_rows(10, [1.0, 1.0, 1.0]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert batch_rows(3, [100.0, 1.0, 1.0]) == [1, 1, 1]  # every island at least one row
    with pytest.raises(ConfigError, match="smaller than the 4 islands"):
        batch_rows(3, [1.0] * 4)


@pytest.mark.parametrize("pins, objective, message", [
    ({"dp": 2}, "time", "--dp do not go together"),
    ({}, "cost", "plans by time to a target loss"),
])
def test_pins_that_rule_islands_out_are_one_line(pins, objective, message):
    with pytest.raises(ConfigError, match=message) as err:
        api.plan(SLOW_CLUSTERS["desktops"], "tiny-llama",
                 options=api.search_options(sync="diloco", **pins), objective=objective,
                 global_batch=16, seq_len=128)
    assert "\n" not in str(err.value)


def test_the_h_scale_reproduces_dilocos_h_ablation():
    """DiLoCo 2023 (arXiv:2311.08105) section 3.1: 150M model, 8 workers, perplexity at
    H = 1000 2.9 % above H = 50 (perplexity about 15): the loss gap grows by that much."""
    params = convergence.H_ABLATION_PARAMS
    grown = _gap(8, 1000, params=params) - _gap(8, 50, params=params)
    assert grown == pytest.approx(math.log(1.029) / math.log(15.0))
    assert convergence.h_scale(convergence.TABLE_H) == 1.0
