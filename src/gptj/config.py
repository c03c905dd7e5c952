"""GPTJConfig: the model's shape, read from and written to HF's config.json.

The field names are HF's (`n_embd`, `n_layer`, ...) so a config.json written by
gptj is one that `transformers.GPTJConfig` reads, and vice versa.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from gptj.errors import ConfigError

# Upper bounds: what a GPT-J can be, generously. They exist so that a config.json alone cannot make
# gptj build or allocate something absurd (n_layer 10^9: a table of 10^10 tensor names; n_positions
# 10^10: an 80 GB rope table) before the checkpoint is even opened. Each is far above any real model.
MAX_LAYERS = 1024  # GPT-J 6B has 28; the deepest published dense transformers ~100-200
MAX_EMBD = 1 << 16  # GPT-J 4096; the widest published dense models ~18-25k
MAX_INNER = 1 << 18  # 4 x MAX_EMBD (GPT-J: n_inner = 4 n_embd)
MAX_VOCAB = 1 << 20  # GPT-J 50400; the largest LLM vocabularies ~256k
# n_positions sizes one buffer outright, the float32 rope table (n_positions x rope_dim, model.rope_table;
# the KV cache and causal masks follow the request's length, capped by it). A million positions is 512
# times GPT-J's 2048, past any context dense attention serves; the table is also held to 1 GiB.
MAX_POSITIONS = 1 << 20
MAX_ROPE_TABLE_BYTES = 1 << 30


def is_int(value: Any) -> bool:
    """An int that is an int: not a bool, not a float like 28.0, not a string."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int, high: int, what: str = "") -> None:
    if not is_int(value) or not low <= value <= high:
        raise ConfigError(f"config field {name!r} must be an integer in [{low}, {high}]{what}, got {value!r}")


def validate(c: GPTJConfig) -> None:
    """Every rule a GPTJConfig obeys, checked on construction (config.json, presets, replace()).

    Pure arithmetic on the fields: nothing is built or allocated. Raises ConfigError naming the field.
    """
    check_int("n_layer", c.n_layer, 1, MAX_LAYERS)
    check_int("n_embd", c.n_embd, 1, MAX_EMBD)
    check_int("n_head", c.n_head, 1, c.n_embd)
    check_int("vocab_size", c.vocab_size, 1, MAX_VOCAB)
    check_int("n_positions", c.n_positions, 1, MAX_POSITIONS)
    if c.n_embd % c.n_head:
        raise ConfigError(f"config field 'n_embd' ({c.n_embd}) must be divisible by n_head ({c.n_head})")
    head_dim = c.n_embd // c.n_head
    if c.rotary_dim is not None:
        if not is_int(c.rotary_dim) or c.rotary_dim <= 0 or c.rotary_dim % 2:
            raise ConfigError(f"config field 'rotary_dim' must be a positive even integer, got {c.rotary_dim!r}")
        if c.rotary_dim > head_dim:
            raise ConfigError(f"config field 'rotary_dim' ({c.rotary_dim}) exceeds head_dim ({head_dim} = "
                              f"n_embd / n_head)")
    elif head_dim % 2:
        raise ConfigError(f"config field 'rotary_dim' is null (rotary over the whole head) but head_dim "
                          f"({head_dim}) is odd; rotary embeddings need an even size")
    rope_dim = c.rotary_dim if c.rotary_dim is not None else head_dim
    if c.n_positions * rope_dim * 4 > MAX_ROPE_TABLE_BYTES:
        raise ConfigError(f"config field 'n_positions' ({c.n_positions}) x rotary dims ({rope_dim}) would need a "
                          f"rope table over {MAX_ROPE_TABLE_BYTES >> 30} GiB (float32)")
    if c.n_inner is not None:
        check_int("n_inner", c.n_inner, 1, MAX_INNER, " or null")
    eps = c.layer_norm_epsilon
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps <= 1:  # NaN / inf fail too
        raise ConfigError(f"config field 'layer_norm_epsilon' must be a number in (0, 1], got {eps!r}")
    inside = f" (a token id below vocab_size {c.vocab_size})"
    check_int("bos_token_id", c.bos_token_id, 0, c.vocab_size - 1, inside)
    check_int("eos_token_id", c.eos_token_id, 0, c.vocab_size - 1, inside)
    if c.pad_token_id is not None:
        check_int("pad_token_id", c.pad_token_id, 0, c.vocab_size - 1, inside + " or null")
    check_records(c)


def check_records(c: Any) -> None:
    """A config's `quantization` and `calibration` entries (any architecture's): objects, or absent."""
    for name in ("quantization", "calibration"):
        value = getattr(c, name)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"config field {name!r} must be an object or absent, got {value!r}")


@dataclass(frozen=True)
class GPTJConfig:
    model_type: ClassVar[str] = "gptj"  # config.json's, as HF's; gptj.models.registry maps it to the model
    vocab_size: int = 50400
    n_positions: int = 2048
    n_embd: int = 4096
    n_layer: int = 28
    n_head: int = 16
    rotary_dim: int | None = 64  # None: rotary over the whole head (HF semantics)
    n_inner: int | None = None  # None: 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    bos_token_id: int = 50256
    eos_token_id: int = 50256
    pad_token_id: int | None = None
    # Quantization recorded in the checkpoint (None for plain weights); set by later tools.
    quantization: dict[str, Any] | None = None
    # W8A8 calibration of a float checkpoint (its factors in calibration.safetensors; gptj.quant.calibrate).
    calibration: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        validate(self)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_kv_head(self) -> int:
        """Key/value heads: GPT-J's attention has one per query head (Llama's grouped-query attention fewer)."""
        return self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def rope_dim(self) -> int:
        """Dims of each head that get rotary embeddings."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    def replace(self, **changes: Any) -> GPTJConfig:
        return dataclasses.replace(self, **changes)

    # --- HF config.json ---------------------------------------------------------

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["GPTJForCausalLM"],
            "model_type": self.model_type,
            "activation_function": "gelu_new",
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
            "initializer_range": 0.02,
            "tie_word_embeddings": False,
            "use_cache": True,
        }
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("quantization", "calibration") and value is None:
                continue
            d[f.name] = value
        d["rotary_dim"] = self.rope_dim  # HF 5 wants an int; rotary over the whole head is rotary_dim = head_dim
        return dict(sorted(d.items()))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config") -> GPTJConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        model_type = d.get("model_type")
        if model_type != "gptj":
            raise ConfigError(f"{source}: not a GPT-J config (model_type is {model_type!r}, expected 'gptj')")
        act = d.get("activation_function", "gelu_new")
        if act != "gelu_new":
            raise ConfigError(f"{source}: activation_function {act!r} is not supported (GPT-J uses 'gelu_new')")
        if d.get("tie_word_embeddings", False):
            raise ConfigError(f"{source}: tie_word_embeddings=true is not GPT-J (its lm_head is untied)")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        # HF aliases, in case a config was written with the generic names.
        for alias, name in (("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"),
                            ("num_attention_heads", "n_head"), ("max_position_embeddings", "n_positions")):
            if alias in d and name not in d:
                kwargs[name] = d[alias]
        for key in ("eos_token_id", "bos_token_id"):
            if isinstance(kwargs.get(key), list):  # HF allows a list of EOS ids; GPT-J has one
                if not kwargs[key]:
                    raise ConfigError(f"{source}: config field {key!r} is an empty list")
                kwargs[key] = kwargs[key][0]
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> GPTJConfig:
        return cls.from_hf_dict(read_json(path), source=str(path))

    def to_json_string(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2) + "\n"


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in the file `path` (a config.json); a one-line ConfigError when it cannot be read."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


def check_layer_count(config: GPTJConfig, held: int, source: str, listing: object) -> None:
    """n_layer must be the number of layers the checkpoint holds (`held`, counted from the tensor names
    `listing` gives, before any weight is read): one error naming both numbers, whichever is larger."""
    if held != config.n_layer:
        raise ConfigError(f"{source}: config field 'n_layer' is {config.n_layer} but the checkpoint holds {held} "
                          f"layers ({listing})")


PRESETS: dict[str, GPTJConfig] = {
    # EleutherAI's GPT-J 6B: 6,050,882,784 parameters.
    "gptj-6b": GPTJConfig(),
    # Small models for demos and tests; the real vocabulary so the tokenizer applies.
    "tiny": GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=256, n_positions=2048),
    "small": GPTJConfig(n_layer=4, n_embd=256, n_head=8, rotary_dim=16, n_inner=1024, n_positions=2048),
}


def get_preset(name: str) -> GPTJConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})") from None
