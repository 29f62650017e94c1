"""Per-layer parameters, FLOPs and activations against the published closed forms."""

from dataclasses import replace

import pytest

from potluck.model import counts, load_model
from potluck.model.counts import Recompute


def test_gpt_flops_equal_narayanan_eq3():
    """72 B s l h^2 (1 + s/(6h) + V/(12 l h)) training FLOPs per iteration (SC'21, Eq. 3)."""
    m = load_model("gpt3-175b")
    b, s, layers, h, v = 1, 2048, m.num_layers, m.hidden_size, m.vocab_size
    expected = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert counts.model_flops_per_token(m, s) * s * b == pytest.approx(expected, rel=1e-12)


def test_gpt_parameters_equal_narayanan_eq2_up_to_biases_and_norms():
    m = load_model("gpt3-13b")
    layers, h, v, s = m.num_layers, m.hidden_size, m.vocab_size, m.max_seq_len
    eq2 = 12 * layers * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h))
    assert counts.total_params(m) == pytest.approx(eq2, rel=1e-3)


def test_llama_block_counts_gqa_and_swiglu_matrices():
    m = load_model("llama2-70b")  # h=8192, 64 heads, 8 kv heads, f=28672
    h, kv, f = 8192, 1024, 28672
    assert counts.attention_params(m) == 2 * h * h + 2 * h * kv
    assert counts.mlp_params(m) == 3 * h * f
    assert counts.block_params(m) == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h


def test_tied_embeddings_count_once_unless_split_over_stages():
    m = load_model("qwen2.5-0.5b")
    projection = m.vocab_size * m.hidden_size
    assert counts.head_params(m) == counts.norm_params(m)
    assert counts.head_params(m, separate_from_embedding=True) == counts.norm_params(m) + projection
    untied = replace(m, tied_embeddings=False)
    assert counts.total_params(untied) - counts.total_params(m) == projection


def test_gpt_activations_equal_korthikanti_table_2():
    m = load_model("gpt3-175b")
    s, b, h, a = 2048, 1, m.hidden_size, m.num_heads
    full = s * b * h * (34 + 5 * a * s / h)
    assert counts.block_activation_bytes(m, b, s, 1, Recompute.NONE, fused=True) == pytest.approx(full)
    assert counts.block_activation_bytes(m, b, s, 1, Recompute.SELECTIVE, fused=True) == pytest.approx(
        34 * s * b * h)
    assert counts.block_activation_bytes(m, b, s, 1, Recompute.FULL) == pytest.approx(2 * s * b * h)
    t = 8  # tensor + sequence parallel divides everything by t
    assert counts.block_activation_bytes(m, b, s, t, Recompute.NONE, fused=True) == pytest.approx(
        full / t)


def test_gqa_and_no_dropout_shrink_llama_activations():
    m = load_model("llama2-70b")
    terms = counts.block_activation_terms(m)
    f_over_h = 28672 / 8192
    # QKV input 2, Q 2, K and V 2 each at kv/h = 1/8, output-projection input 2, no masks
    attention = 2 + 2 + 4 / 8 + 2
    mlp = 2 + 8 * f_over_h
    assert terms.per_sbh == pytest.approx(attention + mlp + 4)
    assert terms.per_as2b == 2


def test_the_attention_core_is_4bs2h_flops():
    """Q K^T and the scores times V: 2 x 2 b s^2 h (what selective recomputation redoes)."""
    m = load_model("gpt3-1.3b")
    b, s = 2, 1024
    assert counts.attention_core_forward_flops(m, b, s) == 4 * b * s * s * m.hidden_size


def _saved_elements_per_block(spec, attn: str, b: int, s: int) -> float:
    """Elements the second block of a Hugging Face model saves for backward in FP32 on CPU
    (saved_tensors_hooks; deduplicated by storage, parameters and their views excluded)."""
    import torch

    from potluck.runtime.models.adapters import blocks_of, detect_family
    from potluck.runtime.models.build import build_model, materialize

    model = build_model(spec, attn)
    materialize([model], torch.device("cpu"), 0)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x):
        key = x.untyped_storage()._cdata
        if key not in params:
            seen.setdefault(key, x.untyped_storage().nbytes())
        return x

    block = blocks_of(model, detect_family(model))[1]
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x)
    block.register_forward_pre_hook(lambda *_: hooks.__enter__())
    block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    model(torch.randint(0, spec.vocab_size, (b, s)))
    return sum(seen.values()) / 4


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_eager_counts_are_what_hugging_face_blocks_save(family, attn):
    """Every term of the eager count, against the tensors autograd keeps; a block measured
    alone also saves the rotary tables every block shares (the eager embedding term)."""
    from dataclasses import replace

    from potluck.model.spec import PRESETS

    if family == "llama":
        spec = replace(PRESETS["tiny-llama"], hidden_size=48, ffn_hidden_size=80, num_heads=4,
                       num_kv_heads=2, max_seq_len=64)
    else:
        spec = replace(PRESETS["tiny-gpt2"], hidden_size=48, ffn_hidden_size=192, num_heads=4,
                       num_kv_heads=4, max_seq_len=64, dropout=False)
    b, s = 2, 24
    expected = counts.eager_block_activation_elements(spec, b, s, Recompute.NONE,
                                                      flash_attention=attn == "sdpa")
    expected += counts.embedding_activation_bytes(spec, b, s, 1) / 2  # 16-bit bytes: 2 each
    assert _saved_elements_per_block(spec, attn, b, s) == pytest.approx(expected, rel=1e-9)
