"""Achieved matmul throughput (potluck.planner.gemm): tiles and waves over the SMs, the
roofline, each architecture's measured GEMM ceiling against the published points it was
taken from and against the other points of the same sweeps, and FlashAttention-2.

The published points (TFLOPS, dense, 16-bit inputs with FP32 accumulation, PyTorch):
- stas00/ml-engineering, "Maximum Achievable Matmul FLOPS comparison table" (MAMF): the best
  shape of a brute-force sweep, M x N x K;
- zzc0721/torch-performance-test-data: ``torch.mm`` of squares 1024-10240, per-size figures
  in its issues (#78 RTX 4090, #114 RTX 3080, #124 RTX 5090, #131 RTX 3060), the best square
  per submission in database.md;
- mli/transformers-benchmarks (micro_bench.ipynb, README): squares 128-8192.
The ceiling of each type is its point divided by the model's wave efficiency there (the
catalog's sources give the arithmetic), so a point the ceiling came from is reproduced to
its rounding; the other points test the shape model.
"""

from __future__ import annotations

import pytest

from potluck.cluster.catalog import catalog, source_of
from potluck.planner import gemm
from potluck.plans import DType


def tflops(device: str, m: int, n: int, k: int, dtype: DType = DType.BF16) -> float:
    """Predicted FLOP/s of an ``[m, k] @ [k, n]`` GEMM on a catalog type, in TFLOPS."""
    return 2.0 * m * n * k / gemm.matmul_time_s(catalog()[device], dtype, m, k, n) / 1e12


# (catalog type, M, N, K, published TFLOPS, source); 16-bit inputs, FP32 accumulation
PUBLISHED = [
    # Ampere data centre
    ("a100-80g-sxm", 1024, 10240, 5120, 271.2, "MAMF, A100 SXM best shape"),
    ("a100-80g-sxm", 8192, 8192, 8192, 264.53, "torch-performance-test-data, A100 SXM4 80GB"),
    ("a100-80g-pcie", 2048, 5120, 6144, 252.9, "MAMF, A100 PCIe best shape"),
    # Ampere GeForce: above the nominal peak (the cards boost past their rated clock)
    ("rtx3090", 8192, 8192, 8192, 76.58, "torch-performance-test-data, median of 3 RTX 3090s"),
    ("rtx3090ti", 8192, 8192, 8192, 81.314, "mli micro_bench, RTX 3090 Ti"),
    ("rtx3080", 2048, 2048, 2048, 58.92, "torch-performance-test-data #114, RTX 3080"),
    ("rtx3080", 4096, 4096, 4096, 61.51, "torch-performance-test-data #114, RTX 3080"),
    ("rtx3080", 8192, 8192, 8192, 63.56, "torch-performance-test-data #114, RTX 3080"),
    ("rtx3080", 10240, 10240, 10240, 64.68, "torch-performance-test-data #114, RTX 3080"),
    ("rtx3060", 2048, 2048, 2048, 23.69, "torch-performance-test-data #131, RTX 3060"),
    ("rtx3060", 4096, 4096, 4096, 24.29, "torch-performance-test-data #131, RTX 3060"),
    ("rtx3060", 8192, 8192, 8192, 25.42, "torch-performance-test-data #131, RTX 3060"),
    # Ampere workstation
    ("rtx-a6000", 8192, 8192, 8192, 123.34, "torch-performance-test-data, RTX A6000"),
    # Ada GeForce and data centre
    ("rtx4090", 2048, 2048, 2048, 164.81, "torch-performance-test-data #78, RTX 4090"),
    ("rtx4090", 4096, 4096, 4096, 151.50, "torch-performance-test-data #78, RTX 4090"),
    ("rtx4090", 8192, 8192, 8192, 160.17, "torch-performance-test-data #78, RTX 4090"),
    ("rtx4090", 10240, 10240, 10240, 158.54, "torch-performance-test-data #78, RTX 4090"),
    ("l40s", 8192, 8192, 8192, 269.15, "torch-performance-test-data, L40S"),
    # Hopper
    ("h100-sxm", 2048, 2048, 13312, 794.5, "MAMF, H100 SXM best shape"),
    ("h100-sxm", 8192, 8192, 8192, 789.24, "torch-performance-test-data, H100 80GB HBM3"),
    ("h200", 8192, 8192, 8192, 790.29, "torch-performance-test-data, H200"),
    ("gh200", 1024, 15360, 4096, 828.6, "MAMF, GH200 best shape"),
    # Blackwell (GeForce and data centre)
    ("rtx5090", 2048, 2048, 2048, 171.53, "torch-performance-test-data #124, RTX 5090"),
    ("rtx5090", 4096, 4096, 4096, 182.19, "torch-performance-test-data #124, RTX 5090"),
    ("rtx5090", 8192, 8192, 8192, 234.66, "torch-performance-test-data #124, RTX 5090"),
    ("rtx5090", 10240, 10240, 10240, 236.99, "torch-performance-test-data #124, RTX 5090"),
    ("b200", 1792, 16128, 3072, 1745.0, "MAMF, B200 SXM best shape"),
    # Volta and Turing (FP16: no BF16)
    ("v100-16g", 8192, 8192, 8192, 95.0, "mli transformers-benchmarks, V100 16GB"),
    ("t4", 8192, 8192, 8192, 42.31, "torch-performance-test-data, mean of 2 T4s"),
    ("rtx2080", 8192, 8192, 8192, 39.03, "torch-performance-test-data, RTX 2080"),
    # CDNA 3
    ("mi300x", 10240, 15360, 8192, 668.4, "MAMF, MI300X best shape"),
]
TOLERANCE = 0.10  # every point of at least 2048 on a side


@pytest.mark.parametrize("device, m, n, k, published, source", PUBLISHED,
                         ids=[f"{p[0]}-{p[1]}x{p[2]}x{p[3]}" for p in PUBLISHED])
def test_each_architecture_matches_its_published_matmul_points(device, m, n, k, published,
                                                                source):
    assert tflops(device, m, n, k) == pytest.approx(published, rel=TOLERANCE), source


def test_wave_quantization_explains_the_rtx_5090s_square_sweep():
    """170 SMs: 4096^2 is 512 tiles of 256 x 128, four waves for 3.01 waves of work (0.75),
    8192^2 is 2048 tiles in 13 waves (0.93), 10240^2 3200 in 19 (0.99): measured 182, 235,
    237 TFLOPS (issue #124), predicted 179, 221, 236."""
    measured = {4096: 182.19, 8192: 234.66, 10240: 236.99}
    predicted = {n: tflops("rtx5090", n, n, n) for n in measured}
    assert predicted[4096] / predicted[10240] == pytest.approx(
        measured[4096] / measured[10240], rel=0.03)


def test_the_mid_size_point_of_the_3090_ti_sweep_is_predicted_conservatively():
    """2048^2 on 84 SMs: 128 tiles of 256 x 128 in two waves (0.76 of the slots used);
    measured 71.5 TFLOPS against 81.3 at 8192^2 (mli), predicted 61.9: cuBLAS picks a tile
    that wastes less there than the model's two tile sizes do (13% slower than measured)."""
    assert tflops("rtx3090ti", 2048, 2048, 2048) == pytest.approx(71.505, rel=0.15)
    assert tflops("rtx3090ti", 2048, 2048, 2048) < 71.505


@pytest.mark.parametrize("device", ["a100-80g-sxm", "rtx3090", "rtx4090", "h100-sxm", "t4"])
def test_one_tile_more_than_a_full_wave_costs_a_whole_wave(device):
    """512 rows (two tiles of 256) by ``sm_count / 2`` column tiles of 128 fill one wave;
    one more column tile of 128 (a fraction of a percent more work) needs a second wave.
    K = 8192 keeps both compute-bound."""
    gpu = catalog()[device]
    cols = gpu.sm_count // 2 * 128
    full = gemm.matmul_time_s(gpu, DType.BF16, 512, 8192, cols)
    one_more = gemm.matmul_time_s(gpu, DType.BF16, 512, 8192, cols + 128)
    assert one_more / full == pytest.approx(2.0, rel=0.01)


def test_geforce_ceilings_are_their_measurements_above_the_rated_peak():
    """GeForce cards' rated peaks assume a boost clock they run above: an RTX 3090 measures
    76.6 TFLOPS against its 71 (three submissions), a 3090 Ti 81.3 against 80, a 5090 237
    against 209. Their ceilings are those measurements, not a cap at 1.0 of the peak, and
    above the A100's 0.88; data-centre parts hold their rated clock or less."""
    types = catalog()
    assert types["rtx3090"].matmul_efficiency == pytest.approx(76.58 / 71 / 0.999, abs=0.01)
    assert types["rtx3090"].matmul_efficiency > types["a100-80g-sxm"].matmul_efficiency
    assert types["t4"].matmul_efficiency < 0.7  # the 70 W T4: 42 of 65 TFLOPS


def test_every_gpu_ceiling_names_its_measurement_or_its_measured_sibling():
    for name, device in catalog().items():
        if device.is_cpu:
            continue
        source = source_of(device, "matmul_efficiency")
        assert "TFLOPS" in source or source.startswith("derived: "), (name, source)


def test_small_gemms_are_memory_bound():
    big = gemm.gemm_time_s(4096, 4096, 4096, 300e12, 2e12, 2)
    thin = gemm.gemm_time_s(1, 4096, 4096, 300e12, 2e12, 2)
    assert big == pytest.approx(2 * 4096**3 / 300e12)
    assert thin == pytest.approx(2 * (4096 + 4096 * 4096 + 4096) / (2e12 * 0.8))


def test_a_partial_last_wave_idles_the_other_processors():
    # 128 x 128 output tiles, one per streaming multiprocessor per wave
    assert gemm.wave_efficiency(1024, 1024, 64) == 1.0  # 8 x 8 tiles: one full wave of 64
    assert gemm.wave_efficiency(1152, 1024, 64) == pytest.approx(72 / 128)  # 9 x 8: two waves
    assert gemm.wave_efficiency(1152, 1024, 0) == 1.0  # SM count unknown: not modelled
    # compute-bound (2.4 GFLOP against 6.8 MB), so the idle processors show in its time
    assert gemm.gemm_time_s(1152, 1024, 1024, 50e12, 1e12, 2, 64) == pytest.approx(
        2 * 1152 * 1024 * 1024 / (50e12 * 72 / 128))


def test_large_gemms_run_256_by_128_tiles_in_the_orientation_that_wastes_less():
    """NVIDIA's GEMM guide: A100's 108 SMs run one 256 x 128 tile each. A 2048 x 7680 output
    (Megatron's 530B QKV at tp=8, one sequence) is 8 x 60 = 480 such tiles, 5 waves for 4.44
    waves of work; turned 128 x 256 it is 16 x 30 = 480 too: 480 / 540."""
    assert gemm.wave_efficiency(2048, 7680, 108) == pytest.approx(480 / 540)
    # 1792 x 1792: 7 x 14 = 98 tiles of 256 x 128, fewer than 108 SMs: 128 x 128 tiles,
    # 14 x 14 = 196 in two waves of 108
    assert gemm.wave_efficiency(1792, 1792, 108) == pytest.approx(196 / 216)
    # partial edge tiles waste their unused part: 2100 rows are 9 tiles of 256 (2304 rows) by
    # 60 of 128, 540 tiles in exactly 5 waves: 2100 / 2304 of the work is useful
    assert gemm.wave_efficiency(2100, 7680, 108) == pytest.approx(2100 / 2304)


def flash_tflops(device: str, seq: int, head_dim: int, heads: int, causal: bool = False,
                 ) -> tuple[float, float]:
    """Predicted forward and backward TFLOPS of FlashAttention-2 as its benchmark counts
    them (4*b*s^2*heads*d forward, halved when causal; 2.5x that backward), for
    ``16384 / seq`` sequences, as benchmark_flash_attention.py runs them."""
    batch = 16384 // seq
    fraction = gemm.CAUSAL_FRACTION if causal else 1.0
    flops = 4.0 * batch * seq * seq * heads * head_dim * fraction
    traffic = 2 * 4 * batch * seq * heads * head_dim  # Q, K, V read, O written, 16-bit
    forward_s, backward_s = gemm.flash_attention_s(catalog()[device], DType.BF16, flops, traffic,
                                                   seq * fraction)
    return flops / forward_s / 1e12, 2.5 * flops / backward_s / 1e12


def test_flash_attention_on_an_a100_reaches_the_papers_73_and_63_percent():
    """FlashAttention-2 (Dao 2023): forward up to 73% of the A100's 312 TFLOPS, backward up
    to 63%, at head dim 128 and 16k keys per query."""
    forward, backward = flash_tflops("a100-80g-sxm", 16384, 128, 16)
    assert forward == pytest.approx(0.73 * 312, rel=0.03)
    assert backward == pytest.approx(0.63 * 312, rel=0.03)


A5000_HD64 = {  # gpu-mode/ring-attention issue 10: FlashAttention-2, head dim 64, non-causal
    512: (84.08, 52.88), 1024: (81.02, 62.54), 2048: (81.31, 70.07), 4096: (81.69, 74.80),
    8192: (81.86, 77.42)}


@pytest.mark.parametrize("seq", [512, 1024, 2048, 4096])
def test_flash_attentions_backward_slows_at_short_sequences_as_published(seq):
    """The backward's rate at ``seq`` over its rate at 8192, against an RTX A5000's published
    sweep (0.68, 0.81, 0.91, 0.97); the forward stays flat (within 3% there)."""
    forward, backward = flash_tflops("rtx-a5000", seq, 64, 16)
    forward_8k, backward_8k = flash_tflops("rtx-a5000", 8192, 64, 16)
    published, published_8k = A5000_HD64[seq], A5000_HD64[8192]
    assert backward / backward_8k == pytest.approx(published[1] / published_8k[1], rel=0.03)
    assert forward / forward_8k == pytest.approx(published[0] / published_8k[0], rel=0.03)


def test_flash_attention_on_an_rtx_a5000_within_what_its_derived_ceiling_allows():
    """Absolute rates on the A5000 are predicted 7% (forward) and 16% (backward) below the
    published sweep: its GEMM ceiling is derived from the RTX A6000's (no published matmul
    measurement of the A5000), and the pass shares are the A100's."""
    forward, backward = flash_tflops("rtx-a5000", 8192, 64, 16)
    assert forward == pytest.approx(81.86, rel=0.10)
    assert backward == pytest.approx(77.42, rel=0.20)
    assert backward < 77.42 and forward < 81.86


def test_causal_masking_halves_the_keys_and_slows_the_backward_more():
    non_causal = flash_tflops("a100-80g-sxm", 1024, 128, 16)
    causal = flash_tflops("a100-80g-sxm", 1024, 128, 16, causal=True)
    assert causal[0] == pytest.approx(non_causal[0])  # the forward: flat
    assert causal[1] / non_causal[1] == pytest.approx(
        gemm.flash_backward_rolloff(512) / gemm.flash_backward_rolloff(1024))
