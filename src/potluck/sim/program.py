"""The op graph of pipelines: forwards, backwards and the transfers between stages.

For each pipeline, every rank's ops come in the schedule's order
(:mod:`potluck.sim.orders`) on the rank's stream (its tensor-parallel group),
and each op waits for what it consumes:

- the forward of virtual stage ``s`` waits for the activations of ``s - 1``
  (a ``send_forward`` transfer when the two live on different devices);
- the backward (or input backward) of ``s`` waits for the gradients of
  ``s + 1`` (a ``send_backward`` transfer), the last virtual stage's for its
  own forward;
- a deferred weight backward waits for the input backward of the same chunk
  and micro-batch.

How transfers meet compute follows the runtime. GPipe and 1F1B with one
stage per device run torch's single-stage schedules, whose batched send and
receive calls :mod:`potluck.sim.p2p` reproduces. Interleaved and zero-bubble
schedules run torch's schedule runtime, which posts receives ahead and waits
for sends only at the end of the step: their transfers start as soon as the
data exists. Transfers between two stages are one
:class:`~potluck.sim.network.Flow` with a lane per pair of tensor-parallel
ranks, each carrying its share of the activations, as the cost model prices them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from potluck.sim import p2p
from potluck.sim.engine import Program
from potluck.sim.network import Flow, Network
from potluck.sim.orders import OpKind, schedule_orders
from potluck.sim.workload import ChunkWork, PipelineWorkload

SEND_FORWARD = "send_forward"
SEND_BACKWARD = "send_backward"
MARKER = "p2p_batch"  # zero-duration start or end of a batch of sends and receives


class OpInfo(NamedTuple):
    """What an op is: its kind, stage (the sender's, for a transfer), chunk and micro-batch."""

    kind: str
    stage: int
    chunk: int
    micro_batch: int
    tp_s: float  # compute ops: the part spent in tensor-parallel collectives
    peer: int  # transfers: the receiving stage; -1 for compute ops


@dataclass
class PipelineProgram:
    """Some pipelines' ops in one :class:`Program`, with what each op is."""

    program: Program = field(default_factory=Program)
    info: list[OpInfo] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)  # position of the op's pipeline in the build


def boundary_flows(work: PipelineWorkload, virtual_stages: int,
                   network: Network) -> dict[tuple[int, int], Flow]:
    """The transfer between every pair of stages that pass activations or gradients."""
    p = len(work.stages)
    pairs = {(i, i + 1) for i in range(p - 1)}
    if virtual_stages > 1 and p > 1:
        pairs.add((p - 1, 0))  # chunk c of the last stage feeds chunk c + 1 of the first
    flows = {}
    for a, b in sorted(pairs | {(b, a) for a, b in pairs}):
        flows[(a, b)] = _flow(work, a, b, network)
    return flows


def _flow(work: PipelineWorkload, src: int, dst: int, network: Network) -> Flow:
    sender, receiver = work.stages[src], work.stages[dst]
    lanes = min(len(sender.devices), len(receiver.devices))
    pairs = list(zip(sender.devices[:lanes], receiver.devices[:lanes], strict=True))
    return network.lanes_flow(pairs, sender.send_bytes / lanes)


def build(workloads: list[PipelineWorkload], schedule: str, virtual_stages: int,
          network: Network, overlap_p2p: bool = True) -> PipelineProgram:
    """One program running ``workloads`` side by side (they may share links).

    ``overlap_p2p=False`` makes the schedule runtime's sends blocking (torch's single-stage
    schedules keep their own batching either way).
    """
    built = PipelineProgram()
    for position, work in enumerate(workloads):
        _add_pipeline(built, position, work, schedule, virtual_stages, network, overlap_p2p)
    return built


def _add_pipeline(built: PipelineProgram, position: int, work: PipelineWorkload, schedule: str,
                  virtual_stages: int, network: Network, overlap_p2p: bool) -> None:
    p = len(work.stages)
    if p > 1 and virtual_stages == 1 and schedule in ("gpipe", "1f1b"):
        _add_torch_calls(built, position, work, schedule, network)
    else:
        _add_eager(built, position, work, schedule, virtual_stages, network, overlap_p2p)


def _add_torch_calls(built: PipelineProgram, position: int, work: PipelineWorkload,
                     schedule: str, network: Network) -> None:
    """A single-stage torch schedule with its send and receive batches (:mod:`potluck.sim.p2p`)."""
    program, p, m = built.program, len(work.stages), work.micro_batches
    calls = p2p.one_f_one_b_calls if (schedule == "1f1b" and m >= p) else p2p.gpipe_calls
    stages = []
    for s, stage in enumerate(work.stages):
        compute = program.add_stream()
        pairs = {peer: program.add_stream() for peer in (s - 1, s + 1) if 0 <= peer < p}
        stages.append(p2p.StageCalls(program, compute, pairs, stage.devices[0].type.is_cpu))
        first, chunk = len(program), stage.chunks[0]
        calls(stages[-1], s, p, m, chunk.forward_s, chunk.backward_s)
        what = {op: key for key, op in stages[-1].compute.items()}
        for op in range(first, len(program)):
            built.info.append(_torch_call_info(what.get(op), s, chunk))
            built.owner.append(position)
    flows = boundary_flows(work, 1, network)
    for src, dst, (what, micro_batch), preds, waiters in p2p.match_transfers(stages):
        op = program.add_transfer(flows[(src, dst)], preds)
        kind = SEND_FORWARD if what == "F" else SEND_BACKWARD
        built.info.append(OpInfo(kind, src, 0, micro_batch, 0.0, dst))
        built.owner.append(position)
        for end in waiters:
            program.preds[end].append(op)


def _torch_call_info(key: tuple[str, int] | None, s: int, chunk: ChunkWork) -> OpInfo:
    if key is None:
        return OpInfo(MARKER, s, 0, -1, 0.0, -2)
    if key[0] == "F":
        return OpInfo(OpKind.FORWARD.value, s, 0, key[1], chunk.forward_tp_s, -1)
    return OpInfo(OpKind.BACKWARD.value, s, 0, key[1], chunk.backward_tp_s, -1)


def _add_eager(built: PipelineProgram, position: int, work: PipelineWorkload, schedule: str,
               virtual_stages: int, network: Network, overlap_p2p: bool) -> None:
    """Torch's schedule runtime: receives posted ahead, transfers start when data exists."""
    program, p = built.program, len(work.stages)
    orders = schedule_orders(schedule, p, work.micro_batches, virtual_stages)
    ids: dict[tuple[OpKind, int, int], int] = {}
    for rank, order in enumerate(orders):
        stream = program.add_stream()
        for kind, chunk, micro_batch in order:
            duration_s, tp_s = _duration(kind, work.stages[rank].chunks[chunk])
            ids[(kind, chunk * p + rank, micro_batch)] = program.add_compute(stream, duration_s, [])
            built.info.append(OpInfo(kind.value, rank, chunk, micro_batch, tp_s, -1))
            built.owner.append(position)
    flows = boundary_flows(work, virtual_stages, network)
    last = p * virtual_stages - 1
    first_transfer = len(program)
    for (kind, virtual, micro_batch), op in list(ids.items()):
        program.preds[op] = _preds(built, ids, flows, position, p, last, kind, virtual, micro_batch)
    if not overlap_p2p:
        _block_on_sends(program, range(first_transfer, len(program)))


def _block_on_sends(program: Program, transfers: range) -> None:
    """Blocking sends (``Execution.overlap_p2p=False``): a stage computes nothing else until
    what it sends has arrived."""
    position = {op: (stream, i) for stream, order in enumerate(program.stream_order)
                for i, op in enumerate(order)}
    for transfer in transfers:
        stream, i = position[program.preds[transfer][0]]
        if i + 1 < len(program.stream_order[stream]):
            program.preds[program.stream_order[stream][i + 1]].append(transfer)


def _duration(kind: OpKind, chunk: ChunkWork) -> tuple[float, float]:
    if kind is OpKind.FORWARD:
        return chunk.forward_s, chunk.forward_tp_s
    if kind is OpKind.BACKWARD:
        return chunk.backward_s, chunk.backward_tp_s
    if kind is OpKind.BACKWARD_INPUT:
        return chunk.backward_s - chunk.weight_grad_s, chunk.backward_tp_s
    return chunk.weight_grad_s, 0.0


def _preds(built: PipelineProgram, ids: dict, flows: dict[tuple[int, int], Flow], position: int,
           p: int, last: int, kind: OpKind, virtual: int, micro_batch: int) -> list[int]:
    if kind is OpKind.BACKWARD_WEIGHT:
        return [ids[(OpKind.BACKWARD_INPUT, virtual, micro_batch)]]
    if kind is OpKind.FORWARD:
        if virtual == 0:
            return []
        source = virtual - 1
        transfer = SEND_FORWARD
    elif virtual == last:
        return [ids[(OpKind.FORWARD, virtual, micro_batch)]]
    else:
        source = virtual + 1
        transfer = SEND_BACKWARD
    producer = ids[(kind, source, micro_batch)]
    src, dst = source % p, virtual % p
    if src == dst:
        return [producer]
    op = built.program.add_transfer(flows[(src, dst)], [producer])
    built.info.append(OpInfo(transfer, src, source // p, micro_batch, 0.0, dst))
    built.owner.append(position)
    return [op]
