"""What a simulation returns: every op with its times, per-device figures, memory, and
the islands' outer cycle where the plan has one (:mod:`potluck.sim.outer`).

Pipelines that are provably identical (same work, same transfers, no link
shared with another pipeline) are simulated once; their :class:`PipelineRun`
objects share one tuple of ops (``twin_of`` names the pipeline that was run).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

from potluck.ops import OpKind
from potluck.plans import Plan, Schedule

if TYPE_CHECKING:
    from potluck.sim.outer import OuterCycle


class OpRecord(NamedTuple):
    """One executed op of a pipeline (for a transfer, ``stage`` sends to ``peer``)."""

    kind: OpKind
    stage: int
    chunk: int
    micro_batch: int
    start_s: float
    end_s: float
    tp_s: float  # compute ops: the blocking tensor-parallel collectives inside
    peer: int  # transfers: the receiving stage; -1 for compute ops


class ShareKind(str, Enum):
    """Where the critical path spends its time (a :class:`PathShare`'s kind)."""

    COMPUTE = "compute"  # a stage computing
    TRANSFER = "transfer"  # a transfer between two stages
    WAIT = "wait"  # a latency or a release time


@dataclass(frozen=True)
class PathShare:
    """Time the critical path spends in one place: compute on a stage, a transfer between
    two stages, or waiting (a latency, a release)."""

    kind: ShareKind
    stage: int
    peer: int  # transfers: the receiving stage; -1 otherwise
    seconds: float
    fraction: float

    def label(self) -> str:
        if self.kind is ShareKind.TRANSFER:
            return f"transfers s{self.stage}->s{self.peer}"
        return f"{self.kind.value} s{self.stage}"


@dataclass(frozen=True)
class PipelineRun:
    """The ops of one pipeline, in execution order per stage, and its critical path."""

    index: int
    ops: tuple[OpRecord, ...]
    twin_of: int  # the pipeline whose simulation this one shares (itself if simulated)
    critical_path: tuple[PathShare, ...] = ()


@dataclass(frozen=True)
class GradientSync:
    """One gradient all-reduce group: replicas of a stage (or the tied embedding)."""

    members: tuple[tuple[int, int], ...]  # (pipeline, stage)
    start_s: float  # the first bytes move (during the members' last backward)
    end_s: float  # the last byte arrived and every member's gradients were complete
    ready_s: tuple[float, ...] = ()  # per member: its gradients complete (its backward over)

    def exposed(self) -> list[tuple[tuple[int, int], float, float]]:
        """Per member, the part of the all-reduce it waits for once its own gradients are
        complete: ``(member, start_s, end_s)``. What the runtime's trace records as
        ``dp_allreduce`` (its wait after the schedule) and the cost model's ``dp_s`` are;
        the part that overlaps the backward is hidden behind it."""
        ready = self.ready_s or (self.start_s,) * len(self.members)
        return [(member, start, max(start, self.end_s))
                for member, start in zip(self.members, ready, strict=True)]


@dataclass(frozen=True)
class OptimizerStep:
    pipeline: int
    stage: int
    start_s: float
    end_s: float


class StateTransferKind(str, Enum):
    """Transfers of issue 13's memory techniques, as the simulator draws them."""

    SWAP_OUT = "swap_out"  # a micro-batch's swapped activations leaving after its forward
    SWAP_IN = "swap_in"  # and coming back for its backward
    PARAM_ALLGATHER = "param_allgather"  # ZeRO-3: a pass's all-gather of the stage's weights


@dataclass(frozen=True)
class StateTransfer:
    """One drawn transfer on its lane (``<device>->host``, ``<device>-><peer>``, or the
    stage's data-parallel ring ``dp ring``)."""

    kind: StateTransferKind
    pipeline: int
    stage: int
    chunk: int
    micro_batch: int
    lane: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class MemoryTrace:
    """Bytes held by each device of a stage over time (a step function)."""

    times_s: tuple[float, ...]
    bytes: tuple[float, ...]

    @property
    def peak_bytes(self) -> float:
        return max(self.bytes)


@dataclass(frozen=True)
class DeviceStats:
    """Where one device's iteration goes, in seconds."""

    device: str
    pipeline: int
    stage: int
    compute_s: float  # forward, backward and optimizer math
    tp_comm_s: float  # blocking tensor-parallel collectives
    transfer_s: float  # pipeline transfers or gradient all-reduce in flight (may overlap compute)
    idle_s: float  # neither computing nor in a collective
    peak_memory_bytes: float

    @property
    def busy_s(self) -> float:
        return self.compute_s + self.tp_comm_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "pipeline": self.pipeline, "stage": self.stage,
            "busy_s": self.busy_s, "compute_s": self.compute_s, "tp_comm_s": self.tp_comm_s,
            "transfer_s": self.transfer_s, "idle_s": self.idle_s,
            "peak_memory_gb": self.peak_memory_bytes / 1e9,
        }


@dataclass(frozen=True)
class SimulationResult:
    """One simulated training iteration of a plan."""

    plan: Plan
    schedule: Schedule
    iteration_time_s: float
    pipeline_time_s: float  # until the last forward or backward ends
    bubble_fraction: float  # idle share of the devices' time until then
    pipelines: tuple[PipelineRun, ...]
    gradient_syncs: tuple[GradientSync, ...]
    optimizer_steps: tuple[OptimizerStep, ...]
    memory: tuple[tuple[MemoryTrace, ...], ...]  # per pipeline, per stage
    devices: tuple[DeviceStats, ...]
    predicted_time_s: float  # the analytic cost model's iteration time, for comparison
    simulated_pipelines: int  # pipelines actually run (the others are identical twins)
    state_transfers: tuple[StateTransfer, ...] = ()  # swaps and ZeRO-3 gathers, drawn
    # islands' outer exchange that a step waits for, amortized over the inner steps
    outer_s: float = 0.0
    # islands that synchronize rarely: one outer period of H inner steps, drawn
    outer_cycle: OuterCycle | None = None

    @property
    def bottleneck(self) -> DeviceStats:
        """The busiest device."""
        return max(self.devices, key=lambda d: d.busy_s)

    @property
    def critical_path(self) -> tuple[PathShare, ...]:
        """Where the slowest pipeline's critical path spends its time, largest share first."""
        slowest = max(self.pipelines, key=lambda r: max((op.end_s for op in r.ops), default=0.0))
        return slowest.critical_path

    def critical_summary(self, top: int = 3) -> str:
        """``"62% transfers s1->s2, 30% compute s2, ..."`` for the slowest pipeline."""
        return ", ".join(f"{share.fraction:.0%} {share.label()}"
                         for share in self.critical_path[:top])

    def summary(self) -> dict[str, Any]:
        """The figures of ``potluck simulate --json``."""
        return {
            "layout": self.plan.layout(),
            "schedule": self.schedule.value,
            "iteration_time_s": self.iteration_time_s,
            "pipeline_time_s": self.pipeline_time_s,
            "bubble_fraction": self.bubble_fraction,
            "predicted_iteration_time_s": self.predicted_time_s,
            "bottleneck_device": self.bottleneck.device,
            "critical_path": [
                {"kind": s.kind.value, "stage": s.stage, "peer": s.peer, "seconds": s.seconds,
                 "fraction": s.fraction} for s in self.critical_path],
            "peak_memory_gb": max(d.peak_memory_bytes for d in self.devices) / 1e9,
            "per_device": [d.as_dict() for d in self.devices],
            "state_transfers": {kind.value: sum(1 for t in self.state_transfers if t.kind is kind)
                                for kind in StateTransferKind},
        } | ({"outer_cycle": self.outer_cycle.as_dict()} if self.outer_cycle else {})
