"""The parallelism strategies one rank applies to its part of a plain model.

- :mod:`~potluck.runtime.parallel.tensor_parallel`: DTensor sharding of the blocks
  (``apply_tp``);
- :mod:`~potluck.runtime.parallel.pipeline`: the plan's stages as modules and the plan's
  torch schedule over them;
- :mod:`~potluck.runtime.parallel.mixed_tp`: pipelines whose stages have different TP
  degrees, run on their leaders;
- :mod:`~potluck.runtime.parallel.recompute`: activation recomputation;
- :mod:`~potluck.runtime.parallel.tp_overlap`: the explicit TP executor of the stages
  that overlap their TP all-reduces in sub-batches or recompute without communicating.

Which rank runs what is :mod:`potluck.runtime.layout`'s; the fixed order in which the
strategies are applied is :mod:`potluck.runtime.parallel_model`'s.
"""
