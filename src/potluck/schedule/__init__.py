"""Scheduling several training jobs on one mixed cluster (``potluck schedule``).

Jobs (:mod:`~potluck.schedule.jobs`) are planned with potluck's own planner on candidate
allocations of whole machines (:mod:`~potluck.schedule.allocations`,
:mod:`~potluck.schedule.throughput`); a policy (:mod:`~potluck.schedule.policies`: fifo,
equal, and Gavel's heterogeneity-aware throughput and fair) shares the machines among
them at every arrival and completion of an event-driven simulation
(:mod:`~potluck.schedule.simulation`). Synthetic traces compare the policies
(:mod:`~potluck.schedule.trace`); the results are rendered as tables and JSON
(:mod:`~potluck.schedule.report`), a Gantt chart (:mod:`~potluck.schedule.gantt`) and
sbatch scripts (:mod:`~potluck.schedule.slurm`).
"""

from potluck.schedule.jobs import Job, JobsFile, JobsFileError, JobShape, load_jobs
from potluck.schedule.policies import Policy
from potluck.schedule.simulation import ScheduleResult, simulate
from potluck.schedule.throughput import ThroughputTable
from potluck.schedule.trace import PolicyComparison, compare_policies, synthetic_trace

__all__ = [
    "Job", "JobShape", "JobsFile", "JobsFileError", "Policy", "PolicyComparison",
    "ScheduleResult", "ThroughputTable", "compare_policies", "load_jobs", "simulate",
    "synthetic_trace",
]
