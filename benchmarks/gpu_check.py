"""Check potluck on a machine with one NVIDIA GPU, in under five minutes.

    python benchmarks/gpu_check.py [--device NAME] [--out gpu-calibrated.yaml] [--skip-tests]

Four parts, each bounded by a timeout (the whole run by ``TOTAL_BUDGET_S``):

(a) the GPU-marked tests (``pytest -m gpu`` on the test files that carry the
    marker), in a subprocess;
(b) a small LLaMA, built from its config (no downloads), trained a few steps on
    the shipped corpus in bf16, fp16 and tf32 through potluck's planner and
    runtime: every loss finite, the last steps' mean below the first steps';
(c) the step time of a few one-GPU plans (micro-batch sizes, recomputation,
    dtypes) measured against potluck's prediction for the catalog device this
    GPU is, with the catalog's figures and with the figures part (d) measured:
    a Markdown table;
(d) matmul FLOP/s per dtype (bf16, fp16, tf32, fp32) at the check model's GEMM
    shapes and memory bandwidth, measured with ``potluck profile``'s code, and
    written as a cluster file with a ``calibration:`` section (``--out``),
    printed against the catalog's peaks.

The GPU is named by its catalog name (``torch.cuda.get_device_name()`` mapped
by :func:`catalog_name`; ``--device NAME`` overrides). Without CUDA the script
exits with one line and code 2; a failed check exits 1.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 290.0  # the whole check stays under five minutes
TESTS_TIMEOUT_S = 120.0
TRAIN_TIMEOUT_S = 60.0  # one dtype's short run (process start included)
PLAN_TIMEOUT_S = 60.0  # one measured plan
ESTIMATE_S = {"tests": 45, "train": 3 * 15, "plans": 4 * 20, "measure": 15}
TRAIN_DTYPES = ("bf16", "fp16", "tf32")
TRAIN_STEPS = 12
PLAN_STEPS = 6
WARMUP_STEPS = 2
MATMUL_BUDGET_S = 1.0  # seconds of matmul timing per dtype (as `potluck profile --budget`)
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "amd", "radeon"}


class NoGpu(Exception):
    """No CUDA GPU, or one potluck cannot name: the script's one line and exit code 2."""


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


# ---- naming the GPU ----------------------------------------------------------------------


def catalog_name(device_name: str, memory_bytes: float, known: list[str]) -> str:
    """The catalog name of a GPU torch reports: ``NVIDIA A100-SXM4-80GB`` -> ``a100-80g-sxm``.

    The model word (``a100``) picks the catalog family; the memory (from the name, else
    the device's) and the form factor (``sxm``/``pcie`` in the name, SXM when unsaid)
    pick the entry. Raises :class:`NoGpu` when no family matches.
    """
    words = [w for w in re.split(r"[\s_\-]+", device_name.lower()) if w and w not in _VENDOR_WORDS]
    exact = {k.replace("-", ""): k for k in known}
    if "".join(words) in exact:
        return exact["".join(words)]
    family = next((w for w in words if any(k.startswith(w) for k in known)), None)
    if family is None:
        raise NoGpu(f"cannot tell which catalog GPU {device_name!r} is; pass --device NAME "
                    "(see `potluck catalog`)")
    candidates = sorted(k for k in known if k.startswith(family))
    memory_gb = _memory_gb(words, memory_bytes)
    form = "pcie" if any(w.startswith("pcie") for w in words) else "sxm"
    return max(candidates, key=lambda k: (sum(w in k.split("-") for w in words),
                                          _memory_match(k, memory_gb), form in k, -len(k)))


def _memory_gb(words: list[str], memory_bytes: float) -> float:
    for word in words:
        found = re.fullmatch(r"(\d+)gb?", word)
        if found:
            return float(found.group(1))
    return memory_bytes / 2**30


def _memory_match(name: str, memory_gb: float) -> float:
    """How close the memory in a catalog name (``-80g-``) is to the GPU's (0: unsaid)."""
    found = re.search(r"-(\d+)g(?:-|$)", name)
    return -abs(float(found.group(1)) - memory_gb) if found else -1e9 + 1.0


def detect_device(override: str | None) -> str:
    """This machine's GPU as a catalog name; :class:`NoGpu` without CUDA."""
    from potluck.cluster.catalog import catalog, lookup

    if not torch.cuda.is_available():
        raise NoGpu("gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False); "
                    "run it on a machine with one NVIDIA GPU")
    if override:
        return lookup(override).name
    properties = torch.cuda.get_device_properties(0)
    return catalog_name(properties.name, properties.total_memory, sorted(catalog()))


# ---- (a) the GPU tests ------------------------------------------------------------------


def gpu_test_files(root: Path = REPO / "tests") -> list[Path]:
    """Test files that carry the ``gpu`` marker."""
    return sorted(p for p in root.rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def run_gpu_tests(timeout_s: float) -> Outcome:
    files = gpu_test_files()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
               *map(str, files)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                              env=env)
    except subprocess.TimeoutExpired:
        return Outcome("gpu tests", False, f"did not finish within {timeout_s:.0f} s")
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    summary = lines[-1] if lines else f"exit code {done.returncode}"
    return Outcome("gpu tests", done.returncode == 0, f"{len(files)} files: {summary}")


# ---- (b) a small LLaMA in each dtype -------------------------------------------------------


def small_llama():
    """A small LLaMA over the byte vocabulary (the shipped corpus's tokens)."""
    from potluck.model.spec import PRESETS

    return replace(PRESETS["tiny-llama"], name="llama-256x4", hidden_size=256, ffn_hidden_size=688,
                   num_heads=4, num_kv_heads=2)


def check_model():
    """The model whose step time (c) and GEMMs (d) are measured: LLaMA-2 blocks at width
    2048, four of them, the 32000-token vocabulary (about 340M parameters)."""
    from potluck.model.spec import PRESETS

    return replace(PRESETS["llama2-7b"], name="llama-2048x4", hidden_size=2048,
                   ffn_hidden_size=5632, num_heads=16, num_kv_heads=16, num_layers=4,
                   max_seq_len=2048)


def one_gpu_cluster(device: str, calibrated: Path | None = None):
    from potluck.cluster.spec import load_cluster, parse_cluster

    if calibrated is not None:
        return load_cluster(calibrated)
    return parse_cluster(f"nodes:\n  - {{name: gpu, gpu: {device}, gpus_per_node: 1}}\n",
                         "gpu-check.yaml")


def loss_falls(losses: list[float]) -> tuple[bool, str]:
    """Every loss finite and the last three steps' mean below the first three's."""
    if not losses or not all(math.isfinite(x) for x in losses):
        return False, f"non-finite loss: {losses}"
    first, last = statistics.fmean(losses[:3]), statistics.fmean(losses[-3:])
    return last < first, f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps"


def train_dtype(device: str, dtype: str, timeout_s: float) -> Outcome:
    from potluck import api
    from potluck.runtime.launch.local import run_local
    from potluck.runtime.training import train_rank

    plan = api.plan(one_gpu_cluster(device), small_llama(), global_batch=16, seq_len=128,
                    dtype=dtype, tp=1, pp=1, dp=1, micro_batch_size=8, recompute="none").best
    options = api.train_options(steps=TRAIN_STEPS, lr=1e-3, progress=False, timeout_s=timeout_s)
    history = run_local(train_rank, plan.devices, (plan, options), timeout_s=timeout_s)[0]
    ok, detail = loss_falls([m.loss for m in history])
    return Outcome(f"train {dtype}", ok, detail)


# ---- (c) measured against predicted -------------------------------------------------------


@dataclass(frozen=True)
class PlanCase:
    dtype: str
    micro_batch: int
    recompute: str


PLAN_CASES = (PlanCase("bf16", 1, "none"), PlanCase("bf16", 4, "none"),
              PlanCase("bf16", 4, "full"), PlanCase("tf32", 4, "none"))
PLAN_GLOBAL_BATCH = 8
PLAN_SEQ_LEN = 1024


@dataclass(frozen=True)
class PlanTiming:
    case: PlanCase
    measured_s: float
    predicted_s: float
    calibrated_s: float | None


def plan_for(cluster, case: PlanCase):
    from potluck import api

    return api.plan(cluster, check_model(), global_batch=PLAN_GLOBAL_BATCH, seq_len=PLAN_SEQ_LEN,
                    dtype=case.dtype, tp=1, pp=1, dp=1, micro_batch_size=case.micro_batch,
                    recompute=case.recompute).best


def time_plan(device: str, case: PlanCase, calibrated: Path | None, timeout_s: float) -> PlanTiming:
    """Median step time after warm-up of one plan (random tokens), and its predictions."""
    from potluck.runtime.launch.local import run_local
    from potluck.runtime.options import TrainOptions
    from potluck.runtime.training import train_rank

    plan = plan_for(one_gpu_cluster(device), case)
    options = TrainOptions(steps=PLAN_STEPS, progress=False, timeout_s=timeout_s)
    history = run_local(train_rank, plan.devices, (plan, options), timeout_s=timeout_s)[0]
    measured = statistics.median(m.step_time_s for m in history[WARMUP_STEPS:])
    calibrated_s = None
    if calibrated is not None:
        calibrated_s = plan_for(one_gpu_cluster(device, calibrated), case).prediction.iteration_time_s
    return PlanTiming(case, measured, plan.prediction.iteration_time_s, calibrated_s)


def timing_table(device: str, timings: list[PlanTiming]) -> str:
    """Markdown: one row per plan, measured against predicted (catalog and calibrated)."""
    rows = [f"{check_model().name} on one {device}, global batch {PLAN_GLOBAL_BATCH} x "
            f"{PLAN_SEQ_LEN} tokens", "",
            "| dtype | micro-batch | recompute | measured s | predicted s | error | "
            "calibrated s | error |", "|---|---|---|---|---|---|---|---|"]
    for t in timings:
        calibrated = ("-", "-") if t.calibrated_s is None else (
            f"{t.calibrated_s:.4f}", f"{_error(t.calibrated_s, t.measured_s):+.0%}")
        rows.append(f"| {t.case.dtype} | {t.case.micro_batch} | {t.case.recompute} | "
                    f"{t.measured_s:.4f} | {t.predicted_s:.4f} | "
                    f"{_error(t.predicted_s, t.measured_s):+.0%} | {calibrated[0]} | {calibrated[1]} |")
    return "\n".join(rows)


def _error(predicted_s: float, measured_s: float) -> float:
    return predicted_s / measured_s - 1.0


# ---- (d) device figures -------------------------------------------------------------------


def measure_device_figures(device_name: str, out: Path, device: torch.device | None = None):
    """Matmul FLOP/s per dtype and memory bandwidth of ``device`` (default GPU 0), written
    as a calibrated cluster file at ``out``; returns the measurement."""
    from potluck.plans import DType
    from potluck.profiler.calibration_file import write_calibrated
    from potluck.profiler.compute import (
        DeviceMeasurement,
        block_gemm_shapes,
        matmul_flops,
        measure_device,
    )
    from potluck.profiler.run import ProfileResult
    from potluck.runtime.launch.precision import apply_precision, torch_precision

    device = device or torch.device("cuda", 0)
    measured = measure_device(device, check_model(), ["bf16", "fp16", "fp32"], MATMUL_BUDGET_S)
    apply_precision(torch_precision(DType.TF32))
    try:
        tf32 = matmul_flops(device, torch.float32, block_gemm_shapes(check_model()), MATMUL_BUDGET_S)
    finally:
        apply_precision(torch_precision(DType.FP32))
    flops = {**measured.matmul_flops, "tf32": tf32}
    measurement = DeviceMeasurement(measured.device_name, flops, measured.memory_bandwidth_bytes_per_s)
    write_calibrated(out, ProfileResult([socket.gethostname()], [measurement]), device_name)
    return measurement


def figures_table(device_name: str, measurement) -> str:
    """Markdown: measured matmul TFLOP/s per dtype against the catalog's peak of that dtype."""
    from potluck.cluster.catalog import lookup
    from potluck.errors import ConfigError
    from potluck.planner.compute import peak_flops
    from potluck.plans import DType

    device_type = lookup(device_name)
    rows = [f"{device_name} ({measurement.device_name}): matmul at {check_model().name}'s GEMM shapes",
            "", "| dtype | measured TFLOP/s | catalog peak TFLOP/s | share of peak |", "|---|---|---|---|"]
    for name, flops in measurement.matmul_flops.items():
        try:
            peak = peak_flops(device_type, DType(name))
        except ConfigError:
            peak = 0.0
        share = f"{flops / peak:.0%}" if peak > 0 else "-"
        rows.append(f"| {name} | {flops / 1e12:.1f} | {peak / 1e12:.1f} | {share} |")
    rows.append(f"\nmemory bandwidth: {measurement.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s "
                f"measured, {device_type.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s catalog")
    return "\n".join(rows)


# ---- the run ------------------------------------------------------------------------------


def _part(label: str, deadline: Deadline, part_s: float,
          body: Callable[[float], Outcome | list[Outcome]]) -> list[Outcome]:
    """Run one part with its timeout; an exception is that part's failure, not the script's."""
    started = time.monotonic()
    print(f"[{label}] started", flush=True)
    try:
        result = body(deadline.timeout_s(part_s))
        outcomes = result if isinstance(result, list) else [result]
    except Exception as err:  # noqa: BLE001 - a failed part is reported, the others still run
        outcomes = [Outcome(label, False, f"{type(err).__name__}: {str(err).strip()[:300]}")]
    for o in outcomes:
        print(f"[{label}] {'ok' if o.ok else 'FAILED'} {o.name}: {o.detail} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
    return outcomes


def run_checks(device: str, out: Path, skip_tests: bool) -> list[Outcome]:
    deadline = Deadline(time.monotonic() + TOTAL_BUDGET_S)
    outcomes: list[Outcome] = []
    if not skip_tests:
        outcomes += _part("a: gpu tests", deadline, TESTS_TIMEOUT_S, run_gpu_tests)
    measured: list = []

    def measure(_timeout_s: float) -> Outcome:
        measured.append(measure_device_figures(device, out))
        return Outcome("device figures", True, f"written to {out}")

    outcomes += _part("d: device figures", deadline, 30.0, measure)
    for dtype in TRAIN_DTYPES:
        outcomes += _part(f"b: train {dtype}", deadline, TRAIN_TIMEOUT_S,
                          lambda t, dtype=dtype: train_dtype(device, dtype, t))
    timings: list[PlanTiming] = []

    def timed(case: PlanCase, timeout_s: float) -> Outcome:
        timings.append(time_plan(device, case, out if measured else None, timeout_s))
        t = timings[-1]
        return Outcome(f"{case.dtype} mbs={case.micro_batch} recompute={case.recompute}", True,
                       f"measured {t.measured_s:.4f} s, predicted {t.predicted_s:.4f} s")

    for case in PLAN_CASES:
        outcomes += _part("c: step time", deadline, PLAN_TIMEOUT_S, lambda t, c=case: timed(c, t))
    if measured:
        print("\n" + figures_table(device, measured[0]))
    if timings:
        print("\n" + timing_table(device, timings))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="catalog name of this GPU (default: from its name)")
    parser.add_argument("--out", type=Path, default=Path("gpu-calibrated.yaml"),
                        help="cluster file to write with the measured calibration")
    parser.add_argument("--skip-tests", action="store_true", help="skip part (a)")
    args = parser.parse_args(argv)
    from potluck.errors import ConfigError

    try:
        device = detect_device(args.device)
    except (NoGpu, ConfigError) as err:
        print(err, file=sys.stderr)
        return 2
    estimate = sum(v for k, v in ESTIMATE_S.items() if k != "tests" or not args.skip_tests)
    print(f"gpu_check on {torch.cuda.get_device_name(0)} as catalog {device!r}: about "
          f"{estimate} s, at most {TOTAL_BUDGET_S:.0f} s (parts: tests {TESTS_TIMEOUT_S:.0f} s, "
          f"each dtype {TRAIN_TIMEOUT_S:.0f} s, each plan {PLAN_TIMEOUT_S:.0f} s)", flush=True)
    outcomes = run_checks(device, args.out, args.skip_tests)
    failed = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes) - len(failed)} of {len(outcomes)} checks passed"
          + (f"; failed: {', '.join(o.name for o in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
