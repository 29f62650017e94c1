"""Expert parallelism on CPU ranks: the routed experts of a mixture of experts split over
the replicas of a stage, tokens exchanged all-to-all, train exactly as one process does,
with the routers' auxiliary loss, under ZeRO, with ranks numbered out of plan order;
checkpoints resume under a layout without it and export a model transformers loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from family_configs import tiny_family
from runtime_helpers import make_plan, pipe, reference_losses, reference_model, run_plan
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.plans import check_plan
from potluck.runtime.checkpoints.export import export_checkpoint
from potluck.runtime.checkpoints.storage import latest_checkpoint
from potluck.schedules import Schedule

TOLERANCE = 2e-5


def _expert_plan(spec, pipelines, ep: int = 2, **changes):
    return dataclasses.replace(make_plan(spec, pipelines), expert_parallel=ep, **changes)


def test_two_replicas_splitting_the_experts_train_like_one_process():
    spec = tiny_family("mixtral")
    plan = _expert_plan(spec, [pipe([(1, (0, 4))], 1, 2), pipe([(1, (0, 4))], 1, 2)])
    expected = reference_losses(spec, 4, steps=2)
    assert run_plan(plan, steps=2) == pytest.approx(expected, abs=TOLERANCE)


@pytest.mark.parametrize(("schedule", "recompute"), [(Schedule.ZERO_BUBBLE, Recompute.NONE),
                                                     (Schedule.ONE_F_ONE_B, Recompute.FULL)])
def test_split_backward_passes_and_recomputation_exchange_in_step(schedule, recompute):
    """Zero-bubble's separate input and weight passes, and full recomputation (which runs
    each block's exchanges again in the backward pass), pair up across the replicas."""
    spec = tiny_family("mixtral")
    stages = [(1, (0, 2)), (1, (2, 4))]
    plain = make_plan(spec, [pipe(stages, 1, 2)] * 2, schedule=schedule, recompute=recompute)
    split = dataclasses.replace(plain, expert_parallel=2)
    assert run_plan(split, steps=2) == pytest.approx(run_plan(plain, steps=2), abs=TOLERANCE)


@pytest.mark.parametrize("zero", [1, 2])
def test_the_auxiliary_loss_zero_and_ranks_out_of_plan_order_change_nothing(zero: int):
    """pp=2 x dp=2 with the experts split in two, the routers' loss on, ZeRO-1 or 2, and
    ranks numbered so that pipeline 1 holds the first shard of the last stage's experts: one
    process's losses."""
    spec = tiny_family("qwen3_moe", output_router_logits=True, router_aux_loss_coef=5.0)
    stages = [(1, (0, 1)), (1, (1, 4))]
    plan = _expert_plan(spec, [pipe(stages, 1, 2), pipe(stages, 1, 2)], zero=zero)
    order = ("cpu.0:3", "cpu.0:0", "cpu.0:2", "cpu.0:1")
    plain = make_plan(spec, [pipe([(1, (0, 4))], 1, 4)])
    assert run_plan(plan, steps=3, rank_order=order) == pytest.approx(
        run_plan(plain, steps=3), abs=TOLERANCE)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _expert_rows_by_file(checkpoint: Path) -> dict[str, int]:
    """Per checkpoint file (by writing rank), the rows of the first expert weight in it."""
    rows = {}
    for path in sorted(checkpoint.glob("shard-*.safetensors")):
        with safe_open(str(path), "pt") as tensors:
            keys = [k for k in tensors.keys() if k.endswith("experts.gate_up_proj")]
            if keys:
                rows[path.name[:11]] = tensors.get_slice(keys[0]).get_shape()[0]
    return rows


def test_a_checkpoint_of_split_experts_resumes_without_them_and_exports(tmp_path: Path):
    spec = tiny_family("mixtral")
    first = _expert_plan(spec, [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)] * 2)
    later = make_plan(spec, [pipe([(1, (0, 4))], 1, 4)])
    reference = reference_model(spec)
    expected = reference_losses(spec, 4, steps=4, model=reference)
    run_dir = str(tmp_path / "run")
    got = run_plan(first, steps=2, out_dir=run_dir)
    assert _expert_rows_by_file(latest_checkpoint(run_dir)) == {
        "shard-00001": 2, "shard-00002": 2, "shard-00003": 2, "shard-00004": 2}
    got += run_plan(later, steps=4, out_dir=run_dir, resume=True)
    assert got == pytest.approx(expected, abs=TOLERANCE)
    exported = export_checkpoint(latest_checkpoint(run_dir), spec, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert torch.allclose(_logits(loaded), _logits(reference.eval()), atol=1e-3)


def test_a_run_without_split_experts_resumes_with_them(tmp_path: Path):
    spec = tiny_family("mixtral")
    first = make_plan(spec, [pipe([(1, (0, 4))], 1, 4)])
    later = _expert_plan(spec, [pipe([(1, (0, 4))], 1, 2)] * 2)
    expected = reference_losses(spec, 4, steps=4)
    run_dir = str(tmp_path / "run")
    got = run_plan(first, steps=2, out_dir=run_dir)
    got += run_plan(later, steps=4, out_dir=run_dir, resume=True)
    assert got == pytest.approx(expected, abs=TOLERANCE)


@pytest.mark.parametrize(("family", "pipelines", "changes", "message"), [
    ("qwen3", [pipe([(1, (0, 4))], 1, 2)] * 2, {}, "needs a mixture-of-experts model"),
    ("mixtral", [pipe([(1, (0, 4))], 1, 2)] * 2, {"expert_parallel": 3}, "does not divide the 4"),
    ("mixtral", [pipe([(1, (0, 4))], 1, 2)] * 3, {"expert_parallel": 2}, "does not divide the 3"),
    ("mixtral", [pipe([(1, (0, 4))], 1, 2), pipe([(1, (0, 1)), (1, (1, 4))], 1, 2)], {},
     "differ in stages"),
    ("mixtral", [pipe([(1, (0, 4))], 1, 2), pipe([(1, (0, 4))], 2, 1)], {}, "differ in stages"),
    ("mixtral", [pipe([(1, (0, 4))], 1, 2)] * 2, {"zero": 3}, "zero 3"),
])
def test_expert_parallelism_it_cannot_run_is_refused_in_one_line(family, pipelines, changes,
                                                                 message):
    changes = {"expert_parallel": 2, **changes}
    plan = dataclasses.replace(make_plan(tiny_family(family), pipelines), **changes)
    with pytest.raises(ConfigError, match=message) as err:
        check_plan(plan)
    assert "\n" not in str(err.value)
