"""From measured runs back to the cost model: compare a traced run with its prediction,
and fit the cost model's inputs (device efficiency, memory bandwidth, links) to it.

``potluck compare RUN_DIR`` and ``potluck calibrate RUN_DIR`` are this package's
commands; :mod:`potluck.runtime.timing.recorder` writes the traces they read.
"""
