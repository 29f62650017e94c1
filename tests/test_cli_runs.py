"""``potluck train`` as a user meets it: a run that fails writes nothing, a resume that
fails leaves the run's plan as it was, and an emulated run says how long it will take and
how far it has got even when its output goes to a file."""

import json
import math
import re

import pytest

from test_cli import CPU_CLUSTER, potluck


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A plan for two CPU ranks training tiny-llama, 4 sequences of 32 tokens."""
    folder = tmp_path_factory.mktemp("plan")
    cluster = folder / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    plan = folder / "plan.json"
    made = potluck("plan", "-c", str(cluster), "-m", "tiny-llama", "--global-batch", "4",
                   "--seq-len", "32", "-o", str(plan), "--json")
    assert made.returncode == 0, made.stderr
    return plan


def _one_line(result) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _data(tmp_path, kind):
    folder = tmp_path / "data"
    folder.mkdir()
    if kind == "empty-file":
        (folder / "a.txt").write_text("   \n")
    elif kind == "short":
        (folder / "a.txt").write_text("twenty bytes of text")  # 20 bytes + eos < 33 tokens
    return folder


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--data", "DATA:no-files"], "holds no .txt or .jsonl files"),
    (["--data", "DATA:empty-file"], "holds no text (all documents are empty)"),
    (["--data", "DATA:short"], "the data has 21 tokens, fewer than one sequence of 33"),
    (["--lr", "-1"], "--lr must be a positive number such as 3e-4, not -1.0"),
    (["--lr", "nan"], "--lr must be a positive number such as 3e-4, not nan"),
    (["--lr", "0"], "--lr must be a positive number such as 3e-4, not 0.0"),
    (["--lr-schedule", "step"], "--lr-schedule must be one of constant, cosine, linear"),
    (["--lr", "1e-3", "--min-lr", "0.01"], "--min-lr must be between 0 and --lr 0.001"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be a positive number such as 1.0"),
    (["--emulate", "--stand-in", "gpt3-125m"], "a stand-in must have the same number of blocks"),
])
def test_a_run_that_fails_before_it_starts_writes_nothing(tmp_path, plan_file, extra, fragment):
    extra = [str(_data(tmp_path, arg.split(":")[1])) if arg.startswith("DATA:") else arg
             for arg in extra]
    out = tmp_path / "run"
    result = potluck("train", "--plan", str(plan_file), "--steps", "1", "--out", str(out), *extra)
    assert fragment in _one_line(result)
    assert not out.exists()


def test_a_run_planned_here_that_fails_before_it_starts_writes_nothing(tmp_path):
    """Planning CPU ranks measures this CPU; that measurement is kept only by a run that
    launches, like the plan."""
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    out = tmp_path / "run"
    result = potluck("train", "-c", str(cluster), "-m", "tiny-llama", "--global-batch", "4",
                     "--seq-len", "32", "--steps", "1", "--out", str(out),
                     "--data", str(_data(tmp_path, "short")))
    assert "fewer than one sequence" in _one_line(result)
    assert not out.exists()


def test_out_naming_a_file_is_one_line(tmp_path, plan_file):
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    line = _one_line(potluck("train", "--plan", str(plan_file), "--out", str(out)))
    assert f"--out {out} is a file, not a run directory" in line
    assert out.read_text() == "mine\n"


def _first_run(tmp_path, plan_file):
    out = tmp_path / "run"
    first = potluck("train", "--plan", str(plan_file), "--steps", "2", "--out", str(out),
                    "--checkpoint-every", "2")
    assert first.returncode == 0, first.stderr
    return out


def test_a_resume_that_does_not_fit_leaves_the_run_as_it_was(tmp_path, plan_file):
    out = _first_run(tmp_path, plan_file)
    saved = (out / "plan.json").read_bytes()
    metrics = (out / "metrics.jsonl").read_bytes()
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    resumed = potluck("train", "-c", str(cluster), "-m", "tiny-gpt2", "--global-batch", "4",
                      "--seq-len", "32", "--out", str(out), "--steps", "4", "--resume")
    line = _one_line(resumed)
    assert "was saved by tiny-llama" in line and "this plan trains tiny-gpt2" in line
    assert f"--plan {out / 'plan.json'}" in line
    assert (out / "plan.json").read_bytes() == saved
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_resuming_under_another_plan_says_so_and_then_keeps_it(tmp_path, plan_file):
    out = _first_run(tmp_path, plan_file)
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    other = tmp_path / "pp2.json"
    made = potluck("plan", "-c", str(cluster), "-m", "tiny-llama", "--global-batch", "4",
                   "--seq-len", "32", "--pp", "2", "-o", str(other), "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(other.read_text()) != json.loads((out / "plan.json").read_text())
    resumed = potluck("train", "--plan", str(other), "--out", str(out), "--steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    notes = [line for line in resumed.stderr.splitlines()
             if line.startswith("note:") and "holds another plan" in line]
    assert len(notes) == 1, resumed.stderr
    assert "continues under dp=1 pp=2" in notes[0]
    assert (out / "plan.json").read_text() == other.read_text()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2] and all(math.isfinite(json.loads(line)["loss"]) for line in
                                      (out / "metrics.jsonl").read_text().splitlines())


def test_an_emulated_run_says_how_long_it_will_take_and_how_far_it_is(tmp_path, plan_file):
    out = tmp_path / "run"
    result = potluck("train", "--plan", str(plan_file), "--emulate", "--steps", "3",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("dry run: 2 CPU ranks stand for the plan's devices"), result.stderr
    assert "time 2 steps unpadded to set the dilation" in lines[0]
    assert [line.split(" took ")[0] for line in lines if line.startswith("emulation:")] == [
        "emulation: unpadded step 1/2", "emulation: unpadded step 2/2"]
    estimate = next(line for line in lines if "emulated steps of about" in line)
    each = re.search(r"3 emulated steps of about ([\d.]+) (s|min) each", estimate)
    assert each and estimate.endswith("in all (an estimate)"), estimate
    predicted_s = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])[
        "predicted_step_time_s"]  # the dilated prediction each step is measured against
    said_s = float(each.group(1)) * (60 if each.group(2) == "min" else 1)
    assert said_s == pytest.approx(predicted_s, rel=0.05, abs=0.06)
    progress = [line for line in lines if line.startswith("train: step ")]
    assert progress[0].startswith("train: step 0 (1/3 done) | loss ") and progress[-1].startswith(
        "train: step 2 (3/3 done) | loss "), result.stderr
    assert all("elapsed, about" in line and line.endswith("left") for line in progress)
    assert lines.index(estimate) < lines.index(progress[0])


def test_an_emulation_computing_a_big_model_says_up_front_that_its_steps_take_minutes():
    """Emulating llama2-7b itself (no stand-in) at 64 x 2048 tokens: each unpadded step needs
    about 5e18 FLOPs, hours on any CPU; the line before launch says so and names the fix."""
    from potluck import api
    from potluck.cli import _emulation_line
    from potluck.examples import example_path

    plan = api.plan(example_path("two-fast-two-slow.yaml"), "llama2-7b").best
    computing_it = api.train_options(emulate=True, steps=3)
    line = _emulation_line(plan, computing_it)
    assert "each unpadded step computes for at least" in line and "(an estimate)" in line
    assert "--stand-in tiny" in line
    with_stand_in = api.train_options(emulate=True, steps=3, stand_in="tiny")
    assert "unpadded step computes" not in _emulation_line(plan, with_stand_in)
    assert api.unpadded_step_s(plan, with_stand_in) < api.unpadded_step_s(plan, computing_it) / 1e4


def test_printing_commands_never_replaces_a_runs_plan(tmp_path, plan_file):
    """The commands for other machines need a plan file at once; the run's is not it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "plan.json").write_bytes(plan_file.read_bytes())
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    result = potluck("train", "-c", str(cluster), "-m", "tiny-llama", "--global-batch", "8",
                     "--seq-len", "32", "--out", str(out), "--resume", "--print-commands")
    assert f"{out / 'plan.json'} holds another plan" in _one_line(result)
    assert (out / "plan.json").read_bytes() == plan_file.read_bytes()
    again = potluck("train", "--plan", str(out / "plan.json"), "--out", str(out), "--resume",
                    "--print-commands")
    assert again.returncode == 0 and "torchrun" in again.stdout, again.stderr


def test_bad_options_are_refused_before_torch_is_imported():
    """Refusing --lr -1 takes a second, not the eight that importing torch's distributed
    parts and transformers' models takes on a busy machine."""
    import subprocess
    import sys

    from test_cli import SRC

    code = ("import sys\nimport potluck.api as api\nfrom potluck.errors import ConfigError\n"
            "try:\n    api.train_options(lr=-1.0)\nexcept ConfigError:\n    pass\n"
            "else:\n    raise SystemExit('accepted --lr -1')\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SRC)}, timeout=120)
    assert result.returncode == 0, result.stderr


def _saved_model(folder, config):
    """A tiny model made from ``config`` and saved with ``save_pretrained`` into ``folder``."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_train_init_from_a_model_directory_fine_tunes_it(tmp_path):
    """--init-from alone names the model too: the run plans for it and starts from its
    weights (the losses' equality with the model's own: tests/runtime/checkpoints)."""
    model = _saved_model(tmp_path / "tiny-hf", _tiny_llama_config())
    cluster = tmp_path / "cpus.yaml"
    cluster.write_text(CPU_CLUSTER)
    out = tmp_path / "run"
    result = potluck("train", "-c", str(cluster), "--init-from", str(model), "--steps", "1",
                     "--global-batch", "2", "--seq-len", "16", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "plan.json").read_text())["model"]["name"] == "tiny-hf"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize(("folder", "fragment"), [
    ("missing", "not a directory; give a Hugging Face model directory"),
    ("empty", "holds no model.safetensors or model.safetensors.index.json"),
    ("bad-index", "not a safetensors index (JSONDecodeError)"),
    ("bad-file", "not a safetensors file"),
])
def test_init_from_a_folder_without_usable_weights_is_one_line(tmp_path, plan_file, folder,
                                                               fragment):
    model = tmp_path / folder
    if folder != "missing":
        model.mkdir()
    if folder == "bad-index":
        (model / "model.safetensors.index.json").write_text("{not json")
    if folder == "bad-file":
        (model / "model.safetensors").write_bytes(b"\x00" * 4)
    line = _one_line(potluck("train", "--plan", str(plan_file), "--init-from", str(model)))
    assert fragment in line


def test_init_from_weights_of_another_model_is_one_line(tmp_path, plan_file):
    from transformers import GPT2Config

    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=260, n_positions=64,
                        bos_token_id=257, eos_token_id=258)
    model = _saved_model(tmp_path / "gpt2", config)
    line = _one_line(potluck("train", "--plan", str(plan_file), "--init-from", str(model),
                             "--steps", "1"))
    assert "weights do not fit 'tiny-llama': missing lm_head.weight" in line


def test_a_model_directory_with_weights_says_how_to_start_from_them(tmp_path):
    model = _saved_model(tmp_path / "tiny-hf", _tiny_llama_config())
    result = potluck("train", "-c", "no-cluster.yaml", "-m", str(model), "--lr", "-1")
    assert f"note: {model} holds weights; training starts from new ones (add --init-from" \
        in result.stderr
    assert result.returncode != 0 and "--lr must be a positive number" in result.stderr


def test_training_into_another_runs_directory_is_one_line_naming_the_flags(tmp_path, plan_file):
    """Without --resume or --overwrite the new run would have cut the old one's metrics.jsonl
    to its own rows and kept the old run's later checkpoints over its own."""
    out = tmp_path / "old"
    (out / "checkpoints" / "step_000040").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 39, "loss": 1.0}\n')
    line = _one_line(potluck("train", "--plan", str(plan_file), "--steps", "3", "--out", str(out)))
    assert f"--out {out} holds another run (metrics.jsonl, checkpoints/ up to step 40)" in line
    assert "--resume" in line and "--overwrite" in line
    assert (out / "metrics.jsonl").read_text() == '{"step": 39, "loss": 1.0}\n'
