"""What every part of the GPU check shares: its time budget, a check's result line, the
models it trains and the one-machine clusters it plans them on."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@dataclass
class Deadline:
    """What is left of the whole check's time."""

    ends_at: float

    def timeout_s(self, part_s: float) -> float:
        left = self.ends_at - time.monotonic()
        if left <= 1.0:
            raise TimeoutError("the check's time budget is spent")
        return min(part_s, left)


@dataclass(frozen=True)
class Outcome:
    """One check's result line."""

    name: str
    ok: bool
    detail: str


def small_llama():
    """A small LLaMA over the byte vocabulary (the shipped corpus's tokens)."""
    from potluck.model.spec import PRESETS

    return replace(PRESETS["tiny-llama"], name="llama-256x4", hidden_size=256, ffn_hidden_size=688,
                   num_heads=4, num_kv_heads=2)


def check_model():
    """The model whose step time (c), GEMMs (d) and memory (f) are measured: LLaMA-2 blocks
    at width 2048, four of them, the 32000-token vocabulary (about 340M parameters)."""
    from potluck.model.spec import PRESETS

    return replace(PRESETS["llama2-7b"], name="llama-2048x4", hidden_size=2048,
                   ffn_hidden_size=5632, num_heads=16, num_kv_heads=16, num_layers=4,
                   max_seq_len=2048)


def gpus_cluster(device: str, count: int):
    """One machine of ``count`` GPUs of catalog type ``device``."""
    from potluck.cluster.spec import parse_cluster

    return parse_cluster(f"nodes:\n  - {{name: gpu, gpu: {device}, gpus_per_node: {count}}}\n",
                         "gpu-check.yaml")


def one_gpu_cluster(device: str, calibrated: Path | None = None):
    from potluck.cluster.spec import load_cluster

    return load_cluster(calibrated) if calibrated is not None else gpus_cluster(device, 1)


def run_on_gpus(plan, options, timeout_s: float, fn=None, args: tuple | None = None) -> list:
    """Rank 0's result of ``fn(*args)`` (default: potluck's ``train_rank(plan, options)``, its
    step metrics) on this machine's GPUs, spawned ranks (a fork of a process that has
    initialized CUDA cannot use it)."""
    from potluck.runtime.launch.gpus import StartMethod
    from potluck.runtime.launch.local import run_local
    from potluck.runtime.training import train_rank

    return run_local(fn or train_rank, plan.devices, args if args is not None else (plan, options),
                     timeout_s=timeout_s, start_method=StartMethod.SPAWN)[0]
