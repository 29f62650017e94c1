"""Where a rank's memory goes: what it measures and what it moves.

- :mod:`~potluck.runtime.memory.ledger`: the bytes of the tensors a rank holds (model
  states, live saved activations, swap stashes), on its device, in host memory and on
  behalf of peers, and their peak per step;
- :mod:`~potluck.runtime.memory.swap`: activation swapping, the saved tensors of a
  stage's first blocks moved to host memory or a peer device between a micro-batch's
  forward and backward pass.
"""
