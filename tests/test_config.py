"""GPTJConfig: presets, HF config.json in and out, validation."""

import json

import pytest
import transformers

from gptj.config import PRESETS, GPTJConfig, get_preset
from gptj.errors import ConfigError


def test_gptj_6b_preset_is_the_released_model():
    c = get_preset("gptj-6b")
    assert (c.n_layer, c.n_embd, c.n_head, c.head_dim, c.rotary_dim, c.inner_dim) == (28, 4096, 16, 256, 64, 16384)
    assert (c.vocab_size, c.n_positions, c.layer_norm_epsilon, c.bos_token_id, c.eos_token_id) == (
        50400, 2048, 1e-5, 50256, 50256)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_reads_what_we_write_and_back(tmp_path, name):
    ours = get_preset(name)
    (tmp_path / "config.json").write_text(ours.to_json_string())
    theirs = transformers.GPTJConfig.from_pretrained(tmp_path)
    assert (theirs.n_layer, theirs.n_embd, theirs.n_head, theirs.rotary_dim, theirs.vocab_size) == (
        ours.n_layer, ours.n_embd, ours.n_head, ours.rotary_dim, ours.vocab_size)
    assert theirs.tie_word_embeddings is False
    theirs.save_pretrained(tmp_path / "hf")
    assert GPTJConfig.from_json_file(tmp_path / "hf" / "config.json") == ours


def test_full_head_rotary_is_written_as_head_dim():
    c = GPTJConfig(n_embd=64, n_head=4, rotary_dim=None)
    assert c.rope_dim == 16 and c.to_hf_dict()["rotary_dim"] == 16


@pytest.mark.parametrize("changes, message", [
    ({"n_head": 5}, "divisible"),
    ({"rotary_dim": 7}, "even"),
    ({"rotary_dim": 4096}, "exceeds head_dim"),
    ({"n_layer": 0}, "n_layer"),
    ({"vocab_size": "big"}, "vocab_size"),
    ({"layer_norm_epsilon": -1.0}, "layer_norm_epsilon"),
])
def test_invalid_values_are_named(changes, message):
    with pytest.raises(ConfigError, match=message):
        GPTJConfig(**changes)


def test_hf_dict_errors_name_the_source():
    with pytest.raises(ConfigError, match="cfg.json: not a GPT-J config"):
        GPTJConfig.from_hf_dict({"model_type": "llama"}, source="cfg.json")
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        GPTJConfig.from_hf_dict({"model_type": "gptj", "tie_word_embeddings": True})
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        get_preset("huge")
    assert GPTJConfig.from_hf_dict(json.loads(get_preset("tiny").to_json_string())) == get_preset("tiny")
