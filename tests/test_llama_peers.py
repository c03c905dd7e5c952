"""benchmarks/llama_peers.py's GGUF export: its tensor names, the Q/K row permutation and rope factors that
llama.cpp's llama architecture needs, and (where gguf and llama_cpp are installed; the CI installs
neither) llama.cpp's float32 logits on an exported small Llama against gptj's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from gptj.models.llama import LlamaConfig, Llama3RopeScaling, apply_rotary, hf_names, rope_frequencies, rotary_tables

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    import llama_peers
finally:
    sys.path.remove(str(BENCH))

HAS_GGUF = importlib.util.find_spec("gguf") is not None
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason="gguf is not installed (pip install gguf)")
needs_llama_cpp = pytest.mark.skipif(not (HAS_GGUF and HAS_LLAMA_CPP),
                                     reason="gguf and llama_cpp are not both installed (pip install gguf "
                                            "llama-cpp-python)")

# head_dim 16, theta 1e4, original context 64: its 8 rope wavelengths (6.3 to 2.8e4) fall in all three llama3
# bands (kept below 16, blended 16..64, slowed 8x above)
SMALL = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=128,
                    rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_max_position_embeddings=64),
                    bos_token_id=0, eos_token_ids=(1,))


def test_every_hf_tensor_has_one_gguf_name():
    names = llama_peers.gguf_names(SMALL)
    assert set(names) == set(hf_names(SMALL))
    assert len(set(names.values())) == len(names)
    assert names["model.layers.1.self_attn.k_proj.weight"] == "blk.1.attn_k.weight"
    assert names["model.layers.0.mlp.down_proj.weight"] == "blk.0.ffn_down.weight"
    assert names["model.layers.0.post_attention_layernorm.weight"] == "blk.0.ffn_norm.weight"
    assert names["lm_head.weight"] == "output.weight" and names["model.norm.weight"] == "output_norm.weight"
    tied = llama_peers.gguf_names(SMALL.replace(tie_word_embeddings=True))
    assert "lm_head.weight" not in tied and set(tied) == set(names) - {"lm_head.weight"}


def test_rotary_pairs_round_trip_and_move_whole_heads():
    w = torch.randn(4 * 8, 5)
    p = llama_peers.to_rotary_pairs(w, 4)
    assert torch.equal(llama_peers.from_rotary_pairs(p, 4), w)
    assert not torch.equal(p, w)
    # row 2i of a head is HF row i, row 2i + 1 is HF row i + D/2 (D = 8), head by head
    assert torch.equal(p[8 + 2 * 1], w[8 + 1]) and torch.equal(p[8 + 2 * 1 + 1], w[8 + 1 + 4])


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """llama.cpp's LLM_ARCH_LLAMA rope, written out: dims (2i, 2i + 1) turned by pos * base^(-2i/D) / factor_i."""
    D = x.shape[-1]
    base = config.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    factors = llama_peers.rope_factors(config)
    theta = positions[:, None].double() * (base / (1.0 if factors is None else factors.double()))  # (T, D/2)
    c, s = theta.cos().float(), theta.sin().float()
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("scaled", [True, False])
def test_permuted_projection_under_llama_cpp_rope_equals_hf_rope(scaled):
    """q = W x roped as HF does (rotate-half, gptj's llama3 frequencies), rows permuted afterwards, equals
    to_rotary_pairs(W) x roped as llama.cpp does with rope_factors: the export's permutation and rope_freqs
    together give llama.cpp the same q (and k), so the same attention."""
    config = SMALL if scaled else SMALL.replace(rope_scaling=None)
    H, D, E, T = config.num_attention_heads, config.head_dim, config.hidden_size, 40
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(H * D, E, generator=g), torch.randn(T, E, generator=g)
    positions = torch.arange(T)
    cos, sin = rotary_tables(rope_frequencies(config), positions[None], torch.float32)
    hf = apply_rotary((x @ w.T).view(T, H, D).transpose(0, 1)[None], cos, sin)[0]  # (H, T, D)
    hf_rows = llama_peers.to_rotary_pairs(hf.transpose(0, 1).reshape(T, H * D).T, H).T.reshape(T, H, D)
    ours = interleaved_rope((x @ llama_peers.to_rotary_pairs(w, H).T).view(T, H, D), positions[:, None], config)
    assert torch.allclose(ours, hf_rows, atol=1e-4, rtol=1e-4)
    wrong = interleaved_rope((x @ w.T).view(T, H, D), positions[:, None], config)  # unpermuted: differs
    assert not torch.allclose(wrong, hf_rows, atol=1e-2)
    factors = llama_peers.rope_factors(config)
    if scaled:  # llama3: the fastest frequency kept, the slowest slowed by `factor`, some blended between
        assert factors[0] == 1.0 and factors[-1] == pytest.approx(8.0)
        assert ((factors > 1.0) & (factors < 8.0 - 1e-4)).any()
    else:
        assert factors is None


@needs_gguf
def test_gguf_vocab_names_every_id(tmp_path):
    spec = {"model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4},
                      "merges": [["a", "b"]]},
            "added_tokens": [{"id": 0, "content": "<s>", "special": True},
                             {"id": 1, "content": "</s>", "special": True},
                             {"id": 5, "content": "<tool>", "special": False}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokens, types, merges = llama_peers.gguf_vocab(tmp_path, 8)
    import gguf

    assert tokens[:6] == ["<s>", "</s>", "a", "b", "ab", "<tool>"] and tokens[6:] == ["[PAD6]", "[PAD7]"]
    assert types[0] == types[1] == gguf.TokenType.CONTROL and types[2] == gguf.TokenType.NORMAL
    assert types[5] == gguf.TokenType.USER_DEFINED and types[7] == gguf.TokenType.UNUSED
    assert merges == ["a b"]


@needs_llama_cpp
def test_llama_cpp_reproduces_gptj_logits_on_the_export(tmp_path):
    """check_export: llama.cpp's float32 logits on the small exported Llama within the bound of gptj's at
    every position, the same greedy tokens, and exports without the permutation or without rope_freqs
    outside it; the file holds the tensors under GGUF's names, q permuted."""
    import gguf

    check = llama_peers.check_export(tmp_path, threads=1, prompt_len=24, steps=3)
    assert check["export"]["max_abs_dlogit"] <= check["bound"], check["export"]
    assert check["export"]["greedy_equal"] and check["gptj_tokens"] == check["llama_cpp_tokens"]
    assert check["without_permutation"]["max_abs_dlogit"] > check["bound"]
    assert check["without_rope_freqs"]["max_abs_dlogit"] > check["bound"]
    assert check["ok"]

    config = llama_peers.read_llama_config(tmp_path / "check-model")
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "check-export.gguf")).tensors}
    assert set(tensors) == set(llama_peers.gguf_names(config).values()) | {llama_peers.ROPE_FREQS}
    from safetensors.torch import load_file

    hf = load_file(str(tmp_path / "check-model" / "model.safetensors"))
    q = torch.from_numpy(tensors["blk.0.attn_q.weight"].data.copy()).reshape(config.hidden_size, config.hidden_size)
    assert torch.equal(q, llama_peers.to_rotary_pairs(hf["model.layers.0.self_attn.q_proj.weight"],
                                                      config.num_attention_heads))
    assert torch.allclose(torch.from_numpy(tensors[llama_peers.ROPE_FREQS].data.copy()),
                          llama_peers.rope_factors(config))


@needs_llama_cpp
def test_direct_q8_0_export_holds_what_llama_quantize_makes(tmp_path):
    """--direct-export's Q8_0 file (the gguf package's quantizer, straight from the folder) holds every
    tensor llama-quantize's Q8_0 of the BF16 export holds, of the same type, with the same bytes (the
    folder's weights are bfloat16, so the BF16 file loses nothing on the way)."""
    import gguf

    folder = llama_peers.write_check_model(tmp_path / "model", dtype=torch.bfloat16)
    bf16 = llama_peers.export_gguf(folder, tmp_path / "bf16.gguf", "bf16")
    theirs = llama_peers.quantize_gguf(bf16, tmp_path / "llama-quantize.gguf", "q8_0", threads=1)
    ours = llama_peers.export_gguf(folder, tmp_path / "direct.gguf", "q8_0")
    a = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    assert set(a) == set(b)
    assert {t.tensor_type for t in b.values()} >= {gguf.GGMLQuantizationType.Q8_0}
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert list(a[name].shape) == list(b[name].shape), name
        assert (a[name].data == b[name].data).all(), name
