"""Checkpoints and export.

- :mod:`~potluck.runtime.checkpoints.storage`: sharded, atomic checkpoints on
  torch.distributed.checkpoint, knowing nothing of the trainer;
- :mod:`~potluck.runtime.checkpoints.training_run`: what a training run saves
  and resumes (model, optimizer, step, data position, loss scale);
- :mod:`~potluck.runtime.checkpoints.export`: trained weights as a Hugging Face
  model directory.
"""
