"""LoRA adapters on GPT-J's linears, in HF PEFT's format (HF PEFT loads what gptj writes, and gptj what PEFT writes).

A LoRA linear computes y = base(x) + (dropout(x) @ A.T @ B.T) * alpha / rank, with the base
frozen: A (rank x in) starts Kaiming-uniform and B (out x rank) at zero, as PEFT initializes them,
so an untrained adapter changes nothing. The base may be a float nn.Linear or a quantized one
(gptj.quant): its x-gradient is taken through its dequantized weight (`_FrozenBase`), so an int8
base trains adapters on the layers below it too.

On disk, an adapter is a folder with adapter_config.json (peft_type LORA, r, lora_alpha,
lora_dropout, target_modules, ...) and adapter_model.safetensors, whose tensors are named
`base_model.model.transformer.h.{i}.{attn|mlp}.{module}.lora_{A|B}.weight` (PEFT's names for
GPTJForCausalLM). Writes are atomic.

`merge_lora` folds an adapter into float weights (W + scale * B @ A, one rounding to the weight's
dtype) for serving one adapter at full speed; `LoRALinear` serves it unmerged, and
`MultiLoRALinear` serves several adapters over one base in one batch, each row with its own (or
none): what `gptj serve --lora NAME=DIR` runs.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gptj.device import check_finite
from gptj.errors import GptjError
from gptj.files import atomic_folder, model_file

TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out")  # GPT-J's linears in a block
DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for GPT-J
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"base_model\.model\.transformer\.h\.(\d+)\.(attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_PARENT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "out_proj": "attn", "fc_in": "mlp", "fc_out": "mlp"}


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
        bad = [t for t in targets if t not in TARGETS]
        if not targets or bad:
            raise GptjError(f"LoRA target_modules must be some of {', '.join(TARGETS)}, got {list(targets)}")
        object.__setattr__(self, "target_modules", tuple(t for t in TARGETS if t in targets))

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


class _FrozenBase(torch.autograd.Function):
    """base(x) by whatever kernel the base runs, with dL/dx = dL/dy @ W (the dequantized weight):
    quantized kernels have no backward of their own, and the base's weights take no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, base: nn.Module) -> torch.Tensor:  # noqa: ANN001
        ctx.base = base
        with torch.no_grad():
            return base(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        w = ctx.base.dequantized_weight(grad.dtype)  # (a float nn.Linear never comes here: _frozen)
        return grad @ w, None


def _frozen(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(base, nn.Linear) or not (torch.is_grad_enabled() and x.requires_grad):
        return base(x)
    return _FrozenBase.apply(x, base)


class FrozenLinear(nn.Module):
    """A quantized linear outside the adapters (lm_head, the block linears not adapted) in a LoRA
    training: its kernel has no backward, so it passes x's gradient as `_frozen` does."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _frozen(self.base, x)


class LoRALinear(nn.Module):
    """A frozen base linear plus one adapter (trainable: lora_A, lora_B)."""

    def __init__(self, base: nn.Module, config: LoRAConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        device = next(base.buffers(), next(base.parameters(), None)).device
        self.lora_A = nn.Linear(self.in_features, config.rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(config.rank, self.out_features, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's (and nn.Linear's) init
        nn.init.zeros_(self.lora_B.weight)
        self.scale = config.scale
        self.dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _frozen(self.base, x)
        d = self.lora_B(self.lora_A(self.dropout(x).to(self.lora_A.weight.dtype)))
        return y + (d * self.scale).to(y.dtype)


@dataclass
class _Part:
    """One adapted linear inside a (possibly fused) linear: its input columns and output rows there."""

    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r)
    cols: slice
    rows: slice


def rows_by_adapter(ids: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(adapter, its rows) for each adapter some row uses, in adapter order; ids: each row's adapter,
    -1 for none. Made on the host, so that a forward finds its rows without reading the device."""
    by: dict[int, list[int]] = {}
    for row, i in enumerate(ids):
        if i >= 0:
            by.setdefault(i, []).append(row)
    return sorted(by.items())


class MultiLoRALinear(nn.Module):
    """A frozen base linear and several adapters; each row of a call uses one adapter or none, and an
    adapter's contribution is computed for its own rows only. The caller sets, before each forward,
    `selection`: (adapter, its rows' indices as a device int64 tensor) pairs (rows_by_adapter's, made
    on the host: the engine moves them with the step's other indices, so no layer waits for the
    device to find its rows), and `n_rows`, the forward's rows (`select` does both from a list of
    ids). The base may be a fused linear (the serving kernels' q|k|v|fc_in, or out_proj and fc_out side
    by side): an adapter then holds one part per linear it adapts there, each on its own input
    columns and output rows."""

    def __init__(self, base: nn.Module, n_adapters: int) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts: list[list[_Part]] = [[] for _ in range(n_adapters)]
        self.scales: list[float] = [1.0] * n_adapters
        self.selection: list[tuple[int, torch.Tensor]] | None = None
        self.n_rows = 0

    def select(self, ids: Sequence[int]) -> None:
        """The next forwards' rows: ids, each row's adapter (-1 for none)."""
        device = next(itertools.chain(self.base.parameters(), self.base.buffers())).device
        self.selection = [(i, torch.tensor(rows, device=device)) for i, rows in rows_by_adapter(ids)]
        self.n_rows = len(ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.selection is None:
            return y
        x2, y2 = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        if self.n_rows != x2.shape[0]:
            raise GptjError(f"LoRA rows: {self.n_rows} adapter ids for {x2.shape[0]} rows")
        for i, sel in self.selection:
            if not self.parts[i]:
                continue
            xs = x2.index_select(0, sel)
            for part in self.parts[i]:
                d = (xs[:, part.cols].to(part.a.dtype) @ part.a.T) @ part.b.T
                y2[:, part.rows].index_add_(0, sel, (d * self.scales[i]).to(y2.dtype))
        return y


@dataclass
class Adapter:
    """An adapter read from disk: its config and its A, B per (layer, module)."""

    config: LoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    path: str | None = None


def _block_linears(model: nn.Module, targets: Iterable[str]) -> Iterable[tuple[int, nn.Module, str]]:
    for i, block in enumerate(model.transformer.h):
        for name in targets:
            yield i, getattr(block, _PARENT[name]), name


def apply_lora(model: nn.Module, config: LoRAConfig, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    """Wrap `model`'s target linears in LoRALinear (freezing every other parameter); -> the
    adapters' parameters, the only trainable ones."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    for _, parent, name in _block_linears(model, config.target_modules):
        base = getattr(parent, name)
        if isinstance(base, LoRALinear | MultiLoRALinear):
            raise GptjError("the model carries LoRA adapters already")
        wrapped = LoRALinear(base, config, dtype)
        setattr(parent, name, wrapped)
        params += [wrapped.lora_A.weight, wrapped.lora_B.weight]
    quantized = [(parent, name) for parent in model.modules() if not isinstance(parent, LoRALinear | FrozenLinear)
                 for name, child in parent.named_children() if hasattr(child, "dequantized_weight")]
    for parent, name in quantized:  # their kernels would cut the gradient to the adapters below them
        setattr(parent, name, FrozenLinear(getattr(parent, name)))
    return params


def lora_modules(model: nn.Module) -> dict[tuple[int, str], LoRALinear]:
    found = {}
    for i, block in enumerate(model.transformer.h):
        for name in TARGETS:
            m = getattr(getattr(block, _PARENT[name]), name)
            if isinstance(m, LoRALinear):
                found[(i, name)] = m
    return found


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under PEFT's names (float32, on CPU)."""
    sd = {}
    for (i, name), m in lora_modules(model).items():
        key = f"{PREFIX}transformer.h.{i}.{_PARENT[name]}.{name}"
        sd[f"{key}.lora_A.weight"] = m.lora_A.weight.detach().float().cpu().contiguous()
        sd[f"{key}.lora_B.weight"] = m.lora_B.weight.detach().float().cpu().contiguous()
    return sd


def load_adapter_state(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy PEFT-named tensors into `model`'s LoRALinear modules (each one present, shapes checked)."""
    mods = lora_modules(model)
    seen = set()
    for key, t in sd.items():
        m = _KEY.fullmatch(key)
        if m is None or (int(m[1]), m[3]) not in mods:
            raise GptjError(f"adapter tensor {key!r}: no LoRA module of this model takes it")
        target = getattr(mods[(int(m[1]), m[3])], f"lora_{m[4]}").weight
        if tuple(t.shape) != tuple(target.shape):
            raise GptjError(f"adapter tensor {key!r} has shape {list(t.shape)}, the module's is {list(target.shape)}")
        with torch.no_grad():
            target.copy_(t)
        seen.add(key)
    missing = [k for k in adapter_state_dict(model) if k not in seen]
    if missing:
        raise GptjError(f"the adapter lacks {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1
                                                                else ""))


def save_adapter(state: nn.Module | dict[str, torch.Tensor], config: LoRAConfig, folder: str | Path,
                 base_model: str | None = None, extra: Callable[[Path], None] | None = None) -> Path:
    """Write a model's adapters (or their PEFT-named state dict) as a PEFT adapter folder, atomically
    (replacing `folder`); `extra(tmp)` adds files (a trainer's state) before it moves into place."""
    from safetensors.torch import save_file

    sd = adapter_state_dict(state) if isinstance(state, nn.Module) else {
        k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        save_file(sd, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config.peft_json(base_model), indent=2) + "\n")
        if extra is not None:
            extra(tmp)
    return folder


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
    adapter = Adapter(config, path=str(folder))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        m = _KEY.fullmatch(key.replace(".default.", "."))
        if m is None or m[3] not in config.target_modules or _PARENT[m[3]] != m[2]:
            raise GptjError(f"{path}: tensor {key!r} is not a LoRA weight of GPT-J's "
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
    return {f"{PREFIX}transformer.h.{i}.{_PARENT[name]}.{name}.lora_{x}.weight": t
            for (i, name), (a, b) in adapter.weights.items() for x, t in (("A", a), ("B", b))}


def _module_at(block: nn.Module, path: str) -> nn.Module:
    m = block
    for part in path.split("."):
        m = getattr(m, part)
    return m.base if isinstance(m, LoRALinear | MultiLoRALinear | FrozenLinear) else m


def _check_fits(model: nn.Module, adapter: Adapter) -> None:
    """GptjError unless each of `adapter`'s matrices fits the linear it adapts (plain or fused blocks)."""
    n = len(model.transformer.h)
    for (i, name), (a, b) in adapter.weights.items():
        if i >= n:
            raise GptjError(f"{adapter.path}: adapts layer {i}; the model has {n}")
        path, cols, rows = _slots(model.transformer.h[i])[name]
        m = _module_at(model.transformer.h[i], path)
        width = len(range(*cols.indices(m.in_features)))
        height = len(range(*rows.indices(m.out_features)))
        if (a.shape[1], b.shape[0]) != (width, height):
            raise GptjError(f"{adapter.path}: layer {i} {name} is {b.shape[0]} x {a.shape[1]}; the model's is "
                            f"{height} x {width}")


def attach_adapter(model: nn.Module, adapter: Adapter) -> None:
    """Wrap the adapted linears in LoRALinear modules holding `adapter` (unmerged)."""
    _check_fits(model, adapter)
    apply_lora(model, adapter.config)
    for (i, name), (a, b) in adapter.weights.items():
        m = getattr(getattr(model.transformer.h[i], _PARENT[name]), name)
        with torch.no_grad():
            m.lora_A.weight.copy_(a)
            m.lora_B.weight.copy_(b)
    model.eval()


def merge_lora(model: nn.Module, adapter: Adapter) -> None:
    """Fold `adapter` into `model`'s float weights: W <- W + scale * B @ A, computed in float32 and
    rounded to W's dtype once. Quantized weights cannot take it (GptjError)."""
    _check_fits(model, adapter)
    scale = adapter.config.scale
    for (i, name), (a, b) in adapter.weights.items():
        base = getattr(getattr(model.transformer.h[i], _PARENT[name]), name)
        if not isinstance(base, nn.Linear):
            raise GptjError("a LoRA adapter merges into float weights only (load the base unquantized)")
        with torch.no_grad():
            w = base.weight
            w.copy_((w.float() + scale * (b.to(w.device) @ a.to(w.device))).to(w.dtype))


def _slots(block: nn.Module) -> dict[str, tuple[str, slice, slice]]:
    """Where each of a block's linears lives: (attribute path of the module computing it, its input
    columns there, its output rows there). A plain block has one module per linear; a fused one
    (gptj.kernels.fuse_block) computes q|k|v|fc_in in `w_in` and [attention | gelu] @ [out_proj | fc_out]
    in `w_out` (or keeps out_proj and fc_out apart)."""
    whole = slice(None)
    slots = {name: (f"{_PARENT[name]}.{name}", whole, whole) for name in TARGETS}
    if block.w_in is None:
        return slots
    E = block.attn.n_head * block.attn.head_dim
    inner = block.w_in.out_features - 3 * E
    slots.update(q_proj=("w_in", whole, slice(0, E)), k_proj=("w_in", whole, slice(E, 2 * E)),
                 v_proj=("w_in", whole, slice(2 * E, 3 * E)), fc_in=("w_in", whole, slice(3 * E, 3 * E + inner)))
    if block.w_out is not None:
        slots.update(out_proj=("w_out", slice(0, E), whole), fc_out=("w_out", slice(E, E + inner), whole))
    return slots


def attach_adapters(model: nn.Module, adapters: Sequence[Adapter], names: Sequence[str]) -> list[MultiLoRALinear]:
    """Serve `adapters` (named `names`) over `model` in one batch: every linear any of them adapts is
    wrapped in a MultiLoRALinear (works on plain and on the serving kernels' fused blocks, so call it
    after gptj.kernels.prepare_for_serving); adapter k is id k of the modules' `rows`, which the engine
    sets before each forward. -> the wrapped modules; `model.lora_names` lists the names."""
    if getattr(model, "lora_names", None):
        raise GptjError("the model serves LoRA adapters already")
    if model.kv_heads != model.config.n_head or any(not hasattr(b, "attn") for b in model.transformer.h):
        raise GptjError("LoRA adapters with --tp / --pp are not supported")  # (a tensor shard; another stage's layers)
    for ad in adapters:
        _check_fits(model, ad)
    wrapped: dict[tuple[int, str], MultiLoRALinear] = {}
    for k, ad in enumerate(adapters):
        for (i, name), (a, b) in sorted(ad.weights.items()):
            block = model.transformer.h[i]
            path, cols, rows = _slots(block)[name]
            key = (i, path)
            if key not in wrapped:
                *parents, attr = path.split(".")
                parent = block
                for p in parents:
                    parent = getattr(parent, p)
                wrapped[key] = MultiLoRALinear(getattr(parent, attr), len(adapters))
                setattr(parent, attr, wrapped[key])
            m = wrapped[key]
            device = next(m.base.buffers(), next(m.base.parameters(), None)).device
            m.parts[k].append(_Part(a.to(device), b.to(device), cols, rows))
            m.scales[k] = ad.config.scale
    model.lora_names = list(names)
    return list(wrapped.values())


def multi_lora_modules(model: nn.Module) -> list[MultiLoRALinear]:
    return [m for m in model.modules() if isinstance(m, MultiLoRALinear)]
