"""Pipeline schedules, one module each, and the one place that maps a schedule's name to it.

Everything potluck knows about a schedule lives in its module
(:mod:`~potluck.schedules.gpipe`, :mod:`~potluck.schedules.one_f_one_b`,
:mod:`~potluck.schedules.interleaved`, :mod:`~potluck.schedules.zero_bubble`):
the micro-batches it keeps in flight (memory), its pipeline time and bubble
(cost model), each rank's op order (simulator), and the torch class that runs
it with that class's constraints (runtime); see :mod:`potluck.schedules.base`.
The planner, the simulator and the runtime ask :func:`schedule_for` and never
compare schedule names. A new schedule is one module with a
:class:`~potluck.schedules.base.PipelineSchedule` subclass, registered here.
"""

from potluck.schedules.base import (
    Action,
    P2PCalls,
    PipelineSchedule,
    RankOrder,
    Schedule,
    local_order,
)
from potluck.schedules.gpipe import GPipe
from potluck.schedules.interleaved import Interleaved
from potluck.schedules.one_f_one_b import OneFOneB
from potluck.schedules.timing import PipelineTime, StageWork
from potluck.schedules.zero_bubble import ZeroBubble

SCHEDULES: dict[Schedule, PipelineSchedule] = {
    schedule.name: schedule for schedule in (GPipe(), OneFOneB(), Interleaved(), ZeroBubble())
}


# What ``--schedule auto`` runs: 1F1B is as fast as GPipe (the same bubble, Narayanan et al.
# SC'21, Sec. 2.2) and holds at most one activation per stage still ahead instead of every
# micro-batch's; with fewer micro-batches than stages it runs as fill and drain, GPipe's
# order, as Megatron-LM's and DeepSpeed's 1F1B do. Interleaved and zero bubble trade more
# P2P traffic and micro-batch constraints for a smaller bubble: pinned, not automatic.
AUTO_SCHEDULE = Schedule.ONE_F_ONE_B
AUTO_NOTE = (f"schedule {AUTO_SCHEDULE.value} chosen by --schedule auto (GPipe's speed, fewer "
             "activations held; fill and drain where a pipeline has fewer micro-batches "
             "than stages); pin another with --schedule")


def schedule_problem(name: Schedule | str, micro_batches: int, stages: int,
                     virtual_stages: int = 1, *, mixed_tp: bool = False) -> str | None:
    """Why schedule ``name`` cannot run this pipeline as laid out (None: it can), and what
    can: the schedules that run it, or, when none does, planning again (its micro-batch
    count and layout are the plan's, which no other flag changes)."""
    shape = (micro_batches, stages, virtual_stages)
    problem = schedule_for(name).problem(*shape, mixed_tp=mixed_tp)
    if problem is None:
        return None
    others = [schedule.value for schedule, runner in SCHEDULES.items()
              if runner.accepts(*shape, mixed_tp=mixed_tp)]
    if not others:
        return (f"{problem}; no schedule runs this pipeline as laid out: make a new plan "
                f"with schedule {schedule_for(name).name.value}")
    names = " or ".join(others)
    return f"{problem}; schedule {names} runs it as laid out"


def schedule_for(name: Schedule | str) -> PipelineSchedule:
    """The schedule called ``name`` (a :class:`Schedule` or its value, e.g. ``"1f1b"``)."""
    found = SCHEDULES.get(name)  # type: ignore[call-overload]  # a member, or its value
    return found if found is not None else SCHEDULES[Schedule(name)]


__all__ = [
    "AUTO_NOTE", "AUTO_SCHEDULE", "SCHEDULES", "Action", "P2PCalls", "PipelineSchedule",
    "PipelineTime", "RankOrder", "Schedule", "StageWork", "local_order", "schedule_for",
    "schedule_problem",
]
