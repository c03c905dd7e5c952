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
from typing import Any

from gptj.errors import ConfigError


@dataclass(frozen=True)
class GPTJConfig:
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.rotary_dim is not None:
            if not isinstance(self.rotary_dim, int) or self.rotary_dim <= 0 or self.rotary_dim % 2:
                raise ConfigError(f"rotary_dim must be a positive even integer, got {self.rotary_dim!r}")
            if self.rotary_dim > self.head_dim:
                raise ConfigError(f"rotary_dim ({self.rotary_dim}) exceeds head_dim ({self.head_dim})")
        elif self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner <= 0):
            raise ConfigError(f"n_inner must be a positive integer or null, got {self.n_inner!r}")
        if not (isinstance(self.layer_norm_epsilon, (int, float)) and self.layer_norm_epsilon > 0):
            raise ConfigError(f"layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

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
            "model_type": "gptj",
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
            if f.name == "quantization" and value is None:
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
                kwargs[key] = kwargs[key][0]
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> GPTJConfig:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read ({e})") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON ({e})") from None
        return cls.from_hf_dict(d, source=str(path))

    def to_json_string(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2) + "\n"


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
