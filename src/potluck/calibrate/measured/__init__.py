"""``potluck calibrate --measured runs.csv``: fit a few cost-model inputs to iteration
times measured by any framework (one row per run), with the leave-one-out error.

:mod:`.runs` reads and checks the CSV, :mod:`.params` says which inputs can be fitted
and applies them to a cluster, :mod:`.solve` is the bounded least-squares solver,
:mod:`.fit` plans the rows and chooses and fits the parameters, :mod:`.stats` holds the
error figures, :mod:`.output` writes the calibrated cluster file and
:mod:`.calibrate` ties them together (refusing a fit that is no better).
"""
