"""The Plan contract: JSON round trip, self-containment, validation, schema."""

import json

import pytest

from potluck.cluster import parse_cluster
from potluck.errors import ConfigError
from potluck.model import load_model
from potluck.planner.search import search
from potluck.plans import (
    Pipeline,
    Plan,
    Stage,
    TrainingShape,
    check_plan,
    load_plan,
    plan_from_dict,
    plan_json_schema,
    plan_to_dict,
    save_plan,
)

CLUSTER = parse_cluster("""
nodes:
  - {name: a, gpu: a100-80g-sxm, gpus_per_node: 2}
  - {name: b, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs}
""")


@pytest.fixture(scope="module")
def plan():
    return search(CLUSTER, load_model("gpt3-350m"), TrainingShape(16, 1024)).best


def test_json_round_trip_gives_an_equal_plan(plan, tmp_path):
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    loaded = load_plan(path)
    assert loaded == plan
    assert loaded.prediction == plan.prediction


def test_a_plan_file_is_self_contained(plan):
    data = json.loads(json.dumps(plan_to_dict(plan)))
    assert data["version"] == 1
    assert data["model"]["hidden_size"] == 1024
    assert data["training"]["global_batch"] == 16 and data["training"]["seq_len"] == 1024
    assert data["training"]["execution"]["flash_attention"] is True
    assert {t["name"] for t in data["cluster"]["device_types"]} == {"a100-80g-sxm", "rtx3090"}


def _pipeline(devices_layers, micro_batches=4):
    stages = tuple(Stage(tuple(d), ((a, b),)) for d, (a, b) in devices_layers)
    return Pipeline(stages, 1, micro_batches)


def _plan(*pipelines, batch=None):
    model = load_model("gpt3-350m")
    batch = batch or sum(p.batch_share for p in pipelines)
    return Plan(CLUSTER, model, TrainingShape(batch, 1024), tuple(pipelines))


@pytest.mark.parametrize(
    ("plan_factory", "fragment"),
    [
        (lambda: _plan(_pipeline([(["a.0:0"], (0, 24))]), _pipeline([(["a.0:0"], (0, 24))])),
         "twice"),
        (lambda: _plan(_pipeline([(["z.0:0"], (0, 24))])), "not in cluster"),
        (lambda: _plan(_pipeline([(["a.0:0"], (0, 10)), (["a.0:1"], (12, 24))])), "without gaps"),
        (lambda: _plan(_pipeline([(["a.0:0"], (0, 20))])), "model has 24"),
        (lambda: _plan(_pipeline([(["a.0:0"], (0, 24))]), batch=5), "global batch"),
        (lambda: _plan(_pipeline([(["a.0:0", "b.0:0"], (0, 24))])), "spans machines"),
    ],
)
def test_inconsistent_plans_are_rejected(plan_factory, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_plan(plan_factory())


def test_tensor_parallel_must_divide_the_heads():
    model = load_model("gpt3-350m")  # 16 heads
    cluster = parse_cluster("nodes: [{name: a, gpu: a100-80g-sxm, gpus_per_node: 8}]")
    stage = Stage(tuple(f"a.0:{i}" for i in range(3)), ((0, 24),))
    plan = Plan(cluster, model, TrainingShape(4, 1024), (Pipeline((stage,), 1, 4),))
    with pytest.raises(ConfigError, match="does not divide"):
        check_plan(plan)


def test_other_versions_and_malformed_files_are_one_clear_line(tmp_path, plan):
    data = plan_to_dict(plan)
    with pytest.raises(ConfigError, match="version 2 is not supported"):
        plan_from_dict({**data, "version": 2})
    with pytest.raises(ConfigError, match="pipelines"):
        plan_from_dict({**data, "pipelines": "many"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_plan(bad)


def test_the_schema_describes_every_top_level_field():
    schema = plan_json_schema()
    assert {"cluster", "model", "training", "pipelines", "schedule", "recompute"} <= set(
        schema["properties"])


def test_the_documented_schema_file_is_current():
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "write_schema.py"
    spec = importlib.util.spec_from_file_location("write_schema", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SCHEMA_PATH.read_text() == module.schema_text(), "run python tools/write_schema.py"


def _tp_plan(chunks=1, keeps=False, micro_batch=2, recompute=None, schedule=None, execution=None,
             swap=None, model=None):
    from dataclasses import replace

    from potluck.cluster.execution import Execution
    from potluck.model.counts import Recompute
    from potluck.plans import StageComm
    from potluck.plans.memory import StageMemory, Swap

    comm = StageComm(chunks, keeps)
    memory = StageMemory(swap=Swap(swap)) if swap else StageMemory()
    stages = (Stage(("a.0:0", "a.0:1"), ((0, 12),), memory=memory, comm=comm),
              Stage(("b.0:0", "b.0:1"), ((12, 24),), comm=comm))
    shape = TrainingShape(micro_batch * 4, 1024, execution=execution or Execution())
    # the explicit executor runs no dropout: gpt3-350m without it, unless a model is named
    model = load_model(model) if model else replace(load_model("gpt3-350m"), dropout=False)
    plan = Plan(CLUSTER, model, shape, (Pipeline(stages, micro_batch, 4),),
                recompute=recompute or Recompute.NONE)
    return replace(plan, schedule=schedule) if schedule else plan


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"chunks": 2, "micro_batch": 3}, "tp_overlap_chunks 2 does not divide the micro-batch size 3"),
    ({"chunks": 2, "recompute": "full"}, "recomputation always keeps its collectives' results"),
    ({"keeps": True, "recompute": "full", "schedule": "zb"}, "zero-bubble schedule"),
    ({"chunks": 2, "swap": "host"}, "pipeline 0 stage 0: the explicit TP executor .* does not "
                                    "swap activations"),
    ({"chunks": 2, "model": "gpt3-350m"}, "does not run models with dropout"),
])
def test_stage_communication_that_cannot_run_is_one_line(kwargs, fragment):
    from potluck.model.counts import Recompute
    from potluck.plans import Schedule

    if "recompute" in kwargs:
        kwargs["recompute"] = Recompute(kwargs["recompute"])
    if "schedule" in kwargs:
        kwargs["schedule"] = Schedule(kwargs["schedule"])
    with pytest.raises(ConfigError, match=fragment) as err:
        check_plan(_tp_plan(**kwargs))
    assert "\n" not in str(err.value)


def test_swapping_runs_on_a_stage_without_the_explicit_tp_executor():
    check_plan(_tp_plan(swap="host"))
    check_plan(_tp_plan(keeps=True, swap="host"))  # keeps without recomputation: plain TP


def test_overlap_on_a_single_device_stage_is_refused():
    from potluck.plans import StageComm

    stages = (Stage(("a.0:0",), ((0, 24),), comm=StageComm(2)),)
    plan = Plan(CLUSTER, load_model("gpt3-350m"), TrainingShape(8, 1024),
                (Pipeline(stages, 2, 4),))
    with pytest.raises(ConfigError, match="needs a tensor-parallel stage"):
        check_plan(plan)


def test_a_decision_the_execution_forces_otherwise_is_refused():
    from dataclasses import replace

    from potluck.cluster.execution import Execution
    from potluck.plans import CommSchedule, explicit_tp

    check_plan(_tp_plan(chunks=2, execution=Execution(tp_overlap_chunks=2)))
    assert explicit_tp(_tp_plan(chunks=2), 0, 0) and not explicit_tp(_tp_plan(), 0, 0)
    assert not explicit_tp(_tp_plan(keeps=True), 0, 0)  # keeps without recomputation: plain
    with pytest.raises(ConfigError, match="tp_overlap_chunks is 2, but the plan's execution "
                                          "forces 1"):
        check_plan(_tp_plan(chunks=2, execution=Execution(tp_overlap_chunks=1)))
    split = replace(_tp_plan(execution=Execution(split_p2p_channels=False)),
                    comm=CommSchedule(split_p2p_channels=True))
    with pytest.raises(ConfigError, match="the plan: split_p2p_channels is true, but the plan's "
                                          "execution forces false"):
        check_plan(split)


def test_communication_decisions_round_trip_and_old_plans_load_plain(plan):
    from dataclasses import replace

    from potluck.plans import PLAIN_COMM, CommSchedule

    decided = replace(_tp_plan(chunks=2), comm=CommSchedule(True, True, False))
    assert plan_from_dict(json.loads(json.dumps(plan_to_dict(decided)))) == decided
    data = plan_to_dict(plan)
    del data["comm"]
    for pipeline in data["pipelines"]:
        for stage in pipeline["stages"]:
            del stage["comm"]
    old = plan_from_dict(data)
    assert old.comm == CommSchedule() and old.pipelines[0].stages[0].comm == PLAIN_COMM


def _replicas(micro_batches, schedule=None, zero=3):
    """Two one-stage replicas of gpt3-350m on the A100s with these micro-batch counts."""
    from dataclasses import replace

    from potluck.plans import Schedule

    pipelines = [_pipeline([([f"a.0:{k}"], (0, 24))], m) for k, m in enumerate(micro_batches)]
    return replace(_plan(*pipelines), zero=zero, schedule=schedule or Schedule.ONE_F_ONE_B)


def test_zero3_replicas_run_alike_and_in_lockstep_or_the_plan_is_refused():
    from potluck.plans import Schedule

    check_plan(_replicas([4, 4]))
    check_plan(_replicas([4, 2], zero=2))
    with pytest.raises(ConfigError, match="the plan: zero 3 needs every replica to run the same "
                                          "number of micro-batches"):
        check_plan(_replicas([4, 2]))
    with pytest.raises(ConfigError, match="zero 3 does not run zero bubble"):
        check_plan(_replicas([4, 4], Schedule.ZERO_BUBBLE))


def test_a_stage_that_keeps_communication_but_recomputes_no_block_runs_plain_tp():
    """Recomputation of none of its blocks has no collective to keep: the plans' rule, the
    cost model's stage (whole, and each chunk of it) and the runtime agree it runs plain TP."""
    from dataclasses import replace

    from potluck.model.counts import Recompute
    from potluck.planner.evaluate import stage_shape
    from potluck.plans import explicit_tp
    from potluck.plans.memory import StageMemory

    plan = _tp_plan(keeps=True, recompute=Recompute.FULL)
    first = plan.pipelines[0].stages[0]
    none_recomputed = replace(first, memory=StageMemory(recompute_blocks=0))
    plan = replace(plan, pipelines=(replace(plan.pipelines[0], stages=(
        none_recomputed, *plan.pipelines[0].stages[1:])),))
    check_plan(plan)
    shape = stage_shape(plan, 0, 0)
    assert shape.keeps_comm and shape.recompute is Recompute.FULL and shape.recomputed == 0
    assert not explicit_tp(plan, 0, 0) and not shape.explicit_tp(2)
    assert explicit_tp(plan, 0, 1) and stage_shape(plan, 0, 1).explicit_tp(2)
    whole = stage_shape(plan, 0, 1)
    chunk = replace(whole, recompute_blocks=4).with_layers(6, offset=6)  # recomputes none itself
    assert chunk.recomputed == 0 and chunk.explicit_tp(2)  # its stage runs the executor
