"""Searches remembered by cluster shape, for the commands that plan many clusters.

``potluck cost`` plans every offer and ``potluck schedule`` every job shape on every
allocation of the cluster's machines; offers of the same hardware at different prices (two
sellers of 8 RTX 4090s), and allocations of node groups built alike (two racks of the same
machines, named apart), plan the same cluster *shape*. A :class:`PlanMemo` runs the search
once per shape and hands each asker the result on its own cluster: the plans carry the
asker's cluster description (its name, prices and group names, which the device ids
carry; the predictions depend on none of them), an infeasible shape raises the same
explanation again.

A shape is everything the search reads: the node groups in order, each with its devices'
figures, the declared links, the calibration, the model, the training shape (batch,
sequence length, dtype, execution) and the search options. Names and prices are not part
of it (group names are, where a calibration names groups). One memo lives as long as one
command; nothing is kept between commands.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from potluck.cluster.catalog import DeviceType
from potluck.cluster.nodes import NodeGroup
from potluck.cluster.spec import ClusterSpec
from potluck.errors import InfeasibleError
from potluck.model.spec import ModelSpec
from potluck.planner.options import SearchOptions
from potluck.planner.requests.host_limit import search_explained
from potluck.planner.search import SearchResult, search
from potluck.plans import Plan, TrainingShape, plan_from_dict, plan_to_dict


@dataclass(frozen=True)
class ShapeKey:
    """What a search's result depends on (see the module docstring)."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingShape
    options: SearchOptions


def shape_key(spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
              options: SearchOptions) -> ShapeKey:
    """The key of a search: ``spec`` without its name, prices and group names."""
    names = _positional_names(spec)
    cluster = replace(
        spec, name="", nodes=tuple(_unpriced_group(g, names[g.name]) for g in spec.nodes),
        device_types=tuple(map(_unpriced_type, spec.device_types)),
        links=tuple(replace(link, between=(names[link.between[0]], names[link.between[1]]))
                    for link in spec.links))
    return ShapeKey(cluster, model, training, options)


def _positional_names(spec: ClusterSpec) -> dict[str, str]:
    """Each group's name in the key: its place, unless a calibration names groups."""
    if spec.calibration is not None:
        return {group.name: group.name for group in spec.nodes}
    return {group.name: f"group{index}" for index, group in enumerate(spec.nodes)}


def _unpriced_group(group: NodeGroup, name: str) -> NodeGroup:
    return replace(group, name=name, price_per_hour_usd=None, purchase_price_usd=None,
                   power_w=None)


def _unpriced_type(device_type: DeviceType) -> DeviceType:
    return replace(device_type, price_per_hour_usd=0.0, spot_price_per_hour_usd=0.0,
                   purchase_price_usd=0.0, power_w=0.0, sources={})


@dataclass(frozen=True)
class _Found:
    """A search's outcome and the cluster it was made on."""

    spec: ClusterSpec
    outcome: SearchResult | InfeasibleError


class PlanMemo:
    """Search results by cluster shape; counts the searches run and those saved. With
    ``explain``, an infeasible shape's error names host memory where that is the limit
    (:func:`~potluck.planner.requests.host_limit.search_explained`: a second search)."""

    def __init__(self, explain: bool = True) -> None:
        self.explain = explain
        self._found: dict[ShapeKey, _Found] = {}
        self.searches = 0
        self.reused = 0

    def search(self, spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
               options: SearchOptions,
               progress: Callable[[float], None] | None = None) -> SearchResult:
        """The search's result for ``spec`` (raising its InfeasibleError), run once per shape;
        the plans are on ``spec``."""
        key = shape_key(spec, model, training, options)
        found = self._found.get(key)
        if found is None:
            self.searches += 1
            found = self._found[key] = _Found(spec, self._outcome(spec, model, training,
                                                                  options, progress))
        else:
            self.reused += 1
        if isinstance(found.outcome, InfeasibleError):
            raise InfeasibleError(str(found.outcome))
        names = dict(zip((g.name for g in found.spec.nodes), (g.name for g in spec.nodes),
                         strict=True))
        return replace(found.outcome,
                       plans=tuple(rehomed(p, spec, names) for p in found.outcome.plans))


    def _outcome(self, spec: ClusterSpec, model: ModelSpec, training: TrainingShape,
                 options: SearchOptions, progress: Callable[[float], None] | None
                 ) -> SearchResult | InfeasibleError:
        run = search_explained if self.explain else search
        try:
            return run(spec, model, training, options, progress)
        except InfeasibleError as err:
            return err


def rehomed(plan: Plan, spec: ClusterSpec, names: dict[str, str]) -> Plan:
    """``plan`` on ``spec``, a cluster of the same shape whose groups are ``names``' values
    for the plan's groups (its keys): every device id and machine renamed."""
    moved = replace(plan, cluster=spec)
    renames = {old: new for old, new in names.items() if old != new}
    if not renames:
        return moved
    pattern = re.compile(rf"^({'|'.join(map(re.escape, renames))})(\.\d+(:\d+)?)$")
    data = plan_to_dict(moved)
    cluster = data.pop("cluster")
    data = _renamed(data, lambda text: pattern.sub(lambda m: renames[m[1]] + m[2], text))
    return replace(plan_from_dict({**data, "cluster": cluster}), cluster=spec, model=plan.model)


def _renamed(value: Any, rename: Callable[[str], str]) -> Any:
    """``value`` (a plan's JSON form) with ``rename`` applied to every string in it."""
    if isinstance(value, str):
        return rename(value)
    if isinstance(value, dict):
        return {key: _renamed(item, rename) for key, item in value.items()}
    if isinstance(value, list):
        return [_renamed(item, rename) for item in value]
    return value
