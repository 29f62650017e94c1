"""Send and receive calls of torch's single-stage schedules (GPipe, 1F1B), as ops of a program.

``ScheduleGPipe`` and ``Schedule1F1B`` post their point-to-point ops in
batches at fixed places and wait on them (where: each schedule's
:meth:`~potluck.schedules.PipelineSchedule.post_p2p`, which drives a
:class:`StageCalls`); with NCCL each batch runs on the
stream of its peer pair, after the batches posted before it on that stream,
and a transfer moves once both ends have reached it. Under 1F1B this couples
neighbours tightly: a stage's backward waits for its forward send
(``fwd_sends + bwd_recvs`` are one batch), which the next stage only
receives after its own backward, so slow links cost on every micro-batch,
not just while the pipeline fills.

Each stage gets a *pair stream* towards each neighbour. A batch is two
zero-duration ops on it: a start (after the compute that produced what it
sends) and an end (after its transfers). A compute op that waits on a batch
has the batch's end as a predecessor; a transfer waits for the starts of the
batches at both ends. On a CPU rank the host thread runs the compute, so a
batch can also not start before the compute op before it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from potluck.ops import OpKind
from potluck.schedules.base import P2PKey as Key
from potluck.sim.engine import Program


@dataclass
class _Batch:
    start: int
    end: int
    sends: list[Key]
    recvs: list[Key]


@dataclass
class StageCalls:
    """One stage's compute ops and the batches it posts, in the order it posts them
    (a :class:`potluck.schedules.P2PCalls`)."""

    program: Program
    compute_stream: int
    pair_streams: dict[int, int]  # peer stage -> this stage's stream towards it
    host_blocking: bool
    compute: dict[Key, int] = field(default_factory=dict)
    batches: dict[int, list[_Batch]] = field(default_factory=dict)  # peer -> batches
    pending: list[int] = field(default_factory=list)  # batch ends the next compute waits for
    last_compute: int | None = None

    def run(self, kind: OpKind, micro_batch: int, duration_s: float) -> int:
        op = self.program.add_compute(self.compute_stream, duration_s, list(self.pending))
        self.pending.clear()
        self.compute[(kind, micro_batch)] = op
        self.last_compute = op
        return op

    def post(self, peer: int | None, sends: list[Key], recvs: list[Key], *,
             wait: bool = True) -> int | None:
        """Post one batch towards ``peer``; the next compute waits for it when ``wait``."""
        if peer is None or not (sends or recvs):
            return None
        preds = [self.compute[key] for key in sends]
        if self.host_blocking and self.last_compute is not None:
            preds.append(self.last_compute)
        stream = self.pair_streams[peer]
        start = self.program.add_compute(stream, 0.0, preds)
        end = self.program.add_compute(stream, 0.0, [])
        self.batches.setdefault(peer, []).append(_Batch(start, end, sends, recvs))
        if wait:
            self.pending.append(end)
        return end

    def wait(self, end: int | None) -> None:
        if end is not None:
            self.pending.append(end)


def match_transfers(stages: list[StageCalls]) -> list[tuple[int, int, Key, list[int], list[int]]]:
    """Every transfer: (sender, receiver, what, ops it waits for, batch ends that wait for it)."""
    received: dict[tuple[int, int, Key], _Batch] = {}
    for s, stage in enumerate(stages):
        for peer, batches in stage.batches.items():
            for batch in batches:
                for key in batch.recvs:
                    received[(peer, s, key)] = batch
    transfers = []
    for s, stage in enumerate(stages):
        for peer, batches in stage.batches.items():
            for batch in batches:
                for key in batch.sends:
                    other = received[(s, peer, key)]
                    transfers.append((s, peer, key, [batch.start, other.start],
                                      [batch.end, other.end]))
    return transfers
