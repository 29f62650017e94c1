"""Export to a Hugging Face directory that transformers reloads with equal logits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import ckpt_layouts as layouts
import pytest
import torch
from dist_harness import run_ranks
from transformers import AutoModelForCausalLM

from potluck.errors import ConfigError
from potluck.model.hf import hf_config_for
from potluck.model.loading import model_from_hf_config
from potluck.model.spec import PRESETS, ModelSpec, model_to_dict
from potluck.runtime.checkpoints.export import (
    export_checkpoint,
    export_hf,
    export_run,
    merge_state_dicts,
)
from potluck.runtime.checkpoints.storage import latest_checkpoint, save_checkpoint, training_state

TINY_QWEN_TIED = replace(PRESETS["tiny-llama"], name="tiny-qwen2", family="qwen2",
                         tied_embeddings=True, qkv_bias=True)


def _model(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config_for(spec)).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 260, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _split_by_layer(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Two pipeline-stage-like halves, both holding the embedding (as with tied weights)."""
    first = {k: v for k, v in state.items() if ".0." in k or ".1." in k or "embed" in k}
    second = {k: v for k, v in state.items() if k not in first or "embed" in k}
    return [first, second]


@pytest.mark.parametrize("spec", [PRESETS["tiny-llama"], PRESETS["tiny-gpt2"], TINY_QWEN_TIED],
                         ids=lambda s: s.name)
def test_exported_partial_state_dicts_reload_with_equal_logits(tmp_path: Path, spec: ModelSpec):
    source = _model(spec)
    parts = _split_by_layer(dict(source.state_dict()))
    out = export_hf(merge_state_dicts(parts), spec, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(reloaded) is type(source)
    assert torch.equal(_logits(reloaded), _logits(source))
    assert torch.equal(_logits(reloaded), _logits(_model(spec, seed=0)))
    assert not torch.equal(_logits(reloaded), _logits(_model(spec, seed=1)))


def test_export_from_a_checkpoint_reloads_with_equal_logits(tmp_path: Path):
    spec = PRESETS["tiny-llama"]
    source = _model(spec)
    optimizer = torch.optim.AdamW(source.parameters())
    save_checkpoint(tmp_path, 5, training_state([source], [optimizer]), {"step": 5})
    out = export_checkpoint(latest_checkpoint(tmp_path), spec, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert torch.equal(_logits(reloaded), _logits(source))


def _run_with_a_checkpoint(run: Path) -> None:
    spec = PRESETS["tiny-llama"]
    source = _model(spec)
    save_checkpoint(run, 5, training_state([source], [torch.optim.AdamW(source.parameters())]),
                    {"step": 5, "model": model_to_dict(spec)})


def test_export_into_the_run_directory_itself_is_refused(tmp_path: Path):
    _run_with_a_checkpoint(tmp_path)
    for out in (tmp_path, tmp_path / "checkpoints" / "hf"):
        with pytest.raises(ConfigError, match="export to a directory of its own"):
            export_run(tmp_path, out)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000005"]


def test_export_into_a_read_only_folder_is_one_line(tmp_path: Path, read_only_folder: Path):
    _run_with_a_checkpoint(tmp_path / "run")
    with pytest.raises(ConfigError, match=f"cannot create the folder {read_only_folder / 'hf'}: "
                                          "permission denied"):
        export_run(tmp_path / "run", read_only_folder / "hf")


def test_export_keeps_the_training_dtype(tmp_path: Path):
    spec = PRESETS["tiny-llama"]
    source = _model(spec).to(torch.bfloat16)
    out = export_hf(dict(source.state_dict()), spec, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(reloaded.model.embed_tokens.weight, source.model.embed_tokens.weight)


def test_weights_of_another_model_are_refused_before_writing(tmp_path: Path):
    state = dict(_model(PRESETS["tiny-llama"]).state_dict())
    narrower = replace(PRESETS["tiny-llama"], hidden_size=32, ffn_hidden_size=86)
    with pytest.raises(ConfigError, match="weights do not fit model 'tiny-llama'.*the model needs"):
        export_hf(state, narrower, tmp_path / "hf")
    del state["model.norm.weight"]
    with pytest.raises(ConfigError, match=r"missing \['model.norm.weight'\]"):
        export_hf(state, PRESETS["tiny-llama"], tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_merging_replicas_that_disagree_is_an_error():
    with pytest.raises(ValueError, match="differs"):
        merge_state_dicts([{"w": torch.zeros(2)}, {"w": torch.ones(2)}])


def test_export_of_a_two_stage_pipeline_checkpoint_matches_the_whole_model(tmp_path: Path):
    run_ranks(layouts.save_worker, 2, "pp", tmp_path)
    spec = model_from_hf_config(layouts.tiny_llama_config().to_dict(), "tiny-test")
    out = export_checkpoint(latest_checkpoint(tmp_path), spec, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    [whole], _ = layouts.build("full", 0, 1, seed=0)  # same seed and steps as the stages
    assert torch.equal(_logits(reloaded), _logits(whole.eval()))
