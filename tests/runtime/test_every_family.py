"""Every causal-LM family of the installed transformers (its auto mapping), not only those
potluck names: a tiny config of each is either refused in one line or trains under
pipeline parallelism (and tensor parallelism, where potluck claims it for the family)
as one process does, from the first step."""

from __future__ import annotations

import pytest
from every_family import CAUSAL_LM_TYPES, GLOBAL_BATCH, NO_TINY_CONFIG, SWEEP_STEPS, tiny_spec, train_each
from runtime_helpers import reference_losses

from potluck.errors import ConfigError
from potluck.runtime.launch.local import run_local

TOLERANCE = 2e-3
GROUPS = 8  # one multi-rank job per group of families: a failure names its family
SPECS = {model_type: tiny_spec(model_type) for model_type in CAUSAL_LM_TYPES
         if model_type not in NO_TINY_CONFIG}
ACCEPTED = sorted(name for name, spec in SPECS.items() if not isinstance(spec, ConfigError))
TP_CLAIMED = [name for name in ACCEPTED if not SPECS[name].tp_refusal]


def test_every_family_is_accepted_or_refused_in_one_line():
    refusals = {name: str(spec) for name, spec in SPECS.items() if isinstance(spec, ConfigError)}
    assert all("\n" not in line and f"tiny-{name}" in line for name, line in refusals.items())
    assert len(ACCEPTED) > 80  # most decoder families run


def _sweep(model_types: list[str], layout: str) -> None:
    got = run_local(train_each, ("cpu.0:0", "cpu.0:1"), (model_types, layout),
                    timeout_s=120.0 * len(model_types))[0]
    wrong = {}
    for name in model_types:
        expected = reference_losses(SPECS[name], GLOBAL_BATCH, steps=SWEEP_STEPS)
        if got[name] != pytest.approx(expected, abs=TOLERANCE):
            wrong[name] = (got[name], expected)
    assert not wrong, wrong


@pytest.mark.slow
@pytest.mark.parametrize("group", range(GROUPS))
def test_every_accepted_family_trains_under_pipeline_parallelism_like_one_process(group: int):
    _sweep(ACCEPTED[group::GROUPS], "pp")


@pytest.mark.slow
def test_every_family_potluck_splits_by_tensor_parallelism_trains_like_one_process():
    _sweep(TP_CLAIMED, "tp")
