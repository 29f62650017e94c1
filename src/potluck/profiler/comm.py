"""Measure links between ranks with torch.distributed: point-to-point and all-reduce.

Every rank takes part; rank 0 talks to each other rank in turn, so one pair
per (rank 0's machine, other machine) and one inside rank 0's machine are
measured. A pair's *latency* is half the median round trip of a 4-byte
ping-pong; its *bandwidth* is the bytes of a large send over the time until
the receiver's 4-byte acknowledgement arrives, less one latency. The
all-reduce's *bus bandwidth* is ``2(g-1)/g * n / t`` (NCCL's convention,
the quantity the ring formula divides by).
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from potluck.planner import formulas
from potluck.profiler.compute import synchronize

PING_BYTES = 4
PINGS = 20


@dataclass(frozen=True)
class PairMeasurement:
    """The link between rank 0 and ``peer``."""

    peer: int
    same_host: bool
    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class AllReduceMeasurement:
    ranks: int
    num_bytes: float
    seconds: float

    @property
    def bus_bandwidth_bytes_per_s(self) -> float:
        return formulas.ring_terms(self.num_bytes, self.ranks).hop_bytes / self.seconds


def hosts() -> list[str]:
    """Every rank's host name, in rank order."""
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return [str(n) for n in names]


def _ping_pong_s(peer: int, tensor: torch.Tensor, device: torch.device, repeats: int) -> float:
    """Median round trip of ``tensor`` to ``peer`` and back (rank 0 side)."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        dist.send(tensor, peer)
        dist.recv(tensor, peer)
        synchronize(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _echo(tensor: torch.Tensor, repeats: int) -> None:
    for _ in range(repeats):
        dist.recv(tensor, 0)
        dist.send(tensor, 0)


def _timed_send_s(peer: int, big: torch.Tensor, ack: torch.Tensor, device: torch.device,
                  repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        dist.send(big, peer)
        dist.recv(ack, peer)
        synchronize(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _receive(big: torch.Tensor, ack: torch.Tensor, repeats: int) -> None:
    for _ in range(repeats):
        dist.recv(big, 0)
        dist.send(ack, 0)


def measure_pairs(device: torch.device, host_names: list[str], num_bytes: float,
                  repeats: int = 5) -> list[PairMeasurement]:
    """Latency and bandwidth between rank 0 and every other rank (call on every rank)."""
    rank = dist.get_rank()
    ping = torch.zeros(PING_BYTES // 4, device=device)
    big = torch.zeros(int(num_bytes // 4), device=device)
    found = []
    for peer in range(1, dist.get_world_size()):
        if rank == 0:
            latency = _ping_pong_s(peer, ping, device, PINGS) / 2
            transfer = _timed_send_s(peer, big, ping, device, repeats) - 2 * latency
            found.append(PairMeasurement(peer, host_names[peer] == host_names[0],
                                         big.numel() * 4 / max(transfer, 1e-9), latency))
        elif rank == peer:
            _echo(ping, PINGS)
            _receive(big, ping, repeats)
        dist.barrier()
    return found


def measure_allreduce(device: torch.device, num_bytes: float, repeats: int = 5) -> AllReduceMeasurement:
    """Median time of an all-reduce of ``num_bytes`` over every rank."""
    tensor = torch.ones(int(num_bytes // 4), device=device)
    dist.all_reduce(tensor)
    synchronize(device)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize(device)
        samples.append(time.perf_counter() - started)
    return AllReduceMeasurement(dist.get_world_size(), tensor.numel() * 4, statistics.median(samples))
