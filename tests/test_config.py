"""GPTJConfig: presets, HF config.json in and out, validation."""

import json

import pytest
import transformers

from gptj.config import (
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_ROPE_TABLE_BYTES,
    PRESETS,
    GPTJConfig,
    get_preset,
    validate,
)
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


# Hostile config.json values: each is refused by validation, in one line naming the field and the file,
# before anything is built (n_layer 10^9 used to build a table of 10^10 tensor names; n_positions 10^10
# an 80 GB rope table; bad token ids were accepted silently).
HOSTILE = [
    ({"n_layer": 10**9}, "n_layer"),
    ({"n_layer": True}, "n_layer"),
    ({"n_layer": 2.0}, "n_layer"),
    ({"n_layer": "2"}, "n_layer"),
    ({"n_positions": 10**10}, "n_positions"),
    ({"n_positions": 1e10}, "n_positions"),
    ({"eos_token_id": 10**9}, "eos_token_id"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": []}, "eos_token_id"),
    ({"bos_token_id": 50400}, "bos_token_id"),  # == vocab_size: one past the last id
    ({"pad_token_id": -5}, "pad_token_id"),
    ({"n_embd": 64, "n_head": 5}, "n_embd"),
    ({"n_head": 0}, "n_head"),
    ({"n_embd": 10**9}, "n_embd"),
    ({"n_inner": 1.5}, "n_inner"),
    ({"vocab_size": 10**12}, "vocab_size"),
    ({"rotary_dim": True}, "rotary_dim"),
    ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon"),
    ({"layer_norm_epsilon": True}, "layer_norm_epsilon"),
    ({"quantization": "int8"}, "quantization"),
]


@pytest.mark.parametrize("changes, field", HOSTILE)
def test_hostile_fields_are_refused_in_one_line(changes, field):
    d = json.loads(get_preset("tiny").to_json_string()) | changes
    with pytest.raises(ConfigError) as e:
        GPTJConfig.from_hf_dict(d, source="m/config.json")
    assert str(e.value).startswith(f"m/config.json: config field {field!r}") and "\n" not in str(e.value)


def test_bounds_are_inclusive_and_replace_and_presets_are_validated():
    tiny = get_preset("tiny")
    assert tiny.replace(eos_token_id=tiny.vocab_size - 1).eos_token_id == tiny.vocab_size - 1
    assert tiny.replace(n_layer=MAX_LAYERS).n_layer == MAX_LAYERS  # arithmetic only: nothing is built
    with pytest.raises(ConfigError, match="'n_layer'"):
        tiny.replace(n_layer=MAX_LAYERS + 1)
    with pytest.raises(ConfigError, match="'n_positions'"):
        tiny.replace(n_positions=MAX_POSITIONS + 1)
    # n_positions also bounds the one buffer it sizes alone: the float32 rope table (n_positions x rope_dim).
    wide = GPTJConfig(n_embd=4096, n_head=1, rotary_dim=None, n_positions=MAX_POSITIONS // 64)
    assert wide.n_positions * wide.rope_dim * 4 <= MAX_ROPE_TABLE_BYTES
    with pytest.raises(ConfigError, match="'n_positions'.*rope table"):
        wide.replace(n_positions=MAX_POSITIONS)
    for preset in PRESETS.values():  # presets (and `gptj init`) pass the same rules
        assert validate(preset) is None
