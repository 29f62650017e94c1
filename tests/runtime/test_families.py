"""Model families end to end on CPU ranks: a tiny config of each trains under tensor,
pipeline and data parallelism (where the family allows) exactly as one process does; one
family of each way of running (TP adapter, experts, traced) also resumes under another
layout and exports a directory transformers loads with the trained model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_configs import FAMILIES, tiny_family
from runtime_helpers import make_plan, pipe, reference_losses, reference_model, run_plan
from transformers import AutoModelForCausalLM

from potluck.errors import ConfigError
from potluck.plans import check_plan
from potluck.runtime.checkpoints.export import export_checkpoint
from potluck.runtime.checkpoints.storage import latest_checkpoint

TOLERANCE = 2e-5
FIRST_STEPS, STEPS = 2, 4


def _layouts(spec) -> tuple[list, list]:
    """The first run's layout (tp=2 x pp=2 where TP splits the family, else dp=2 x pp=2,
    uneven stages; a traced family: pp=2 alone, tracing is slow) and the resumed run's (one
    pipeline of three stages)."""
    if not spec.tp_refusal:
        first = [pipe([(2, (0, 1)), (2, (1, 4))], 2, 2)]
    elif "tracing" in spec.tp_refusal:
        first = [pipe([(1, (0, 1)), (1, (1, 4))], 1, 4)]
    else:
        first = [pipe([(1, (0, 1)), (1, (1, 4))], 1, 2), pipe([(1, (0, 3)), (1, (3, 4))], 1, 2)]
    resumed = [pipe([(1, (0, 2)), (1, (2, 3)), (1, (3, 4))], 1, 4)]
    return first, resumed


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_trains_like_one_process(family: str):
    spec = tiny_family(family)
    plan = make_plan(spec, _layouts(spec)[0])
    expected = reference_losses(spec, 4, steps=FIRST_STEPS)
    assert run_plan(plan, steps=FIRST_STEPS) == pytest.approx(expected, abs=TOLERANCE)


@pytest.mark.parametrize("family", ["qwen3", "mixtral", "gpt_neox"])  # TP, experts, traced
def test_family_resumes_under_another_layout_and_exports_the_trained_model(family: str,
                                                                           tmp_path: Path):
    spec = tiny_family(family)
    first, resumed = _layouts(spec)
    plan, later = make_plan(spec, first), make_plan(spec, resumed)
    assert plan.training.global_batch == later.training.global_batch == 4
    reference = reference_model(spec)
    expected = reference_losses(spec, 4, steps=STEPS, model=reference)
    run_dir = str(tmp_path / "run")
    got = run_plan(plan, steps=FIRST_STEPS, out_dir=run_dir)
    got += run_plan(later, steps=STEPS, out_dir=run_dir, resume=True)
    assert got == pytest.approx(expected, abs=TOLERANCE)
    exported = export_checkpoint(latest_checkpoint(run_dir), spec, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert type(loaded) is type(reference)
    # the run's weights, not one process's: float sums in another order, amplified by Adam
    assert torch.allclose(_logits(loaded), _logits(reference.eval()), atol=1e-3)


@pytest.mark.parametrize("family", ["phi3", "olmo2", "mixtral", "gpt_neox"])
def test_a_family_tensor_parallelism_cannot_split_is_refused_in_one_line(family: str):
    spec = tiny_family(family)
    assert spec.tp_refusal
    with pytest.raises(ConfigError, match="cannot be split so") as err:
        check_plan(make_plan(spec, [pipe([(2, (0, 4))], 1, 2)]))
    assert "\n" not in str(err.value)
