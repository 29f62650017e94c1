"""potluck's predictions against published iteration times of other frameworks' runs.

Each validation set (``SETS``) is a CSV of measured runs under ``benchmarks/data/`` (one
layout per line: tp, pp, dp, micro-batch size, global batch, sequence length and the
measured seconds per iteration; the format ``potluck calibrate --measured`` reads), the
cluster file the runs were measured on, the model, and how the framework executes a step.
A set of several model sizes names each block's model in the CSV: a ``# model: FILE`` line
holds for the runs below it (``potluck calibrate --measured`` reads it as a comment).
``benchmarks/data/README.md`` names the source of every number.

For every run potluck plans the run's pinned layout (``top_k=1``) and predicts its
iteration time; per set it reports the mean absolute percentage error (MAPE) and
Spearman's rank correlation between predicted and measured times (does potluck order the
layouts as the measurements do?), and every run potluck refuses, with the reason.

After calibration: where ``potluck.api.calibrate_measured`` exists, each set is also
calibrated on ``--calibrate-on K`` of its runs (spread over the file) and the other runs
are predicted with the calibrated cluster file. The fit sees the runs as the
uncalibrated predictions do: the cluster file gets the framework's traits as its
``execution:`` section, and each run the schedule it is predicted with.

Usage: python benchmarks/validation.py [--set NAME] [--rows] [--pairs] [--megatron]
       [--calibrate-on K]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import yaml

from potluck import api
from potluck.calibrate.measured.runs import MeasuredRun, read_runs
from potluck.calibrate.measured.stats import mape, spearman
from potluck.cluster.execution import preset
from potluck.cluster.spec import ClusterSpec
from potluck.errors import PotluckError
from potluck.model.counts import Recompute
from potluck.planner.search import search
from potluck.plans import Execution, Placement, TimeBreakdown
from potluck.schedules import Schedule

DATA = Path(__file__).parent / "data"

# How each framework ran its published steps: an execution preset and the traits in which
# these runs differ from it (the presets are potluck's `--execution` names). Every one of
# them places ranks in Megatron-LM's and DeepSpeed's fixed order over the hostfile
# (tensor-parallel rank fastest, then data-parallel, then pipeline) and splits the blocks
# evenly: `placement: rank-order` (potluck.plans.Placement), the cluster files listing the
# machines in launch order.
RANK_ORDER = {"placement": Placement.RANK_ORDER}
FRAMEWORKS: dict[str, tuple[str, dict[str, object]]] = {
    # DeepSpeed's pipeline engine over Megatron-LM v1.1.5 (2020) as AMP ran it, with
    # "fp32_allreduce": true in AMP's examples/ds_config.json: FP32 gradients on the wire.
    # AMP's trials ran DeepSpeed's default rank order (het_cluster_results.txt: rank map
    # "None", machine i holding ranks 4i..4i+3) with AMP's own layer partition, within a
    # block or two of even (e.g. [5, 7, 6, 6] blocks for pp=4).
    "deepspeed": ("deepspeed", {"grad_reduce_bytes": 4, **RANK_ORDER}),
    # BigScience's Megatron-DeepSpeed (2021-22): Megatron's fused softmax and bias-GeLU kernels,
    # attention scores in memory, DeepSpeed's pipeline engine (gradients reduced after the
    # last micro-batch, blocking sends), fp16/bf16 weights with FP32 masters; DeepSpeed's
    # ZeRO-1 reduces the gradients in the 16-bit training dtype (communication_data_type's
    # default). ZeRO-1 itself is the CSV's zero1 column.
    # DeepSpeed's engine, not Megatron's main_grad hook, accumulates the gradients: as the
    # deepspeed preset counts them.
    "megatron-deepspeed": ("megatron-lm-2021", {
        "grad_reduce_bytes": 2,
        "grad_accumulation_bytes": preset("deepspeed").grad_accumulation_bytes, **RANK_ORDER}),
    # Sailor's Megatron-DeepSpeed fork (2024-25) training in FP32: no fused softmax (it needs
    # 16-bit inputs), no flash attention, DeepSpeed's engine with ZeRO stage 0 (FP32
    # gradients all-reduced after the last micro-batch), blocking pipeline sends; 16 bytes of
    # model state per parameter, as fp32_params=False counts.
    "megatron-deepspeed-fp32": ("deepspeed", {"grad_reduce_bytes": 4, **RANK_ORDER}),
    # Megatron-LM at commit 8aa4619 (2021-03) as DLPerf ran it with --fp16: SC'21's traits (fused
    # softmax and bias-GeLU, scores in memory, blocking batch_isend_irecv followed by
    # torch.cuda.synchronize, the local DDP's all-reduce after the backward pass) but no main_grad
    # buffer yet: each micro-batch's gradient accumulates in the fp16 .grad (read 2 + 2, write 2
    # bytes) and is all-reduced in fp16 (--fp32-allreduce not given; megatron/model/distributed.py).
    "megatron-lm-2021-03": ("megatron-lm-2021", {
        "fp32_main_grads": False, "grad_reduce_bytes": 2,
        "grad_accumulation_bytes": preset("deepspeed").grad_accumulation_bytes}),
    # NeMo 24.05 (Megatron-Core with Transformer Engine) as NVIDIA's dgxc-benchmarking ran it in
    # BF16: today's Megatron traits (fused kernels, flash attention, overlapped gradient reduction
    # and interleaved sends), but apex's distributed_fused_adam with grad_sync_dtype bf16 keeps the
    # gradients in a bf16 buffer (DistributedFusedAdam._grad_buffer, dtype grad_sync_dtype) that the
    # weight-gradient GEMMs accumulate into (2 + 2 + 2 bytes) and reduces them in bf16.
    "nemo-2024": ("megatron-lm", {"fp32_main_grads": False, "grad_reduce_bytes": 2,
                                  "grad_accumulation_bytes": 6.0}),
    # llm-foundry's MPT on Composer's FSDP, mixed_precision PURE (bf16 gather and
    # reduce-scatter): the fsdp preset as it is.
    "llm-foundry": ("fsdp", {}),
    # the same with mixed_precision DEFAULT: bf16 gather, FP32 reduce-scatter (Composer's
    # get_mixed_precision from 0.16.4, commit d745fcb: reduce_dtype = torch.float32).
    "llm-foundry-default": ("fsdp", {"grad_reduce_bytes": 4}),
    # Megatron-LM of 2022 as Yuan et al. ran it (DS3Lab/Decentralized_FM_alpha): SC'21's
    # traits (blocking sends, gradients all-reduced after the backward pass, --DDP-impl local),
    # but --fp16 without --accumulate-allreduce-grads-in-fp32: main_grad and the all-reduce in
    # fp16 (megatron/arguments.py forces FP32 only for bf16), each micro-batch's gradient added
    # into it in fp16 (read 2 + 2, write 2 bytes per parameter).
    "megatron-lm-fp16": ("megatron-lm-2021", {"fp32_main_grads": False, "grad_reduce_bytes": 2,
                                              "grad_accumulation_bytes": 6.0}),
}


def execution(framework: str) -> Execution:
    """The execution traits of ``framework`` (a key of ``FRAMEWORKS``)."""
    name, overrides = FRAMEWORKS[framework]
    return replace(preset(name), **overrides)


@dataclass(frozen=True)
class ValidationSet:
    """Published runs of one model on one cluster, and where they come from."""

    name: str
    runs: str  # CSV under benchmarks/data
    cluster: str  # cluster file under benchmarks/data
    model: str  # a preset name or a config.json under benchmarks/data
    framework: str  # a key of FRAMEWORKS
    source: str  # paper and table, or repository file and commit (details in data/README.md)

    def model_ref(self, run: MeasuredRun | None = None) -> str:
        """The model of ``run`` (its block's ``# model:`` line), else of the set."""
        name = model_lines(self.runs).get(run.line, self.model) if run else self.model
        return str(DATA / name) if name.endswith(".json") else name


@functools.cache
def model_lines(runs: str) -> dict[int, str]:
    """Line number -> the model a ``# model: FILE`` line above it names, for a CSV under
    ``benchmarks/data`` (lines before any such line are absent: the set's model)."""
    models, current = {}, None
    for number, line in enumerate((DATA / runs).read_text().splitlines(), 1):
        text = line.strip()
        if text.startswith("# model:"):
            current = text.split(":", 1)[1].strip()
        elif current and text and not text.startswith("#"):
            models[number] = current
    return models


SETS: tuple[ValidationSet, ...] = (
    ValidationSet("amp-t4", "amp_t4_16.csv", "amp_t4_16.yaml", "amp_gpt2_345m.json", "deepspeed",
                  "AMP (Li et al., NeurIPS'22), DachengLi1/AMP src/results/homogeneous_results.txt"),
    ValidationSet("amp-v100-t4", "amp_v100_t4_16.csv", "amp_v100_t4_16.yaml",
                  "amp_gpt2_345m.json", "deepspeed",
                  "AMP (Li et al., NeurIPS'22), DachengLi1/AMP src/results/het_cluster_results.txt"),
    ValidationSet("bigscience-v100-32g", "bigscience_1b3_v100_32g.csv", "bigscience_v100_32g.yaml",
                  "bigscience_1b3.json", "megatron-deepspeed",
                  "BigScience 1B3 tune-up, bigscience-workshop/bigscience experiments/tr3m-1B3.md"),
    ValidationSet("bigscience-v100-16g", "bigscience_1b3_v100_16g.csv", "bigscience_v100_16g.yaml",
                  "bigscience_1b3.json", "megatron-deepspeed",
                  "BigScience 1B3 tune-up, bigscience-workshop/bigscience experiments/tr3m-1B3.md"),
    ValidationSet("bigscience-a100", "bigscience_181b_a100.csv", "bigscience_a100_80g.yaml",
                  "bigscience_181b.json", "megatron-deepspeed",
                  "BLOOM 48-node tune-up, bigscience-workshop/bigscience tr11 chronicles-prequel.md"),
    ValidationSet("sailor-gh200", "sailor_opt350_gh200.csv", "sailor_gh200_clariden.yaml",
                  "sailor_opt_350m.json", "megatron-deepspeed-fp32",
                  "Sailor (Strati et al., SOSP'25) Fig. 5b runs, eth-easl/sailor validation/clariden"),
    *(ValidationSet(f"dlperf-v100-h{hidden}", f"dlperf_megatron_h{hidden}_v100.csv",
                    "dlperf_v100_4x8.yaml", f"dlperf_gpt_h{hidden}_l{layers}.json",
                    "megatron-lm-2021-03",
                    "OneFlow DLPerf's Megatron-LM (8aa4619) runs on 4 x 8 V100 16GB, IB 100 Gb/s, "
                    "Oneflow-Inc/DLPerf Megatron-LM/README.md")
      for hidden, layers in ((1536, 16), (2304, 24))),
    ValidationSet("nemo-gpt3-175b-h100", "nemo_gpt3_175b_h100.csv", "eos_dgx_h100.yaml",
                  "nemo_gpt3_175b.json", "nemo-2024",
                  "NeMo 24.05 GPT-3 175B BF16 on 128-2048 H100s (EOS), NVIDIA/dgxc-benchmarking "
                  "v24.11.1 nemo_megatron/README_175b.md"),
    ValidationSet("llmfoundry-a100-40g", "llmfoundry_a100_40g.csv", "llmfoundry_a100_40g.yaml",
                  "mpt_7b.json", "llm-foundry",
                  "llm-foundry MPT throughput table (A100 40GB), mosaicml/llm-foundry "
                  "scripts/train/benchmarking/README.md"),
    ValidationSet("llmfoundry-a100-80g-pure", "llmfoundry_a100_80g_pure.csv",
                  "llmfoundry_a100_80g.yaml", "mpt_7b.json", "llm-foundry",
                  "llm-foundry MPT throughput table (A100 80GB, 2023-06), mosaicml/llm-foundry "
                  "scripts/train/benchmarking/README.md"),
    ValidationSet("llmfoundry-a100-80g", "llmfoundry_a100_80g.csv", "llmfoundry_a100_80g.yaml",
                  "mpt_7b.json", "llm-foundry-default",
                  "llm-foundry MPT throughput table (A100 80GB, 2023-10), mosaicml/llm-foundry "
                  "scripts/train/benchmarking/README.md"),
    *(ValidationSet(f"dtfm-p3-l{layers}", f"dtfm_megatron_l{layers}_p3_16x.csv",
                    "dtfm_p3_16xlarge.yaml", f"dtfm_gpt_xl_l{layers}.json", "megatron-lm-fp16",
                    "Yuan et al. (NeurIPS'22) Megatron baselines, case 1: 8 p3.16xlarge, 25 Gb/s, "
                    "DS3Lab/Decentralized_FM_alpha results/NeurIPS2022_submission.md")
      for layers in (24, 32, 40)),
    ValidationSet("dtfm-spot-l24", "dtfm_megatron_l24_p3_spot.csv", "dtfm_p3_spot.yaml",
                  "dtfm_gpt_xl_l24.json", "megatron-lm-fp16",
                  "Yuan et al. (NeurIPS'22) Megatron baselines, case 2: 8 p3.8xlarge + 32 "
                  "p3.2xlarge, 10 Gb/s, DS3Lab/Decentralized_FM_alpha NeurIPS2022_submission.md"),
)


def read_set_runs(vset: ValidationSet) -> tuple[MeasuredRun, ...]:
    """The runs of a set's CSV, read and checked as ``potluck calibrate --measured`` reads them."""
    spec = api.as_cluster(DATA / vset.cluster)
    return read_runs(DATA / vset.runs, {group.name: group.num_gpus for group in spec.nodes})


def layout(run: MeasuredRun) -> str:
    """``tp/pp/dp µb<micro-batch size>``: a run's layout in the tables."""
    return f"{run.tp}/{run.pp}/{run.dp} µb{run.micro_batch_size}"


@dataclass(frozen=True)
class Outcome:
    """potluck's prediction for one run, or why it refused the run."""

    run: MeasuredRun
    predicted_s: float | None
    refusal: str = ""
    schedule: Schedule | None = None  # the schedule predicted, where it differs from the run's
    breakdown: TimeBreakdown | None = None  # where potluck's predicted time goes

    @property
    def error(self) -> float:
        assert self.predicted_s is not None
        return (self.predicted_s - self.run.iteration_time_s) / self.run.iteration_time_s


def predict_run(vset: ValidationSet, run: MeasuredRun, spec: ClusterSpec | None = None,
                traits: Execution | None = None) -> Outcome:
    """Plan ``run``'s pinned layout on the set's cluster (or ``spec``) and predict it."""
    schedule = timeline_schedule(run)
    options = replace(run.options(), schedule=schedule)
    shape = run.shape(traits or execution(vset.framework))
    spec = spec or api.as_cluster(DATA / vset.cluster)
    try:
        plan = search(spec, api.as_model(vset.model_ref(run)), shape, options).best
    except PotluckError as err:
        return Outcome(run, None, str(err).splitlines()[0])
    changed = schedule if schedule is not run.schedule else None
    return Outcome(run, plan.prediction.iteration_time_s, schedule=changed,
                   breakdown=plan.prediction.breakdown)


def timeline_schedule(run: MeasuredRun) -> Schedule:
    """The run's schedule, or GPipe for a 1F1B pipeline with fewer micro-batches than stages.

    DeepSpeed's and Megatron's 1F1B run such a pipeline (every stage does all its forward
    passes before its first backward: GPipe's timeline and memory); torch's 1F1B class, and
    so potluck's planner, refuses it.
    """
    if run.schedule is Schedule.ONE_F_ONE_B and micro_batches(run) < run.pp:
        return Schedule.GPIPE
    return run.schedule


def outcome_mape(outcomes: list[Outcome]) -> float:
    return mape([o.predicted_s for o in outcomes], [o.run.iteration_time_s for o in outcomes])


def summary(outcomes: list[Outcome]) -> tuple[int, float, float, float]:
    """(runs predicted, MAPE, Spearman, median signed error) of the predicted runs."""
    done = [o for o in outcomes if o.predicted_s is not None]
    if len(done) < 2:
        return len(done), float("nan"), float("nan"), float("nan")
    errors = sorted(o.error for o in done)
    rho = spearman([o.predicted_s for o in done], [o.run.iteration_time_s for o in done])
    return (len(done), outcome_mape(done), float("nan") if rho is None else rho,
            errors[len(errors) // 2])


def print_rows(vset: ValidationSet, outcomes: list[Outcome]) -> None:
    print(f"\n### {vset.name}: {vset.source}\n")
    print("| line | tp/pp/dp µbatch | measured s | potluck s | error | potluck: compute / bubble / "
          "tp / pp / dp / optimizer s |")
    print("|---:|---|---:|---:|---:|---|")
    for o in outcomes:
        if o.predicted_s is None:
            print(f"| {o.run.line} | {layout(o.run)} | {o.run.iteration_time_s:.3g} | refused | "
                  f"| {o.refusal} |")
        else:
            note = f" ({o.schedule.value}: fewer micro-batches than stages)" if o.schedule else ""
            print(f"| {o.run.line} | {layout(o.run)} | {o.run.iteration_time_s:.3g} | "
                  f"{o.predicted_s:.3g}{note} | {o.error:+.0%} | {parts(o.breakdown)} |")


def parts(breakdown: TimeBreakdown | None) -> str:
    if breakdown is None:
        return ""
    return " / ".join(f"{getattr(breakdown, name):.3g}" for name in (
        "compute_s", "bubble_s", "tp_s", "pp_s", "dp_s", "optimizer_s"))


def print_summary(results: list[tuple[str, list[Outcome]]], title: str) -> None:
    print(f"\n{title}\n")
    print("| set | runs | predicted | MAPE | Spearman | median error | worst run |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, outcomes in results:
        count, err, rho, median = summary(outcomes)
        done = [o for o in outcomes if o.predicted_s is not None]
        worst = max(done, key=lambda o: abs(o.error), default=None)
        worst_text = f"{layout(worst.run)} {worst.error:+.0%}" if worst else "-"
        print(f"| {name} | {len(outcomes)} | {count} | {err:.0%} | {rho:.2f} | "
              f"{median:+.0%} | {worst_text} |")


def print_refusals(results: list[tuple[str, list[Outcome]]]) -> None:
    """Refused runs, grouped by set and reason (the pins are named in the layouts column)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, outcomes in results:
        for o in outcomes:
            if o.predicted_s is None:
                reason = o.refusal.split("; drop the pins")[0]
                groups.setdefault((name, reason), []).append(layout(o.run))
    if groups:
        print("\n| set | refused layouts (tp/pp/dp µbatch) | potluck's reason |")
        print("|---|---|---|")
        for (name, reason), labels in groups.items():
            print(f"| {name} | {', '.join(labels)} | {reason} |")


def micro_batches(run: MeasuredRun) -> int:
    """Micro-batches each pipeline runs per iteration."""
    return run.global_batch // (run.dp * run.micro_batch_size)


def per_micro_batch_pairs(outcomes: list[Outcome]) -> list[tuple[Outcome, Outcome, float, float]]:
    """Runs without pipeline parallelism that differ only in micro-batch size: (smaller,
    larger, measured and predicted seconds per extra micro-batch).

    Without a pipeline there is no bubble to shrink: the same work split into more
    micro-batches costs what each micro-batch costs on top of its FLOPs (host time, kernel
    launches, per-message latency) plus the lower efficiency of smaller GEMMs.
    """
    groups: dict[tuple, list[Outcome]] = {}
    for o in outcomes:
        r = o.run
        if r.pp > 1:
            continue
        key = (r.tp, r.dp, r.global_batch, r.seq_len, r.dtype, r.recompute)
        groups.setdefault(key, []).append(o)
    pairs = []
    for group in groups.values():
        done = sorted((o for o in group if o.predicted_s is not None),
                      key=lambda o: o.run.micro_batch_size)
        for small, large in zip(done, done[1:], strict=False):
            extra = micro_batches(small.run) - micro_batches(large.run)
            if extra > 0:
                measured = (small.run.iteration_time_s - large.run.iteration_time_s) / extra
                predicted = (small.predicted_s - large.predicted_s) / extra
                pairs.append((small, large, measured, predicted))
    return pairs


def print_pairs(results: list[tuple[str, list[Outcome]]]) -> None:
    rows = [(name, pair) for name, outcomes in results for pair in per_micro_batch_pairs(outcomes)]
    if rows:
        print("\nSeconds per extra micro-batch (no pipeline; same layout and batch):\n")
        print("| set | layout | micro-batches per pipeline | measured s | potluck s |")
        print("|---|---|---|---:|---:|")
        for name, (small, large, measured, predicted) in rows:
            r = small.run
            print(f"| {name} | {r.tp}/{r.pp}/{r.dp} | {micro_batches(large.run)} → "
                  f"{micro_batches(r)} | {measured:.4f} | {predicted:.4f} |")


# ---- after calibration --------------------------------------------------------------------
# Calibrate each set on a few of its runs with `potluck.api.calibrate_measured` (helper C's
# `potluck calibrate --measured`) and predict every run with the calibrated cluster file.


def calibration_rows(runs: list[MeasuredRun], k: int) -> list[MeasuredRun]:
    """``k`` runs spread evenly over the file."""
    step = len(runs) / k
    return [runs[int(i * step)] for i in range(k)]


CSV_COLUMNS = ("tp", "pp", "dp", "micro_batch_size", "global_batch", "seq_len",
               "iteration_time_s", "dtype", "recompute", "schedule", "zero", "zero1",
               "virtual_stages", "partition", "groups")


def write_runs(path: Path, runs: list[MeasuredRun]) -> None:
    """``runs`` as a runs CSV, each with the schedule it is predicted with
    (:func:`timeline_schedule`)."""
    lines = [",".join(CSV_COLUMNS)]
    for run in runs:
        cells = {**{name: getattr(run, name) for name in CSV_COLUMNS},
                 "schedule": timeline_schedule(run), "groups": "+".join(run.groups or ())}
        lines.append(",".join(_cell(cells[name]) for name in CSV_COLUMNS))
    path.write_text("\n".join(lines) + "\n")


def _cell(value: object) -> str:
    if value is None:
        return ""
    return str(value.value if isinstance(value, Enum) else value)


def write_cluster(path: Path, vset: ValidationSet) -> None:
    """The set's cluster file with its framework's traits as the ``execution:`` section
    (what ``calibrate --measured`` plans the runs with, and writes back with the fit)."""
    name, overrides = FRAMEWORKS[vset.framework]
    section = {"preset": name, **{key: _cell(value) if isinstance(value, Enum) else value
                                  for key, value in overrides.items()}}
    path.write_text((DATA / vset.cluster).read_text() + "\n"
                    + yaml.safe_dump({"execution": section}, sort_keys=False))
    assert api.as_cluster(path).execution == execution(vset.framework), vset.framework


@dataclass(frozen=True)
class Calibrated:
    """The runs of a set not calibrated on, before and after calibrating on the others."""

    before: list[Outcome]
    after: list[Outcome]  # on the calibrated file; the same as ``before`` where refused
    fitted: str  # the inputs fitted, or "refused (below)"
    held_out: str  # the fit's held-out MAPE on the runs it saw, and the file's
    refusal: str = ""


def calibrated(vset: ValidationSet, outcomes: list[Outcome], k: int) -> Calibrated:
    """The other runs predicted after calibrating on ``k`` of them (as before where the
    calibration is refused: the user keeps the cluster file as it was)."""
    chosen = calibration_rows([o.run for o in outcomes], k)
    fitted_lines = {r.line for r in chosen}
    before = [o for o in outcomes if o.run.line not in fitted_lines]
    models = {vset.model_ref(r) for r in chosen}
    if len(models) > 1:
        return Calibrated(before, before, "skipped (below)", "-", refusal=(
            f"skipped: the {k} runs are of {len(models)} models "
            f"({', '.join(sorted(Path(m).name for m in models))}), "
            "and a runs CSV calibrates one model's runs"))
    with tempfile.TemporaryDirectory() as tmp:
        subset, cluster = Path(tmp) / "runs.csv", Path(tmp) / "cluster.yaml"
        write_runs(subset, chosen)
        write_cluster(cluster, vset)
        try:
            outcome = api.calibrate_measured(subset, model=api.as_model(vset.model_ref(chosen[0])),
                                             cluster=cluster, out=Path(tmp) / "calibrated.yaml")
            spec = api.as_cluster(Path(tmp) / "calibrated.yaml")
        except PotluckError as err:
            return Calibrated(before, before, "refused (below)", "-",
                              refusal=str(err).splitlines()[0])
    after = [predict_run(vset, o.run, spec, spec.execution) for o in before]
    return Calibrated(before, after, *fitted_columns(outcome))


def fitted_columns(outcome) -> tuple[str, str]:
    """The inputs a calibration fitted, and their held-out MAPE on the runs it was fitted
    to with the cluster file's in brackets."""
    values = ", ".join(f"{p.name} {v * 1e3:.3g} ms" if p.in_seconds else f"{p.name} {v:.3g}"
                       for p, v in outcome.fit.values.items())
    selection = outcome.selection
    if not selection.folds:
        return values, "- (too few runs)"
    return values, (f"{selection.held_out_mape(selection.chosen):.0%} "
                    f"({selection.uncalibrated_mape:.0%})")


def print_calibrated(results: list[tuple[str, Calibrated]], k: int) -> None:
    print(f"\nAfter calibrating on {k} runs per set (the other runs; a refused calibration "
          "keeps the cluster file, so its runs are predicted as before):\n")
    print(f"| set | runs | MAPE before | after | Spearman before | after | worst run after | "
          f"inputs fitted to the {k} | their held-out MAPE (uncalibrated) |")
    print("|---|---:|---:|---:|---:|---:|---|---|---:|")
    for name, result in results:
        _, before, rho_before, _ = summary(result.before)
        count, after, rho_after, _ = summary(result.after)
        done = [o for o in result.after if o.predicted_s is not None]
        worst = max(done, key=lambda o: abs(o.error), default=None)
        worst_text = f"{layout(worst.run)} {worst.error:+.0%}" if worst else "-"
        print(f"| {name} | {count} | {before:.0%} | {after:.0%} | {rho_before:.2f} | "
              f"{rho_after:.2f} | {worst_text} | {result.fitted} | {result.held_out} |")
    for name, result in results:
        if result.refusal:
            verb = "" if result.refusal.startswith("skipped") else "refused: "
            print(f"\n{name}: calibration {verb}{result.refusal}")


def megatron_sc21() -> list[Outcome]:
    """The Megatron-LM runs of ``published_runs.py`` (SC'21 Table 1) as outcomes.

    Their published TFLOP/s become seconds per iteration through the paper's Eq. 3 FLOPs,
    t = F / (TFLOP/s x GPUs); the table gives no micro-batch size, so potluck chooses it
    (the row's label shows potluck's choice).
    """
    import published_runs as megatron

    outcomes = []
    for line, row in enumerate(megatron.SC21_TABLE_1, 1):
        params, heads, hidden, layers, tp, pp, gpus, batch, tflops = row
        schedule = (Schedule.INTERLEAVED if pp > 1 and layers // pp >= 2
                    else Schedule.ONE_F_ONE_B)
        plan = megatron.predict(megatron.gpt(params, heads, hidden, layers), gpus, batch, tp, pp,
                                Recompute.FULL, schedule)
        measured_s = megatron.eq3_flops(batch, layers, hidden) / (tflops * 1e12 * gpus)
        run = MeasuredRun(line, tp, pp, gpus // (tp * pp), plan.pipelines[0].micro_batch_size,
                          batch, megatron.SEQ, measured_s, recompute=Recompute.FULL,
                          schedule=schedule)
        outcomes.append(Outcome(run, plan.prediction.iteration_time_s))
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=[s.name for s in SETS], action="append")
    parser.add_argument("--rows", action="store_true", help="print every run")
    parser.add_argument("--pairs", action="store_true",
                        help="print the time per extra micro-batch of runs that differ only in it")
    parser.add_argument("--megatron", action="store_true",
                        help="also summarise published_runs.py's Megatron-LM runs (SC'21)")
    parser.add_argument("--calibrate-on", type=int, default=4, metavar="K",
                        help="runs per set to calibrate on (0: skip calibration)")
    args = parser.parse_args()
    chosen = [s for s in SETS if not args.set or s.name in args.set]
    results = []
    for vset in chosen:
        runs = read_set_runs(vset)
        outcomes = [predict_run(vset, run) for run in runs]
        results.append((vset, outcomes))
        if args.rows:
            print_rows(vset, outcomes)
    named = [(vset.name, outcomes) for vset, outcomes in results]
    if args.megatron:
        named.append(("megatron-sc21 (µbatch: potluck's)", megatron_sc21()))
    print_summary(named, "Uncalibrated (catalog figures, framework traits only):")
    print_refusals(named)
    if args.pairs:
        print_pairs(named)
    if args.calibrate_on and not hasattr(api, "calibrate_measured"):
        print("\ncalibration: not available (no potluck.api.calibrate_measured)")
    elif args.calibrate_on:
        print_calibrated([(vset.name, calibrated(vset, outcomes, args.calibrate_on))
                          for vset, outcomes in results], args.calibrate_on)


if __name__ == "__main__":
    main()
