"""Presenting plans: the JSON summary of ``potluck plan --json`` and the rich tables.

The summary fields are documented in the README; keep the two in step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from potluck.cluster.catalog import DeviceType
from potluck.cluster.execution import describe, placement_text
from potluck.cluster.topology import Cluster
from potluck.model.counts import Recompute, active_params, total_params
from potluck.model.spec import ModelSpec
from potluck.planner.gemm import effective_dtype
from potluck.planner.search import SearchResult
from potluck.plans import DType, Plan, Prediction, plan_to_dict
from potluck.plans.memory import Offload, StageMemory, Swap
from potluck.schedules import schedule_for
from potluck.tables import compact_table
from potluck.units import format_duration

GB = 1e9


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The headline figures of one plan, as in ``potluck plan --json``."""
    prediction = _prediction(plan)
    cluster = Cluster(plan.cluster)
    memory = {m.device: m for m in prediction.memory}
    devices = []
    for device_id in plan.devices:
        device, used = cluster.device(device_id), memory[device_id]
        memory_choice = plan.stage_memory(used.pipeline, used.stage)
        devices.append({
            "id": device_id, "node": device.node, "type": device.type.name,
            "pipeline": used.pipeline, "stage": used.stage,
            "memory_gb": round(used.total_bytes / GB, 3),
            "memory_capacity_gb": round(device.type.memory_bytes / GB, 3),
            "host_gb": round(used.host_bytes / GB, 3),
            "swap": memory_choice.swap.value if memory_choice.swaps else "none",
            "swap_to": _swap_target(memory_choice),
            "swapped_out_gb": round(used.swapped_out_bytes / GB, 3),
            "peer_held_gb": round(used.peer_held_bytes / GB, 3),
            "offloaded_gb": round(used.offloaded_bytes / GB, 3),
            "zero": plan.zero,
        })
    breakdown = prediction.breakdown
    return {
        "layout": plan.layout(),
        "iteration_time_s": prediction.iteration_time_s,
        "tokens_per_s": prediction.tokens_per_s,
        "tflops_per_gpu": prediction.tflops_per_gpu,
        "mfu": prediction.mfu,
        "peak_memory_gb": prediction.peak_memory_bytes / GB,
        "num_gpus": plan.num_gpus,
        "unused_devices": list(plan.unused_devices),
        "micro_batch_size": plan.pipelines[0].micro_batch_size,
        "recompute": plan.recompute.value,
        "zero": plan.zero,
        "stage_memory": [[plan.stage_memory(k, i).describe(plan.recompute)
                          for i in range(p.pp)] for k, p in enumerate(plan.pipelines)],
        "host_memory": [{"node": h.node, "used_gb": round(h.used_bytes / GB, 3),
                         "reserve_gb": round(h.reserve_bytes / GB, 3),
                         "capacity_gb": round(h.capacity_bytes / GB, 3)}
                        for h in prediction.host_memory],
        "schedule": plan.schedule.value,
        "schedule_notes": schedule_notes(plan),
        "execution": describe(plan.training.execution),
        "placement": placement_text(plan.training.execution),
        "communication": comm_text(plan),
        "model_notes": model_notes(plan.model, plan.ep),
        "dtype": plan.training.dtype.value,
        "dtype_notes": plan_dtype_notes(plan),
        "breakdown_s": {k: getattr(breakdown, k) for k in breakdown.__dataclass_fields__},
        "devices": devices,
        "notes": list(plan.notes),
    }


def result_json(result: SearchResult) -> dict[str, Any]:
    """``potluck plan --json``: the best plan's figures, the plan itself, the alternatives."""
    best = result.best
    summary = plan_summary(best)
    summary["search_time_s"] = result.search_time_s
    summary["search_notes"] = list(result.notes)
    summary["candidates"] = result.candidates
    summary["alternatives"] = [
        {k: v for k, v in plan_summary(p).items() if k not in ("devices",)}
        for p in result.plans[1:]
    ]
    summary["plan"] = plan_to_dict(best)
    return summary


def _prediction(plan: Plan) -> Prediction:
    if plan.prediction is None:
        from potluck.planner.evaluate import predict

        return predict(plan)
    return plan.prediction


def render_result(console: Console, result: SearchResult) -> None:
    """The best plan as tables, then its alternatives."""
    best = result.best
    render_plan(console, best)
    if len(result.plans) > 1:
        console.print()
        console.print(_alternatives_table(result.plans))
        for note in same_layout_notes(result.plans):
            console.print(f"[dim]{note}[/dim]")
    console.print(
        f"[dim]searched {result.candidates} candidates in {result.search_time_s:.2f} s[/dim]"
    )


def _count_text(count: int) -> str:
    """A parameter count as people write it: 46.70B, 12.4M, 9,304."""
    if count >= 1e9:
        return f"{count / 1e9:.2f}B"
    return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,}"


def model_notes(model: ModelSpec, ep: int = 1) -> list[str]:
    """What the plan's reader should know about the model: its experts (and how ``ep``
    replicas split them), why it has no tensor parallelism."""
    notes = []
    if model.is_moe:
        notes.append(f"mixture of experts: {model.num_experts} experts, {model.experts_per_token} "
                     f"per token; {_count_text(active_params(model))} of "
                     f"{_count_text(total_params(model))} parameters active")
    if ep > 1:
        notes.append(f"expert parallelism: each group of {ep} replicas splits every block's "
                     f"experts, {model.num_experts // ep} per device; tokens travel to their "
                     "experts and back all-to-all (EP in the breakdown)")
    if model.tp_refusal:
        notes.append(f"no tensor parallelism: {model.tp_refusal}")
    return notes


def schedule_notes(plan: Plan) -> list[str]:
    """How the plan's pipelines run its schedule, where more than its name says it."""
    schedule = schedule_for(plan.schedule)
    notes = {schedule.how_it_runs(p.pp, p.num_micro_batches) for p in plan.pipelines}
    return sorted(note for note in notes if note)


def render_plan(console: Console, plan: Plan) -> None:
    prediction = _prediction(plan)
    shape = plan.training
    console.print(
        f"[bold]{escape(plan.model.name)}[/bold] on [bold]{escape(plan.cluster.name)}[/bold] "
        f"({plan.num_gpus} of {plan.cluster.num_gpus} GPUs): {plan.layout()}, "
        f"micro-batch {plan.pipelines[0].micro_batch_size}, recompute {recompute_text(plan)}, "
        f"{zero_text(plan)}schedule {plan.schedule.value}; global batch {shape.global_batch} x "
        f"{shape.seq_len} tokens, {shape.dtype.value}"
    )
    for note in schedule_notes(plan):
        console.print(f"schedule: {note}", highlight=False)
    console.print(f"execution: {describe(plan.training.execution)}", highlight=False)
    console.print(f"placement: {placement_text(plan.training.execution)}", highlight=False)
    console.print(f"communication: {comm_text(plan)}", highlight=False)
    for note in model_notes(plan.model, plan.ep):
        console.print(f"[dim]{escape(note)}[/dim]")
    tables = [_stage_table(plan, prediction)]
    if not uniform_memory(plan):
        tables.append(_choices_table(plan))
    if _fits_beyond_device(plan, prediction):
        tables += [_device_memory_table(plan, prediction), _host_memory_table(prediction)]
    for table in (*tables, _headline_table(prediction), _breakdown_table(prediction)):
        console.print()
        console.print(table)
    for note in [*plan_dtype_notes(plan), *plan.notes]:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")


def _stage_table(plan: Plan, prediction: Prediction) -> Table:
    cluster = Cluster(plan.cluster)
    memory = {m.device: m.total_bytes for m in prediction.memory}
    table = compact_table("Pipelines and stages",
                          ("pipe", "batch", "stage", "devices", "type", "tp", "layers",
                           "memory GB", "t/µbatch"),
                          left=("devices", "type", "layers"))
    for k, pipeline in enumerate(plan.pipelines):
        for i, stage in enumerate(pipeline.stages):
            device_type = cluster.device(stage.devices[0]).type
            peak = max(memory[d] for d in stage.devices)
            layers = ", ".join(f"{a}-{b - 1}" for a, b in stage.layer_ranges)
            table.add_row(
                str(k) if i == 0 else "",
                f"{pipeline.num_micro_batches}x{pipeline.micro_batch_size}" if i == 0 else "",
                str(i), compact_ids(stage.devices), device_type.name, str(stage.tp), layers,
                f"{peak / GB:.1f}/{device_type.memory_bytes / GB:.0f}",
                format_duration(prediction.stage_times_s[k][i]),
            )
    return table


def _choices_table(plan: Plan) -> Table:
    """Per stage that does not just recompute as the plan says: its recomputation, swap
    and offload (where swaps go: the memory table)."""
    table = compact_table("Memory choices per stage", ("pipe", "stage", "layers", "choices"),
                          left=("layers", "choices"))
    for k, pipeline in enumerate(plan.pipelines):
        for i, stage in enumerate(pipeline.stages):
            layers = ", ".join(f"{a}-{b - 1}" for a, b in stage.layer_ranges)
            table.add_row(str(k), str(i), layers, choices_text(plan.stage_memory(k, i)))
    return table


def uniform_memory(plan: Plan) -> bool:
    """Whether every stage makes the plan-wide choice: recompute ``plan.recompute`` on all
    its blocks, no swap, no offload."""
    return all(plan.stage_memory(k, i).describe(plan.recompute) == plan.recompute.value
               for k, p in enumerate(plan.pipelines) for i in range(p.pp))


def choices_text(memory: StageMemory) -> str:
    """A stage's memory choices in a few characters: ``full x3, host 40%, offload``; where
    a swap goes is in the memory table."""
    mode = memory.recompute or Recompute.NONE
    parts = []
    if mode is not Recompute.NONE:
        blocks = f" x{memory.recompute_blocks}" if memory.recompute_blocks is not None else ""
        parts.append(mode.value + blocks)
    if memory.swaps:
        parts.append(f"{memory.swap.value} {memory.swap_fraction:.0%}")
    if memory.offload is not Offload.NONE:
        parts.append("offload")
    return ", ".join(parts) or "-"


def recompute_text(plan: Plan) -> str:
    """``full``, or ``per stage`` when the stages recompute differently."""
    modes = {(m.recompute, m.recompute_blocks) for m in
             (plan.stage_memory(k, i) for k, p in enumerate(plan.pipelines) for i in range(p.pp))}
    if len(modes) == 1:
        mode, blocks = modes.pop()
        if blocks is None:
            return (mode or plan.recompute).value
    return "per stage"


def zero_text(plan: Plan) -> str:
    return f"ZeRO-{plan.zero}, " if plan.zero else ""


COMM_NAMES = {"split_p2p_channels": "split pipeline channels",
              "dp_priority_schedule": "data-parallel priority schedule",
              "sparse_embedding_grads": "sparse embedding gradients"}


def comm_text(plan: Plan) -> str:
    """The communication scheduling a plan uses, e.g. ``split pipeline channels; TP overlap
    (2 sub-batches) on 2 of 4 stages``, or ``none``."""
    parts = [text for name, text in COMM_NAMES.items() if getattr(plan.comm, name)]
    stages = [s.comm for p in plan.pipelines for s in p.stages]
    by_chunks: dict[int, int] = {}
    for comm in stages:
        if comm.tp_overlap_chunks > 1:
            by_chunks[comm.tp_overlap_chunks] = by_chunks.get(comm.tp_overlap_chunks, 0) + 1
    for chunks, count in sorted(by_chunks.items()):
        parts.append(f"TP overlap ({chunks} sub-batches) on {count} of {len(stages)} stages")
    kept = sum(comm.recompute_keeps_comm and comm.tp_overlap_chunks == 1 for comm in stages)
    if kept:
        parts.append(f"recomputation keeping communication on {kept} of {len(stages)} stages")
    return "; ".join(parts) or "none"


def _swap_target(memory: StageMemory) -> str | None:
    if not memory.swaps:
        return None
    if memory.swap is Swap.HOST:
        return "host"
    if memory.swap is Swap.HYBRID:
        return f"host {memory.host_share:.0%} + {memory.swap_peer}"
    return memory.swap_peer


def _fits_beyond_device(plan: Plan, prediction: Prediction) -> bool:
    """Whether the plan puts anything beyond its devices' own memory (swap, offload) or
    shards more than the optimizer (ZeRO-2/3)."""
    return plan.zero >= 2 or any(m.host_bytes or m.peer_held_bytes or m.swapped_out_bytes
                                 for m in prediction.memory)


def _device_memory_table(plan: Plan, prediction: Prediction) -> Table:
    """Per device: memory used of available, what it swaps where, holds for peers, shards
    (ZeRO, in the plan's heading) and offloads, its host bytes."""
    cluster = Cluster(plan.cluster)
    table = compact_table("Memory per device (GB)", ("device", "used", "swapped out to",
                                                     "for peers", "offloaded", "host"),
                          left=("device", "swapped out to"))
    for m in prediction.memory:
        device = cluster.device(m.device)
        choice = plan.stage_memory(m.pipeline, m.stage)
        swapped = (f"{m.swapped_out_bytes / GB:.1f} {_swap_target(choice)}"
                   if m.swapped_out_bytes else "-")
        table.add_row(
            m.device, f"{m.total_bytes / GB:.1f}/{device.type.memory_bytes / GB:.0f}", swapped,
            f"{m.peer_held_bytes / GB:.1f}" if m.peer_held_bytes else "-",
            f"{m.offloaded_bytes / GB:.1f}" if m.offloaded_bytes else "-",
            f"{m.host_bytes / GB:.1f}",
        )
    return table


def _host_memory_table(prediction: Prediction) -> Table:
    table = compact_table("Host memory per machine", ("machine", "used GB", "reserve GB",
                                                      "capacity GB"), left=("machine",))
    for host in prediction.host_memory:
        table.add_row(host.node, f"{host.used_bytes / GB:.1f}", f"{host.reserve_bytes / GB:.0f}",
                      f"{host.capacity_bytes / GB:.0f}")
    return table


def _headline_table(prediction: Prediction) -> Table:
    table = compact_table("Predicted iteration",
                          ("iteration", "tokens/s", "TFLOPS/GPU", "MFU", "peak memory"))
    table.add_row(
        format_duration(prediction.iteration_time_s), f"{prediction.tokens_per_s:,.0f}",
        f"{prediction.tflops_per_gpu:.1f}", f"{prediction.mfu:.1%}",
        f"{prediction.peak_memory_bytes / GB:.1f} GB",
    )
    return table


def _breakdown_table(prediction: Prediction) -> Table:
    """The iteration's critical path by kind of work."""
    b = prediction.breakdown
    columns = [("compute", b.compute_s), ("bubble", b.bubble_s), ("TP", b.tp_s),
               *([("EP", b.ep_s)] if b.ep_s else []), ("PP", b.pp_s), ("DP", b.dp_s),
               ("optimizer", b.optimizer_s), *([("outer", b.outer_s)] if b.outer_s else [])]
    table = compact_table("Where the time goes (critical path)", tuple(n for n, _ in columns))
    table.add_row(*(format_duration(x) for _, x in columns))
    return table


def _alternatives_table(plans: tuple[Plan, ...]) -> Table:
    table = compact_table("Best alternatives",
                          ("#", "layout", "µb", "recompute", "GPUs", "iteration", "tokens/s",
                           "MFU", "peak GB"),
                          left=("layout",))
    for rank, plan in enumerate(plans, start=1):
        p = _prediction(plan)
        table.add_row(
            str(rank), plan.layout(), str(plan.pipelines[0].micro_batch_size),
            recompute_text(plan), str(plan.num_gpus), format_duration(p.iteration_time_s),
            f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", f"{p.peak_memory_bytes / GB:.1f}",
        )
    return table


def same_layout_notes(plans: tuple[Plan, ...]) -> list[str]:
    """For alternatives that share a layout and micro-batch size, what tells them apart:
    the order of their stages (the first pipeline's node groups)."""
    groups: dict[tuple[str, int, str], list[int]] = {}
    for rank, plan in enumerate(plans, start=1):
        key = (plan.layout(), plan.pipelines[0].micro_batch_size, plan.recompute.value)
        groups.setdefault(key, []).append(rank)
    notes = []
    for ranks in groups.values():
        orders = {rank: stage_order(plans[rank - 1]) for rank in ranks}
        if len(set(orders.values())) > 1:
            notes.extend(f"#{rank} stage order: {order}" for rank, order in orders.items())
    return notes


def dtype_notes(requested: DType, device_types: Iterable[DeviceType]) -> list[str]:
    """One line per dtype some device types compute in instead of ``requested``, and why:
    ``v100-32g computes in fp16, not bf16: no bf16``."""
    groups: dict[tuple[str, str], list[str]] = {}
    for device_type in sorted({t.name: t for t in device_types}.values(), key=lambda t: t.name):
        dtype = effective_dtype(device_type, requested)
        if dtype is not requested:
            groups.setdefault((dtype.value, _why(device_type, requested)), []).append(device_type.name)
    return [f"{', '.join(names)} compute{'s' if len(names) == 1 else ''} in {dtype}, "
            f"not {requested.value}: {why}" for (dtype, why), names in groups.items()]


def _why(device_type: DeviceType, requested: DType) -> str:
    if device_type.is_cpu:
        return "CPU ranks train in fp32"
    if requested is DType.BF16:
        return "no bf16 support"
    return "no TF32 tensor cores"


def plan_dtype_notes(plan: Plan) -> list[str]:
    """:func:`dtype_notes` for the device types a plan uses."""
    cluster = Cluster(plan.cluster)
    return dtype_notes(plan.training.dtype, (cluster.device(d).type for d in plan.devices))


def stage_order(plan: Plan) -> str:
    """The node groups of the first pipeline's stages in order, runs counted:
    ``box3090 x2, a100 x2``."""
    cluster = Cluster(plan.cluster)
    runs: list[tuple[str, int]] = []
    for stage in plan.pipelines[0].stages:
        group = cluster.device(stage.devices[0]).group
        if runs and runs[-1][0] == group:
            runs[-1] = (group, runs[-1][1] + 1)
        else:
            runs.append((group, 1))
    return ", ".join(name if count == 1 else f"{name} x{count}" for name, count in runs)


def compact_ids(ids: tuple[str, ...]) -> str:
    """``('a.0:0', 'a.0:1', 'a.0:2')`` -> ``a.0:0-2``."""
    if len(ids) == 1:
        return ids[0]
    node = ids[0].rsplit(":", 1)[0]
    locals_ = [int(i.rsplit(":", 1)[1]) for i in ids]
    same_node = all(i.rsplit(":", 1)[0] == node for i in ids)
    contiguous = locals_ == list(range(locals_[0], locals_[0] + len(ids)))
    if same_node and contiguous:
        return f"{node}:{locals_[0]}-{locals_[-1]}"
    return ",".join(ids)
