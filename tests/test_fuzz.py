"""Fuzzing the files potluck reads from others: a cluster file, a model's config.json and a plan
file, each mutated at random from a valid one (keys deleted, values swapped for other types,
huge, negative, non-finite or empty ones, unicode, markup, shell words; bytes flipped, cut or
replaced by binary garbage).

Every outcome is a plan (or a simulation, or printed commands) or a ``PotluckError`` whose
message is one line, what ``potluck`` prints as ``potluck: error: ...`` with a non-zero exit;
never another exception and never a hang: each case runs under a time limit (SIGALRM). The
cases run in this process through the command line's own code (typer's runner on
``potluck.cli.app``, the plan file also through ``api.simulate``); a few run as real
processes to check the exit code and that stderr is exactly one line. The seeds are fixed,
so a failure names a case that reruns the same way: ``case(kind, seed)``. The tally and the
slowest case are logged: ``pytest tests/test_fuzz.py --log-cli-level=INFO``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from potluck import api, cli
from potluck.errors import PotluckError
from potluck.plans import plan_to_dict, save_plan

SRC = Path(__file__).resolve().parents[1] / "src"
CASE_LIMIT_S = 20  # far above any case (the slowest is reported); a case past it is a hang
CASES = {"cluster": 90, "model": 60, "plan": 90}  # mutated files of each kind
HUNG_S = 120
log = logging.getLogger(__name__)

CLUSTERS = [
    """name: lab
nodes:
  - {name: box3090, gpu: rtx3090, gpus_per_node: 4, nvlink: pairs, inter_bandwidth: 10Gb/s}
  - {name: a100, gpu: a100-80g-sxm, gpus_per_node: 2, count: 2, inter_bandwidth: 25Gb/s,
     price_per_hour: 1.5}
links:
  - {between: [box3090, a100], bandwidth: 1Gb/s, latency: 20ms}
""",
    """devices:
  mine: {tflops: 100, memory: 24GB, memory_bandwidth: 900GB/s, matmul_efficiency: 0.6}
nodes:
  - {name: m, gpu: mine, gpus_per_node: 2, intra_latency: 5us}
  - {name: t, gpu: t4, gpus_per_node: 1, count: 2}
execution:
  preset: megatron-lm
  step_overhead_s: 1ms
calibration:
  devices:
    t4: {matmul_efficiency: 0.5, memory_bandwidth_factor: 0.9}
  links:
    - {kind: network, bandwidth: 1GB/s, latency: 30us}
""",
]
SMALL_CLUSTER = "nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 2}\n"
CONFIGS = [
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
     "intermediate_size": 172, "vocab_size": 260, "max_position_embeddings": 256,
     "tie_word_embeddings": False},
    {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 260,
     "n_positions": 256, "resid_pdrop": 0.1, "attn_pdrop": 0.1},
    {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
     "vocab_size": 300, "head_dim": 16},
]
WEIRD = [None, "", " ", "é✓漢", "[/bold]", "x;touch owned;", "$(id)", "-rf", "1e999", "nan",
         ".inf", "10Gb/s", "fast", True, False, 0, -1, 1, 3, 2**31, 10**9, 2**63, 10**30,
         1e308, -1e308, 1e-308, float("nan"), float("inf"), float("-inf"), 0.5, -0.0, [], {},
         [1, 2], {"a": 1}]
GARBAGE = [b"\x00", b"\xff\xfe", b"\x80\x81", b"\xc3\x28", b"{{", b": :", b"- [", b"\t", b"&a *a"]


class CaseTimeout(Exception):
    """A case ran past CASE_LIMIT_S."""


@dataclass
class Outcome:
    """What one case did: ``ok`` (a result), ``error`` (one line), or ``bug`` (anything else)."""

    kind: str
    seed: int
    verdict: str
    seconds: float
    detail: str = ""


# ---- mutations -------------------------------------------------------------------------


def _paths(value, path=()):
    """Every place in a nested structure: tuples of keys and indices."""
    yield path
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        yield from _paths(item, (*path, key))


def _at(value, path):
    for key in path:
        value = value[key]
    return value


def mutate(data, rng: random.Random, rounds: int):
    """``data`` with ``rounds`` random changes: a value replaced, a key deleted or added, a
    list item copied."""
    data = json.loads(json.dumps(data))
    for _ in range(rounds):
        path = rng.choice(list(_paths(data))[1:])
        parent, key = _at(data, path[:-1]), path[-1]
        roll = rng.random()
        if _is_number(parent[key]) and roll < 0.4:
            parent[key] = nearby(parent[key], rng)
        elif isinstance(parent[key], str) and roll < 0.4:
            parent[key] = rng.choice([w for w in WEIRD if isinstance(w, str)])
        elif roll < 0.6:
            parent[key] = rng.choice(WEIRD)
        elif roll < 0.75:
            del parent[key]
        elif roll < 0.85 and isinstance(parent, dict):
            parent[rng.choice(["extra", "nodes", "version", "name", "count"])] = rng.choice(WEIRD)
        elif isinstance(parent, list):
            parent.insert(rng.randrange(len(parent) + 1), json.loads(json.dumps(parent[key])))
        else:
            parent[key] = {"nested": parent[key]}
    return data


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def nearby(value, rng: random.Random):
    """Another number of the same kind: small, scaled by up to 10^300 either way, or its
    negative; what stays plausible reaches the search and the simulator."""
    if isinstance(value, int):
        return rng.choice([0, 1, 2, 3, 5, 7, 64, value * 2, value * 10**6, -value])
    return rng.choice([0.0, 1e-300, value * 1e-6, value * 2, value * 1e6, value * 1e300, -value])


def damage(text: bytes, rng: random.Random) -> bytes:
    """Bytes flipped, the file cut short, or binary garbage spliced in."""
    roll = rng.random()
    if roll < 0.3:
        return text[:rng.randrange(len(text) + 1)]
    if roll < 0.6:
        where = rng.randrange(len(text) + 1)
        return text[:where] + rng.choice(GARBAGE) * rng.randint(1, 3) + text[where:]
    if roll < 0.8:
        raw = bytearray(text)
        for _ in range(rng.randint(1, 5)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))


def mutated_yaml(rng: random.Random) -> bytes:
    data = yaml.safe_load(rng.choice(CLUSTERS))
    if rng.random() < 0.2:  # the cluster's name is free text, shown in every report
        data["name"] = rng.choice([w for w in WEIRD if isinstance(w, str)])
    if rng.random() < 0.25:
        return damage(yaml.safe_dump(data, allow_unicode=True).encode(), rng)
    text = yaml.safe_dump(mutate(data, rng, rng.choice([1, 1, 2, 3])), allow_unicode=True)
    return text.encode()


def mutated_json(base, rng: random.Random) -> bytes:
    if rng.random() < 0.25:
        return damage(json.dumps(base, indent=1).encode(), rng)
    return json.dumps(mutate(base, rng, rng.choice([1, 1, 2, 3]))).encode()  # NaN and Infinity too


# ---- running a case ---------------------------------------------------------------------


def _timeout(signum, frame):
    raise CaseTimeout


def run_case(kind: str, seed: int, action: Callable[[], None]) -> Outcome:
    """``action`` under the time limit, judged."""
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.setitimer(signal.ITIMER_REAL, CASE_LIMIT_S)
    started = time.perf_counter()
    try:
        action()
        verdict, detail = "ok", ""
    except PotluckError as err:
        message = str(err)
        one_line = message.strip() and "\n" not in message
        verdict, detail = ("error" if one_line else "bug"), message
    except CaseTimeout:
        verdict, detail = "bug", f"ran past {CASE_LIMIT_S} s"
    except Exception:  # noqa: BLE001 - any other exception is what the fuzzer looks for
        verdict, detail = "bug", traceback.format_exc(limit=-4)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return Outcome(kind, seed, verdict, time.perf_counter() - started, detail)


def invoke(*args: str) -> None:
    """The command line in this process; a PotluckError comes out as cli.main would see it."""
    result = CliRunner().invoke(cli.app, list(args), catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    if result.exit_code != 0:
        raise AssertionError(f"exit {result.exit_code} without an error: {result.output[-500:]}")


def case_files(kind: str, seed: int, folder: Path, plan_data) -> Path:
    """The mutated file of case ``(kind, seed)``, written into ``folder``."""
    rng = random.Random(f"{kind}-{seed}")
    if kind == "cluster":
        path, content = folder / f"cluster-{seed}.yaml", mutated_yaml(rng)
    elif kind == "model":
        path = folder / f"model-{seed}" / "config.json"
        path.parent.mkdir(exist_ok=True)
        content = mutated_json(rng.choice(CONFIGS), rng)
    else:
        path, content = folder / f"plan-{seed}.json", mutated_json(plan_data, rng)
    path.write_bytes(content)
    return path


def case_action(kind: str, path: Path, small_cluster: Path) -> Callable[[], None]:
    if kind == "cluster":
        return lambda: invoke("plan", "-c", str(path), "-m", "tiny-llama", "--global-batch", "8",
                              "--seq-len", "128", "--top", "2")
    if kind == "model":
        return lambda: invoke("plan", "-c", str(small_cluster), "-m", str(path),
                              "--global-batch", "8", "--seq-len", "64", "--top", "2")

    def plan_file() -> None:
        api.simulate(path)
        invoke("train", "--plan", str(path), "--print-commands")
    return plan_file


@pytest.fixture(scope="module")
def plan_data(tmp_path_factory):
    """A valid plan of the first cluster, as `potluck plan -o` writes it; simulated and
    launched once, so that no case's time holds the first import of torch."""
    from potluck.cluster.spec import parse_cluster

    best = api.plan(parse_cluster(CLUSTERS[0]), "tiny-llama", global_batch=8, seq_len=128).best
    path = tmp_path_factory.mktemp("valid") / "plan.json"
    save_plan(best, path)
    case_action("plan", path, path)()
    return plan_to_dict(best)


def test_mutated_files_give_a_plan_or_one_line_never_a_traceback_or_a_hang(tmp_path, plan_data,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)  # --print-commands writes nothing, but a run would land here
    small_cluster = tmp_path / "small.yaml"
    small_cluster.write_text(SMALL_CLUSTER)
    outcomes = []
    for kind, count in CASES.items():
        for seed in range(count):
            path = case_files(kind, seed, tmp_path, plan_data)
            outcomes.append(run_case(kind, seed, case_action(kind, path, small_cluster)))
    bugs = [o for o in outcomes if o.verdict == "bug"]
    slowest = max(outcomes, key=lambda o: o.seconds)
    tally = {v: sum(o.verdict == v for o in outcomes) for v in ("ok", "error", "bug")}
    log.info("fuzz: %d cases %s; slowest case(%r, %d): %.2f s", len(outcomes), tally,
             slowest.kind, slowest.seed, slowest.seconds)
    assert not bugs, "\n\n".join(f"case({b.kind!r}, {b.seed}):\n{b.detail}" for b in bugs[:5])
    for kind in CASES:  # the mutations reach both outcomes, not only the first check
        assert {"ok", "error"} <= {o.verdict for o in outcomes if o.kind == kind}, kind


# binary bytes, a name that is a mapping (its ': ' once cut the message short), a cluster
# named with markup (once a traceback from the report), layers given as a list (once a
# TypeError), a plan's non-finite latency, binary bytes in a plan, a valid plan
SUBPROCESS_CASES = [("cluster", 8), ("cluster", 19), ("cluster", 46), ("model", 1), ("plan", 7),
                    ("plan", 18), ("plan", 0)]


@pytest.mark.parametrize(("kind", "seed"), SUBPROCESS_CASES)
def test_a_real_process_exits_non_zero_with_exactly_one_line(tmp_path, plan_data, kind, seed):
    small_cluster = tmp_path / "small.yaml"
    small_cluster.write_text(SMALL_CLUSTER)
    path = case_files(kind, seed, tmp_path, plan_data)
    args = {"cluster": ["plan", "-c", path, "-m", "tiny-llama", "--global-batch", "8"],
            "model": ["plan", "-c", small_cluster, "-m", path, "--global-batch", "8"],
            "plan": ["train", "--plan", path, "--print-commands"]}[kind]
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "potluck", *map(str, args)], cwd=tmp_path,
                            capture_output=True, text=True, env=env, timeout=HUNG_S)
    assert "Traceback" not in result.stderr
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("potluck: error: "), result.stderr
