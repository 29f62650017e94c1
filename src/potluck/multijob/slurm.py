"""sbatch scripts for a schedule: each job pinned to the machines the schedule gave it.

Labs already run a cluster manager; potluck does not become one. ``--slurm DIR`` writes,
per job, ``<job>.plan.json`` (its plan on the machines of its main segment, the
allocation it trains most tokens on; :func:`potluck.plans.save_plan`), ``<job>.sbatch``
(``#SBATCH --nodelist`` naming those machines, one task per machine) and
``<job>.launch.sh``, which ``srun`` runs on every machine: it picks that machine's
``torchrun`` command (:func:`potluck.runtime.launch.torchrun.torchrun_commands`, the
commands ``potluck train --print-commands`` prints) by host name. A plan's machines are
numbered from 0 within each node group of the job's sub-cluster; the scripts map them to
the cluster's machines. Host names come from the jobs file's ``hosts:`` section, else
``<group>-<index>``. A job the schedule moves between allocations gets the script of its
main allocation (Slurm cannot move it; a resize would go through ``--resume``).
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from potluck.errors import ConfigError
from potluck.multijob.machines import Machine, machine_name
from potluck.multijob.simulation import HOUR_S, JobOutcome, ScheduleResult
from potluck.plans import save_plan

MASTER_PORT = 29500
CHECKPOINTS_PER_RUN = 20  # a job's run checkpoints this many times, so it can resume


def write_slurm(result: ScheduleResult, folder: str | Path,
                hosts: dict[str, tuple[str, ...]] | None = None) -> list[Path]:
    """Write every job's plan, sbatch and launch scripts into ``folder``; the sbatch paths."""
    folder = Path(folder).resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return [_write_job(outcome, result, folder, hosts or {}) for outcome in result.outcomes]
    except OSError as err:
        raise ConfigError(f"--slurm {str(folder)!r}: cannot write the scripts ({err})") from None


def host_name(machine: Machine, hosts: dict[str, tuple[str, ...]]) -> str:
    group, index = machine
    return hosts[group][index] if group in hosts else f"{group}-{index}"


def _write_job(outcome: JobOutcome, result: ScheduleResult, folder: Path,
               hosts: dict[str, tuple[str, ...]]) -> Path:
    name = outcome.job.name
    plan_path = folder / f"{name}.plan.json"
    save_plan(outcome.main.plan, plan_path)
    launch = folder / f"{name}.launch.sh"
    launch.write_text(launch_script(outcome, plan_path, folder / f"{name}-run", hosts))
    sbatch = folder / f"{name}.sbatch"
    sbatch.write_text(sbatch_script(outcome, result, launch, hosts))
    return sbatch


def plan_hosts(outcome: JobOutcome, hosts: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """The host of each machine id of the job's plan (``<group>.<i>``, numbered within the
    job's sub-cluster) in its main segment."""
    mapped, seen = {}, {}
    for group, index in outcome.main.machines:
        local = seen[group] = seen.get(group, -1) + 1
        mapped[f"{group}.{local}"] = host_name((group, index), hosts)
    return mapped


def sbatch_script(outcome: JobOutcome, result: ScheduleResult, launch: Path,
                  hosts: dict[str, tuple[str, ...]]) -> str:
    """The job's sbatch script: every value from a file shell-quoted (names are checked
    when read: :func:`potluck.cluster.spec.check_host_name`), every comment one line."""
    job, main = outcome.job, outcome.main
    names = [host_name(m, hosts) for m in main.machines]
    moved = (f"the schedule moves it {len(outcome.segments) - 1} times; this pins its main "
             "allocation" if len(outcome.segments) > 1 else "")
    comments = (
        f"potluck schedule ({result.policy.value}): job {job.name}, "
        f"{job.model_name or job.shape.model.name}, {job.tokens:,} tokens",
        f"allocation {main.allocation.label()} "
        f"({', '.join(machine_name(m) for m in main.machines)}); plan {main.plan.layout()}, "
        f"predicted {main.tokens_per_s:,.0f} tokens/s",
        f"predicted from {main.start_s / HOUR_S:.2f} h to {main.end_s / HOUR_S:.2f} h on the "
        "schedule's clock", moved)
    return (
        "#!/bin/bash\n" + "".join(_comment(text) for text in comments if text) +
        f"#SBATCH --job-name={shlex.quote(job.name)}\n"
        f"#SBATCH --nodes={len(names)}\n"
        f"#SBATCH --nodelist={shlex.quote(','.join(names))}\n"
        "#SBATCH --ntasks-per-node=1\n"
        "#SBATCH --exclusive\n"
        f"#SBATCH --output={shlex.quote(job.name + '-%j.out')}\n"
        "set -euo pipefail\n"
        f"srun --nodes={len(names)} --ntasks-per-node=1 bash {shlex.quote(str(launch))}\n"
    )


def _comment(text: str) -> str:
    """``text`` as one comment line of a script, whatever line breaks it holds."""
    return f"# {' '.join(text.split())}\n"


def launch_script(outcome: JobOutcome, plan_path: Path, run_dir: Path,
                  hosts: dict[str, tuple[str, ...]]) -> str:
    """What ``srun`` runs on each machine: that machine's torchrun command."""
    from potluck.data.corpus import builtin_corpus_path
    from potluck.runtime.launch.torchrun import plan_nodes, torchrun_commands
    from potluck.runtime.options import TrainOptions
    from potluck.runtime.worker import worker_args

    plan = outcome.main.plan
    steps = math.ceil(outcome.job.tokens / outcome.job.shape.tokens_per_iteration)
    options = TrainOptions(steps=steps, out_dir=str(run_dir), data=str(builtin_corpus_path()),
                           checkpoint_every=max(1, steps // CHECKPOINTS_PER_RUN))
    by_machine = plan_hosts(outcome, hosts)
    commands = {c.node: c.command for c in torchrun_commands(
        plan, str(plan_path), by_machine[plan_nodes(plan)[0][0]], MASTER_PORT,
        worker_args(options))}
    cases = "".join(
        f"  {shlex.quote(host)}) {commands.get(node, 'true  # no rank of the plan here')} ;;\n"
        for node, host in by_machine.items())
    return (
        "#!/bin/bash\n"
        + _comment(f"One torchrun per machine of job {outcome.job.name}, {steps} steps; srun "
                   "runs it on each machine.") +
        "set -euo pipefail\n"
        'case "${SLURMD_NODENAME:-$(hostname -s)}" in\n' + cases +
        f'  *) echo "potluck: $(hostname -s) is no machine of job "{shlex.quote(outcome.job.name)} >&2; '
        "exit 1 ;;\nesac\n"
    )

