"""Check potluck on a machine with NVIDIA GPUs: one GPU in under five minutes, two in eight.

    python benchmarks/gpu_check.py [--device NAME] [--out gpu-calibrated.yaml] [--skip-tests]

Five parts, each bounded by a timeout (the whole run by ``TOTAL_BUDGET_S``):

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
    printed against the catalog's peaks;
(e) where ``torch.cuda.device_count()`` is 2 or more, the multi-rank paths on two
    GPUs (NCCL): pp=2 (sends between pipeline stages), dp=2 (gradient buckets),
    dp=2 with ZeRO-1, tp=2 (a TP mesh), and a dp=2 run checkpointed halfway then
    resumed by ``potluck train --resume`` with a one-GPU plan in a process that
    sees one GPU (``CUDA_VISIBLE_DEVICES``); each trains the small LLaMA a few
    steps on the shipped corpus in bf16 through potluck's runtime, its losses
    within ``MULTI_LOSS_TOLERANCE`` of one GPU's. With one GPU the part is
    skipped, and the output says so and why.

CUDA numbers the GPUs as nvidia-smi and the cluster files do (``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
unless set). The GPU is named by its catalog name (``torch.cuda.get_device_name()`` mapped
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
TOTAL_BUDGET_S = 440.0  # the whole check: under five minutes on one GPU, under eight with (e)
TESTS_TIMEOUT_S = 120.0
TRAIN_TIMEOUT_S = 60.0  # one dtype's short run (process start included)
PLAN_TIMEOUT_S = 60.0  # one measured plan
ESTIMATE_S = {"tests": 45, "train": 3 * 15, "plans": 4 * 20, "measure": 15, "multi": 7 * 20}
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


def run_on_gpus(plan, options, timeout_s: float) -> list:
    """Rank 0's step metrics of ``plan`` trained on this machine's GPUs, spawned ranks (a
    fork of a process that has initialized CUDA cannot use it)."""
    from potluck.runtime.launch.gpus import StartMethod
    from potluck.runtime.launch.local import run_local
    from potluck.runtime.training import train_rank

    return run_local(train_rank, plan.devices, (plan, options), timeout_s=timeout_s,
                     start_method=StartMethod.SPAWN)[0]


def train_dtype(device: str, dtype: str, timeout_s: float) -> Outcome:
    from potluck import api

    plan = api.plan(one_gpu_cluster(device), small_llama(), global_batch=16, seq_len=128,
                    dtype=dtype, tp=1, pp=1, dp=1, micro_batch_size=8, recompute="none").best
    options = api.train_options(steps=TRAIN_STEPS, lr=1e-3, progress=False, timeout_s=timeout_s)
    history = run_on_gpus(plan, options, timeout_s)
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
    from potluck.runtime.options import TrainOptions

    plan = plan_for(one_gpu_cluster(device), case)
    options = TrainOptions(steps=PLAN_STEPS, progress=False, timeout_s=timeout_s)
    history = run_on_gpus(plan, options, timeout_s)
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


# ---- (e) several GPUs: the multi-rank paths ---------------------------------------------------

MULTI_GPUS = 2  # the part runs where torch.cuda.device_count() reaches this
MULTI_STEPS = 4
MULTI_LR = 3e-3
MULTI_DTYPE = "bf16"
MULTI_LOSS_TOLERANCE = 2e-2  # per step, absolute: bf16 autocast summed in other orders (as
# tests/runtime/test_gpu.py allows one GPU's bf16 run against an fp32 reference)
MULTI_TIMEOUT_S = 60.0  # one multi-rank run, process start and NCCL set-up included
MULTI_GLOBAL_BATCH = 8
MULTI_SEQ_LEN = 64
MULTI_MICRO_BATCH = 2


@dataclass(frozen=True)
class MultiCase:
    """One layout of the multi-rank part and what it exercises."""

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero1: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


REFERENCE_CASE = MultiCase("one GPU (the reference)")
MULTI_CASES = (
    MultiCase("pp=2: NCCL sends between pipeline stages", pp=2),
    MultiCase("dp=2: gradient buckets all-reduced over NCCL", dp=2),
    MultiCase("dp=2 ZeRO-1: gradients reduce-scattered, updates all-gathered", dp=2, zero1=True),
    MultiCase("tp=2: a tensor-parallel mesh", tp=2),
)
RESUME_CASE = MultiCase("checkpoint on 2 GPUs, resume where 1 is visible", dp=2)


def multi_rank_skip_reason(gpu_count: int) -> str | None:
    """Why the multi-rank part does not run here (None: it runs)."""
    if gpu_count >= MULTI_GPUS:
        return None
    return (f"skipped: {gpu_count} GPU{'' if gpu_count == 1 else 's'} visible "
            f"(torch.cuda.device_count()), the multi-rank part needs {MULTI_GPUS}")


def gpus_cluster(device: str, count: int):
    from potluck.cluster.spec import parse_cluster

    return parse_cluster(f"nodes:\n  - {{name: gpu, gpu: {device}, gpus_per_node: {count}}}\n",
                         "gpu-check.yaml")


def multi_plan(device: str, case: MultiCase):
    """``case``'s layout of the small LLaMA on ``case.gpus`` GPUs of this type."""
    from potluck import api

    return api.plan(gpus_cluster(device, case.gpus), small_llama(), global_batch=MULTI_GLOBAL_BATCH,
                    seq_len=MULTI_SEQ_LEN, dtype=MULTI_DTYPE, tp=case.tp, pp=case.pp, dp=case.dp,
                    micro_batch_size=MULTI_MICRO_BATCH, recompute="none", zero=int(case.zero1)).best


def multi_options(steps: int, timeout_s: float, **fields):
    from potluck import api

    return api.train_options(steps=steps, lr=MULTI_LR, seed=0, progress=False,
                             timeout_s=timeout_s, **fields)


def run_losses(plan, options, timeout_s: float) -> list[float]:
    """Rank 0's losses of ``plan`` trained through potluck's runtime on this machine."""
    history = run_on_gpus(plan, options, timeout_s)
    return [m.loss for m in history]


def losses_match(reference: list[float], losses: list[float],
                 tolerance: float = MULTI_LOSS_TOLERANCE) -> tuple[bool, str]:
    """Every step's loss finite and within ``tolerance`` of the one-GPU reference's."""
    shown = f"losses {_losses(losses)} against one GPU's {_losses(reference)}"
    if len(losses) != len(reference) or not all(math.isfinite(x) for x in losses):
        return False, shown
    worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    return worst <= tolerance, f"{shown}: largest difference {worst:.4f} (at most {tolerance:g})"


def _losses(losses: list[float]) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in losses) + "]"


def one_visible_gpu(visible: str | None, gpu_count: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` that leaves one GPU, the last one this process sees
    (not GPU 0, which rank 0 saved from), by its nvidia-smi number as the variable lists it."""
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
    return entries[-1] if entries else str(gpu_count - 1)


def train_case(device: str, case: MultiCase, reference: list[float], timeout_s: float) -> Outcome:
    plan = multi_plan(device, case)
    losses = run_losses(plan, multi_options(MULTI_STEPS, timeout_s), timeout_s)
    return Outcome(case.name, *losses_match(reference, losses))


def resume_plan(device: str, gpu: int):
    """The reference case's one-GPU plan moved onto GPU ``gpu`` (nvidia-smi's number) of this
    machine. ``CUDA_VISIBLE_DEVICES=<gpu>`` renumbers that GPU ``cuda:0``, but a plan names a
    GPU by its number on the machine (:func:`potluck.runtime.launch.gpus.cuda_ordinal`): GPU 0
    of a one-GPU cluster is one the variable hides."""
    from potluck.cluster.topology import device_id
    from potluck.runtime.elastic.pool import on_whole_cluster

    plan = multi_plan(device, REFERENCE_CASE)
    machine = gpus_cluster(device, gpu + 1)
    return on_whole_cluster(plan, machine, {plan.devices[0]: device_id("gpu", 0, gpu)})


def resume_command(plan_file: Path, out: Path, timeout_s: float) -> list[str]:
    """``potluck train --resume`` of the run in ``out`` up to ``MULTI_STEPS``, as the
    multi-rank runs train (the shipped corpus, ``MULTI_LR``, seed 0)."""
    return [sys.executable, "-m", "potluck", "train", "--plan", str(plan_file), "--out", str(out),
            "--resume", "--steps", str(MULTI_STEPS), "--lr", str(MULTI_LR), "--seed", "0",
            "--timeout", f"{timeout_s:.0f}"]


def metrics_losses(path: Path) -> list[float]:
    """The loss of every step in a run's ``metrics.jsonl``, by step."""
    import json

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["loss"] for row in sorted(rows, key=lambda row: row["step"])]


def resume_on_one_gpu(plan_file: Path, out: Path, visible: str, timeout_s: float) -> None:
    """Run :func:`resume_command` in a process (and its ranks) that see GPU ``visible`` only."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "CUDA_VISIBLE_DEVICES": visible,
           "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # the variable's numbers as nvidia-smi's
    try:
        done = subprocess.run(resume_command(plan_file, out, timeout_s), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the resumed run did not finish within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        raise RuntimeError(f"the resumed run failed: {lines[-1] if lines else done.returncode}")


def resume_with_fewer_gpus(device: str, reference: list[float], timeout_s: float) -> Outcome:
    """Half the steps on 2 GPUs (dp=2, a checkpoint at the end), the rest resumed by a
    one-GPU plan where only one GPU is visible: the run's losses against the reference."""
    import tempfile

    from potluck.plans import save_plan

    deadline = Deadline(time.monotonic() + timeout_s)
    visible = one_visible_gpu(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as directory:
        out = Path(directory)
        left_s = deadline.timeout_s(timeout_s)
        run_losses(multi_plan(device, RESUME_CASE),
                   multi_options(MULTI_STEPS // 2, left_s, out=out), left_s)
        plan_file = out / "one-gpu-plan.json"
        save_plan(resume_plan(device, int(visible)), plan_file)
        resume_on_one_gpu(plan_file, out, visible, deadline.timeout_s(timeout_s))
        losses = metrics_losses(out / "metrics.jsonl")
    ok, detail = losses_match(reference, losses)
    return Outcome(RESUME_CASE.name, ok, f"resumed with only GPU {visible} visible; {detail}")


def run_multi_rank(device: str, deadline: Deadline, gpu_count: int) -> list[Outcome]:
    """Part (e): each layout trained a few steps against one GPU's losses; on a machine
    with fewer than two GPUs, one line saying why it was skipped."""
    reason = multi_rank_skip_reason(gpu_count)
    if reason is not None:
        print(f"[e: multi-rank] {reason}", flush=True)
        return []
    reference: list[float] = []

    def one_gpu(timeout_s: float) -> Outcome:
        plan = multi_plan(device, REFERENCE_CASE)
        reference.extend(run_losses(plan, multi_options(MULTI_STEPS, timeout_s), timeout_s))
        finite = all(math.isfinite(x) for x in reference)
        return Outcome(REFERENCE_CASE.name, finite, f"losses {_losses(reference)}")

    outcomes = _part("e: multi-rank", deadline, MULTI_TIMEOUT_S, one_gpu)
    if not outcomes[0].ok:
        return outcomes
    for case in MULTI_CASES:
        outcomes += _part("e: multi-rank", deadline, MULTI_TIMEOUT_S,
                          lambda t, c=case: train_case(device, c, reference, t))
    outcomes += _part("e: multi-rank", deadline, 2 * MULTI_TIMEOUT_S,
                      lambda t: resume_with_fewer_gpus(device, reference, t))
    return outcomes


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
    outcomes += run_multi_rank(device, deadline, torch.cuda.device_count())
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
    skipped = multi_rank_skip_reason(torch.cuda.device_count())
    print(f"gpu_check on {torch.cuda.get_device_name(0)} as catalog {device!r}: about "
          f"{estimate_s(args.skip_tests, skipped is None)} s, at most {TOTAL_BUDGET_S:.0f} s "
          f"(parts: tests {TESTS_TIMEOUT_S:.0f} s, each dtype {TRAIN_TIMEOUT_S:.0f} s, each plan "
          f"{PLAN_TIMEOUT_S:.0f} s, each multi-rank run {MULTI_TIMEOUT_S:.0f} s)", flush=True)
    outcomes = run_checks(device, args.out, args.skip_tests)
    print("\n" + summary_line(outcomes, skipped))
    return 1 if any(not o.ok for o in outcomes) else 0


def estimate_s(skip_tests: bool, multi_rank: bool) -> int:
    """The check's expected duration: every part's estimate, the ones that run."""
    skipped = {"tests"} if skip_tests else set()
    if not multi_rank:
        skipped.add("multi")
    return sum(v for k, v in ESTIMATE_S.items() if k not in skipped)


def summary_line(outcomes: list[Outcome], multi_rank_skipped: str | None) -> str:
    """``7 of 8 checks passed; failed: ...`` and, on one GPU, that part (e) did not run."""
    failed = [o for o in outcomes if not o.ok]
    line = f"{len(outcomes) - len(failed)} of {len(outcomes)} checks passed"
    if failed:
        line += f"; failed: {', '.join(o.name for o in failed)}"
    if multi_rank_skipped:
        line += f"; multi-rank part (e) {multi_rank_skipped}"
    return line


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # before CUDA is first used
    sys.exit(main())
