"""Timing the pipeline's send and receive waits inside torch's schedules.

torch.distributed.pipelining posts each batch of point-to-point ops with
``schedules._batch_p2p`` and blocks on it with ``schedules._wait_batch_p2p``;
neither is a method a stage can override. While a traced run records its
steps, :func:`timing_p2p_waits` replaces those two module functions with
wrappers that remember which ops a batch holds (a stage tags its ops when it
creates them: ``recv_forward``, ``send_backward``, ... with its virtual stage
and micro-batch) and report each blocking wait to a callback. Outside that
context nothing is patched, so an untraced run pays nothing.

A wait that holds a receive is reported as the receive (it is what blocks);
a batch of sends only as the send. Where torch moves these functions, the
patch is skipped with a warning and traces simply have no send/receive waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining import schedules

from potluck.ops import OpKind

log = logging.getLogger(__name__)
_RECEIVES = (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD)


@dataclass(frozen=True)
class P2PTag:
    """What one point-to-point op is for."""

    kind: OpKind  # RECV_FORWARD, SEND_FORWARD, RECV_BACKWARD or SEND_BACKWARD
    stage_id: int  # the virtual stage that posts it
    micro_batch: int


class TaggedWorks(list):
    """The works of one batch of ops, with the ops' tags (and, emulating, what the
    emulation posted with them: :mod:`~potluck.runtime.timing.p2p_emulation`)."""

    tags: tuple[P2PTag, ...] = ()
    posted: list[Any] = []

    @classmethod
    def of(cls, works: list[Any]) -> TaggedWorks:
        """``works`` itself when it already is one (a wrapper inside another), else a copy."""
        return works if isinstance(works, TaggedWorks) else cls(works)


# A wait's callback gets the tag that names it and the wait's start and end marks.
WaitCallback = Callable[[P2PTag, Any, Any], None]


class P2PTagger:
    """Remembers the tags of ops a stage has created until they are posted."""

    def __init__(self) -> None:
        self._tags: dict[int, P2PTag] = {}

    def tag(self, ops: list[Any], kind: OpKind, stage_id: int, micro_batch: int) -> list[Any]:
        for op in ops:
            self._tags[id(op)] = P2PTag(kind, stage_id, micro_batch)
        return ops

    def take(self, ops: list[Any]) -> tuple[P2PTag, ...]:
        return tuple(tag for tag in (self._tags.pop(id(op), None) for op in ops) if tag)


def _blocking_tag(tags: tuple[P2PTag, ...]) -> P2PTag | None:
    receives = [tag for tag in tags if tag.kind in _RECEIVES]
    return (receives or list(tags) or [None])[0]


Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


@contextmanager
def wrapping_p2p(wrap_batch: Wrapper, wrap_wait: Wrapper, skipped: str) -> Iterator[None]:
    """While inside, torch's ``schedules._batch_p2p`` and ``_wait_batch_p2p`` are
    ``wrap_batch(original)`` and ``wrap_wait(original)`` (wrappers of wrappers compose: the
    innermost was installed first); where torch moved them, a warning says what is
    ``skipped``."""
    original_batch = getattr(schedules, "_batch_p2p", None)
    original_wait = getattr(schedules, "_wait_batch_p2p", None)
    if original_batch is None or original_wait is None:
        log.warning("this torch has no schedules._batch_p2p/_wait_batch_p2p: %s", skipped)
        yield
        return
    schedules._batch_p2p = wrap_batch(original_batch)
    schedules._wait_batch_p2p = wrap_wait(original_wait)
    try:
        yield
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = original_batch, original_wait


def timing_p2p_waits(tagger: P2PTagger, on_wait: WaitCallback,
                     mark: Callable[[], Any] = time.perf_counter
                     ) -> AbstractContextManager[None]:
    """Report every blocking wait of torch's schedules to ``on_wait`` while inside."""

    def wrap_batch(original: Callable[..., Any]) -> Callable[..., Any]:
        def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
            works = TaggedWorks.of(original(p2p_ops, desc=desc))
            works.tags = tagger.take(p2p_ops)
            return works
        return batch_p2p

    def wrap_wait(original: Callable[..., Any]) -> Callable[..., Any]:
        def wait_batch_p2p(work: list[Any]) -> None:
            tag = _blocking_tag(getattr(work, "tags", ()))
            if not work or tag is None:
                original(work)
                return
            start = mark()
            original(work)
            on_wait(tag, start, mark())
        return wait_batch_p2p

    return wrapping_p2p(wrap_batch, wrap_wait, "traces will have no send/receive waits")
