"""Jobs files: the training jobs to share one cluster, read and checked all at once.

A jobs file (YAML) lists the jobs and, optionally, the host names of the cluster's
machines (for ``--slurm``)::

    jobs:
      - {name: alice-7b, model: llama2-7b, global_batch: 64, seq_len: 4096, tokens: 2B}
      - {name: bob-1b, model: gpt3-1.3b, global_batch: 128, seq_len: 2048, tokens: 5B,
         arrival_h: 1, priority: 2, deadline_h: 24}
    hosts:                       # optional: node group -> one host name per machine
      boxa100: [gpu-a01, gpu-a02]

Each job is validated by a pydantic model (:class:`JobEntry`: unknown keys, types,
``2B``-style token counts read by :func:`potluck.units.parse_count`); models are loaded
with :func:`potluck.model.loading.load_model` (a relative config path is read beside the
jobs file first). ``deadline_h`` counts hours from the job's arrival, as ``potluck plan
--deadline-hours`` does. Nothing stops at the first mistake: :func:`load_jobs` gathers
every problem (bad keys and values, unknown models, duplicate names, and jobs that the
caller's ``refusal`` finds fit nowhere) and raises one :class:`JobsFileError` with one
line per problem, each naming the file, line and job.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    ValidationError,
)

from potluck.cluster.execution import Execution
from potluck.cluster.spec import ClusterSpec, check_host_name, check_name
from potluck.errors import ConfigError, PotluckError
from potluck.model.loading import load_model
from potluck.model.spec import ModelSpec, check_seq_len
from potluck.plans import TrainingShape
from potluck.units import parse_count
from potluck.yamlio import load_yaml


class JobsFileError(ConfigError):
    """A jobs file with problems: ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = tuple(problems)


def _checked(check: Callable[[Any, str], Any], what: str) -> BeforeValidator:
    """``check(value, what)`` as a pydantic validator: its ConfigError becomes the ValueError
    pydantic reports (without the ``what: `` the key's path already says)."""
    def validate(value: Any) -> Any:
        try:
            return check(value, what)
        except ConfigError as err:
            raise ValueError(str(err).removeprefix(f"{what}: ")) from None
    return BeforeValidator(validate)


WholeNumber = Annotated[int, Field(strict=True, ge=1)]
HostName = Annotated[str, _checked(check_host_name, "host name")]


class JobEntry(BaseModel):
    """One job as the file writes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, _checked(check_name, "job name")]
    model: Annotated[str, Field(min_length=1)]
    global_batch: WholeNumber
    seq_len: WholeNumber
    tokens: Annotated[int, _checked(parse_count, "tokens")]
    priority: PositiveFloat = 1.0
    deadline_h: PositiveFloat | None = None
    arrival_h: NonNegativeFloat = 0.0


class JobsDocument(BaseModel):
    """The file's top level."""

    model_config = ConfigDict(extra="forbid")

    jobs: Annotated[list[Any], Field(min_length=1)]
    hosts: dict[str, list[HostName]] | None = None


@dataclass(frozen=True)
class JobShape:
    """What a job trains, the key under which its throughput is remembered."""

    model: ModelSpec
    training: TrainingShape

    @property
    def tokens_per_iteration(self) -> int:
        return self.training.global_batch * self.training.seq_len


@dataclass(frozen=True)
class Job:
    """A job to schedule: its shape, how many tokens, when it arrives and how it weighs."""

    name: str
    shape: JobShape
    tokens: int
    arrival_h: float = 0.0
    priority: float = 1.0
    deadline_h: float | None = None  # hours after arrival
    model_name: str = ""  # as the file named it


@dataclass(frozen=True)
class JobsFile:
    """The jobs of a file in file order, and the host names of the machines it gives."""

    jobs: tuple[Job, ...]
    hosts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # warnings, one line each (a sequence beyond a model's positions)


Refusal = Callable[[Job], str | None]  # why a job fits nowhere on the cluster, or None


def load_jobs(path: str | Path, cluster: ClusterSpec, refusal: Refusal,
              execution: Execution | None = None,
              before_checks: Callable[[list[Job]], None] | None = None) -> JobsFile:
    """Read and check a jobs file against ``cluster``; every problem in one JobsFileError.
    ``before_checks`` hears of the jobs read before ``refusal`` checks each (to plan them
    all at once, with progress)."""
    path = Path(path)
    data = load_yaml(path, "jobs file")
    reader = _Reader(str(path), path.parent, execution or Execution())
    document = reader.document(data)
    items = data["jobs"] if document is not None and isinstance(data.get("jobs"), list) else []
    jobs = reader.jobs(items, getattr(data, "key_lines", {}))  # the YAML list: item lines
    if before_checks is not None:
        before_checks([job for job, _ in jobs])
    for job, line in jobs:
        reader.check_fits(job, line, refusal)
    hosts = reader.hosts(document.hosts if document else None, cluster, data)
    if reader.problems:
        raise JobsFileError(reader.problems)
    return JobsFile(tuple(job for job, _ in jobs), hosts, tuple(reader.notes))


class _Reader:
    """Reads one jobs file, gathering problems instead of stopping at the first."""

    def __init__(self, label: str, folder: Path, execution: Execution) -> None:
        self.label = label
        self.folder = folder
        self.execution = execution
        self.problems: list[str] = []
        self.notes: list[str] = []  # what is allowed but worth a warning

    def problem(self, line: int, where: str, message: str) -> None:
        at = f"{self.label}:{line}: " if line else f"{self.label}: "
        self.problems.append(f"{at}{where}: {message}")

    def document(self, data: Any) -> JobsDocument | None:
        if not isinstance(data, dict):
            self.problem(getattr(data, "line", 0), "jobs file",
                         "must be a mapping with a `jobs:` list")
            return None
        try:
            return JobsDocument.model_validate(data)
        except ValidationError as err:
            self._report(err, "jobs file", data, JobsDocument)
            usable = {k: v for k, v in data.items() if k == "jobs" and isinstance(v, list)}
            return JobsDocument.model_construct(jobs=usable.get("jobs", []), hosts=None)

    def jobs(self, items: list[Any], top_lines: dict) -> list[tuple[Job, int]]:
        lines = getattr(items, "item_lines", None) or [top_lines.get("jobs", 0)] * len(items)
        found: list[tuple[Job, int]] = []
        seen: dict[str, int] = {}
        for index, (item, line) in enumerate(zip(items, lines, strict=True)):
            name = item["name"] if _named(item) else None
            where = f"jobs[{index}]" + (f" ({name})" if name is not None else "")
            if name in seen:
                self.problem(line, where, f"a second job named {name!r} (the first is "
                             f"jobs[{seen[name]}]); give every job its own name")
                continue
            if name is not None:
                seen[name] = index
            job = self.job(item, where, line)
            if job is not None:
                found.append((job, line))
        return found

    def job(self, item: Any, where: str, line: int) -> Job | None:
        if not isinstance(item, dict):
            self.problem(line, where, "must be a mapping (name: ..., model: ..., ...)")
            return None
        try:
            entry = JobEntry.model_validate(item)
        except ValidationError as err:
            self._report(err, where, item, JobEntry)
            return None
        try:
            model = load_model(self._model_path(entry.model))
        except PotluckError as err:
            self.problem(_line_of(item, "model", line), f"{where}.model", str(err))
            return None
        try:
            warning = check_seq_len(model, entry.seq_len, flag="seq_len")
        except ConfigError as err:
            self.problem(_line_of(item, "seq_len", line), f"{where}.seq_len", str(err))
            return None
        if warning is not None:
            self.notes.append(f"{self.label}:{line}: {where}: {warning}")
        training = TrainingShape(entry.global_batch, entry.seq_len, execution=self.execution)
        return Job(entry.name, JobShape(model, training), entry.tokens, entry.arrival_h,
                   entry.priority, entry.deadline_h, entry.model)

    def _model_path(self, model: str) -> str:
        """A relative config path is read beside the jobs file when it is there."""
        beside = self.folder / model
        return str(beside) if not Path(model).is_absolute() and beside.exists() else model

    def check_fits(self, job: Job, line: int, refusal: Refusal) -> None:
        why = refusal(job)
        if why is not None:
            self.problem(line, f"jobs ({job.name})",
                         f"{job.model_name} fits nowhere on the cluster, not even on all of "
                         f"it: {why}")

    def hosts(self, hosts: dict[str, list[str]] | None, cluster: ClusterSpec,
              data: Any) -> dict[str, tuple[str, ...]]:
        if not hosts:
            return {}
        line = getattr(data, "key_lines", {}).get("hosts", 0)
        groups = {group.name: group.count for group in cluster.nodes}
        for name, names in hosts.items():
            if name not in groups:
                self.problem(line, f"hosts.{name}", f"the cluster has no node group {name!r} "
                             f"(it has {', '.join(groups)})")
            elif len(names) != groups[name]:
                self.problem(line, f"hosts.{name}", f"gives {len(names)} host names for "
                             f"{groups[name]} machines; give one per machine")
        return {name: tuple(names) for name, names in hosts.items()}

    def _report(self, err: ValidationError, where: str, data: Any, model: type[BaseModel]) -> None:
        for error in err.errors():
            key = str(error["loc"][0]) if error["loc"] else None
            path = ".".join(str(part) for part in error["loc"])
            self.problem(_line_of(data, key, getattr(data, "line", 0)),
                         f"{where}.{path}" if path else where, _message(error, key, model))


def _named(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str)


def _line_of(data: Any, key: str | None, default: int) -> int:
    return getattr(data, "key_lines", {}).get(key, default) if key is not None else default


def _message(error: Any, key: str | None, model: type[BaseModel]) -> str:
    """pydantic's message in potluck's words for the common cases."""
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = list(model.model_fields)
        close = difflib.get_close_matches(str(key), allowed, n=1)
        return "unknown key; " + (f"did you mean {close[0]!r}?" if close
                                  else f"allowed: {', '.join(allowed)}")
    if kind == "missing":
        return "is required"
    message = error["msg"].removeprefix("Value error, ")
    return f"{message} (not {error['input']!r})" if kind != "value_error" else message
