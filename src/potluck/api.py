"""The Python API: the same verbs as the CLI (``plan``, ...), with typed arguments.

Everything ``potluck <command>`` does is callable from here; the CLI only
parses flags and renders results.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from potluck.cluster.spec import ClusterSpec, load_cluster
from potluck.economics.candidates import CostRequest
from potluck.economics.cheapest import check_deadline, plan_cheapest
from potluck.economics.offers import MAX_GPUS_PER_NODE, Offer, catalog_offers, load_offers
from potluck.economics.prices import Pricing
from potluck.economics.study import CostStudy, cost_study
from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.model.spec import ModelSpec, load_model
from potluck.planner.search import Partition, SearchOptions, SearchResult, search
from potluck.plans import DType, Plan, Schedule, TrainingShape
from potluck.units import parse_count

if TYPE_CHECKING:
    from potluck.profiler import ProfileOutcome
    from potluck.sim.result import SimulationResult

DEFAULT_GLOBAL_BATCH = 64
DEFAULT_SEQ_LEN = 2048


class Objective(str, Enum):
    TIME = "time"  # the fastest plan on the whole cluster
    COST = "cost"  # the plan, and the share of the devices, with the lowest USD per token


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
         top_k: int = 5, objective: str | Objective = Objective.TIME,
         tokens: int | str | None = None, deadline_hours: float | None = None,
         pricing: Pricing | None = None,
         progress: Callable[[float], None] | None = None) -> SearchResult:
    """Plan training of ``model`` on ``cluster``: the best plans, best first.

    ``objective="cost"`` chooses the plan and the subset of the devices with the lowest USD
    per token (priced by ``pricing``); ``deadline_hours`` requires ``tokens`` to be trained
    by then (for either objective).
    """
    spec, model_spec = as_cluster(cluster), as_model(model)
    options = SearchOptions(
        tp=tp, pp=pp, dp=dp, micro_batch_size=micro_batch_size,
        recompute=Recompute(recompute) if recompute else None,
        partition=Partition(partition), schedule=Schedule(schedule), zero1=zero1, top_k=top_k,
    )
    shape = training_shape(model_spec, global_batch, seq_len, dtype)
    count = parse_count(tokens, "--tokens") if tokens is not None else None
    if _objective(objective) is Objective.COST:
        return plan_cheapest(spec, model_spec, shape, options, pricing, count, deadline_hours, progress)
    result = search(spec, model_spec, shape, options, progress)
    check_deadline(result, count, deadline_hours)
    return result


def _objective(objective: str | Objective) -> Objective:
    try:
        return Objective(objective)
    except ValueError:
        raise ConfigError(f"--objective must be time or cost, not {objective!r}") from None


def cost(model: str | Path | ModelSpec, tokens: int | str, *,
         offers: str | Path | list[Offer] | None = None, max_gpus: int | None = None,
         max_usd_per_hour: float | None = None, deadline_hours: float | None = None,
         pricing: Pricing | None = None, global_batch: int | None = None, seq_len: int | None = None,
         dtype: str | DType = DType.BF16,
         progress: Callable[[float], None] | None = None) -> CostStudy:
    """Rank offers (an offers file, or the catalog's GPUs up to ``max_gpus``) for training
    ``tokens`` tokens of ``model``: by USD per million tokens, with time to train and RCC."""
    model_spec = as_model(model)
    request = CostRequest(parse_count(tokens, "--tokens"), pricing or Pricing(), deadline_hours,
                          max_usd_per_hour, max_gpus)
    if offers is None:
        candidates = catalog_offers(max_gpus or MAX_GPUS_PER_NODE)
    else:
        candidates = offers if isinstance(offers, list) else load_offers(offers)
    shape = training_shape(model_spec, global_batch, seq_len, dtype)
    return cost_study(model_spec, shape, candidates, request, progress=progress)


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
            progress: Callable[[float], None] | None = None) -> ProfileOutcome | None:
    """Measure the devices and links this runs on and write a calibrated cluster file
    (``cluster`` given: that file with its calibration section replaced). ``None`` on
    torchrun ranks other than 0."""
    from potluck.profiler import profile_cluster

    return profile_cluster(out, as_model(model), cluster=cluster, ranks=ranks, budget_s=budget_s,
                           device_type=device_type, progress=progress)
