"""Show a measured-runs calibration: the inputs chosen and why (their held-out error
against the cluster file's), the inputs before and after, each run's error before, after
and left out, and the summary figures."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from potluck.calibrate.measured.calibrate import MeasuredOutcome
from potluck.calibrate.measured.params import Parameter
from potluck.calibrate.measured.select import Selection
from potluck.calibrate.measured.stats import errors, mape, spearman
from potluck.tables import compact_table


def _value(param: Parameter, value: float) -> str:
    return f"{value * 1e3:.4g} ms" if param.in_seconds else f"{value:.4g}"


def summary(outcome: MeasuredOutcome) -> dict[str, float | None]:
    measured = outcome.measured_s
    return {
        "mape_before": mape(outcome.before_s, measured),
        "mape_after": mape(outcome.after_s, measured),
        "mape_leave_one_out": mape(outcome.held_out_s, measured),
        "spearman_before": spearman(outcome.before_s, measured),
        "spearman_leave_one_out": spearman(outcome.held_out_s, measured),
    }


RUNNERS_UP = 3  # sets shown after the chosen one


def choice_line(selection: Selection) -> str:
    """Which inputs were chosen, by what held-out error against the cluster file's, and the
    sets that came closest."""
    chosen = selection.chosen
    if not selection.folds:
        return f"inputs chosen: {chosen.names()} (the best fit to every run; no held-out check)"
    how = ("left out in turn" if selection.folds == len(selection.measured_s)
           else f"left out in {selection.folds} groups")
    others = sorted((s for s in selection.tried if s is not chosen), key=selection.held_out_mape)
    next_best = ", ".join(f"{s.names()} {selection.held_out_mape(s):.1%}"
                          for s in others[:RUNNERS_UP])
    return (f"inputs chosen by the error of runs {how}: {chosen.names()}, held-out MAPE "
            f"{selection.held_out_mape(chosen):.1%} against {selection.uncalibrated_mape:.1%} "
            f"uncalibrated ({len(selection.tried)} sets tried; next: {next_best})")


def _rho(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def render_measured(console: Console, outcome: MeasuredOutcome) -> None:
    for skipped in outcome.skipped:
        console.print(f"line {skipped.run.line} left out ({skipped.run.label()}): {skipped.reason}",
                      highlight=False, soft_wrap=True)
    for note in outcome.notes():
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    console.print(choice_line(outcome.selection), highlight=False, soft_wrap=True)
    fitted = outcome.fit.values
    table = compact_table(f"fitted to {len(outcome.planned)} runs", ("parameter", "before", "after"),
                          left=("parameter",))
    for param, value in fitted.items():
        table.add_row(param.name, _value(param, param.start), _value(param, value))
    console.print(table)
    kept = [p.name for p in outcome.fit.exercised if p not in fitted]
    unused = [p.name for p in outcome.candidates if p not in outcome.fit.exercised and p not in fitted]
    if kept:
        console.print(f"kept (not chosen): {', '.join(kept)}", highlight=False)
    if unused:
        console.print(f"kept (the runs do not depend on them): {', '.join(unused)}", highlight=False)
    runs = compact_table("iteration time per run", ("line", "layout", "measured s", "before",
                                                    "after", "left out"), left=("layout",))
    measured = outcome.measured_s
    columns = [errors(times, measured)
               for times in (outcome.before_s, outcome.after_s, outcome.held_out_s)]
    for i, planned in enumerate(outcome.planned):
        runs.add_row(str(planned.run.line), planned.run.label(), f"{measured[i]:.4g}",
                     *(f"{column[i]:+.1%}" for column in columns))
    console.print(runs)
    figures = summary(outcome)
    console.print(f"MAPE: before {figures['mape_before']:.1%}, after {figures['mape_after']:.1%} "
                  f"(in sample), leave-one-out {figures['mape_leave_one_out']:.1%}; Spearman: "
                  f"before {_rho(figures['spearman_before'])}, leave-one-out "
                  f"{_rho(figures['spearman_leave_one_out'])}", highlight=False)
    if figures["mape_leave_one_out"] >= figures["mape_before"]:
        console.print("note: left out of the fit, the runs are predicted no better than before "
                      "calibration; the fitted inputs may not carry over to other layouts (add runs "
                      "whose layouts differ)", highlight=False)
    console.print(f"{len(outcome.selection.tried)} sets of inputs, each fitted to the runs and "
                  f"without each: {outcome.fit_time_s:.1f} s", highlight=False)
    console.print(f"calibrated cluster file: {outcome.cluster_file}", highlight=False)


def measured_json(outcome: MeasuredOutcome) -> dict[str, Any]:
    return {
        "cluster_file": str(outcome.cluster_file),
        "fitted": [{"parameter": p.name, "before": p.start, "after": v}
                   for p, v in outcome.fit.values.items()],
        "runs": [{"line": p.run.line, "layout": p.run.label(), "measured_s": p.run.iteration_time_s,
                  "before_s": b, "after_s": a, "leave_one_out_s": loo}
                 for p, b, a, loo in zip(outcome.planned, outcome.before_s, outcome.after_s,
                                         outcome.held_out_s, strict=True)],
        "skipped": [{"line": s.run.line, "reason": s.reason} for s in outcome.skipped],
        "selection": selection_json(outcome.selection),
        "notes": list(outcome.notes()),
        **summary(outcome),
        "fit_time_s": outcome.fit_time_s,
    }


def selection_json(selection: Selection) -> dict[str, Any]:
    """The inputs chosen, the held-out folds (0: too few runs to hold one out) and every set
    tried with its held-out error, the cluster file's (no inputs) first."""
    return {
        "chosen": [p.name for p in selection.chosen.terms],
        "held_out_mape": selection.held_out_mape(selection.chosen),
        "uncalibrated_mape": selection.uncalibrated_mape,
        "folds": selection.folds,
        "tried": [{"inputs": [p.name for p in s.terms], "held_out_mape": selection.held_out_mape(s)}
                  for s in selection.tried],
    }
