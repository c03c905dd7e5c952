"""LoRA adapters in HF PEFT's format (HF PEFT loads what gptj writes, and gptj what PEFT writes): trained,
merged and served unmerged on GPT-J's linears and Llama's (q/k/v/o, gate/up/down), under PEFT's names
for each (gptj.weights.peft.LAYOUTS).

A LoRA linear computes y = base(x) + (dropout(x) @ A.T @ B.T) * alpha / rank, with the base
frozen: A (rank x in) starts Kaiming-uniform and B (out x rank) at zero, as PEFT initializes them,
so an untrained adapter changes nothing. The base may be a float nn.Linear or a quantized one
(gptj.quant): its x-gradient is taken through its dequantized weight (`_FrozenBase`), so an int8
base trains adapters on the layers below it too.

On disk, an adapter is a folder in PEFT's format (gptj.weights.peft reads it; its names are
re-exported here); `save_adapter` writes one, atomically.

A loader folds an adapter into the weights as it reads them (gptj.weights.peft.merged: W + scale *
B @ A, one rounding to the weight's dtype); `merge_lora` does the same to a built model. Either
serves one adapter at full speed; `LoRALinear` serves it unmerged, and
`MultiLoRALinear` serves several adapters over one base in one batch, each row with its own (or
none): what `gptj serve --lora NAME=DIR` runs.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gptj.errors import GptjError
from gptj.files import atomic_folder
from gptj.weights.peft import (CONFIG_FILE, DEFAULT_TARGETS, KEY, LAYOUTS, PARENT, PREFIX,  # noqa: F401 (re-exported)
                               TARGETS, WEIGHTS_FILE, Adapter, Layout, LoRAConfig, base_mismatch, is_adapter, merged,
                               read_adapter, read_adapter_state, read_config, weight_name)

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


def _block_linears(model: nn.Module, targets: Iterable[str]) -> Iterable[tuple[int, nn.Module, str]]:
    for i, block in enumerate(model.transformer.h):
        for name in targets:
            yield i, getattr(block, _OUR_PARENT[name]), name


def layout_of(model: nn.Module) -> Layout:
    """How PEFT names the adapters of `model`'s architecture (gptj.weights.peft.LAYOUTS)."""
    return LAYOUTS[model.config.model_type]


def apply_lora(model: nn.Module, config: LoRAConfig, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    """Wrap `model`'s target linears in LoRALinear (freezing every other parameter); -> the
    adapters' parameters, the only trainable ones. Targets that are not the architecture's
    linears are refused in one line."""
    layout = layout_of(model)
    other = [t for t in config.target_modules if t not in layout.targets]
    if other:
        raise GptjError(f"LoRA target_modules {other} are not {layout.arch}'s linears ({', '.join(layout.targets)})")
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
    targets = layout_of(model).targets
    for i, block in enumerate(model.transformer.h):
        for name in targets:
            m = getattr(getattr(block, _OUR_PARENT[name]), name)
            if isinstance(m, LoRALinear):
                found[(i, name)] = m
    return found


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under PEFT's names for the model's architecture (float32, on CPU)."""
    layout, sd = layout_of(model), {}
    for (i, name), m in lora_modules(model).items():
        sd[layout.lora_name(i, name, "A")] = m.lora_A.weight.detach().float().cpu().contiguous()
        sd[layout.lora_name(i, name, "B")] = m.lora_B.weight.detach().float().cpu().contiguous()
    return sd


def load_adapter_state(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy PEFT-named tensors into `model`'s LoRALinear modules (each one present, shapes checked)."""
    mods = lora_modules(model)
    key_re = layout_of(model).key
    seen = set()
    for key, t in sd.items():
        m = key_re.fullmatch(key)
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


# Where each adaptable linear lives in a block of gptj.models (GPT-J's, and Llama's in gptj's module names)
_OUR_PARENT = {**PARENT, "o_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _module_at(block: nn.Module, path: str) -> nn.Module:
    m = block
    for part in path.split("."):
        m = getattr(m, part)
    return m.base if isinstance(m, LoRALinear | MultiLoRALinear | FrozenLinear) else m


def _check_fits(model: nn.Module, adapter: Adapter) -> None:
    """GptjError unless `adapter` adapts this model's architecture and each of its matrices fits the
    linear it adapts (plain or fused blocks)."""
    arch = model.config.model_type
    if adapter.layout.arch != arch:
        raise GptjError(f"{adapter.path}: a {adapter.layout.arch} adapter on a {arch} model")
    shapes = {}
    for (i, name) in adapter.weights:
        if i < len(model.transformer.h):
            path, cols, rows = _slots(model.transformer.h[i])[name]
            m = _module_at(model.transformer.h[i], path)
            shapes[adapter.layout.weight_name(i, name)] = (len(range(*rows.indices(m.out_features))),
                                                           len(range(*cols.indices(m.in_features))))
    adapter.check_fits(shapes, len(model.transformer.h))


def attach_adapter(model: nn.Module, adapter: Adapter) -> None:
    """Wrap the adapted linears in LoRALinear modules holding `adapter` (unmerged)."""
    _check_fits(model, adapter)
    apply_lora(model, adapter.config)
    for (i, name), (a, b) in adapter.weights.items():
        m = getattr(getattr(model.transformer.h[i], _OUR_PARENT[name]), name)
        with torch.no_grad():
            m.lora_A.weight.copy_(a)
            m.lora_B.weight.copy_(b)
    model.eval()


def merge_lora(model: nn.Module, adapter: Adapter) -> None:
    """Fold `adapter` into `model`'s float weights: W <- W + scale * B @ A, computed in float32 and
    rounded to W's dtype once. Quantized weights cannot take it (GptjError)."""
    _check_fits(model, adapter)
    for i, name in adapter.weights:
        base = getattr(getattr(model.transformer.h[i], _OUR_PARENT[name]), name)
        if not isinstance(base, nn.Linear):
            raise GptjError("a LoRA adapter merges into float weights only (load the base unquantized)")
        with torch.no_grad():
            w = base.weight
            w.copy_(merged(w, adapter.delta(adapter.layout.weight_name(i, name), w.device)).to(w.dtype))


def _slots(block: nn.Module) -> dict[str, tuple[str, slice, slice]]:
    """Where each of a block's linears lives: (attribute path of the module computing it, its input
    columns there, its output rows there). A plain block has one module per linear; a fused one
    (gptj.kernels.fuse_block) computes q|k|v|fc_in in `w_in` and [attention | gelu] @ [out_proj | fc_out]
    in `w_out` (or keeps out_proj and fc_out apart); a fused Llama block q|k|v in `w_qkv` and gate|up in
    `w_gate_up`."""
    whole = slice(None)
    slots = {name: (f"{_OUR_PARENT[name]}.{name}", whole, whole) for name in _OUR_PARENT}
    if getattr(block, "w_qkv", None) is not None:
        q, k, v = block.qkv_sizes
        inner = block.w_gate_up.out_features // 2
        slots.update(q_proj=("w_qkv", whole, slice(0, q)), k_proj=("w_qkv", whole, slice(q, q + k)),
                     v_proj=("w_qkv", whole, slice(q + k, q + k + v)), gate_proj=("w_gate_up", whole, slice(0, inner)),
                     up_proj=("w_gate_up", whole, slice(inner, 2 * inner)))
    if getattr(block, "w_in", None) is None:  # a plain or a Llama block
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
    if model.kv_heads != getattr(model.config, "n_kv_head", model.config.n_head) or \
            any(not hasattr(b, "attn") for b in model.transformer.h):
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
