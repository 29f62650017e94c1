"""Timing the ops of a step: emulated device speed and recorded traces.

- :mod:`~potluck.runtime.timing.clock`: the
  :class:`~potluck.runtime.timing.clock.Clock` every op runs through, and the
  null clock that just runs it;
- :mod:`~potluck.runtime.timing.emulate`: pad each op to the cost model's time
  on the plan's device (:mod:`~potluck.runtime.loop.dilation` fixes, with a few
  trainer steps, how much slower than those devices the emulation runs);
- :mod:`~potluck.runtime.timing.recorder`: record a few steps' ops into a trace;
  :mod:`~potluck.runtime.timing.p2p_waits` times the pipeline's send and
  receive waits.
"""
