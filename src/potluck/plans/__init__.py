"""The Plan: the contract between the planner, the simulator and the runtime.

A plan is frozen, versioned data. It says which devices form which pipeline
(one per data-parallel replica), which tensor-parallel group runs which
layers in each stage, how the global batch is split between replicas (shares
may differ: faster replicas take more), the micro-batch size and count, the
schedule and the recomputation. It carries the cluster, the model and the
training shape it was made for, so a plan file alone says everything the
runtime and the simulator need. An uneven, heterogeneous plan is just
different data; nothing downstream re-decides strategy.

Layers are numbered over the transformer blocks, ``[start, end)``; the first
stage of every pipeline also holds the embedding and the last one the final
norm, the output projection and the loss.

The package: the data (:mod:`potluck.plans.data`), each stage's memory choices
(:mod:`potluck.plans.memory`), the islands that synchronize rarely
(:mod:`potluck.plans.islands`), plan files (:mod:`potluck.plans.files`) and every rule a
plan must keep to run (:mod:`potluck.plans.feasibility`), which the search, the plan
loader and the runtime all call.
"""

from potluck.cluster.execution import Execution
from potluck.plans.data import (
    PLAIN_COMM,
    PLAN_VERSION,
    CommSchedule,
    DeviceMemory,
    DType,
    HostMemory,
    Pipeline,
    Placement,
    Plan,
    Prediction,
    Stage,
    StageComm,
    TiedGradSync,
    TimeBreakdown,
    TrainingShape,
    ZeroStage,
    mixed_tp,
)
from potluck.plans.feasibility import (
    MODEL_SHAPE_FIELDS,
    check_pipeline_schedule,
    check_plan,
    check_plan_matches,
    expert_parallel_problem,
    explicit_tp,
    explicit_tp_model_problem,
    explicit_tp_plan_problem,
    islands_problem,
    runs_explicit_tp,
    shards_parameters,
    stage_recomputes,
    zero3_problem,
)
from potluck.plans.files import (
    load_plan,
    plan_from_dict,
    plan_json_schema,
    plan_to_dict,
    plan_to_json,
    save_plan,
)
from potluck.plans.islands import (
    ONE_ISLAND,
    Compression,
    InnerLR,
    Island,
    Islands,
    SyncMethod,
    Transport,
)
from potluck.schedules import Schedule

__all__ = [
    "MODEL_SHAPE_FIELDS", "ONE_ISLAND", "PLAIN_COMM", "Compression", "InnerLR", "Island",
    "Islands", "SyncMethod", "Transport", "islands_problem", "PLAN_VERSION", "CommSchedule",
    "DType", "DeviceMemory", "Execution",
    "HostMemory", "Pipeline", "Placement", "Plan", "Prediction", "Schedule", "Stage",
    "StageComm", "TiedGradSync", "TimeBreakdown", "TrainingShape", "ZeroStage",
    "check_pipeline_schedule", "check_plan", "check_plan_matches", "expert_parallel_problem",
    "explicit_tp", "explicit_tp_model_problem", "explicit_tp_plan_problem",
    "load_plan", "mixed_tp", "plan_from_dict", "plan_json_schema",
    "plan_to_dict", "plan_to_json", "save_plan", "runs_explicit_tp", "shards_parameters",
    "stage_recomputes", "zero3_problem",
]
