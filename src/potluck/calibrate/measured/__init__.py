"""``potluck calibrate --measured runs.csv``: fit a few cost-model inputs to iteration
times measured by any framework (one row per run), choosing which by the error of runs
left out of the fit.

:mod:`.runs` reads and checks the CSV, :mod:`.params` says which inputs can be fitted,
within which bounds, and applies them to a cluster, :mod:`.solve` is the bounded
least-squares solver, :mod:`.fit` plans the rows and fits a given set of inputs,
:mod:`.select` chooses the set by held-out error, :mod:`.stats` holds the error figures,
:mod:`.output` writes the calibrated cluster file and :mod:`.calibrate` ties them together
(refusing a fit that predicts held-out runs no better than the cluster file).
"""
