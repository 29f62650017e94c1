"""Routed experts saved one tensor per expert, read as transformers' fused expert tensors.

transformers keeps a mixture of experts' weights fused (``mlp.experts.gate_up_proj``,
``[experts, 2 x ffn, hidden]``) but Hugging Face checkpoints, its own ``save_pretrained``
included, hold them one per expert (``mlp.experts.3.gate_proj.weight``, Mixtral's under
``block_sparse_moe.experts.3.w1.weight``). The model type's conversion mapping
(``transformers.conversion_mapping``) says how one becomes the other; potluck follows the
two kinds of step it uses for these models, renamings and ``MergeModulelist(dim=0)``
(stack the experts) optionally followed by ``Concatenate(dim=1)`` (gate then up), and
reads only the experts a rank holds (:meth:`PerExpert.read`). Other conversions are
left alone: their tensors then count as missing or unexpected.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Conversion:
    """One fused tensor (``target``, a name suffix) from per-expert ones (``sources``, with
    ``*`` for the expert index), concatenated along their first dimension."""

    target: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class PerExpert:
    """Where a fused expert tensor's values are: ``parts[e]``, the file names whose
    tensors, concatenated along dimension 0, are expert ``e``'s."""

    parts: tuple[tuple[str, ...], ...]

    def shape_of(self, shapes: Mapping[str, Sequence[int]]) -> tuple[int, ...] | None:
        """The fused shape these tensors make, or None when the experts' shapes disagree."""
        per_expert = {(sum(shapes[n][0] for n in part), *shapes[part[0]][1:])
                      for part in self.parts if all(len(shapes[n]) >= 1 for n in part)}
        tails = {tuple(shapes[n][1:]) for part in self.parts for n in part}
        if len(per_expert) != 1 or len(tails) != 1:
            return None
        return (len(self.parts), *per_expert.pop())

    def read(self, tensor: Callable[[str], torch.Tensor], experts: Sequence[int]) -> torch.Tensor:
        """Experts ``experts`` (in this order) stacked, each read whole by ``tensor(name)``."""
        return torch.stack([torch.cat([tensor(name) for name in self.parts[e]], dim=0)
                            for e in experts])


def renamings_and_conversions(model_type: str) -> tuple[list[tuple[str, str]], list[Conversion]]:
    """The model type's renamings (file pattern, model replacement) and expert conversions
    potluck follows (see the module docstring); none where transformers has no mapping."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return [], []
    renames: list[tuple[str, str]] = []
    conversions: list[Conversion] = []
    for step in get_checkpoint_conversion_mapping(model_type) or []:
        kind = type(step).__name__
        sources, targets = list(step.source_patterns), list(step.target_patterns)
        if kind == "WeightRenaming" and len(sources) == len(targets) == 1:
            renames.append((sources[0], targets[0]))
        elif kind == "WeightConverter" and len(targets) == 1 and _stacks(step.operations,
                                                                        len(sources)):
            conversions.append(Conversion(targets[0], tuple(sources)))
    return renames, conversions


def _stacks(operations: Sequence[Any], sources: int) -> bool:
    """Whether ``operations`` stack the experts (then concatenate several sources)."""
    steps = [(type(op).__name__, getattr(op, "dim", None)) for op in operations]
    if sources == 1:
        return steps == [("MergeModulelist", 0)]
    return steps == [("MergeModulelist", 0), ("Concatenate", 1)]


def renamed(names: Sequence[str], renames: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Each file tensor's name as the model calls it (renamings applied) -> its file name."""
    found: dict[str, str] = {}
    for name in names:
        model_name = name
        for pattern, replacement in renames:
            model_name = re.sub(pattern, replacement, model_name)
        found[model_name] = name
    return found


def per_expert(name: str, experts: int, conversions: Sequence[Conversion],
               present: Mapping[str, str]) -> PerExpert | None:
    """Where fused parameter ``name`` (``experts`` rows) is stored one tensor per expert
    among ``present`` (model name -> file name), or None."""
    for conversion in conversions:
        if not name.endswith(conversion.target):
            continue
        stem = name[: len(name) - len(conversion.target)]
        parts = tuple(tuple(stem + source.replace("*", str(e)) for source in conversion.sources)
                      for e in range(experts))
        if all(part in present for expert in parts for part in expert):
            return PerExpert(tuple(tuple(present[p] for p in expert) for expert in parts))
    return None
