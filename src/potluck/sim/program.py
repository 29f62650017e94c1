"""The op graph of pipelines: forwards, backwards and the transfers between stages.

For each pipeline, every rank's ops come in the schedule's order
(:meth:`potluck.schedules.PipelineSchedule.rank_orders`) on the rank's stream (its
tensor-parallel group),
and each op waits for what it consumes:

- the forward of virtual stage ``s`` waits for the activations of ``s - 1``
  (a ``send_forward`` transfer when the two live on different devices);
- the backward (or input backward) of ``s`` waits for the gradients of
  ``s + 1`` (a ``send_backward`` transfer), the last virtual stage's for its
  own forward;
- a deferred weight backward waits for the input backward of the same chunk
  and micro-batch.

How transfers meet compute follows the runtime. Schedules that run torch's
single-stage classes (:attr:`~potluck.schedules.PipelineSchedule.single_stage_torch`:
GPipe, 1F1B) post batched sends and receives where the schedule's module says
(:meth:`~potluck.schedules.PipelineSchedule.post_p2p`), which :mod:`potluck.sim.p2p`
turns into ops. The others run torch's schedule runtime, which posts receives
ahead and waits for sends only at the end of the step: their transfers start
as soon as the data exists, in the schedule's op order
(:meth:`~potluck.schedules.PipelineSchedule.rank_orders`). Transfers between two stages are one
:class:`~potluck.sim.network.Flow` with a lane per pair of tensor-parallel
ranks, each carrying its share of the activations, as the cost model prices them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from potluck.cluster.topology import spans_vendors
from potluck.ops import OpKind
from potluck.planner.network import host_staging_s
from potluck.schedules import PipelineSchedule
from potluck.sim import p2p
from potluck.sim.engine import Program
from potluck.sim.network import Flow, Network
from potluck.sim.workload import ChunkWork, PipelineWorkload

MARKER = None  # the kind of a zero-duration start or end of a batch of sends and receives


class OpInfo(NamedTuple):
    """What an op is: its kind (``MARKER`` for a batch's start or end), stage (the sender's,
    for a transfer), chunk and micro-batch."""

    kind: OpKind | None
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


def boundary_flows(work: PipelineWorkload, virtual_stages: int, network: Network,
                   serial_pairs: bool = False) -> dict[tuple[int, int], Flow]:
    """The transfer between every pair of stages that pass activations or gradients;
    ``serial_pairs``: both directions of a pair take turns on one channel."""
    p = len(work.stages)
    pairs = {(i, i + 1) for i in range(p - 1)}
    if virtual_stages > 1 and p > 1:
        pairs.add((p - 1, 0))  # chunk c of the last stage feeds chunk c + 1 of the first
    flows = {}
    for a, b in sorted(pairs | {(b, a) for a, b in pairs}):
        flows[(a, b)] = _flow(work, a, b, network, serial_pairs)
    return flows


def _flow(work: PipelineWorkload, src: int, dst: int, network: Network,
          serial_pairs: bool) -> Flow:
    """The transfer from stage ``src`` to ``dst``; where the pipeline spans vendors, staged
    through host memory: its slowest lane's copies to and from the host
    (:func:`~potluck.planner.network.host_staging_s`) start it late, as a latency does."""
    sender, receiver = work.stages[src], work.stages[dst]
    lanes = min(len(sender.devices), len(receiver.devices))
    pairs = list(zip(sender.devices[:lanes], receiver.devices[:lanes], strict=True))
    flow = network.lanes_flow(pairs, sender.send_bytes / lanes, serial_pairs=serial_pairs)
    if not spans_vendors(d for stage in work.stages for d in stage.devices):
        return flow
    staging = max(host_staging_s(network.cluster, a, b, flow.lane_bytes) for a, b in pairs)
    return replace(flow, latency_s=flow.latency_s + staging)


def runs_torch_calls(schedule: PipelineSchedule, stages: int, micro_batches: int,
                     split_channels: bool) -> bool:
    """Whether a pipeline of ``stages`` over ``micro_batches`` runs a single-stage torch
    schedule with its fused send/receive batches (else torch's schedule runtime: one op at a
    time, receives posted ahead; split channels run every schedule there)."""
    return schedule.single_stage_class(stages, micro_batches) and not split_channels


def build(workloads: list[PipelineWorkload], schedule: PipelineSchedule, virtual_stages: int,
          network: Network, *, overlap_p2p: bool = True, split_channels: bool = False
          ) -> PipelineProgram:
    """One program running ``workloads`` side by side (they may share links).

    ``overlap_p2p=False`` makes the schedule runtime's sends blocking (torch's single-stage
    schedules keep their own batching either way); ``split_channels`` runs every schedule
    on the schedule runtime with activations and gradients on their own channels (else
    the runtime's ops between two stages take turns on one).
    """
    built = PipelineProgram()
    for position, work in enumerate(workloads):
        adder = _PipelineAdder(built, position, work, network, virtual_stages)
        if runs_torch_calls(schedule, len(work.stages), work.micro_batches, split_channels):
            adder.add_torch_calls(schedule)
        else:
            adder.add_eager(schedule, overlap_p2p=overlap_p2p, serial_pairs=not split_channels)
    return built


@dataclass
class _PipelineAdder:
    """Adds one pipeline's ops to a program being built."""

    built: PipelineProgram
    position: int  # the pipeline's place among those the program runs
    work: PipelineWorkload
    network: Network
    virtual_stages: int

    def _note(self, info: OpInfo) -> None:
        self.built.info.append(info)
        self.built.owner.append(self.position)

    def add_torch_calls(self, schedule: PipelineSchedule) -> None:
        """A single-stage torch schedule with its send and receive batches (:mod:`potluck.sim.p2p`)."""
        program, work = self.built.program, self.work
        p, m = len(work.stages), work.micro_batches
        stages = []
        for s, stage in enumerate(work.stages):
            compute = program.add_stream()
            pairs = {peer: program.add_stream() for peer in (s - 1, s + 1) if 0 <= peer < p}
            stages.append(p2p.StageCalls(program, compute, pairs, stage.devices[0].type.is_cpu))
            first, chunk = len(program), stage.chunks[0]
            schedule.post_p2p(stages[-1], s, p, m, chunk.forward_s, chunk.backward_s)
            what = {op: key for key, op in stages[-1].compute.items()}
            for op in range(first, len(program)):
                self._note(_torch_call_info(what.get(op), s, chunk))
        flows = boundary_flows(work, 1, self.network)
        for src, dst, (what, micro_batch), preds, waiters in p2p.match_transfers(stages):
            op = program.add_transfer(flows[(src, dst)], preds)
            kind = OpKind.SEND_FORWARD if what is OpKind.FORWARD else OpKind.SEND_BACKWARD
            self._note(OpInfo(kind, src, 0, micro_batch, 0.0, dst))
            for end in waiters:
                program.preds[end].append(op)

    def add_eager(self, schedule: PipelineSchedule, *, overlap_p2p: bool,
                  serial_pairs: bool = False) -> None:
        """Torch's schedule runtime: receives posted ahead, transfers start when data exists."""
        program, work, v = self.built.program, self.work, self.virtual_stages
        p = len(work.stages)
        ids: dict[tuple[OpKind, int, int], int] = {}
        for rank, order in enumerate(schedule.rank_orders(p, work.micro_batches, v)):
            stream = program.add_stream()
            for kind, chunk, micro_batch in order:
                duration_s, tp_s = _duration(kind, work.stages[rank].chunks[chunk])
                ids[(kind, chunk * p + rank, micro_batch)] = program.add_compute(stream, duration_s, [])
                self._note(OpInfo(kind, rank, chunk, micro_batch, tp_s, -1))
        flows = boundary_flows(work, v, self.network, serial_pairs)
        first_transfer = len(program)
        for (kind, virtual, micro_batch), op in list(ids.items()):
            program.preds[op] = self._preds(ids, flows, kind, virtual, micro_batch)
        if not overlap_p2p:
            _block_on_sends(program, range(first_transfer, len(program)))

    def _preds(self, ids: dict, flows: dict[tuple[int, int], Flow], kind: OpKind, virtual: int,
               micro_batch: int) -> list[int]:
        """What the op ``kind`` of virtual stage ``virtual`` waits for (a transfer it adds)."""
        p = len(self.work.stages)
        if kind is OpKind.BACKWARD_WEIGHT:
            return [ids[(OpKind.BACKWARD_INPUT, virtual, micro_batch)]]
        if kind is OpKind.FORWARD:
            if virtual == 0:
                return []
            source, transfer = virtual - 1, OpKind.SEND_FORWARD
        elif virtual == p * self.virtual_stages - 1:
            return [ids[(OpKind.FORWARD, virtual, micro_batch)]]
        else:
            source, transfer = virtual + 1, OpKind.SEND_BACKWARD
        producer = ids[(kind, source, micro_batch)]
        src, dst = source % p, virtual % p
        if src == dst:
            return [producer]
        op = self.built.program.add_transfer(flows[(src, dst)], [producer])
        self._note(OpInfo(transfer, src, source // p, micro_batch, 0.0, dst))
        return [op]


def _torch_call_info(key: tuple[str, int] | None, s: int, chunk: ChunkWork) -> OpInfo:
    if key is None:
        return OpInfo(MARKER, s, 0, -1, 0.0, -2)
    if key[0] is OpKind.FORWARD:
        return OpInfo(OpKind.FORWARD, s, 0, key[1], chunk.forward_tp_s, -1)
    return OpInfo(OpKind.BACKWARD, s, 0, key[1], chunk.backward_tp_s, -1)


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
