"""Show a calibration: the inputs before and after, and the prediction error before and after."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from potluck.calibrate.calibrate_run import CalibrationOutcome
from potluck.calibrate.fit_links import current_link
from potluck.sim.compare import TraceComparison, error_text
from potluck.tables import compact_table
from potluck.units import format_bandwidth, format_duration


def input_lines(outcome: CalibrationOutcome) -> list[str]:
    """One line per fitted input: the plan's figure and the fitted one."""
    spec = outcome.record.plan.cluster
    lines = []
    for device in outcome.fit.devices:
        old = spec.device_type(device.device)
        parts = []
        if device.matmul_efficiency is not None:
            parts.append(f"matmul efficiency {old.matmul_efficiency:.3g} -> "
                         f"{device.matmul_efficiency:.3g}")
        if device.memory_bandwidth_bytes_per_s is not None:
            parts.append(f"memory bandwidth {format_bandwidth(old.memory_bandwidth_bytes_per_s)} -> "
                         f"{format_bandwidth(device.memory_bandwidth_bytes_per_s)}")
        lines.append(f"{device.device}: " + (", ".join(parts) or "nothing to fit"))
    for link in outcome.fit.links:
        old = current_link(spec, link.key)
        before = format_bandwidth(old.bandwidth_bytes_per_s) if old else "?"
        latency = (f"latency {format_duration(old.latency_s) if old else '?'} -> "
                   f"{format_duration(link.latency_s)}" if link.latency_s is not None
                   else "latency kept")
        source = link.source or f"{link.observations} all-reduces"
        lines.append(f"{link.key.describe()}: bandwidth {before} -> "
                     f"{format_bandwidth(link.bandwidth_bytes_per_s)}, {latency} ({source})")
    if outcome.fit.step_overhead_s:
        lines.append(f"host time per iteration (execution.step_overhead_s): "
                     f"{format_duration(outcome.fit.step_overhead_s)} (the optimizer step beyond "
                     "its memory traffic)")
    if not outcome.fit.links:
        lines.append("links: kept (no all-reduce or pipeline transfer this run could tell them by)")
    return lines + [f"note: {note}" for note in outcome.fit.notes]


def _step_line(label: str, before: TraceComparison, after: TraceComparison,
               pick: str) -> str:
    b, a = getattr(before, pick), getattr(after, pick)
    error = "step_error" if pick == "predicted_step_s" else "cost_model_error"
    return (f"{label}: before {b:.4g} s ({getattr(before, error):+.1%}), "
            f"after {a:.4g} s ({getattr(after, error):+.1%})")


def render_calibration(console: Console, outcome: CalibrationOutcome) -> None:
    before, after = outcome.before, outcome.after
    console.print(f"calibrated from {outcome.record.run_dir} ({outcome.record.plan.layout()})",
                  highlight=False)
    for line in input_lines(outcome):
        console.print(f"  {line}", highlight=False)
    console.print(f"step time measured {before.measured_step_s:.4g} s", highlight=False)
    console.print("  " + _step_line("simulator", before, after, "predicted_step_s"), highlight=False)
    console.print("  " + _step_line("cost model", before, after, "cost_model_step_s"),
                  highlight=False)
    table = compact_table("mean op time per kind", ("op", "measured ms", "before ms", "error",
                                                    "after ms", "error "), left=("op",))
    later = {c.kind: c for c in after.by_kind}
    for c in before.by_kind:
        a = later[c.kind]
        table.add_row(c.kind, f"{c.measured_s * 1e3:.4g}", f"{c.predicted_s * 1e3:.4g}",
                      error_text(c.error), f"{a.predicted_s * 1e3:.4g}", error_text(a.error))
    console.print(table)
    console.print(f"calibrated cluster file: {outcome.cluster_file}", highlight=False)


def calibration_json(outcome: CalibrationOutcome) -> dict[str, Any]:
    fit = outcome.fit
    return {
        "cluster_file": str(outcome.cluster_file),
        "devices": [{"device": d.device, "matmul_efficiency": d.matmul_efficiency,
                     "memory_bandwidth_bytes_per_s": d.memory_bandwidth_bytes_per_s}
                    for d in fit.devices],
        "links": [{"link": link.key.describe(), "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
                   "latency_s": link.latency_s, "observations": link.observations}
                  for link in fit.links],
        "step_overhead_s": fit.step_overhead_s,
        "notes": list(fit.notes),
        "before": outcome.before.as_dict(),
        "after": outcome.after.as_dict(),
    }
