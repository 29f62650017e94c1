"""The calibrated cluster file of a measured-runs fit, and reading one back.

The input file's text is kept; its ``calibration:`` section becomes the old one with
the fitted entries in place (written by :mod:`potluck.cluster.calibration_file`, as
``potluck profile`` and ``potluck calibrate RUN_DIR`` write theirs) and its
``execution:`` section gets the fitted host times, its other keys kept (keys are
:class:`~potluck.plans.Execution` field names; written by
:func:`potluck.cluster.calibration_file.with_execution`, as ``calibrate RUN_DIR``
writes its own)::

    execution:
      micro_batch_overhead_s: 0.0021
      step_overhead_s: 0.015
      block_host_s: 0.0045

The cluster parser reads the section back into ``ClusterSpec.execution``
(:mod:`potluck.cluster.execution`).
"""

from __future__ import annotations

from dataclasses import replace

from potluck.calibrate.measured.params import EXECUTION_KINDS, Values, fitted_calibration
from potluck.cluster.calibration import Calibration, DeviceCalibration, LinkCalibration
from potluck.cluster.calibration_file import with_calibration, with_execution
from potluck.cluster.spec import ClusterSpec

HOST_TIMES = tuple(kind.value for kind in EXECUTION_KINDS)  # the Execution fields a fit sets


def merged_calibration(spec: ClusterSpec, values: Values, source: str) -> Calibration:
    """``spec``'s own calibration with the fitted entries in place of the ones they replace."""
    fitted = fitted_calibration(spec, values, source)
    old = spec.calibration or Calibration()
    efficiency = {d.device: d.matmul_efficiency for d in fitted.devices}
    devices = [replace(d, matmul_efficiency=efficiency.pop(d.device)) if d.device in efficiency
               else d for d in old.devices]
    devices += [DeviceCalibration(name, matmul_efficiency=value) for name, value in efficiency.items()]
    replaced = {_link_key(link) for link in fitted.links}
    links = [link for link in old.links if _link_key(link) not in replaced] + list(fitted.links)
    return Calibration(tuple(devices), tuple(links), source)


def _link_key(link: LinkCalibration) -> tuple:
    if link.between is not None:
        return ("between", frozenset(link.between))
    return (link.kind.value, link.groups)


def calibrated_text(text: str, calibration: Calibration, values: Values, label: str) -> str:
    """``text`` with ``calibration`` and the fitted host times set in its ``execution:``
    section (its other keys kept)."""
    fitted = {p.kind.value: v for p, v in values.items() if p.kind in EXECUTION_KINDS}
    return with_execution(with_calibration(text, calibration), fitted, label)
