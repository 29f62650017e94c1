"""The model a rank computes: built, cut into stages, initialized.

- :mod:`~potluck.runtime.models.build`: meta init, building a Hugging Face model
  for a spec, deterministic materialization;
- :mod:`~potluck.runtime.models.adapters`: where each model family keeps its
  parts and how its forward runs a stage;
- :mod:`~potluck.runtime.models.traced`: torch's tracing split, for other models;
- :mod:`~potluck.runtime.models.stand_in`: the model actually computed when a
  run stands in a smaller one for the plan's.
"""
