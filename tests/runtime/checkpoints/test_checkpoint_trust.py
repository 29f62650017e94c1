"""Run directories are untrusted: what `potluck train --resume` and `potluck export` do with
a crafted, damaged or inconsistent checkpoint, as a user meets it on the command line.

One two-rank run of a tiny LLaMA (4 steps, checkpoints at steps 2 and 4) is trained once
per module; each test damages its own copy of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src"
HUNG_S = 600  # not a speed check: how long a command may take before the test calls it hung
CPU_CLUSTER = "nodes: [{name: cpu, gpu: cpu, gpus_per_node: 2}]\n"
SHARD = "shard-00001-model-00001-of-00001.safetensors"


def potluck(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "potluck", *args], capture_output=True,
                          text=True, env=env, timeout=HUNG_S)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    (root / "cpus.yaml").write_text(CPU_CLUSTER)
    result = potluck("train", "-c", str(root / "cpus.yaml"), "-m", "tiny-llama", "--global-batch",
                     "4", "--seq-len", "32", "--out", str(root / "run"), "--checkpoint-every", "2",
                     "--steps", "4")
    assert result.returncode == 0, result.stderr
    return root / "run"


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run for one test to damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def _resume(run: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return potluck("train", "--plan", str(run / "plan.json"), "--out", str(run), "--resume",
                   "--steps", str(steps), *extra)


def _step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


def _error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a failure shows: no traceback, the error last."""
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("potluck: error: "), result.stderr
    return lines[-1]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _overwrite_with_inf(shard: Path, nbytes: int = 64) -> None:
    """Overwrite ``nbytes`` of tensor data (past the safetensors header) with float32 infs."""
    data = bytearray(shard.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0] + 256
    data[start:start + nbytes] = struct.pack(f"<{nbytes // 4}f", *[float("inf")] * (nbytes // 4))
    shard.write_bytes(bytes(data))


class _WritesAFile:
    """Unpickling this creates a file: what a crafted .metadata could do instead."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _old_format_checkpoint(run: Path, proof: Path) -> None:
    """Replace the run's checkpoints with one in the old layout whose pickled .metadata
    would create ``proof`` if anything unpickled it."""
    shutil.rmtree(run / "checkpoints")
    old = _step_dir(run, 4)
    old.mkdir(parents=True)
    (old / ".metadata").write_bytes(pickle.dumps(_WritesAFile(proof)))
    (old / "__0_0.distcp").write_bytes(b"\0" * 64)
    (old / "trainer_state.json").write_text(json.dumps({"step": 4}))
    (old / "COMPLETE").write_text(json.dumps({"step": 4}))


def test_a_pickle_in_a_run_directory_is_never_unpickled_by_resume_or_export(run, tmp_path):
    proof = tmp_path / "code-ran"
    _old_format_checkpoint(run, proof)
    for result in (_resume(run, 6), potluck("export", str(run), "--out", str(tmp_path / "hf"))):
        line = _error_line(result)
        assert "step_000004" in line and ".metadata" in line and "could run code" in line
        assert not proof.exists(), "loading the checkpoint ran code from the run directory"
    assert not (tmp_path / "hf").exists()


def test_a_damaged_shard_is_named_and_the_run_resumes_from_the_previous_checkpoint(run):
    """Also: metrics.jsonl holds each step once, and the resumed steps are those of the
    uninterrupted run (so the damaged state was never read)."""
    before = _metrics(run)
    _overwrite_with_inf(_step_dir(run, 4) / SHARD)
    result = _resume(run, 6)
    assert result.returncode == 0, result.stderr
    warning = next(line for line in result.stderr.splitlines() if SHARD in line)
    assert "step_000004" in warning and "sha256" in warning and "using step_000002" in warning
    rows = _metrics(run)
    assert [row["step"] for row in rows] == list(range(6))
    assert [row["loss"] for row in rows[:4]] == pytest.approx([row["loss"] for row in before],
                                                              abs=1e-6)
    assert not any(row["skipped"] for row in rows)


def test_when_every_checkpoint_is_damaged_resume_and_export_stop_with_one_line(run, tmp_path):
    shutil.rmtree(_step_dir(run, 2))
    _overwrite_with_inf(_step_dir(run, 4) / SHARD)
    for result in (_resume(run, 6), potluck("export", str(run), "--out", str(tmp_path / "hf"))):
        line = _error_line(result)
        assert "step_000004" in line and SHARD in line and "sha256" in line
    assert len(_metrics(run)) == 4 and not (tmp_path / "hf").exists()


def test_export_says_which_step_it_exported_and_skips_a_damaged_newer_one(run, tmp_path):
    _overwrite_with_inf(_step_dir(run, 4) / SHARD)
    result = potluck("export", str(run), "--out", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert "exported step 2" in result.stdout and "step_000002" in result.stdout
    assert SHARD in result.stderr and "using step_000002" in result.stderr


def test_a_resumed_run_saves_its_final_state_without_checkpoint_every(run, tmp_path):
    result = _resume(run, 5)
    assert result.returncode == 0, result.stderr
    assert (_step_dir(run, 5) / "COMPLETE").is_file()
    exported = potluck("export", str(run), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    assert "exported step 5" in exported.stdout


def test_export_to_an_existing_file_is_one_line_and_writes_nothing(run, tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"keep me")
    line = _error_line(potluck("export", str(run), "--out", str(target)))
    assert str(target) in line and "directory" in line
    assert target.read_bytes() == b"keep me"


def _update_manifest(checkpoint: Path, name: str) -> None:
    """The manifest's entry of ``name`` made to match the file: damage that verifies."""
    path = checkpoint / name
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": path.stat().st_size,
                               "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _rewrite_shard(checkpoint: Path, change) -> None:
    """``change(tensors, metadata)`` applied to the shard, the manifest updated to match."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = checkpoint / SHARD
    with safe_open(str(shard), framework="pt") as file:
        metadata = file.metadata()
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    change(tensors, metadata)
    save_file(tensors, str(shard), metadata=metadata)
    _update_manifest(checkpoint, SHARD)


def _rewrite_json(checkpoint: Path, name: str, change) -> None:
    """``change(data)`` applied to a JSON file of the checkpoint, the manifest updated."""
    data = json.loads((checkpoint / name).read_text())
    change(data)
    (checkpoint / name).write_text(json.dumps(data))
    _update_manifest(checkpoint, name)


def _set_lr(value):
    def change(values: dict) -> None:
        for key in values:
            if key.endswith(".lr"):
                values[key] = value
    return change


def _inf_weights(tensors: dict, metadata: dict) -> None:
    for key, tensor in tensors.items():
        if key.startswith("model.") and tensor.is_floating_point():
            tensor.fill_(float("inf"))


def test_a_checkpoint_that_verifies_but_is_not_finite_is_skipped_for_an_older_one(run):
    """Inf weights with a matching manifest (as a diverged run saves them): the run
    resumes from step 2 and says why, instead of skipping every step and exiting 0."""
    _rewrite_shard(_step_dir(run, 4), _inf_weights)
    result = _resume(run, 6)
    assert result.returncode == 0, result.stderr
    warning = next(line for line in result.stderr.splitlines() if "holds inf or NaN" in line)
    assert "step_000004 cannot be resumed" in warning and "trying" in warning
    assert "step_000002" in warning
    rows = _metrics(run)
    assert [row["step"] for row in rows] == list(range(6))
    assert not any(row["skipped"] for row in rows)


def test_export_skips_a_checkpoint_whose_weights_are_not_finite(run, tmp_path):
    _rewrite_shard(_step_dir(run, 4), _inf_weights)
    result = potluck("export", str(run), "--out", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert "exported step 2" in result.stdout
    warning = next(line for line in result.stderr.splitlines() if "holds inf or NaN" in line)
    assert "step_000004 cannot be exported" in warning and "trying" in warning


def test_when_no_checkpoint_can_be_resumed_the_run_stops_with_one_line(run):
    """Step 4 says it is step 10**18 (which ran nothing and exited 0), step 2 has lr NaN
    (which trained NaN and exited 0), each with its manifest updated: the run names
    step 4's problem after a warning naming step 2's, and trains nothing."""
    _rewrite_json(_step_dir(run, 4), "trainer_state.json",
                  lambda state: state.update(step=10**18))
    _rewrite_json(_step_dir(run, 2), "values.json", _set_lr(float("nan")))
    result = _resume(run, 6)
    line = _error_line(result)
    assert "step_000004 cannot be resumed" in line
    assert "says step 1000000000000000000, but the checkpoint is of step 4" in line
    assert "no older checkpoint can be resumed either (checkpoint" in line
    assert "step_000002 cannot be resumed: its values.json value" in line and ".lr' is nan" in line
    assert len(_metrics(run)) == 4


def test_shard_offsets_past_the_model_are_refused_before_export_allocates(run, tmp_path):
    """Offsets [1e12, 0] in a shard header made export try to allocate 256 TB."""
    def far_offsets(tensors: dict, metadata: dict) -> None:
        sharding = json.loads(metadata["DCP_SHARDING_INFO"])
        key = next(k for k in sharding if k.startswith("model.") and k.endswith("embed_tokens.weight"))
        sharding[key]["saved_offsets"] = [10**12, 0]
        metadata["DCP_SHARDING_INFO"] = json.dumps(sharding)

    _rewrite_shard(_step_dir(run, 4), far_offsets)
    line = _error_line(potluck("export", str(run), "--out", str(tmp_path / "hf")))
    assert "step_000004 does not fit the model" in line
    assert "embed_tokens.weight" in line and "1000000000" in line
    assert not (tmp_path / "hf").exists()


def test_a_manifest_linked_to_dev_zero_is_one_line(run, tmp_path):
    """Read to its end, /dev/zero fills the memory."""
    for step in (2, 4):
        manifest = _step_dir(run, step) / "manifest.json"
        manifest.unlink()
        manifest.symlink_to("/dev/zero")
    line = _error_line(potluck("export", str(run), "--out", str(tmp_path / "hf")))
    assert "manifest.json is a character device, not a regular file" in line
