"""Elastic training: a run that replans when devices leave or join, and carries on.

- :mod:`~potluck.runtime.elastic.pool`: the devices a run may use, and the planner's plan
  for exactly those (a machine that lost GPUs is planned as the smaller machine it now is).
- :mod:`~potluck.runtime.elastic.replans`: ``replans.jsonl``, one object per replan.
- :mod:`~potluck.runtime.elastic.joins`: devices that register with a running run.
- :mod:`~potluck.runtime.elastic.drills`: what the ranks do for it (a failure injected at a
  step, stopping at a checkpoint when the supervisor asks for a replan).
- :mod:`~potluck.runtime.elastic.supervisor`: the loop that launches, replans and resumes.
"""
