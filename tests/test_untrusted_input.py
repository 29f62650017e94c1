"""Files from others, as a user meets them on the command line: every bad input is one line
on stderr and a non-zero exit, and nothing read from a file reaches a shell unquoted."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
HUNG_S = 120  # not a speed check: a command that has not ended by then is hung
CLUSTER = "nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 2, count: 2}\n"


def potluck(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "potluck", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=HUNG_S)


def one_line_error(result, *fragments):
    """The command failed with exactly one ``potluck: error:`` line holding ``fragments``."""
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("potluck: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def plan_data(tmp_path_factory):
    """A plan over two machines of 2 GPUs, as `potluck plan -o` writes it."""
    folder = tmp_path_factory.mktemp("plan")
    (folder / "lab.yaml").write_text(CLUSTER)
    result = potluck("plan", "-c", folder / "lab.yaml", "-m", "tiny-llama", "--global-batch", 8,
                     "--seq-len", 128, "--dp", 2, "--pp", 2, "-o", folder / "plan.json")
    assert result.returncode == 0, result.stderr
    return json.loads((folder / "plan.json").read_text())


def write_plan(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def renamed(data, old: str, new: str):
    """The plan with node group ``old`` called ``new`` everywhere (devices included)."""
    text = json.dumps(data).replace(f'"{old}"', f'"{new}"').replace(f'"{old}.', f'"{new}.')
    return json.loads(text)


def test_a_plan_whose_node_group_is_a_shell_command_is_refused_at_load(tmp_path, plan_data):
    evil = write_plan(tmp_path / "evil.json", renamed(plan_data, "box", "x;touch owned;"))
    result = potluck("train", "--plan", evil, "--print-commands", cwd=tmp_path)
    one_line_error(result, "nodes[0].name", "'x;touch owned;'", "cannot contain")
    assert "torchrun" not in result.stdout


@pytest.mark.parametrize("name", ["a b", "$(id)", "-rf", "é", "x" * 65])
def test_names_a_cluster_file_refuses_are_refused_in_a_plan_file(tmp_path, plan_data, name):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(CLUSTER.replace("name: box", f"name: {json.dumps(name)}"))
    from_cluster = one_line_error(potluck("plan", "-c", cluster, "-m", "tiny-llama"))
    plan = write_plan(tmp_path / "plan.json", renamed(plan_data, "box", name))
    from_plan = one_line_error(potluck("simulate", plan, cwd=tmp_path))
    assert from_cluster.split("node group name ", 1)[1] == from_plan.split("node group name ", 1)[1]


def test_every_value_in_the_printed_commands_is_one_shell_word(tmp_path, plan_data):
    folder = tmp_path / "it's my plans"
    folder.mkdir()
    plan = write_plan(folder / "the plan.json", plan_data)
    data = tmp_path / "my corpus"
    data.mkdir()
    (data / "a.txt").write_text("hello world\n" * 50)
    out = tmp_path / 'runs "x"'
    result = potluck("train", "--plan", plan, "--print-commands", "--data", data, "--out", out,
                     "--master-addr", "head node;reboot")
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if line.startswith("POTLUCK_NODE=")]
    assert len(commands) == 2
    for node_rank, command in enumerate(commands):
        words = shlex.split(command)
        assert words[0] == f"POTLUCK_NODE=box.{node_rank}" and words[2] == "torchrun"
        assert words[words.index("--plan") + 1] == str(plan)
        assert words[words.index("--data") + 1] == str(data)
        assert words[words.index("--out-dir") + 1] == str(out)
        assert "--master-addr=head node;reboot" in words


def test_printed_commands_carry_no_path_of_this_install(tmp_path, plan_data):
    from potluck.data.corpus import builtin_corpus_path
    from potluck.runtime.worker import parse_options

    plan = write_plan(tmp_path / "plan.json", plan_data)
    result = potluck("train", "--plan", plan, "--print-commands", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--data" not in result.stdout and str(SRC) not in result.stdout
    # each machine's worker reads its own shipped corpus when --data is not given
    assert parse_options(["--plan", "plan.json"])[1].data == str(builtin_corpus_path())


@pytest.mark.parametrize(("command", "suffix"), [("plan", ".yaml"), ("simulate", ".json"),
                                                  ("model", "config.json")])
def test_a_binary_file_is_one_line(tmp_path, command, suffix):
    path = tmp_path / f"garbage{suffix}"
    path.write_bytes(b"\x00\xff\xfe\x80 not text")
    if command == "plan":
        result = potluck("plan", "-c", path, "-m", "tiny-llama")
    elif command == "simulate":
        result = potluck("simulate", path, cwd=tmp_path)
    else:
        cluster = tmp_path / "lab.yaml"
        cluster.write_text(CLUSTER)
        result = potluck("plan", "-c", cluster, "-m", path)
    one_line_error(result, str(path), "not UTF-8 text")


@pytest.mark.parametrize(("field", "fragment"), [
    ("inter_bandwidth: .nan", "nodes[0].inter_bandwidth: nan is not a finite number"),
    ("inter_latency: .inf", "nodes[0].inter_latency: inf is not a finite number"),
    ("price_per_hour: -.inf", "nodes[0].price_per_hour: -inf is not a finite number"),
    ("nvlink_bandwidth: 1e999GB/s", "nodes[0].nvlink_bandwidth: '1e999GB/s' is not a finite"),
])
def test_non_finite_numbers_in_a_cluster_file_are_refused_at_their_line(tmp_path, field, fragment):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("nodes:\n  - name: box\n    gpu: rtx3090\n    gpus_per_node: 2\n"
                       f"    {field}\n")
    one_line_error(potluck("plan", "-c", cluster, "-m", "tiny-llama"), "lab.yaml:5:", fragment)


@pytest.mark.parametrize(("key", "value"), [("tflops", "0"), ("matmul_efficiency", "0"),
                                            ("tflops", ".nan"), ("memory", "0GB")])
def test_a_custom_device_that_cannot_compute_is_refused_at_load(tmp_path, key, value):
    figures = {"memory": "24GB", "tflops": "10", key: value}
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("devices:\n  mine: {" + ", ".join(f"{k}: {v}" for k, v in figures.items())
                       + "}\nnodes:\n  - {name: box, gpu: mine, gpus_per_node: 1}\n")
    one_line_error(potluck("plan", "-c", cluster, "-m", "tiny-llama"), "lab.yaml:2:", key)


@pytest.mark.parametrize(("change", "fragment"), [
    (lambda d: d["training"].update(seq_len=0), "training.seq_len: Input should be greater than 0"),
    (lambda d: d.pop("version"), "has no 'version'"),
    (lambda d: d.update(version="1"), "plan version '1' is not supported"),
    (lambda d: d["cluster"]["nodes"][0].update(inter_bandwidth_bytes_per_s=float("nan")),
     "cluster.nodes.0.inter_bandwidth_bytes_per_s: is not a finite number"),
    (lambda d: d["cluster"]["device_types"][0].update(tflops=0),
     "cluster.device_types.0.tflops: Input should be greater than 0"),
    (lambda d: d["cluster"]["nodes"][0].update(count=100_000_000), "at most 16,384"),
    (lambda d: d["cluster"]["nodes"][0].update(gpu="ghost"), "'ghost' is none of the device types"),
    # every key one the plan has: a misspelt setting would be off
    (lambda d: d.update(zer0=1), "zer0: unknown key, which potluck would ignore (a misspelt "
                                 "setting would be off); did you mean 'zero'?"),
    (lambda d: d.update(recompte="full"), "recompte: unknown key"),
    (lambda d: d["training"].update(global_bach=64),
     "training.global_bach: unknown key, which potluck would ignore (a misspelt setting would "
     "be off); did you mean 'global_batch'?"),
    # the plan agrees with itself: the model with the config the run builds it from
    (lambda d: d["model"].update(hf_config={"model_type": "llama", "hidden_size": 128}),
     "model.hidden_size 64 contradicts model.hf_config.hidden_size 128"),
    (lambda d: (d["model"].update(learned_positions=True), d["training"].update(seq_len=512)),
     "training.seq_len 512 exceeds tiny-llama's 256 learned positions"),
    (lambda d: d["cluster"].update(name="lab\nrm -rf ~"), "cluster name 'lab\\nrm -rf ~' cannot "
                                                        "contain '\\n'"),
])
def test_a_plan_file_is_validated_on_load_naming_the_field(tmp_path, plan_data, change, fragment):
    data = json.loads(json.dumps(plan_data))
    change(data)
    plan = write_plan(tmp_path / "plan.json", data)
    one_line_error(potluck("simulate", plan, cwd=tmp_path), str(plan), fragment)


@pytest.mark.parametrize(("text", "fragment"), [
    ("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 2, gpus_per_node: 4}\n",
     "lab.yaml:2: malformed YAML: key 'gpus_per_node' is written twice in one mapping (first at "
     "line 2; YAML would keep the last silently); keep one"),
    ("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 2, nvlink: yes}\n",
     "nodes[0].nvlink: must be none, pairs or all, not true (YAML reads yes, on and true as "
     "true): write pairs"),
    ("devices:\n  mine: {memory: 24GB, tflops: 10, matmul_efficiency: 50}\n"
     "nodes:\n  - {name: box, gpu: mine, gpus_per_node: 1}\n",
     "matmul_efficiency: 50 is no share of the peak; write one such as 0.8"),
    ('name: "lab\\e[2J"\n' + CLUSTER, "cluster name 'lab\\x1b[2J' cannot contain '\\x1b'"),
])
def test_a_cluster_file_value_yaml_or_a_typo_would_change_is_one_line(tmp_path, text, fragment):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(text)
    one_line_error(potluck("plan", "-c", cluster, "-m", "tiny-llama"), fragment)


def test_a_model_config_whose_rope_scaling_transformers_does_not_know_is_one_line(tmp_path):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(CLUSTER)
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 300,
              "rope_scaling": {"type": "nosuch", "factor": 2.0}}
    path = tmp_path / "mine" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    one_line_error(potluck("plan", "-c", cluster, "-m", path),
                   "rope_scaling type 'nosuch' is none of default, linear, dynamic, yarn")


def test_a_bert_config_is_refused_not_planned_as_a_llama(tmp_path):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(CLUSTER)
    bert = {"architectures": ["BertForMaskedLM"], "hidden_size": 768, "num_hidden_layers": 12,
            "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522}
    for config in ({**bert, "model_type": "bert"}, bert):  # with and without model_type
        path = tmp_path / "bert" / "config.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(config))
        one_line_error(potluck("plan", "-c", cluster, "-m", path), "BertForMaskedLM",
                       "potluck plans decoder-only causal language models")


def test_absurd_machine_counts_end_at_once_with_the_bound(tmp_path):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 8, count: 100000000}\n")
    result = potluck("plan", "-c", cluster, "-m", "tiny-llama")  # minutes before the bound
    one_line_error(result, "800,000,000 GPUs", "at most 16,384")


def test_the_search_benchmarks_clusters_are_well_inside_the_bound():
    sys.path.insert(0, str(SRC.parent / "benchmarks"))
    try:
        from search_scale import CASES, cluster_text
    finally:
        sys.path.pop(0)
    from potluck.cluster.spec import MAX_GPUS, parse_cluster

    largest = max(parse_cluster(cluster_text(case[0])).num_gpus for case in CASES)
    assert largest == 1024 and MAX_GPUS >= 16 * largest


def test_rank_order_pins_that_leave_ranks_idle_say_so_not_out_of_memory(tmp_path):
    """No hostfile runs --pp 2 on a batch of 3: the T4s alone are 3 ranks, the 3090 alone 1,
    all of them 4 (two replicas, which cannot split 3 micro-batches evenly)."""
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("nodes:\n  - {name: a, gpu: t4, gpus_per_node: 3}\n"
                       "  - {name: b, gpu: rtx3090, gpus_per_node: 1}\n")
    result = potluck("plan", "-c", cluster, "-m", "tiny-llama", "--global-batch", 3, "--seq-len",
                     128, "--pp", 2, "--execution", "megatron-lm")
    line = one_line_error(result, "uses all 4 ranks", "dp 2 (tp 1 x pp 2)",
                          "multiple of 2")
    assert "memory" not in line


def _alias_bomb(levels: int) -> str:
    """A node group name that YAML aliases expand to 9^levels strings."""
    value = "&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"
    for i in range(1, levels + 1):
        value = f"&a{i} [{value}, " + ", ".join([f"*a{i - 1}"] * 8) + "]"
    return value


@pytest.mark.parametrize(("text", "fragment"), [
    ("nodes:\n  - {name: " + _alias_bomb(8) + ", gpu: t4, gpus_per_node: 1}\n",
     "expands to more than 100,000 values"),
    ("nodes: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
])
def test_a_cluster_file_that_expands_or_nests_without_end_is_one_line(tmp_path, text, fragment):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(text)
    result = potluck("plan", "-c", cluster, "-m", "tiny-llama")
    one_line_error(result, fragment)
    assert len(result.stderr) < 300  # not the 43 million strings the aliases stand for


def test_names_free_to_hold_any_text_are_printed_as_written(tmp_path):
    """A cluster's and a model's name are free text: shown as written, not read as markup."""
    cluster = tmp_path / "lab.yaml"
    cluster.write_text('name: "[/bold] [red]lab"\n' + CLUSTER)
    model = tmp_path / "[bold]mine" / "config.json"
    model.parent.mkdir()
    model.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "intermediate_size": 128,
                                 "vocab_size": 300}))
    result = potluck("plan", "-c", cluster, "-m", model, "--global-batch", 8, "--seq-len", 128)
    assert result.returncode == 0, result.stderr
    assert "[bold]mine on [/bold] [red]lab (" in result.stdout


@pytest.mark.parametrize(("command", "kind", "fragment"), [
    ("plan", "/dev/zero", "is a character device, not a regular file"),
    ("simulate", "fifo", "is a FIFO, not a regular file"),
    ("plan", "huge", "is larger than 67,108,864 bytes"),
])
def test_a_device_a_fifo_or_a_huge_file_is_one_line_before_it_is_read(tmp_path, command, kind,
                                                                       fragment):
    """Read to its end, a link to /dev/zero fills the memory and a FIFO blocks for ever."""
    path = tmp_path / ("lab.yaml" if command == "plan" else "plan.json")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        with open(path, "wb") as file:
            file.truncate((64 << 20) + 1)  # sparse: no disk used
    else:
        path.symlink_to(kind)
    args = ("-c", path, "-m", "tiny-llama") if command == "plan" else (path,)
    one_line_error(potluck(command, *args, cwd=tmp_path), str(path), fragment)
