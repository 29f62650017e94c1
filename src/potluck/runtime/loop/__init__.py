"""The training loop: steps, the loss, loss scaling, batches and metrics.

- :mod:`~potluck.runtime.loop.trainer`:
  :class:`~potluck.runtime.loop.trainer.Trainer` steps a parallel model;
- :mod:`~potluck.runtime.loop.loss`: the token-weighted loss;
- :mod:`~potluck.runtime.loop.loss_scale`: dynamic loss scaling for fp16;
- :mod:`~potluck.runtime.loop.peak_memory`: each step's peak memory;
- :mod:`~potluck.runtime.loop.batches`: what a run reads (random tokens or a corpus);
- :mod:`~potluck.runtime.loop.metrics`: metrics.jsonl, progress bar, TensorBoard;
- :mod:`~potluck.runtime.loop.dilation`: an emulation's dilation, from a few steps undone.
"""
