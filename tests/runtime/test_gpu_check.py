"""benchmarks/gpu_check.py's parts that run without a GPU: naming the GPU, the loss check,
finding the GPU tests, the one line it exits with where there is no CUDA, the multi-rank
part's skip on one GPU, plans, loss comparison, resume command and budget; the memory
contract's tolerance and table, the swap and offload verdicts, the sanitizer's command,
the MFU arithmetic, and the multi-GPU cases' pairing onto GPUs, environment and the
killed rank's deadline."""

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
    from potluck.plans.memory import Swap

    multi = gpu_check.multi_module()
    cases = [*multi.ALL_CASES, multi.RESUME_CASE]
    shapes = set()
    for case in cases:
        plan = multi.multi_plan("a100-80g-sxm", case)
        stages = plan.pipelines[0].stages
        tps = tuple(s.tp for s in stages)
        assert (plan.num_gpus, plan.dp, len(stages), plan.zero, plan.ep) == (
            case.gpus, case.dp, case.pp, case.zero, case.ep), case.name
        assert tps == (case.stage_tps or (case.tp,) * case.pp), case.name
        assert plan.schedule.value == case.schedule and plan.training.dtype.value == "fp32"
        assert plan.comm.split_p2p_channels == case.split_channels
        assert plan.comm.dp_priority_schedule == case.priority
        assert stages[0].comm.tp_overlap_chunks == case.tp_overlap
        assert (stages[0].memory.swap is Swap.PEER) == case.peer_swap
        if case.peer_swap:
            assert stages[0].memory.swap_peer == stages[1].devices[0]
        assert plan.prediction is not None and plan.prediction.memory
        shapes.add((plan.model.is_moe, plan.training.global_batch, plan.training.seq_len))
    assert len(shapes) == 2, "every case trains what its reference trains"
    assert {case.gpus for case in cases} == {1, 2, 3, 4}


def test_a_case_plans_on_the_gpus_it_was_given(gpu_check):
    multi = gpu_check.multi_module()
    zero3 = multi.case_by_key("zero3")
    plan = multi.multi_plan("h100-sxm", zero3, [4, 5, 6, 7])
    assert plan.devices == ("gpu.0:4", "gpu.0:5", "gpu.0:6", "gpu.0:7")
    assert set(plan.unused_devices) == {f"gpu.0:{n}" for n in range(4)}
    peer = multi.multi_plan("h100-sxm", multi.case_by_key("peer-swap"), [6, 3])
    assert peer.devices == ("gpu.0:6", "gpu.0:3")
    assert peer.pipelines[0].stages[0].memory.swap_peer == "gpu.0:3"
    mixed = multi.multi_plan("h100-sxm", multi.case_by_key("mixed-tp"), [1, 2, 3])
    assert [s.devices for s in mixed.pipelines[0].stages] == [("gpu.0:1", "gpu.0:2"),
                                                              ("gpu.0:3",)]


def test_losses_must_stay_within_the_tolerance_of_the_reference_at_every_step(gpu_check):
    reference = [5.50, 5.30, 5.10, 4.90]
    tolerance = gpu_check.multi_module().MULTI_LOSS_TOLERANCE
    assert tolerance == 1e-4, "FP32 runs, so that races show"
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
    parts = gpu_check.selected_parts(None, skip_tests=False)
    assert gpu_check.estimate_s(parts) <= gpu_check.TOTAL_BUDGET_S == 600, "10 min on one GPU"
    assert gpu_check.budget_s(parts, 1) == gpu_check.TOTAL_BUDGET_S
    for gpus in (2, 4, 8):
        rounds, _ = gpu_check.multi_rounds(gpus)
        assert gpu_check.estimate_s(parts) < gpu_check.estimate_s(parts, rounds)
        assert gpu_check.estimate_s(parts, rounds) <= gpu_check.budget_s(parts, gpus)
    assert gpu_check.estimate_s(("g", "h")) == gpu_check.ESTIMATE_S["g"] + gpu_check.ESTIMATE_S["h"]


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


# ---- (f) the memory contract ------------------------------------------------------------------


def _memory(gpu_check):
    from gpu_check_parts import memory_contract

    return memory_contract


def test_the_memory_contract_takes_each_devices_largest_peaks_over_the_steps(gpu_check):
    m = _memory(gpu_check)
    steps = [[{"device": "gpu.0:0", "device_bytes": 5e9, "reserved_bytes": 5.5e9}],
             [{"device": "gpu.0:0", "device_bytes": 6e9, "reserved_bytes": 6.2e9}],
             [{"device": "gpu.0:0", "device_bytes": 5.8e9, "reserved_bytes": 7e9}]]
    [row] = m.peak_rows("plain", {"gpu.0:0": 6.1e9}, steps)
    assert (row.allocated_bytes, row.reserved_bytes, row.predicted_bytes) == (6e9, 7e9, 6.1e9)


@pytest.mark.parametrize(("allocated", "reserved", "ok"), [
    (10.0, 11.0, True), (11.4, 12.9, True), (8.6, 9.0, True),
    (11.8, 12.0, False),  # allocated 18 % over
    (8.0, 9.0, False),  # 20 % under: a gross over-prediction
    (10.0, 13.5, False),  # reserve 35 % over
])
def test_the_memory_contract_fails_beyond_its_stated_tolerance(gpu_check, allocated, reserved, ok):
    m = _memory(gpu_check)
    gb = 1e9
    row = m.MemoryRow("plain", "gpu.0:0", 10 * gb, allocated * gb, reserved * gb)
    assert m.MEMORY_TOLERANCE == 0.15 and m.RESERVED_TOLERANCE == 0.30
    assert m.memory_verdict(row)[0] == ok
    assert not m.memory_verdict(m.MemoryRow("plain", "cpu", 10 * gb, 10 * gb, None))[0]


def test_the_memory_table_has_a_row_per_case_and_device(gpu_check):
    m = _memory(gpu_check)
    rows = [m.MemoryRow("plain", "gpu.0:0", 10e9, 10.5e9, 11e9),
            m.MemoryRow("swap to host", "gpu.0:0", 8e9, 10e9, None)]
    lines = m.memory_table(rows).splitlines()
    assert lines[0].startswith("memory contract: allocated within +-15%")
    assert lines[-2] == "| plain | gpu.0:0 | 10.00 | 10.50 | +5% | 11.00 | +10% | yes |"
    assert lines[-1] == "| swap to host | gpu.0:0 | 8.00 | 10.00 | +25% | - | - | NO |"


def test_the_memory_plans_make_the_memory_choices_they_are_named_for(gpu_check):
    from potluck.plans.memory import Offload, Swap

    m = _memory(gpu_check)
    plans = {case.name: m.memory_plan("h100-sxm", case) for case in m.MEMORY_CASES}
    assert plans["swap to host"].stage_memory(0, 0).swap is Swap.HOST
    assert plans["optimizer offload"].stage_memory(0, 0).offload is Offload.OPTIMIZER
    assert plans["full recomputation"].stage_memory(0, 0).recompute.value == "full"
    plain = plans["plain"].stage_memory(0, 0)
    assert (plain.swap, plain.offload, plain.recompute.value) == (Swap.NONE, Offload.NONE, "none")
    assert all(m.predicted_totals(p)["gpu.0:0"] > 1e9 for p in plans.values())


# ---- (g), (h) swap and offload against the plain runs -------------------------------------------


def test_swapped_gradients_must_equal_the_unswapped_ones(gpu_check):
    import torch
    from gpu_check_parts import numerics

    reference = {"a": torch.ones(4), "b": torch.arange(4.0)}
    ok, detail = numerics.grads_match(reference, {k: v.clone() for k, v in reference.items()})
    assert ok and detail.startswith("2 of 2 gradients bitwise equal")
    assert not numerics.grads_match(reference, {"a": torch.ones(4), "b": torch.arange(4.0) * 1.1})[0]
    assert not numerics.grads_match(reference, {"a": torch.ones(4)})[0]


def test_the_stash_must_be_close_to_the_predicted_activation_bytes(gpu_check):
    from gpu_check_parts import numerics

    assert numerics.stash_matches(110e6, 100e6)[0]
    assert not numerics.stash_matches(300e6, 100e6)[0]  # autocast's weight copies stashed too
    assert not numerics.stash_matches(10e6, 0.0)[0]


def _run(losses, dtype, scale=1.0):
    import torch

    return {"losses": losses, "dtypes": {"w": dtype, "norm": dtype},
            "params": {"w": torch.ones(8) * scale, "norm": torch.ones(2)}}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_offload_must_train_like_plain_adamw_with_16_bit_device_parameters(gpu_check, dtype):
    from gpu_check_parts import numerics

    half = numerics.HALF[dtype]
    plain = _run([5.0, 4.8, 4.6], "torch.float32")
    ok, detail = numerics.offload_matches(plain, _run([5.0, 4.81, 4.6], half, 1.001), dtype)
    assert ok, detail
    assert "device parameters" in detail and half in detail
    fp32_on_device = _run([5.0, 4.8, 4.6], "torch.float32")
    assert "not torch." in numerics.offload_matches(plain, fp32_on_device, dtype)[1]
    assert not numerics.offload_matches(plain, _run([5.0, 4.9, 4.6], half), dtype)[0]
    assert not numerics.offload_matches(plain, _run([5.0, 4.8, 4.6], half, 1.1), dtype)[0]


def test_the_swap_and_offload_plans_differ_only_in_that_choice(gpu_check):
    from gpu_check_parts import numerics

    from potluck.plans.memory import Offload, Swap

    for shape in (numerics.check_shape(), numerics.tiny_shape()):
        plain = numerics.one_gpu_plan("h100-sxm", shape, "bf16")
        swapped = numerics.one_gpu_plan("h100-sxm", shape, "bf16", swap="host")
        offloaded = numerics.one_gpu_plan("h100-sxm", shape, "fp16", offload="optimizer")
        assert swapped.stage_memory(0, 0).swap is Swap.HOST
        assert plain.stage_memory(0, 0).swap is Swap.NONE
        assert offloaded.stage_memory(0, 0).offload is Offload.OPTIMIZER
        assert plain.pipelines[0].num_micro_batches == 1


# ---- (i) the sanitizer ------------------------------------------------------------------------


def test_the_sanitizer_reruns_g_and_h_on_a_tiny_model_with_csan_on(gpu_check):
    from gpu_check_parts import sanitizer

    command = sanitizer.sanitizer_command("h100-sxm")
    assert command[1] == str(SCRIPT) and command[command.index("--only") + 1] == "g,h"
    assert "--tiny" in command and command[command.index("--device") + 1] == "h100-sxm"
    assert sanitizer.sanitizer_env()["TORCH_CUDA_SANITIZER"] == "1"
    race = "CSAN detected a possible data race on tensor with data pointer 1234"
    assert sanitizer.sanitizer_detail(f"x\n{race}\n1 of 3 checks passed\n", 1).startswith(race)
    assert sanitizer.sanitizer_detail("3 of 3 checks passed\n", 0) == "3 of 3 checks passed"


def test_only_runs_the_parts_named_in_order(gpu_check):
    from potluck.errors import ConfigError

    assert gpu_check.selected_parts("h,g", skip_tests=False) == ("g", "h")
    assert "a" not in gpu_check.selected_parts(None, skip_tests=True)
    with pytest.raises(ConfigError, match="no part z"):
        gpu_check.selected_parts("g,z", skip_tests=False)


# ---- (j) MFU -----------------------------------------------------------------------------------


def test_mfu_is_the_model_flops_formula_over_the_catalog_bf16_peak(gpu_check):
    from gpu_check_parts import mfu

    from potluck.cluster.catalog import lookup
    from potluck.model.counts import model_flops_per_token

    model = mfu.mfu_model()
    assert (model.hidden_size, model.num_heads, model.ffn_hidden_size, model.num_layers) == (
        4096, 32, 11008, 4)
    peak = mfu.bf16_peak_flops("h100-sxm")
    assert peak == lookup("h100-sxm").tflops * 1e12
    result = mfu.step_mfu(model, 4096, 4096, 0.25, peak)
    assert result.mfu == pytest.approx(model_flops_per_token(model, 4096) * 4096 / 0.25 / peak)
    # 6 x parameters x tokens, roughly (attention adds the rest): about 1.1B parameters
    assert 6 * 1.0e9 * 4096 < result.model_flops < 6 * 1.4e9 * 4096
    assert mfu.measured_step_s([9.0, 5.0, 1.0, 1.2]) == pytest.approx(1.1)
    assert mfu.measured_step_s([3.0]) == 3.0
    assert mfu.mfu_line(result, 0.5, "none").startswith(f"MFU {result.mfu:.1%}, predicted 50.0%")


def test_the_mfu_plan_is_one_gpu_one_sequence_of_4096(gpu_check):
    from gpu_check_parts import mfu

    plan = mfu.mfu_plan("h100-sxm")
    assert (plan.num_gpus, plan.training.global_batch, plan.training.seq_len) == (1, 1, 4096)
    assert plan.training.dtype.value == "bf16"


# ---- (e) the multi-GPU cases ---------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [2, 3, 4, 8])
def test_cases_run_two_at_a_time_on_disjoint_gpus(gpu_check, gpus):
    multi = gpu_check.multi_module()
    numbers = list(range(gpus))
    rounds, skipped = multi.pair_rounds(multi.ALL_CASES, numbers)
    placed = [a for r in rounds for a in r]
    assert sorted([a.case.key for a in placed] + [c.key for c, _ in skipped]) == sorted(
        c.key for c in multi.ALL_CASES), "every case runs once or is skipped"
    for r in rounds:
        assert 1 <= len(r) <= 2
        used = [g for a in r for g in a.gpus]
        assert len(used) == len(set(used)) and set(used) <= set(numbers)
        assert all(len(a.gpus) == a.case.gpus for a in r)
    for case, why in skipped:
        assert case.gpus > gpus and why == f"skipped: needs {case.gpus} GPUs, {gpus} visible"
    assert {c.key for c, _ in skipped} == {c.key for c in multi.ALL_CASES if c.gpus > gpus}
    assert {c.key for c, _ in skipped} >= ({"pp4-1f1b", "pp4-interleaved", "pp4-zb", "zero3"}
                                           if gpus < 4 else set())
    if gpus >= 4:
        assert not skipped and len(rounds) <= len(multi.ALL_CASES) // 2 + 3


def test_pairing_keeps_the_case_order_and_fills_rounds(gpu_check):
    multi = gpu_check.multi_module()
    a, b, c = (multi.MultiCase(k, k, dp=n) for k, n in (("a", 2), ("b", 3), ("c", 1)))
    rounds, skipped = multi.pair_rounds([a, b, c], [4, 5, 6, 7])
    assert [[(x.case.key, x.gpus) for x in r] for r in rounds] == [
        [("a", (4, 5)), ("c", (6,))], [("b", (4, 5, 6))]]
    assert skipped == []


def test_the_gpus_a_process_may_use_are_its_visible_ones(gpu_check):
    multi = gpu_check.multi_module()
    assert multi.available_gpus(None, 4) == [0, 1, 2, 3]
    assert multi.available_gpus("4,6", 2) == [4, 6]
    assert multi.available_gpus("4,6,-1,7", 2) == [4, 6]


def test_a_case_runs_alone_on_its_gpus_with_the_flight_recorder_on(gpu_check, tmp_path):
    multi = gpu_check.multi_module()
    assigned = multi.Assigned(multi.case_by_key("zero3"), (4, 5, 6, 7))
    env = multi.case_env(assigned, tmp_path, {"HOME": "/h", "CUDA_VISIBLE_DEVICES": "0"})
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and env["HOME"] == "/h"
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
    assert "POTLUCK_SILENCE_S" not in env
    kill = multi.case_env(multi.Assigned(multi.case_by_key("kill"), (0, 1)), tmp_path, {})
    assert kill["POTLUCK_SILENCE_S"] == "15"
    command = multi.case_command("h100-sxm", assigned, tmp_path / "r.json")
    assert command[command.index("--case") + 1] == "zero3"
    assert command[command.index("--gpus") + 1] == "4,5,6,7"
    assert multi.CASE_TIMEOUT_S == 60


def test_the_killed_rank_must_be_named_within_the_silence_limit_plus_10_s(gpu_check):
    multi = gpu_check.multi_module()
    assert multi.kill_deadline_s(15.0) == 25.0
    message = "RankFailure: rank 1 (gpu.0:3) died (killed by signal 9)"
    ok, detail = multi.killed_rank_verdict(message, 1, "gpu.0:3", 100.0, 112.0)
    assert ok and detail.startswith("stopped 12.0 s after the kill (at most 25 s)")
    assert not multi.killed_rank_verdict(message, 1, "gpu.0:3", 100.0, 126.0)[0]
    assert not multi.killed_rank_verdict("rank 0 (gpu.0:2) failed", 1, "gpu.0:3", 100, 101)[0]
    assert not multi.killed_rank_verdict(None, 1, "gpu.0:3", 100.0, 101.0)[0]
    assert not multi.killed_rank_verdict(message, 1, "gpu.0:3", None, 101.0)[0]


def test_a_cases_verdict_compares_with_its_own_reference(gpu_check):
    multi = gpu_check.multi_module()
    found = {"reference": {"losses": [5.0, 4.0]}, "moe-reference": {"losses": [6.0, 5.0]},
             "dp2": {"losses": [5.0, 4.00005]}, "ep2": {"losses": [6.0, 5.01]},
             "kill": {"ok": True, "detail": "stopped"}, "tp2": {"error": "did not finish"},
             "zero3": {"losses": [5.0, 4.0], "memory": [
                 {"case": "zero3", "device": "gpu.0:0", "predicted_bytes": 1e9,
                  "allocated_bytes": 2e9, "reserved_bytes": 2e9}]}}
    verdict = {key: multi.case_outcome(multi.case_by_key(key), found)
               for key in ("reference", "dp2", "ep2", "kill", "tp2", "zero3", "pp2")}
    assert verdict["reference"].ok and verdict["dp2"].ok and verdict["kill"].ok
    assert not verdict["ep2"].ok, "against the MoE's own reference"
    assert verdict["tp2"].detail == "did not finish" and not verdict["pp2"].ok
    assert not verdict["zero3"].ok and "memory:" in verdict["zero3"].detail


def test_the_plan_printed_first_lists_rounds_and_skips(gpu_check, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    lines = gpu_check.schedule_lines(gpu_check.selected_parts(None, False), 2)
    assert lines[0].startswith("  about ") and "at most 1020 s" in lines[0]
    assert any(line.startswith("  (e) round 1: reference on GPUs 0; moe-reference on GPUs 1")
               for line in lines)
    assert "  (e) zero3 skipped: needs 4 GPUs, 2 visible" in lines
    one = gpu_check.schedule_lines(("f", "e"), 1)
    assert one[-1].startswith("  (e) skipped: 1 GPU visible")


def test_a_round_runs_its_cases_side_by_side_and_kills_one_past_its_limit(gpu_check, monkeypatch,
                                                                         tmp_path):
    import time

    multi = gpu_check.multi_module()
    monkeypatch.setattr(multi, "CASE_TIMEOUT_S", 2.0)

    def command(device, assigned, result):
        body = (f"import pathlib; pathlib.Path({str(result)!r}).write_text('{{\"losses\": [1.0]}}')"
                if assigned.case.key == "dp2" else "import time; time.sleep(60)")
        return [sys.executable, "-c", body]

    monkeypatch.setattr(multi, "case_command", command)
    placed = [multi.Assigned(multi.case_by_key("dp2"), (0, 1)),
              multi.Assigned(multi.case_by_key("tp2"), (2, 3))]
    began = time.monotonic()
    later = [multi.Assigned(multi.case_by_key("zero1"), (0, 1))]
    found = multi.run_rounds("h100-sxm", [placed, later], tmp_path, budget_s=6.0)
    assert time.monotonic() - began < 10
    assert found["dp2"] == {"losses": [1.0]}
    assert found["zero1"] == {"error": "not run: the check's time budget is spent"}
    assert found["tp2"]["error"].startswith("did not finish within 2 s (flight recorder dumps")
