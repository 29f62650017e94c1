"""The runtime: train a model with exactly the layout a Plan gives, on torch.distributed.

A few lines turn a single-device script into multi-device training::

    with potluck.runtime.meta_init():             # parameters cost nothing yet
        model = LlamaForCausalLM(config)
    session = potluck.runtime.start(plan)          # process groups from the plan
    model = potluck.runtime.parallelize(model, session)  # TP, PP, init, recompute, DP
    trainer = potluck.runtime.Trainer(model, lr=3e-4)
    for step in range(steps):
        trainer.step(data.replica_rows(step, *session.layout.batch_rows))

Run it under torchrun (one command per machine: :func:`torchrun_commands`),
or let :func:`train` start the ranks of one machine. Checkpoints
(:mod:`potluck.runtime.checkpoints.storage`) and Hugging Face export
(:mod:`potluck.runtime.checkpoints.export`) take the model's state dicts under its own
parameter names (``ParallelModel.module``).
"""

from potluck.runtime.launch.local import run_local
from potluck.runtime.launch.session import Session, start
from potluck.runtime.launch.torchrun import NodeCommand, torchrun_commands
from potluck.runtime.launch.watchdog import RankFailure
from potluck.runtime.layout import Layout, Role
from potluck.runtime.loop.trainer import BatchSource, StepMetrics, Trainer
from potluck.runtime.models.build import build_model, materialize, meta_init, model_spec
from potluck.runtime.options import TrainOptions
from potluck.runtime.parallelize import ParallelModel, StepOutput, parallelize
from potluck.runtime.timing.emulate import EmulationClock, emulate
from potluck.runtime.train import train, train_rank

__all__ = [
    "BatchSource", "EmulationClock", "Layout", "NodeCommand", "ParallelModel", "RankFailure",
    "Role", "Session", "StepMetrics", "StepOutput", "TrainOptions", "Trainer", "build_model",
    "emulate", "materialize", "meta_init", "model_spec", "parallelize", "run_local", "start",
    "torchrun_commands", "train", "train_rank",
]
