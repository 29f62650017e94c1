"""The Python API: the same verbs as the CLI (``plan``, ...), with typed arguments.

Everything ``potluck <command>`` does is callable from here; the CLI only
parses flags and renders results.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from potluck.cluster.spec import ClusterSpec, load_cluster
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec, load_model
from potluck.planner.search import Partition, SearchOptions, SearchResult, search
from potluck.plans import DType, Plan, Schedule, TrainingShape
from potluck.sim.result import SimulationResult

DEFAULT_GLOBAL_BATCH = 64
DEFAULT_SEQ_LEN = 2048


def as_cluster(cluster: str | Path | ClusterSpec) -> ClusterSpec:
    return cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)


def as_model(model: str | Path | ModelSpec) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else load_model(str(model))


def training_shape(model: ModelSpec, global_batch: int | None = None, seq_len: int | None = None,
                   dtype: str | DType = DType.BF16) -> TrainingShape:
    """The training shape with potluck's defaults filled in."""
    return TrainingShape(
        global_batch=global_batch or DEFAULT_GLOBAL_BATCH,
        seq_len=seq_len or min(model.max_seq_len, DEFAULT_SEQ_LEN),
        dtype=DType(dtype),
    )


def plan(cluster: str | Path | ClusterSpec, model: str | Path | ModelSpec, *,
         global_batch: int | None = None, seq_len: int | None = None,
         dtype: str | DType = DType.BF16, tp: int | None = None, pp: int | None = None,
         dp: int | None = None, micro_batch_size: int | None = None,
         recompute: str | Recompute | None = None, partition: str | Partition = Partition.BALANCED,
         schedule: str | Schedule = Schedule.ONE_F_ONE_B, zero1: bool | None = None,
         top_k: int = 5, progress: Callable[[float], None] | None = None) -> SearchResult:
    """Plan training of ``model`` on ``cluster``: the best plans, best first."""
    spec, model_spec = as_cluster(cluster), as_model(model)
    options = SearchOptions(
        tp=tp, pp=pp, dp=dp, micro_batch_size=micro_batch_size,
        recompute=Recompute(recompute) if recompute else None,
        partition=Partition(partition), schedule=Schedule(schedule), zero1=zero1, top_k=top_k,
    )
    shape = training_shape(model_spec, global_batch, seq_len, dtype)
    return search(spec, model_spec, shape, options, progress)


def simulate(plan: str | Path | Plan, *, schedule: str | Schedule | None = None,
             out_dir: str | Path | None = None) -> SimulationResult:
    """Simulate one iteration of ``plan`` (a Plan or a plan file); with ``out_dir``, write
    timeline.png, memory.png and trace.json there."""
    from potluck.plans import load_plan
    from potluck.sim import simulate as run_simulation
    from potluck.sim.outputs import write_outputs

    loaded = plan if isinstance(plan, Plan) else load_plan(plan)
    result = run_simulation(loaded, schedule)
    if out_dir is not None:
        write_outputs(result, out_dir)
    return result


def profile(out: str | Path = "cluster.yaml", *, model: str | Path | ModelSpec = "llama2-7b",
            cluster: str | Path | None = None, ranks: int | None = None, budget_s: float = 1.0,
            device_type: str | None = None,
            progress: Callable[[float], None] | None = None):
    """Measure the devices and links this runs on and write a calibrated cluster file
    (``cluster`` given: that file with its calibration section replaced)."""
    from potluck.profiler import profile_cluster

    return profile_cluster(out, as_model(model), cluster=cluster, ranks=ranks, budget_s=budget_s,
                           device_type=device_type, progress=progress)
