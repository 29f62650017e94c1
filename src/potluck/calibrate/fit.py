"""Fit a run's cost-model inputs and turn them into a calibration section.

:func:`fit_run` fits every device type the plan uses (memory bandwidth, then
matmul efficiency: :mod:`potluck.calibrate.fit_devices`), then the links its
gradient all-reduces cross (:mod:`potluck.calibrate.fit_links`) and the
pipeline's link where no all-reduce tells it (:mod:`potluck.calibrate.fit_pipeline`),
in rounds: compute includes tensor-parallel traffic (and, emulated, the
sends) over those links. The optimizer step's time beyond its memory traffic is
the framework's host time per iteration (:func:`~potluck.calibrate.fit_devices.fit_step_overhead`).
Every round starts from the run's own cluster, so nothing compounds. :func:`calibration`
expresses the fit as a :class:`~potluck.cluster.calibration.Calibration`
relative to a cluster's uncalibrated figures (the memory-bandwidth factor
multiplies them), and :func:`calibrated_cluster` applies it in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from potluck.calibrate.fit_devices import DeviceFit, fit_devices, fit_step_overhead, with_step_overhead
from potluck.calibrate.fit_links import LinkFit, fit_exposed, fit_links
from potluck.calibrate.fit_pipeline import fit_pipeline
from potluck.calibrate.fit_sends import fit_sends
from potluck.calibrate.run import RunRecord
from potluck.cluster.calibration import (
    Calibration,
    DeviceCalibration,
    LinkCalibration,
    calibrate_device,
    calibrate_group,
    calibrated_links,
    uncalibrated_device,
)
from potluck.cluster.spec import ClusterSpec
from potluck.plans import Plan
from potluck.sim.compare import step_time_s
from potluck.traces import Trace

ROUNDS = 3  # devices, then links; again with the links (TP traffic is in compute)
EMULATED_ROUNDS = 12  # devices and the sends padded into their ops, in turn until both settle


@dataclass(frozen=True)
class Fit:
    """What a run says about its cluster's inputs."""

    devices: tuple[DeviceFit, ...]
    links: tuple[LinkFit, ...]
    source: str = "potluck calibrate"
    link_notes: tuple[str, ...] = ()
    step_overhead_s: float | None = None  # framework host time per iteration (None: kept)

    @property
    def notes(self) -> tuple[str, ...]:
        return tuple(note for device in self.devices for note in device.notes) + self.link_notes


def fit_run(record: RunRecord, source: str = "potluck calibrate") -> Fit:
    """Fit the inputs of ``record``'s cluster to what the run measured."""
    plan, measured = record.plan, record.measured
    step_s = step_time_s(measured)
    devices: tuple[DeviceFit, ...] = ()
    links: tuple[LinkFit, ...] = ()
    overhead_s: float | None = None
    note = ""
    emulated = record.dilation is not None
    for _ in range(EMULATED_ROUNDS if emulated else ROUNDS):
        devices = fit_devices(_applied(plan, devices, links), measured, emulated)
        with_devices = _applied(plan, devices, ())
        if not emulated:  # an emulated run's optimizer is padded to the prediction
            overhead_s = fit_step_overhead(with_devices, measured)
            with_devices = applied_overhead(with_devices, overhead_s)
        apply = partial(_with_links, with_devices.cluster)
        if emulated:  # its sends are inside forward and backward, not left in the step
            links = _emulated_links(with_devices, measured)
        else:
            links, note = fit_pipeline(with_devices, fit_links(with_devices, measured), step_s,
                                       apply)
    return Fit(devices, links, source, (note,) if note else (), overhead_s)


def applied_overhead(plan: Plan, overhead_s: float | None) -> Plan:
    """``plan`` with a fitted host time per iteration (unchanged when none was fitted)."""
    return plan if overhead_s is None else with_step_overhead(plan, overhead_s)


def _emulated_links(plan: Plan, measured: Trace) -> tuple[LinkFit, ...]:
    """The pipeline's links from the sends padded into forward and backward, then the
    all-reduce's other link classes from the padded exposed all-reduce. A run with split
    pipeline channels pads no send into its compute (the emulator times them beside it),
    so its pipeline links are not fitted."""
    sends = () if plan.comm.split_p2p_channels else fit_sends(plan, measured)
    with_sends = replace(plan, cluster=_with_links(plan.cluster, sends))
    exposed = fit_exposed(with_sends, measured, partial(_with_links, with_sends.cluster))
    fitted = {link.key for link in sends}
    return (*sends, *(link for link in exposed if link.key not in fitted))


def _with_links(spec: ClusterSpec, links: tuple[LinkFit, ...]) -> ClusterSpec:
    return calibrated_cluster(spec, Fit((), links))


def _applied(plan: Plan, devices: tuple[DeviceFit, ...], links: tuple[LinkFit, ...]) -> Plan:
    return replace(plan, cluster=calibrated_cluster(plan.cluster, Fit(devices, links)))


def uncalibrated_bandwidth(spec: ClusterSpec, name: str) -> float:
    """Type ``name``'s memory bandwidth before ``spec``'s own calibration scaled it."""
    return uncalibrated_device(spec.device_type(name), spec.calibration).memory_bandwidth_bytes_per_s


def calibration(fit: Fit, spec: ClusterSpec, relative_to_calibrated: bool = False) -> Calibration:
    """``fit`` as a calibration section for ``spec``: bandwidth factors relative to its
    uncalibrated figures (or to its current ones with ``relative_to_calibrated``)."""
    devices = []
    for device in fit.devices:
        factor = None
        if device.memory_bandwidth_bytes_per_s is not None:
            base = (spec.device_type(device.device).memory_bandwidth_bytes_per_s
                    if relative_to_calibrated else uncalibrated_bandwidth(spec, device.device))
            factor = device.memory_bandwidth_bytes_per_s / base
        devices.append(DeviceCalibration(device.device, device.matmul_efficiency, factor))
    links = tuple(
        LinkCalibration(link.bandwidth_bytes_per_s, link.latency_s, link.key.kind,
                        (link.key.group,) if link.key.group else (), link.key.between)
        for link in fit.links)
    return Calibration(tuple(devices), links, fit.source)


def calibrated_cluster(spec: ClusterSpec, fit: Fit) -> ClusterSpec:
    """``spec`` with ``fit`` applied on top of its current figures (in memory)."""
    found = calibration(fit, spec, relative_to_calibrated=True)
    return replace(
        spec,
        nodes=tuple(calibrate_group(group, found) for group in spec.nodes),
        device_types=tuple(calibrate_device(t, found) for t in spec.device_types),
        links=calibrated_links(spec.links, found),
    )
