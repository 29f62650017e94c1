"""Planner layer: the cost model and the heterogeneity-aware search that produce Plans.

:class:`CostModel` prices one pipeline stage; :func:`predict` a whole plan;
:func:`search` finds the fastest plans under :class:`SearchOptions`.
"""

from potluck.planner.cost import CostModel
from potluck.planner.evaluate import predict, stage_op_times
from potluck.planner.options import Partition, SearchOptions
from potluck.planner.search import SearchResult, search

__all__ = ["CostModel", "Partition", "SearchOptions", "SearchResult", "predict", "search",
           "stage_op_times"]
