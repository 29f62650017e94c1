"""Starting the ranks of a plan and joining the job.

- :mod:`~potluck.runtime.launch.local`: one process per device on this machine
  (:func:`~potluck.runtime.launch.local.run_local`);
- :mod:`~potluck.runtime.launch.torchrun`: one torchrun command per machine;
- :mod:`~potluck.runtime.launch.checks`: one clear error before any rank starts;
- :mod:`~potluck.runtime.launch.gpus`: one backend for the world, the start
  method, the CUDA device of a plan's GPU;
- :mod:`~potluck.runtime.launch.session`: a rank joins the job (process groups,
  device, layout);
- :mod:`~potluck.runtime.launch.warmup`: every communicator made and used once
  before the first step;
- :mod:`~potluck.runtime.launch.watchdog`: heartbeats, and the note that names
  the rank that failed or went silent and stops every other rank;
- :mod:`~potluck.runtime.launch.lifeline`: no rank outlives its launcher or the
  fork server that started it.
"""
