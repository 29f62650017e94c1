"""Issue 13's memory contract in the cost model and the search, each term by hand.

Every expectation is computed here from the contract (/work/notes/contract.md): the
bytes a swapping stage keeps, where the stash goes, ZeRO-2/3's shards and collectives,
optimizer offload's host bytes, the host-memory limit, and the search's per-stage
choices and pins.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from potluck.cluster.spec import parse_cluster
from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError, InfeasibleError
from potluck.model import counts
from potluck.model.counts import Recompute
from potluck.model.loading import load_model
from potluck.planner import formulas
from potluck.planner.cost import CostModel, StageShape, usable_memory_bytes
from potluck.planner.evaluate import gradient_groups, predict
from potluck.planner.formulas import StateSharding
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import (
    Pipeline,
    Plan,
    Stage,
    TrainingShape,
    plan_from_dict,
    plan_to_dict,
    zero3_problem,
)
from potluck.plans.memory import Offload, StageMemory, Swap

BOX = "nodes: [{name: box, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, host_memory: 256GB}]"
SEQ = 1024


def _cost(model_name: str = "llama2-7b", text: str = BOX) -> CostModel:
    return CostModel.for_training(Cluster(parse_cluster(text)), load_model(model_name),
                                  TrainingShape(8, SEQ))


def _plan(memories: list[StageMemory], *, dp: int = 1, zero: int = 0, micro_batches: int = 8,
          model_name: str = "tiny-llama", text: str = BOX) -> Plan:
    """``dp`` pipelines of ``len(memories)`` stages (one device each), an even split."""
    model = load_model(model_name)
    pp = len(memories)
    per = model.num_layers // pp
    ids = [d.id for d in Cluster(parse_cluster(text)).devices]
    pipelines = []
    for k in range(dp):
        stages = tuple(Stage((ids[k * pp + i],), ((i * per, model.num_layers if i == pp - 1
                                                   else (i + 1) * per),), memories[i])
                       for i in range(pp))
        pipelines.append(Pipeline(stages, 1, micro_batches))
    return Plan(cluster=parse_cluster(text), model=model,
                training=TrainingShape(dp * micro_batches, SEQ), pipelines=tuple(pipelines),
                zero=zero)


def _block_bytes(cost: CostModel, recompute: Recompute = Recompute.NONE) -> float:
    return counts.block_activation_bytes(cost.model, 1, SEQ, 1, recompute,
                                         flash_attention=cost.flash_attention)


# ---- activations: recompute some blocks, swap some blocks -------------------------------

def test_a_1f1b_first_stage_keeps_all_but_the_swapped_share_of_its_in_flight_micro_batches():
    cost = _cost()
    device = cost.cluster.devices[0].type
    n, in_flight, swapped = 8, 4.0, 6
    shape = StageShape(n, first=True, pp=4, swap=Swap.HOST, swapped_blocks=swapped)
    everything = n * _block_bytes(cost) + counts.embedding_activation_bytes(cost.model, 1, SEQ, 1)
    kept = everything - swapped * _block_bytes(cost)
    expected = (in_flight - 1) * kept + everything  # the contract's peak
    assert cost.stage_peak_activation_bytes(device, 1, shape, in_flight) == pytest.approx(expected)
    stash = cost.swap_bytes(device, 1, shape, in_flight)
    # the stash peaks when the last warm-up forward has swapped out: every in-flight one
    assert stash.host == pytest.approx(in_flight * swapped * _block_bytes(cost))
    assert stash.peer == 0.0


def test_a_hybrid_swap_splits_its_stash_between_host_and_peer():
    cost = _cost()
    device = cost.cluster.devices[0].type
    shape = StageShape(4, pp=2, swap=Swap.HYBRID, swapped_blocks=4, host_share=0.25,
                       swap_peer="box.0:1")
    stash = cost.swap_bytes(device, 1, shape, 3.0)
    total = 3 * 4 * _block_bytes(cost)  # three micro-batches in flight, four blocks each
    assert stash.host == pytest.approx(0.25 * total) and stash.peer == pytest.approx(0.75 * total)


def test_recomputing_the_first_blocks_keeps_only_their_inputs():
    cost = _cost()
    device = cost.cluster.devices[0].type
    shape = StageShape(8, pp=2, recompute=Recompute.FULL, recompute_blocks=3)
    expected = 3 * 2.0 * SEQ * cost.model.hidden_size + 5 * _block_bytes(cost)
    assert cost.activation_bytes_per_micro_batch(device, 1, shape) == pytest.approx(expected)


def test_recomputing_some_blocks_costs_their_forward_once_more():
    cost = _cost()
    devices = cost.cluster.devices[:1]
    plain = cost.stage_time(devices, StageShape(8, pp=2)).work.backward_s
    some = cost.stage_time(devices, StageShape(8, pp=2, recompute=Recompute.FULL,
                                               recompute_blocks=3)).work.backward_s
    forward = cost.block_times(devices[0].type, 1, 1, Recompute.NONE).forward_s
    assert some - plain == pytest.approx(3 * forward, rel=0.05)


def test_a_swap_that_fits_under_compute_costs_nothing_and_one_that_does_not_is_exposed():
    slow = BOX.replace("host_memory: 256GB", "host_memory: 256GB, host_bandwidth: 10MB/s")
    fast = BOX.replace("host_memory: 256GB", "host_memory: 256GB, host_bandwidth: 1TB/s")
    for text, exposed in ((fast, False), (slow, True)):
        cost = _cost(text=text)
        devices = cost.cluster.devices[:1]
        plain = cost.stage_time(devices, StageShape(8, pp=2)).work
        swapping = StageShape(8, pp=2, swap=Swap.HOST, swapped_blocks=8)
        work = cost.stage_time(devices, swapping).work
        transfer = cost.swap_transfer_s(devices[0], 1, swapping)
        assert transfer == pytest.approx(8 * _block_bytes(cost)
                                         / cost.cluster.host_bandwidth_bytes_per_s(devices[0]))
        compute = plain.forward_s - 0.5 * cost.execution.micro_batch_overhead_s
        if exposed:  # all but what streams under the forward's compute
            assert work.forward_s - plain.forward_s == pytest.approx(transfer - compute)
        else:
            assert work.forward_s == pytest.approx(plain.forward_s)


def test_a_peer_swap_over_the_bridge_its_tp_partner_uses_contends_with_it():
    cost = _cost()
    a, b = cost.cluster.devices[:2]  # bridged pair
    shape = StageShape(8, pp=2, swap=Swap.PEER, swapped_blocks=8, swap_peer=b.id)
    assert cost._swap_shares_link((a, b), shape, ())
    assert not cost._swap_shares_link((a,), shape, ())


# ---- model states: ZeRO-2/3 and offload ----------------------------------------------------

def test_zero3_keeps_a_shard_of_every_state_and_two_whole_blocks_of_weights():
    cost = _cost()
    device = cost.cluster.devices[0].type
    shape = StageShape(8, pp=2)
    params = cost.stage_params(shape, 1)
    block = counts.block_params(cost.model)
    sharding = StateSharding.of(4, 3)
    layout = cost.state_layout(device, sharding)
    at_rest = params * layout.total / 4
    working = 2 * block * layout.gathered_weights + block * layout.grads
    assert cost.model_state_bytes(device, params, sharding) == pytest.approx(at_rest)
    assert cost.zero_working_bytes(device, 1, shape, sharding) == pytest.approx(working)


def test_zero2_shards_gradients_and_optimizer_and_keeps_one_block_of_gradients():
    cost = _cost()
    device = cost.cluster.devices[0].type
    layout = cost.state_layout(device)
    shape = StageShape(8, pp=2)
    params = cost.stage_params(shape, 1)
    sharding = StateSharding.of(2, 2)
    expected = params * (layout.weights + layout.grads / 2 + layout.optimizer / 2)
    assert cost.model_state_bytes(device, params, sharding) == pytest.approx(expected)
    assert cost.zero_working_bytes(device, 1, shape, sharding) == pytest.approx(
        counts.block_params(cost.model) * layout.grads)


def test_offload_moves_12_bytes_per_parameter_to_the_host():
    assert formulas.host_state_bytes(1e9, StateSharding.of(1, 0, offload=True)) == 12e9
    assert formulas.host_state_bytes(1e9, StateSharding.of(4, 1, offload=True)) == 3e9
    plan = _plan([StageMemory(offload=Offload.OPTIMIZER), StageMemory()])
    memory = predict(plan).memory
    cost = CostModel.for_plan(plan)
    params = cost.stage_params(StageShape(plan.pipelines[0].stages[0].num_layers, True, False, 2), 1)
    assert memory[0].optimizer_bytes == 0.0 and memory[0].offloaded_bytes == pytest.approx(12 * params)
    assert memory[0].host_bytes == pytest.approx(12 * params)
    assert memory[1].host_bytes == 0.0 and memory[1].optimizer_bytes > 0.0


def test_zero2_and_3_reduce_scatter_after_every_micro_batch_and_zero3_does_not_gather_after_the_step():
    for zero in (2, 3):
        plan = _plan([StageMemory(), StageMemory()], dp=2, zero=zero, micro_batches=6)
        groups = [g for g in gradient_groups(CostModel.for_plan(plan), plan) if len(g.members) > 1]
        assert all(g.rounds == 6 and g.scatter for g in groups)
        assert all(g.gathers is (zero == 2) for g in groups)


def test_zero3_costs_time_in_every_pass_and_zero1_does_not():
    plans = {z: _plan([StageMemory(), StageMemory()], dp=2, zero=z, model_name="llama2-7b")
             for z in (1, 3)}
    times = {z: predict(p).stage_times_s[0][0] for z, p in plans.items()}
    assert times[3] > times[1]


def test_zero3_is_refused_where_replicas_hold_a_stage_differently():
    plan = _plan([StageMemory(), StageMemory()], dp=2, zero=3)
    first = plan.pipelines[0]
    moved = (Stage(first.stages[0].devices, ((0, 1),)), Stage(first.stages[1].devices,
                                                                ((1, plan.model.num_layers),)))
    uneven = replace(plan, pipelines=(replace(first, stages=moved), plan.pipelines[1]))
    assert zero3_problem(plan) is None
    assert "zero 3 needs every replica" in zero3_problem(uneven)
    with pytest.raises(ConfigError, match="zero 3"):
        predict(uneven)


# ---- host memory -----------------------------------------------------------------------------

def test_host_bytes_of_a_host_swap_and_the_machine_total():
    plan = _plan([StageMemory(swap=Swap.HOST), StageMemory()], micro_batches=8)
    prediction = predict(plan)
    first = prediction.memory[0]
    assert first.host_bytes == pytest.approx(first.swapped_out_bytes) and first.host_bytes > 0
    (host,) = prediction.host_memory
    assert host.used_bytes == pytest.approx(first.host_bytes)
    assert host.capacity_bytes == 256e9 and host.fits


def test_a_plan_over_its_machines_host_memory_is_refused():
    small = BOX.replace("256GB", "12GB")
    options = SearchOptions(offload=Offload.OPTIMIZER)
    assert search(parse_cluster(BOX), load_model("gpt3-1.3b"), TrainingShape(16, SEQ), options)
    with pytest.raises(InfeasibleError):
        search(parse_cluster(small), load_model("gpt3-1.3b"), TrainingShape(16, SEQ), options)


# ---- search: per-stage choices and pins ----------------------------------------------------

def test_under_tight_memory_the_first_1f1b_stage_recomputes_and_the_last_does_not():
    spec = parse_cluster("nodes: [{name: b, gpu: rtx4090, gpus_per_node: 4}]")
    options = SearchOptions(pp=4, dp=1, tp=1, micro_batch_size=1, swap=Swap.NONE,
                            offload=Offload.OPTIMIZER, zero=0)
    best = search(spec, load_model("llama2-7b"), TrainingShape(32, 4096), options).best
    first, last = best.stage_memory(0, 0), best.stage_memory(0, 3)
    assert first.recompute is not Recompute.NONE and last.recompute is Recompute.NONE
    for used in best.prediction.memory:
        assert used.total_bytes <= usable_memory_bytes(Cluster(spec).devices[0].type)


@pytest.mark.parametrize("gpu", ["a100-80g-sxm", "cpu"])
def test_pins_force_every_technique_on_every_stage_where_it_does_not_pay(gpu: str):
    spec = parse_cluster(f"nodes: [{{name: a, gpu: {gpu}, gpus_per_node: 4}}]")
    tiny = load_model("tiny-llama")
    training = TrainingShape(16, 256)
    options = SearchOptions(pp=2, dp=2, swap=Swap.HOST, offload=Offload.OPTIMIZER,
                            recompute=Recompute.FULL, zero=3)
    best = search(spec, tiny, training, options).best
    assert best.zero == 3
    for k, pipeline in enumerate(best.pipelines):
        for i in range(pipeline.pp):
            memory = best.stage_memory(k, i)
            assert memory.swap is Swap.HOST and memory.swap_fraction == 1.0
            assert memory.offload is Offload.OPTIMIZER
            assert memory.recompute is Recompute.FULL and memory.recompute_blocks is None
    free = search(spec, tiny, training).best
    assert free.zero == 0 and not any(free.stage_memory(k, i).swaps
                                      for k, p in enumerate(free.pipelines) for i in range(p.pp))


def test_a_pinned_peer_swap_stashes_on_another_device_of_the_machine():
    spec = parse_cluster(BOX)
    best = search(spec, load_model("tiny-llama"), TrainingShape(16, 256),
                  SearchOptions(pp=4, dp=1, swap=Swap.PEER)).best
    stages = best.pipelines[0].stages
    own = {s.devices[0] for s in stages}
    for stage in stages[:-1]:
        assert stage.memory.swap is Swap.PEER and stage.memory.swap_peer in own
        assert stage.memory.swap_peer != stage.devices[0]
    held = sum(m.peer_held_bytes for m in best.prediction.memory)
    stashed = sum(m.swapped_out_bytes for m in best.prediction.memory)
    assert held == pytest.approx(stashed) and held > 0


def test_llama2_13b_at_seq_4096_gets_a_plan_on_four_3090s_with_256_gb_of_host_memory():
    best = search(parse_cluster(BOX), load_model("llama2-13b"), TrainingShape(64, 4096)).best
    assert best.num_gpus == 4 and best.prediction.tokens_per_s > 0
    assert all(h.fits for h in best.prediction.host_memory)


def test_llama2_7b_gets_a_plan_on_two_machines_of_four_3060s():
    spec = parse_cluster("nodes: [{name: b, gpu: rtx3060, gpus_per_node: 4, count: 2, "
                         "inter_bandwidth: 10Gb/s}]")
    best = search(spec, load_model("llama2-7b"), TrainingShape(64, 2048)).best
    assert best.prediction.tokens_per_s > 0


def test_plan_files_written_before_the_memory_fields_still_load():
    plan = replace(_plan([StageMemory(), StageMemory()]), prediction=None)
    plan = replace(plan, prediction=predict(plan))
    data = plan_to_dict(plan)
    for memory in data["prediction"]["memory"]:
        for key in ("host_bytes", "swapped_out_bytes", "peer_held_bytes", "offloaded_bytes",
                    "zero_working_bytes"):
            del memory[key]
    del data["prediction"]["host_memory"]
    for pipeline in data["pipelines"]:
        for stage in pipeline["stages"]:
            del stage["memory"]
    loaded = plan_from_dict(data)
    assert loaded.prediction.memory[0].host_bytes == 0.0
    assert loaded.stage_memory(0, 0) == StageMemory(Recompute.NONE)


SEQ_4096 = TrainingShape(32, 4096)
TIGHT = SearchOptions(pp=4, dp=1, tp=1, micro_batch_size=1, offload=Offload.OPTIMIZER, zero=0)


def test_swapping_is_chosen_where_it_beats_recomputation_and_flattens_1f1b_memory():
    spec = parse_cluster("nodes: [{name: b, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs}]")
    model = load_model("llama2-7b")
    auto = search(spec, model, SEQ_4096, TIGHT).best
    recomputing = search(spec, model, SEQ_4096, replace(TIGHT, swap=Swap.NONE)).best
    host = search(spec, model, SEQ_4096, replace(TIGHT, swap=Swap.HOST)).best
    assert auto.stage_memory(0, 0).swaps and not auto.stage_memory(0, 3).swaps
    assert auto.prediction.iteration_time_s < recomputing.prediction.iteration_time_s

    def spread(plan: Plan) -> float:
        used = [m.total_bytes for m in plan.prediction.memory]
        return max(used) - min(used)

    assert spread(host) < 0.5 * spread(recomputing)


def test_uneven_replicas_keep_optimizer_shares_proportional_to_their_memory():
    text = ("nodes: [{name: small, gpu: rtx3090, gpus_per_node: 1}, "
            "{name: big, gpu: a100-80g-sxm, gpus_per_node: 1}]")
    model = load_model("tiny-llama")
    stages = [Stage((device,), ((0, model.num_layers),)) for device in ("small.0:0", "big.0:0")]
    plan = Plan(cluster=parse_cluster(text), model=model, training=TrainingShape(8, SEQ),
                pipelines=tuple(Pipeline((s,), 1, 4) for s in stages), zero=1)
    cost = CostModel.for_plan(plan)
    params = cost.stage_params(StageShape(model.num_layers, True, True, 1), 1)
    by_device = {m.device: m for m in predict(plan).memory}
    for device, memory_gb in (("small.0:0", 24), ("big.0:0", 80)):
        layout = cost.state_layout(cost.cluster.device(device).type)
        share = memory_gb / (24 + 80)
        assert by_device[device].optimizer_bytes == pytest.approx(layout.optimizer * params * share,
                                                                  rel=1e-3)


def test_zero3_gathers_the_head_with_the_last_block_and_the_embedding_with_the_first():
    """A large vocabulary's output layer outweighs a block: the last stage holds it gathered
    beside the last block (the backward starts with both), the first stage the embedding
    beside the first block."""
    cost = _cost("llama3.1-8b")
    device = cost.cluster.devices[0].type
    sharding = StateSharding.of(4, 3)
    gathered = cost.state_layout(device, sharding).gathered_weights
    block = counts.block_params(cost.model)
    head = counts.head_params(cost.model, separate_from_embedding=True)
    embedding = counts.embedding_params(cost.model)
    assert head > block and embedding > block  # llama3.1-8b: 525M against 218M
    for shape, edge in ((StageShape(8, last=True, pp=2), head),
                        (StageShape(8, first=True, pp=2), embedding)):
        expected = (block + edge) * gathered + block * cost.state_layout(device, sharding).grads
        assert cost.zero_working_bytes(device, 1, shape, sharding) == pytest.approx(expected)
