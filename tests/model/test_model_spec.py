"""Model shapes from presets, HF config.json files and model directories."""

import json

import pytest

from potluck.errors import ConfigError
from potluck.model import MlpKind, load_model, model_from_hf_config, total_params


@pytest.mark.parametrize(
    ("name", "published_b"),
    [("llama2-7b", 6.74), ("llama2-13b", 13.0), ("llama2-70b", 69.0), ("llama3-8b", 8.03),
     ("llama3-70b", 70.6), ("qwen2.5-0.5b", 0.494), ("qwen2.5-7b", 7.62),
     ("qwen2.5-72b", 72.7), ("gpt3-175b", 174.6), ("gpt3-1.3b", 1.3)],
)
def test_preset_parameter_counts_match_published_sizes(name, published_b):
    assert total_params(load_model(name)) / 1e9 == pytest.approx(published_b, rel=0.015)


def test_gpt3_family_covers_125m_to_175b():
    sizes = [total_params(load_model(n)) for n in
             ("gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b",
              "gpt3-13b", "gpt3-175b")]
    assert sizes == sorted(sizes)
    assert sizes[0] / 1e9 == pytest.approx(0.125, rel=0.05)


LLAMA_CONFIG = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False,
}
GPT2_CONFIG = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
               "vocab_size": 50257, "n_positions": 1024}


def test_llama_config_keys_give_the_same_model_as_the_preset():
    spec = model_from_hf_config(LLAMA_CONFIG, "llama3")
    assert total_params(spec) == total_params(load_model("llama3-8b"))
    assert spec.num_kv_heads == 8 and spec.mlp is MlpKind.SWIGLU


def test_gpt2_config_keys():
    spec = model_from_hf_config(GPT2_CONFIG, "gpt2")
    assert spec.mlp is MlpKind.GELU and spec.tied_embeddings and spec.ffn_hidden_size == 3072
    assert total_params(spec) == 124_439_808  # the published GPT-2 small count


def test_qwen2_and_mistral_configs_are_read():
    qwen = dict(LLAMA_CONFIG, model_type="qwen2", tie_word_embeddings=True)
    mistral = dict(LLAMA_CONFIG, model_type="mistral")
    assert model_from_hf_config(qwen).qkv_bias and model_from_hf_config(qwen).tied_embeddings
    assert model_from_hf_config(mistral).family == "mistral"


def test_config_file_and_model_directory(tmp_path):
    directory = tmp_path / "my-model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    from_dir = load_model(str(directory))
    from_file = load_model(str(directory / "config.json"))
    assert from_dir == from_file and from_dir.name == "my-model"
    assert from_dir.hf_config == LLAMA_CONFIG


def test_a_bare_config_json_is_named_after_its_folder(tmp_path, monkeypatch):
    directory = tmp_path / "gpt2-medium"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    monkeypatch.chdir(directory)
    assert load_model("config.json").name == "gpt2-medium"
    assert load_model("./config.json").name == "gpt2-medium"


def test_a_config_file_of_another_name_is_named_after_its_stem(tmp_path):
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(LLAMA_CONFIG))
    assert load_model(str(path)).name == "tiny-llama"


def test_unknown_model_suggests_presets():
    with pytest.raises(ConfigError, match="llama2-7b"):
        load_model("llama2-7")


def test_a_missing_model_path_says_not_found_not_unknown_preset(tmp_path):
    with pytest.raises(ConfigError, match="not found") as info:
        load_model(str(tmp_path / "no-such-model" / "config.json"))
    assert "preset (" not in str(info.value)
    with pytest.raises(ConfigError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unsupported_config_is_one_clear_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    with pytest.raises(ConfigError, match="encoder-decoder"):
        load_model(str(path))


def test_heads_must_divide_hidden_size():
    with pytest.raises(ConfigError, match="hidden_size"):
        model_from_hf_config(dict(LLAMA_CONFIG, num_attention_heads=30))


@pytest.mark.parametrize(("name", "close"), [
    ("llama2-7", "did you mean llama2-7b, llama2-70b, llama3-70b? give a preset, a config.json"),
    ("qwen2.5-7", "did you mean qwen2.5-7b, qwen2.5-72b,"),
])
def test_a_mistyped_model_name_shows_the_closest_presets_not_all_of_them(name, close):
    with pytest.raises(ConfigError) as err:
        load_model(name)
    assert close in str(err.value) and "gemma2-27b" not in str(err.value)


def test_a_name_like_no_preset_lists_them_all():
    with pytest.raises(ConfigError, match=r"give a preset \(gemma2-27b, .*tiny-llama\)"):
        load_model("zzzz")
