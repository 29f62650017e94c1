"""Presenting cost studies: the JSON of ``potluck cost --json`` and the rich tables.

Every candidate shows the raw TFLOPS per dollar (RCC) and its rank by it
beside the training figures and the rank by USD per token, so where the two
orders disagree is plain to see.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from potluck.cluster.topology import Cluster
from potluck.economics import rank
from potluck.economics.candidates import Candidate
from potluck.economics.figures import CostFigures, plan_figures
from potluck.economics.prices import Pricing
from potluck.economics.study import CostStudy
from potluck.plans import Plan
from potluck.report import dtype_notes, plan_summary

DEFAULT_ROWS = 15
WIDE_COLUMNS = 120
NARROW_DROPS = ("plan", "total $", "model TF/$h")
# What the table's marks and terse columns mean; the caption explains those it shows.
COLUMN_NOTES = {
    "offer": "* Pareto front (no offer both faster and cheaper)",
    "$/Mtok": "$/Mtok: USD per million tokens",
    "RCC": "RCC: peak TFLOPS per $/h",
    "RCC #": "RCC #: rank by it",
    "model TF/$h": "model TF/$h: the TFLOPS the plan achieves per $/h",
}


def candidate_json(candidate: Candidate, ranks: dict[str, dict[str, int]], on_front: bool) -> dict[str, Any]:
    """One candidate of ``potluck cost --json``."""
    f, group = candidate.figures, candidate.offer.group
    summary = {k: v for k, v in plan_summary(candidate.plan).items() if k != "devices"}
    return {
        "name": candidate.name, "gpu": group.gpu, "gpus": f.gpus, "gpus_offered": candidate.offer.num_gpus,
        "nodes": group.count, "gpus_per_node": group.gpus_per_node, "nvlink": group.nvlink.value,
        "tokens_per_s": f.tokens_per_s, "usd_per_hour": f.usd_per_hour,
        "usd_per_million_tokens": f.usd_per_million_tokens, "tokens_per_usd": f.tokens_per_usd,
        "hours_to_train": f.hours_to_train, "total_usd": f.total_usd,
        "tflops_per_usd": f.tflops_per_usd, "achieved_tflops_per_usd": f.achieved_tflops_per_usd,
        "peak_tflops": f.peak_tflops, "achieved_tflops": f.achieved_tflops,
        "meets_deadline": candidate.meets_deadline, "pareto": on_front,
        "rank_cost": ranks["cost"][candidate.name], "rank_time": ranks["time"][candidate.name],
        "rank_rcc": ranks["rcc"][candidate.name], "price_source": candidate.offer.source,
        "plan": summary,
    }


def _ranks(study: CostStudy) -> dict[str, dict[str, int]]:
    return {"cost": rank.positions(study.candidates), "time": rank.positions(rank.by_time(study.candidates)),
            "rcc": rank.positions(rank.by_rcc(study.candidates))}


def study_json(study: CostStudy) -> dict[str, Any]:
    """``potluck cost --json``: the request, every candidate (cheapest first), the offers skipped."""
    ranks = _ranks(study)
    front = {c.name for c in study.pareto}
    pricing = asdict(study.request.pricing)
    pricing["mode"] = study.request.pricing.mode.value
    return {
        "model": study.model.name, "tokens": study.request.tokens,
        "global_batch": study.training.global_batch, "seq_len": study.training.seq_len,
        "dtype": study.training.dtype.value, "dtype_notes": study_dtype_notes(study),
        "pricing": pricing, "deadline_hours": study.request.deadline_hours,
        "candidates": [candidate_json(c, ranks, c.name in front) for c in study.candidates],
        "pareto": [c.name for c in study.pareto],
        "skipped": [{"name": s.name, "reason": s.reason} for s in study.skipped],
        "search_time_s": study.search_time_s, "notes": list(study.notes),
    }


def render_study(console: Console, study: CostStudy, rows: int = DEFAULT_ROWS) -> None:
    """The candidates as a table (cheapest per token first), then what RCC would have chosen."""
    wide = console.width >= WIDE_COLUMNS
    console.print(_study_table(study, rows, wide))
    if not wide:
        console.print(f"[dim]plans, totals and achieved TFLOPS per $/h need {WIDE_COLUMNS} columns "
                      "(or --json)[/dim]")
    if len(study.candidates) > rows:
        console.print(f"[dim]{len(study.candidates) - rows} more candidates: --top or --json[/dim]")
    for line in summary_lines(study):
        console.print(line)
    for note in [*study.notes, *study_dtype_notes(study)]:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
    if study.skipped:
        example = study.skipped[0]
        console.print(f"[dim]{len(study.skipped)} offers skipped (--json says why), e.g. {example.name}: "
                      f"{example.reason}[/dim]", soft_wrap=True)
    console.print(f"[dim]planned {len(study.candidates) + len(study.skipped)} offers in "
                  f"{study.search_time_s:.1f} s[/dim]")


def _study_table(study: CostStudy, rows: int, wide: bool) -> Table:
    """Cheapest first; a narrow console drops the plan, total and achieved-TFLOPS columns."""
    ranks, front = _ranks(study), {c.name for c in study.pareto}
    columns = [c for c in ("#", "offer", "GPUs", "plan", "tokens/s", "$/h", "$/Mtok", "hours", "total $",
                           "RCC", "RCC #", "model TF/$h") if wide or c not in NARROW_DROPS]
    caption = "; ".join(COLUMN_NOTES[c] for c in columns if c in COLUMN_NOTES)
    table = Table(title=f"{study.model.name}: {study.request.tokens:,} tokens, "
                        f"{study.training.dtype.value}, {study.request.pricing.describe()}",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0), caption=caption, caption_justify="left")
    for column in columns:  # an offer's name stays whole; a late run's hours may wrap
        table.add_column(column, justify="left" if column in ("offer", "plan") else "right",
                         no_wrap=column != "hours", min_width=len(column))
    for candidate in study.candidates[:rows]:
        f = candidate.figures
        late = "" if candidate.meets_deadline else " [red](late)[/red]"
        cells = {
            "#": str(ranks["cost"][candidate.name]),
            "offer": candidate.name + (" *" if candidate.name in front else ""),
            "GPUs": _gpus(candidate), "plan": candidate.plan.layout(), "tokens/s": f"{f.tokens_per_s:,.0f}",
            "$/h": f"{f.usd_per_hour:.2f}", "$/Mtok": f"{f.usd_per_million_tokens:.4f}",
            "hours": f"{f.hours_to_train:,.1f}{late}", "total $": f"{f.total_usd:,.0f}",
            "RCC": f"{f.tflops_per_usd:.0f}", "RCC #": str(ranks["rcc"][candidate.name]),
            "model TF/$h": f"{f.achieved_tflops_per_usd:.0f}",
        }
        table.add_row(*(cells[c] for c in columns))
    return table


def _gpus(candidate: Candidate) -> str:
    used, offered = candidate.figures.gpus, candidate.offer.num_gpus
    return str(used) if used == offered else f"{used} of {offered}"


def study_dtype_notes(study: CostStudy) -> list[str]:
    """The candidates' device types that compute in another dtype than the study's."""
    types = (Cluster(c.plan.cluster).device(d).type for c in study.candidates for d in c.plan.devices)
    return dtype_notes(study.training.dtype, types)


def summary_lines(study: CostStudy) -> list[str]:
    """Cheapest, fastest, and what ranking by raw TFLOPS per dollar would have picked."""
    best, fastest, by_rcc = study.best, study.fastest, rank.by_rcc(study.candidates)[0]
    lines = [
        f"cheapest per token: [bold]{best.name}[/bold] ({best.plan.layout()}): "
        f"{_money(best.figures)}",
        f"fastest: [bold]{fastest.name}[/bold] ({fastest.plan.layout()}): {_money(fastest.figures)}",
    ]
    if by_rcc.name != best.name:
        ratio = by_rcc.figures.usd_per_million_tokens / best.figures.usd_per_million_tokens
        lines.append(
            f"raw TFLOPS per dollar (RCC) would pick [bold]{by_rcc.name}[/bold] "
            f"({by_rcc.figures.tflops_per_usd:.0f} TFLOPS per $/h): it trains at "
            f"${by_rcc.figures.usd_per_million_tokens:.4f} per million tokens, {ratio:.2f}x the cheapest"
        )
    else:
        lines.append("raw TFLOPS per dollar (RCC) picks the same offer here")
    return lines


def _money(f: CostFigures) -> str:
    return (f"${f.usd_per_million_tokens:.4f} per million tokens, {f.hours_to_train:,.1f} h and "
            f"${f.total_usd:,.0f} for the run at ${f.usd_per_hour:.2f}/h")


def plan_cost_line(plan: Plan, pricing: Pricing, tokens: int | None) -> str:
    """One line of dollars for ``potluck plan`` when prices or tokens are asked for."""
    f = plan_figures(plan, pricing, tokens or 1)
    line = (f"cost ({pricing.describe()}): ${f.usd_per_hour:.2f}/h for {f.gpus} GPUs, "
            f"${f.usd_per_million_tokens:.4f} per million tokens")
    if tokens:
        line += f"; {tokens:,} tokens in {f.hours_to_train:,.1f} h for ${f.total_usd:,.0f}"
    return line


def plan_cost_json(plan: Plan, pricing: Pricing, tokens: int | None) -> dict[str, Any]:
    """The ``cost`` object of ``potluck plan --json`` when prices or tokens are asked for."""
    f = plan_figures(plan, pricing, tokens or 1)
    figures: dict[str, Any] = {
        "pricing": pricing.describe(), "gpus": f.gpus, "usd_per_hour": f.usd_per_hour,
        "usd_per_million_tokens": f.usd_per_million_tokens, "tflops_per_usd": f.tflops_per_usd,
        "achieved_tflops_per_usd": f.achieved_tflops_per_usd,
    }
    if tokens:
        figures.update(tokens=tokens, hours_to_train=f.hours_to_train, total_usd=f.total_usd)
    return figures
