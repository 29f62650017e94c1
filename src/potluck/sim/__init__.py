"""The training simulator: one iteration of a Plan as discrete events.

``simulate(plan)`` runs every forward, backward, stage-to-stage transfer,
gradient all-reduce and optimizer step of a plan on its devices' compute
streams and on the links they share, with op durations from the one cost
model, and returns a :class:`SimulationResult` (iteration time, bubble,
per-device busy/idle/communication time, memory over time) and, for islands
that synchronize every H steps, one outer period drawn (:mod:`potluck.sim.outer`). The
timeline, memory chart and Chrome trace are written by :mod:`potluck.sim.timeline` and
:mod:`potluck.sim.trace`; the text, files and outer cycle's trace by :mod:`potluck.sim.outputs`.
"""

from potluck.sim.result import DeviceStats, SimulationResult
from potluck.sim.simulator import rerank, simulate

__all__ = ["DeviceStats", "SimulationResult", "rerank", "simulate"]
