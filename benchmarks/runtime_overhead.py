"""Overhead of potluck's runtime against plain PyTorch loops of the same model (target: at
most 5% per row), and what each of its per-step features costs.

Rows, each on CPU ranks of this machine (gloo, one thread per rank):

- one rank: potluck's trainer against a plain loop (forward, backward, clipping, AdamW);
- dp=2: against DistributedDataParallel over the same two halves of the batch;
- pp=2: against ``torch.distributed.pipelining`` (``PipelineStage`` and 1F1B, the same
  micro-batches and the same cut), its gradient norm summed over the stages for clipping;
- dp=2 ZeRO-3: against a torchtitan-style FSDP2 loop (``fully_shard`` per block, then
  the root; AdamW; ``clip_grad_norm_``).

Every loop trains the same LLaMA-style model (deterministic initial weights), the same
batches and AdamW (single-tensor, the CPU default). The loops of a row run in the same rank
processes, their steps alternating so background load hits all alike; each step starts
and ends with a barrier (the slowest rank's time), timed on rank 0. After warm-up the
tables give each loop's median step and, as the overhead, the median over steps of
potluck's step over the plain step just before it (pairs see the same background load).

Feature costs: on the one-rank and dp=2 rows potluck also runs with one feature changed
at a time: the memory ledger on (``count_memory``: model states counted three times a
step, every tensor autograd saves counted through a saved-tensor hook; potluck's default
leaves it off), the gradient hooks off (``overlap_grad_reduce: false``: buckets reduced
after the backward pass, not from post-accumulate-grad hooks), the op recorder on (the
clock ``trace_steps`` installs, recording every op), and the per-step memory metrics off
(the memory table and its all-reduce). The cost is the step's time with the feature
minus without (the median over steps of that pair's difference), over the plain loop's
median step.

    python benchmarks/runtime_overhead.py [--hidden 128] [--layers 4] [--batch 8]
        [--seq-len 128] [--steps 24] [--rows one,dp,pp,zero3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from potluck.cluster.spec import parse_cluster
from potluck.model.spec import PRESETS, ModelSpec
from potluck.plans import DType, Pipeline, Plan, Stage, TrainingShape
from potluck.runtime import Trainer, build_model, materialize, parallelize, start
from potluck.runtime.launch.local import run_local
from potluck.runtime.loop.batches import RandomTokens
from potluck.runtime.loop.trainer import StepMetrics
from potluck.runtime.timing.recorder import TraceWindow, attach_recorder

WARMUP = 3
LR = 3e-4
BETAS = (0.9, 0.95)
MAX_GRAD_NORM = 1.0
PP_MICRO_BATCHES = 4
CLUSTER = parse_cluster("nodes:\n  - {name: cpu, gpu: cpu, gpus_per_node: 2}\n")
PLAIN = "plain"
POTLUCK = "potluck"
# potluck's variants with one feature changed, by the feature they change
FEATURES = {"ledger": "memory ledger on", "hooks": "gradient hooks off",
            "recorder": "op recorder on", "metrics": "memory metrics off"}
FEATURE_ROWS = ("one", "dp")
ROW_TITLES = {"one": ("one rank", "plain loop"), "dp": ("dp=2", "DDP"),
              "pp": ("pp=2", "pipelining 1F1B"), "zero3": ("dp=2 ZeRO-3", "FSDP2")}

Step = Callable[[torch.Tensor], Any]


@dataclass(frozen=True)
class Setup:
    """What a row trains: the model, the batch, the steps."""

    spec: ModelSpec
    batch: int
    seq_len: int
    steps: int

    def data(self) -> RandomTokens:
        return RandomTokens(self.spec.vocab_size, self.seq_len, self.batch)


# --- plans -------------------------------------------------------------------------------


def plan_of(setup: Setup, row: str, *, overlap: bool = True) -> Plan:
    """The row's plan: one rank, two replicas, two stages, or two ZeRO-3 replicas."""
    layers = setup.spec.num_layers
    if row == "pp":
        stages = (Stage(("cpu.0:0",), ((0, layers // 2),)),
                  Stage(("cpu.0:1",), ((layers // 2, layers),)))
        pipelines = (Pipeline(stages, setup.batch // PP_MICRO_BATCHES, PP_MICRO_BATCHES),)
    else:
        replicas = 1 if row == "one" else 2
        pipelines = tuple(Pipeline((Stage((f"cpu.0:{r}",), ((0, layers),)),),
                                   setup.batch // replicas, 1) for r in range(replicas))
    shape = TrainingShape(setup.batch, setup.seq_len, DType.FP32)
    shape = replace(shape, execution=replace(shape.execution, overlap_grad_reduce=overlap))
    return Plan(CLUSTER, setup.spec, shape, pipelines, zero=3 if row == "zero3" else 0)


# --- the plain loops -----------------------------------------------------------------------


def _model(spec: ModelSpec) -> nn.Module:
    model = build_model(spec)
    materialize([model], torch.device("cpu"), seed=0)
    return model


def _adamw(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(parameters), lr=LR, betas=BETAS, weight_decay=0.0)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _own_rows(setup: Setup, rows: torch.Tensor) -> torch.Tensor:
    """This replica's half of the global batch."""
    half = setup.batch // dist.get_world_size()
    return rows[dist.get_rank() * half:(dist.get_rank() + 1) * half]


def plain_step(model: nn.Module, setup: Setup, shard: bool) -> Step:
    """Forward, backward, clip, AdamW of ``model`` (plain, DDP or FSDP2) on its rows."""
    optimizer = _adamw(model.parameters())

    def step(rows: torch.Tensor) -> float:
        rows = _own_rows(setup, rows) if shard else rows
        loss = _loss(model(rows[:, :-1]).logits, rows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def ddp_step(setup: Setup) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    return plain_step(DistributedDataParallel(_model(setup.spec)), setup, shard=True)


def fsdp2_step(setup: Setup) -> Step:
    """torchtitan's recipe: each block its own FSDP2 unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(setup.spec)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return plain_step(model, setup, shard=True)


class PlainStage(nn.Module):
    """Blocks ``[start, end)`` of a LLaMA model, with the embedding or the head at the ends."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        inner = model.model
        self.first, self.last = start == 0, end == len(inner.layers)
        self.embed = inner.embed_tokens if self.first else None
        self.layers = nn.ModuleList(inner.layers[start:end])
        self.rotary = inner.rotary_emb
        self.norm, self.head = (inner.norm, model.lm_head) if self.last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.first else x
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        rotary = self.rotary(hidden, positions)
        for layer in self.layers:
            out = layer(hidden, attention_mask=None, position_ids=positions,
                        position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
        return self.head(self.norm(hidden)) if self.last else hidden


def pipelining_step(setup: Setup) -> Step:
    """torch's 1F1B over two stages cut where the plan cuts; the norm summed over stages."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = setup.spec.num_layers
    module = PlainStage(_model(setup.spec), rank * layers // world, (rank + 1) * layers // world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, PP_MICRO_BATCHES,
                            loss_fn=lambda out, y: _loss(out, y) / PP_MICRO_BATCHES,
                            scale_grads=False)
    optimizer = _adamw(module.parameters())

    def step(rows: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        if module.first:
            schedule.step(rows[:, :-1])
        else:
            schedule.step(target=rows[:, 1:], losses=losses)
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        norm_squared = torch.nn.utils.get_total_norm(grads) ** 2
        dist.all_reduce(norm_squared)
        torch.nn.utils.clip_grads_with_norm_(module.parameters(), MAX_GRAD_NORM,
                                             norm_squared.sqrt())
        optimizer.step()
        optimizer.zero_grad()
        return float(sum(loss.item() for loss in losses))

    return step


# --- potluck -------------------------------------------------------------------------------


class NoMemoryMetrics(Trainer):
    """The trainer without its per-step memory table (and that table's all-reduce)."""

    def _metrics(self, output: Any, step_time_s: float, scale: float) -> StepMetrics:
        return StepMetrics(step=self.step_index, loss=output.loss, tokens=output.tokens,
                           tokens_per_s=output.tokens / step_time_s, step_time_s=step_time_s,
                           predicted_step_time_s=None, peak_memory_gb=0.0,
                           grad_norm=output.grad_norm, lr=LR)


def potluck_step(setup: Setup, row: str, session: Any, feature: str | None = None) -> Step:
    """One step of potluck's trainer on this rank of the row's plan, ``feature`` changed."""
    if feature == "hooks":  # the same groups; the gradient sync reads the session's plan
        session = replace(session, plan=plan_of(setup, row, overlap=False))
    model = parallelize(build_model(setup.spec), session, count_memory=feature == "ledger")
    trainer_type = NoMemoryMetrics if feature == "metrics" else Trainer
    trainer = trainer_type(model, lr=LR, max_grad_norm=MAX_GRAD_NORM)
    if feature == "recorder":
        attach_recorder(model).start(TraceWindow(0, 10**9), 0)
    start_row, count = session.layout.batch_rows
    return lambda rows: trainer.step(rows[start_row:start_row + count]).loss


# --- one row on its ranks ------------------------------------------------------------------


def _timed(step: Step, rows: torch.Tensor) -> float:
    dist.barrier()
    start_s = time.perf_counter()
    step(rows)
    dist.barrier()
    return time.perf_counter() - start_s


def _plain(setup: Setup, row: str) -> Step:
    if row == "one":
        return plain_step(_model(setup.spec), setup, shard=False)
    return {"dp": ddp_step, "pp": pipelining_step, "zero3": fsdp2_step}[row](setup)


def run_row(setup: Setup, row: str) -> dict[str, list[float]]:
    """On each rank: every loop of the row, steps alternating; each loop's step times
    (seconds, after warm-up)."""
    torch.set_num_threads(1)
    session = start(plan_of(setup, row), timeout_s=300)
    try:
        loops = {PLAIN: _plain(setup, row), POTLUCK: potluck_step(setup, row, session)}
        if row in FEATURE_ROWS:
            for feature in FEATURES:
                loops[feature] = potluck_step(setup, row, session, feature)
        times: dict[str, list[float]] = {name: [] for name in loops}
        data = setup.data()
        for index in range(setup.steps):
            rows = data.global_batch(index)
            for name, step in loops.items():
                times[name].append(_timed(step, rows))
        return {name: values[WARMUP:] for name, values in times.items()}
    finally:
        session.close()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


# --- report --------------------------------------------------------------------------------


Times = dict[str, list[float]]


def overhead_table(results: dict[str, Times]) -> list[str]:
    lines = ["| row | plain loop | plain ms/step | potluck ms/step | overhead |",
             "|---|---|---:|---:|---:|"]
    for row, times in results.items():
        title, plain = ROW_TITLES[row]
        ratio = median([ours / theirs for ours, theirs in zip(times[POTLUCK], times[PLAIN],
                                                               strict=True)])
        lines.append(f"| {title} | {plain} | {median(times[PLAIN]) * 1e3:.1f} | "
                     f"{median(times[POTLUCK]) * 1e3:.1f} | {100 * (ratio - 1):+.1f}% |")
    return lines


def feature_table(results: dict[str, Times]) -> list[str]:
    """Each feature's cost in % of the plain step: time with it on minus off."""
    rows = [row for row in FEATURE_ROWS if row in results]
    lines = ["| feature (default) | " + " | ".join(ROW_TITLES[r][0] for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for feature, change in FEATURES.items():
        costs = []
        for row in rows:
            times = results[row]
            sign = -1.0 if change.endswith(" off") else 1.0
            on_minus_off = median([sign * (changed - ours) for changed, ours
                                   in zip(times[feature], times[POTLUCK], strict=True)])
            costs.append(f"{100 * on_minus_off / median(times[PLAIN]):+.1f}%")
        name = change.rsplit(" ", 1)[0]
        default = "off" if change.endswith(" on") else "on"
        lines.append(f"| {name} ({default}) | " + " | ".join(costs) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rows", default="one,dp,pp,zero3")
    args = parser.parse_args()
    spec = replace(PRESETS["tiny-llama"], hidden_size=args.hidden, num_layers=args.layers,
                   ffn_hidden_size=4 * args.hidden, num_heads=8, num_kv_heads=8)
    setup = Setup(spec, args.batch, args.seq_len, args.steps)
    results = {}
    for row in args.rows.split(","):
        devices = plan_of(setup, row).devices
        results[row] = run_local(run_row, devices, (setup, row), threads_per_rank=1,
                                 timeout_s=600)[0]
    print(f"model: hidden {args.hidden}, {args.layers} layers, batch {args.batch}x"
          f"{args.seq_len}, CPU ranks (gloo, 1 thread each), median of {args.steps - WARMUP} "
          "steps; target: overhead at most 5% per row")
    print()
    print("\n".join(overhead_table(results)))
    print()
    print("Cost of each feature, in % of the plain loop's step (time with it minus without):")
    print()
    print("\n".join(feature_table(results)))


if __name__ == "__main__":
    main()
