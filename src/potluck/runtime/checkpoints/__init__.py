"""Checkpoints and export.

- :mod:`~potluck.runtime.checkpoints.storage`: sharded, atomic checkpoints on
  torch.distributed.checkpoint (safetensors shards, JSON for the rest),
  knowing nothing of the trainer;
- :mod:`~potluck.runtime.checkpoints.names`: where checkpoints live and what they are
  called (no torch);
- :mod:`~potluck.runtime.checkpoints.manifest`: every file's SHA-256, written at
  save and checked before anything is read;
- :mod:`~potluck.runtime.checkpoints.values`: the non-tensor leaves of a state as JSON;
- :mod:`~potluck.runtime.checkpoints.rng`: each rank's RNG states;
- :mod:`~potluck.runtime.checkpoints.training_run`: what a training run saves
  and resumes (model, optimizer, step, data position, loss scale);
- :mod:`~potluck.runtime.checkpoints.export`: trained weights as a Hugging Face
  model directory;
- :mod:`~potluck.runtime.checkpoints.pretrained`: a Hugging Face model directory's
  weights as a run's starting point (``--init-from``), each rank reading its part
  (its files: :mod:`~potluck.runtime.checkpoints.weight_files`; experts saved one per
  expert: :mod:`~potluck.runtime.checkpoints.expert_files`).
"""
