"""Fitting each device type's memory bandwidth and matmul efficiency to a measured run.

Memory bandwidth comes first, from the optimizer step, when that step is
memory bound: the cost model prices Adam as pure memory traffic (36 bytes
per parameter), so the measured step gives it in closed form,
``B_new = B x predicted / measured`` over the type's devices. The step is
also host time (a Python loop over the parameter tensors, kernel launches),
which dominates for a small model: a bandwidth read from such a step is far
too low, and the forward and backward, whose element-wise traffic is memory
bound too, could not run as fast as they were measured at any efficiency.
Such a reading is refused (the bandwidth is kept) and the optimizer's time
beyond its traffic becomes the framework's host time per iteration
(``Execution.step_overhead_s``: :func:`fit_step_overhead`), so the
optimizer op is still fitted to what was measured. Then the matmul
efficiency: the one value ``e`` for which the cost model's forward and
backward times of the type's stages (``m x (f + b)`` per device,
tensor-parallel traffic included) add up to what those devices measured in
a step. Predicted time falls as ``e`` grows (roofline), so bisection finds
it. An emulated run is read as the emulator padded it
(:mod:`potluck.calibrate.expected`). Only the inputs move; every formula stays the cost
model's, so a layout the run never tried is predicted with the same shape.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from potluck.calibrate import expected
from potluck.calibrate.measure import compute_s, optimizer_s
from potluck.calibrate.solve import log_bisect
from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster
from potluck.plans import Plan
from potluck.traces import Trace

# perf_counter's resolution is far below this; a smaller host time is the fit's rounding
OVERHEAD_RESOLUTION_S = 1e-6
EFFICIENCY_RANGE = (1e-4, 1e3)  # of the catalog peak; CPUs' nominal peaks may be far off


@dataclass(frozen=True)
class DeviceFit:
    """Fitted inputs of one device type (None: the run does not tell)."""

    device: str
    matmul_efficiency: float | None
    memory_bandwidth_bytes_per_s: float | None
    notes: tuple[str, ...] = ()


def with_device(spec: ClusterSpec, name: str, efficiency: float | None = None,
                bandwidth_bytes_per_s: float | None = None) -> ClusterSpec:
    """``spec`` with device type ``name``'s efficiency and/or memory bandwidth replaced."""
    changes = {}
    if efficiency is not None:
        changes["matmul_efficiency"] = efficiency
    if bandwidth_bytes_per_s is not None:
        changes["memory_bandwidth_bytes_per_s"] = bandwidth_bytes_per_s
    types = tuple(replace(t, **changes) if t.name == name else t for t in spec.device_types)
    return replace(spec, device_types=types)


def with_step_overhead(plan: Plan, seconds: float) -> Plan:
    """``plan`` with the framework's host time per iteration set to ``seconds``."""
    execution = replace(plan.training.execution, step_overhead_s=seconds)
    return replace(plan, training=replace(plan.training, execution=execution))


def fit_bandwidth(plan: Plan, name: str, devices: list[str], measured: Trace, *,
                  emulated: bool = False) -> float | None:
    """Memory bandwidth of type ``name`` from its devices' optimizer steps (an emulated run's
    are all the plan's slowest: every type is scaled alike)."""
    if plan.shards_optimizer and plan.dp > 1 and not emulated:
        return None  # the step holds the parameter all-gather too
    seen = optimizer_s(measured)
    timed = [d for d in (plan.devices if emulated else devices) if seen.get(d, 0.0) > 0]
    traffic_only = plan if emulated else with_step_overhead(plan, 0.0)
    predicted_s = expected.optimizer_s(traffic_only, timed, emulated) if timed else 0.0
    if predicted_s <= 0:
        return None
    return plan.cluster.device_type(name).memory_bandwidth_bytes_per_s * predicted_s / sum(
        seen[d] for d in timed)


def fit_efficiency(plan: Plan, name: str, devices: list[str], measured: Trace, *,
                   emulated: bool = False) -> tuple[float | None, str]:
    """Matmul efficiency of type ``name`` that makes its devices' compute what was measured;
    with a note when the run cannot tell it."""
    seen = compute_s(measured)
    timed = [d for d in devices if seen.get(d, 0.0) > 0]
    if not timed:
        return None, f"{name}: no forward/backward measured"
    target_s = sum(seen[d] for d in timed)

    def predicted(efficiency: float) -> float:
        spec = with_device(plan.cluster, name, efficiency=efficiency)
        return expected.compute_s(replace(plan, cluster=spec), timed, emulated)

    low, high = EFFICIENCY_RANGE
    if predicted(high) > target_s:
        return None, (f"{name}: compute measured faster than its memory traffic allows at any "
                      "efficiency; efficiency left as it was")
    if predicted(low) < target_s:
        return low, f"{name}: compute slower than the lowest efficiency tried ({low:g})"
    return log_bisect(predicted, target_s, low, high, increasing=False), ""


def compute_reachable(plan: Plan, name: str, devices: list[str], measured: Trace,
                      emulated: bool = False) -> bool:
    """Whether type ``name``'s measured forward and backward fit the cost model at some
    efficiency of the range, i.e. its memory-bound traffic at the type's bandwidth does not
    already take longer than what was measured."""
    seen = compute_s(measured)
    timed = [d for d in devices if seen.get(d, 0.0) > 0]
    if not timed:
        return True
    fastest = with_device(plan.cluster, name, efficiency=EFFICIENCY_RANGE[1])
    return expected.compute_s(replace(plan, cluster=fastest), timed, emulated) <= sum(
        seen[d] for d in timed)


def _bandwidth(plan: Plan, name: str, devices: list[str], measured: Trace,
               emulated: bool) -> tuple[float | None, str]:
    """The optimizer's bandwidth reading when it is memory bound, with a note when not."""
    bandwidth = fit_bandwidth(plan, name, devices, measured, emulated=emulated)
    if bandwidth is None:
        return None, (f"{name}: no optimizer step alone (none measured, or ZeRO-1's all-gather "
                      "in it); memory bandwidth kept")
    with_bandwidth = replace(plan, cluster=with_device(plan.cluster, name,
                                                       bandwidth_bytes_per_s=bandwidth))
    if compute_reachable(with_bandwidth, name, devices, measured, emulated):
        return bandwidth, ""
    return None, (f"{name}: the optimizer step is host time more than memory traffic (at "
                  f"{bandwidth / 1e9:.3g} GB/s the forward and backward could not run as "
                  "fast as measured); memory bandwidth kept, the rest of the step is host time")


def fit_devices(plan: Plan, measured: Trace, emulated: bool = False) -> tuple[DeviceFit, ...]:
    """Bandwidth, then efficiency, of every device type the plan uses."""
    cluster = Cluster(plan.cluster)
    by_type: dict[str, list[str]] = {}
    for device in plan.devices:
        by_type.setdefault(cluster.device(device).type.name, []).append(device)
    fits = []
    for name, devices in by_type.items():
        bandwidth, note = _bandwidth(plan, name, devices, measured, emulated)
        notes = [note] if note else []
        with_bandwidth = replace(plan, cluster=with_device(plan.cluster, name,
                                                           bandwidth_bytes_per_s=bandwidth))
        efficiency, note = fit_efficiency(with_bandwidth, name, devices, measured, emulated=emulated)
        fits.append(DeviceFit(name, efficiency, bandwidth, tuple(notes + ([note] if note else []))))
    return tuple(fits)


def fit_step_overhead(plan: Plan, measured: Trace) -> float | None:
    """The framework's host time per iteration: the median over the devices of their
    measured optimizer step beyond what its memory traffic takes at their (fitted)
    bandwidth; 0 below a microsecond (None: no optimizer step measured alone)."""
    if plan.shards_optimizer and plan.dp > 1:
        return None  # the step holds the parameter all-gather too
    seen = optimizer_s(measured)
    timed = [d for d in plan.devices if seen.get(d, 0.0) > 0]
    if not timed:
        return None
    traffic_only = with_step_overhead(plan, 0.0)
    rest = [seen[d] - expected.optimizer_s(traffic_only, [d]) for d in timed]
    overhead_s = statistics.median(rest)
    return overhead_s if overhead_s >= OVERHEAD_RESOLUTION_S else 0.0

