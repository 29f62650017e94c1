"""(f) The memory contract on one GPU: measured peaks against the plan's prediction.

A few one-GPU plans of the check model (plain, host swap, optimizer offload, full
recomputation) are trained a few steps through potluck's runtime; each step's memory rows
(:func:`potluck.runtime.loop.trainer.rank_memory_rows`) give the allocator's peak of live
tensors (``device_bytes``) and of its reserve (``reserved_bytes``) per device. Their
largest values over the run are set against ``predict(plan).memory``'s ``total_bytes`` of
that device. The contract holds when the allocated peak is within
``MEMORY_TOLERANCE`` of the prediction (either way: an under-prediction runs out of memory,
a gross over-prediction wastes it) plus ``MEMORY_SLACK_BYTES``, and the reserve exceeds the
prediction by at most ``RESERVED_TOLERANCE`` plus the slack (the cache and fragmentation the
cost model does not count). The slack covers what no formula counts: cuBLAS's workspaces
and the allocator's rounding (512-byte blocks, 2 MB segments). The same check serves the
multi-GPU ZeRO-3 case (:mod:`.multi`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpu_check_parts.common import Outcome, check_model, one_gpu_cluster, run_on_gpus

MEMORY_TOLERANCE = 0.15  # allocated peak against predicted total, relative, either way
RESERVED_TOLERANCE = 0.30  # reserved peak above predicted total, relative
MEMORY_SLACK_BYTES = 128 * 2**20
MEMORY_STEPS = 4
MEMORY_GLOBAL_BATCH = 4
MEMORY_MICRO_BATCH = 2
MEMORY_SEQ_LEN = 1024
MEMORY_TIMEOUT_S = 60.0
GB = 1e9


@dataclass(frozen=True)
class MemoryCase:
    """One memory choice of the check model's one-GPU plan (``api.plan``'s pins)."""

    name: str
    swap: str | None = None
    offload: str | None = None
    recompute: str = "none"


MEMORY_CASES = (MemoryCase("plain"), MemoryCase("swap to host", swap="host"),
                MemoryCase("optimizer offload", offload="optimizer"),
                MemoryCase("full recomputation", recompute="full"))


@dataclass(frozen=True)
class MemoryRow:
    """One device's peaks over a run against its predicted total, in bytes."""

    case: str
    device: str
    predicted_bytes: float
    allocated_bytes: float
    reserved_bytes: float | None  # None: the rank reported no GPU figures


def memory_plan(device: str, case: MemoryCase):
    from potluck import api

    return api.plan(one_gpu_cluster(device), check_model(), global_batch=MEMORY_GLOBAL_BATCH,
                    seq_len=MEMORY_SEQ_LEN, dtype="bf16", tp=1, pp=1, dp=1,
                    micro_batch_size=MEMORY_MICRO_BATCH, recompute=case.recompute,
                    swap=case.swap, offload=case.offload).best


def predicted_totals(plan) -> dict[str, float]:
    """The plan's predicted peak on each device (``predict(plan).memory``), by device id."""
    from potluck.planner.evaluate import predict

    return {m.device: m.total_bytes for m in predict(plan).memory}


def peak_rows(case: str, predicted: Mapping[str, float],
              steps: Iterable[Sequence[Mapping]]) -> list[MemoryRow]:
    """Per device, the largest allocated and reserved bytes over ``steps`` (each step's
    memory rows, as ``StepMetrics.memory``) against ``predicted``."""
    allocated: dict[str, float] = {}
    reserved: dict[str, float | None] = {}
    for rows in steps:
        for row in rows:
            device = row["device"]
            allocated[device] = max(allocated.get(device, 0.0), row["device_bytes"])
            if row.get("reserved_bytes") is None:
                reserved.setdefault(device, None)
            else:
                reserved[device] = max(reserved.get(device) or 0.0, row["reserved_bytes"])
    return [MemoryRow(case, d, predicted.get(d, 0.0), allocated[d], reserved.get(d))
            for d in sorted(allocated)]


def memory_verdict(row: MemoryRow) -> tuple[bool, str]:
    """Whether ``row`` keeps the contract (module docstring), and why not."""
    slack, predicted = MEMORY_SLACK_BYTES, row.predicted_bytes
    if predicted <= 0:
        return False, f"{row.device}: no prediction"
    problems = []
    if abs(row.allocated_bytes - predicted) > MEMORY_TOLERANCE * predicted + slack:
        problems.append(f"allocated {row.allocated_bytes / GB:.2f} GB is "
                        f"{_share(row.allocated_bytes, predicted)} of predicted "
                        f"{predicted / GB:.2f} GB (at most +-{MEMORY_TOLERANCE:.0%})")
    if row.reserved_bytes is None:
        problems.append("no reserved bytes reported (not a GPU rank?)")
    elif row.reserved_bytes > (1 + RESERVED_TOLERANCE) * predicted + slack:
        problems.append(f"reserved {row.reserved_bytes / GB:.2f} GB is "
                        f"{_share(row.reserved_bytes, predicted)} of predicted (at most "
                        f"+{RESERVED_TOLERANCE:.0%})")
    return not problems, "; ".join(problems) or "within the tolerance"


def _share(measured: float, predicted: float) -> str:
    return f"{measured / predicted - 1:+.0%}"


def memory_table(rows: Sequence[MemoryRow]) -> str:
    """Markdown: one row per device and case, measured peaks against predicted."""
    lines = [f"memory contract: allocated within +-{MEMORY_TOLERANCE:.0%}, reserved at most "
             f"+{RESERVED_TOLERANCE:.0%} of predicted, plus {MEMORY_SLACK_BYTES / 2**20:.0f} MiB",
             "", "| case | device | predicted GB | allocated GB | error | reserved GB | error | ok |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        reserved = ("-", "-") if row.reserved_bytes is None else (
            f"{row.reserved_bytes / GB:.2f}", _share(row.reserved_bytes, row.predicted_bytes)
            if row.predicted_bytes > 0 else "-")
        allocated_error = _share(row.allocated_bytes, row.predicted_bytes) \
            if row.predicted_bytes > 0 else "-"
        lines.append(f"| {row.case} | {row.device} | {row.predicted_bytes / GB:.2f} | "
                     f"{row.allocated_bytes / GB:.2f} | {allocated_error} | {reserved[0]} | "
                     f"{reserved[1]} | {'yes' if memory_verdict(row)[0] else 'NO'} |")
    return "\n".join(lines)


def rows_outcome(name: str, rows: Sequence[MemoryRow]) -> Outcome:
    verdicts = [memory_verdict(r) for r in rows]
    failed = [detail for ok, detail in verdicts if not ok]
    shown = ", ".join(f"{r.device} {r.allocated_bytes / GB:.2f}/{r.predicted_bytes / GB:.2f} GB"
                      for r in rows)
    return Outcome(name, bool(rows) and not failed,
                   "; ".join(failed) if failed else f"allocated/predicted {shown}")


def measure_case(device: str, case: MemoryCase, timeout_s: float,
                 collected: list[MemoryRow]) -> Outcome:
    """Train ``case``'s plan :data:`MEMORY_STEPS` steps on GPU 0; its rows join ``collected``."""
    from potluck.runtime.options import TrainOptions

    plan = memory_plan(device, case)
    options = TrainOptions(steps=MEMORY_STEPS, progress=False, timeout_s=timeout_s)
    history = run_on_gpus(plan, options, timeout_s)
    rows = peak_rows(case.name, predicted_totals(plan), [m.memory for m in history])
    collected.extend(rows)
    return rows_outcome(f"memory {case.name}", rows)
