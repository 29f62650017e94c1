"""Where each parameter of a plan lives, and so which replicas' stages reduce gradients together.

A model's parameters come in *units*: the embedding, each transformer block,
the head (final norm and output projection) and, when the output projection
is tied to the embedding, the tied weight, held by both ends of a pipeline.
Every pipeline of a plan holds every unit once, on the stage whose layer
ranges cover it (:func:`holders`). This module is the one answer to "which
stages hold the same parameters", used by

- the runtime's layout (:class:`potluck.runtime.layout.Layout`), which sums
  each unit's gradients over exactly its holders;
- the cost model and the simulator (:func:`replica_stages`), which price one
  gradient collective per stage of the longest pipeline over the stages of
  the other pipelines that hold most of its layers. For identical pipelines
  the two coincide; for pipelines of different depth the price groups whole
  stages where the runtime sums unit by unit.

A tied weight is summed as :class:`potluck.plans.TiedGradSync` says: over all
of its :func:`holders` at once, apart from the stages' rings (potluck's
runtime, the cost model's default), or in each stage's ring and then between
each pipeline's :func:`tied_ends` (Megatron-LM, DeepSpeed).
"""

from __future__ import annotations

from collections import Counter

from potluck.model import counts
from potluck.model.spec import ModelSpec
from potluck.plans import Plan, Stage

EMBED = "embed"
HEAD = "head"
TIED = "embed+head"

StageRef = tuple[int, int]  # (pipeline, stage)


def block_unit(index: int) -> str:
    return f"block.{index}"


def expert_unit(index: int, shard: int) -> str:
    """Block ``index``'s routed experts of shard ``shard`` under expert parallelism: a unit
    of its own, held by the members of every expert group with that shard."""
    return f"block.{index}.experts.{shard}"


def block_index(unit: str) -> int:
    """The block number of a :func:`block_unit` (or :func:`expert_unit`) name."""
    return int(unit.split(".")[1])


def expert_shard(unit: str) -> int | None:
    """The shard of an :func:`expert_unit`, None for any other unit."""
    parts = unit.split(".")
    return int(parts[3]) if len(parts) == 4 and parts[2] == "experts" else None


def parameter_units(model: ModelSpec, ep: int = 1) -> tuple[str, ...]:
    """Every unit of ``model``, in the order one backward pass finishes them reversed; with
    expert parallelism each block's expert shards follow the block."""
    tied = (TIED,) if model.tied_embeddings else ()
    shards = range(ep) if ep > 1 and model.is_moe else ()
    blocks = (unit for i in range(model.num_layers)
              for unit in (block_unit(i), *(expert_unit(i, j) for j in shards)))
    return (EMBED, *blocks, HEAD, *tied)


def stage_holds(stage: Stage, index: int, pp: int, unit: str) -> bool:
    """Whether stage ``index`` of a pipeline of ``pp`` stages holds ``unit``."""
    if unit == EMBED:
        return index == 0
    if unit == HEAD:
        return index == pp - 1
    if unit == TIED:
        return index in (0, pp - 1)
    layer = block_index(unit)
    return any(start <= layer < end for start, end in stage.layer_ranges)


def unit_params(model: ModelSpec, unit: str) -> float:
    """Parameters of one unit of ``model`` (the whole of it, across TP ranks)."""
    if unit in (EMBED, TIED):
        return counts.embedding_params(model)
    if unit == HEAD:
        return counts.head_params(model, separate_from_embedding=True)
    return counts.block_params(model)


def holders(plan: Plan, unit: str) -> tuple[StageRef, ...]:
    """``(pipeline, stage)`` of every stage that holds ``unit``, in plan order."""
    return tuple(
        (k, i)
        for k, pipeline in enumerate(plan.pipelines)
        for i, stage in enumerate(pipeline.stages)
        if stage_holds(stage, i, pipeline.pp, unit)
    )


def island_members(plan: Plan) -> list[tuple[int, ...]]:
    """The pipelines of each island that sums gradients every step: one group of every
    pipeline unless the plan's islands synchronize rarely (:meth:`Plan.island_pipelines`)."""
    if not plan.islands.split:
        return [tuple(range(plan.dp))]
    return [plan.islands.members(i, plan.dp) for i in range(plan.islands.count)]


def by_island(plan: Plan, refs: tuple[StageRef, ...] | list[StageRef]
              ) -> list[tuple[StageRef, ...]]:
    """``refs`` split by the island of their pipeline (one part without islands), empty
    parts left out."""
    parts = [tuple(ref for ref in refs if ref[0] in members) for members in island_members(plan)]
    return [part for part in parts if part]


def replica_stages(plan: Plan) -> list[tuple[StageRef, ...]]:
    """Per island (:func:`island_members`), per stage of its longest pipeline, that stage
    and, in every other pipeline of the island, the stage that holds most of its blocks (the
    earlier one on a tie): the stages that reduce gradients together every step, as the cost
    model and the simulator price them."""
    return [group for members in island_members(plan)
            for group in _replica_stages(plan, members)]


def _replica_stages(plan: Plan, island: tuple[int, ...]) -> list[tuple[StageRef, ...]]:
    pipelines = plan.pipelines
    lead = max(island, key=lambda k: pipelines[k].pp)
    splits = [tuple(stage.layer_ranges for stage in p.stages) for p in pipelines]
    replica: dict[tuple, int] = {}  # (a pipeline's split, lead stage) -> its stage in that split
    groups = []
    for i, stage in enumerate(pipelines[lead].stages):
        layers = [layer for start, end in stage.layer_ranges for layer in range(start, end)]
        members = [(lead, i)]
        for k in island:
            if k != lead:
                if (splits[k], i) not in replica:
                    replica[(splits[k], i)] = _most_held(_layer_stages(pipelines[k].stages), layers)
                members.append((k, replica[(splits[k], i)]))
        groups.append(tuple(members))
    return groups


def _layer_stages(stages: tuple[Stage, ...]) -> list[int]:
    """The stage of a pipeline that holds each block (what :func:`stage_holds` answers)."""
    owner: dict[int, int] = {}
    for i, stage in enumerate(stages):
        for start, end in stage.layer_ranges:
            owner.update(dict.fromkeys(range(start, end), i))
    return [owner[layer] for layer in range(len(owner))]


def _most_held(layer_stage: list[int], layers: list[int]) -> int:
    counts = Counter(layer_stage[layer] for layer in layers)
    best = max(counts.values())
    return min(j for j, count in counts.items() if count == best)


def tied_ends(plan: Plan) -> list[tuple[StageRef, StageRef]]:
    """Per pipeline of more than one stage, its first and last stage: where a tied embedding
    and its head copy sum their gradients in Megatron-LM's embedding group (none: the tied
    weight needs no sum apart from the stages' rings)."""
    if not plan.model.tied_embeddings:
        return []
    return [((k, 0), (k, p.pp - 1)) for k, p in enumerate(plan.pipelines) if p.pp > 1]
