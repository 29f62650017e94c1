"""benchmarks/gpu_check.py's parts that run without a GPU: naming the GPU, the loss check,
finding the GPU tests, the one line it exits with where there is no CUDA, and the
multi-rank part's skip on one GPU, plans, loss comparison, resume command and budget."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
KNOWN = ["a10", "a100-40g-pcie", "a100-80g-pcie", "a100-80g-sxm", "gh200", "h100-pcie",
         "h100-sxm", "h200", "l40", "l40s", "rtx-6000-ada", "rtx-a6000", "rtx3090", "rtx4090",
         "t4", "v100-16g", "v100-32g"]
GB = 2**30


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "memory_gb", "catalog"), [
    ("NVIDIA A100-SXM4-80GB", 80, "a100-80g-sxm"),
    ("NVIDIA A100-PCIE-40GB", 40, "a100-40g-pcie"),
    ("NVIDIA A100 80GB PCIe", 80, "a100-80g-pcie"),
    ("NVIDIA H100 80GB HBM3", 80, "h100-sxm"),
    ("NVIDIA H100 PCIe", 80, "h100-pcie"),
    ("NVIDIA H200", 141, "h200"),
    ("NVIDIA GH200 480GB", 96, "gh200"),
    ("Tesla V100-SXM2-16GB", 16, "v100-16g"),
    ("Tesla V100-PCIE-32GB", 32, "v100-32g"),
    ("Tesla T4", 15, "t4"),
    ("NVIDIA GeForce RTX 4090", 24, "rtx4090"),
    ("NVIDIA RTX A6000", 48, "rtx-a6000"),
    ("NVIDIA RTX 6000 Ada Generation", 48, "rtx-6000-ada"),
    ("NVIDIA L40S", 48, "l40s"),
])
def test_the_gpu_torch_names_maps_to_its_catalog_entry(gpu_check, name, memory_gb, catalog):
    assert gpu_check.catalog_name(name, memory_gb * GB, KNOWN) == catalog


def test_an_unknown_gpu_asks_for_its_name(gpu_check):
    with pytest.raises(gpu_check.NoGpu, match="pass --device NAME"):
        gpu_check.catalog_name("Matrox G200", 8 * GB, KNOWN)


def test_the_loss_must_be_finite_and_fall(gpu_check):
    assert gpu_check.loss_falls([5.0, 4.8, 4.9, 4.0, 3.5, 3.6])[0]
    assert not gpu_check.loss_falls([5.0, 5.0, 5.0, 5.1, 5.2, 5.0])[0]
    assert not gpu_check.loss_falls([5.0, float("nan"), 4.0, 3.0])[0]
    assert not gpu_check.loss_falls([])[0]


def test_the_gpu_tests_are_found_by_their_marker(gpu_check):
    names = {p.name for p in gpu_check.gpu_test_files()}
    assert "test_gpu.py" in names and "test_gpu_check.py" not in names


def test_without_cuda_it_exits_2_with_one_line(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "no CUDA GPU" in err


def test_a_wrong_device_name_exits_2_with_one_line(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    assert gpu_check.main(["--device", "a1000"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "unknown GPU type 'a1000'" in err


# ---- (e) the multi-rank part: what runs without GPUs ----------------------------------------


@pytest.mark.parametrize(("gpus", "runs"), [(0, False), (1, False), (2, True), (8, True)])
def test_the_multi_rank_part_needs_two_gpus(gpu_check, gpus, runs):
    reason = gpu_check.multi_rank_skip_reason(gpus)
    assert (reason is None) == runs
    if not runs:
        assert reason.startswith("skipped") and "needs 2" in reason and f"{gpus} GPU" in reason


def test_with_one_gpu_the_part_says_it_was_skipped_and_why(gpu_check, capsys):
    deadline = gpu_check.Deadline(0.0)  # spent: the part must not even try to run
    assert gpu_check.run_multi_rank("h100-sxm", deadline, gpu_count=1) == []
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["[e: multi-rank] skipped: 1 GPU visible (torch.cuda.device_count()), "
                   "the multi-rank part needs 2"]
    line = gpu_check.summary_line([gpu_check.Outcome("train bf16", True, "")],
                                  gpu_check.multi_rank_skip_reason(1))
    assert line.startswith("1 of 1 checks passed") and "multi-rank part (e) skipped" in line


def test_each_multi_rank_case_plans_its_pinned_layout_of_one_training_shape(gpu_check):
    cases = [gpu_check.REFERENCE_CASE, *gpu_check.MULTI_CASES, gpu_check.RESUME_CASE]
    shapes = set()
    for case in cases:
        plan = gpu_check.multi_plan("a100-80g-sxm", case)
        stages = plan.pipelines[0].stages
        assert (plan.num_gpus, plan.dp, len(stages), stages[0].tp, plan.shards_optimizer) == (
            case.gpus, case.dp, case.pp, case.tp, case.zero1), case.name
        shapes.add((plan.training.global_batch, plan.training.seq_len, plan.training.dtype))
    assert len(shapes) == 1, "every case trains what the reference trains"
    assert {case.gpus for case in cases} == {1, 2}


def test_losses_must_stay_within_the_tolerance_of_the_reference_at_every_step(gpu_check):
    reference = [5.50, 5.30, 5.10, 4.90]
    tolerance = gpu_check.MULTI_LOSS_TOLERANCE
    ok, detail = gpu_check.losses_match(reference, [x + tolerance / 2 for x in reference])
    assert ok and "largest difference" in detail
    assert not gpu_check.losses_match(reference, [5.50, 5.30, 5.10 + 2 * tolerance, 4.90])[0]
    assert not gpu_check.losses_match(reference, reference[:3])[0]
    assert not gpu_check.losses_match(reference, [5.50, float("nan"), 5.10, 4.90])[0]


def test_the_resume_sees_one_gpu_other_than_the_one_rank_0_saved_from(gpu_check):
    assert gpu_check.one_visible_gpu(None, 2) == "1"
    assert gpu_check.one_visible_gpu("", 4) == "3"
    assert gpu_check.one_visible_gpu("4, 6", 2) == "6"  # indices as this process sees them


def test_the_resume_continues_the_run_with_the_one_gpu_plan(gpu_check, tmp_path):
    command = gpu_check.resume_command(tmp_path / "plan.json", tmp_path, 50.0)
    assert command[1:4] == ["-m", "potluck", "train"]

    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    assert "--resume" in command and flag("--plan") == str(tmp_path / "plan.json")
    assert flag("--steps") == str(gpu_check.MULTI_STEPS) and flag("--out") == str(tmp_path)
    assert flag("--lr") == str(gpu_check.MULTI_LR) and flag("--seed") == "0"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n{"step": 0, "loss": 5.0}\n'
                                            '{"step": 2, "loss": 3.0}\n')
    assert gpu_check.metrics_losses(tmp_path / "metrics.jsonl") == [5.0, 4.0, 3.0]


def test_the_expected_duration_fits_the_budget_with_every_part(gpu_check):
    everything = gpu_check.estimate_s(skip_tests=False, multi_rank=True)
    assert gpu_check.estimate_s(skip_tests=False, multi_rank=False) < everything
    assert everything <= gpu_check.TOTAL_BUDGET_S


@pytest.mark.parametrize(("visible", "gpu_count"), [(None, 2), (None, 8), ("4, 6", 2)])
def test_the_resume_plan_runs_on_the_one_gpu_its_process_sees(gpu_check, monkeypatch, tmp_path,
                                                             visible, gpu_count):
    """CUDA_VISIBLE_DEVICES lists nvidia-smi's numbers and CUDA renumbers them from 0, so
    the one-GPU plan must name the GPU left visible (cuda_ordinal maps it to cuda:0), not
    GPU 0 of a one-GPU machine, which that variable hides."""
    from potluck.plans import load_plan
    from potluck.runtime.launch import session

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: gpu_count)
    monkeypatch.setattr(gpu_check, "run_losses", lambda plan, options, timeout_s: [])
    reference = [5.0, 4.5, 4.0, 3.5]
    ordinals = []

    def resume(plan_file, out, shown: str, timeout_s: float) -> None:
        plan = load_plan(plan_file)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", shown)
        monkeypatch.setattr(session.torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(session.torch.cuda, "device_count", lambda: 1)  # as a rank sees
        ordinals.extend(session.gpu_ordinal(plan, d) for d in plan.devices)
        (out / "metrics.jsonl").write_text("".join(
            f'{{"step": {i}, "loss": {loss}}}\n' for i, loss in enumerate(reference)))

    monkeypatch.setattr(gpu_check, "resume_on_one_gpu", resume)
    outcome = gpu_check.resume_with_fewer_gpus("a100-80g-sxm", reference, 60.0)
    assert ordinals == [0] and outcome.ok, outcome.detail
