"""Measured runs from a CSV file: one row per run, its layout and its iteration time.

The header names the columns, in any order::

    tp,pp,dp,micro_batch_size,global_batch,seq_len,iteration_time_s,dtype,recompute,schedule
    1,1,8,2,64,1024,0.612,bf16,none,1f1b

``dtype``, ``recompute``, ``schedule``, ``zero`` (the ZeRO stage, 0-3; FSDP's
FULL_SHARD is 3), ``zero1`` (its older alias: true is 1, false 0), ``virtual_stages``
(model chunks per rank of an interleaved schedule), ``partition`` and ``groups`` are
optional (an empty cell takes the default: bf16, the search's choice, 1f1b, the
search's choice, 2, balanced, any node groups; ``uniform`` is the even split of layers and
batch most frameworks use; ``groups`` names the node groups the run used, joined by
``+``, e.g. ``box3090+a100``). Lines starting
with ``#`` are comments. Every mistake is one line naming the file, the line and the fix.
A file holds at most :data:`MAX_RUNS` runs (each is planned several times per fit) and
:data:`MAX_CSV_BYTES` bytes of UTF-8 text.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.planner.options import Partition, SearchOptions
from potluck.plans import DType, Execution, TrainingShape
from potluck.plans.memory import Offload, Swap
from potluck.schedules import Schedule
from potluck.yamlio import read_text

REQUIRED = ("tp", "pp", "dp", "micro_batch_size", "global_batch", "seq_len", "iteration_time_s")
OPTIONAL = ("dtype", "recompute", "schedule", "zero", "zero1", "virtual_stages", "partition",
            "groups")
VIRTUAL_SCHEDULES = (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE)
_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")
MAX_RUNS = 200  # 8 runs calibrated in 22 s, 64 in 190 s (2 loaded cores): 200 take ~10 min
MAX_CSV_BYTES = 16 << 20


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run: the layout it trained with and its mean iteration time."""

    line: int  # line of the CSV file (the header is line 1)
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch: int
    seq_len: int
    iteration_time_s: float
    dtype: DType = DType.BF16
    recompute: Recompute | None = None
    schedule: Schedule = Schedule.ONE_F_ONE_B
    zero1: bool | None = None
    zero: int | None = None  # the ZeRO stage (None: zero1's, else the search's choice)
    virtual_stages: int | None = None  # chunks per rank of an interleaved schedule
    partition: Partition = Partition.BALANCED
    groups: tuple[str, ...] | None = None  # the node groups the run used (None: any)

    def options(self) -> SearchOptions:
        """The search pinned to this run's layout."""
        return SearchOptions(tp=self.tp, pp=self.pp, dp=self.dp,
                             micro_batch_size=self.micro_batch_size, recompute=self.recompute,
                             partition=self.partition, schedule=self.schedule,
                             zero=self.zero_stage, swap=Swap.NONE,
                             offload=Offload.NONE,  # what published runs did
                             groups=self.groups, top_k=1,
                             **({"virtual_stages": self.virtual_stages}
                                if self.virtual_stages else {}))

    @property
    def zero_stage(self) -> int | None:
        """The run's ZeRO stage: ``zero``, else ``zero1`` (1 or 0), else unknown."""
        if self.zero is not None:
            return self.zero
        return None if self.zero1 is None else int(self.zero1)

    def shape(self, execution: Execution) -> TrainingShape:
        return TrainingShape(self.global_batch, self.seq_len, self.dtype, execution)

    def label(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} mbs={self.micro_batch_size} "
                f"gb={self.global_batch} seq={self.seq_len}")


def read_runs(path: str | Path, group_gpus: dict[str, int]) -> tuple[MeasuredRun, ...]:
    """The runs of ``path``, checked against a cluster of these node groups (name: GPUs)."""
    path = Path(path)
    reader = csv.reader(_lines(path))
    try:
        header = _header(path, next((row for row in reader if any(c.strip() for c in row)), None))
        header_line = reader.line_num
        runs = []
        for row in reader:
            if any(cell.strip() for cell in row):
                runs.append(_run(path, reader.line_num, header, row, group_gpus))
                _check_count(path, len(runs))
    except csv.Error as err:
        raise ConfigError(f"{path}:{reader.line_num}: not CSV ({err}); give a text file of "
                          "comma-separated values") from None
    if not runs:
        raise ConfigError(f"{path}:{header_line}: no runs after the header; add one line per "
                          f"measured run ({','.join(REQUIRED)})")
    return tuple(runs)


def _lines(path: Path) -> list[str]:
    """The file's lines, comments blanked (so that line numbers stay); a binary file is one
    ConfigError."""
    if not path.exists():
        raise ConfigError(f"cannot read measured runs {path}: no such file")
    text = read_text(path, "measured runs CSV", MAX_CSV_BYTES)
    if (nul := text.find("\0")) >= 0:
        raise ConfigError(f"{path}:{text.count(chr(10), 0, nul) + 1}: a NUL byte: this is a "
                          "binary file, not a CSV of measured runs")
    return [line if not line.lstrip().startswith("#") else "" for line in text.splitlines()]


def _check_count(path: Path, runs: int) -> None:
    if runs > MAX_RUNS:
        raise ConfigError(f"{path}: more than {MAX_RUNS:,} runs; calibrate against at most "
                          f"{MAX_RUNS:,} (each is planned for every set of inputs tried): keep "
                          "a sample of different layouts")


def _header(path: Path, row: list[str] | None) -> list[str]:
    if row is None:
        raise ConfigError(f"{path}: empty file; its first line must be the header "
                          f"{','.join(REQUIRED)} (optional: {','.join(OPTIONAL)}), then one "
                          "line per measured run")
    header = [cell.strip().lower() for cell in row]
    for name in header:
        if name not in REQUIRED + OPTIONAL:
            raise ConfigError(f"{path}:1: unknown column {name!r}; columns are "
                              f"{','.join(REQUIRED)} and optionally {','.join(OPTIONAL)}")
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise ConfigError(f"{path}:1: column {twice[0]!r} appears twice; name each column once")
    missing = [name for name in REQUIRED if name not in header]
    if missing:
        raise ConfigError(f"{path}:1: no column {', '.join(map(repr, missing))}; the header must "
                          f"name {','.join(REQUIRED)}")
    return header


def _run(path: Path, line: int, header: list[str], row: list[str],
         group_gpus: dict[str, int]) -> MeasuredRun:
    if len(row) != len(header):
        raise ConfigError(f"{path}:{line}: {len(row)} values for {len(header)} columns; give one "
                          "value per column of the header")
    cells = {name: cell.strip() for name, cell in zip(header, row, strict=True)}
    values: dict[str, Any] = {}
    for name, parse in _PARSERS.items():
        if cells.get(name, "") == "":
            if name in REQUIRED:
                raise ConfigError(f"{path}:{line}: column {name!r} is empty; give the run's value")
            continue
        try:
            values[name] = parse(cells[name])
        except ValueError as err:
            raise ConfigError(f"{path}:{line}: column {name!r} {err}") from None
    run = MeasuredRun(line, **values)
    _check_layout(path, run, group_gpus)
    return run


def _check_layout(path: Path, run: MeasuredRun, group_gpus: dict[str, int]) -> None:
    if run.zero is not None and run.zero1 is not None and int(run.zero1) != run.zero:
        raise ConfigError(f"{path}:{run.line}: zero {run.zero} and zero1 {run.zero1} disagree; "
                          "give the run's ZeRO stage in the zero column only")
    if (run.virtual_stages or 1) > 1 and run.schedule not in VIRTUAL_SCHEDULES:
        raise ConfigError(f"{path}:{run.line}: virtual_stages {run.virtual_stages} needs an "
                          f"interleaved schedule; set schedule to interleaved or zb")
    for name in run.groups or ():
        if name not in group_gpus:
            raise ConfigError(f"{path}:{run.line}: column 'groups' names {name!r}, not a node group "
                              f"of the cluster ({', '.join(group_gpus)}); join names with '+'")
    gpus, available = run.tp * run.pp * run.dp, sum(
        n for name, n in group_gpus.items() if run.groups is None or name in run.groups)
    if gpus > available:
        where = "the cluster has" if run.groups is None else f"{'+'.join(run.groups)} have"
        raise ConfigError(f"{path}:{run.line}: tp*pp*dp = {gpus} GPUs but {where} "
                          f"{available}; give the cluster file the run was measured on")
    per_step = run.dp * run.micro_batch_size
    if run.global_batch % per_step:
        raise ConfigError(f"{path}:{run.line}: global_batch {run.global_batch} is not divisible "
                          f"by dp*micro_batch_size = {per_step}; give the run's global batch "
                          f"(a multiple of {per_step})")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"must be a positive integer, not {text!r}") from None
    if value <= 0:
        raise ValueError(f"must be a positive integer, not {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"must be a positive number of seconds, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a positive number of seconds, not {text!r}")
    return value


def _choice(kind: type[Enum]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return kind(text.lower())
        except ValueError:
            names = ", ".join(str(choice.value) for choice in kind)
            raise ValueError(f"must be one of {names}, not {text!r}") from None
    return parse


def _groups(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split("+"))
    if not all(names):
        raise ValueError(f"must name node groups joined by '+', not {text!r}")
    return names


def _zero_stage(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise ValueError(f"must be a ZeRO stage, 0, 1, 2 or 3, not {text!r}")
    return int(text)


def _flag(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"must be true or false, not {text!r}")


_PARSERS: dict[str, Callable[[str], Any]] = {
    "tp": _positive_int, "pp": _positive_int, "dp": _positive_int,
    "micro_batch_size": _positive_int, "global_batch": _positive_int, "seq_len": _positive_int,
    "iteration_time_s": _positive_float, "dtype": _choice(DType),
    "recompute": _choice(Recompute), "schedule": _choice(Schedule), "zero": _zero_stage,
    "zero1": _flag, "virtual_stages": _positive_int,
    "partition": _choice(Partition), "groups": _groups,
}
