"""Check potluck on a machine with NVIDIA GPUs: one GPU in under ten minutes.

    python benchmarks/gpu_check.py [--device NAME] [--out gpu-calibrated.yaml] [--skip-tests]
                                   [--only a,b,...] [--tiny]

Each part is bounded by a timeout, the whole run by ``TOTAL_BUDGET_S`` (plus
``MULTI_BUDGET_S`` where two or more GPUs are visible); it prints what it will run and
its estimated time first. On one GPU:

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
(f) the memory contract: allocated and reserved peaks of plain, host-swap,
    optimizer-offload and full-recomputation plans against ``predict(plan).memory``,
    a table (:mod:`gpu_check_parts.memory_contract`);
(g) swap to host in bf16 against no swap: gradients equal after one step, stashed
    bytes close to the predicted activation bytes (:mod:`gpu_check_parts.numerics`);
(h) optimizer offload in bf16 and fp16 against plain AdamW after three steps, with
    16-bit device parameters asserted (same module);
(i) (g) and (h) on a tiny model under ``TORCH_CUDA_SANITIZER=1``, in a subprocess
    (:mod:`gpu_check_parts.sanitizer`);
(j) one step of four Llama-7B-wide blocks at sequence 4096 as MFU
    (:mod:`gpu_check_parts.mfu`).

(e) where ``torch.cuda.device_count()`` is 2 or more, the multi-rank cases of
:mod:`gpu_check_parts.multi`, two at a time on disjoint GPUs, each in its own process
with a 60 s limit and NCCL's flight recorder on, in FP32 against one GPU's losses within
1e-4: pp=2, dp=2, ZeRO-1/2, tp=2 (and with TP overlap), EP=2 on a tiny MoE, peer swap,
the priority schedule, a rank killed mid-step, a mixed-TP pipeline, and where 4 GPUs
are visible pp=4 with split channels under 1F1B, interleaved and zero bubble, and
dp2 x tp2 ZeRO-3 with its memory check; then a dp=2 run checkpointed halfway and
resumed by ``potluck train --resume`` with a one-GPU plan in a process that sees one GPU.
Cases that need more GPUs than are visible are skipped, and the output says why.

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
from dataclasses import dataclass
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # the parts' package beside it
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_parts import mfu, numerics, sanitizer  # noqa: E402
from gpu_check_parts.common import (  # noqa: E402
    Deadline,
    Outcome,
    check_model,
    gpus_cluster,
    one_gpu_cluster,
    run_on_gpus,
    small_llama,
)
from gpu_check_parts.memory_contract import (  # noqa: E402
    MEMORY_CASES,
    MEMORY_TIMEOUT_S,
    measure_case,
    memory_table,
)
from gpu_check_parts.multi import (  # noqa: E402
    ALL_CASES,
    MULTI_CASES,
    MULTI_GPUS,
    MULTI_LR,
    MULTI_STEPS,
    REFERENCE_CASE,
    RESUME_CASE,
    available_gpus,
    case_outcome,
    losses_match,
    multi_estimate_s,
    multi_options,
    multi_plan,
    pair_rounds,
    run_case,
    run_rounds,
)

__all__ = ["Deadline", "Outcome", "MULTI_CASES", "REFERENCE_CASE", "check_model", "gpus_cluster",
           "losses_match", "multi_plan", "small_llama"]

REPO = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 600.0  # the one-GPU parts: under ten minutes
MULTI_BUDGET_S = 420.0  # the multi-GPU rounds and the resume, where two or more GPUs are seen
TESTS_TIMEOUT_S = 120.0
TRAIN_TIMEOUT_S = 60.0  # one dtype's short run (process start included)
PLAN_TIMEOUT_S = 60.0  # one measured plan
# each part's expected seconds, by its letter (e: the resume; its rounds are counted apart)
ESTIMATE_S = {"a": 45, "b": 3 * 15, "c": 4 * 20, "d": 15, "f": 4 * 20, "g": 30, "h": 2 * 30,
              "i": 100, "j": 30, "e": 40}
PARTS = tuple(ESTIMATE_S)
TRAIN_DTYPES = ("bf16", "fp16", "tf32")
TRAIN_STEPS = 12
PLAN_STEPS = 6
WARMUP_STEPS = 2
MATMUL_BUDGET_S = 1.0  # seconds of matmul timing per dtype (as `potluck profile --budget`)
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "amd", "radeon"}


class NoGpu(Exception):
    """No CUDA GPU, or one potluck cannot name: the script's one line and exit code 2."""


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


def loss_falls(losses: list[float]) -> tuple[bool, str]:
    """Every loss finite and the last three steps' mean below the first three's."""
    if not losses or not all(math.isfinite(x) for x in losses):
        return False, f"non-finite loss: {losses}"
    first, last = statistics.fmean(losses[:3]), statistics.fmean(losses[-3:])
    return last < first, f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps"


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
    from potluck.planner.gemm import peak_flops
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


def multi_rank_skip_reason(gpu_count: int) -> str | None:
    """Why the multi-rank part does not run here (None: it runs)."""
    if gpu_count >= MULTI_GPUS:
        return None
    return (f"skipped: {gpu_count} GPU{'' if gpu_count == 1 else 's'} visible "
            f"(torch.cuda.device_count()), the multi-rank part needs {MULTI_GPUS}")


def run_losses(plan, options, timeout_s: float) -> list[float]:
    """Rank 0's losses of ``plan`` trained through potluck's runtime on this machine."""
    history = run_on_gpus(plan, options, timeout_s)
    return [m.loss for m in history]


def one_visible_gpu(visible: str | None, gpu_count: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` that leaves one GPU, the last one this process sees
    (not GPU 0, which rank 0 saved from), by its nvidia-smi number as the variable lists it."""
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
    return entries[-1] if entries else str(gpu_count - 1)


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
    """Part (e): the cases of :mod:`gpu_check_parts.multi` in rounds of two on disjoint GPUs,
    then the resume; on a machine with fewer than two GPUs, one line saying why it was
    skipped."""
    import tempfile

    reason = multi_rank_skip_reason(gpu_count)
    if reason is not None:
        print(f"[e: multi-rank] {reason}", flush=True)
        return []
    rounds, skipped = multi_rounds(gpu_count)
    directory = Path(tempfile.mkdtemp(prefix="gpu-check-multi-"))
    print(f"[e: multi-rank] started: {len(rounds)} rounds, each case's output and NCCL flight "
          f"recorder dumps in {directory}", flush=True)
    found = run_rounds(device, rounds, directory, deadline.timeout_s(MULTI_BUDGET_S))
    outcomes = [case_outcome(a.case, found) for placed in rounds for a in placed]
    outcomes += [Outcome(case.name, True, why) for case, why in skipped]
    for o in outcomes:
        print(f"[e: multi-rank] {'ok' if o.ok else 'FAILED'} {o.name}: {o.detail}", flush=True)
    reference = found.get(REFERENCE_CASE.key, {}).get("losses")
    if reference:
        outcomes += _part("e: multi-rank", deadline, 120.0,
                          lambda t: resume_with_fewer_gpus(device, reference, t))
    return outcomes


def multi_module():
    """:mod:`gpu_check_parts.multi` (the tests reach the parts through this script)."""
    from gpu_check_parts import multi

    return multi


def multi_rounds(gpu_count: int):
    """The rounds of (e)'s cases on this process's GPUs, and the cases skipped with why."""
    return pair_rounds(ALL_CASES, available_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                 gpu_count))


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


def run_checks(device: str, out: Path, parts: tuple[str, ...], tiny: bool = False,
               gpu_count: int = 1) -> list[Outcome]:
    deadline = Deadline(time.monotonic() + budget_s(parts, gpu_count))
    outcomes: list[Outcome] = []
    if "a" in parts:
        outcomes += _part("a: gpu tests", deadline, TESTS_TIMEOUT_S, run_gpu_tests)
    measured: list = []

    def measure(_timeout_s: float) -> Outcome:
        measured.append(measure_device_figures(device, out))
        return Outcome("device figures", True, f"written to {out}")

    if "d" in parts:
        outcomes += _part("d: device figures", deadline, 30.0, measure)
    for dtype in TRAIN_DTYPES if "b" in parts else ():
        outcomes += _part(f"b: train {dtype}", deadline, TRAIN_TIMEOUT_S,
                          lambda t, dtype=dtype: train_dtype(device, dtype, t))
    timings: list[PlanTiming] = []

    def timed(case: PlanCase, timeout_s: float) -> Outcome:
        timings.append(time_plan(device, case, out if measured else None, timeout_s))
        t = timings[-1]
        return Outcome(f"{case.dtype} mbs={case.micro_batch} recompute={case.recompute}", True,
                       f"measured {t.measured_s:.4f} s, predicted {t.predicted_s:.4f} s")

    for case in PLAN_CASES if "c" in parts else ():
        outcomes += _part("c: step time", deadline, PLAN_TIMEOUT_S, lambda t, c=case: timed(c, t))
    memory_rows: list = []
    for case in MEMORY_CASES if "f" in parts else ():
        outcomes += _part("f: memory", deadline, MEMORY_TIMEOUT_S,
                          lambda t, c=case: measure_case(device, c, t, memory_rows))
    shape = numerics.tiny_shape() if tiny else numerics.check_shape()
    for label, part_s, body in numerics.parts(shape):
        if label[0] in parts:
            outcomes += _part(label, deadline, part_s, lambda t, b=body: b(device, t))
    if "i" in parts:
        outcomes += _part("i: sanitizer", deadline, sanitizer.SANITIZER_TIMEOUT_S,
                          lambda t: sanitizer.run_sanitized(device, t))
    if "j" in parts:
        outcomes += _part("j: mfu", deadline, mfu.MFU_TIMEOUT_S, lambda t: mfu.run_mfu(device, t))
    if "e" in parts:
        outcomes += run_multi_rank(device, deadline, gpu_count)
    if measured:
        print("\n" + figures_table(device, measured[0]))
    if timings:
        print("\n" + timing_table(device, timings))
    if memory_rows:
        print("\n" + memory_table(memory_rows))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="catalog name of this GPU (default: from its name)")
    parser.add_argument("--out", type=Path, default=Path("gpu-calibrated.yaml"),
                        help="cluster file to write with the measured calibration")
    parser.add_argument("--skip-tests", action="store_true", help="skip part (a)")
    parser.add_argument("--only", help="run only these parts, such as g,h (default: all)")
    parser.add_argument("--tiny", action="store_true", help="(g) and (h) on a tiny model")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one multi-GPU case (its process)
    parser.add_argument("--gpus", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from potluck.errors import ConfigError

    if args.case:
        return run_case(args.device, args.case, [int(g) for g in args.gpus.split(",")],
                        args.result)
    try:
        parts = selected_parts(args.only, args.skip_tests)
        device = detect_device(args.device)
    except (NoGpu, ConfigError) as err:
        print(err, file=sys.stderr)
        return 2
    gpu_count = torch.cuda.device_count()
    skipped = multi_rank_skip_reason(gpu_count) if "e" in parts else None
    print(f"gpu_check on {torch.cuda.get_device_name(0)} as catalog {device!r}:", flush=True)
    print("\n".join(schedule_lines(parts, gpu_count)), flush=True)
    outcomes = run_checks(device, args.out, parts, args.tiny, gpu_count)
    print("\n" + summary_line(outcomes, skipped))
    return 1 if any(not o.ok for o in outcomes) else 0


def selected_parts(only: str | None, skip_tests: bool) -> tuple[str, ...]:
    """The parts to run, in :data:`PARTS`' order; a ConfigError for a letter there is not."""
    from potluck.errors import ConfigError

    chosen = set(PARTS) if not only else {p.strip() for p in only.split(",") if p.strip()}
    unknown = sorted(chosen - set(PARTS))
    if unknown:
        raise ConfigError(f"--only {only}: no part {', '.join(unknown)}; the parts are "
                          f"{','.join(sorted(PARTS))}")
    return tuple(p for p in PARTS if p in chosen and not (p == "a" and skip_tests))


def budget_s(parts: tuple[str, ...], gpu_count: int) -> float:
    """The whole run's limit: the one-GPU parts', and the multi-GPU part's where it runs."""
    multi = "e" in parts and multi_rank_skip_reason(gpu_count) is None
    return TOTAL_BUDGET_S + (MULTI_BUDGET_S if multi else 0.0)


def estimate_s(parts: tuple[str, ...], rounds: list | None = None) -> int:
    """The check's expected duration: the estimates of the parts that run, and of (e)'s
    rounds (None: (e) does not run)."""
    one_gpu = sum(ESTIMATE_S[p] for p in parts if p != "e")
    multi = ESTIMATE_S["e"] + multi_estimate_s(rounds) if "e" in parts and rounds else 0
    return int(one_gpu + multi)


def schedule_lines(parts: tuple[str, ...], gpu_count: int) -> list[str]:
    """What the run will do and how long it should take, before it starts."""
    rounds, skipped = multi_rounds(gpu_count) if gpu_count >= MULTI_GPUS else (None, [])
    lines = [f"  about {estimate_s(parts, rounds)} s, at most {budget_s(parts, gpu_count):.0f} s; "
             f"parts {','.join(parts)}:"]
    lines += [f"  ({p}) about {ESTIMATE_S[p]} s" for p in parts if p != "e"]
    if "e" in parts and rounds is None:
        lines.append(f"  (e) {multi_rank_skip_reason(gpu_count)}")
    elif "e" in parts:
        for k, placed in enumerate(rounds):
            lines.append(f"  (e) round {k + 1}: " + "; ".join(
                f"{a.case.key} on GPUs {','.join(map(str, a.gpus))}" for a in placed))
        lines += [f"  (e) {case.key} {why}" for case, why in skipped]
    return lines


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
