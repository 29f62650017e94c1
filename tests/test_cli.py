"""The command line as a user meets it: real processes, exit codes, stdout and stderr."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# How long a command may run before the test calls it hung. Not a speed check: a command's
# time grows with the machine's load (compute shares the cores, and an emulated run's
# dilation, calibrated under that load, stretches every op again). The demo's dry run takes
# 13 s on an idle two-core machine, 20-32 s beside two busy processes, 48 s beside four, so
# no fixed bound holds under any load (120 s failed on a busy machine). 600 s is what the
# ranks themselves wait for a stuck collective (TrainOptions.timeout_s) before they stop
# with potluck's own error.
HUNG_S = 600
CLUSTER = """
nodes:
  - {name: box3090, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 2, inter_bandwidth: 10Gb/s}
"""


def potluck(*args, cwd=None, columns=160):
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "potluck", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=HUNG_S)


@pytest.fixture
def cluster_file(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(CLUSTER)
    return path


def test_plan_json_has_the_documented_fields(cluster_file, tmp_path):
    out = tmp_path / "plan.json"
    result = potluck("plan", "--cluster", str(cluster_file), "--model", "gpt3-1.3b", "--json",
                     "--global-batch", "32", "-o", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for field in ("iteration_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_gb",
                  "devices", "plan", "breakdown_s", "alternatives"):
        assert field in data
    assert data["tokens_per_s"] == pytest.approx(32 * 2048 / data["iteration_time_s"])
    device = data["devices"][0]
    assert {"id", "node", "type", "stage", "memory_gb"} <= set(device)
    assert json.loads(out.read_text())["training"]["global_batch"] == 32


def test_plan_table_shows_stages_and_the_time_breakdown(cluster_file):
    result = potluck("plan", "-c", str(cluster_file), "-m", "gpt3-1.3b", "--top", "3")
    assert result.returncode == 0, result.stderr
    for heading in ("Pipelines and stages", "Predicted iteration", "Best alternatives", "bubble",
                    "execution: potluck"):
        assert heading in result.stdout


def _published_runs():
    """benchmarks/published_runs.py, imported from its file."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "published_runs.py"
    spec = importlib.util.spec_from_file_location("published_runs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_execution_flag_predicts_a_published_run_as_the_benchmark_does(tmp_path):
    """SC'21 Table 1, first row (1.7B on 32 A100s, t/p/d 1/1/32): the CLI with
    --execution megatron-lm-2021 plans what benchmarks/published_runs.py does."""
    from potluck.model.counts import Recompute
    from potluck.plans import Schedule

    runs = _published_runs()
    expected = runs.predict(runs.gpt(1.7, 24, 2304, 24), 32, 512, 1, 1, Recompute.FULL,
                            Schedule.ONE_F_ONE_B)
    cluster = tmp_path / "selene.yaml"
    cluster.write_text("nodes: [{name: dgx, gpu: a100-80g-sxm, gpus_per_node: 8, count: 4, "
                       "inter_bandwidth: 1600Gb/s, inter_latency: 5us}]\n")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 2304, "n_layer": 24,
                                  "n_head": 24, "n_positions": 2048, "vocab_size": 51200}))
    result = potluck("plan", "-c", str(cluster), "-m", str(config), "--global-batch", "512",
                     "--seq-len", "2048", "--tp", "1", "--pp", "1", "--dp", "32",
                     "--recompute", "full", "--zero", "0", "--execution", "megatron-lm-2021", "--top", "1",
                     "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["execution"] == "megatron-lm-2021"
    assert summary["plan"]["training"]["execution"]["flash_attention"] is False
    assert summary["iteration_time_s"] == pytest.approx(expected.prediction.iteration_time_s,
                                                        rel=1e-9)


@pytest.mark.parametrize(("flag", "section", "fragment"), [
    ("megatron", "", "--execution 'megatron' is neither a preset nor a file; did you mean "
                     "'megatron-lm'?"),
    (None, "execution: {preset: deepspeed, overlap_pp: true}\n",
     "lab.yaml:5: execution.overlap_pp: unknown key; did you mean 'overlap_p2p'?"),
    (None, "execution: {grad_reduce_bytes: fp32}\n",
     "execution.grad_reduce_bytes: must be 2 (16-bit gradients on the wire) or 4 (FP32)"),
])
def test_execution_errors_are_one_line(tmp_path, flag, section, fragment):
    path = tmp_path / "lab.yaml"
    path.write_text(CLUSTER + section)
    result = potluck("plan", "-c", str(path), "-m", "gpt3-125m",
                     *(["--execution", flag] if flag else []))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model", "gpt3-1.3b", "--tp", "3"], "does not divide"),
        (["--model", "gpt4"], "unknown model"),
        (["--model", "llama2-70b"], "add at least"),
        (["--model", "gpt3-1.3b", "--global-batch", "10", "--micro-batch-size", "4"],
         "not a multiple"),
        (["--model", "gpt3-1.3b", "--recompute", "some"], "--recompute must be one of"),
        (["--model", "gpt3-1.3b", "--global-batch", "0"], "--global-batch must be at least 1"),
        (["--model", "gpt3-1.3b", "--seq-len", "0"], "--seq-len must be at least 1"),
        (["--model", "gpt3-1.3b", "--dtype", "fp8"], "--dtype must be one of bf16, fp16, fp32, tf32"),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(cluster_file, args, fragment):
    result = potluck("plan", "--cluster", str(cluster_file), *args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


V100S = """
nodes:
  - {name: v, gpu: v100-32g, gpus_per_node: 2}
devices:
  v100-32g: {fp32_tflops: 15.7, tf32_tflops: 0}
"""


def test_plan_says_its_dtype_and_notes_a_device_computing_in_another(tmp_path):
    cluster = tmp_path / "v100.yaml"
    cluster.write_text(V100S)
    note = "v100-32g computes in fp32, not tf32: no TF32 tensor cores"
    result = potluck("plan", "-c", str(cluster), "-m", "gpt3-125m", "--dtype", "tf32", "--top", "1")
    assert result.returncode == 0, result.stderr
    assert "tokens, tf32" in result.stdout
    assert [line for line in result.stdout.splitlines() if "note:" in line] == [f"note: {note}"]
    data = json.loads(potluck("plan", "-c", str(cluster), "-m", "gpt3-125m", "--dtype", "tf32",
                              "--json").stdout)
    assert data["dtype"] == "tf32" and data["dtype_notes"] == [note]
    assert data["plan"]["training"]["dtype"] == "tf32"


def test_planning_fp32_without_the_devices_fp32_figure_names_the_field_to_set(tmp_path):
    cluster = tmp_path / "mine.yaml"
    cluster.write_text("nodes: [{name: m, gpu: my-gpu, gpus_per_node: 2}]\n"
                       "devices:\n  my-gpu: {tflops: 100, memory: 24GB}\n")
    result = potluck("plan", "-c", str(cluster), "-m", "gpt3-125m", "--dtype", "fp32")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "'my-gpu' has no fp32_tflops figure" in lines[0], result.stderr


def test_bad_cluster_files_are_one_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes:\n  - name: a\n    gpu: rtx3099\n    gpus_per_node: 2\n")
    result = potluck("plan", "--cluster", str(broken), "--model", "gpt3-125m")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "broken.yaml:3" in result.stderr and "rtx3090" in result.stderr
    missing = potluck("plan", "--cluster", str(tmp_path / "none.yaml"), "--model", "gpt3-125m")
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_catalog_shows_every_name_whole_at_80_columns():
    from potluck.cluster.catalog import catalog

    result = potluck("catalog", columns=80)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    first_words = {line.split()[0] for line in lines if line.strip()}
    assert set(catalog()) <= first_words  # whole, the way a cluster file's `gpu:` takes them
    row = next(line.split() for line in lines if line.split()[:1] == ["a100-40g-pcie"])
    assert row[1:4] == ["312", "156", "19.5"]  # 16-bit, TF32 and FP32 peaks


def test_catalog_json_has_every_device_with_its_sources():
    from potluck.cluster.catalog import catalog

    result = potluck("catalog", "--json")
    assert result.returncode == 0, result.stderr
    devices = {d["name"]: d for d in json.loads(result.stdout)}
    assert set(devices) == set(catalog())
    h100 = devices["h100-sxm"]
    assert (h100["tflops"], h100["tf32_tflops"], h100["fp32_tflops"]) == (989, 494.5, 67)
    assert h100["memory_bytes"] == 80e9 and h100["link"] == "nvlink"
    assert all(h100["sources"][key] for key in h100 if key not in ("name", "sources"))
    one = json.loads(potluck("catalog", "l40", "--json").stdout)
    assert one["name"] == "l40" and "L40 datasheet" in one["sources"]["tf32_tflops"]


def test_catalog_name_shows_each_figure_with_its_source():
    result = potluck("catalog", "rtx2080ti", columns=80)
    assert result.returncode == 0, result.stderr
    assert "53.8 TFLOPS" in result.stdout and "Turing" in result.stdout
    assert "tf32_tflops" in result.stdout and "purchase_price" in result.stdout


def test_catalog_unknown_name_is_one_line_with_close_names():
    result = potluck("catalog", "a100")
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1
    assert "a100-40g-pcie" in lines[0] and "a100-80g-pcie" in lines[0]


CPU_CLUSTER = "nodes: [{name: cpu, gpu: cpu, gpus_per_node: 2}]\n"


def test_train_plans_first_and_writes_the_run_directory(tmp_path):
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    out = tmp_path / "run"
    result = potluck("train", "--cluster", str(cluster), "--model", "tiny-llama", "--steps", "3",
                     "--global-batch", "4", "--seq-len", "32", "--dtype", "fp32", "--out", str(out))
    assert result.returncode == 0, result.stderr
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    record = json.loads(lines[-1])
    for field in ("step", "loss", "tokens_per_s", "step_time_s", "predicted_step_time_s",
                  "peak_memory_gb"):
        assert field in record
    training = json.loads((out / "plan.json").read_text())["training"]
    assert training["global_batch"] == 4 and training["dtype"] == "fp32"
    assert all(json.loads(line)["loss"] > 0 for line in lines)
    assert "loss" in result.stdout


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--data", "no/such/corpus"], "not found"),
        (["--global-batch", "6"], "differs from the plan's"),
        (["--dtype", "tf32"], "--dtype tf32 differs from the plan's bf16"),
        (["--cluster", "OTHER"], "make a new plan"),
        (["--steps", "0"], "--steps must be at least 1, not 0"),
        (["--steps", "-3"], "--steps must be at least 1, not -3"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be 0"),
        (["--execution", "deepspeed"], "--execution deepspeed differs from the plan's potluck"),
    ],
)
def test_train_rejects_bad_input_in_one_line(tmp_path, extra, fragment):
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    other = tmp_path / "other.yaml"
    other.write_text("nodes: [{name: cpu, gpu: cpu, gpus_per_node: 1}]\n")
    plan = tmp_path / "plan.json"
    made = potluck("plan", "-c", str(cluster), "-m", "tiny-llama", "--global-batch", "4",
                   "--seq-len", "32", "-o", str(plan), "--json")
    assert made.returncode == 0, made.stderr
    extra = [str(other) if arg == "OTHER" else arg for arg in extra]
    result = potluck("train", "--plan", str(plan), "--steps", "1", *extra)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_plan_help_lists_the_execution_presets():
    result = potluck("plan", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # as wrapped to any width
    for name in ("potluck (", "megatron-lm (", "megatron-lm-2021 (", "deepspeed ("):
        assert name in text


def test_cost_takes_the_execution_flag():
    result = potluck("cost", "-m", "gpt3-125m", "--tokens", "1B", "--max-gpus", "1",
                     "--execution", "megatron-2021")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "did you mean 'megatron-lm-2021'?" in result.stderr


def test_train_refuses_execution_traits_the_runtime_does_not_run(tmp_path):
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER + "execution: {preset: megatron-lm}\n")
    result = potluck("train", "--cluster", str(cluster), "--model", "tiny-llama", "--steps", "1",
                     "--global-batch", "4", "--seq-len", "32")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert ("the plan's execution (megatron-lm) asks for fused_kernels=true, "
            "tied_grad_sync=pipeline-ends, "
            "which potluck's runtime does not run; make the plan with --execution potluck"
            in lines[0])


def test_exporting_a_run_without_checkpoints_says_how_to_get_one(tmp_path):
    (tmp_path / "run").mkdir()
    result = potluck("export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "nothing to export" in result.stderr and "--checkpoint-every" in result.stderr


def test_a_tokenizer_larger_than_the_model_vocabulary_is_one_line(tmp_path):
    config = tmp_path / "small-vocab"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64}))
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    result = potluck("train", "-c", str(cluster), "-m", str(config), "--steps", "1",
                     "--global-batch", "2", "--seq-len", "16")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "tokenizer" in result.stderr and "260" in result.stderr


def test_a_plan_over_several_machines_prints_one_torchrun_command_per_machine(tmp_path):
    """--print-commands prints them (exit 0); without it nothing is trained, which a non-zero
    exit and one line say, and the run directory is left alone."""
    cluster = tmp_path / "two.yaml"
    cluster.write_text("nodes: [{name: cpu, gpu: cpu, gpus_per_node: 1, count: 2}]\n")
    args = ("train", "-c", str(cluster), "-m", "tiny-llama", "--global-batch", "4",
            "--seq-len", "32", "--out", str(tmp_path / "run"))
    refused = potluck(*args, cwd=tmp_path)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and refused.stdout == "" and len(lines) == 1, refused.stderr
    assert "nothing was trained: the plan spans 2 machines; print one torchrun command per " \
           "machine with --print-commands" in lines[0]
    assert not (tmp_path / "run").exists()
    result = potluck(*args, "--print-commands", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if "torchrun" in line]
    assert len(commands) == 2 and all("--node-rank" in c or "--node_rank" in c for c in commands)


def test_demo_plans_and_dry_runs_with_whole_headings_at_80_columns(tmp_path):
    result = potluck("demo", "--steps", "3", cwd=tmp_path, columns=80)
    assert result.returncode == 0, result.stderr
    rules = [line.strip("─ ") for line in result.stdout.splitlines() if line.startswith("─")]
    headings = [title for title in rules if title]  # the others underline table headers
    assert headings == ["1. plan llama2-7b for mixed-lab",
                        "2. plan it for two-fast-two-slow, dry-run it on this CPU", "summary"]
    assert "measured/predicted" in result.stdout and "…" not in result.stdout
    assert "3 emulated steps of about" in result.stderr and "train: step 2 (3/3 done)" in result.stderr


def test_a_run_resumes_and_its_checkpoint_exports_to_hugging_face(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    out, hf = tmp_path / "run", tmp_path / "hf"
    common = ["-c", str(cluster), "-m", "tiny-llama", "--global-batch", "4", "--seq-len", "32",
              "--out", str(out), "--checkpoint-every", "2"]
    first = potluck("train", *common, "--steps", "2")
    assert first.returncode == 0, first.stderr
    second = potluck("train", "--plan", str(out / "plan.json"), "--out", str(out),
                     "--checkpoint-every", "2", "--steps", "4", "--resume")
    assert second.returncode == 0, second.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [2, 3] or steps[-2:] == [3, 4]
    exported = potluck("export", str(out), "--out", str(hf))
    assert exported.returncode == 0, exported.stderr
    model = AutoModelForCausalLM.from_pretrained(hf)
    logits = model(torch.randint(0, 260, (1, 8))).logits
    assert logits.shape == (1, 8, 260) and torch.isfinite(logits).all()
    tokenizer = AutoTokenizer.from_pretrained(hf)  # the bytes the run read its text as
    assert tokenizer.encode("naïve") == list("naïve".encode()) and tokenizer.eos_token_id == 258
    assert "AutoTokenizer.from_pretrained" in exported.stdout
    mask = os.umask(0)
    os.umask(mask)
    assert (hf / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask  # not 0600


@pytest.mark.parametrize(("args", "fragment"), [
    (["plan", "--bogus"], "No such option: --bogus; see potluck plan --help"),
    (["plan", "-c"], "Option '-c' requires an argument; see potluck plan --help"),
    (["plan", "-c", "x", "-m", "y", "--top", "abc"], "Invalid value for '--top'"),
    (["cost", "-m", "gpt3-125m"], "Missing option '--tokens'; see potluck cost --help"),
    (["simulate"], "Missing argument"),
    (["nosuch"], "No such command 'nosuch'; see potluck --help"),
    (["plan", "--batch-size", "8"], "No such option: --batch-size (potluck calls it "
                                    "--global-batch); see potluck plan --help"),
    (["train", "--learning-rate", "1"], "No such option: --learning-rate (potluck calls it --lr)"),
])
def test_usage_errors_are_one_line_with_the_help_to_read(args, fragment):
    result = potluck(*args, columns=80)
    assert result.returncode == 2 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("potluck: error: "), result.stderr
    assert fragment in lines[0]


def test_version_is_one_line_on_stdout():
    from potluck.version import __version__

    result = potluck("--version")
    assert result.returncode == 0 and result.stdout == f"potluck {__version__}\n"


def test_help_shows_every_option_and_command_whole_at_80_columns():
    top = potluck(columns=80)  # no command: the help, as --help shows it
    assert top.returncode == 2 and "Commands:" in top.stderr
    for command, option in (("plan", "--electricity-usd-per-kwh"), ("cost", "--max-usd-per-hour"),
                            ("train", "--checkpoint-every"), ("calibrate", "--measured")):
        result = potluck(command, "--help", columns=80)
        assert result.returncode == 0, result.stderr
        assert option in result.stdout and f"potluck {command}" in result.stdout
        assert max(len(line) for line in result.stdout.splitlines()) <= 80
        assert "…" not in result.stdout and "╭" not in result.stdout
    listed = [line.split(None, 1) for line in top.stderr.split("Commands:")[1].splitlines()
              if line.strip()]
    assert len(listed) >= 10 and not any(text.endswith("...") for _, text in listed)


def test_cost_at_80_columns_keeps_offer_names_whole_and_explains_only_its_columns():
    args = ["cost", "-m", "gpt3-1.3b", "--tokens", "1B", "--top", "12", "--max-gpus", "2"]
    names = [c["name"] for c in json.loads(potluck(*args, "--json").stdout)["candidates"][:12]]
    narrow = potluck(*args, columns=80)
    assert narrow.returncode == 0, narrow.stderr
    rows = narrow.stdout.split("plans, totals")[0].splitlines()  # the table and its caption
    assert max(len(line) for line in rows) <= 80
    for rank, name in enumerate(names, start=1):
        assert any(line.split()[:1] == [str(rank)] and name in line for line in rows), name
    caption = narrow.stdout.split("* Pareto front")[1].split("plans, totals")[0]
    assert "RCC #: rank by it" in caption and "TF/$h" not in caption
    wide = potluck(*args, columns=140)
    assert "model TF/$h: the TFLOPS the plan achieves per $/h" in " ".join(wide.stdout.split())


def test_simulate_defines_its_bubble_beside_the_plans_and_lists_stages_in_order(tmp_path):
    plan = tmp_path / "plan.json"
    made = potluck("plan", "-c", str(Path(SRC) / "potluck/examples/mixed.yaml"), "-m", "llama2-7b",
                   "--global-batch", "64", "--seq-len", "4096", "--json", "-o", str(plan))
    assert made.returncode == 0, made.stderr
    predicted = json.loads(made.stdout)
    simulated = json.loads(potluck("simulate", str(plan), "--json", "--out",
                                   str(tmp_path / "sim")).stdout)
    result = potluck("simulate", str(plan), "--out", str(tmp_path / "sim"), columns=80)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    plan_bubble = predicted["breakdown_s"]["bubble_s"] / predicted["iteration_time_s"]
    assert (f"bubble {simulated['bubble_fraction']:.1%}: the devices' idle share of their time "
            "until the last forward or backward ends, every stage counted") in text
    assert (f"the plan's bubble ({predicted['breakdown_s']['bubble_s']:.3g} s, {plan_bubble:.1%} "
            "of its iteration) is the critical path's") in text
    devices = {d for stage in predicted["plan"]["pipelines"][0]["stages"] for d in stage["devices"]}
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1]
            and line.split()[0] in devices]
    stages = [int(row[2]) for row in rows]
    assert len(rows) == len(devices) and stages == sorted(stages)  # stage 2 before stage 3


def test_a_framework_preset_says_its_placement_and_what_it_costs(cluster_file):
    """Issue 29: the presets placed ranks in rank order with an even split and nothing said
    so. The plan names the placement, the hostfile order it assumes where it is not the
    cluster file's, and the framework's placement against potluck's with the same traits."""
    result = potluck("plan", "--cluster", str(cluster_file), "--model", "llama2-7b",
                     "--global-batch", "32", "--execution", "megatron-lm", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["placement"].startswith("rank order, even layer split, as Megatron-LM launches")
    cost = [n for n in data["notes"] if "the framework's placement" in n]
    assert len(cost) == 1 and ("costs nothing here" in cost[0] or "x: placed by potluck" in cost[0])
    plain = json.loads(potluck("plan", "--cluster", str(cluster_file), "--model", "llama2-7b",
                               "--global-batch", "32", "--json").stdout)
    assert plain["placement"].startswith("planned")
    assert not [n for n in plain["notes"] if "the framework's placement" in n]


def _unwritable(tmp_path: Path, where: str, request) -> tuple[Path, str]:
    """An output path that cannot be written, and what the error line says of it."""
    if where == "a directory":
        return tmp_path, f"cannot write {tmp_path}: it is a directory: give a file name"
    if where == "under a file":
        (tmp_path / "notes.txt").write_text("mine\n")
        return tmp_path / "notes.txt" / "plan.json", "a file is in the way of a folder"
    locked = request.getfixturevalue("read_only_folder")
    return locked / "plan.json", f"cannot write {locked / 'plan.json'}: permission denied"


@pytest.mark.parametrize("where", ["a directory", "under a file", "read-only"])
def test_a_plan_output_that_cannot_be_written_is_one_line(tmp_path, where, request):
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    out, says = _unwritable(tmp_path, where, request)
    result = potluck("plan", "-c", str(cluster), "-m", "tiny-llama", "--global-batch", "4",
                     "--seq-len", "32", "-o", str(out))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith("potluck: error: ") and says in lines[0], lines[0]


def test_a_plan_output_in_a_folder_not_there_yet_creates_it(tmp_path):
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    out = tmp_path / "plans" / "tiny" / "plan.json"
    result = potluck("plan", "-c", str(cluster), "-m", "tiny-llama", "--global-batch", "4",
                     "--seq-len", "32", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["model"]["name"] == "tiny-llama"
    assert [p.name for p in out.parent.iterdir()] == ["plan.json"]  # no temporary file left
