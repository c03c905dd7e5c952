"""The architectures gptj loads, by config.json's `model_type`: the one place that chooses one.

A config names its own (`config.model_type`, as HF's configs do): ARCHITECTURES[config.model_type]
is its architecture. Each entry names its config class (from_hf_dict / to_hf_dict), its build_model, for those whose
module names are not HF's the HF state-dict names (`hf_names(config)`: HF name -> ours), and the
buffers old HF checkpoints of it saved (passed over when read). GPT-J's modules keep HF's names;
Llama's are mapped (models.llama). gptj.weights.io loads every one the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gptj.config import PRESETS as GPTJ_PRESETS
from gptj.config import GPTJConfig
from gptj.errors import ConfigError
from gptj.models import gptj, llama


@dataclass(frozen=True)
class Architecture:
    model_type: str
    config_class: type
    build_model: Callable[..., Any]
    hf_names: Callable[[Any], dict[str, str]] | None  # None: the model's names are HF's
    legacy: tuple[str, ...] = ()  # name suffixes of buffers old HF checkpoints saved (gptj computes them)


ARCHITECTURES: dict[str, Architecture] = {
    "gptj": Architecture("gptj", GPTJConfig, gptj.build_model, None, gptj.LEGACY_BUFFERS),
    "llama": Architecture("llama", llama.LlamaConfig, llama.build_model, llama.hf_names, llama.LEGACY_BUFFERS),
}


def architecture(model_type: Any, source: str = "config") -> Architecture:
    """The architecture of `model_type`; an unknown one is a one-line ConfigError naming the supported."""
    try:
        return ARCHITECTURES[model_type]
    except (KeyError, TypeError):
        supported = ", ".join(repr(t) for t in ARCHITECTURES)
        raise ConfigError(f"{source}: not a GPT-J config: model_type {model_type!r} is not supported "
                          f"(supported: {supported})") from None


PRESETS: dict[str, Any] = {**GPTJ_PRESETS, **llama.PRESETS}  # every preset `gptj init` writes


def get_preset(name: str) -> Any:
    """A GPT-J or a Llama preset by name; one-line ConfigError naming them all."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})") from None
