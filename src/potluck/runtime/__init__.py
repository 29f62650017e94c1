"""The runtime: train a model with exactly the layout a Plan gives, on torch.distributed.

A few lines turn a single-device script into multi-device training::

    with potluck.runtime.meta_init():             # parameters cost nothing yet
        model = LlamaForCausalLM(config)
    session = potluck.runtime.start(plan)          # process groups from the plan
    model = potluck.runtime.parallelize(model, session)  # TP, PP, init, recompute, DP
    trainer = potluck.runtime.Trainer(model, lr=3e-4)
    for step in range(steps):                      # data: a BatchSource (TokenDataset)
        trainer.step(data.replica_rows(step, *session.layout.batch_rows))
    session.close()

Run it under torchrun (one command per machine: :func:`torchrun_commands`),
or let :func:`train` start the ranks of one machine. Checkpoints
(:mod:`potluck.runtime.checkpoints.storage`) and Hugging Face export
(:mod:`potluck.runtime.checkpoints.export`) take the model's state dicts under its own
parameter names (``ParallelModel.module``).

The names below are imported when first used, so that importing one part of the
runtime (``potluck train`` checking its options, say) does not import all of it,
torch's distributed parts and transformers' models included.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "run_local": "launch.local", "Session": "launch.session", "start": "launch.session",
    "NodeCommand": "launch.torchrun", "torchrun_commands": "launch.torchrun",
    "RankFailure": "launch.watchdog", "Layout": "layout", "Role": "layout",
    "BatchSource": "loop.trainer", "StepMetrics": "loop.trainer", "Trainer": "loop.trainer",
    "build_model": "models.build", "materialize": "models.build", "meta_init": "models.build",
    "model_spec": "models.build", "TrainOptions": "options", "ParallelModel": "parallel_model",
    "StepOutput": "parallel_model", "parallelize": "parallel_model",
    "EmulationClock": "timing.emulate",
    "emulate": "timing.emulate", "train": "training", "train_rank": "training",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
