"""``potluck train`` as Python: run a plan on this machine, or as one rank of a job.

- :func:`train` starts one process per device of the plan on this machine
  (all of them when emulating a cluster on CPU) and returns rank 0's metrics.
- :func:`train_rank` is what each rank runs (also under torchrun, through
  ``python -m potluck.runtime.worker``): join the job, build the plan's model
  on the meta device, parallelize it, optionally put it on emulated time,
  and train.

A plan that cannot run here (wrong world size, GPUs missing, several
machines without ``--emulate``) fails with one ConfigError before any rank
starts.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from potluck.errors import ConfigError
from potluck.model.spec import MlpKind, ModelSpec, load_model
from potluck.plans import Plan, check_plan, load_plan
from potluck.runtime.checkpoints import training_run
from potluck.runtime.launch.local import run_local
from potluck.runtime.launch.session import Session, start, wants_gpu
from potluck.runtime.launch.torchrun import plan_nodes
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.metrics import MetricsLog, ProgressBar, TensorBoardLog
from potluck.runtime.loop.trainer import BatchSource, Callback, StepMetrics, Trainer
from potluck.runtime.models.build import build_model
from potluck.runtime.parallel.parallelize import parallelize
from potluck.runtime.timing.emulate import EmulationClock, emulate, predict
from potluck.runtime.timing.recorder import OpRecorder, TraceWindow, attach_recorder

log = logging.getLogger(__name__)
CALIBRATION_STEPS = 2
TINY = "tiny"
TINY_SEQ_LEN = 128


@dataclass(frozen=True)
class TrainOptions:
    """How to train a plan; every field has a flag in ``potluck train``."""

    steps: int = 20  # total steps of the run (a resumed run continues up to it)
    lr: float = 3e-4
    seed: int = 0
    max_grad_norm: float | None = 1.0
    out_dir: str | None = None  # metrics.jsonl (and tensorboard/) go here
    data: str | None = None  # a .txt/.jsonl file or directory; None: random tokens
    tokenizer: str | None = None  # a local HF tokenizer directory; None: bytes
    emulate: bool = False  # run the plan's devices as CPU ranks, timed like them
    dilation: float | None = None  # emulation time stretch; None: calibrate
    stand_in: str | None = None  # compute with this model (same layer count), or "tiny"
    seq_len: int | None = None  # compute with this sequence length (default: the plan's)
    timeout_s: float = 600.0  # how long a rank waits for the others
    tensorboard: bool = False
    progress: bool = True
    checkpoint_every: int = 0  # save to out_dir/checkpoints every N steps and at the end
    keep_checkpoints: int = 2  # newest checkpoints kept (0: all)
    resume: bool = False  # continue from the newest checkpoint in out_dir
    trace_steps: int = 0  # record this many steps' ops into out_dir/trace.json (0: off)

def batch_source(plan: Plan, options: TrainOptions) -> BatchSource:
    """The run's data: the corpus at ``options.data`` or random tokens."""
    shape = plan.training
    if options.data is None:
        return RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch, options.seed)
    try:
        from potluck.data.dataset import build_dataset
        from potluck.data.tokenizer import load_tokenizer
    except ImportError as err:
        raise ConfigError(f"--data needs potluck.data, which is missing ({err})") from None
    tokenizer = load_tokenizer(options.tokenizer)
    return build_dataset(options.data, tokenizer, shape.seq_len, shape.global_batch, options.seed)


def _callbacks(options: TrainOptions, session: Session, done_steps: int) -> list[Callback]:
    if session.rank != 0:
        return []
    callbacks: list[Callback] = []
    if options.out_dir:
        callbacks.append(MetricsLog(options.out_dir))
        if options.tensorboard:
            callbacks.append(TensorBoardLog(options.out_dir))
    if options.progress:
        callbacks.append(ProgressBar(options.steps, done_steps))
    return callbacks


def _calibrate(trainer: Trainer, clock: EmulationClock, source: BatchSource) -> None:
    """Measure a few real steps, then fix the dilation. The steps are undone (weights,
    optimizer and loss-scale state, step count): the run then trains exactly its steps,
    with the numbers of a run without emulation."""
    saved = _TrainerSnapshot.take(trainer)
    start_row, count = trainer.model.layout.batch_rows
    for _ in range(CALIBRATION_STEPS):
        trainer.step(source.replica_rows(trainer.step_index, start_row, count))
    clock.calibrate()
    saved.restore(trainer)
    _warn_if_slow(trainer, clock)


SLOW_EMULATED_STEP_S = 30.0


def _warn_if_slow(trainer: Trainer, clock: EmulationClock) -> None:
    """Say so when the emulated steps will be long (the real model computes on CPU)."""
    predicted_s = trainer.predicted_step_time_s
    if trainer.model.layout.rank != 0 or not predicted_s:
        return
    step_s = predicted_s * clock.dilation
    if step_s > SLOW_EMULATED_STEP_S:
        log.warning("emulated steps will take about %.0f s each (every op %.0fx its GPU time "
                    "so the CPU ranks keep pace); --stand-in tiny computes a tiny model with "
                    "the same blocks and layout, and runs far faster", step_s, clock.dilation)


@dataclass
class _TrainerSnapshot:
    """A trainer's state, to undo steps taken only to measure them."""

    parameters: list[torch.Tensor]
    optimizer: dict[str, Any]
    loss_scale: dict[str, Any] | None
    step_index: int

    @classmethod
    def take(cls, trainer: Trainer) -> _TrainerSnapshot:
        with torch.no_grad():
            parameters = [p.detach().clone() for p in trainer.model.parameters()]
        scale = copy.deepcopy(trainer.loss_scale.state_dict()) if trainer.loss_scale else None
        return cls(parameters, copy.deepcopy(trainer.optimizer.state_dict()), scale,
                   trainer.step_index)

    def restore(self, trainer: Trainer) -> None:
        with torch.no_grad():
            for param, saved in zip(trainer.model.parameters(), self.parameters, strict=True):
                param.copy_(saved)
        trainer.optimizer.load_state_dict(self.optimizer)
        if self.loss_scale is not None and trainer.loss_scale is not None:
            trainer.loss_scale.load_state_dict(self.loss_scale)
        trainer.step_index = self.step_index


def compute_plan(plan: Plan, options: TrainOptions) -> Plan:
    """The plan's layout with the model and sequence length that are actually computed.

    A stand-in lets a laptop dry-run (``--emulate``) a plan for a model it could
    never hold: the layout and the timing are the plan's, the numbers computed
    are the stand-in's.
    """
    if options.stand_in is None and options.seq_len is None:
        return plan
    if options.stand_in == TINY:
        model = tiny_stand_in(plan)
    else:
        model = load_model(options.stand_in) if options.stand_in else plan.model
    if model.num_layers != plan.model.num_layers:
        raise ConfigError(
            f"stand-in {model.name} has {model.num_layers} blocks; the plan's {plan.model.name} "
            f"has {plan.model.num_layers}; a stand-in must have the same number of blocks"
        )
    seq_len = options.seq_len or min(plan.training.seq_len, model.max_seq_len)
    return replace(plan, model=model, training=replace(plan.training, seq_len=seq_len))


def tiny_stand_in(plan: Plan) -> ModelSpec:
    """The plan's model shrunk to hidden size 64 and a byte vocabulary, same blocks and
    family, heads divisible by every TP degree of the plan."""
    max_tp = max(stage.tp for pipeline in plan.pipelines for stage in pipeline.stages)
    heads = max(4, max_tp)
    model = plan.model
    return replace(model, name=f"{model.name}-tiny", hidden_size=64, num_heads=heads,
                   num_kv_heads=heads, ffn_hidden_size=172 if model.mlp is MlpKind.SWIGLU
                   else 256, vocab_size=260, max_seq_len=TINY_SEQ_LEN, dropout=False,
                   hf_config=None)


def train_rank(plan: Plan, options: TrainOptions,
               model_factory: Callable[[], nn.Module] | None = None,
               source: BatchSource | None = None) -> list[StepMetrics]:
    """Run this rank's part of ``plan`` (inside a launched process)."""
    check_trace(options)
    computed = compute_plan(plan, options)
    session = start(computed, emulate=options.emulate, timeout_s=options.timeout_s)
    try:
        with session.guard():
            model = model_factory() if model_factory else build_model(computed.model)
            parallel = parallelize(model, session, seed=options.seed)
            source = source or batch_source(computed, options)
            trainer = Trainer(parallel, lr=options.lr, max_grad_norm=options.max_grad_norm,
                              predicted_step_time_s=predict(plan).iteration_time_s
                              if options.emulate else None)
            clock = emulate(parallel, options.dilation, timing=plan) if options.emulate else None
            recorder = attach_recorder(parallel) if options.trace_steps > 0 else None
            if clock is not None and options.dilation is None:
                _calibrate(trainer, clock, source)
            if options.resume:
                training_run.resume(trainer, source, _out_dir(options))
            trainer.callbacks = _callbacks(options, session, trainer.step_index)
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


def _out_dir(options: TrainOptions) -> str:
    if not options.out_dir:
        raise ConfigError("checkpoints need an output directory: give --out DIR")
    return options.out_dir


def _on_step(trainer: Trainer, source: BatchSource, options: TrainOptions,
             recorder: OpRecorder | None) -> Callable[[StepMetrics], None] | None:
    """After each step: checkpoints, then the trace's bookkeeping."""
    checkpoint = _checkpoint_hook(trainer, source, options)
    if recorder is None:
        return checkpoint

    def hook(metrics: StepMetrics) -> None:
        if checkpoint is not None:
            checkpoint(metrics)
        recorder.end_step(metrics.step, options.out_dir)

    return hook


def _checkpoint_hook(trainer: Trainer, source: BatchSource, options: TrainOptions
                     ) -> Callable[[StepMetrics], None] | None:
    """Save every ``checkpoint_every`` steps and after the last one."""
    every = options.checkpoint_every
    if every <= 0:
        return None
    out_dir = _out_dir(options)

    def hook(metrics: StepMetrics) -> None:
        done = metrics.step + 1
        if done % every == 0 or done == options.steps:
            training_run.save(trainer, source, out_dir, options.keep_checkpoints)

    return hook


def check_local(plan: Plan, options: TrainOptions) -> None:
    """One clear error when ``plan`` cannot run on this machine."""
    check_plan(plan)
    check_plan(compute_plan(plan, options))
    nodes = plan_nodes(plan)
    check_counts(options)
    check_trace(options)
    if len(nodes) > 1 and not options.emulate:
        raise ConfigError(
            f"the plan spans {len(nodes)} machines; start it with the torchrun command for each "
            "machine (potluck train --print-commands), or dry-run it here with --emulate"
        )
    wants_gpu(plan, plan.devices[0], options.emulate)
    check_data(plan, options)


def check_counts(options: TrainOptions) -> None:
    """--steps is at least 1, --checkpoint-every not negative."""
    if options.steps < 1:
        raise ConfigError(f"--steps must be at least 1, not {options.steps}")
    if options.checkpoint_every < 0:
        raise ConfigError(
            f"--checkpoint-every must be 0 (never) or a number of steps, not {options.checkpoint_every}"
        )


def check_trace(options: TrainOptions) -> None:
    if options.trace_steps > 0 and not options.out_dir:
        raise ConfigError("--trace writes DIR/trace.json: give --out DIR")


def check_data(plan: Plan, options: TrainOptions) -> None:
    """The data path exists and the tokenizer fits the model (compute model included)."""
    if options.data is None:
        return
    from potluck.data.corpus import data_files
    from potluck.data.tokenizer import check_tokenizer_fits, load_tokenizer

    data_files(options.data)
    tokenizer = load_tokenizer(options.tokenizer)
    check_tokenizer_fits(tokenizer, compute_plan(plan, options).model)


def _fits_in_memory(plan: Plan) -> bool:
    """Whether every replica's weights, gradients and Adam states fit in half this
    machine's memory (16 bytes per parameter)."""
    from potluck.model.counts import total_params

    needed_bytes = 16.0 * total_params(plan.model) * plan.dp
    available_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return needed_bytes < 0.5 * available_bytes


def train(plan: Plan | str | Path, options: TrainOptions | None = None, **kwargs: Any
          ) -> list[StepMetrics]:
    """Train ``plan`` with one process per device on this machine; rank 0's metrics."""
    options = options or TrainOptions(**kwargs)
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    if options.emulate and options.stand_in is None and not _fits_in_memory(plan):
        log.warning("%s does not fit in this machine's memory; emulating with the tiny "
                    "stand-in (same layout and timing; --stand-in to choose)", plan.model.name)
        options = replace(options, stand_in=TINY)
    check_local(plan, options)
    return run_local(train_rank, plan.devices, (plan, options))[0]


def summarize(history: list[StepMetrics]) -> str:
    """One line about a finished run: loss, throughput, measured against predicted step time."""
    if not history:
        return "no steps run"
    timed = history[len(history) // 2:] or history  # skip warm-up
    step_s = sum(m.step_time_s for m in timed) / len(timed)
    tokens_per_s = sum(m.tokens_per_s for m in timed) / len(timed)
    line = (f"{len(history)} steps: loss {history[0].loss:.4f} -> {history[-1].loss:.4f}, "
            f"{tokens_per_s:,.0f} tokens/s, step {step_s:.3g} s")
    predicted = [m.predicted_step_time_s for m in timed if m.predicted_step_time_s]
    if predicted:
        mean_predicted = sum(predicted) / len(predicted)
        line += f" (predicted {mean_predicted:.3g} s, measured/predicted {step_s / mean_predicted:.2f})"
    return line
