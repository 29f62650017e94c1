"""Checkpoints of a training run: save every N steps and the final state, resume.

:func:`checkpoint_hook` saves after every ``--checkpoint-every`` steps and, in
any run with an output directory, after the last one; :func:`save` and
:func:`resume` do the work. :func:`resume` continues from the newest
checkpoint whose files match their checksums (a damaged one is skipped with a
warning naming the bad file) and whose state a run can continue from: its optimizer
settings valid and finite, its tensors finite, its trainer state's step the step of its
name (:func:`trainer_state_problem`); one that is not is skipped with a warning too.

A checkpoint is *known good* once a step run from its state had finite
gradients and a finite loss (``Trainer.note_checkpoint``; a step's own loss says
nothing of the update it saves). The newest one is ``Trainer.good_checkpoint``.
Pruning waits until the run has one and never deletes it, so a run whose state
turned to inf or NaN keeps the checkpoints it started from, and a run that
stops because every step is skipped names it.

The bridge between the trainer and :mod:`potluck.runtime.checkpoints.storage`: the
model's state under its own parameter names (``ParallelModel.module``), the
optimizer's state flattened per parameter, the step and the data position.
Ranks of replica 0 write (every replica holds the whole model, possibly laid
out differently). With ZeRO-1 each replica keeps the optimizer states of its
own share of the parameters only, so every rank also writes the states it
keeps (each state under its parameter's name, by exactly one replica). Under
ZeRO-3 every replica holds its own shard of the FSDP2 parameters (DTensors over
the stage's data-parallel mesh), so every rank also writes those parameters'
shards; optimizer offload keeps its states in host memory but saves and loads
them under the same keys (:class:`~potluck.runtime.grads.offload.HostOffloadOptimizer`).
Under expert parallelism the replicas of the first expert group each hold their own
rows of the routed experts (``Shard(0)`` DTensors), so they write those rows and
their optimizer states too. Every rank loads exactly the keys and shards it holds,
so a run may resume under
another plan, with or without ZeRO (any stage) or offload. Under islands that synchronize
rarely each island writes its own weights and inner optimizer states, DiLoCo its outer
state, and each rank its own file (:mod:`~potluck.runtime.checkpoints.island_files`), so a
run resumes under the same plan exactly and under another split from a consensus state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from potluck.errors import ConfigError
from potluck.model.spec import model_to_dict
from potluck.plans.islands import ONE_ISLAND, Islands
from potluck.runtime.checkpoints.island_files import (
    ISLANDS_KEY,
    checkpoint_steps_note,
    first_of_island,
    island_resume,
    save_island_state,
    saves_at,
    shared_state,
    split_info,
)
from potluck.runtime.checkpoints.rng import load_rng_state
from potluck.runtime.checkpoints.storage import (
    TRAINER_STATE,
    UnusableCheckpoint,
    apply_training_state,
    checkpoint_step,
    load_checkpoint,
    newest_verified,
    prune_checkpoints,
    resume_checkpoint,
    save_checkpoint,
    training_state,
)
from potluck.runtime.loop.schedule import restore_schedule, schedule_state
from potluck.runtime.loop.trainer import StepMetrics, Trainer
from potluck.runtime.options import TrainOptions
from potluck.units import is_positive_real

log = logging.getLogger(__name__)

OPTIMIZER_SETTINGS = "optimizer"  # trainer_state.json's key of optimizer_settings()


def checkpoint_dir(options: TrainOptions) -> str:
    """Where a run's checkpoints go: its output directory, which it must have."""
    if not options.out_dir:
        raise ConfigError("checkpoints need an output directory: give --out DIR")
    return options.out_dir


def checkpoint_hook(trainer: Trainer, source: Any, options: TrainOptions
                    ) -> Callable[[StepMetrics], None] | None:
    """Save every ``checkpoint_every`` steps (0: none in between) and after the last one;
    None without an output directory (``checkpoint_every`` then needs one)."""
    if not options.out_dir and options.checkpoint_every <= 0:
        return None
    out_dir = checkpoint_dir(options)
    islands = trainer.model.layout.plan.islands
    note = checkpoint_steps_note(options.checkpoint_every, islands)
    if note and trainer.model.layout.rank == 0:
        log.info(note)

    def hook(metrics: StepMetrics) -> None:
        if saves_after(metrics.step + 1, options, islands):
            save(trainer, source, out_dir, options.keep_checkpoints)

    return hook


def saves_after(done: int, options: TrainOptions, islands: Islands = ONE_ISLAND) -> bool:
    """Whether a run with an output directory saves a checkpoint once ``done`` steps are
    done: every ``checkpoint_every`` steps (under islands moved up to the next consensus
    step, :func:`~potluck.runtime.checkpoints.island_files.saves_at`), and after the last
    one."""
    return saves_at(done, options.checkpoint_every, islands) or done == options.steps


def save(trainer: Trainer, source: Any, out_dir: str, keep_last: int = 0) -> Path:
    """Checkpoint the state after the trainer's last step (collective: every rank calls);
    once the run has a known-good checkpoint, prune to it and the newest ``keep_last``.
    What the priority schedule left in flight is finished first (the updated parameters
    every replica saves, the last step's metrics)."""
    trainer.flush()
    model = trainer.model
    next_step = trainer.step_index
    pipeline = model.layout.role.pipeline
    writes = pipeline == first_of_island(model.layout.plan, pipeline)
    experts = model.expert_names if pipeline < model.layout.plan.ep else frozenset()
    state = (training_state([model.module], [trainer.optimizer])
             if writes or model.zero or experts else {})
    if not writes and state:
        state = _shares_of_replica(state, model.fsdp_names | experts, experts,
                                   whole_optimizer=model.zero is None)
    state = shared_state(trainer, state, writes)
    trainer_state: dict[str, Any] = {"step": next_step, "layout": model.layout.plan.layout(),
                                     "model": model_to_dict(model.layout.plan.model)}
    if (islands := split_info(trainer)) is not None:
        trainer_state[ISLANDS_KEY] = islands
    if hasattr(source, "state_dict"):
        trainer_state["data"] = source.state_dict(next_step)
    if trainer.loss_scale is not None:
        trainer_state["loss_scale"] = trainer.loss_scale.state_dict()
    trainer_state[OPTIMIZER_SETTINGS] = optimizer_settings(trainer)
    path = save_checkpoint(out_dir, next_step, state, trainer_state,
                           rank_files=lambda partial: save_island_state(trainer, partial))
    trainer.note_checkpoint(path)
    if model.layout.rank == 0 and trainer.good_checkpoint is not None:
        prune_checkpoints(out_dir, keep_last, keep=trainer.good_checkpoint)
    return path


def _shares_of_replica(state: dict[str, Any], sharded: frozenset[str], experts: frozenset[str],
                       *, whole_optimizer: bool) -> dict[str, Any]:
    """What a replica other than the first writes: its shards of the parameters it holds a
    shard of (``sharded``: FSDP2's, its expert rows), and the optimizer states it alone
    keeps (under ZeRO its own share; else its experts' rows)."""
    model = {k: v for k, v in state["model"].items() if k in sharded}
    optim = _states_only(state["optim"])
    if whole_optimizer:
        prefixes = tuple(f"state.{name}." for name in experts)
        optim = {k: v for k, v in optim.items() if k.startswith(prefixes)}
    return {**({"optim": optim} if optim else {}), **({"model": model} if model else {})}


def _states_only(optim: dict[str, Any]) -> dict[str, Any]:
    """The per-parameter states of a flattened optimizer state dict (under ZeRO-1 this
    rank's own share), without the param-group settings replica 0 writes."""
    return {key: value for key, value in optim.items() if key.startswith("state.")}


def resume(trainer: Trainer, source: Any, out_dir: str) -> int:
    """Load the newest checkpoint under ``out_dir`` that verifies and holds a state a run
    can continue from (each newer one that does not is named in a warning); returns the
    step to continue from (collective: every rank calls). Parameter all-gathers still in
    flight are finished first, so none writes over the loaded values."""
    trainer.flush()
    path, saved = _load_newest_usable(trainer, out_dir)
    if "data" in saved and hasattr(source, "load_state_dict"):
        source.load_state_dict(saved["data"])
    load_rng_state(path)
    if "loss_scale" in saved and trainer.loss_scale is not None:
        trainer.loss_scale.load_state_dict(saved["loss_scale"])
    trainer.step_index = saved["step"]  # checked by trainer_state_problem
    if OPTIMIZER_SETTINGS in saved:
        restore_optimizer_settings(trainer, saved[OPTIMIZER_SETTINGS], path)
    trainer.note_checkpoint(path, resumed=True)
    return trainer.step_index


def optimizer_settings(trainer: Trainer) -> dict[str, Any]:
    """The trainer's settings that are not the optimizer's own values (those, ``lr``,
    ``weight_decay``, ``betas``..., are in ``values.json``): the gradient clipping norm and
    the learning-rate schedule with the scheduler's place in it."""
    return {"max_grad_norm": trainer.max_grad_norm,
            "schedule": schedule_state(trainer.schedule, trainer.scheduler)}


def restore_optimizer_settings(trainer: Trainer, saved: Any, path: Path) -> None:
    """Continue with the checkpoint's clipping norm and learning-rate schedule (a run
    resumed with other flags says so once, on rank 0). Checked first: a ConfigError for a
    damaged one."""
    where = f"checkpoint {path}"
    if not (isinstance(saved, dict) and "schedule" in saved and "max_grad_norm" in saved):
        raise ConfigError(f"{where}: its optimizer settings are damaged")
    norm = saved["max_grad_norm"]
    if norm is not None and not is_positive_real(norm):
        raise ConfigError(f"{where}: its max_grad_norm {norm!r} is not a positive number")
    schedule, scheduler = restore_schedule(trainer.optimizer, saved["schedule"],
                                           trainer.step_index, where, trainer.lr_scale)
    flags = (trainer.schedule.describe(), trainer.max_grad_norm)
    if trainer.model.layout.rank == 0 and (schedule.describe(), norm) != flags:
        log.warning("resuming with the checkpoint's learning-rate schedule (%s) and gradient "
                    "clipping (%s), not this run's flags", schedule.describe(),
                    "off" if norm is None else f"max norm {norm:g}")
    trainer.schedule, trainer.scheduler, trainer.max_grad_norm = schedule, scheduler, norm


def _load_newest_usable(trainer: Trainer, out_dir: str) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint that verifies and loads without an :class:`UnusableCheckpoint`,
    loaded, and its trainer state; one line when none does."""
    path, first_refusal = resume_checkpoint(out_dir), None
    while True:
        try:
            return path, _load(trainer, path)
        except UnusableCheckpoint as err:
            first_refusal = first_refusal or err
            older = newest_verified(out_dir, before=checkpoint_step(path))
            if older is None:
                oldest = "" if err is first_refusal else f" ({err})"
                raise UnusableCheckpoint(f"{first_refusal}; no older checkpoint can be resumed "
                                         f"either{oldest}: train again without --resume") from None
            if trainer.model.layout.rank == 0:
                log.warning("%s; trying %s, the newest older one that verifies", err, older)
            path = older


def _load(trainer: Trainer, path: Path) -> dict[str, Any]:
    """Checkpoint ``path`` into the trainer's model and optimizer; its trainer state.
    A state no run can continue from is an :class:`UnusableCheckpoint` (on every rank)."""
    model = trainer.model
    state = training_state([model.module], [trainer.optimizer])
    islands = island_resume(trainer, path)
    saved = load_checkpoint(path, islands.request(trainer, state), verify=False)  # verified
    if problem := trainer_state_problem(saved, checkpoint_step(path)):
        raise UnusableCheckpoint(f"checkpoint {path} cannot be resumed: its {TRAINER_STATE} "
                                 f"{problem}")
    apply_training_state([model.module], [trainer.optimizer], state)
    islands.finish(trainer)
    return saved


def trainer_state_problem(saved: Mapping[str, Any], step: int) -> str | None:
    """Why a checkpoint's trainer state, saved as checkpoint ``step``, cannot be resumed
    (None: it can). Add a check here with each key :func:`save` writes."""
    saved_step = saved.get("step")
    if not isinstance(saved_step, int) or isinstance(saved_step, bool):
        return f"has no step number (step: {saved_step!r})"
    if saved_step != step:
        return f"says step {saved_step}, but the checkpoint is of step {step}"
    return None
