"""What the communication scheduling methods overlap and cost, in the cost model and the
simulator: TP overlap with sub-batches and recomputation that keeps communication (Oases),
split pipeline channels, the data-parallel priority schedule and sparse embedding gradients
(TriRace). Hand-computed where the composition is the point; the simulator, which runs each
op on its own, must agree with the cost model's closed forms."""

from dataclasses import replace

import pytest

from potluck import api
from potluck.cluster import Cluster, parse_cluster
from potluck.model import load_model
from potluck.model.counts import Recompute, block_activation_bytes
from potluck.planner import formulas
from potluck.planner.comm.sparse import expected_unique_tokens, sparse_exchange_bytes
from potluck.planner.comm.step_overlap import (
    first_forward_starts_s,
    gathered_forward_delay_s,
    next_step_bound_s,
)
from potluck.planner.cost import CostModel, StageShape
from potluck.planner.evaluate import gradient_groups, predict
from potluck.plans import CommSchedule, Pipeline, Plan, Stage, StageComm, TrainingShape
from potluck.schedules import Schedule, StageWork, schedule_for
from potluck.sim import simulate

# A comm-bound cluster: two machines of four RTX 3090 on PCIe (no NVLink), 10 Gb/s between.
PCIE_BOXES = parse_cluster("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 4, count: 2, "
                           "nvlink: none, inter_bandwidth: 10Gb/s}\n", "boxes.yaml")


def test_one_sub_batch_is_the_plain_sum_and_two_hide_the_faster_stream():
    assert formulas.overlapped_chain_s([1.0, 2.0], [0.5, 0.5], 1) == pytest.approx(4.0)
    # compute-bound: both sub-batches' compute back to back, only the last collective shows
    assert formulas.overlapped_chain_s([0.5, 0.5], [0.2, 0.2], 2) == pytest.approx(2.0 + 0.2)
    # comm-bound: the first compute, then the collectives back to back
    assert formulas.overlapped_chain_s([0.2, 0.2], [0.5, 0.5], 2) == pytest.approx(0.2 + 2.0)


def _tp_shape(chunks=1, keeps=False, recompute=Recompute.NONE, micro_batch=2):
    return StageShape(4, micro_batch=micro_batch, recompute=recompute, tp_overlap_chunks=chunks,
                      keeps_comm=keeps)


def _tp_devices(cost):
    return tuple(cost.cluster.device(f"box.0:{i}") for i in range(4))


@pytest.fixture(scope="module")
def cost():
    return CostModel(Cluster(PCIE_BOXES), load_model("gpt3-1.3b"), 2048)


def test_overlapped_sub_batches_hide_the_all_reduces_behind_the_other_sub_batch(cost):
    """Four blocks on four PCIe GPUs: the all-reduces take longer than the compute, so two
    sub-batches run at about the collectives' pace, and smaller GEMMs cost more compute."""
    devices = _tp_devices(cost)
    plain = cost.stage_time(devices, _tp_shape())
    overlapped = cost.stage_time(devices, _tp_shape(chunks=2))
    allreduce = cost.network.allreduce_s(cost.send_bytes(devices[0].type, 1), devices)
    gather = cost.network.reduce_scatter_s(cost.send_bytes(devices[0].type, 2), devices)
    assert overlapped.work.forward_s < plain.work.forward_s
    # never faster than its compute or than its 8 collectives per sub-batch back to back
    assert overlapped.work.forward_s >= gather + 2 * 8 * allreduce
    assert overlapped.compute_s > plain.compute_s  # half-size GEMMs, norms on every rank
    # what is left of the communication is what the compute could not hide
    assert overlapped.forward_tp_s < 0.5 * plain.forward_tp_s


def test_recomputation_that_keeps_communication_saves_the_backwards_collectives(cost):
    """Plain full recomputation runs each block's forward again with its collectives; the
    explicit executor recomputes each part up to its all-reduce and keeps the result."""
    devices = _tp_devices(cost)
    plain = cost.stage_time(devices, _tp_shape(recompute=Recompute.FULL))
    kept = cost.stage_time(devices, _tp_shape(keeps=True, recompute=Recompute.FULL))
    block_comm = cost.tp_block_comm_s(devices, 2)  # two all-reduces of the micro-batch
    gather = cost.network.reduce_scatter_s(cost.send_bytes(devices[0].type, 2), devices)
    assert plain.backward_tp_s == pytest.approx(2 * 4 * block_comm)
    assert kept.backward_tp_s == pytest.approx(4 * block_comm + gather)


def test_the_executor_keeps_the_hidden_stream_whole_on_every_rank(cost):
    """Without sequence parallelism the norms' tensors are not split; recomputing per part
    keeps both parts' inputs whole: 2 x 2 s b h bytes per block instead of 2 s b h / t."""
    m, s, b = cost.model, 2048, 2
    whole = block_activation_bytes(m, b, s, 4, Recompute.FULL, sequence_parallel=False)
    split = block_activation_bytes(m, b, s, 4, Recompute.FULL)
    assert whole == pytest.approx(2 * 2 * s * b * m.hidden_size)
    assert split == pytest.approx(2 * s * b * m.hidden_size / 4)
    kept = block_activation_bytes(m, b, s, 4, Recompute.NONE, sequence_parallel=False)
    assert kept > block_activation_bytes(m, b, s, 4, Recompute.NONE)


def _stage(devices, start, end, comm=StageComm()):
    return Stage(tuple(devices), ((start, end),), comm=comm)


def test_split_channels_take_the_transfers_off_each_micro_batch():
    """1F1B over a pipeline that crosses the network twice: torch's fused batches wait on
    every transfer; split channels pay them in the fill and in the round trips only, and
    the simulator, which runs every op, agrees with the closed form."""
    planned = api.plan(PCIE_BOXES, "gpt3-1.3b", global_batch=32, seq_len=2048, tp=1, pp=4,
                       dp=2).best
    plan = replace(planned, comm=CommSchedule())
    split = replace(planned, comm=CommSchedule(split_p2p_channels=True))
    for case in (plan, split):
        assert predict(case).iteration_time_s == pytest.approx(
            simulate(case).iteration_time_s, rel=0.02)
    assert predict(split).iteration_time_s < predict(plan).iteration_time_s


def test_a_round_trip_longer_than_the_in_flight_micro_batches_paces_the_pipeline():
    """Two stages, 1F1B: stage 0 holds two micro-batches, so its period is at least the
    round trip F0 + S + F1 + B1 + S + B0 over two."""
    works = [StageWork(1.0, 2.0, 0.0, 2.0), StageWork(1.0, 2.0, 0.0, 0.0)]
    time = schedule_for(Schedule.ONE_F_ONE_B).pipeline_time(works, 8, split_channels=True)
    assert time.period_s == pytest.approx((3.0 + 2.0 + 3.0 + 2.0) / 2)


def test_first_forwards_and_gathers_of_the_next_step():
    works = [StageWork(1.0, 2.0, 0.0, 0.5), StageWork(2.0, 3.0, 0.0, 0.5), StageWork(1.0, 1.0)]
    assert first_forward_starts_s(works) == pytest.approx([0.0, 1.5, 4.0])
    # four blocks of 0.25 s, a gather of 2 s in four buckets: the last block waits for all
    assert gathered_forward_delay_s(2.0, 1.0, 4) == pytest.approx(2.0 + 0.25 - 1.0)
    assert gathered_forward_delay_s(0.2, 1.0, 4) == pytest.approx(0.05)  # the first bucket
    assert next_step_bound_s([[5.0, 6.0]], [[0.0, 3.0]]) == pytest.approx(5.0)


def test_the_priority_schedule_hides_later_stages_steps_and_gathers():
    """ZeRO-1 over two pipelines on different machines (a 10 Gb/s all-gather after the
    step): with the priority schedule the gather runs into the next forward and a later
    stage's step into the time the next step takes to reach it; what it hides is at most
    the first stage's first forward plus the later stages' head start."""
    stages = [(0, 6), (6, 12), (12, 18), (18, 24)]
    pipelines = tuple(Pipeline(tuple(_stage([f"box.{k}:{i}"], *layers)
                                     for i, layers in enumerate(stages)), 1, 16) for k in range(2))
    plan = Plan(PCIE_BOXES, load_model("gpt3-1.3b"), TrainingShape(32, 2048), pipelines,
                zero=1)
    priority = replace(plan, comm=CommSchedule(dp_priority_schedule=True))
    before, after = predict(plan), predict(priority)
    window = sum(work.forward_s for work in _works(plan)) + max(
        work.forward_s for work in _works(plan))
    assert 0.0 < before.iteration_time_s - after.iteration_time_s < window
    for case in (plan, priority):
        assert predict(case).iteration_time_s == pytest.approx(
            simulate(case).iteration_time_s, rel=0.02)


def _works(plan):
    cost = CostModel.for_plan(plan)
    devices = [cost.cluster.device(stage.devices[0]) for stage in plan.pipelines[0].stages]
    return [cost.stage_time((device,), StageShape(stage.num_layers, i == 0, i == 3, 4, 1)).work
            for i, (device, stage) in enumerate(zip(devices, plan.pipelines[0].stages, strict=True))]


def test_distinct_tokens_grow_slower_than_tokens_and_never_pass_the_vocabulary():
    counts = [expected_unique_tokens(n, 32000) for n in (1000, 10_000, 100_000, 10_000_000)]
    assert counts == sorted(counts)
    assert counts[0] < 1000 and counts[-1] < 32000
    assert counts[-1] > 0.9 * 32000  # ten million tokens reach nearly every id
    assert expected_unique_tokens(1, 32000) == pytest.approx(1.0)


def test_sparse_embedding_rows_replace_the_embedding_in_the_first_stages_ring():
    """dp=2 over the network: the first stage's ring loses the vocab x hidden matrix and a
    separate all-gather moves each replica's touched rows with their ids."""
    stages = [(0, 16), (16, 32)]
    pipelines = tuple(Pipeline(tuple(_stage([f"box.{k}:{i}"], *layers)
                                     for i, layers in enumerate(stages)), 1, 8) for k in range(2))
    model = load_model("llama2-7b")
    plan = Plan(PCIE_BOXES, replace(model, num_layers=32), TrainingShape(16, 1024), pipelines)
    sparse = replace(plan, comm=CommSchedule(sparse_embedding_grads=True))
    cost = CostModel.for_plan(plan)
    dense_groups, sparse_groups = gradient_groups(cost, plan), gradient_groups(cost, sparse)
    embedding_bytes = 2 * model.vocab_size * model.hidden_size
    assert dense_groups[0].grad_bytes - sparse_groups[0].grad_bytes == pytest.approx(
        embedding_bytes)
    rows = expected_unique_tokens(8 * 1024, model.vocab_size)
    assert sparse_groups[-1].grad_bytes == pytest.approx(
        sparse_exchange_bytes(rows, model.hidden_size, 2, 2))
    assert predict(sparse).iteration_time_s < predict(plan).iteration_time_s
    assert simulate(sparse).iteration_time_s < simulate(plan).iteration_time_s


def _off():
    from potluck.cluster.execution import Execution

    return Execution(tp_overlap_chunks=1, recompute_keeps_comm=False, split_p2p_channels=False,
                     dp_priority_schedule=False, sparse_embedding_grads=False)


def test_the_planner_overlaps_a_tp_heavy_layout_where_it_pays_and_as_forced():
    """tp=4 on PCIe with micro-batches of two: the all-reduces outlast the compute, so every
    TP stage runs two sub-batches side by side; forced off, none does, and it is slower. With
    dropout (GPT-3's) the executor does not run, and no stage overlaps."""
    shape = {"global_batch": 32, "seq_len": 2048, "tp": 4, "pp": 2, "micro_batch_size": 2}
    model = replace(load_model("gpt3-1.3b"), dropout=False)  # the executor runs no dropout
    chosen = api.plan(PCIE_BOXES, model, **shape).best
    plain = api.plan(PCIE_BOXES, model, execution=_off(), **shape).best
    assert {s.comm.tp_overlap_chunks for p in chosen.pipelines for s in p.stages} == {2}
    assert {s.comm for p in plain.pipelines for s in p.stages} == {StageComm()}
    dropout = api.plan(PCIE_BOXES, "gpt3-1.3b", **shape).best
    assert {s.comm for p in dropout.pipelines for s in p.stages} == {StageComm()}
    assert plain.comm == CommSchedule()
    assert chosen.prediction.iteration_time_s < 0.85 * plain.prediction.iteration_time_s


def test_a_plan_with_the_methods_available_is_faster_than_the_best_without():
    """The whole search, each method where it pays against none: never slower, and on a
    pipeline over eight machines faster (split channels at least)."""
    desks = parse_cluster("nodes:\n  - {name: desk, gpu: rtx3090, gpus_per_node: 1, count: 8, "
                          "inter_bandwidth: 10Gb/s}\n", "desks.yaml")
    for cluster in (PCIE_BOXES, desks):
        shape = {"global_batch": 32, "seq_len": 2048}
        chosen = api.plan(cluster, "gpt3-1.3b", **shape).best
        plain = api.plan(cluster, "gpt3-1.3b", execution=_off(), **shape).best
        assert chosen.prediction.iteration_time_s < plain.prediction.iteration_time_s
        assert chosen.comm.split_p2p_channels


def test_zero_bubble_stages_never_run_the_explicit_executor():
    from potluck.cluster.execution import Execution
    from potluck.planner.comm.refine import stage_comm_options

    assert stage_comm_options(Execution(), 4, Recompute.FULL, Schedule.ZERO_BUBBLE) == [
        StageComm()]
    options = stage_comm_options(Execution(), 2, Recompute.FULL, Schedule.ONE_F_ONE_B)
    assert StageComm(2, False) not in options and StageComm(2, True) in options
    assert stage_comm_options(Execution(tp_overlap_chunks=4), 2, Recompute.NONE,
                              Schedule.ONE_F_ONE_B) == [StageComm()]  # 4 does not divide 2


def test_models_the_explicit_executor_does_not_run_are_planned_without_it():
    """Gemma 2's post-norms are not the pre-norm blocks the executor runs: the search keeps
    its TP stages on DTensor styles, and forcing TP overlap is refused in one line."""
    from potluck.cluster.execution import Execution
    from potluck.errors import ConfigError
    from potluck.planner.comm.refine import stage_comm_options
    from potluck.planner.search import search
    from potluck.plans import TrainingShape

    gemma = load_model("gemma2-2b")
    assert not gemma.runs_explicit_tp and load_model("llama2-7b").runs_explicit_tp
    assert stage_comm_options(Execution(), 4, Recompute.FULL, Schedule.ONE_F_ONE_B,
                              explicit=False) == [StageComm()]
    cluster = "nodes:\n  - name: box\n    gpu: rtx3090\n    gpus_per_node: 4\n"
    forced = TrainingShape(8, 1024, execution=Execution(tp_overlap_chunks=2))
    with pytest.raises(ConfigError, match="LLaMA-style and GPT-2 blocks") as err:
        search(parse_cluster(cluster, "box.yaml"), gemma, forced)
    assert "\n" not in str(err.value)
