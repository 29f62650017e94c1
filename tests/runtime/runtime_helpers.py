"""Shared pieces of the runtime tests: CPU clusters, small plans, the single-process reference."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from potluck.cluster.spec import parse_cluster
from potluck.model.counts import Recompute
from potluck.model.spec import PRESETS, ModelSpec
from potluck.plans import DType, Pipeline, Plan, Schedule, Stage, TrainingShape
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.trainer import BatchSource
from potluck.runtime.models.build import build_model, materialize
from potluck.runtime.options import TrainOptions
from potluck.runtime.training import train_rank

CPU_CLUSTER = parse_cluster(
    "nodes:\n  - name: cpu\n    gpu: cpu\n    gpus_per_node: 8\n", "cpu.yaml"
)
SEQ_LEN = 16
LR = 3e-3
STEPS = 3

# Tiny models: 4 blocks, hidden 32, no dropout, so every layout computes the same function.
TINY_LLAMA = replace(PRESETS["tiny-llama"], hidden_size=32, ffn_hidden_size=64, num_heads=4,
                     num_kv_heads=2, max_seq_len=64)
TINY_GPT2 = replace(PRESETS["tiny-gpt2"], hidden_size=32, ffn_hidden_size=64, num_heads=4,
                    num_kv_heads=4, max_seq_len=64, dropout=False)

StageSpec = tuple[int, tuple[tuple[int, int], ...]]  # (tp degree, layer ranges)
SRC = Path(__file__).resolve().parents[2] / "src"
CLI_TIMEOUT_S = 600  # a CLI run that takes this long has hung


def potluck(*args: str) -> subprocess.CompletedProcess:
    """``python -m potluck ARGS`` in a child process (this checkout's sources), bounded."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "potluck", *args], capture_output=True,
                          text=True, env=env, timeout=CLI_TIMEOUT_S)


def pipe(stages: Sequence[tuple[int, tuple[int, int] | tuple[tuple[int, int], ...]]],
         micro_batch: int, micro_batches: int) -> tuple[list[StageSpec], int, int]:
    """A pipeline: ``[(tp, (start, end)), ...]`` (or several ranges per stage), mbs, count."""
    normalized = []
    for tp, ranges in stages:
        ranges = (ranges,) if isinstance(ranges[0], int) else ranges
        normalized.append((tp, tuple(ranges)))
    return normalized, micro_batch, micro_batches


def make_plan(model: ModelSpec, pipelines: Sequence[tuple[list[StageSpec], int, int]], *,
              schedule: Schedule = Schedule.ONE_F_ONE_B, recompute: Recompute = Recompute.NONE,
              seq_len: int = SEQ_LEN, cluster=CPU_CLUSTER, device_ids: Sequence[str] = (),
              dtype: DType = DType.BF16) -> Plan:
    """A plan that hands out the cluster's devices in order. CPU ranks (emulated GPUs
    included) compute in fp32 whatever ``dtype`` says; it sets what the GPUs' predictions,
    and so the emulator's targets, assume."""
    ids = list(device_ids) or [f"cpu.0:{i}" for i in range(8)]
    next_device = iter(ids)
    built = []
    for stages, micro_batch, count in pipelines:
        plan_stages = tuple(
            Stage(devices=tuple(next(next_device) for _ in range(tp)), layer_ranges=ranges)
            for tp, ranges in stages
        )
        built.append(Pipeline(plan_stages, micro_batch, count))
    virtual = len(built[0].stages[0].layer_ranges)
    total = sum(p.batch_share for p in built)
    return Plan(cluster=cluster, model=model,
                training=TrainingShape(global_batch=total, seq_len=seq_len, dtype=dtype),
                pipelines=tuple(built), schedule=schedule, virtual_stages=virtual,
                recompute=recompute)


def reference_model(spec: ModelSpec, seed: int = 0) -> nn.Module:
    model = build_model(spec)
    materialize([model], torch.device("cpu"), seed)
    return model


def reference_losses(spec: ModelSpec, global_batch: int, steps: int = STEPS, lr: float = LR,
                     seed: int = 0, max_grad_norm: float | None = 1.0,
                     model: nn.Module | None = None, data: BatchSource | None = None
                     ) -> list[float]:
    """A plain single-process PyTorch loop over the same data (default: random tokens) and
    initial weights."""
    model = model if model is not None else reference_model(spec, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.0, foreach=False)
    data = data or RandomTokens(spec.vocab_size, SEQ_LEN, global_batch, seed)
    losses = []
    for step in range(steps):
        rows = data.replica_rows(step, 0, global_batch)
        output = model(rows[:, :-1])
        logits = output.logits if hasattr(output, "logits") else output
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _losses_of_rank(plan: Plan, options: TrainOptions,
                    model_factory: Callable[[], nn.Module] | None) -> list[float]:
    return [m.loss for m in train_rank(plan, options, model_factory)]


def run_plan(plan: Plan, steps: int = STEPS, lr: float = LR, seed: int = 0,
             model_factory: Callable[[], nn.Module] | None = None,
             timeout_s: float = 60.0, rank_order: Sequence[str] = (), **options) -> list[float]:
    """Rank 0's loss curve of ``plan`` run on CPU ranks of this machine; rank ``i`` runs
    ``rank_order[i]`` (default: the plan's device order)."""
    train_options = TrainOptions(steps=steps, lr=lr, seed=seed, progress=False,
                                 timeout_s=timeout_s, **options)
    results = run_local(_losses_of_rank, tuple(rank_order) or plan.devices,
                        (plan, train_options, model_factory), timeout_s=timeout_s * 2)
    for losses in results[1:]:
        assert losses == results[0], "all ranks must report the same global loss"
    return results[0]


class ToyBlock(nn.Module):
    """A pre-norm block: causal self-attention and an MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ToyLM(nn.Module):
    """Not a Hugging Face model: blocks in one ModuleList, a plain forward."""

    def __init__(self, vocab: int = 260, hidden: int = 32, layers: int = 4, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyBlock(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def toy_on_meta() -> nn.Module:
    from potluck.runtime.models.build import meta_init

    with meta_init():
        return ToyLM()


def toy_reference(seed: int = 0) -> nn.Module:
    model = toy_on_meta()
    materialize([model], torch.device("cpu"), seed)
    return model
