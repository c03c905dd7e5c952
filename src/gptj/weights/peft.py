"""LoRA adapter folders in HF PEFT's format: their config, reading them, and folding one into the
weights it adapts as they are read (gptj.lora holds the modules that train and serve adapters).

A folder holds adapter_config.json (peft_type LORA, r, lora_alpha, lora_dropout, target_modules,
...) and adapter_model.safetensors, whose tensors are named as PEFT names them (`Layout`):
`base_model.model.transformer.h.{i}.{attn|mlp}.{module}.lora_{A|B}.weight` for GPTJForCausalLM,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` for LlamaForCausalLM
(whose adapters gptj folds in at load; it trains and serves unmerged adapters on GPT-J). An adapter adds scale * B @ A to the weight of each linear it adapts, scale =
lora_alpha / r: `merged` computes that sum in float32, and `Adapter.delta` gives it for a weight by its
checkpoint name, so a loader folds the adapter in while it reads the checkpoint (the model is never
built unmerged, and a quantized load quantizes the merged weight).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptj.weights.finite import check_finite
from gptj.errors import GptjError
from gptj.files import model_file

TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out")  # GPT-J's linears in a block
DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for GPT-J
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
KEY = re.compile(r"base_model\.model\.transformer\.h\.(\d+)\.(attn|mlp)\.(\w+)\.lora_([AB])\.weight")
PARENT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "out_proj": "attn", "fc_in": "mlp", "fc_out": "mlp"}


@dataclass(frozen=True)
class Layout:
    """How PEFT names an architecture's adapters: the block linears it may adapt (`targets`, each
    under its `parent`), its tensors' names (`key`: layer, parent, module, A or B) and the checkpoint
    name of the weight each adapts (`prefix` + "{i}.{parent}.{module}.weight", `weight_key` its
    pattern: layer, parent, module)."""

    arch: str
    targets: tuple[str, ...]
    parent: dict[str, str]
    key: re.Pattern
    prefix: str

    @functools.cached_property
    def weight_key(self) -> re.Pattern:
        return re.compile(re.escape(self.prefix) + r"(\d+)\.(\w+)\.(\w+)\.weight")

    def weight_name(self, layer: int, module: str) -> str:
        return f"{self.prefix}{layer}.{self.parent[module]}.{module}.weight"

    def lora_name(self, layer: int, module: str, which: str) -> str:
        """PEFT's name of the adapter matrix `which` ("A" or "B") of `module` in block `layer`."""
        return f"{PREFIX}{self.prefix}{layer}.{self.parent[module]}.{module}.lora_{which}.weight"

    def weight_of(self, name: str) -> tuple[int, str] | None:
        """(layer, module) of the checkpoint weight `name` this layout's adapters may adapt, or None."""
        m = self.weight_key.fullmatch(name)
        if m is None or self.parent.get(m[3]) != m[2]:
            return None
        return int(m[1]), m[3]


_LLAMA_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
LAYOUTS = {
    "gptj": Layout("gptj", TARGETS, PARENT, KEY, "transformer.h."),
    "llama": Layout("llama", tuple(_LLAMA_PARENT), _LLAMA_PARENT,
                    re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"),
                    "model.layers."),
}
_ALL_TARGETS = tuple(dict.fromkeys(t for layout in LAYOUTS.values() for t in layout.targets))


@dataclass(frozen=True)
class LoRAConfig:
    """An adapter's shape: rank r, scale alpha / r, dropout on its input (training only), the
    block linears it adapts."""

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise GptjError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, int | float) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise GptjError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise GptjError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        targets = tuple(self.target_modules)
        bad = [t for t in targets if t not in _ALL_TARGETS]
        if not targets or bad:
            raise GptjError(f"LoRA target_modules must be some of {', '.join(TARGETS)} (GPT-J) or "
                            f"{', '.join(LAYOUTS['llama'].targets)} (Llama), got {list(targets)}")
        object.__setattr__(self, "target_modules", tuple(t for t in _ALL_TARGETS if t in targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_json(self, base_model: str | None = None) -> dict:
        """adapter_config.json as HF PEFT writes it for a LoRA on a causal LM."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "target_modules": list(self.target_modules), "bias": "none", "fan_in_fan_out": False,
                "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
                "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
                "use_rslora": False, "use_dora": False, "revision": None}


@dataclass
class Adapter:
    """An adapter read from disk: its config and its A, B per (layer, module)."""

    config: LoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    path: str | None = None
    layout: Layout = LAYOUTS["gptj"]  # whose module names it adapts

    def check_fits(self, shapes: dict[str, tuple[int, ...]], n_layer: int) -> None:
        """GptjError unless each of the adapter's matrices fits the weight it adapts, of a model
        whose checkpoint tensors have `shapes` (by name) and `n_layer` blocks."""
        for (i, name), (a, b) in self.weights.items():
            if i >= n_layer:
                raise GptjError(f"{self.path}: adapts layer {i}; the model has {n_layer}")
            height, width = shapes[self.layout.weight_name(i, name)]
            if (a.shape[1], b.shape[0]) != (width, height):
                raise GptjError(f"{self.path}: layer {i} {name} is {b.shape[0]} x {a.shape[1]}; the model's is "
                                f"{height} x {width}")

    def delta(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """scale * B @ A (float32, on `device`) for the weight the checkpoint names `name`, or None
        when the adapter leaves that weight alone."""
        where = self.layout.weight_of(name)
        ab = None if where is None else self.weights.get(where)
        if ab is None:
            return None
        a, b = ab
        return self.config.scale * (b.to(device) @ a.to(device))


def is_adapter(folder: str | Path) -> bool:
    return (Path(folder) / CONFIG_FILE).is_file()


def read_config(folder: str | Path) -> LoRAConfig:
    """An adapter folder's LoRAConfig; one-line GptjError for what gptj cannot run."""
    path = model_file(folder, CONFIG_FILE)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GptjError(f"{folder}: not a LoRA adapter folder (no {CONFIG_FILE})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GptjError(f"{path}: cannot read: {e}") from None
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        got = raw.get("peft_type") if isinstance(raw, dict) else raw
        raise GptjError(f"{path}: peft_type must be LORA, got {got!r}")
    for key, plain in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if raw.get(key, plain) != plain:
            raise GptjError(f"{path}: {key} {raw[key]!r} is not supported (gptj runs plain LoRA)")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if raw.get(key):
            raise GptjError(f"{path}: {key} is not supported (one rank and alpha for every adapted linear)")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list):
        raise GptjError(f"{path}: target_modules must be a list of module names")
    return LoRAConfig(rank=raw.get("r"), alpha=raw.get("lora_alpha", 8), dropout=raw.get("lora_dropout", 0.0),
                      target_modules=tuple(targets))


def base_mismatch(folder: str | Path, base: str | Path) -> str | None:
    """Why adapter `folder` may not belong on the model folder `base`, in one line, or None: its
    adapter_config.json's base_model_name_or_path names another model (by path when that path is
    here, else by its last name: an HF id "EleutherAI/gpt-j-6b" fits a folder "gpt-j-6b"; `gptj
    train`'s "gptj preset tiny" fits "tiny"). An adapter that names no base is taken as it is; its
    shapes are checked where it loads (an error)."""
    try:
        raw = json.loads((Path(folder) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # read_config says what is wrong with the folder
    named = raw.get("base_model_name_or_path") if isinstance(raw, dict) else None
    if not isinstance(named, str) or not named.strip():
        return None
    base = Path(base)
    recorded = Path(named.removeprefix("gptj preset ").rstrip("/"))
    if recorded.exists() and recorded.resolve() == base.resolve():
        return None
    if recorded.name.lower() == base.resolve().name.lower():
        return None
    return (f"adapter {folder} was trained on {named!r} (its adapter_config.json's base_model_name_or_path), "
            f"not on {base}: its output may be meaningless")


def read_adapter(folder: str | Path) -> Adapter:
    """An adapter folder: its config and tensors (safetensors: data only, never code)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_config(folder)
    path = model_file(folder, WEIGHTS_FILE)
    try:
        sd = load_file(str(path))
    except FileNotFoundError:
        raise GptjError(f"{folder}: no {WEIGHTS_FILE}") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise GptjError(f"{path}: not a readable safetensors file ({e})") from None
    keys = [key.replace(".default.", ".") for key in sd]
    layout = next((lay for lay in LAYOUTS.values() if keys and lay.key.fullmatch(keys[0])), LAYOUTS["gptj"])
    adapter = Adapter(config, path=str(folder), layout=layout)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in zip(keys, sd.values()):
        m = layout.key.fullmatch(key)
        if m is None or m[3] not in config.target_modules or layout.parent.get(m[3]) != m[2]:
            raise GptjError(f"{path}: tensor {key!r} is not a LoRA weight of {layout.arch}'s "
                            f"{', '.join(config.target_modules)}")
        if t.dim() != 2 or not t.is_floating_point():
            raise GptjError(f"{path}: {key!r} must be a float matrix")
        check_finite(t, key, path)  # a NaN here would make every token it touches NaN
        pairs.setdefault((int(m[1]), m[3]), {})[m[4]] = t.float()
    for where, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != config.rank or ab["B"].shape[1] != config.rank:
            raise GptjError(f"{path}: layer {where[0]} {where[1]}: lora_A must be r x in and lora_B out x r "
                            f"(r = {config.rank})")
        adapter.weights[where] = (ab["A"], ab["B"])
    if not adapter.weights:
        raise GptjError(f"{path}: holds no LoRA weights")
    return adapter


def read_adapter_state(folder: str | Path, expected: LoRAConfig | None = None) -> dict[str, torch.Tensor]:
    """An adapter folder's tensors under PEFT's names, for load_adapter_state; `expected`: the
    LoRAConfig they must have been trained with (GptjError naming the difference)."""
    adapter = read_adapter(folder)
    if expected is not None and adapter.config != expected:
        raise GptjError(f"{folder}: an adapter of {adapter.config}, the config asks for {expected}")
    return {adapter.layout.lora_name(i, name, x): t
            for (i, name), (a, b) in adapter.weights.items() for x, t in (("A", a), ("B", b))}


def weight_name(layer: int, module: str) -> str:
    """The checkpoint name of the weight that `module` of block `layer` adapts."""
    return f"transformer.h.{layer}.{PARENT[module]}.{module}.weight"


def merged(weight: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """weight + delta (Adapter.delta) in float32 (the caller rounds it once, to its dtype); the weight
    as it is when the adapter leaves it alone (delta None)."""
    return weight if delta is None else weight.float() + delta.to(weight.device)
