"""Every schedule has one module that answers for it, and what torch cannot run is never planned."""

import pytest

from potluck.cluster import parse_cluster
from potluck.errors import ConfigError
from potluck.model import load_model
from potluck.ops import OpKind
from potluck.planner.search import SearchOptions, search
from potluck.plans import Pipeline, Plan, Stage, TrainingShape, check_plan, mixed_tp
from potluck.schedules import SCHEDULES, Schedule, schedule_for
from potluck.sim import simulate


def test_every_schedule_name_has_exactly_its_module():
    assert set(SCHEDULES) == set(Schedule)
    for name, schedule in SCHEDULES.items():
        assert schedule.name is name
        assert schedule_for(name.value) is schedule
    assert [name.value for name in Schedule] == ["gpipe", "1f1b", "interleaved", "zb"]


@pytest.mark.parametrize("name", list(Schedule))
def test_a_pipeline_of_one_stage_runs_forward_then_backward_per_micro_batch(name):
    order = schedule_for(name).rank_orders(1, 2)
    assert [(a.kind, a.micro_batch) for a in order[0]] == [
        (OpKind.FORWARD, 0), (OpKind.BACKWARD, 0), (OpKind.FORWARD, 1), (OpKind.BACKWARD, 1)]


def test_what_torch_cannot_run_is_said_in_one_line():
    assert schedule_for("1f1b").problem(3, 4) is None  # fill and drain, as Megatron-LM runs it
    assert not schedule_for("1f1b").single_stage_class(4, 3)  # on torch's schedule runtime
    assert schedule_for("1f1b").single_stage_class(4, 4)  # torch's Schedule1F1B
    assert schedule_for("1f1b").problem(4, 4) is None
    assert schedule_for("1f1b").problem(1, 1) is None  # one stage: the runtime's own loop
    assert schedule_for("gpipe").problem(1, 8) is None
    assert "multiple of 2" in schedule_for("interleaved").problem(9, 4, 2)  # rounds of 4
    assert schedule_for("interleaved").problem(8, 4, 2) is None
    assert "virtual stages" in schedule_for("gpipe").problem(8, 4, 2)
    assert "tensor-parallel" in schedule_for("zb").problem(8, 4, 2, mixed_tp=True)
    assert schedule_for("interleaved").problem(8, 4, 2, mixed_tp=True) is None
    assert ConfigError is type(_raised(lambda: schedule_for("zb").check(9, 4, 2)))


def _raised(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the type is what the test looks at
        return err
    return None


SPEC = parse_cluster("""
nodes:
  - {name: a, gpu: a100-80g-pcie, gpus_per_node: 1}
  - {name: b, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs}
""")
MODEL = load_model("tiny-llama")


def _plan(schedule: Schedule, micro_batches: int, tps: tuple[int, ...], virtual: int = 1) -> Plan:
    devices = iter(["a.0:0", "b.0:0", "b.0:1"])
    layers = MODEL.num_layers // (len(tps) * virtual)
    stages = []
    for i, tp in enumerate(tps):
        ranges = tuple(((c * len(tps) + i) * layers, (c * len(tps) + i + 1) * layers)
                       for c in range(virtual))
        stages.append(Stage(tuple(next(devices) for _ in range(tp)), ranges))
    pipeline = Pipeline(tuple(stages), 1, micro_batches)
    return Plan(SPEC, MODEL, TrainingShape(micro_batches, 64), (pipeline,), schedule, virtual)


def test_plans_torch_cannot_run_as_written_are_refused():
    check_plan(_plan(Schedule.GPIPE, 1, (1, 1)))
    check_plan(_plan(Schedule.ONE_F_ONE_B, 1, (1, 1)))  # fill and drain
    check_plan(_plan(Schedule.INTERLEAVED, 4, (1, 2), virtual=2))
    with pytest.raises(ConfigError, match="different tensor-parallel degrees"):
        check_plan(_plan(Schedule.ZERO_BUBBLE, 4, (1, 2), virtual=2))


@pytest.mark.parametrize("schedule", list(Schedule))
def test_the_search_only_emits_plans_the_runtime_runs_as_written(schedule):
    options = SearchOptions(schedule=schedule, top_k=5, max_micro_batch_size=2)
    result = search(SPEC, MODEL, TrainingShape(4, 64), options)
    for plan in result.plans:
        check_plan(plan)
        for pipeline in plan.pipelines:
            assert schedule_for(schedule).accepts(pipeline.num_micro_batches, pipeline.pp,
                                                  plan.virtual_stages, mixed_tp=mixed_tp(pipeline))


@pytest.mark.parametrize(("schedule", "micro_batches", "virtual", "advice"), [
    # zb cannot run mixed TP; interleaved cannot run 5 micro-batches in rounds of 2
    (Schedule.ZERO_BUBBLE, 5, 1, "; schedule gpipe or 1f1b runs it as laid out"),
    (Schedule.GPIPE, 4, 2, "; schedule interleaved runs it as laid out"),
    (Schedule.ZERO_BUBBLE, 4, 2, "; schedule interleaved runs it as laid out"),
])
def test_simulating_with_a_schedule_that_cannot_run_the_plan_names_only_those_that_can(
        schedule, micro_batches, virtual, advice):
    """simulate --schedule cannot change the plan's micro-batch count or layout: it advises
    only schedules that run the plan as it is."""
    plan = _plan(Schedule.INTERLEAVED if virtual > 1 else Schedule.ONE_F_ONE_B,
                 micro_batches, (1, 2), virtual)
    with pytest.raises(ConfigError) as err:
        simulate(plan, schedule=schedule)
    assert str(err.value).endswith(advice), str(err.value)


def test_a_plan_file_no_schedule_runs_says_to_plan_again():
    with pytest.raises(ConfigError, match="no schedule runs this pipeline as laid out: make a new "
                                          "plan with schedule zb$"):
        check_plan(_plan(Schedule.ZERO_BUBBLE, 5, (1, 2), virtual=2))
