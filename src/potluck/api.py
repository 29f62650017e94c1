"""The Python API: the same verbs as the CLI (``plan``, ...), with typed arguments.

Everything ``potluck <command>`` does is callable from here; the CLI only
parses flags and renders results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from potluck.cluster.execution import Execution, choose_execution, describe
from potluck.cluster.spec import ClusterSpec, load_cluster
from potluck.economics.candidates import CostRequest
from potluck.economics.cheapest import check_deadline, plan_cheapest
from potluck.economics.offers import MAX_GPUS_PER_NODE, Offer, catalog_offers, load_offers
from potluck.economics.prices import Pricing
from potluck.economics.study import CostStudy, cost_study
from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.model.loading import load_model
from potluck.model.spec import ModelSpec, check_seq_len
from potluck.multijob.simulation import DEFAULT_RESTART_S
from potluck.planner.checks import pin_notes
from potluck.planner.islands.planning import plan_islands
from potluck.planner.options import Partition, SearchOptions
from potluck.planner.requests.host_limit import search_explained
from potluck.planner.requests.placement_cost import placement_cost_note
from potluck.planner.search import SearchResult
from potluck.plans import DType, Plan, Schedule, TrainingShape
from potluck.plans.islands import SyncMethod
from potluck.plans.memory import Offload, Swap
from potluck.runtime.loop.schedule import LRSchedule
from potluck.units import non_negative_number, parse_count, whole_number

E = TypeVar("E", bound=Enum)

if TYPE_CHECKING:
    from potluck.calibrate.calibrate_run import CalibrationOutcome
    from potluck.calibrate.measured.calibrate import MeasuredOutcome
    from potluck.multijob import Job, PolicyComparison, ScheduleResult
    from potluck.multijob.executor import Progress, RunOutcome
    from potluck.multijob.trace import MixEntry
    from potluck.profiler import ProfileOutcome
    from potluck.runtime.checkpoints.export import Exported
    from potluck.runtime.elastic.supervisor import ElasticSettings, Report
    from potluck.runtime.launch.torchrun import NodeCommand
    from potluck.runtime.loop.metrics import StepMetrics
    from potluck.runtime.options import TrainOptions
    from potluck.sim.compare import TraceComparison
    from potluck.sim.result import SimulationResult

DEFAULT_GLOBAL_BATCH = 64
DEFAULT_SEQ_LEN = 2048
AUTO = "auto"  # a technique left to the search


class Objective(str, Enum):
    TIME = "time"  # the fastest plan on the whole cluster
    COST = "cost"  # the plan, and the share of the devices, with the lowest USD per token


def as_cluster(cluster: str | Path | ClusterSpec) -> ClusterSpec:
    return cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)


def as_model(model: str | Path | ModelSpec) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else load_model(str(model))


def training_shape(model: ModelSpec, global_batch: int | None = None, seq_len: int | None = None,
                   dtype: str | DType = DType.BF16,
                   execution: Execution | None = None) -> TrainingShape:
    """The training shape with potluck's defaults filled in (execution: potluck's runtime)."""
    return TrainingShape(
        global_batch=DEFAULT_GLOBAL_BATCH if global_batch is None else global_batch,
        seq_len=min(model.max_seq_len, DEFAULT_SEQ_LEN) if seq_len is None else seq_len,
        dtype=as_dtype(dtype), execution=execution or Execution(),
    )


def as_execution(execution: str | Path | Execution | None,
                 cluster: ClusterSpec | None = None) -> Execution:
    """The execution traits to plan with: ``execution`` (traits, a preset name or a YAML
    file), else the cluster file's ``execution:`` section, else potluck's runtime."""
    if isinstance(execution, Execution):
        return execution
    from_cluster = cluster.execution if cluster is not None else None
    return choose_execution(str(execution) if execution is not None else None, from_cluster)


def as_dtype(dtype: str | DType) -> DType:
    """``dtype`` as a :class:`DType` (bf16, fp16, fp32 or tf32)."""
    return _member(DType, dtype, "dtype")


def _member(kind: type[E], value: str | E, what: str) -> E:
    """``value`` as a member of the enum ``kind``; a ConfigError naming ``what`` and the
    choices otherwise."""
    try:
        return kind(value)
    except ValueError:
        names = ", ".join(str(member.value) for member in kind)
        raise ConfigError(f"{what} must be one of {names}, not {value!r}") from None


def plan(cluster: str | Path | ClusterSpec, model: str | Path | ModelSpec, *,
         options: SearchOptions | None = None,
         global_batch: int | None = None, seq_len: int | None = None,
         dtype: str | DType = DType.BF16, tp: int | None = None, pp: int | None = None,
         dp: int | None = None, micro_batch_size: int | None = None, ep: int | None = None,
         recompute: str | Recompute | None = None, partition: str | Partition = Partition.BALANCED,
         schedule: str | Schedule = AUTO, zero: int | None = None,
         swap: str | Swap | None = None, offload: str | Offload | None = None,
         top_k: int = 5, objective: str | Objective = Objective.TIME,
         tokens: int | str | None = None, deadline_hours: float | None = None,
         pricing: Pricing | None = None, execution: str | Path | Execution | None = None,
         progress: Callable[[float], None] | None = None) -> SearchResult:
    """Plan training of ``model`` on ``cluster``: the best plans, best first.

    ``objective="cost"`` chooses the plan and the subset of the devices with the lowest USD
    per token (priced by ``pricing``); ``deadline_hours`` requires ``tokens`` to be trained
    by then (for either objective). ``execution`` is the framework that will train (a
    preset name such as ``megatron-lm``, a YAML file of traits, or :class:`Execution`);
    by default the cluster file's ``execution:`` section, else potluck's runtime. The
    search's pins are ``options`` (built once by :func:`search_options`, as ``potluck plan``
    does) or the keywords ``tp`` to ``top_k``, not both.
    """
    spec, model_spec = as_cluster(cluster), as_model(model)
    pins = search_options(
        tp=tp, pp=pp, dp=dp, micro_batch_size=micro_batch_size, ep=ep, recompute=recompute,
        partition=partition, schedule=schedule, zero=zero, swap=swap, offload=offload,
        top_k=top_k,
    )
    if options is not None and pins != SearchOptions():
        raise ConfigError("give the search's pins as options= or as keywords (tp=, pp=, ...), "
                          "not both")
    options = pins if options is None else options
    shape = training_shape(model_spec, global_batch, seq_len, dtype, as_execution(execution, spec))
    warning = check_seq_len(model_spec, shape.seq_len)
    count = parse_count(tokens, "--tokens") if tokens is not None else None
    if _objective(objective) is Objective.COST:
        if options.sync not in (None, SyncMethod.SYNC):
            raise ConfigError(f"--sync {options.sync.value} plans by time to a target loss; "
                              "use --objective time, or --sync sync with --objective cost")
        result = plan_cheapest(spec, model_spec, shape, options, pricing, count, deadline_hours,
                               progress)
    else:
        result = plan_islands(spec, model_spec, shape, options,
                              lambda: search_explained(spec, model_spec, shape, options, progress))
        check_deadline(result, count, deadline_hours)
        placement = placement_cost_note(spec, model_spec, shape, options, result.best)
        if placement:
            best = replace(result.best, notes=(*result.best.notes, placement))
            result = replace(result, plans=(best, *result.plans[1:]))
    return _with_notes(result, options, warning)


def _with_notes(result: SearchResult, options: SearchOptions, warning: str | None) -> SearchResult:
    """Every plan with what the request means for it: a sequence beyond the model's positions
    (``warning``), a pin with no effect on it (:func:`~potluck.planner.checks.pin_notes`)."""
    plans = tuple(replace(p, notes=(*p.notes, *([warning] if warning else []),
                                    *pin_notes(p, options)))
                  for p in result.plans)
    return replace(result, plans=plans)


def search_options(*, tp: int | None = None, pp: int | None = None, dp: int | None = None,
                   micro_batch_size: int | None = None, ep: int | None = None,
                   recompute: str | Recompute | None = None,
                   partition: str | Partition = Partition.BALANCED,
                   schedule: str | Schedule = AUTO, zero: int | None = None,
                   swap: str | Swap | None = None, offload: str | Offload | None = None,
                   top_k: int = 5, sync: str | SyncMethod | None = None,
                   target_tokens: int | str | None = None) -> SearchOptions:
    """:class:`~potluck.planner.options.SearchOptions` from the pins of ``potluck plan``
    (``None`` or ``auto``: left to the search); a ConfigError for a technique it does not know."""
    whole_number(top_k, "--top")
    return SearchOptions(
        tp=tp, pp=pp, dp=dp, micro_batch_size=micro_batch_size, ep=ep,
        recompute=_pin(recompute, Recompute), partition=Partition(partition),
        schedule=_pin(schedule, Schedule), zero=zero, swap=_pin(swap, Swap),
        offload=_pin(offload, Offload), top_k=top_k, sync=_pin(sync, SyncMethod),
        target_tokens=(parse_count(target_tokens, "--target-tokens")
                       if target_tokens is not None else None),
    )


def _pin(value: str | Enum | None, kind: type[Enum]) -> Any:
    """A technique pinned to ``value``, or None where it is unset or ``auto``."""
    if value is None or value == AUTO:
        return None
    try:
        return kind(value)
    except ValueError:
        names = "|".join([*(item.value for item in kind), AUTO])
        raise ConfigError(f"{value!r} is not one of {names}") from None


def _objective(objective: str | Objective) -> Objective:
    try:
        return Objective(objective)
    except ValueError:
        raise ConfigError(f"--objective must be time or cost, not {objective!r}") from None


def cost(model: str | Path | ModelSpec, tokens: int | str, *,
         offers: str | Path | list[Offer] | None = None, max_gpus: int | None = None,
         max_usd_per_hour: float | None = None, deadline_hours: float | None = None,
         pricing: Pricing | None = None, global_batch: int | None = None, seq_len: int | None = None,
         dtype: str | DType = DType.BF16, execution: str | Path | Execution | None = None,
         progress: Callable[[int, int, str], None] | None = None) -> CostStudy:
    """Rank offers (an offers file, or the catalog's GPUs up to ``max_gpus``) for training
    ``tokens`` tokens of ``model``: by USD per million tokens, with time to train and RCC.
    ``execution``: the framework that will train (as for :func:`plan`; default potluck's).
    ``progress(done, offers, name)`` hears of each offer planned (offers of the same
    hardware are searched once)."""
    model_spec = as_model(model)
    request = CostRequest(parse_count(tokens, "--tokens"), pricing or Pricing(), deadline_hours,
                          max_usd_per_hour, max_gpus)
    if offers is None:
        candidates = catalog_offers(max_gpus or MAX_GPUS_PER_NODE)
    else:
        candidates = offers if isinstance(offers, list) else load_offers(offers)
    shape = training_shape(model_spec, global_batch, seq_len, dtype, as_execution(execution))
    warning = check_seq_len(model_spec, shape.seq_len)
    study = cost_study(model_spec, shape, candidates, request, progress=progress)
    return replace(study, notes=(warning,)) if warning else study


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
            device_type: str | None = None, timeout_s: float | None = None,
            progress: Callable[[float, str], None] | None = None) -> ProfileOutcome | None:
    """Measure the devices and links this runs on and write a calibrated cluster file
    (``cluster`` given: that file with its calibration section replaced). ``None`` on
    torchrun ranks other than 0. ``progress(fraction, what)`` as it goes; stopped with an
    error after ``timeout_s`` (default: a few times the estimate)."""
    from potluck.profiler import profile_cluster

    return profile_cluster(out, as_model(model), cluster=cluster, ranks=ranks, budget_s=budget_s,
                           device_type=device_type, timeout_s=timeout_s, progress=progress)


@dataclass(frozen=True)
class TrainResult:
    """The plan a run used and rank 0's metrics, one per step."""

    plan: Plan
    history: list[StepMetrics]

    def summary(self) -> str:
        """One line about the run: loss, throughput, measured against predicted step time."""
        from potluck.runtime.loop.metrics import summarize

        return summarize(self.history)


def resolve_plan(cluster: str | Path | ClusterSpec | None = None,
                 model: str | Path | ModelSpec | None = None, *,
                 plan_file: str | Path | Plan | None = None, global_batch: int | None = None,
                 seq_len: int | None = None, dtype: str | DType | None = None,
                 partition: str | Partition = Partition.BALANCED,
                 run_dir: str | Path | None = None,
                 execution: str | Path | Execution | None = None) -> Plan:
    """The plan to train: ``plan_file`` (checked against ``cluster`` and ``model`` when given),
    or the best plan for ``cluster`` and ``model`` (in ``dtype``, default bf16; with
    ``execution``, as :func:`plan`): CPU ranks the cluster has no calibration for are planned
    with this machine's measured figures (``profiler.quick``, kept in ``run_dir``)."""
    from potluck.plans import check_plan_matches, load_plan

    if plan_file is not None:
        chosen = plan_file if isinstance(plan_file, Plan) else load_plan(plan_file)
        check_plan_matches(chosen, as_cluster(cluster) if cluster is not None else None,
                           as_model(model) if model is not None else None)
        _check_shape_flags(chosen, global_batch, seq_len, dtype)
        _check_execution_flag(chosen, execution)
        return chosen
    if cluster is None or model is None:
        raise ConfigError("give --plan PLAN.json, or --cluster and --model to plan first")
    from potluck.profiler.quick import with_measured_cpu

    model_spec = as_model(model)
    spec = with_measured_cpu(as_cluster(cluster), model_spec, run_dir)
    return plan(spec, model_spec, global_batch=global_batch, seq_len=seq_len,
                dtype=DType.BF16 if dtype is None else dtype, partition=partition,
                execution=execution).best


def model_to_train(model: str | Path | ModelSpec | None, plan_file: object,
                   init_from: object) -> str | Path | ModelSpec | None:
    """The model to plan for: the one given, else (no plan file) ``init_from``'s directory."""
    if model is None and plan_file is None and isinstance(init_from, str | Path):
        return init_from
    return model


def weights_left_note(model: str | Path | ModelSpec | None, init_from: object) -> str | None:
    """What to tell a run whose ``model`` is a directory holding weights it will not load
    (no ``init_from``); None otherwise."""
    if init_from is not None or not isinstance(model, str | Path) or not Path(model).is_dir():
        return None
    from potluck.runtime.checkpoints.weight_files import has_weights

    if not has_weights(model):
        return None
    return (f"{model} holds weights; training starts from new ones (add --init-from {model} "
            "to fine-tune from them)")


def _check_shape_flags(chosen: Plan, global_batch: int | None, seq_len: int | None,
                       dtype: str | DType | None) -> None:
    wanted = as_dtype(dtype).value if dtype is not None else None
    for flag, given, planned in (("--global-batch", global_batch, chosen.training.global_batch),
                                 ("--seq-len", seq_len, chosen.training.seq_len),
                                 ("--dtype", wanted, chosen.training.dtype.value)):
        if given is not None and given != planned:
            raise ConfigError(f"{flag} {given} differs from the plan's {planned}; "
                              "drop the flag or make a new plan")


def _check_execution_flag(chosen: Plan, execution: str | Path | Execution | None) -> None:
    if execution is None:
        return
    wanted = as_execution(execution)
    if wanted != chosen.training.execution:
        raise ConfigError(f"--execution {describe(wanted)} differs from the plan's "
                          f"{describe(chosen.training.execution)}; drop the flag or make a new plan")


def train_options(*, data: str | Path | None = None, tokenizer: str | Path | None = None,
                  out: str | Path | None = None, init_from: str | Path | None = None,
                  lr_schedule: str | LRSchedule = LRSchedule.CONSTANT,
                  **fields: object) -> TrainOptions:
    """:class:`~potluck.runtime.options.TrainOptions` with potluck's defaults (``data`` is
    the shipped corpus; the tokenizer, ``init_from``'s when that model directory holds one),
    checked (learning rate and its schedule, counts, run directory, which may hold another
    run only with ``resume`` or ``overwrite``): a ConfigError for a bad one."""
    from potluck.data.corpus import builtin_corpus_path
    from potluck.data.tokenizer import TOKENIZER_FILES
    from potluck.runtime.launch.checks import check_options
    from potluck.runtime.launch.run_dir import check_run_dir
    from potluck.runtime.options import TrainOptions

    if tokenizer is None and init_from is not None \
            and any((Path(init_from) / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = init_from  # fine-tuning reads text as the model was trained to
    options = TrainOptions(
        data=str(data if data is not None else builtin_corpus_path()),
        tokenizer=str(tokenizer) if tokenizer is not None else None,
        out_dir=str(out) if out is not None else None,
        init_from=str(init_from) if init_from is not None else None,
        lr_schedule=_member(LRSchedule, lr_schedule, "--lr-schedule"), **fields,
    )
    check_options(options)
    check_run_dir(options)
    return options




def run_plan(chosen: Plan, options: TrainOptions, *,
             before_launch: Callable[[Plan, TrainOptions], None] | None = None,
             elastic: ElasticSettings | None = None) -> TrainResult:
    """Train ``chosen`` on this machine's ranks. Everything is checked before any rank
    starts, then ``before_launch(plan, options)`` runs and the CPU measurement the plan was
    made with is kept in the run directory; rank 0 writes the plan there once the run has
    started. An elastic run (``options.elastic``) replans as ``elastic`` says; its result
    holds the plan it finished under."""
    from potluck.runtime.training import train as run_train

    def launching(plan: Plan, launched: TrainOptions) -> None:
        if before_launch is not None:
            before_launch(plan, launched)
        if launched.out_dir is not None:
            _keep_cpu_measurement(plan, launched.out_dir)

    history = run_train(chosen, options, before_launch=launching, elastic=elastic)
    if options.elastic and options.out_dir is not None:
        from potluck.plans import load_plan
        from potluck.runtime.training import PLAN_FILE

        chosen = load_plan(Path(options.out_dir) / PLAN_FILE)
    return TrainResult(chosen, history)


def check_launch(chosen: Plan, options: TrainOptions) -> None:
    """What must hold before any rank starts or any torchrun command is printed: potluck's
    runtime runs the plan's execution traits, and one backend serves every rank."""
    from potluck.runtime.launch.checks import check_execution
    from potluck.runtime.launch.gpus import world_backend

    check_execution(chosen)
    world_backend(chosen, options.emulate)


def claim_run_dir(options: TrainOptions) -> None:
    """Before a run's ranks (or its torchrun commands) start: a run directory holding another
    run is refused unless ``options.resume`` or ``options.overwrite`` (which deletes that
    run's files now; :mod:`potluck.runtime.launch.run_dir`)."""
    from potluck.runtime.launch.run_dir import claim_run_dir as claim

    claim(options)


def needs_torchrun(chosen: Plan, options: TrainOptions) -> bool:
    """Whether ``chosen`` spans machines that torchrun must start, one command each (an
    emulated run starts all its ranks on this machine)."""
    from potluck.runtime.launch.torchrun import plan_nodes

    return len(plan_nodes(chosen)) > 1 and not options.emulate


def torchrun_commands(chosen: Plan, plan_path: str | Path, options: TrainOptions, *,
                      master_addr: str, master_port: int,
                      max_restarts: int | None = None) -> list[NodeCommand]:
    """One torchrun command per machine training ``chosen`` (read from ``plan_path`` there)
    with ``options``; with ``max_restarts``, an elastic run's
    (:func:`potluck.runtime.launch.torchrun.torchrun_commands`)."""
    from potluck.runtime.launch.torchrun import torchrun_commands as commands
    from potluck.runtime.worker import worker_args

    return commands(chosen, str(plan_path), master_addr, master_port, worker_args(options),
                    max_restarts)


def elastic_settings(max_restarts: int, replan_margin: float,
                     report: Report | None = None) -> ElasticSettings:
    """How an elastic run replans: after up to ``max_restarts`` failures, to a plan with
    joined devices at least ``replan_margin`` faster; ``report`` hears of each replan."""
    from potluck.runtime.elastic.supervisor import ElasticSettings

    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more, not {max_restarts}")
    if not 0.0 <= replan_margin < 1.0:
        raise ConfigError(f"--replan-margin is a fraction from 0 to below 1, such as 0.1, "
                          f"not {replan_margin}")
    return ElasticSettings(replan_margin, max_restarts, report)


def calibration_steps(options: TrainOptions) -> int:
    """The steps an emulated run times unpadded to set its dilation before it trains (none
    when ``options.dilation`` is given)."""
    from potluck.runtime.loop.dilation import CALIBRATION_STEPS

    return CALIBRATION_STEPS if options.dilation is None else 0


def export(run_dir: str | Path, out: str | Path) -> Exported:
    """Export the newest checkpoint of a run that verifies as a Hugging Face model
    (:func:`potluck.runtime.checkpoints.export.export_run`)."""
    from potluck.runtime.checkpoints.export import export_run

    return export_run(run_dir, out)


def join(run_dir: str | Path, devices: list[str]) -> list[str]:
    """Offer ``devices`` (ids of the run's cluster) to the elastic run in ``run_dir``; it
    plans with them while it trains and moves to them at a checkpoint if that is faster
    (:mod:`potluck.runtime.elastic.joins`)."""
    from potluck.runtime.elastic.joins import register

    return register(run_dir, _run_plan(run_dir), devices)


def leave(run_dir: str | Path, devices: list[str]) -> list[str]:
    """Take ``devices`` from the elastic run in ``run_dir``: it continues without them from
    its next checkpoint."""
    from potluck.runtime.elastic.joins import release

    return release(run_dir, _run_plan(run_dir), devices)


def _run_plan(run_dir: str | Path) -> Plan:
    from potluck.plans import load_plan
    from potluck.runtime.training import PLAN_FILE

    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory of potluck train (no {PLAN_FILE})")
    return load_plan(path)


def _keep_cpu_measurement(chosen: Plan, run_dir: str) -> None:
    from potluck.profiler.quick import CPU, keep_measurement, ranks_per_machine

    if any(group.gpu == CPU for group in chosen.cluster.nodes):
        keep_measurement(chosen.model, ranks_per_machine(chosen.cluster), run_dir)


def unpadded_step_s(chosen: Plan, options: TrainOptions) -> float:
    """About how long one step of ``chosen``'s computed model (the stand-in, if any) takes
    on this machine's CPU, as an emulation's unpadded steps run it: its training FLOPs over
    what all the ranks reach together in matmuls at its shapes (``profiler.quick``'s
    measurement, about a second). A lower bound: pipeline waits and host time come on top."""
    from potluck.model.counts import model_flops_per_token
    from potluck.profiler.quick import measure_cpu
    from potluck.runtime.models.stand_in import compute_plan

    computed = compute_plan(chosen, options)
    ranks = len(computed.devices)
    per_rank_flops = measure_cpu(computed.model, ranks).matmul_flops["fp32"]
    tokens = computed.training.global_batch * computed.training.seq_len
    flops = model_flops_per_token(computed.model, computed.training.seq_len) * tokens
    return flops / (per_rank_flops * ranks)


def train(cluster: str | Path | ClusterSpec | None = None,
          model: str | Path | ModelSpec | None = None, *, plan_file: str | Path | Plan | None = None,
          global_batch: int | None = None, seq_len: int | None = None,
          dtype: str | DType | None = None, partition: str | Partition = Partition.BALANCED,
          execution: str | Path | Execution | None = None, **options: object) -> TrainResult:
    """Plan (unless ``plan_file`` is given) and train on this machine's ranks.

    ``execution`` is as for :func:`plan`; potluck's runtime refuses traits it does not run
    (:func:`potluck.runtime.launch.checks.check_execution`).
    Further keyword arguments are :class:`potluck.runtime.options.TrainOptions` fields
    (``steps``, ``lr``, ``lr_schedule``, ``warmup_steps``, ``min_lr``, ``weight_decay``,
    ``max_grad_norm``, ``seed``, ``out``, ``data`` (default: the shipped corpus),
    ``tokenizer``, ``init_from`` (a Hugging Face model directory whose weights the run
    starts from; ``model`` defaults to it), ``emulate``, ``checkpoint_every``, ``resume``,
    ``stand_in``, ...).
    """
    out = options.get("out")
    model = model_to_train(model, plan_file, options.get("init_from"))
    chosen = resolve_plan(cluster, model, plan_file=plan_file, global_batch=global_batch,
                          seq_len=seq_len, dtype=dtype, partition=partition,
                          run_dir=out if isinstance(out, str | Path) else None,
                          execution=execution)
    return run_plan(chosen, train_options(**options))


def compare(target: str | Path, measured: str | Path | None = None, *,
            out_dir: str | Path | None = None) -> tuple[TraceComparison, list[Path]]:
    """Predicted against measured: ``target`` is a run directory of ``potluck train --trace``,
    a plan file or a predicted trace; ``measured`` a runtime trace (default: the run's).
    Returns the comparison and the traces written for Perfetto (predicted, side by side)."""
    from potluck.calibrate.compare_run import compare_paths

    return compare_paths(target, measured, out_dir)


def calibrate(run_dir: str | Path, *, cluster: str | Path | None = None,
              out: str | Path | None = None) -> CalibrationOutcome:
    """Fit the cost model's inputs to a traced run and write them into a cluster file
    (``cluster`` with its calibration replaced, or the run's cluster); the outcome holds
    the fit and the run's prediction error before and after."""
    from potluck.calibrate.calibrate_run import calibrate_run

    return calibrate_run(run_dir, cluster=cluster, out=out)


def calibrate_measured(runs: str | Path, *, model: str | Path | ModelSpec,
                       cluster: str | Path, out: str | Path | None = None,
                       progress: Callable[[float, str], None] | None = None) -> MeasuredOutcome:
    """Fit a few inputs of ``cluster`` (device efficiency, link bandwidths, framework
    overheads) to iteration times measured by any framework (``runs``: a CSV, one run per
    line) and write them into a cluster file (default ``<cluster>-calibrated.yaml``); which
    inputs is chosen by the error of runs left out of the fit, and a fit that does not
    predict them significantly better than ``cluster`` raises ``CalibrationRefused``
    (nothing written). The outcome holds the choice and each run's error before, after and
    left out of the fit. ``progress(fraction, what)`` hears of each set of inputs scored."""
    from potluck.calibrate.measured.calibrate import calibrate_measured as fit_measured

    return fit_measured(runs, as_model(model), cluster, out, progress)


def schedule(cluster: str | Path | ClusterSpec, jobs: str | Path | Sequence[Job], *,
             policy: str = "fair", restart_s: float = DEFAULT_RESTART_S,
             execution: str | Path | Execution | None = None,
             progress: Callable[[int, int, str], None] | None = None) -> ScheduleResult:
    """Share ``cluster`` among ``jobs`` (a jobs file, or :class:`potluck.multijob.Job`
    values) under ``policy`` (fifo, equal, throughput, fair or jct): each job planned by the
    planner on its allocations, the schedule simulated from arrival to completion. A
    jobs file with problems raises one :class:`potluck.multijob.JobsFileError` that lists
    them all (``problems``: one line each). ``progress(done, at_most, what)`` hears of each
    search of a job shape on an allocation."""
    from potluck.multijob import ThroughputTable, load_jobs, simulate

    spec = as_cluster(cluster)
    chosen = _schedule_policy(policy)
    restart = _restart_s(restart_s)
    table = ThroughputTable(spec)

    def prepare(found: Sequence[Job]) -> None:
        table.expect((job.shape for job in found), progress)

    hosts: dict[str, tuple[str, ...]] = {}
    notes: tuple[str, ...] = ()
    if isinstance(jobs, str | Path):
        read = load_jobs(jobs, spec, lambda job: table.refusal(job.shape),
                         as_execution(execution, spec), before_checks=prepare)
        jobs, hosts, notes = read.jobs, read.hosts, read.notes
    else:
        prepare(jobs)
    result = simulate(tuple(jobs), table, chosen, restart)
    return replace(result, hosts=hosts, notes=notes)


def schedule_run(cluster: str | Path | ClusterSpec, jobs: str | Path | Sequence[Job], *,
                 out: str | Path, policy: str = "fair", steps: int = 20,
                 checkpoint_every: int = 5, dilation: float = 1.0,
                 seconds_per_hour: float = 0.0, job_timeout_s: float = 3600.0,
                 replan_margin: float | None = None,
                 execution: str | Path | Execution | None = None,
                 progress: Progress | None = None) -> RunOutcome:
    """Carry out the schedule of ``jobs`` on ``cluster`` under ``policy``: every job a
    ``potluck train --elastic`` run in ``out/<job>`` (emulated on CPU ranks), re-allocated
    through ``join``/``leave`` at every arrival and completion; ``out/schedule.jsonl``
    holds the events (:mod:`potluck.multijob.executor`). ``progress(line)`` hears of each."""
    from potluck.multijob import ThroughputTable, load_jobs
    from potluck.multijob.executor import RunSettings, run_schedule

    spec = as_cluster(cluster)
    chosen = _schedule_policy(policy)
    settings = RunSettings(Path(out), steps, checkpoint_every, dilation, seconds_per_hour,
                           job_timeout_s, replan_margin)
    settings.check()
    table = ThroughputTable(spec)
    if isinstance(jobs, str | Path):
        read = load_jobs(jobs, spec, lambda job: table.refusal(job.shape),
                         as_execution(execution, spec))
        for note in read.notes if progress is not None else ():
            progress(f"note: {note}")
        jobs = read.jobs
    return run_schedule(tuple(jobs), table, chosen, settings, progress)


def schedule_trace(cluster: str | Path | ClusterSpec, num_jobs: int, *, seed: int = 0,
                   restart_s: float = DEFAULT_RESTART_S,
                   execution: str | Path | Execution | None = None,
                   mix: tuple[MixEntry, ...] | None = None,
                   progress: Callable[[int, int, str], None] | None = None) -> PolicyComparison:
    """Every scheduling policy on a synthetic trace of ``num_jobs`` jobs (Poisson arrivals,
    a size mix of presets, ``potluck.multijob.trace.MIX`` unless ``mix`` is given) on
    ``cluster``; ``progress(done, at_most, what)`` hears of each search of a job shape on
    an allocation."""
    from potluck.multijob import ThroughputTable, compare_policies, synthetic_trace
    from potluck.multijob.trace import MIX, check_trace_size, mix_shapes

    spec = as_cluster(cluster)
    chosen_mix, traits = mix or MIX, as_execution(execution, spec)
    restart = _restart_s(restart_s)
    check_trace_size(num_jobs)
    table = ThroughputTable(spec)
    table.expect(mix_shapes(chosen_mix, traits).values(), progress)
    jobs = synthetic_trace(table, num_jobs, seed, traits, chosen_mix)
    return compare_policies(jobs, table, seed, restart_s=restart)


def _schedule_policy(policy: str) -> Any:
    from potluck.multijob import Policy

    try:
        return Policy(policy)
    except ValueError:
        names = ", ".join(p.value for p in Policy)
        raise ConfigError(f"--policy must be one of {names}, not {policy!r}") from None


def _restart_s(restart_s: float) -> float:
    return non_negative_number(restart_s, "--restart-s")
