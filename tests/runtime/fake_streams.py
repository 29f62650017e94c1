"""Fakes of torch.cuda's streams and events for the copy-stream tests, without a GPU,
written from torch's source: a stream's work is ordered, and ``wait_stream``/``wait_event``
order it after another stream's work so far, as CUDA does. Each stream keeps a vector clock,
so "copy A is done before B starts" is a comparison of clocks (:func:`done_before`).
The tests add their own logs of copies (what ``Tensor.copy_`` is patched to)."""

from __future__ import annotations

import torch


class FakeEvent:
    """An event: the clock of the stream it was recorded on; how often the host waited."""

    def __init__(self) -> None:
        self.clock: dict[str, int] = {}
        self.waited_by_host = 0

    def record(self, stream: FakeStream) -> None:
        self.clock = dict(stream.clock)

    def synchronize(self) -> None:
        self.waited_by_host += 1


class FakeStream:
    """A stream's vector clock: its own work queued, and what it waits for on others."""

    def __init__(self, name: str) -> None:
        self.name, self.clock = name, {name: 0}

    def queue(self) -> dict[str, int]:
        """Queue one piece of work; the clock once it is done."""
        self.clock[self.name] += 1
        return dict(self.clock)

    def wait_stream(self, other: FakeStream) -> None:
        self._after(other.clock)

    def wait_event(self, event: FakeEvent) -> None:
        self._after(event.clock)

    def _after(self, clock: dict[str, int]) -> None:
        for name, ops in clock.items():
            self.clock[name] = max(self.clock.get(name, 0), ops)

    def synchronize(self) -> None:
        raise AssertionError("a copy made the host wait for a whole stream")


class FakeStreams:
    """torch.cuda's ``Stream``, ``current_stream`` and ``stream``: the compute stream first,
    then each stream made, named ``side1``, ``side2``..."""

    def __init__(self) -> None:
        self.streams = [FakeStream("compute")]
        self.current = self.streams[0]

    def Stream(self, device: torch.device | None = None) -> FakeStream:  # noqa: N802 (torch's name)
        self.streams.append(FakeStream(f"side{len(self.streams)}"))
        return self.streams[-1]

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        return self.current

    def stream(self, stream: FakeStream):
        fake = self

        class Current:
            def __enter__(self) -> None:
                self.outer, fake.current = fake.current, stream

            def __exit__(self, *exc: object) -> None:
                fake.current = self.outer

        return Current()


def storage_key(tensor: torch.Tensor) -> int:
    """A tensor's storage, as the copy logs name it."""
    return tensor.untyped_storage().data_ptr()


def done_before(first: dict[str, int], stream: str, then: dict[str, int]) -> bool:
    """Whether work queued at ``first`` on ``stream`` is done before work at ``then``."""
    return first[stream] <= then.get(stream, 0)
