"""Emulated pipeline transfers on their channels, for plans whose channels are split.

Where the plan splits pipeline channels (:attr:`potluck.plans.CommSchedule.split_p2p_channels`)
a transfer runs beside the compute, so the emulator cannot fold it into a compute op: it
times each one on its channel instead, and the runtime's real waits (torch's schedule
waits a receive right before the compute that needs it, and its sends at the end of the
step) last until the emulated transfer is over.

A channel is one process group between two ranks, an in-order stream as NCCL runs it: a
transfer starts once both its ends are ready (the sender has posted it and finished what
it posted earlier on the channel, the receiver likewise) and takes its predicted time,
stretched by the dilation. Each send carries, in a small tensor posted right after it in
the same batch, when its sender was ready; the receiver, knowing when it was ready
itself, computes when the data arrived and waits for that. A sender does not know when its
receiver was ready, except from a receive in the same batch from the same peer (torch's
fused send/receive batches): otherwise it assumes at once.

While inside :func:`emulating_p2p`, ``torch.distributed.pipelining.schedules._batch_p2p``
and ``_wait_batch_p2p`` are wrapped (as :mod:`~potluck.runtime.timing.p2p_waits` does for
traces); stages name their ops through the clock's ``tag_p2p``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from potluck.ops import OpKind
from potluck.runtime.timing.p2p_waits import TaggedWorks, wrapping_p2p

_SENDS = (OpKind.SEND_FORWARD, OpKind.SEND_BACKWARD)
Channel = tuple[int, int]  # (id of the process group, peer's global rank)


@dataclass
class _Posted:
    """One tagged op of a posted batch, with what the emulation needs at its wait."""

    kind: OpKind
    channel: Channel
    duration_s: float
    ready_s: float  # when this end was ready to move it
    stamp: torch.Tensor  # a send's readiness as sent, or a receive's buffer for the peer's


class P2PEmulation:
    """The channels of one rank and the transfers posted on them."""

    def __init__(self, sends_s: dict[tuple[OpKind, int], float], dilation: float = 0.0) -> None:
        self.sends_s = sends_s
        self.dilation = dilation
        self.free_s: dict[Channel, float] = {}  # when each channel's last op is over
        self._tags: dict[int, tuple[OpKind, int]] = {}

    def tag(self, ops: list[Any], kind: OpKind, stage_id: int) -> None:
        for op in ops:
            self._tags[id(op)] = (kind, stage_id)

    def post(self, ops: list[Any]) -> tuple[list[Any], list[_Posted]]:
        """The batch to post (``ops`` and a stamp after each tagged one) and its records."""
        now = time.perf_counter()
        batch, posted = [], []
        for op in ops:
            batch.append(op)
            tag = self._tags.pop(id(op), None)
            if tag is None or self.dilation <= 0:
                continue
            channel = (id(op.group), op.peer)
            ready = max(now, self.free_s.get(channel, 0.0))
            sending = tag[0] in _SENDS
            stamp = (torch.tensor([ready], dtype=torch.float64) if sending
                     else torch.zeros(1, dtype=torch.float64))
            posted.append(_Posted(tag[0], channel, self.dilation * self.sends_s.get(tag, 0.0),
                                  ready, stamp))
            batch.append(dist.P2POp(dist.isend if sending else dist.irecv, stamp, op.peer,
                                    op.group))
            if sending:  # until a receive from this peer says when it was ready
                self.free_s[channel] = ready + posted[-1].duration_s
        return batch, posted

    def arrival_s(self, posted: list[_Posted]) -> float:
        """After the batch's real wait: when its last transfer is over, emulated; its
        channels are busy until then."""
        peers = {p.channel: float(p.stamp) for p in posted if p.kind not in _SENDS}
        end = 0.0
        for op in posted:
            start = max(op.ready_s, peers.get(op.channel, op.ready_s))
            end = max(end, start + op.duration_s)
            self.free_s[op.channel] = max(self.free_s.get(op.channel, 0.0), start + op.duration_s)
        return end


def emulating_p2p(emulation: P2PEmulation) -> AbstractContextManager[None]:
    """Time the pipeline's transfers on their channels while inside (see the module)."""

    def wrap_batch(original: Callable[..., Any]) -> Callable[..., Any]:
        def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
            ops, posted = emulation.post(p2p_ops)
            works = TaggedWorks.of(original(ops, desc=desc))
            works.posted = posted
            return works
        return batch_p2p

    def wrap_wait(original: Callable[..., Any]) -> Callable[..., Any]:
        def wait_batch_p2p(work: list[Any]) -> None:
            original(work)
            posted = getattr(work, "posted", None)
            if posted:
                sleep_until(emulation.arrival_s(posted))
        return wait_batch_p2p

    return wrapping_p2p(wrap_batch, wrap_wait, "pipeline transfers are not emulated")


def sleep_until(moment_s: float) -> None:
    """Sleep until ``moment_s`` (``time.perf_counter``'s clock, shared by the processes of
    one machine), if it is still to come."""
    left = moment_s - time.perf_counter()
    if left > 0:
        time.sleep(left)
