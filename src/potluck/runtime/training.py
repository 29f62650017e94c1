"""``potluck train`` as Python: run a plan on this machine, or as one rank of a job.

- :func:`train` starts one process per device of the plan on this machine
  (all of them when emulating a cluster on CPU; spawned for a GPU run, forked
  from a fork server otherwise) and returns rank 0's metrics.
- :func:`train_rank` is what each rank runs (also under torchrun, through
  ``python -m potluck.runtime.worker``): join the job, build the plan's model
  on the meta device, parallelize it (from ``--init-from``'s pretrained weights, of
  which each rank reads only its part, or potluck's initial values), optionally put
  it on emulated time, resume, and train. Once the model is built, its objects (and the libraries')
  are frozen out of Python's garbage collector (``gc.freeze``): a collection that
  walked them paused a rank for 0.3-0.5 s, measured on emulated CPU ranks of an
  explicit TP stage, long enough to stall every rank waiting on it. Rank 0 writes
  the run directory's ``plan.json`` (and ``tokenizer/``, the tokenizer the run reads
  its data with) only then, once the run has started, so a run that fails before (or
  a resume that does not fit) leaves the directory, and the plan it holds, as it was.

A plan that cannot run here (wrong world size, GPUs missing or hidden by
``CUDA_VISIBLE_DEVICES``, CPU ranks mixed with GPUs, several machines without
``--emulate``) fails with one ConfigError before any rank
starts (:mod:`potluck.runtime.launch.checks`).
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from potluck.plans import Plan, load_plan, save_plan
from potluck.runtime.checkpoints import training_run
from potluck.runtime.checkpoints.export import TOKENIZER_DIR
from potluck.runtime.checkpoints.pretrained import PretrainedWeights, checked_weights
from potluck.runtime.elastic.drills import check_elastic, rank_hook
from potluck.runtime.elastic.supervisor import ElasticSettings, train_elastic
from potluck.runtime.launch.checks import check_local, check_options
from potluck.runtime.launch.gpus import start_method
from potluck.runtime.launch.local import run_local
from potluck.runtime.launch.run_dir import PLAN_FILE, claim_run_dir
from potluck.runtime.launch.session import start
from potluck.runtime.launch.watchdog import JobNotes
from potluck.runtime.loop.batches import batch_source
from potluck.runtime.loop.dilation import calibrate_dilation
from potluck.runtime.loop.metrics import StepEstimate, calibration_reporter, run_callbacks
from potluck.runtime.loop.trainer import BatchSource, StepMetrics, Trainer
from potluck.runtime.models.build import attention_implementation, build_model
from potluck.runtime.models.stand_in import compute_plan, with_stand_in_if_too_big
from potluck.runtime.options import TrainOptions
from potluck.runtime.parallel_model import parallelize
from potluck.runtime.timing.emulate import EmulationClock, emulate, predict
from potluck.runtime.timing.recorder import OpRecorder, TraceWindow, attach_recorder


def train(plan: Plan | str | Path, options: TrainOptions | None = None, *,
          before_launch: Callable[[Plan, TrainOptions], None] | None = None,
          elastic: ElasticSettings | None = None, **kwargs: Any) -> list[StepMetrics]:
    """Train ``plan`` with one process per device on this machine; rank 0's metrics.
    ``before_launch(plan, options)`` runs once every check has passed, before any rank
    starts (the options as the ranks get them: the stand-in chosen). With
    ``options.elastic`` the run replans when devices leave or join (``elastic``: its
    margin, restarts and replan reports; :mod:`~potluck.runtime.elastic.supervisor`)."""
    options = options or TrainOptions(**kwargs)
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    options = with_stand_in_if_too_big(plan, options)
    check_local(plan, options)
    check_elastic(plan, options)
    claim_run_dir(options)  # another run there: refused, or deleted with options.overwrite
    if before_launch is not None:
        before_launch(plan, options)
    if options.elastic:
        return train_elastic(plan, options, _checked_launch, elastic or ElasticSettings())[1]
    return run_local(train_rank, plan.devices, (plan, options),
                     start_method=start_method(plan, options.emulate))[0]


def _checked_launch(plan: Plan, options: TrainOptions, watch: Callable[[JobNotes], None]
                    ) -> list[StepMetrics]:
    """An elastic run's attempt: the new plan checked as the first was, then its ranks."""
    check_local(plan, options)
    return run_local(train_rank, plan.devices, (plan, options),
                     start_method=start_method(plan, options.emulate), watch=watch)[0]


def train_rank(plan: Plan, options: TrainOptions,
               model_factory: Callable[[], nn.Module] | None = None,
               source: BatchSource | None = None) -> list[StepMetrics]:
    """Run this rank's part of ``plan`` (inside a launched process)."""
    check_options(options)
    computed = compute_plan(plan, options)
    attention = attention_implementation(plan.training.execution.flash_attention
                                         and computed.model.sdpa)
    session = start(computed, emulate=options.emulate, timeout_s=options.timeout_s)
    try:
        with session.guard():
            model = model_factory() if model_factory else build_model(computed.model, attention)
            weights = _pretrained(model, computed, options)
            parallel = parallelize(model, session, seed=options.seed,
                                   count_memory=options.count_memory or options.emulate,
                                   weights=weights)
            if weights is not None:
                weights.close()
            source = source or batch_source(computed, options)
            trainer = Trainer(parallel, schedule=options.schedule(),
                              weight_decay=options.weight_decay,
                              max_grad_norm=options.max_grad_norm,
                              predicted_step_time_s=predict(plan).iteration_time_s
                              if options.emulate else None, emulated=options.emulate)
            clock = emulate(parallel, options.dilation, timing=plan) if options.emulate else None
            gc.freeze()  # the model and libraries stay: collections need not walk them
            recorder = attach_recorder(parallel) if options.trace_steps > 0 else None
            if clock is not None and options.dilation is None:
                calibrate_dilation(trainer, clock, source,
                                   calibration_reporter(options, session.rank))
            if options.resume:
                training_run.resume(trainer, source, training_run.checkpoint_dir(options))
            _write_plan(plan, options, session.rank)
            _write_tokenizer(options, session.rank)
            trainer.callbacks = run_callbacks(options, session.rank, trainer.step_index,
                                              _estimate(trainer, clock))
            if recorder is not None:
                recorder.start(TraceWindow.after_warmup(trainer.step_index, options.steps,
                                                        options.trace_steps), trainer.step_index)
            history = trainer.fit(source, max(0, options.steps - trainer.step_index),
                                  on_step=_on_step(trainer, source, options, recorder))
            if recorder is not None:
                recorder.finish(options.out_dir)  # when the run ended inside the traced window
        return history
    finally:
        session.close()


def _pretrained(model: nn.Module, computed: Plan, options: TrainOptions
                ) -> PretrainedWeights | None:
    """``--init-from``'s weights, checked against the model this rank builds (None: the
    model starts from potluck's initial values)."""
    if options.init_from is None:
        return None
    return checked_weights(options.init_from, model, computed.model.name)


def _estimate(trainer: Trainer, clock: EmulationClock | None) -> StepEstimate | None:
    """An emulated step's expected wall time here: its predicted time times the dilation."""
    if clock is None or not clock.dilation or not trainer.predicted_step_time_s:
        return None
    return StepEstimate(trainer.predicted_step_time_s * clock.dilation, clock.dilation)


def _write_plan(plan: Plan, options: TrainOptions, rank: int) -> None:
    """Rank 0 writes the run's ``plan.json`` once the run has started (model built, any
    checkpoint loaded): a run that fails before leaves its directory as it was."""
    if rank != 0 or not options.out_dir:
        return
    save_plan(plan, Path(options.out_dir) / PLAN_FILE)  # atomic: a temporary file, a rename


def _write_tokenizer(options: TrainOptions, rank: int) -> None:
    """Rank 0 keeps the tokenizer the run reads its data with in the run directory (as
    Hugging Face files: ``potluck export`` writes them beside the weights); random-token
    runs have none."""
    if rank != 0 or not options.out_dir or options.data is None:
        return
    from potluck.data.tokenizer import load_tokenizer

    path = Path(options.out_dir) / TOKENIZER_DIR
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    load_tokenizer(options.tokenizer).save(partial)
    shutil.rmtree(path, ignore_errors=True)
    partial.replace(path)


def _on_step(trainer: Trainer, source: BatchSource, options: TrainOptions,
             recorder: OpRecorder | None) -> Callable[[StepMetrics], None] | None:
    """After each step: checkpoints, an elastic run's drills and replan stops
    (:mod:`~potluck.runtime.elastic.drills`), then the trace's bookkeeping."""
    hooks = [hook for hook in (training_run.checkpoint_hook(trainer, source, options),
                               rank_hook(trainer, options)) if hook is not None]
    if recorder is not None:
        hooks.append(lambda metrics: recorder.end_step(metrics.step, options.out_dir))
    if not hooks:
        return None

    def hook(metrics: StepMetrics) -> None:
        for each in hooks:
            each(metrics)

    return hook
