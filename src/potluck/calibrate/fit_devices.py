"""Fitting each device type's memory bandwidth and matmul efficiency to a measured run.

Memory bandwidth comes first, from the optimizer step: the cost model prices
Adam as pure memory traffic (36 bytes per parameter), so the measured step
gives it in closed form, ``B_new = B x predicted / measured`` over the type's
devices. Then the matmul efficiency: the one value ``e`` for which the cost
model's forward and backward times of the type's stages (``m x (f + b)`` per
device, tensor-parallel traffic included) add up to what those devices
measured in a step. Predicted time falls as ``e`` grows (roofline), so
bisection finds it. An emulated run is read as the emulator padded it
(:mod:`potluck.calibrate.expected`). Only the inputs move; every formula stays the cost
model's, so a layout the run never tried is predicted with the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from potluck.calibrate import expected
from potluck.calibrate.measure import compute_s, optimizer_s
from potluck.calibrate.solve import log_bisect
from potluck.cluster.spec import ClusterSpec
from potluck.cluster.topology import Cluster
from potluck.plans import Plan
from potluck.traces import Trace

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


def fit_bandwidth(plan: Plan, name: str, devices: list[str], measured: Trace, *,
                  emulated: bool = False) -> float | None:
    """Memory bandwidth of type ``name`` from its devices' optimizer steps (an emulated run's
    are all the plan's slowest: every type is scaled alike)."""
    if plan.zero1 and plan.dp > 1 and not emulated:
        return None  # the step holds the parameter all-gather too
    seen = optimizer_s(measured)
    timed = [d for d in (plan.devices if emulated else devices) if seen.get(d, 0.0) > 0]
    predicted_s = expected.optimizer_s(plan, timed, emulated) if timed else 0.0
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


def fit_devices(plan: Plan, measured: Trace, emulated: bool = False) -> tuple[DeviceFit, ...]:
    """Bandwidth, then efficiency, of every device type the plan uses."""
    cluster = Cluster(plan.cluster)
    by_type: dict[str, list[str]] = {}
    for device in plan.devices:
        by_type.setdefault(cluster.device(device).type.name, []).append(device)
    fits = []
    for name, devices in by_type.items():
        bandwidth = fit_bandwidth(plan, name, devices, measured, emulated=emulated)
        notes = [] if bandwidth else [f"{name}: no optimizer step alone (none measured, or "
                                      "ZeRO-1's all-gather in it); memory bandwidth kept"]
        with_bandwidth = replace(plan, cluster=with_device(plan.cluster, name,
                                                           bandwidth_bytes_per_s=bandwidth))
        efficiency, note = fit_efficiency(with_bandwidth, name, devices, measured, emulated=emulated)
        fits.append(DeviceFit(name, efficiency, bandwidth, tuple(notes + ([note] if note else []))))
    return tuple(fits)

