"""``potluck schedule --run``: the schedule carried out, each job a ``potluck train --elastic``.

The executor runs the simulation's policy (:func:`potluck.multijob.policies.allocate`) on
real events instead of predicted ones: at the start, when a job arrives, and when a job's
run ends (its process exits), it re-divides the cluster's machines among the active jobs
and picks concrete machines (:func:`potluck.multijob.machines.assign_machines`). Then:

- a job that gets machines for the first time is launched as its own process group,
  ``python -m potluck train --plan DIR/<job>/plan.json --out DIR/<job> --elastic``, its
  plan made by the planner on its machines and moved onto the whole cluster
  (:func:`potluck.runtime.elastic.pool.on_whole_cluster`: the other jobs' devices listed
  as unused), so ``potluck join``/``leave`` can name any device of the cluster;
- a running job whose allocation grows is offered the new devices
  (:func:`~potluck.runtime.elastic.joins.register`, as ``potluck join`` does: it takes
  them at its next checkpoint if that plan is faster by its replan margin); one whose
  allocation shrinks gives devices back (:func:`~potluck.runtime.elastic.joins.release`,
  as ``potluck leave`` does: dropped at its next checkpoint). Devices taken from a job
  go to another only once that job no longer runs on them (its ``replans.jsonl`` says so,
  or its process has ended), so no device ever serves two jobs;
- a running job is never stopped to make room (the policy's allocation is kept only where
  it fits beside the running jobs; the others wait for the next event).

Choices that keep it simple: arrival hours are scaled to wall time by
``seconds_per_hour`` (0, the default: every job has arrived at the start and the policy
orders them by the file). The jobs file's tokens are for the prediction; an emulated run
trains ``steps`` steps for the job with the most tokens and proportionally fewer (at least
one) for the others. Runs are emulated (CPU ranks timed like the devices, computing a
tiny stand-in model) when the cluster has GPUs; a CPU cluster's ranks compute the real
model, emulated only to run several machines' ranks on this one. Every event is one line
of progress and one line of ``DIR/schedule.jsonl`` (``time_s``, ``job``, ``action``:
start, join, leave, finish or fail, ``devices``). Every wait is bounded: a run past
``job_timeout_s`` is stopped and reported as failed, a failed run is reported in one line
and the others go on, and an interrupt or a SIGTERM (what ``timeout``, ``kill`` and Slurm
send) stops every run's process group: SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`.
A run never outlives the executor, even one SIGKILLed: each is started with the kernel's
parent-death signal (:func:`~potluck.runtime.launch.lifeline.dies_with_this_process`), and
its own ranks end with it. Nothing of the
jobs file runs as code: it names presets and numbers; the command lines are built here.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster, device_id
from potluck.errors import ConfigError, InfeasibleError, PotluckError
from potluck.multijob.allocations import Allocation, capacity
from potluck.multijob.jobs import Job
from potluck.multijob.machines import Machine, assign_machines
from potluck.multijob.policies import Active, Policy, allocate
from potluck.multijob.throughput import ThroughputTable
from potluck.plans import Plan, load_plan, save_plan
from potluck.runtime.elastic.joins import register, release
from potluck.runtime.launch.lifeline import dies_with_this_process
from potluck.safe_files import open_append, write_text, writing
from potluck.units import non_negative_number, positive_number, whole_number
from potluck.yamlio import MAX_LOG_BYTES, read_bounded

log = logging.getLogger(__name__)

SCHEDULE_FILE = "schedule.jsonl"
LOG_FILE = "train.log"  # a run's stdout and stderr, in its run directory
POLL_S = 0.2
STOP_GRACE_S = 5.0  # after SIGTERM, a run's process group gets this long before SIGKILL

Progress = Callable[[str], None]


class Terminated(PotluckError):
    """``potluck schedule --run`` got a SIGTERM; every run was stopped."""

    exit_code = 128 + signal.SIGTERM


@dataclass(frozen=True)
class RunSettings:
    """How ``potluck schedule --run`` runs the jobs (see the module docstring)."""

    out_dir: Path
    steps: int = 20
    checkpoint_every: int = 5
    dilation: float = 1.0
    seconds_per_hour: float = 0.0
    job_timeout_s: float = 3600.0
    replan_margin: float | None = None  # None: potluck train's default

    def check(self) -> None:
        whole_number(self.steps, "--steps")
        if self.checkpoint_every < 1:
            raise ConfigError("--checkpoint-every must be at least 1 with --run (a job "
                              f"changes machines at a checkpoint), not {self.checkpoint_every}")
        positive_number(self.dilation, "--dilation")
        non_negative_number(self.seconds_per_hour, "--seconds-per-hour")
        positive_number(self.job_timeout_s, "--job-timeout")


@dataclass(frozen=True)
class ScheduleEvent:
    """One line of ``schedule.jsonl``."""

    time_s: float
    job: str
    action: str  # start, join, leave, finish, fail
    devices: tuple[str, ...]
    detail: str = ""


@dataclass(frozen=True)
class RunOutcome:
    """What ``--run`` did: its events, the jobs that finished and why the others failed."""

    events: tuple[ScheduleEvent, ...]
    finished: tuple[str, ...]
    failed: dict[str, str]
    steps: dict[str, int]
    out_dir: Path


def job_steps(jobs: Sequence[Job], steps: int) -> dict[str, int]:
    """Each job's emulated steps: ``steps`` for the most tokens, the others in proportion."""
    most = max(job.tokens for job in jobs)
    return {job.name: max(1, round(steps * job.tokens / most)) for job in jobs}


def run_schedule(jobs: Sequence[Job], table: ThroughputTable, policy: Policy,
                 settings: RunSettings, progress: Progress | None = None) -> RunOutcome:
    """Run ``jobs`` on ``table``'s cluster under ``policy`` until each has finished or failed."""
    settings.check()
    executor = _Executor(tuple(jobs), table, policy, settings, progress or log.info)
    with _sigterm_raises(settings.out_dir):
        try:
            executor.loop()
        finally:
            executor.stop_all()
    return executor.outcome()


@contextmanager
def _sigterm_raises(out_dir: Path) -> Iterator[None]:
    """In the main thread, a SIGTERM raises :class:`Terminated`, so the runs are stopped as
    on Ctrl-C (elsewhere signals cannot be handled; the parent-death signal still ends the
    runs with the process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise Terminated(f"stopped by SIGTERM; every job's run was stopped (their run "
                         f"directories: {out_dir}/<job>)")

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _Run:
    """A launched job: its process, its run directory, the devices it holds and gives back."""

    process: subprocess.Popen[bytes]
    run_dir: Path
    started_s: float
    releasing: set[str] = field(default_factory=set)


class _Executor:
    """The executor's clock, queue, runs and device accounting."""

    def __init__(self, jobs: tuple[Job, ...], table: ThroughputTable, policy: Policy,
                 settings: RunSettings, progress: Progress) -> None:
        self.table, self.spec, self.policy, self.settings = table, table.spec, policy, settings
        self.say = progress
        self.pending = sorted(jobs, key=lambda j: j.arrival_h)  # stable: file order on ties
        self.active: list[Job] = []
        self.steps = job_steps(jobs, settings.steps)
        self.target: dict[str, tuple[Machine, ...]] = {}  # machines the policy gave each job
        self.held: dict[str, set[str]] = {}  # devices each job holds (schedule.jsonl's view)
        self.runs: dict[str, _Run] = {}
        self.finished: list[str] = []
        self.failed: dict[str, str] = {}
        self.events: list[ScheduleEvent] = []
        self.emulate = _needs_emulation(self.spec)
        self.changed = True  # re-decide at the next poll
        self.clock0 = time.monotonic()
        self.tie_to_executor = dies_with_this_process()
        settings.out_dir.mkdir(parents=True, exist_ok=True)
        write_text(settings.out_dir / SCHEDULE_FILE, "")

    def now_s(self) -> float:
        return time.monotonic() - self.clock0

    def loop(self) -> None:
        self.say(f"launching {len(self.pending)} jobs as potluck train --elastic runs "
                 f"({', '.join(f'{n} {s} steps' for n, s in self.steps.items())}; "
                 f"{'emulated' if self.emulate else 'CPU'} ranks) under {self.policy.value}, "
                 f"into {self.settings.out_dir}")
        while self.pending or self.active:
            self._arrivals()
            self._reap()
            if self.changed:
                self.changed = False
                self._decide()
            self._release()
            self._reconcile()
            if not self.runs and self.active and not self.pending and not self._startable():
                raise InfeasibleError(f"jobs {', '.join(j.name for j in self.active)} can "
                                      "never start (no allocation frees up for them)")
            time.sleep(POLL_S)

    def _arrivals(self) -> None:
        scale = self.settings.seconds_per_hour
        while self.pending and self.pending[0].arrival_h * scale <= self.now_s():
            self.active.append(self.pending.pop(0))
            self.changed = True

    def _decide(self) -> None:
        entries = [Active(job, self._allocation(job.name)) for job in self.active]
        decision = _keep_running(allocate(self.policy, entries, self.table),
                                 {n: self._allocation(n) for n in self.runs}, self.spec)
        self.target = assign_machines(self.spec, self.target, decision)
        for job in self.active:
            machines = self.target.get(job.name, ())
            log.debug("%s: %s", job.name, ", ".join(f"{g}.{i}" for g, i in machines) or "waits")

    def _allocation(self, name: str) -> Allocation | None:
        machines = self.target.get(name)
        if not machines:
            return None
        counts: dict[str, int] = {}
        for group, _ in machines:
            counts[group] = counts.get(group, 0) + 1
        return Allocation.of(self.spec, counts)

    def _busy(self, name: str) -> set[str]:
        """Devices another job than ``name`` holds or is still giving back."""
        busy: set[str] = set()
        for other, devices in self.held.items():
            if other != name:
                busy |= devices
        for run in self.runs.values():
            busy |= run.releasing
        return busy

    def _startable(self) -> bool:
        return any(self.target.get(job.name) for job in self.active)

    def _reconcile(self) -> None:
        """Move every active job towards the machines the policy gave it."""
        for job in list(self.active):
            wanted = set(_devices(self.spec, self.target.get(job.name, ())))
            held = self.held.get(job.name, set())
            if job.name in self.runs and held - wanted:
                self._leave(job, held - wanted)
            gained = wanted - self.held.get(job.name, set())
            if gained and not gained & self._busy(job.name):
                if job.name in self.runs:
                    self._join(job, gained)
                else:
                    self._launch(job)

    def _launch(self, job: Job) -> None:
        machines = self.target[job.name]
        run_dir = self.settings.out_dir / job.name
        try:
            plan = self._plan(job, machines)
            save_plan(plan, run_dir / "plan.json")
            with open_append(run_dir / LOG_FILE) as out:
                process = subprocess.Popen(
                    self._command(job, run_dir), stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                    preexec_fn=self.tie_to_executor)
        except (OSError, ConfigError, InfeasibleError) as err:
            self._fail(job, f"could not start: {err}")
            return
        devices = set(_devices(self.spec, machines))
        self.runs[job.name] = _Run(process, run_dir, self.now_s())
        self.held[job.name] = devices
        self._event(job.name, "start", devices, f"{len(plan.devices)} ranks, {plan.layout()}")

    def _plan(self, job: Job, machines: tuple[Machine, ...]) -> Plan:
        """The job's plan on ``machines``, on the whole cluster."""
        from potluck.runtime.elastic.pool import on_whole_cluster

        allocation = self._allocation(job.name)
        assert allocation is not None
        plan = self.table.plan(job.shape, allocation)
        return on_whole_cluster(plan, self.spec, _original_ids(self.spec, machines))

    def _command(self, job: Job, run_dir: Path) -> list[str]:
        s = self.settings
        command = [sys.executable, "-m", "potluck", "train", "--plan", str(run_dir / "plan.json"),
                   "--out", str(run_dir), "--elastic", "--steps", str(self.steps[job.name]),
                   "--checkpoint-every", str(s.checkpoint_every)]
        if s.replan_margin is not None:
            command += ["--replan-margin", str(s.replan_margin)]
        if self.emulate:
            command += ["--emulate", "--dilation", str(s.dilation)]
            if any(not g.type.is_cpu for g in Cluster(self.spec).devices):
                command += ["--stand-in", "tiny"]
        return command

    def _join(self, job: Job, devices: set[str]) -> None:
        run_dir = self.runs[job.name].run_dir
        register(run_dir, load_plan(run_dir / "plan.json"), sorted(devices))
        self.held[job.name] |= devices
        self._event(job.name, "join", devices, "taken at a checkpoint if faster by the margin")

    def _leave(self, job: Job, devices: set[str]) -> None:
        run = self.runs[job.name]
        release(run.run_dir, load_plan(run.run_dir / "plan.json"), sorted(devices))
        self.held[job.name] -= devices
        run.releasing |= devices
        self._event(job.name, "leave", devices, "dropped at its next checkpoint")

    def _release(self) -> None:
        """Devices a running job gave back that its current plan no longer runs."""
        for run in self.runs.values():
            if run.releasing:
                run.releasing -= _running_devices(run.run_dir)

    def _reap(self) -> None:
        """Runs that ended, or ran past the timeout (then stopped)."""
        for name, run in list(self.runs.items()):
            code = run.process.poll()
            if code is None and self.now_s() - run.started_s > self.settings.job_timeout_s:
                _stop([run.process])
                self._end(name, f"stopped after {self.settings.job_timeout_s:g} s (--job-timeout)")
            elif code is not None:
                self._end(name, None if code == 0 else _last_error(run.run_dir, code))

    def _end(self, name: str, error: str | None) -> None:
        job = next(j for j in self.active if j.name == name)
        devices = self.held.pop(name, set())
        del self.runs[name]
        self.target.pop(name, None)
        self.active.remove(job)
        self.changed = True
        if error is None:
            self.finished.append(name)
            self._event(name, "finish", devices, f"{self.steps[name]} steps")
        else:
            self.failed[name] = error
            self._event(name, "fail", devices, error)

    def _fail(self, job: Job, error: str) -> None:
        self.target.pop(job.name, None)
        self.active.remove(job)
        self.changed = True
        self.failed[job.name] = error
        self._event(job.name, "fail", set(), error)

    def _event(self, job: str, action: str, devices: set[str], detail: str) -> None:
        event = ScheduleEvent(round(self.now_s(), 3), job, action, tuple(sorted(devices)), detail)
        self.events.append(event)
        path = self.settings.out_dir / SCHEDULE_FILE
        with open_append(path) as out, writing(path):
            out.write(json.dumps(asdict(event)) + "\n")
        shown = ", ".join(event.devices) or "-"
        self.say(f"{event.time_s:8.1f} s  {job}: {action} {shown}" + (f" ({detail})" if detail else ""))

    def stop_all(self) -> None:
        """Stop every run still going (an interrupt, a SIGTERM, or an error of the
        executor); another SIGTERM or Ctrl-C meanwhile waits until they are stopped."""
        going = [name for name, run in self.runs.items() if run.process.poll() is None]
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            _stop([self.runs[name].process for name in going])
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        for name in going:
            log.warning("%s: stopped (its run directory: %s)", name, self.runs[name].run_dir)

    def outcome(self) -> RunOutcome:
        return RunOutcome(tuple(self.events), tuple(self.finished), dict(self.failed),
                          dict(self.steps), self.settings.out_dir)


def _keep_running(decision: dict[str, Allocation], running: dict[str, Allocation | None],
                  spec: ClusterSpec) -> dict[str, Allocation]:
    """The policy's decision, with running jobs never left without machines: each keeps its
    allocation where the policy gave it none; jobs that then no longer fit wait (newcomers
    first, in reverse order), and if that is not enough the running jobs keep what they hold."""
    held = {name: a for name, a in running.items() if a is not None}
    chosen = {**decision, **{n: a for n, a in held.items() if n not in decision}}
    for name in reversed([n for n in decision if n not in held]):
        if _fits(chosen, spec):
            break
        del chosen[name]
    return chosen if _fits(chosen, spec) else held


def _fits(allocations: dict[str, Allocation], spec: ClusterSpec) -> bool:
    free = capacity(spec)
    for allocation in allocations.values():
        for group, count in allocation.machines:
            free[group] -= count
    return all(count >= 0 for count in free.values())


def _devices(spec: ClusterSpec, machines: Sequence[Machine]) -> list[str]:
    per_node = {g.name: g.gpus_per_node for g in spec.nodes}
    return [device_id(group, index, j) for group, index in machines
            for j in range(per_node[group])]


def _original_ids(spec: ClusterSpec, machines: Sequence[Machine]) -> dict[str, str]:
    """Device ids of the allocation's sub-cluster (each group's machines numbered from 0,
    :func:`~potluck.multijob.allocations.subcluster`) to those of ``machines``."""
    per_node = {g.name: g.gpus_per_node for g in spec.nodes}
    ids, seen = {}, {}
    for group, index in machines:
        local = seen[group] = seen.get(group, -1) + 1
        for j in range(per_node[group]):
            ids[device_id(group, local, j)] = device_id(group, index, j)
    return ids


def _needs_emulation(spec: ClusterSpec) -> bool:
    """Emulate unless every device is a CPU rank of one machine (a plan over several
    machines runs here only emulated)."""
    devices = Cluster(spec).devices
    return any(not d.type.is_cpu for d in devices) or sum(g.count for g in spec.nodes) > 1


def _running_devices(run_dir: Path) -> set[str]:
    """The devices the run in ``run_dir`` trains on now: its newest replan's, else its plan's."""
    from potluck.runtime.elastic.replans import read_replans

    replans = read_replans(run_dir)
    if replans:
        return set(replans[-1]["new_devices"])
    return set(load_plan(run_dir / "plan.json").devices)


def _last_error(run_dir: Path, code: int) -> str:
    """The run's one-line error (potluck's, else the log's last line) and its exit code."""
    path = run_dir / LOG_FILE
    text = read_bounded(path, "log", MAX_LOG_BYTES).decode(errors="replace") if path.is_file() else ""
    lines = text.splitlines()
    lines = [line.strip() for line in lines if line.strip()]
    errors = [line for line in lines if line.startswith("potluck: error:")]
    said = (errors or lines or ["no output"])[-1].removeprefix("potluck: error:").strip()
    return f"exited with {code}: {said} (log: {path})"


def _stop(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Stop runs' whole process groups together: SIGTERM, then SIGKILL to the groups whose
    run is still going after :data:`STOP_GRACE_S`."""
    going = list(processes)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in going:
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for process in going:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        going = [process for process in going if process.poll() is None]
