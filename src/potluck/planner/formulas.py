"""Closed-form costs of the pieces of a training step, each next to its source.

These are the only places where time and memory are computed from physics;
everything else (the cost model, the search, the simulator, the emulator)
composes them. Inputs are device and link figures that calibration may
change; the shape of each formula stays.

Sources (see ``shared/reference/formulas.md`` of the design notes):
- ring all-reduce: ``2(g-1)/g * n/W + 2(g-1)*alpha`` (Patarasuk & Yuan 2009;
  NCCL's bus-bandwidth convention);
- roofline: an op takes ``max(flops / achievable FLOP/s, bytes / memory bandwidth)``
  (Williams et al. 2009); GEMMs run in waves of output tiles over the streaming
  multiprocessors (NVIDIA, "Matrix Multiplication Background User's Guide");
- pipeline schedules (GPipe, 1F1B): ``T = sum_i (f_i + b_i) + (m - 1) * max_i (f_i + b_i)``
  for unequal stages; interleaving divides the bubble by ``v`` (Narayanan et al.,
  SC'21); zero bubble (Qi et al. 2024, ZB-H1) shrinks it to ``(f + b - 2w)`` per stage;
- model states: 16 bytes per parameter for mixed-precision Adam with FP32 master
  weights, ``4 + 12/d`` with the optimizer sharded over ``d`` replicas (ZeRO-1;
  Rajbhandari et al. 2020); 18 for FP32 weights under autocast (``10 + 8/d``);
- Adam step: memory bound, about 36 bytes of traffic per parameter (read FP32
  master, both moments and the gradient, write them back and the 16-bit copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GEMM_TILE = 128  # output tile edge of cuBLAS/CUTLASS kernels for 16-bit GEMMs
MEMORY_BANDWIDTH_EFFICIENCY = 0.8  # stas00/ml-engineering: plan on ~80% of advertised rates
ADAM_TRAFFIC_BYTES_PER_PARAM = 36.0
KERNEL_DISPATCH_S = 8e-6  # host-side cost to launch one eager PyTorch op


def ring_allreduce_time_s(num_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                          latency_s: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``ranks`` ranks on links of the given bandwidth."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    steps = ranks - 1
    return 2.0 * steps / ranks * num_bytes / bandwidth_bytes_per_s + 2.0 * steps * latency_s


def ring_allgather_time_s(num_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                          latency_s: float) -> float:
    """All-gather (or reduce-scatter) of a ``num_bytes`` result: half a ring all-reduce."""
    return 0.5 * ring_allreduce_time_s(num_bytes, ranks, bandwidth_bytes_per_s, latency_s)


def roofline_time_s(flops: float, memory_bytes: float, achievable_flops: float,
                    memory_bandwidth_bytes_per_s: float) -> float:
    """An op is bound by whichever of compute and memory traffic takes longer."""
    compute = flops / achievable_flops
    memory = memory_bytes / (memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY)
    return max(compute, memory)


def wave_efficiency(rows: int, cols: int, processors: int) -> float:
    """Share of the last wave's processors that have a tile (wave quantization).

    A GEMM's output is cut into ``GEMM_TILE x GEMM_TILE`` tiles that run in waves of
    one tile per streaming multiprocessor; a partial last wave idles the rest
    (NVIDIA, "Matrix Multiplication Background User's Guide").
    """
    if processors <= 0:
        return 1.0
    tiles = math.ceil(rows / GEMM_TILE) * math.ceil(cols / GEMM_TILE)
    return tiles / (math.ceil(tiles / processors) * processors)


def gemm_time_s(rows: int, inner: int, cols: int, achievable_flops: float,
                memory_bandwidth_bytes_per_s: float, element_bytes: int, processors: int = 0) -> float:
    """``[rows, inner] @ [inner, cols]`` under the roofline, with wave quantization."""
    flops = 2.0 * rows * inner * cols
    traffic = element_bytes * (rows * inner + inner * cols + rows * cols)
    compute_flops = achievable_flops * wave_efficiency(rows, cols, processors)
    return roofline_time_s(flops, traffic, compute_flops, memory_bandwidth_bytes_per_s)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter a device keeps; ZeRO-1 shards the optimizer part."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


# 16-bit weights and gradients, FP32 master weights and Adam moments (SC'21; ZeRO).
MIXED_PRECISION_MASTER = StateBytes(2.0, 2.0, 12.0)
# FP32 weights under 16-bit autocast (plus autocast's 16-bit copy of every weight, kept for
# the step), FP32 gradients, Adam moments: what PyTorch AMP and potluck's runtime hold.
FP32_PARAMS_AUTOCAST = StateBytes(6.0, 4.0, 8.0)
FP32 = StateBytes(4.0, 4.0, 8.0)  # plain FP32 training (CPU ranks)


def model_state_bytes(params: float, dp: int, zero1: bool,
                      layout: StateBytes = MIXED_PRECISION_MASTER) -> float:
    """Weights, gradients and Adam states of ``params`` parameters on one device."""
    shards = dp if (zero1 and dp > 1) else 1
    return params * (layout.weights + layout.grads + layout.optimizer / shards)


def adam_step_time_s(params: float, memory_bandwidth_bytes_per_s: float) -> float:
    return params * ADAM_TRAFFIC_BYTES_PER_PARAM / (
        memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY
    )


@dataclass(frozen=True)
class StageWork:
    """One pipeline stage's time per micro-batch, in seconds.

    ``forward_s``/``backward_s`` include the stage's tensor-parallel
    communication; ``weight_grad_s`` is the part of the backward that a
    zero-bubble schedule can defer; ``send_s`` is the transfer of one
    micro-batch's activations to the next stage (and of gradients back).
    """

    forward_s: float
    backward_s: float
    weight_grad_s: float = 0.0
    send_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class PipelineTime:
    """The time of one pipeline's forward and backward passes over m micro-batches."""

    total_s: float
    period_s: float  # steady-state time per micro-batch (the slowest stage or link)
    fill_s: float  # warm-up and cool-down on top of m periods
    fill_transfer_s: float  # the part of the fill spent in transfers
    bottleneck_stage: int
    finish_s: tuple[float, ...]  # when each stage's last backward ends


def pipeline_time(stages: list[StageWork], micro_batches: int, schedule: str,
                  virtual_stages: int = 1, overlap_p2p: bool = True) -> PipelineTime:
    """Schedule time for unequal stages (SC'21; interleaving and zero bubble as cited above).

    With blocking sends and receives every stage also waits for its transfers: one
    activation out and one gradient back per micro-batch and chunk. torch's 1F1B posts
    them in batches and waits on each batch, so it blocks even where ``overlap_p2p``;
    this matches the discrete-event simulator (``potluck.sim``) to within one transfer
    per stage.
    """
    v = max(1, virtual_stages) if schedule in ("interleaved", "zb") else 1
    blocking = not overlap_p2p or schedule == "1f1b"
    if blocking:
        stages = _with_blocking_transfers(stages, v)
    busiest = max(range(len(stages)), key=lambda i: stages[i].total_s)
    link_period = max((s.send_s * v for s in stages), default=0.0)
    period = max(stages[busiest].total_s, link_period)
    work = sum(s.total_s for s in stages)
    if schedule == "zb":
        # ZB-H1: the bubble is (p-1)(F + B - W) with B the input-gradient half of the
        # backward, i.e. (f + b - 2w) in terms of the whole backward b.
        work = sum(s.total_s - 2.0 * s.weight_grad_s for s in stages)
        fill = max(0.0, work - (period - 2.0 * stages[busiest].weight_grad_s)) / v
    else:
        fill = max(0.0, work - period) / v
    fill_transfer = 0.0 if blocking else 2.0 * sum(s.send_s for s in stages[:-1])
    total = micro_batches * period + fill + fill_transfer
    finish = _stage_finish_times(stages, total)
    return PipelineTime(total, period, fill + fill_transfer, fill_transfer, busiest, finish)


def _with_blocking_transfers(stages: list[StageWork], v: int) -> list[StageWork]:
    """A stage that blocks on its transfers waits, per micro-batch and chunk, for the
    activation it sends on and the gradient it sends back (forward), and for the
    gradient from the next stage and the one it passes back (backward)."""
    result = []
    for i, s in enumerate(stages):
        incoming = stages[i - 1].send_s if i > 0 else 0.0
        wait = v * (incoming + s.send_s) / 2.0
        result.append(StageWork(s.forward_s + wait, s.backward_s + wait, s.weight_grad_s, s.send_s))
    return result


def _stage_finish_times(stages: list[StageWork], total_s: float) -> tuple[float, ...]:
    """Stage i's last backward ends before stage 0's by the backwards of stages < i."""
    finish = []
    earlier = 0.0
    for stage in stages:
        finish.append(total_s - earlier)
        earlier += stage.backward_s + stage.send_s
    return tuple(finish)


def in_flight_micro_batches(schedule: str, stage: int, stages: int, micro_batches: int,
                            virtual_stages: int = 1) -> float:
    """Micro-batches whose activations a stage holds at its peak.

    GPipe keeps all m; 1F1B and zero bubble (ZB-H1) keep ``p - i`` on stage i; interleaved
    1F1B keeps ``(p - i) * (1 + (p - 1)/(p * v))`` (Korthikanti et al. 2022, Sec. 4.2.3).
    """
    if schedule == "gpipe":
        return float(micro_batches)
    in_flight = float(min(micro_batches, stages - stage))
    if schedule in ("interleaved", "zb") and virtual_stages > 1:
        in_flight *= 1.0 + (stages - 1) / (stages * virtual_stages)
    return min(in_flight, float(micro_batches * max(1, virtual_stages)))
