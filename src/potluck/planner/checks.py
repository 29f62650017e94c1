"""Input checks and explanations for requests the search cannot satisfy.

Every message is one line that says what is wrong and what would help.
"""

from __future__ import annotations

from potluck.cluster.topology import Cluster
from potluck.errors import ConfigError
from potluck.model import counts
from potluck.model.counts import Recompute
from potluck.model.sharding import heads_problem
from potluck.model.spec import ModelSpec, check_seq_len
from potluck.planner.cost import GPU_RUNTIME_OVERHEAD_BYTES, CostModel
from potluck.planner.formulas import StateSharding
from potluck.planner.options import Partition, SearchOptions
from potluck.planner.space import tp_options
from potluck.plans import Plan, TrainingShape
from potluck.plans.feasibility import explicit_tp_model_problem, zero3_schedule_problem
from potluck.plans.memory import Offload
from potluck.schedules import AUTO_NOTE
from potluck.units import whole_number

GB = 1e9


def _check_overlap_chunks(training: TrainingShape, options: SearchOptions) -> None:
    """Sub-batches forced by the execution must divide a pinned micro-batch of TP stages."""
    chunks = training.execution.tp_overlap_chunks
    size = options.micro_batch_size
    if chunks and chunks > 1 and size and size % chunks and (options.tp or 2) > 1:
        raise ConfigError(
            f"the execution's tp_overlap_chunks {chunks} does not divide --micro-batch-size "
            f"{size}; pin a multiple of {chunks}, or set tp_overlap_chunks to auto or 1")


def _check_explicit_tp(model: ModelSpec, training: TrainingShape) -> None:
    """TP overlap and recomputation keeping communication, forced on, need blocks the
    explicit TP executor runs."""
    execution = training.execution
    forced = (execution.tp_overlap_chunks or 1) > 1 or execution.recompute_keeps_comm
    problem = explicit_tp_model_problem(model) if forced else None
    if problem:
        raise ConfigError(
            f"the execution forces TP overlap or recomputation keeping communication, but "
            f"{problem}; set tp_overlap_chunks and recompute_keeps_comm to auto")


def _check_ep(model: ModelSpec, options: SearchOptions) -> None:
    """A pinned expert-parallel degree needs routed experts it divides, and replicas."""
    ep = options.ep
    _check_at_least_one("--ep", ep)
    if ep is None or ep == 1:
        return
    if not model.is_moe:
        raise ConfigError(f"--ep {ep} splits routed experts and {model.name} has none; "
                          "leave --ep out")
    if model.num_experts % ep:
        raise ConfigError(f"--ep {ep} does not divide {model.name}'s {model.num_experts} "
                          f"experts; use a divisor of {model.num_experts}")
    if options.dp is not None and options.dp % ep:
        raise ConfigError(f"--ep {ep} does not divide --dp {options.dp}; use a divisor of it")


def check_request(cluster: Cluster, model: ModelSpec, training: TrainingShape,
                  options: SearchOptions) -> None:
    """Reject requests that no plan could satisfy, before searching."""
    batch = training.global_batch
    _check_at_least_one("--global-batch", batch)
    _check_at_least_one("--seq-len", training.seq_len)
    for flag, pin in (("--pp", options.pp), ("--dp", options.dp),
                      ("--micro-batch-size", options.micro_batch_size)):
        _check_at_least_one(flag, pin)
    check_seq_len(model, training.seq_len)
    _check_tp(cluster, model, options.tp)
    _check_ep(model, options)
    if options.pp is not None and options.pp > model.num_layers:
        raise ConfigError(
            f"--pp {options.pp} is more stages than {model.name}'s {model.num_layers} layers"
        )
    if options.micro_batch_size and batch % options.micro_batch_size:
        raise ConfigError(
            f"global batch {batch} is not a multiple of --micro-batch-size "
            f"{options.micro_batch_size}; use a multiple of it"
        )
    _check_overlap_chunks(training, options)
    _check_explicit_tp(model, training)
    if options.dp is not None:
        _check_batch_over_replicas(batch, options)
    _check_zero_replicas(options)
    if options.groups is not None and not options.groups:
        raise ConfigError("no node groups left to plan on")
    _check_device_count(cluster, options)
    _check_units(cluster, model, options)


ZERO_SHARDS = {1: "optimizer states", 2: "optimizer states and gradients",
               3: "optimizer states, gradients and parameters"}


def _check_zero_replicas(options: SearchOptions) -> None:
    """ZeRO shards over data-parallel replicas: pinned with ``--dp 1`` it cannot do anything;
    ZeRO-3 over several pinned replicas needs a schedule FSDP2 runs."""
    if options.zero and options.dp == 1:
        raise ConfigError(
            f"--zero {options.zero} shards the {ZERO_SHARDS[options.zero]} over data-parallel "
            "replicas and --dp 1 leaves one replica, so it would do nothing; drop --zero, or "
            "pin --dp 2 or more"
        )
    problem = zero3_schedule_problem(options.pipeline_schedule) if options.zero == 3 else None
    if problem and options.dp is not None and options.dp > 1:
        raise ConfigError(f"--dp {options.dp}: {problem}")


def pin_notes(plan: Plan, options: SearchOptions) -> tuple[str, ...]:
    """What the request means for ``plan``: a pin it does not act on (``--zero N`` over one
    data-parallel replica shards nothing: the plan is as it would be without the pin), and
    the schedule ``--schedule auto`` chose where some pipeline has stages to schedule."""
    notes = []
    if options.zero and plan.dp == 1:
        notes.append(f"--zero {options.zero} has no effect on this plan: it has one "
                     f"data-parallel replica (dp=1), so there is nothing to shard the "
                     f"{ZERO_SHARDS[options.zero]} over (its memory and time are those "
                     "without ZeRO)")
    if options.schedule is None and any(p.pp > 1 for p in plan.pipelines):
        notes.append(AUTO_NOTE)
    return tuple(notes)


def _check_batch_over_replicas(batch: int, options: SearchOptions) -> None:
    """Every pinned replica runs at least one micro-batch; the uniform baseline gives each
    the same number."""
    dp, micro_batch = options.dp or 1, options.micro_batch_size or 1
    step = dp * micro_batch
    sizes = f"--dp {dp} x --micro-batch-size {micro_batch}" if options.micro_batch_size else f"--dp {dp}"
    if batch < step:
        raise ConfigError(
            f"global batch {batch} cannot be split over --dp {dp} replicas ({sizes} = {step} "
            f"sequences at least); use a global batch of at least {step}"
            + (f" or --micro-batch-size {_largest_divisor(batch, batch // dp)}"
               if micro_batch > 1 and batch >= dp else "")
        )
    if options.partition is Partition.UNIFORM and batch % step:
        below, above = batch // step * step, (batch // step + 1) * step
        raise ConfigError(
            f"global batch {batch} cannot be split evenly over --dp {dp} replicas: "
            f"--partition uniform needs a multiple of {sizes} = {step}; use {below} or {above}"
        )


def _check_at_least_one(flag: str, value: int | None) -> None:
    """A count the user gave: from 1 to :data:`potluck.units.MAX_COUNT`."""
    if value is not None:
        whole_number(value, flag)


def _check_device_count(cluster: Cluster, options: SearchOptions) -> None:
    """Every replica has ``pp`` stages of at least ``tp`` devices each."""
    pins = {"--dp": options.dp, "--pp": options.pp, "--tp": options.tp}
    needed = (options.dp or 1) * (options.pp or 1) * (options.tp or 1)
    available = len(cluster.devices)
    if needed > available:
        given = ", ".join(f"{flag} {value}" for flag, value in pins.items() if value is not None)
        raise ConfigError(
            f"{given} asks for at least {needed} devices, the cluster has {available}; "
            "pin smaller degrees or add devices"
        )


def _check_units(cluster: Cluster, model: ModelSpec, options: SearchOptions) -> None:
    """A pinned TP degree needs ``pp x dp`` groups of ``tp`` GPUs inside one machine."""
    if options.tp is None or (options.pp is None and options.dp is None):
        return
    groups = [g for g in cluster.spec.nodes if options.groups is None or g.name in options.groups]
    holders = [g for g in groups if tp_options(g, model, options.tp)]
    units = sum(g.count * (g.gpus_per_node // options.tp) for g in holders)
    needed = (options.pp or 1) * (options.dp or 1)
    if needed > units:
        where = ", ".join(f"{g.name}: {g.count} x {g.gpus_per_node // options.tp}"
                          for g in holders)
        raise ConfigError(
            f"{_pins(options)} needs {needed} groups of {options.tp} GPUs inside one machine, "
            f"the cluster's machines hold {units} ({where}); pin a smaller --tp, --pp or --dp"
        )


def _check_tp(cluster: Cluster, model: ModelSpec, tp: int | None) -> None:
    if tp is None:
        return
    if tp < 1:
        raise ConfigError("--tp must be at least 1")
    if tp > 1 and model.tp_refusal:
        raise ConfigError(f"--tp {tp}: {model.name} is planned without tensor parallelism "
                          f"({model.tp_refusal}); use --tp 1")
    problem = heads_problem(tp, model.num_heads, model.num_kv_heads, f"{model.name}'s")
    if problem:
        raise ConfigError(f"--tp {tp} {problem}")
    if not any(g.gpus_per_node % tp == 0 for g in cluster.spec.nodes):
        sizes = sorted({g.gpus_per_node for g in cluster.spec.nodes})
        raise ConfigError(
            f"--tp {tp} does not fit inside any machine (GPUs per machine: {sizes}); "
            "tensor parallelism stays inside a machine"
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


def states_fit_gpus(cluster: Cluster, model: ModelSpec, training: TrainingShape) -> bool:
    """Whether the devices could hold the model's weights and gradients at the least (the
    optimizer offloaded, everything sharded): below that no plan fits, whatever host
    memory there is."""
    return _least_states_bytes(cluster, model, training) <= _usable_bytes(cluster)


def explain_infeasible(cluster: Cluster, model: ModelSpec, training: TrainingShape,
                       options: SearchOptions) -> str:
    """Why no plan fits, with how much memory is missing and what would help: the states
    left on the devices at the least (16-bit weights and gradients, the optimizer offloaded
    and everything sharded, ZeRO-3 with ZeRO-Offload) against all devices' memory. What it
    suggests leaves out what the search has tried already (a technique left to it) and
    what is pinned; it names the pins that keep lighter choices out."""
    params = counts.total_params(model)
    cost = CostModel.for_training(cluster, model, training)
    states_unsharded = params * cost.state_layout(cluster.devices[0].type).total
    states = _least_states_bytes(cluster, model, training)
    usable = _usable_bytes(cluster)
    if states > usable:
        missing = states - usable
        largest = max(cluster.devices, key=lambda d: d.type.memory_bytes).type
        return (
            f"{model.name} ({params / 1e9:.1f}B parameters) needs {states / GB:.0f} GB for its "
            f"weights and gradients even with the optimizer offloaded and ZeRO-3 "
            f"({states_unsharded / GB:.0f} GB with Adam states on the GPUs), the cluster has "
            f"{usable / GB:.0f} GB usable: add at least {missing / GB:.0f} GB of GPU memory "
            f"(e.g. {max(1, int(-(-missing // largest.memory_bytes)))} more "
            f"{largest.name}) or choose a smaller model"
        )
    limiting, lighter = _limiting_pins(options)
    hint = f"drop the pins that keep lighter choices out ({limiting}), or " if limiting else ""
    hint += f"pin the lightest instead ({lighter}), or " if lighter else ""
    return (
        f"no layout of {model.name} fits in memory with global batch {training.global_batch} "
        f"and sequence length {training.seq_len} (model states: {states_unsharded / GB:.0f} GB "
        f"with Adam states on the GPUs, {states / GB:.0f} GB with the optimizer offloaded and "
        f"sharded; the GPUs have {usable / GB:.0f} GB usable, and none of the layouts tried "
        f"fit with {_what_was_tried(options)}); {hint}use a shorter --seq-len or more GPUs"
    )


def _least_states_bytes(cluster: Cluster, model: ModelSpec, training: TrainingShape) -> float:
    """16-bit weights and gradients of the whole model: what stays on the devices with the
    optimizer offloaded and everything sharded."""
    cost = CostModel.for_training(cluster, model, training)
    least = cost.state_layout(cluster.devices[0].type, StateSharding(offload=True))
    return counts.total_params(model) * (least.weights + least.grads)


def _usable_bytes(cluster: Cluster) -> float:
    return sum(max(0.0, d.type.memory_bytes - _overhead(d)) for d in cluster.devices)


def _limiting_pins(options: SearchOptions) -> tuple[str, str]:
    """The pins that keep a lighter choice from the search (every layout pin, every
    technique pinned to other than its lightest setting; any swap pin leaves the other
    swaps out), and those techniques' lightest settings, each as flags."""
    lightest = {"recompute": Recompute.FULL, "zero": 3, "offload": Offload.OPTIMIZER}
    pinned, lighter = [], []
    for name in ("tp", "pp", "dp", "micro_batch_size", "recompute", "zero", "swap", "offload"):
        value = getattr(options, name)
        if value is not None and lightest.get(name) != value:
            pinned.append(f"--{name.replace('_', '-')} {getattr(value, 'value', value)}")
            if name in lightest:
                lighter.append(f"--{name} {getattr(lightest[name], 'value', lightest[name])}")
    return ", ".join(pinned), ", ".join(lighter)


def _what_was_tried(options: SearchOptions) -> str:
    """The memory techniques the search used, as pinned or as it chose them."""
    def technique(name: str, auto: str) -> str:
        value = getattr(options, name)
        return auto if value is None else f"--{name} {getattr(value, 'value', value)}"

    return ", ".join((technique("recompute", "recomputation up to full"),
                      technique("swap", "activation swapping"),
                      technique("zero", "ZeRO up to 3"),
                      technique("offload", "the optimizer offloaded where needed")))


def _overhead(device) -> float:
    return 0.0 if device.type.is_cpu else GPU_RUNTIME_OVERHEAD_BYTES


def _pins(options: SearchOptions) -> str:
    pinned = []
    for name in ("tp", "pp", "dp", "micro_batch_size", "recompute", "zero", "swap", "offload"):
        value = getattr(options, name)
        if value is not None:
            pinned.append(f"--{name.replace('_', '-')} {getattr(value, 'value', value)}")
    return ", ".join(pinned)
