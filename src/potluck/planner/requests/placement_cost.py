"""What a framework's placement costs on this cluster, against potluck's own.

Megatron-LM and DeepSpeed place ranks in launch order and split the blocks evenly
(:class:`~potluck.cluster.execution.Placement`); on a mixed lab that gives a slow card as
many blocks as a fast one. A plan made for such a framework says how much faster the same
framework's traits would train placed as potluck places them (devices chosen per stage,
blocks split by speed), so a user sees what the framework's placement costs on their
hardware, not only which of its layouts is best.
"""

from __future__ import annotations

from dataclasses import replace

from potluck.cluster.execution import Placement
from potluck.cluster.spec import ClusterSpec
from potluck.errors import InfeasibleError
from potluck.model.spec import ModelSpec
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import Plan, TrainingShape


def placement_cost_note(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                        options: SearchOptions, best: Plan) -> str | None:
    """A note for ``best`` (planned in a framework's rank order): its time against the best
    plan with the same traits placed by potluck; None for plans potluck places itself, or
    where no such plan exists."""
    if training.execution.placement is not Placement.RANK_ORDER:
        return None
    planned = replace(training, execution=replace(training.execution, placement=Placement.PLANNED))
    try:
        ours = search(spec, model, planned, replace(options, top_k=1)).best
    except InfeasibleError:
        return None
    theirs_s = best.prediction.iteration_time_s
    ours_s = ours.prediction.iteration_time_s
    if ours_s >= theirs_s:
        return (f"the framework's placement costs nothing here: placed by potluck with the same "
                f"traits the best plan takes {ours_s:.3g} s ({ours.layout()})")
    return (f"the framework's placement (rank order, even split) costs {theirs_s / ours_s:.2f}x: "
            f"placed by potluck with the same traits the best plan takes {ours_s:.3g} s "
            f"({ours.layout()}) against {theirs_s:.3g} s")
