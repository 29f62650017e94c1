"""Searches remembered by cluster shape, for the commands that plan many clusters.

``potluck cost`` plans every offer and ``potluck schedule`` every job shape on every
allocation; offers of the same hardware at different prices (two sellers of 8 RTX 4090s)
and jobs of the same model, batch and sequence length plan the same cluster *shape*. A
:class:`PlanMemo` runs the search once per shape and hands each asker the result on its
own cluster: the plans carry the asker's cluster description (its name and prices; the
predictions do not depend on either), an infeasible shape raises the same explanation
again.

A shape is everything the search reads: the node groups (names included, since device ids
carry them) with their devices' figures, the declared links, the calibration, the model,
the training shape (batch, sequence length, dtype, execution) and the search options. Names
and prices are not part of it. One memo lives as long as one command; nothing is kept
between commands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from potluck.cluster.catalog import DeviceType
from potluck.cluster.nodes import NodeGroup
from potluck.cluster.spec import ClusterSpec
from potluck.errors import InfeasibleError
from potluck.model.spec import ModelSpec
from potluck.planner.options import SearchOptions
from potluck.planner.requests.host_limit import search_explained
from potluck.planner.search import SearchResult
from potluck.plans import TrainingShape


@dataclass(frozen=True)
class ShapeKey:
    """What a search's result depends on (see the module docstring)."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingShape
    options: SearchOptions


def shape_key(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
              options: SearchOptions) -> ShapeKey:
    """The key of a search: ``spec`` without its name and prices."""
    cluster = replace(spec, name="", nodes=tuple(map(_unpriced_group, spec.nodes)),
                      device_types=tuple(map(_unpriced_type, spec.device_types)))
    return ShapeKey(cluster, model, training, options)


def _unpriced_group(group: NodeGroup) -> NodeGroup:
    return replace(group, price_per_hour_usd=None, purchase_price_usd=None, power_w=None)


def _unpriced_type(device_type: DeviceType) -> DeviceType:
    return replace(device_type, price_per_hour_usd=0.0, spot_price_per_hour_usd=0.0,
                   purchase_price_usd=0.0, power_w=0.0, sources={})


class PlanMemo:
    """Search results by cluster shape; counts the searches run and those saved."""

    def __init__(self) -> None:
        self._found: dict[ShapeKey, SearchResult | InfeasibleError] = {}
        self.searches = 0
        self.reused = 0

    def search(self, spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
               options: SearchOptions,
               progress: Callable[[float], None] | None = None) -> SearchResult:
        """The search's result for ``spec`` (raising its InfeasibleError), run once per shape;
        the plans describe ``spec``."""
        key = shape_key(spec, model, training, options)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = self._run(spec, model, training, options, progress)
        else:
            self.reused += 1
        if isinstance(found, InfeasibleError):
            raise InfeasibleError(str(found))
        return replace(found, plans=tuple(replace(p, cluster=spec) for p in found.plans))

    def _run(self, spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
             options: SearchOptions, progress: Callable[[float], None] | None
             ) -> SearchResult | InfeasibleError:
        self.searches += 1
        try:
            return search_explained(spec, model, training, options, progress)
        except InfeasibleError as err:
            return err
