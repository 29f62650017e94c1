"""Before any rank starts: one clear error when a plan cannot run here as asked.

:func:`check_local` runs in the launching process of ``potluck train``: the
plan (and the plan actually computed, with a stand-in) is valid, the counts
and flags make sense, a plan that spans several machines is only emulated
here, the GPUs it needs exist, the data and tokenizer fit the model, and the
plan's execution traits are ones potluck's runtime runs (:func:`check_execution`).
Each failure is one :class:`~potluck.errors.ConfigError` that says how to fix it.
"""

from __future__ import annotations

from potluck.cluster.execution import (
    DEFAULT_PRESET,
    PRESETS,
    describe,
    differences,
    traits_text,
)
from potluck.errors import ConfigError
from potluck.plans import Plan, check_plan
from potluck.runtime.launch.session import wants_gpu
from potluck.runtime.launch.torchrun import plan_nodes
from potluck.runtime.models.stand_in import compute_plan
from potluck.runtime.options import TrainOptions


def check_local(plan: Plan, options: TrainOptions) -> None:
    """One clear error when ``plan`` cannot run on this machine."""
    check_plan(plan)
    check_plan(compute_plan(plan, options))
    check_execution(plan)
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


# Choices the runtime follows whatever their value: the gradient all-reduce overlaps the
# backward pass or not (runtime/grads/data_parallel.py), crosses the wire in 16 or 32 bits
# (parallelize._wire_dtype), attention runs SDPA or eager (models/build.py), and any
# placement's layout runs as the plan lays it out (runtime/layout.py).
RUNTIME_FOLLOWS = ("overlap_grad_reduce", "grad_reduce_bytes", "flash_attention", "placement")


def check_execution(plan: Plan) -> None:
    """The plan's execution traits are ones potluck's runtime runs: every choice (a true/false
    or named trait) outside :data:`RUNTIME_FOLLOWS` as in the ``potluck`` preset (no fused
    kernels, FP32 weights, overlapped pipeline sends). Figures (host seconds, bytes of
    traffic) only describe how long a step takes, so any value runs."""
    execution = plan.training.execution
    refused = [name for name in differences(PRESETS[DEFAULT_PRESET], execution)
               if name not in RUNTIME_FOLLOWS and not _is_figure(getattr(execution, name))]
    if refused:
        raise ConfigError(
            f"the plan's execution ({describe(execution)}) asks for "
            f"{traits_text(execution, refused)}, which potluck's "
            f"runtime does not run; make the plan with --execution {DEFAULT_PRESET}")


def _is_figure(value: object) -> bool:
    return isinstance(value, float)


def check_counts(options: TrainOptions) -> None:
    """--steps is at least 1, --checkpoint-every not negative."""
    if options.steps < 1:
        raise ConfigError(f"--steps must be at least 1, not {options.steps}")
    if options.checkpoint_every < 0:
        raise ConfigError(
            f"--checkpoint-every must be 0 (only the final state) or a number of steps, "
            f"not {options.checkpoint_every}"
        )


def check_trace(options: TrainOptions) -> None:
    """--trace has somewhere to write its trace."""
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
