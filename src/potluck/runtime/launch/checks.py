"""Before any rank starts: one clear error when a plan cannot run here as asked.

:func:`check_local` runs in the launching process of ``potluck train``: the
plan (and the plan actually computed, with a stand-in) is valid, the counts,
learning rate and flags make sense (:func:`check_options`, which ``potluck train``
also runs before it plans), the ranks' backends join them (ranks of several vendors, CPUs
among GPUs, only where vendors meet through host memory unless emulated: host-staged
islands, or pipelines whose stages span vendors:
:func:`~potluck.runtime.launch.gpus.world_backend`, which each rank also checks, and
``potluck train --print-commands``), a plan that spans several
machines is only emulated here, the GPUs it needs exist and ``CUDA_VISIBLE_DEVICES``
shows them, the data holds at least one sequence and the
tokenizer fits the model, a resumed run's newest checkpoint was saved by the model
the plan computes, ``--init-from``'s weights fit that model, this machine's memory holds
the ranks (:func:`~potluck.runtime.launch.host_memory.check_host_memory`), and the plan's
execution traits are ones potluck's runtime runs
(:func:`check_execution`), as is what its explicit TP executor runs
(:func:`check_explicit_tp`). Each failure is one :class:`~potluck.errors.ConfigError`
that says how to fix it, raised before anything is written.
"""

from __future__ import annotations

import math
from dataclasses import fields
from enum import Enum
from pathlib import Path

from potluck.cluster.execution import (
    COMM_TRAITS,
    DEFAULT_PRESET,
    PRESETS,
    describe,
    differences,
    traits_text,
)
from potluck.errors import ConfigError
from potluck.model.spec import ModelSpec
from potluck.plans import Plan, check_plan, explicit_tp, explicit_tp_plan_problem
from potluck.plans.feasibility import EXPLICIT_TP_OFF
from potluck.runtime.launch.gpus import world_backend
from potluck.runtime.launch.host_memory import check_host_memory
from potluck.runtime.launch.run_dir import check_resume_or_overwrite
from potluck.runtime.launch.torchrun import plan_nodes
from potluck.runtime.loop.schedule import check_schedule
from potluck.runtime.models.stand_in import compute_plan
from potluck.runtime.options import TrainOptions
from potluck.units import positive_number, whole_number


def check_local(plan: Plan, options: TrainOptions) -> None:
    """One clear error when ``plan`` cannot run on this machine."""
    check_plan(plan)
    check_plan(compute_plan(plan, options))
    check_execution(plan)
    check_explicit_tp(compute_plan(plan, options))
    nodes = plan_nodes(plan)
    check_options(options)
    backend = world_backend(plan, options.emulate)
    if len(nodes) > 1 and not options.emulate:
        raise ConfigError(
            f"nothing was trained: the plan spans {len(nodes)} machines; print one torchrun "
            "command per machine with --print-commands and run each on its machine, or "
            "dry-run the plan here with --emulate"
        )
    if backend == "nccl":
        check_gpus(plan)
    check_host_memory(compute_plan(plan, options), host_states=backend == "gloo")
    check_data(plan, options)
    check_resume(plan, options)
    check_init_from(plan, options)


def check_gpus(plan: Plan) -> None:
    """This machine has the plan's GPUs and ``CUDA_VISIBLE_DEVICES`` shows each of them."""
    from potluck.runtime.launch.session import gpu_ordinal  # torch: only once a run is launched

    for device_id in plan.devices:
        gpu_ordinal(plan, device_id)


def check_options(options: TrainOptions) -> None:
    """What the options alone can tell: counts, learning rate, the run directory, and that
    ``--init-from`` is a directory holding safetensors weights."""
    check_counts(options)
    check_trace(options)
    check_out_dir(options)
    check_drill(options)
    if options.init_from is not None:
        from potluck.runtime.checkpoints.weight_files import weight_files

        weight_files(options.init_from)


# Choices the runtime follows whatever their value: the gradient all-reduce overlaps the
# backward pass or not (runtime/grads/data_parallel.py), crosses the wire in 16 or 32 bits
# (parallelize._wire_dtype), attention runs SDPA or eager (models/build.py), and any
# placement's layout runs as the plan lays it out (runtime/layout.py); weights are FP32 under
# autocast or 16-bit with FP32 masters (runtime/grads/master_weights.py, fp32_params: false).
# The communication traits only constrain the planner (auto, or forced on or off); the runtime
# runs whatever the plan decided (Plan.comm, Stage.comm: split channels in
# runtime/parallel/pipeline.py, sparse embedding gradients in runtime/grads/sparse_embedding.py,
# the priority schedule in runtime/grads/gather.py and runtime/loop/trainer.py, TP overlap and
# recomputation keeping communication in runtime/parallel/tp_overlap.py). ``compile`` (auto,
# true or false) is each rank's torch.compile of its blocks and loss, or eager where it does
# not compose (runtime/parallel/compile.py).
RUNTIME_FOLLOWS = ("overlap_grad_reduce", "grad_reduce_bytes", "flash_attention", "placement",
                   "fp32_params", "compile", *COMM_TRAITS)


def check_execution(plan: Plan) -> None:
    """The plan's execution traits are ones potluck's runtime runs: every choice (a true/false
    or named trait) outside :data:`RUNTIME_FOLLOWS` as in the ``potluck`` preset (no fused
    kernels, overlapped pipeline sends; weights FP32 or 16-bit with FP32 masters, as
    ``fp32_params`` says). Figures (host seconds, bytes of traffic) only describe how
    long a step takes, so any value runs."""
    execution = plan.training.execution
    refused = [name for name in differences(PRESETS[DEFAULT_PRESET], execution)
               if name not in RUNTIME_FOLLOWS and not _is_figure(getattr(execution, name))]
    if refused:
        raise ConfigError(
            f"the plan's execution ({describe(execution)}) asks for "
            f"{traits_text(execution, refused)}, which potluck's "
            f"runtime does not run; make the plan with --execution {DEFAULT_PRESET}")


def check_explicit_tp(plan: Plan) -> None:
    """What the runtime's explicit TP executor (runtime/parallel/tp_overlap.py) does not run,
    for the plan actually computed (a stand-in has no dropout): the plans' rule
    (:func:`potluck.plans.explicit_tp_plan_problem`), which the plan checks and the search
    share."""
    if not any(explicit_tp(plan, k, j) for k, pipeline in enumerate(plan.pipelines)
               for j in range(len(pipeline.stages))):
        return
    problem = explicit_tp_plan_problem(plan)
    if problem:
        raise ConfigError(f"{problem} ({EXPLICIT_TP_OFF})")


def _is_figure(value: object) -> bool:
    return isinstance(value, float)


def check_counts(options: TrainOptions) -> None:
    """--steps from 1 to :data:`~potluck.units.MAX_COUNT`, --checkpoint-every not negative,
    --timeout and --dilation positive and finite, the learning rate and its schedule
    (:meth:`~potluck.runtime.loop.schedule.Schedule.problem`) and the optimizer's settings
    sensible."""
    whole_number(options.steps, "--steps")
    if options.checkpoint_every < 0:
        raise ConfigError(
            f"--checkpoint-every must be 0 (only the final state) or a number of steps, "
            f"not {options.checkpoint_every}"
        )
    positive_number(options.timeout_s, "--timeout")
    if options.dilation is not None:
        positive_number(options.dilation, "--dilation")
    check_schedule(options.schedule())
    check_optimizer_settings(options)


def check_drill(options: TrainOptions) -> None:
    """--inject-failure is a drill of an elastic run (:mod:`potluck.runtime.elastic.drills`)."""
    if options.inject_failure and not options.elastic:
        raise ConfigError("--inject-failure is a drill of an elastic run (a rank killed for it "
                          "to recover from); add --elastic")


def check_optimizer_settings(options: TrainOptions) -> None:
    """--weight-decay is 0 or more, --max-grad-norm positive (or None: no clipping)."""
    if not (math.isfinite(options.weight_decay) and options.weight_decay >= 0):
        raise ConfigError(f"--weight-decay must be 0 or a positive number such as 0.1, "
                          f"not {options.weight_decay}")
    norm = options.max_grad_norm
    if norm is not None and not (math.isfinite(norm) and norm > 0):
        raise ConfigError(f"--max-grad-norm must be a positive number such as 1.0 "
                          f"(0: no clipping), not {norm}")


def check_trace(options: TrainOptions) -> None:
    """--trace has somewhere to write its trace."""
    if options.trace_steps > 0 and not options.out_dir:
        raise ConfigError("--trace writes DIR/trace.json: give --out DIR")


def check_out_dir(options: TrainOptions) -> None:
    """--out is a directory or does not exist yet; --resume and --overwrite not both."""
    check_resume_or_overwrite(options)
    if options.out_dir is not None and Path(options.out_dir).exists() \
            and not Path(options.out_dir).is_dir():
        raise ConfigError(f"--out {options.out_dir} is a file, not a run directory; "
                          "give a directory (it is created if missing)")


def check_data(plan: Plan, options: TrainOptions) -> None:
    """The data path holds at least one sequence of the computed plan's length, and the
    tokenizer fits the model (compute model included)."""
    if options.data is None:
        return
    from potluck.data.dataset import check_one_sequence
    from potluck.data.tokenizer import check_tokenizer_fits, load_tokenizer

    computed = compute_plan(plan, options)
    tokenizer = load_tokenizer(options.tokenizer)
    check_tokenizer_fits(tokenizer, computed.model)
    check_one_sequence(options.data, tokenizer, computed.training.seq_len)


def check_init_from(plan: Plan, options: TrainOptions) -> None:
    """--init-from's weights fit the model the plan trains (their headers only are read)."""
    if options.init_from is None:
        return
    if options.stand_in is not None:
        raise ConfigError("--init-from loads the model's own weights, which a stand-in (--stand-in, "
                          "or --emulate's for a model too big for this machine) cannot use; "
                          "train without --stand-in, or without --init-from")
    from potluck.runtime.checkpoints.pretrained import checked_weights
    from potluck.runtime.models.build import build_model

    checked_weights(options.init_from, build_model(plan.model), plan.model.name)


# Model fields a checkpoint need not share with the model it resumes: its name, whether
# it trains with dropout, the Hugging Face config it came from.
_RESUME_IGNORES = ("name", "dropout", "hf_config")


def check_resume(plan: Plan, options: TrainOptions) -> None:
    """--resume finds a complete checkpoint under --out, saved by the model this plan computes."""
    if not options.resume:
        return
    from potluck.model.spec import model_from_dict
    from potluck.runtime.checkpoints.storage import read_trainer_state, resume_checkpoint
    from potluck.runtime.launch.watchdog import one_line

    if not options.out_dir:
        raise ConfigError("--resume needs --out DIR (the run directory to continue)")
    path = resume_checkpoint(options.out_dir)
    _check_steps_left(path, options.steps)
    try:
        saved = read_trainer_state(path).get("model")
        saved_model = model_from_dict(saved) if saved is not None else None
    except (OSError, ValueError) as err:
        raise ConfigError(f"checkpoint {path}: cannot read its trainer state ({one_line(err)})"
                          ) from None
    if saved_model is not None:
        _check_same_model(path, saved_model, compute_plan(plan, options).model)


def _check_steps_left(path: Path, steps: int) -> None:
    """--steps counts the whole run, so a resumed run must ask for more than it has done."""
    from potluck.runtime.checkpoints.storage import checkpoint_step

    done = checkpoint_step(path)
    if steps <= done:
        raise ConfigError(
            f"--steps {steps} is not beyond the {done} steps the run has done ({path}): "
            f"--steps counts the whole run, so continue it with --steps {done + 1} or more")


def _check_same_model(path: Path, saved: ModelSpec, model: ModelSpec) -> None:
    differ = [f.name for f in fields(ModelSpec)
              if f.name not in _RESUME_IGNORES and getattr(saved, f.name) != getattr(model, f.name)]
    if differ:
        def values(spec: ModelSpec) -> str:
            shown = ", ".join(f"{name} {_value(getattr(spec, name))}" for name in differ[:3])
            return shown + (", ..." if len(differ) > 3 else "")

        raise ConfigError(
            f"checkpoint {path} was saved by {saved.name} ({values(saved)}), but this plan "
            f"trains {model.name} ({values(model)}); resume with the run's plan "
            f"(--plan {path.parents[1] / 'plan.json'}) or train into a new --out")


def _value(value: object) -> str:
    return value.value if isinstance(value, Enum) else str(value)
