"""Sharded checkpoints: save under one plan, load under another, exact tensors back.

The multi-rank tests spawn gloo processes (see dist_harness.py); the models
and workers are in ckpt_layouts.py.
"""

from __future__ import annotations

from pathlib import Path

import ckpt_layouts as layouts
import pytest
import torch
from dist_harness import run_ranks

from potluck.errors import ConfigError
from potluck.runtime.checkpoints.storage import (
    MARKER,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    newest_verified,
    prune_checkpoints,
    read_trainer_state,
    resume_checkpoint,
    save_checkpoint,
    training_state,
)


def _loaded_keys(out_dir: Path, layout: str) -> set[str]:
    keys: set[str] = set()
    for file in out_dir.glob(f"loaded_keys_{layout}_rank*.pt"):
        keys.update(torch.load(file))
    return keys


def _saved_keys(out_dir: Path) -> set[str]:
    keys: set[str] = set()
    for file in out_dir.glob("saved_rank*.pt"):
        keys.update(torch.load(file, weights_only=False))
    return keys


def test_two_pipeline_stages_save_and_one_process_loads_everything(tmp_path: Path):
    run_ranks(layouts.save_worker, 2, "pp", tmp_path)
    path = latest_checkpoint(tmp_path)
    assert path == checkpoint_path(tmp_path, 3)
    assert read_trainer_state(path) == {"step": 3, "layout": "pp"}
    layouts.load("full", 0, 1, tmp_path)
    assert _loaded_keys(tmp_path, "full") == _saved_keys(tmp_path)
    assert any("model.layers.0." in k for k in _saved_keys(tmp_path))
    assert any("model.layers.3." in k for k in _saved_keys(tmp_path))


def test_one_process_saves_and_two_pipeline_stages_load_their_halves(tmp_path: Path):
    layouts.save("full", 0, 1, tmp_path)
    run_ranks(layouts.load_worker, 2, "pp", tmp_path)
    assert _loaded_keys(tmp_path, "pp") == _saved_keys(tmp_path)


def test_tensor_parallel_shards_reload_as_pipeline_stages(tmp_path: Path):
    run_ranks(layouts.save_then_load, 2, "tp", "pp", tmp_path)
    assert _loaded_keys(tmp_path, "pp") == _saved_keys(tmp_path)


def test_pipeline_stages_reload_as_tensor_parallel_shards(tmp_path: Path):
    run_ranks(layouts.save_then_load, 2, "pp", "tp", tmp_path)
    assert _loaded_keys(tmp_path, "tp") == _saved_keys(tmp_path)


def _shard_bytes(out_dir: Path) -> int:
    return sum(f.stat().st_size for f in checkpoint_path(out_dir, 3).glob("*.safetensors"))


def test_data_parallel_replicas_are_written_once_and_reload_as_stages(tmp_path: Path):
    run_ranks(layouts.save_then_load, 2, "dp", "pp", tmp_path / "dp")
    assert _loaded_keys(tmp_path / "dp", "pp") == _saved_keys(tmp_path / "dp")
    layouts.save("full", 0, 1, tmp_path / "single")
    assert _shard_bytes(tmp_path / "dp") < 1.1 * _shard_bytes(tmp_path / "single")


def test_uneven_pipeline_and_heterogeneous_replicas_load_each_other(tmp_path: Path):
    """pp=[1,1,2] <-> dp=2 with a tp=2 replica on ranks 0-1 and a plain one on rank 2."""
    run_ranks(layouts.hetero_round_trip, 3, tmp_path)
    assert _loaded_keys(tmp_path, "hetero") == _saved_keys(tmp_path)
    assert _loaded_keys(tmp_path, "pp") == _saved_keys(tmp_path)


def test_a_rank_asking_for_another_shape_fails_on_every_rank_without_hanging(tmp_path: Path):
    run_ranks(layouts.mismatch_worker, 2, tmp_path, timeout_s=60)


def test_loading_a_key_the_checkpoint_lacks_is_a_config_error(tmp_path: Path):
    save_checkpoint(tmp_path, 1, {"model": {"a": torch.zeros(2)}}, {"step": 1})
    with pytest.raises(ConfigError, match="it has no tensor 'model.b'"):
        load_checkpoint(latest_checkpoint(tmp_path), {"model": {"b": torch.zeros(2)}})


def test_latest_checkpoint_skips_partial_and_unmarked_directories(tmp_path: Path):
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(ConfigError, match="nothing to resume"):
        resume_checkpoint(tmp_path)
    save_checkpoint(tmp_path, 2, {"x": torch.ones(3)}, {"step": 2})
    root = tmp_path / "checkpoints"
    (root / "step_000009.partial").mkdir()
    (root / "step_000009.partial" / MARKER).write_text("{}")
    (root / "step_000007").mkdir()
    (root / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == root / "step_000002"
    assert resume_checkpoint(tmp_path) == root / "step_000002"
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        load_checkpoint(root / "step_000007", {"x": torch.zeros(3)})


def test_saving_the_same_step_again_replaces_it(tmp_path: Path):
    save_checkpoint(tmp_path, 4, {"x": torch.ones(3)}, {"run": 1})
    save_checkpoint(tmp_path, 4, {"x": torch.full((3,), 2.0)}, {"run": 2})
    state = {"x": torch.zeros(3)}
    assert load_checkpoint(latest_checkpoint(tmp_path), state) == {"run": 2}
    assert state["x"].tolist() == [2.0, 2.0, 2.0]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000004"]


def test_trainer_state_that_is_not_json_fails_before_anything_is_written(tmp_path: Path):
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, {"x": torch.ones(1)}, {"when": object()})
    assert not (tmp_path / "checkpoints").exists()


def test_prune_keeps_the_newest(tmp_path: Path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"x": torch.ones(1) * step}, {"step": step})
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step_000001"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000002", "step_000003"]


def test_prune_never_deletes_the_checkpoint_known_good(tmp_path: Path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"x": torch.ones(1) * step}, {"step": step})
    removed = prune_checkpoints(tmp_path, keep_last=2, keep=checkpoint_path(tmp_path, 1))
    assert [p.name for p in removed] == ["step_000002"]


def test_a_damaged_file_on_the_rank_that_hashes_it_fails_every_rank_alike(tmp_path: Path):
    run_ranks(layouts.damaged_file_worker, 2, tmp_path, timeout_s=60)


def test_a_stray_safetensors_file_is_refused_before_anything_is_read(tmp_path: Path):
    """The safetensors reader reads every *.safetensors file in the directory."""
    from safetensors.torch import save_file

    save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(3)}}, {"step": 1})
    save_file({"model.w": torch.full((3,), 7.0)}, str(checkpoint_path(tmp_path, 1) / "extra.safetensors"))
    with pytest.raises(ConfigError, match="extra.safetensors is not one of the files it was saved with"):
        load_checkpoint(latest_checkpoint(tmp_path), {"model": {"w": torch.zeros(3)}})


def test_the_newest_checkpoint_that_verifies_is_used_and_the_damaged_one_named(tmp_path: Path, caplog):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"model": {"w": torch.ones(3) * step}}, {"step": step})
    (checkpoint_path(tmp_path, 2) / "values.json").write_text("[]\n")  # as long as "{}\n"
    with caplog.at_level("WARNING"):
        assert newest_verified(tmp_path) == checkpoint_path(tmp_path, 1)
    assert "step_000002 cannot be used: values.json does not match its sha256" in caplog.text
    assert "using step_000001 instead" in caplog.text
    (checkpoint_path(tmp_path, 1) / "manifest.json").unlink()
    with pytest.raises(ConfigError, match=r"step_000002 cannot be used: values.json .*\(nor can the 1 "
                                          r"older one\)"):
        resume_checkpoint(tmp_path)


def test_tied_and_strided_tensors_round_trip(tmp_path: Path):
    """safetensors refuses tensors that share memory (GPT-2's tied embedding and head) and
    non-contiguous ones; the checkpoint writes copies and loads both names back."""
    from transformers import AutoModelForCausalLM

    from potluck.model.hf import hf_config_for
    from potluck.model.spec import PRESETS

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config_for(PRESETS["tiny-gpt2"]))
    state = training_state([model], [torch.optim.AdamW(model.parameters())])
    tied = state["model"]["lm_head.weight"], state["model"]["transformer.wte.weight"]
    assert tied[0].data_ptr() == tied[1].data_ptr()
    state["model"]["strided"] = torch.arange(12.0).reshape(3, 4).t()
    save_checkpoint(tmp_path, 1, state, {"step": 1})
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    load_checkpoint(latest_checkpoint(tmp_path), loaded)
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value), key


def test_plain_values_come_back_with_their_types_or_are_refused_before_loading(tmp_path: Path):
    save_checkpoint(tmp_path, 1, {"optim": {"w": torch.ones(2), "betas": (0.9, 0.95), "lr": 1,
                                            "foreach": None}}, {"step": 1})
    state = {"optim": {"w": torch.zeros(2), "betas": (0.1, 0.2), "lr": 0.5, "foreach": True}}
    load_checkpoint(latest_checkpoint(tmp_path), state)
    assert state["optim"] == {"w": state["optim"]["w"], "betas": (0.9, 0.95), "lr": 1.0,
                              "foreach": None}
    assert isinstance(state["optim"]["lr"], float) and state["optim"]["w"].tolist() == [1.0, 1.0]
    wrong = {"optim": {"w": torch.zeros(2), "betas": "fast"}}
    with pytest.raises(ConfigError, match="value 'optim.betas' is a list, this run has a str"):
        load_checkpoint(latest_checkpoint(tmp_path), wrong)
    assert wrong["optim"]["w"].tolist() == [0.0, 0.0], "refused only after loading tensors"


GROUP = "optim.param_groups.w"  # how the flattened optimizer state keys a parameter's group


@pytest.mark.parametrize(("setting", "value", "wanted"), [
    ("lr", float("nan"), "a finite number of at least 0"), ("lr", -1.0, "at least 0"),
    ("eps", -1.0, "at least 0"), ("weight_decay", float("inf"), "finite"),
    ("foreach", "yes", "true or false"), ("betas", [1.5, 0.9], "two finite numbers in [0, 1)"),
])
def test_optimizer_settings_no_optimizer_steps_with_are_refused_before_loading(
        tmp_path: Path, setting: str, value, wanted: str):
    from potluck.runtime.checkpoints.storage import UnusableCheckpoint

    good = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "foreach": None, "betas": (0.9, 0.95)}
    saved = {**good, setting: value}
    save_checkpoint(tmp_path, 1, {"optim": {"w": torch.ones(2), "param_groups": {"w": saved}}},
                    {"step": 1})
    live = {"optim": {"w": torch.zeros(2), "param_groups": {"w": dict(good)}}}
    with pytest.raises(UnusableCheckpoint) as err:
        load_checkpoint(latest_checkpoint(tmp_path), live)
    assert f"'{GROUP}.{setting}' is" in str(err.value) and wanted in str(err.value)
    assert live["optim"]["w"].tolist() == [0.0, 0.0], "refused before loading tensors"


def test_a_tensor_that_is_not_finite_is_named_and_not_resumed(tmp_path: Path):
    from potluck.runtime.checkpoints.storage import UnusableCheckpoint

    save_checkpoint(tmp_path, 1, {"model": {"w": torch.tensor([1.0, float("nan")])}}, {"step": 1})
    with pytest.raises(UnusableCheckpoint, match="cannot be resumed: model.w holds inf or NaN"):
        load_checkpoint(latest_checkpoint(tmp_path), {"model": {"w": torch.zeros(2)}})
