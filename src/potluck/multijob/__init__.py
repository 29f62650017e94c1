"""Scheduling several training jobs on one mixed cluster (``potluck schedule``).

Jobs (:mod:`~potluck.multijob.jobs`) are planned with potluck's own planner on candidate
allocations of whole machines (:mod:`~potluck.multijob.allocations`,
:mod:`~potluck.multijob.throughput`); a policy (:mod:`~potluck.multijob.policies`: fifo,
equal, and Gavel's heterogeneity-aware throughput and fair) shares the machines among
them at every arrival and completion of an event-driven simulation
(:mod:`~potluck.multijob.simulation`). Synthetic traces compare the policies
(:mod:`~potluck.multijob.trace`); the results are rendered as tables and JSON
(:mod:`~potluck.multijob.report`), a Gantt chart (:mod:`~potluck.multijob.gantt`) and
sbatch scripts (:mod:`~potluck.multijob.slurm`); ``--run`` trains the jobs as separate
elastic ``potluck train`` runs re-allocated by ``potluck join``/``leave``
(:mod:`~potluck.multijob.executor`).
"""

from potluck.multijob.jobs import Job, JobsFile, JobsFileError, JobShape, load_jobs
from potluck.multijob.policies import Policy
from potluck.multijob.simulation import ScheduleResult, simulate
from potluck.multijob.throughput import ThroughputTable
from potluck.multijob.trace import PolicyComparison, compare_policies, synthetic_trace

__all__ = [
    "Job", "JobShape", "JobsFile", "JobsFileError", "Policy", "PolicyComparison",
    "ScheduleResult", "ThroughputTable", "compare_policies", "load_jobs", "simulate",
    "synthetic_trace",
]
