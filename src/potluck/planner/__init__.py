"""Planner layer: the cost model and the heterogeneity-aware search that produce Plans."""

from potluck.planner.cost import CostModel, stage_op_times
from potluck.planner.search import Partition, SearchOptions, SearchResult, search

__all__ = ["CostModel", "Partition", "SearchOptions", "SearchResult", "search", "stage_op_times"]
