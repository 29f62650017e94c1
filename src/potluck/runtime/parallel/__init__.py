"""Applying a plan's parallelism to a plain model, and running one step of it.

- :mod:`~potluck.runtime.parallel.layout`: which rank runs what, and every
  process group;
- :mod:`~potluck.runtime.parallel.parallelize`: TP, PP, init, recompute and DP in
  their fixed order; :class:`~potluck.runtime.parallel.parallelize.ParallelModel`
  runs a step's forward and backward;
- :mod:`~potluck.runtime.parallel.tensor_parallel`,
  :mod:`~potluck.runtime.parallel.pipeline`,
  :mod:`~potluck.runtime.parallel.mixed_tp` (stages of different TP degrees),
  :mod:`~potluck.runtime.parallel.recompute`: the strategies themselves.
"""
