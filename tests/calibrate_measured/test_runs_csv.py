"""Reading measured runs: the columns, the defaults, and one line per mistake."""

from __future__ import annotations

import os

import pytest

from potluck.calibrate.measured.runs import MAX_CSV_BYTES, read_runs
from potluck.errors import ConfigError
from potluck.model.counts import Recompute
from potluck.planner.options import Partition
from potluck.plans import DType
from potluck.plans.memory import Offload, Swap
from potluck.schedules import Schedule

HEADER = "tp,pp,dp,micro_batch_size,global_batch,seq_len,iteration_time_s"


def runs_file(tmp_path, text: str):
    path = tmp_path / "runs.csv"
    path.write_text(text)
    return path


def test_rows_with_optional_columns_and_defaults(tmp_path) -> None:
    path = runs_file(tmp_path, "# measured with Megatron-LM\n"
                     "iteration_time_s,tp,pp,dp,micro_batch_size,global_batch,seq_len,dtype,"
                     "recompute,schedule,zero1,partition,groups\n"
                     "0.61,2,2,2,1,32,1024,fp16,full,gpipe,yes,uniform,box + big\n"
                     "\n"
                     "0.5,1,1,8,2,64,2048,,,,,,\n")
    first, second = read_runs(path, {"box": 4, "big": 4})
    assert (first.line, first.tp, first.pp, first.dp, first.micro_batch_size) == (3, 2, 2, 2, 1)
    assert (first.global_batch, first.seq_len, first.iteration_time_s) == (32, 1024, 0.61)
    assert (first.dtype, first.recompute, first.schedule, first.zero1, first.partition) == (
        DType.FP16, Recompute.FULL, Schedule.GPIPE, True, Partition.UNIFORM)
    assert first.groups == ("box", "big") and second.groups is None
    assert second.line == 5
    assert (second.dtype, second.recompute, second.schedule, second.zero1, second.partition) == (
        DType.BF16, None, Schedule.ONE_F_ONE_B, None, Partition.BALANCED)
    options = first.options()
    assert (options.tp, options.pp, options.dp, options.micro_batch_size, options.top_k) == (2, 2, 2, 1, 1)
    assert (options.partition, options.zero, options.recompute) == (Partition.UNIFORM, 1, Recompute.FULL)
    assert (options.swap, options.offload) == (Swap.NONE, Offload.NONE)  # published runs did neither
    assert options.groups == ("box", "big")


def test_zero_stage_and_virtual_stages_columns_pin_the_search(tmp_path) -> None:
    """FSDP's FULL_SHARD runs are ZeRO-3 and NeMo's interleaved runs have 12 chunks per
    rank: the search they calibrate must be pinned to both, not to its own choice."""
    path = runs_file(tmp_path, HEADER + ",schedule,zero,zero1,virtual_stages\n"
                     "1,1,8,2,64,2048,0.5,1f1b,3,,\n"
                     "4,8,1,1,64,2048,9.0,interleaved,,true,12\n")
    fsdp, nemo = read_runs(path, {"a": 32})
    assert (fsdp.options().zero, nemo.options().zero) == (3, 1)
    assert nemo.options().virtual_stages == 12


@pytest.mark.parametrize(("text", "message"), [
    ("", r"runs.csv: empty file; its first line must be the header tp,pp,dp,"),
    (HEADER + "\n", r"runs.csv:1: no runs after the header; add one line per measured run"),
    ("tp,pp,dp,micro_batch_size,global_batch,iteration_time_s\n1,1,1,1,8,0.5\n",
     r"runs.csv:1: no column 'seq_len'; the header must name tp,pp,dp,"),
    ("tp,pp,dp,micro_batch_size,global_batch,seq_len,iteration_time,x\n",
     r"runs.csv:1: unknown column 'iteration_time'; columns are tp,pp,"),
    (HEADER + ",tp\n", r"runs.csv:1: column 'tp' appears twice"),
    (HEADER + "\n1,1,2,1,8,512,0.5\n1,one,1,1,8,512,0.5\n",
     r"runs.csv:3: column 'pp' must be a positive integer, not 'one'"),
    (HEADER + "\n1,1,2,1,8,512,fast\n",
     r"runs.csv:2: column 'iteration_time_s' must be a positive number of seconds, not 'fast'"),
    (HEADER + "\n1,1,2,1,8,512,-0.5\n", r"runs.csv:2: column 'iteration_time_s' must be a positive"),
    (HEADER + "\n1,0,2,1,8,512,0.5\n", r"runs.csv:2: column 'pp' must be a positive integer, not '0'"),
    (HEADER + ",zero\n1,1,2,1,8,512,0.5,4\n", r"runs.csv:2: column 'zero' must be a ZeRO stage"),
    (HEADER + ",zero,zero1\n1,1,2,1,8,512,0.5,3,true\n", r"runs.csv:2: zero 3 and zero1 True disagree"),
    (HEADER + ",virtual_stages\n1,2,1,1,8,512,0.5,4\n",
     r"runs.csv:2: virtual_stages 4 needs an interleaved schedule"),
    (HEADER + "\n1,1,2,1,8,,0.5\n", r"runs.csv:2: column 'seq_len' is empty; give the run's value"),
    (HEADER + "\n1,1,2,1,8,512\n", r"runs.csv:2: 6 values for 7 columns"),
    (HEADER + ",dtype\n1,1,2,1,8,512,0.5,int8\n",
     r"runs.csv:2: column 'dtype' must be one of bf16, fp16, fp32, tf32, not 'int8'"),
    (HEADER + ",schedule\n1,2,1,1,8,512,0.5,pipedream\n", r"runs.csv:2: column 'schedule' must be one of"),
    (HEADER + "\n2,2,4,1,16,512,0.5\n",
     r"runs.csv:2: tp\*pp\*dp = 16 GPUs but the cluster has 8; give the cluster file the run"),
    (HEADER + ",groups\n1,1,4,1,8,512,0.5,box+boxes\n",
     r"runs.csv:2: column 'groups' names 'boxes', not a node group of the cluster \(box, big\); "
     r"join names with '\+'"),
    (HEADER + ",groups\n1,1,,1,8,512,0.5,box+\n", r"runs.csv:2: column 'dp' is empty"),
    (HEADER + ",groups\n1,1,2,1,8,512,0.5,box+\n",
     r"runs.csv:2: column 'groups' must name node groups joined by '\+', not 'box\+'"),
    (HEADER + ",groups\n1,2,4,1,8,512,0.5,big\n",
     r"runs.csv:2: tp\*pp\*dp = 8 GPUs but big have 4; give the cluster file the run"),
    (HEADER + "\n1,1,4,2,12,512,0.5\n",
     r"runs.csv:2: global_batch 12 is not divisible by dp\*micro_batch_size = 8; give the run's "
     r"global batch \(a multiple of 8\)"),
])
def test_each_mistake_is_one_line_naming_the_row(tmp_path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        read_runs(runs_file(tmp_path, text), {"box": 4, "big": 4})
    assert "\n" not in str(err.value)


def test_a_missing_file_is_one_line(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read measured runs .*nope.csv"):
        read_runs(tmp_path / "nope.csv", {"box": 8})


def test_too_many_runs_are_one_line_with_the_limit(tmp_path) -> None:
    from potluck.calibrate.measured.runs import MAX_RUNS

    rows = "\n".join(["1,1,2,1,8,512,0.5"] * (MAX_RUNS + 1))
    with pytest.raises(ConfigError, match=f"more than {MAX_RUNS} runs; calibrate against at most"):
        read_runs(runs_file(tmp_path, f"{HEADER}\n{rows}\n"), {"box": 4, "big": 4})


@pytest.mark.parametrize(("content", "message"), [
    (b"\x00\x01\x02\x03" * 64, r"runs.csv:1: a NUL byte: this is a binary file, not a CSV"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe", r"runs.csv: the measured runs CSV is not UTF-8 text"),
])
def test_a_binary_file_is_one_line(tmp_path, content: bytes, message: str) -> None:
    path = tmp_path / "runs.csv"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        read_runs(path, {"box": 8})


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "huge"])
def test_a_device_a_fifo_or_a_huge_file_is_refused_before_it_is_read(tmp_path, target) -> None:
    """A link to /dev/zero would fill the memory, a FIFO block for ever."""
    path = tmp_path / "runs.csv"
    if target == "fifo":
        os.mkfifo(path)
    elif target == "huge":
        with open(path, "wb") as file:
            file.truncate(MAX_CSV_BYTES + 1)  # sparse: no disk used
    else:
        path.symlink_to(target)
    message = "larger than" if target == "huge" else "not a regular file"
    with pytest.raises(ConfigError, match=message):
        read_runs(path, {"box": 8})
