"""Measure one device: matmul throughput per dtype at a model's GEMM shapes, memory bandwidth.

The GEMMs are a transformer block's four (QKV, attention output, MLP up, MLP
down) at the model's widths. Their row count (tokens per micro-batch) is cut
so that one GEMM takes about ``budget_s`` on this device: the inner sizes,
which decide how well a GEMM uses the hardware, stay the model's. Throughput
is the FLOP-weighted figure over the four (total FLOPs over total time), so a
block's GEMM time is what the cost model predicts with it.

Memory bandwidth is that of an element-wise ``c = a + b`` over tensors far
larger than the caches (three tensors of traffic), as the cost model counts
element-wise traffic. Each figure is the median of timed repeats after a
warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from potluck.model.counts import block_gemms
from potluck.model.spec import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROBE_SIZE = 512
# fewest GEMM rows timed: a slow device (a CPU without fast BF16) keeps within its budget
# at a 7B model's widths, where 64 rows of its MLP GEMM are already 5.8 GFLOP
MIN_ROWS = 8


@dataclass(frozen=True)
class DeviceMeasurement:
    """What one device reached: dense matmul FLOP/s per dtype and memory bandwidth."""

    device_name: str
    matmul_flops: dict[str, float]  # dtype -> FLOP/s
    memory_bandwidth_bytes_per_s: float


def block_gemm_shapes(model: ModelSpec, tp: int = 1) -> list[tuple[int, int]]:
    """(inner, cols) of a block's four GEMMs, as the cost model prices them."""
    return [gemm.shape(1, tp)[1:] for gemm in block_gemms(model)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_s(fn: Callable[[], object], device: torch.device, budget_s: float,
            max_repeats: int = 20) -> float:
    """Median seconds of ``fn`` over repeats that fill about ``budget_s`` (one warm-up first)."""
    fn()
    synchronize(device)
    samples: list[float] = []
    spent = 0.0
    while len(samples) < 3 or (spent < budget_s and len(samples) < max_repeats):
        # at least three samples; more while the budget lasts
        started = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - started)
        spent += samples[-1]
    return statistics.median(samples)


def matmul_flops(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int]],
                 budget_s: float) -> float:
    """FLOP/s over the given GEMMs, all of them timed within about ``budget_s``."""
    probe = torch.full((PROBE_SIZE, PROBE_SIZE), 0.5, device=device, dtype=dtype)
    rough = 2 * PROBE_SIZE**3 / timed_s(lambda: probe @ probe, device, 0.02, 3)
    per_run_s = budget_s / len(shapes) / 5  # a warm-up and at least four timed runs each
    flops = seconds = 0.0
    for inner, cols in shapes:
        rows = int(max(MIN_ROWS, min(16384, rough * per_run_s / (2 * inner * cols))))
        a = torch.full((rows, inner), 0.5, device=device, dtype=dtype)  # randn is slow to fill
        b = torch.full((inner, cols), 0.5, device=device, dtype=dtype)
        seconds += timed_s(lambda a=a, b=b: a @ b, device, budget_s / len(shapes), 8)
        flops += 2.0 * rows * inner * cols
    return flops / seconds


def memory_bandwidth(device: torch.device, num_bytes: float = 128e6, budget_s: float = 0.3) -> float:
    """Bytes per second of ``c = a + b`` on FP32 tensors of ``num_bytes`` each."""
    n = int(num_bytes // 4)
    a, b = torch.ones(n, device=device), torch.ones(n, device=device)
    c = torch.empty_like(a)
    return 3 * 4 * n / timed_s(lambda: torch.add(a, b, out=c), device, budget_s)


def _no_phase(index: int, label: str) -> None:
    """Nothing to wait for or report before a measurement."""


def measure_device(device: torch.device, model: ModelSpec, dtypes: list[str], budget_s: float,
                   tp: int = 1, sync: Callable[[int, str], None] = _no_phase) -> DeviceMeasurement:
    """Matmul FLOP/s per dtype at ``model``'s shapes and memory bandwidth of ``device``.

    ``sync(index, label)`` runs before each measurement: ranks that share a machine call a
    barrier there, so they all measure the same thing at once, as they would train, and
    report what they measure next.
    """
    shapes = block_gemm_shapes(model, tp)
    flops = {}
    for index, name in enumerate(dtypes):
        sync(index, f"matmul {name}")
        flops[name] = matmul_flops(device, DTYPES[name], shapes, budget_s)
    sync(len(dtypes), "memory bandwidth")
    bandwidth = memory_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return DeviceMeasurement(name, flops, bandwidth)
