"""``potluck cost`` and ``potluck plan --objective cost`` from the command line."""

from __future__ import annotations

import json
import sys

import pytest

from potluck import cli

OFFERS = """\
offers:
  - {name: four, gpu: rtx4090, gpus_per_node: 4}
  - {name: pairs, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, price_per_hour: 0.30,
     spot_price_per_hour: 0.2}
"""
LAB = """\
nodes:
  - {name: fast, gpu: rtx4090, gpus_per_node: 4, inter_bandwidth: 100Gb/s}
  - {name: old, gpu: rtx3090, gpus_per_node: 4, price_per_hour: 3.0, inter_bandwidth: 100Gb/s}
"""
REQUIRED = ("name", "gpus", "tokens_per_s", "usd_per_hour", "usd_per_million_tokens", "hours_to_train",
            "tflops_per_usd", "plan")


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run ``potluck ARGS`` in this process; its exit code, stdout and stderr."""
    monkeypatch.setattr(sys, "argv", ["potluck", *args])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    out, err = capsys.readouterr()
    return exited.value.code or 0, out, err


def test_cost_json_has_one_object_per_candidate_with_consistent_dollars(monkeypatch, capsys, write, tmp_path):
    offers = write("offers.yaml", OFFERS)
    plot = tmp_path / "costs.png"
    code, out, _ = run(monkeypatch, capsys, "cost", "--model", "gpt3-350m", "--tokens", "300M",
                       "--offers", str(offers), "--json", "--plot", str(plot))
    assert code == 0
    study = json.loads(out)
    assert study["tokens"] == 300_000_000
    assert [c["name"] for c in study["candidates"]] and plot.is_file()
    for candidate in study["candidates"]:
        assert all(key in candidate for key in REQUIRED)
        per_million = candidate["usd_per_hour"] / (candidate["tokens_per_s"] * 3600 / 1e6)
        assert candidate["usd_per_million_tokens"] == pytest.approx(per_million)
        assert candidate["hours_to_train"] == pytest.approx(3e8 / candidate["tokens_per_s"] / 3600)
        assert candidate["plan"]["layout"].startswith("dp=")
    costs = [c["usd_per_million_tokens"] for c in study["candidates"]]
    assert costs == sorted(costs)


@pytest.mark.parametrize("tokens, count", [("1e9", 10**9), ("2B", 2 * 10**9), ("300M", 3 * 10**8)])
def test_token_counts_read_as_people_write_them(monkeypatch, capsys, write, tokens, count):
    offers = write("offers.yaml", OFFERS)
    code, out, _ = run(monkeypatch, capsys, "cost", "-m", "gpt3-350m", "--tokens", tokens,
                       "--offers", str(offers), "--json", "--spot")
    assert code == 0 and json.loads(out)["tokens"] == count


def test_cost_table_shows_rcc_beside_the_training_figures(monkeypatch, capsys, write):
    offers = write("offers.yaml", OFFERS)
    code, out, _ = run(monkeypatch, capsys, "cost", "-m", "gpt3-350m", "--tokens", "1B",
                       "--offers", str(offers), "--mode", "buy", "--lifetime-years", "2")
    assert code == 0
    assert "$/Mtok" in out and "RCC" in out and "cheapest per token:" in out
    assert "bought: 2 years" in out


def test_cost_says_its_dtype_and_which_gpus_compute_in_another(monkeypatch, capsys, write):
    offers = write("offers.yaml", OFFERS + "  - {name: tees, gpu: t4, gpus_per_node: 4}\n")
    code, out, _ = run(monkeypatch, capsys, "cost", "-m", "gpt3-350m", "--tokens", "1B",
                       "--offers", str(offers), "--dtype", "bf16")
    assert code == 0 and "gpt3-350m: 1,000,000,000 tokens, bf16," in out
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == ["note: t4 computes in fp16, not bf16: no bf16 support"]
    code, out, _ = run(monkeypatch, capsys, "cost", "-m", "gpt3-350m", "--tokens", "1B",
                       "--offers", str(offers), "--dtype", "bf16", "--json")
    study = json.loads(out)
    assert study["dtype"] == "bf16" and study["dtype_notes"] == [notes[0].removeprefix("note: ")]


@pytest.mark.parametrize("args, message", [
    (["--tokens", "lots"], "--tokens: cannot read 'lots'"),
    (["--tokens", "1B", "--dtype", "fp8"], "--dtype must be one of bf16, fp16, fp32, tf32, not 'fp8'"),
    (["--tokens", "1B", "--mode", "lease"], "--mode must be one of rent, buy"),
    (["--tokens", "1B", "--utilization", "2"], "--utilization: must be a fraction above 0 and at most 1"),
    (["--tokens", "1B", "--offers", "BAD"], ":3: offers[0].gpus_per_node: must be a whole number"),
    (["--tokens", "1B", "--offers", "nowhere.yaml"], "offers file 'nowhere.yaml' not found"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(monkeypatch, capsys, write, args, message):
    bad = write("bad.yaml", "offers:\n  - gpu: rtx4090\n    gpus_per_node: two\n")
    args = [str(bad) if a == "BAD" else a for a in args]
    code, out, err = run(monkeypatch, capsys, "cost", "-m", "gpt3-350m", *args)
    assert code != 0
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("potluck: error: ") and message in err


def test_plan_objective_cost_says_which_devices_do_not_pay(monkeypatch, capsys, write):
    lab = write("lab.yaml", LAB)
    code, out, _ = run(monkeypatch, capsys, "plan", "-c", str(lab), "-m", "gpt3-350m", "--global-batch",
                       "32", "--seq-len", "1024", "--objective", "cost", "--tokens", "1B", "--json")
    assert code == 0
    result = json.loads(out)
    assert any("old left out" in note and "do not pay" in note for note in result["notes"])
    assert result["cost"]["gpus"] == result["num_gpus"] == 4
    assert result["cost"]["tokens"] == 10**9


def test_plan_with_an_impossible_deadline_exits_non_zero(monkeypatch, capsys, write):
    lab = write("lab.yaml", LAB)
    code, _, err = run(monkeypatch, capsys, "plan", "-c", str(lab), "-m", "gpt3-350m", "--tokens", "1B",
                       "--deadline-hours", "0.001")
    assert code == 3 and "no plan trains 1,000,000,000 tokens within 0.001 h" in err
