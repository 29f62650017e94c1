"""Achieved matmul throughput: how long a GEMM or an attention kernel takes on a device.

The one owner of a matmul's efficiency. Everything that prices a matmul (a block's
projections and MLP, materialized attention's batched GEMMs, the output layer, grouped
expert GEMMs, FlashAttention) comes here; nothing else multiplies a peak by a share.

A GEMM ``[M, K] @ [K, N]`` (``rows``, ``inner``, ``cols``) in the dtype a device computes in:

    time = max(2*M*N*K / (peak x ceiling x tiles-and-waves(M, N, SMs)),
               bytes moved / memory bandwidth)

- **peak** (:func:`peak_flops`): the catalog's dense peak of that dtype (16-bit tensor,
  TF32 tensor or FP32 cores);
- **ceiling**: the device type's ``matmul_efficiency``, the share of the peak that large,
  well-shaped GEMMs reach in PyTorch, from published measured sweeps (the catalog names
  the sweep and the shape for every type: stas00/ml-engineering's "maximum achievable
  matmul FLOPS" table, mli/transformers-benchmarks, zzc0721/torch-performance-test-data).
  It is set so that this model reproduces the sweep's best point: the measured FLOP/s over
  the peak, divided by :func:`wave_efficiency` at the measured shape. GeForce cards run above
  the boost clock NVIDIA rates them at, and their measured ceiling is 1.0 to 1.14 of that
  nominal peak; data-centre parts hold their rated clock or less under load (A100 0.88, H100
  0.83, T4 0.66). ``potluck calibrate`` replaces the ceiling with what a run measured;
- **tiles and waves** (:func:`wave_efficiency`): the output is cut into tiles, one thread
  block each, run in waves over the streaming multiprocessors; partial tiles at the edges
  and a partial last wave do no useful work (NVIDIA, "Matrix Multiplication Background
  User's Guide", Deep Learning Performance documentation: tile and wave quantization);
- **roofline** (:func:`potluck.planner.formulas.roofline_time_s`): a GEMM whose arithmetic
  intensity is below the device's ridge point (a thin ``M``, a small ``K``) is bound by its
  traffic, ``(MK + KN + MN)`` elements, at the planned share of the memory bandwidth.

FlashAttention-2 (Dao 2023, arXiv 2307.08691): on an A100 its forward pass reaches 73% and
its backward pass 63% of the peak, where large GEMMs reach 87% (stas00's MAMF table), so
the forward runs at 0.84 and the backward at 0.72 of the device's GEMM ceiling; the
backward does 2.5x the forward's FLOPs (it recomputes the scores). The backward slows at
short sequences: each key block's pass over the queries has a fixed start and end (loading
K and V, writing dK and dV) worth the work of 256 more keys per query, so it runs at
``k / (k + 256)`` of its long-sequence rate for ``k`` keys per query (fitted to the
published FlashAttention-2 benchmark of an RTX A5000 for head dim 64, sequences 512 to
8192, gpu-mode/ring-attention issue 10: 0.68, 0.81, 0.91, 0.97 of the 8192 rate; the
forward stays within 4% of flat there). Causal masking halves the keys per query. Head
dimension enters through the FLOPs and the traffic only: the per-head-dimension points of
the FlashAttention-2 paper were not available to source a separate factor.
"""

from __future__ import annotations

import math

from potluck.cluster.catalog import DeviceType
from potluck.errors import ConfigError
from potluck.planner import formulas
from potluck.plans import DType

GEMM_TILE = 128  # output tile edge of cuBLAS/CUTLASS kernels for 16-bit GEMMs
LARGE_GEMM_TILE = (256, 128)  # cuBLAS's largest 16-bit tile (NVIDIA GEMM guide's A100 example)

# FlashAttention-2 on A100 (Dao 2023): forward 73% and backward 63% of the peak where large
# GEMMs reach 87% (stas00 MAMF); the backward's 63% is measured at 16k keys per query.
FLASH_BACKWARD_FLOPS_FACTOR = 2.5  # backward FLOPs / forward FLOPs (the scores recomputed)
FLASH_BACKWARD_START_KEYS = 256.0  # a key block's fixed start, in keys of work (A5000 sweep)
FLASH_FORWARD_OF_GEMM = 0.73 / 0.87
FLASH_BACKWARD_OF_GEMM = 0.63 / 0.87 * (16384 + FLASH_BACKWARD_START_KEYS) / 16384
CAUSAL_FRACTION = 0.5  # causal kernels skip the masked half of the scores


def effective_dtype(device_type: DeviceType, requested: DType) -> DType:
    """The dtype a device computes in when ``requested`` is asked for: CPU ranks train in
    FP32 whatever is asked; devices without BF16 fall back to FP16; TF32 on a device
    without TF32 tensor cores (``tf32_tflops`` 0: before Ampere, AMD CDNA 2) is plain FP32."""
    if device_type.is_cpu:
        return DType.FP32
    if requested is DType.BF16 and not device_type.bf16:
        return DType.FP16
    if requested is DType.TF32 and device_type.tf32_tflops <= 0:
        return DType.FP32
    return requested


def peak_flops(device_type: DeviceType, requested: DType) -> float:
    """Dense peak FLOP/s of the dtype ``device_type`` computes in when ``requested`` is
    asked for: 16-bit tensor (``tflops``), TF32 tensor (``tf32_tflops``) or FP32 on the
    ordinary cores (``fp32_tflops``; the catalog's CPU ``tflops`` is already FP32)."""
    dtype = effective_dtype(device_type, requested)
    if dtype is DType.TF32:
        return device_type.tf32_tflops * 1e12
    # a CPU's `tflops` is its FP32 peak, the figure `potluck profile` calibrates against
    if dtype is not DType.FP32 or device_type.is_cpu:
        return device_type.tflops * 1e12
    if device_type.fp32_tflops > 0:
        return device_type.fp32_tflops * 1e12
    raise ConfigError(
        f"device {device_type.name!r} has no fp32_tflops figure, needed to plan "
        f"{requested.value}: set fp32_tflops (and tf32_tflops, if it has TF32 tensor cores) "
        "under devices in the cluster file")


def achievable_flops(device_type: DeviceType, requested: DType) -> float:
    """FLOP/s large, well-shaped GEMMs reach: the dtype's peak x the ceiling
    (``matmul_efficiency``). The ceiling is measured on 16-bit GEMMs (and calibrated in the
    device's 16-bit dtype); potluck applies the same share to the TF32 and FP32 peaks, as no
    per-dtype measurement is published for most devices (cuBLAS SGEMM and TF32 GEMMs reach a
    similar share of their own peaks)."""
    return peak_flops(device_type, requested) * device_type.matmul_efficiency


def wave_efficiency(rows: int, cols: int, processors: int) -> float:
    """Share of the streaming multiprocessors' tile slots that do useful work.

    A GEMM's output is cut into tiles, one thread block each, that run in waves of
    one tile per streaming multiprocessor; partial tiles at the matrix edges (tile
    quantization) and a partial last wave (wave quantization) waste the rest
    (NVIDIA, "Matrix Multiplication Background User's Guide"). cuBLAS runs large
    GEMMs with its largest tensor-core tile, 256 x 128 (the guide's A100 example), in
    whichever orientation wastes less; a GEMM with fewer such tiles than processors
    runs ``GEMM_TILE x GEMM_TILE`` tiles instead.
    """
    if processors <= 0:
        return 1.0
    large = [_tiled_efficiency(rows, cols, tile_rows, tile_cols, processors)
             for tile_rows, tile_cols in (LARGE_GEMM_TILE, LARGE_GEMM_TILE[::-1])
             if math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols) >= processors]
    if large:
        return max(large)
    return _tiled_efficiency(rows, cols, GEMM_TILE, GEMM_TILE, processors)


def _tiled_efficiency(rows: int, cols: int, tile_rows: int, tile_cols: int,
                      processors: int) -> float:
    tiles = math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols)
    waves = math.ceil(tiles / processors)
    return rows * cols / (waves * processors * tile_rows * tile_cols)


def gemm_time_s(rows: int, inner: int, cols: int, achievable_flops: float,
                memory_bandwidth_bytes_per_s: float, element_bytes: int, processors: int = 0) -> float:
    """``[rows, inner] @ [inner, cols]`` under the roofline, with tile and wave quantization
    over ``processors`` streaming multiprocessors (0: not modelled)."""
    flops = 2.0 * rows * inner * cols
    traffic = element_bytes * (rows * inner + inner * cols + rows * cols)
    compute_flops = achievable_flops * wave_efficiency(rows, cols, processors)
    return formulas.roofline_time_s(flops, traffic, compute_flops, memory_bandwidth_bytes_per_s)


def grouped_gemm_time_s(groups: int, rows_per_group: int, inner: int, cols: int,
                        achievable_flops: float, memory_bandwidth_bytes_per_s: float,
                        element_bytes: int, processors: int = 0) -> float:
    """``groups`` GEMMs ``[rows_per_group, inner] @ [inner, cols]``, each with its own
    weights, in one grouped kernel (``torch._grouped_mm``, how transformers runs routed
    experts): each group's rows fill whole ``GEMM_TILE`` tiles, the tiles of all groups
    share the waves, and every group's weights are read."""
    if groups == 1:
        return gemm_time_s(rows_per_group, inner, cols, achievable_flops,
                           memory_bandwidth_bytes_per_s, element_bytes, processors)
    rows = groups * rows_per_group
    padded = groups * math.ceil(rows_per_group / GEMM_TILE) * GEMM_TILE
    flops = 2.0 * rows * inner * cols
    traffic = element_bytes * (rows * inner + groups * inner * cols + rows * cols)
    compute_flops = achievable_flops * rows / padded * wave_efficiency(padded, cols, processors)
    return formulas.roofline_time_s(flops, traffic, compute_flops, memory_bandwidth_bytes_per_s)


def matmul_time_s(device: DeviceType, dtype: DType, rows: int, inner: int, cols: int,
                  groups: int = 1) -> float:
    """``groups`` GEMMs of ``[rows, inner] @ [inner, cols]`` on ``device`` when ``dtype`` is
    asked for (one plain GEMM when ``groups`` is 1; ``rows`` per group)."""
    return grouped_gemm_time_s(groups, rows, max(1, inner), max(1, cols),
                               achievable_flops(device, dtype), device.memory_bandwidth_bytes_per_s,
                               effective_dtype(device, dtype).bytes, device.sm_count)


def flash_backward_rolloff(keys_per_query: float) -> float:
    """Share of its long-sequence rate FlashAttention-2's backward runs at with
    ``keys_per_query`` keys per query: each key block's fixed start is worth
    :data:`FLASH_BACKWARD_START_KEYS` keys of work."""
    return keys_per_query / (keys_per_query + FLASH_BACKWARD_START_KEYS)


def flash_attention_s(device: DeviceType, dtype: DType, flops: float, traffic_bytes: float,
                      keys_per_query: float) -> tuple[float, float]:
    """FlashAttention-2's forward and backward seconds for a forward of ``flops`` (the
    scores it computes, causal half skipped) that reads Q, K, V and writes the output,
    ``traffic_bytes``, with ``keys_per_query`` keys scored per query on average."""
    gemm = achievable_flops(device, dtype)
    bandwidth = device.memory_bandwidth_bytes_per_s
    forward = formulas.roofline_time_s(flops, traffic_bytes, gemm * FLASH_FORWARD_OF_GEMM, bandwidth)
    backward_flops = gemm * FLASH_BACKWARD_OF_GEMM * flash_backward_rolloff(keys_per_query)
    backward = formulas.roofline_time_s(flops * FLASH_BACKWARD_FLOPS_FACTOR, 2.0 * traffic_bytes,
                                        backward_flops, bandwidth)
    return forward, backward
