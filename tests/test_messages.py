"""Messages that lead to a fix, as a user meets them on the command line: the real limit named
with numbers and the key that lifts it, no suggestion of what is already pinned, a pin that
does nothing said so, sequences beyond a model's positions warned of or refused, and
progress from the commands that plan many clusters when their output is not a terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from potluck import cli
from potluck.console import progress
from potluck.console.progress import QUIET_ENV
from potluck.examples import __file__ as examples_init

SRC = Path(__file__).resolve().parents[1] / "src"
HUNG_S = 600  # a command this slow is hung, not slow (see tests/test_cli.py)
MIXED = Path(examples_init).with_name("mixed.yaml")  # the demo cluster: 3090s, 4090s, A100s
SEVENTY_B = ("-m", "llama2-70b", "--offload", "optimizer", "--zero", "3", "--recompute", "full")
ONE_GPU = "nodes: [{name: desk, gpu: rtx3060, gpus_per_node: 1}]\n"
ONE_A100 = "nodes: [{name: box, gpu: a100-80g-sxm, gpus_per_node: 1}]\n"
TWO_OFFERS = """\
offers:
  - {name: seller-a, gpu: rtx4090, gpus_per_node: 2, price_per_hour: 0.50}
  - {name: seller-b, gpu: rtx4090, gpus_per_node: 2, price_per_hour: 0.70}
  - {name: pairs, gpu: rtx3090, gpus_per_node: 2, nvlink: pairs}
"""


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run ``potluck ARGS`` in this process (stdout and stderr not terminals)."""
    monkeypatch.setattr(sys, "argv", ["potluck", *args])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    out, err = capsys.readouterr()
    return exited.value.code or 0, out, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("potluck: error: "), err
    return lines[0]


@pytest.fixture
def write(tmp_path: Path):
    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return _write


# ---- the real limit, with numbers ------------------------------------------------------------

def _host_bound(host_memory: str) -> str:
    """The demo cluster with a third box of 3090s (the GPUs then hold llama2-70b with the
    optimizer offloaded) and the 4090 box's host memory set."""
    return MIXED.read_text().replace("    count: 2\n", "    count: 3\n").replace(
        "    gpu: rtx4090\n", f"    gpu: rtx4090\n    host_memory: {host_memory}\n")


def test_host_memory_as_the_limit_is_named_with_numbers_and_its_key(monkeypatch, capsys, write):
    cluster = write("lab.yaml", _host_bound("128GB"))
    code, _, err = run(monkeypatch, capsys, "plan", "-c", str(cluster), *SEVENTY_B)
    line = error_line(err)
    assert code == 3
    assert "host memory is the limit" in line and "host_memory" in line
    # the machine short of it, what it needs against what it has
    assert "GB of host memory on box4090.0" in line and "which has 128 GB" in line
    assert "for node group box4090" in line
    assert "GPU memory" not in line and "model states" not in line


def test_the_host_memory_the_message_asks_for_is_enough(monkeypatch, capsys, write):
    cluster = write("lab.yaml", _host_bound("128GB"))
    _, _, err = run(monkeypatch, capsys, "plan", "-c", str(cluster), *SEVENTY_B)
    needed = error_line(err).split("host_memory: ")[1].split(" or more for node group box4090")[0]
    code, out, err = run(monkeypatch, capsys, "plan", "-c", str(write("more.yaml", _host_bound(needed))),
                         *SEVENTY_B, "--json", "--top", "1")
    assert code == 0, err
    box4090 = next(h for h in json.loads(out)["host_memory"] if h["node"] == "box4090.0")
    assert box4090["used_gb"] + box4090["reserve_gb"] <= box4090["capacity_gb"]


def test_no_pinned_flag_is_suggested_and_lightest_pins_are_not_to_be_dropped(
        monkeypatch, capsys, write):
    cluster = write("desk.yaml", ONE_GPU)
    code, _, err = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "qwen2.5-0.5b",
                       "--seq-len", "32768", "--recompute", "full", "--zero", "3",
                       "--offload", "optimizer")
    suggestions = error_line(err).rsplit(");", 1)[1]
    assert code == 3
    assert "drop the pins" not in suggestions
    for flag in ("--recompute", "--zero", "--offload"):
        assert flag not in suggestions
    assert "shorter --seq-len" in suggestions


def test_a_pin_that_keeps_a_lighter_choice_out_is_named_with_the_lighter_one(
        monkeypatch, capsys, write):
    cluster = write("desk.yaml", ONE_GPU)
    _, _, err = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "qwen2.5-0.5b",
                    "--seq-len", "32768", "--recompute", "none")
    suggestions = error_line(err).rsplit(");", 1)[1]
    assert "drop the pins that keep lighter choices out (--recompute none)" in suggestions
    assert "--recompute full" in suggestions


# ---- a pin with no effect ----------------------------------------------------------------------

def test_zero_over_a_single_replica_is_noted_in_the_table_and_the_json(monkeypatch, capsys, write):
    cluster = write("one.yaml", ONE_A100)
    code, out, _ = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "gpt3-125m",
                       "--zero", "2", "--top", "1")
    assert code == 0
    assert "note: --zero 2 has no effect on this plan: it has one data-parallel replica" in out
    code, out, _ = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "gpt3-125m",
                       "--zero", "2", "--top", "1", "--json")
    summary = json.loads(out)
    assert summary["layout"].startswith("dp=1 ")
    assert any(note.startswith("--zero 2 has no effect") for note in summary["notes"])


def test_a_plan_over_replicas_has_no_such_note(monkeypatch, capsys, write):
    cluster = write("two.yaml", ONE_A100.replace("gpus_per_node: 1", "gpus_per_node: 2"))
    code, out, _ = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "gpt3-125m",
                       "--zero", "1", "--dp", "2", "--top", "1", "--json")
    assert code == 0
    assert not any("no effect" in note for note in json.loads(out)["notes"])


def test_zero_pinned_with_one_replica_pinned_is_refused(monkeypatch, capsys, write):
    cluster = write("two.yaml", ONE_A100.replace("gpus_per_node: 1", "gpus_per_node: 2"))
    code, _, err = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "gpt3-125m",
                       "--zero", "3", "--dp", "1")
    line = error_line(err)
    assert code == 2
    assert "--zero 3 shards" in line and "--dp 1 leaves one replica" in line
    assert "drop --zero, or pin --dp 2 or more" in line


# ---- sequences beyond the model's positions ---------------------------------------------------

def test_plan_warns_of_a_sequence_beyond_rotary_positions(monkeypatch, capsys, write):
    cluster = write("one.yaml", ONE_A100)
    warning = "--seq-len 512 is beyond tiny-llama's 256 positions"
    code, out, _ = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "tiny-llama",
                       "--seq-len", "512", "--top", "1")
    assert code == 0
    assert [line for line in out.splitlines() if warning in line]
    code, out, _ = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "tiny-llama",
                       "--seq-len", "512", "--top", "1", "--json")
    assert any(note.startswith(warning) for note in json.loads(out)["notes"])
    _, out, _ = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "tiny-llama",
                    "--seq-len", "256", "--top", "1", "--json")
    assert not any("positions" in note for note in json.loads(out)["notes"])


def test_plan_refuses_a_sequence_beyond_learned_positions(monkeypatch, capsys, write):
    cluster = write("one.yaml", ONE_A100)
    code, _, err = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "gpt3-125m",
                       "--seq-len", "4096")
    line = error_line(err)
    assert code == 2
    assert "--seq-len 4096 exceeds gpt3-125m's 2048 learned positions" in line
    assert "use --seq-len 2048 or less" in line


def test_cost_warns_once_and_refuses_once(monkeypatch, capsys, write):
    offers = write("offers.yaml", TWO_OFFERS)
    code, out, _ = run(monkeypatch, capsys, "cost", "-m", "tiny-llama", "--tokens", "1B",
                       "--offers", str(offers), "--seq-len", "512")
    assert code == 0
    assert [line for line in out.splitlines()
            if line.startswith("note: --seq-len 512 is beyond tiny-llama's 256 positions")]
    code, _, err = run(monkeypatch, capsys, "cost", "-m", "gpt3-125m", "--tokens", "1B",
                       "--offers", str(offers), "--seq-len", "4096")
    assert code == 2 and "2048 learned positions" in error_line(err)


SCHEDULE_CLUSTER = """
nodes:
  - {name: fast, gpu: a100-80g-sxm, gpus_per_node: 2}
  - {name: slow, gpu: rtx3090, gpus_per_node: 2}
"""


def test_schedule_warns_of_a_job_beyond_its_model_positions(monkeypatch, capsys, write):
    cluster = write("lab.yaml", SCHEDULE_CLUSTER)
    jobs = write("jobs.yaml", "jobs:\n  - {name: long, model: tiny-llama, global_batch: 8, "
                              "seq_len: 512, tokens: 1B}\n")
    code, out, _ = run(monkeypatch, capsys, "schedule", "-c", str(cluster), "--jobs", str(jobs))
    assert code == 0
    assert "note: " in out and "jobs[0] (long): seq_len 512 is beyond tiny-llama's 256" in out
    bad = write("bad.yaml", "jobs:\n  - {name: long, model: gpt3-125m, global_batch: 8, "
                            "seq_len: 4096, tokens: 1B}\n")
    code, _, err = run(monkeypatch, capsys, "schedule", "-c", str(cluster), "--jobs", str(bad))
    line = error_line(err)
    assert code == 2 and "jobs[0] (long).seq_len: seq_len 4096 exceeds" in line


def test_schedule_run_says_the_jobs_files_warnings_before_it_launches(monkeypatch, write,
                                                                      tmp_path):
    from potluck import api

    monkeypatch.setattr("potluck.multijob.executor.run_schedule", lambda *args: "launched")
    cluster = write("lab.yaml", SCHEDULE_CLUSTER)
    jobs = write("jobs.yaml", "jobs:\n  - {name: long, model: tiny-llama, global_batch: 8, "
                              "seq_len: 512, tokens: 1B}\n")
    said: list[str] = []
    assert api.schedule_run(cluster, jobs, out=tmp_path / "run", progress=said.append) == "launched"
    assert len(said) == 1 and said[0].startswith("note: ") and "seq_len 512 is beyond" in said[0]


def test_train_says_the_plans_warning_before_it_starts(monkeypatch, capsys, write, tmp_path):
    cluster = write("one.yaml", ONE_A100)
    code, out, err = run(monkeypatch, capsys, "train", "-c", str(cluster), "-m", "tiny-llama",
                         "--seq-len", "512", "--print-commands", "--out", str(tmp_path / "run"))
    assert code == 0, err
    assert "note: --seq-len 512 is beyond tiny-llama's 256 positions" in err
    assert "torchrun" in out


# ---- progress when the output is not a terminal -----------------------------------------------

def test_cost_shows_progress_lines_and_searches_the_same_hardware_once(monkeypatch, capsys, write):
    monkeypatch.setenv(QUIET_ENV, "1")
    offers = write("offers.yaml", TWO_OFFERS)
    code, out, err = run(monkeypatch, capsys, "cost", "-m", "gpt3-125m", "--tokens", "1B",
                         "--offers", str(offers), "--json")
    assert code == 0
    lines = err.splitlines()
    assert lines[0].startswith("planning 3 offers (a search each")
    assert lines[-1].startswith("planned 3 offers in ")
    candidates = {c["name"]: c for c in json.loads(out)["candidates"]}
    a, b = candidates["seller-a"], candidates["seller-b"]
    assert a["tokens_per_s"] == b["tokens_per_s"] and a["plan"]["layout"] == b["plan"]["layout"]
    assert b["usd_per_hour"] == pytest.approx(a["usd_per_hour"] * 0.70 / 0.50)


def test_schedule_shows_progress_lines(monkeypatch, capsys, write):
    monkeypatch.setenv(QUIET_ENV, "1")
    cluster = write("lab.yaml", SCHEDULE_CLUSTER)
    jobs = write("jobs.yaml", "jobs:\n  - {name: a, model: tiny-llama, global_batch: 8, "
                              "seq_len: 256, tokens: 1B}\n")
    code, _, err = run(monkeypatch, capsys, "schedule", "-c", str(cluster), "--jobs", str(jobs),
                       "--json")
    lines = err.splitlines()
    assert code == 0
    assert lines[0].startswith("planning up to 3 searches (a job shape on an allocation each")
    assert lines[-1].startswith("planned ") and " searches in " in lines[-1]


REAL_PLAN = cli.api.plan


class _Clock:
    """``time.monotonic`` as the test sets it."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _plan_lines(monkeypatch, capsys, fractions_at: list[tuple[float, float]]) -> list[str]:
    """What ``potluck plan`` writes off a terminal while its search reports ``fraction`` at
    ``seconds`` (pairs) and then finds a plan."""
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)

    def slow_plan(*args, progress=None, **kwargs):
        for seconds, fraction in fractions_at:
            clock.now_s = 100.0 + seconds
            progress(fraction)
        return REAL_PLAN(*args, **kwargs)

    monkeypatch.setattr(cli.api, "plan", slow_plan)
    code, _, err = run(monkeypatch, capsys, "plan", "-c", str(MIXED), "-m", "gpt3-125m",
                       "--top", "1")
    assert code == 0, err
    return err.splitlines()


def test_a_search_says_how_far_it_is_and_how_long_it_may_take_after_two_seconds(
        monkeypatch, capsys):
    monkeypatch.setenv(QUIET_ENV, "1")
    lines = _plan_lines(monkeypatch, capsys, [(1.0, 0.05), (4.0, 0.2), (5.0, 0.25), (8.0, 0.5)])
    assert lines[0].startswith("planning: 20% after 4 s, at most about 16 s left (the bound")
    assert lines[1] == "planning: 50% after 8 s, at most about 8 s left"  # a tenth later
    assert lines[-1].startswith("planning: done in ")
    assert len(lines) == 3


def test_a_quick_search_and_a_silenced_one_write_no_progress(monkeypatch, capsys):
    monkeypatch.setenv(QUIET_ENV, "1")
    assert _plan_lines(monkeypatch, capsys, [(0.5, 0.1), (1.5, 0.9)]) == []
    monkeypatch.setenv(QUIET_ENV, "0")
    assert _plan_lines(monkeypatch, capsys, [(4.0, 0.2), (8.0, 0.5)]) == []


# ---- a narrow terminal ---------------------------------------------------------------------------

def potluck_at(columns: int, *args: str) -> subprocess.CompletedProcess:
    """``potluck ARGS`` in its own process, its output ``columns`` wide."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "potluck", *args], capture_output=True,
                          text=True, env=env, timeout=HUNG_S)


def test_schedule_says_which_columns_a_narrow_terminal_leaves_out(write):
    cluster = write("lab.yaml", SCHEDULE_CLUSTER)
    jobs = write("jobs.yaml", "jobs:\n  - {name: pretraining-run, model: tiny-llama, "
                              "global_batch: 8, seq_len: 256, tokens: 1B}\n")
    wide = potluck_at(200, "schedule", "-c", str(cluster), "--jobs", str(jobs))
    assert wide.returncode == 0, wide.stderr
    assert "left out" not in wide.stdout
    narrow = potluck_at(60, "schedule", "-c", str(cluster), "--jobs", str(jobs))
    assert narrow.returncode == 0, narrow.stderr
    said = [line for line in narrow.stdout.splitlines() if line.startswith("left out at 60 ")]
    assert len(said) == 1
    left_out = said[0].split("columns: ")[1].split(" (")[0].split(", ")
    header = next(line for line in narrow.stdout.splitlines() if line.startswith("job "))
    assert left_out and all(name not in header for name in left_out)
    assert "…" not in narrow.stdout and "pretraining-run" in narrow.stdout


def test_cost_names_host_memory_for_an_offer_and_its_host_memory_key_lifts_it(
        monkeypatch, capsys, write):
    """A 4 RTX 2080 Ti machine with 48 GB of host memory cannot hold llama3.2-3b's offloaded
    optimizer; the same offer with host_memory raised as the message says plans."""
    short = write("short.yaml", "offers:\n  - {name: ti, gpu: rtx2080ti, gpus_per_node: 4, "
                                "nvlink: pairs, host_memory: 48GB}\n")
    code, _, err = run(monkeypatch, capsys, "cost", "-m", "llama3.2-3b", "--tokens", "1B",
                       "--offers", str(short))
    line = error_line(err.splitlines()[-1])
    assert code == 3 and "host memory is the limit" in line and "which has 48 GB" in line
    needed = line.split("host_memory: ")[1].split(" or more")[0]
    enough = write("enough.yaml", short.read_text().replace("48GB", needed))
    code, out, _ = run(monkeypatch, capsys, "cost", "-m", "llama3.2-3b", "--tokens", "1B",
                       "--offers", str(enough), "--json")
    assert code == 0 and [c["name"] for c in json.loads(out)["candidates"]] == ["ti"]


# ---- the schedule --schedule auto chose --------------------------------------------------------

TWO_BOXES_ONE_GB = ("nodes: [{name: desk, gpu: rtx3060, gpus_per_node: 1, count: 2, "
                    "inter_bandwidth: 1Gb/s}]\n")


@pytest.mark.parametrize("pinned", [(), ("--schedule", "1f1b")])
def test_the_schedule_auto_chose_is_said_and_a_pinned_one_is_not(monkeypatch, capsys, write,
                                                                    pinned):
    cluster = write("desks.yaml", TWO_BOXES_ONE_GB)
    code, out, err = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "gpt3-125m",
                         "--pp", "2", "--global-batch", "8", "--seq-len", "512", "--top", "1",
                         "--json", *pinned)
    assert code == 0, err
    summary = json.loads(out)
    said = [note for note in summary["notes"] if "--schedule auto" in note]
    assert len(said) == (0 if pinned else 1)
    assert summary["layout"].startswith("dp=1 pp=2")


def test_a_schedule_that_is_no_choice_is_refused_with_auto_among_the_choices(
        monkeypatch, capsys, write):
    cluster = write("desks.yaml", TWO_BOXES_ONE_GB)
    code, _, err = run(monkeypatch, capsys, "plan", "-c", str(cluster), "-m", "gpt3-125m",
                       "--schedule", "2f2b")
    assert code != 0
    assert "auto" in error_line(err) and "1f1b" in error_line(err)


# ---- a bad value of a flag: one line, whichever flag of its kind ------------------------------

TWO_MACHINES = "nodes: [{name: box, gpu: rtx3090, gpus_per_node: 1, count: 2}]\n"
ONE_OFFER = "offers:\n  - {name: seller, gpu: rtx4090, gpus_per_node: 1, price_per_hour: 0.5}\n"


@pytest.mark.parametrize(("args", "fragment"), [
    (["train", "--timeout", "0"], "--timeout: must be a positive number, not 0.0"),
    (["train", "--timeout", "-5"], "--timeout: must be a positive number, not -5.0"),
    (["train", "--timeout", "nan"], "--timeout: nan is not a finite number"),
    (["train", "--dilation", "0"], "--dilation: must be a positive number"),
    (["train", "--dilation", "nan"], "--dilation: nan is not a finite number"),
    (["train", "--steps", str(10**20)], "--steps must be at most 2,147,483,647"),
    (["train", "--master-port", "99999"], "--master-port must be at most 65,535"),
    (["train", "--trace-steps", "0"], "--trace-steps must be at least 1, not 0"),
    (["train", "--inject-failure", "1@2"], "--inject-failure is a drill of an elastic run"),
    (["plan", "--global-batch", "9" * 20], "--global-batch must be at most 2,147,483,647"),
    (["plan", "--top", "0"], "--top must be at least 1, not 0"),
    (["plan", "--lifetime-years", "inf", "--mode", "buy"], "--lifetime-years: inf is not a finite"),
    (["plan", "--deadline-hours", "nan", "--tokens", "1M"], "--deadline-hours: nan is not a finite"),
    (["cost", "--top", "0"], "--top must be at least 1, not 0"),
    (["profile", "--budget", "nan"], "--budget: nan is not a finite number"),
    (["schedule", "--trace", "1000000"], "--trace 1000000 is more jobs than potluck compares"),
])
def test_a_flag_value_out_of_its_kinds_range_is_one_line(monkeypatch, capsys, write, tmp_path,
                                                         args, fragment):
    from potluck import api
    from potluck.plans import save_plan

    cluster = write("lab.yaml", TWO_MACHINES)
    plan = tmp_path / "plan.json"
    save_plan(api.plan(cluster, "tiny-llama", global_batch=4, seq_len=32, dp=2).best, plan)
    command, *flags = args
    given = {"train": ["--plan", str(plan), "--print-commands"],
             "plan": ["-c", str(cluster), "-m", "tiny-llama", "--global-batch", "4"],
             "cost": ["-m", "tiny-llama", "--tokens", "1M", "--offers",
                      str(write("offers.yaml", ONE_OFFER))],
             "profile": ["-o", str(tmp_path / "measured.yaml")],
             "schedule": ["-c", str(cluster)]}[command]
    code, out, err = run(monkeypatch, capsys, command, *given, *flags)
    assert code == 2 and "torchrun" not in out
    assert fragment in error_line(err)
