"""Layouts placed in a framework's rank order (:attr:`potluck.plans.Placement.RANK_ORDER`).

Megatron-LM and DeepSpeed do not choose devices: they number the processes in launch
order (the hostfile's machines in order, each machine's GPUs in order) and lay the
parallel dimensions over those ranks with tensor parallelism fastest, then data
parallelism, then the pipeline. Replica ``d`` of stage ``s`` holds the ``tp`` ranks from
``(s * dp + d) * tp`` on:

- Megatron-LM ``megatron/core/parallel_state.initialize_model_parallel`` (order
  ``tp-dp-pp``: with 16 GPUs, tp 2 and pp 4, the tensor groups are [0, 1], [2, 3], ...,
  the data groups [0, 2], [1, 3], [4, 6], ... and the pipelines [0, 4, 8, 12], ...);
- DeepSpeed ``runtime/pipe/topology.PipeModelDataParallelTopology`` (axes ``pipe``,
  ``data``, ``model`` in row-major order: the same ranks).

Launch order is the hostfile's, which the user writes: :func:`launch_orders` tries the
cluster file's order (node groups as listed, their machines, their GPUs:
:attr:`potluck.cluster.topology.Cluster.devices`) and the node groups fastest first (then
by memory), each cut after every group, since a framework user may leave the slower
machines out of the hostfile. A pinned layout runs on the first ``tp x pp x dp`` devices
of an order (the framework launched on that many); an unpinned one on all of a cut. The
blocks are split evenly, the batch too (``FamilySetting.uniform``); pipelines whose stages
sit on different GPU types are timed as separate families that share that even split.
``--partition`` and TP pinned per node group do not apply: the framework decides both.
"""

from __future__ import annotations

from collections.abc import Callable

from potluck.cluster.catalog import DeviceType
from potluck.cluster.topology import Cluster, Device
from potluck.model.spec import ModelSpec
from potluck.planner.options import SearchOptions, micro_batch_sizes
from potluck.planner.pinned import PinnedShape
from potluck.planner.space import MAX_TP, Unit
from potluck.schedules import schedule_for

Pipelines = tuple[tuple[Unit, ...], ...]


def launch_order(cluster: Cluster, options: SearchOptions) -> tuple[Device, ...]:
    """The devices in the cluster file's order, only those of the node groups ``options``
    allows."""
    return tuple(d for d in cluster.devices
                 if options.groups is None or d.group in options.groups)


def launch_orders(cluster: Cluster, options: SearchOptions,
                  speed: Callable[[DeviceType], float]) -> list[tuple[Device, ...]]:
    """Hostfiles the framework could be launched with: the node groups in the cluster file's
    order and fastest first (``speed`` per GPU, then memory), each cut after every group; a
    layout pinned in full takes the first devices of the two whole orders."""
    devices = launch_order(cluster, options)
    groups = list(dict.fromkeys(d.group for d in devices))
    kind = {g.name: cluster.spec.device_type(g.gpu) for g in cluster.spec.nodes}
    fastest = sorted(groups, key=lambda g: (-speed(kind[g]), -kind[g].memory_bytes, g))
    pinned = bool(options.tp and options.pp and options.dp)
    cuts = [len(groups)] if pinned else range(1, len(groups) + 1)
    orders = [tuple(d for g in ranked[:k] for d in devices if d.group == g)
              for ranked in (groups, fastest) for k in cuts]
    return list(dict.fromkeys(orders))


def rank_order_shapes(devices: tuple[Device, ...], model: ModelSpec, options: SearchOptions,
                      global_batch: int) -> list[PinnedShape]:
    """Every (tp, pp, dp) the pins allow over ``devices``: all of them unless tp, pp and dp
    are all pinned (then the first tp x pp x dp), every tensor-parallel group inside one
    machine, the batch split evenly over the replicas into micro-batches the schedule runs."""
    return [shape for shape in _products(devices, model, options)
            if _batch_problem(shape, global_batch, options) is None]


def _products(devices: tuple[Device, ...], model: ModelSpec,
              options: SearchOptions) -> list[PinnedShape]:
    """The (tp, pp, dp) whose product is the ranks launched, before the batch is looked at."""
    virtual = schedule_for(options.pipeline_schedule).chunks(options.virtual_stages)
    pinned = options.tp and options.pp and options.dp
    world = options.tp * options.pp * options.dp if pinned else len(devices)
    if world > len(devices):
        return []
    shapes = []
    for tp in [options.tp] if options.tp else [t for t in (1, 2, 4, 8) if t <= MAX_TP]:
        if not model.splits_by(tp) or world % tp:
            continue
        for pp in [options.pp] if options.pp else range(1, model.num_layers // virtual + 1):
            dp, rest = divmod(world, tp * pp)
            if rest or dp < 1 or (options.dp and dp != options.dp):
                continue
            if pp * virtual <= model.num_layers and _tp_inside_machines(devices, tp, world):
                shapes.append(PinnedShape(tp, pp, dp))
    return shapes


def _batch_problem(shape: PinnedShape, global_batch: int, options: SearchOptions) -> str | None:
    """Why the framework cannot split ``global_batch`` over the shape's replicas: evenly,
    into micro-batches its schedule runs, at any micro-batch size the search tries (the
    reason at the smallest); None when one size works."""
    schedule = schedule_for(options.pipeline_schedule)
    virtual = schedule.chunks(options.virtual_stages)
    split = f"dp {shape.dp} (tp {shape.tp} x pp {shape.pp})"
    reasons = []
    for micro_batch in micro_batch_sizes(options, global_batch):
        micro_batches = global_batch // micro_batch
        if micro_batches % shape.dp:
            reasons.append(f"{split} needs the {micro_batches} micro-batches of {micro_batch} to "
                           f"split evenly over {shape.dp} replicas; use a global batch that is "
                           f"a multiple of {shape.dp * micro_batch}")
            continue
        problem = schedule.problem(micro_batches // shape.dp, shape.pp, virtual)
        if problem is None:
            return None
        reasons.append(f"{split} leaves {micro_batches // shape.dp} micro-batches of "
                       f"{micro_batch} per replica, and {problem}")
    return reasons[0] if reasons else f"{split}: no micro-batch size divides the global batch"


def _tp_inside_machines(devices: tuple[Device, ...], tp: int, world: int) -> bool:
    return all(len({d.node for d in devices[start:start + tp]}) == 1
               for start in range(0, world, tp))


def rank_order_pipelines(devices: tuple[Device, ...], shape: PinnedShape) -> Pipelines:
    """The ``dp`` pipelines of ``shape`` in rank order: replica ``d`` of stage ``s`` on the
    ``tp`` devices from ``(s * dp + d) * tp`` on."""
    tp, pp, dp = shape.tp, shape.pp, shape.dp

    def unit(stage: int, replica: int) -> Unit:
        start = (stage * dp + replica) * tp
        group = devices[start:start + tp]
        return Unit(group[0].group, group[0].node_index, group)

    return tuple(tuple(unit(s, d) for s in range(pp)) for d in range(dp))


def rank_order_refusal(orders: list[tuple[Device, ...]], model: ModelSpec,
                       options: SearchOptions, global_batch: int) -> str | None:
    """Why no layout in rank order exists over any of the hostfiles ``orders``, before memory
    is looked at (said of the largest); None when some does."""
    if any(rank_order_shapes(devices, model, options, global_batch) for devices in orders):
        return None
    devices = max(orders, key=len)
    sizes = sorted({len(order) for order in orders})
    products = _products(devices, model, options)
    if products:
        reasons = "; ".join(str(_batch_problem(shape, global_batch, options)) for shape in products)
        return (f"rank order: the framework uses all {products[0].tp * products[0].pp * products[0].dp} "
                f"ranks it launches and splits the batch evenly: {reasons}")
    world = len(devices)
    if options.tp and options.pp and options.dp:
        world = options.tp * options.pp * options.dp
        if world > len(devices):
            return (f"rank order: tp {options.tp} x pp {options.pp} x dp {options.dp} = {world} "
                    f"ranks, the cluster has {len(devices)} devices; pin smaller degrees")
    if options.tp and world % options.tp == 0 and not _tp_inside_machines(devices, options.tp,
                                                                           world):
        return (f"rank order: tensor-parallel groups of {options.tp} consecutive ranks span "
                "two machines in the cluster file's order; pin a --tp that divides every "
                "machine's GPU count")
    counts = " or ".join(str(n) for n in sizes) if not options.dp or not options.pp \
        else str(world)
    return (f"rank order: no tp x pp x dp with the pins multiplies to the {counts} devices "
            "of a hostfile (the framework uses every rank it launches: the node groups in "
            "order or fastest first, cut after a group); pin degrees whose product is one "
            "of them")
