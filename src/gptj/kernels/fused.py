"""Serving kernels: fused GPT-J blocks and bfloat16 Linear weights repacked for oneDNN on CPU.

Which of these a model gets, and which kernel each call runs, is decided by gptj.policy.

Fused blocks. GPT-J feeds attention and MLP the same LayerNorm output, so q, k, v and fc_in are
one matmul (7 E x E weights for gptj-6b) and, in bfloat16, out_proj and fc_out are one more
(their inputs concatenated): two or three weight-streaming calls per layer instead of six, each
on a bigger matrix (the kernels' per-call cost and small-matrix inefficiency dominate decode on
small models). Rotary runs on q and k together, in place. `fuse_model` does this for models whose
weights are not float32 (bfloat16 or quantized); float32 stays the exact, unfused math (policy.fusable).

Packed linears. `pack_model` swaps every bfloat16 `nn.Linear` of a model for a `PackedLinear`
(gptj.kernels.dense: oneDNN's blocked layout or gptj.native's) and every W8A8 layer for a
`PackedW8A8Linear` (gptj.quant.w8a8), reordered once, layer by layer, each plain weight freed before
the next is reordered, so memory never holds two copies of the model. `prepare_for_serving` then
chooses every quantized layer's kernels for the model's dtype (gptj.quant.base.choose_methods).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gptj import native
from gptj.config import GPTJConfig
from gptj.policy import (NATIVE, PACK_MODES, TORCH, TRITON, can_pack, can_pack_int8, elementwise_path, exact, fusable,
                         pack_layout)
from gptj.fallback import Fallbacks
from gptj.kernels.dense import PackedLinear
from gptj.models.gptj import PLAIN_OPS, Block, BlockOps
from gptj.models.llama import Block as LlamaBlock
from gptj.quant import Fp8Linear, Int4Linear, Int8Linear, W8A8Linear
from gptj.quant.base import choose_methods
from gptj.quant.w8a8 import PackedW8A8Linear

log = logging.getLogger(__name__)


def pack_model(model: nn.Module, mode: str = "auto", max_rows: int | None = None) -> int:
    """Swap the model's bfloat16 CPU nn.Linear modules for PackedLinear in place; return how many.

    max_rows: the most rows a matmul will see at decode (None: unbounded); it picks the layout
    (policy.pack_layout: gptj.native's for few rows where it is available, otherwise oneDNN's).

    mode "off" (or a model that is not bfloat16 on a CPU with oneDNN bf16) leaves it unchanged.
    W8A8 layers on a CPU with oneDNN's int8 GEMM or gptj.native's become PackedW8A8Linear (any float dtype); the other
    quantized layers (gptj.quant) keep their own kernels.
    """
    if mode not in PACK_MODES:
        raise ValueError(f"pack mode must be one of {', '.join(PACK_MODES)}, got {mode!r}")
    if mode == "off":
        return 0
    layout = pack_layout(max_rows)
    # (parent, name) pairs only: a list of the linears themselves would keep every plain weight
    # alive until the end, holding the model twice while it is repacked.
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if (type(child) is nn.Linear and can_pack(child.weight.dtype, child.weight.device, layout))
               or (type(child) is W8A8Linear and can_pack_int8(child.weight.device))]
    for parent, name in targets:
        child = getattr(parent, name)
        packed = PackedW8A8Linear(child) if type(child) is W8A8Linear else PackedLinear(child, layout)
        setattr(parent, name, packed)  # the plain weight is freed here
    return len(targets)


def _linear_parts(m: nn.Module) -> dict[str, torch.Tensor]:
    """A linear's tensors in a concatenable form: weight rows (portable layout), per-row scales, bias."""
    if type(m) is nn.Linear:
        parts = {"weight": m.weight.detach()}
    elif isinstance(m, (Int8Linear, Fp8Linear)):
        parts = {"weight": m.weight, "weight_scale": m.weight_scale}
    elif isinstance(m, W8A8Linear):
        parts = {"weight": m.weight, "weight_scale": m.weight_scale}  # input_smooth: shared, see concat_out_features
    elif isinstance(m, Int4Linear):
        parts = {"weight": m.portable_weight(), "weight_scale": m.weight_scale, "weight_zero": m.weight_zero}
    else:
        raise TypeError(f"cannot fuse a {type(m).__name__}")
    w = parts["weight"]
    dtype = m.bias.dtype if m.bias is not None else (w.dtype if type(m) is nn.Linear else torch.float32)
    parts["bias"] = m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=dtype,
                                                                          device=w.device)
    return parts


def concat_out_features(mods: list[nn.Module]) -> nn.Module:
    """One linear computing all of `mods` (same type and input) side by side: y = [m0(x) | m1(x) | ...].

    Each output is the same dot product as before (quantized rows keep their own scales), only
    done in one call. The result has a bias (zeros where a part had none). W8A8 layers must share
    their smoothing factors (calibration gives linears that read one tensor the same ones), as
    their input is quantized once for all of them.
    """
    first = mods[0]
    if any(type(m) is not type(first) for m in mods) or any(m.in_features != first.in_features for m in mods):
        raise TypeError("fused linears must share type and in_features")
    if isinstance(first, W8A8Linear) and any(not torch.equal(m.input_smooth, first.input_smooth) for m in mods):
        raise TypeError("fused W8A8 linears must share their smoothing factors")
    parts = [_linear_parts(m) for m in mods]
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    n_out = sum(m.out_features for m in mods)
    w = cat["weight"]
    if type(first) is nn.Linear:
        new = nn.Linear(first.in_features, n_out, device="meta")
        new.weight = nn.Parameter(w, requires_grad=False)
        new.bias = nn.Parameter(cat["bias"].to(w.dtype), requires_grad=False)
        return new
    if isinstance(first, (Int8Linear, Fp8Linear)):
        new = type(first)(first.in_features, n_out, True, device="meta")
    elif isinstance(first, W8A8Linear):
        new = W8A8Linear(first.in_features, n_out, True, device="meta")
        new.input_smooth = first.input_smooth
    else:
        new = type(first)(first.in_features, n_out, True, first.group_size, device="meta")  # int4, w4a8
    for k, t in cat.items():
        setattr(new, k, t)
    return new.prepare()


def concat_in_features(a: nn.Linear, b: nn.Linear) -> nn.Linear:
    """One float linear with y = a(x1) + b(x2) for input [x1 | x2] (bias: b's). Float weights only."""
    w = torch.cat([a.weight.detach(), b.weight.detach()], dim=1)
    new = nn.Linear(w.shape[1], w.shape[0], device="meta")
    new.weight = nn.Parameter(w, requires_grad=False)
    bias = b.bias if b.bias is not None else a.bias
    new.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
    return new


class KernelOps(BlockOps):
    """A fused block's elementwise ops by the kernels policy.elementwise_path chose for its device and
    dtype at load: NATIVE (gptj.native's rotary and GELU), TRITON (the rotary), TORCH (torch's ops;
    GELU below float32 in one pass, rounded once)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def rotary_qk_(self, qkv: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> None:
        rotary_qk_(qkv, sin, cos, self.path)

    def gelu_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        gelu_into(x, out, self.path == NATIVE)

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.gelu_into(x, out)
        return out


def fuse_block(block: Block | LlamaBlock) -> Block | LlamaBlock:
    """A block's weights fused in place; the same math (models.gptj.Block, models.llama.Block).
    Llama: w_qkv = [q | k | v], w_gate_up = [gate | up]. GPT-J: its ops chosen for its device and
    dtype (the LayerNorm's: the activations'), and

    w_in = [q | k | v | fc_in] (bias: fc_in's). Float weights: w_out = [out_proj | fc_out] over the
    input [attention | gelu]; quantized ones keep out_proj and fc_out apart (their per-row scales
    would not survive concatenation along the input). Each plain linear is freed as it is replaced.
    """
    attn, mlp = block.attn, block.mlp
    if isinstance(block, LlamaBlock):
        block.qkv_sizes = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
        block.w_qkv = concat_out_features([attn.q_proj, attn.k_proj, attn.v_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj
        block.w_gate_up = concat_out_features([mlp.gate_proj, mlp.up_proj])
        del mlp.gate_proj, mlp.up_proj
        return block
    block.w_in = concat_out_features([attn.q_proj, attn.k_proj, attn.v_proj, mlp.fc_in])
    del attn.q_proj, attn.k_proj, attn.v_proj, mlp.fc_in
    if type(attn.out_proj) is nn.Linear and type(mlp.fc_out) is nn.Linear:
        block.w_out = concat_in_features(attn.out_proj, mlp.fc_out)
        del attn.out_proj, mlp.fc_out
    w = block.ln_1.weight
    block.ops = KernelOps(elementwise_path(w.device, w.dtype))
    return block


def rotary_qk_(qkv: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, path: str = TORCH) -> None:
    """Rotary on q and k of qkv (B, T, 3, H, D) in place; sin, cos (B, T, 1, R) from
    gptj.models.gptj.rotary_tables. path (policy.elementwise_path): NATIVE, gptj.native's one pass where the
    rotary width suits it; TRITON, one Triton kernel; TORCH, torch's ops."""
    B, T, _, H, D = qkv.shape
    R = sin.shape[-1]
    if path == NATIVE and R % 16 == 0:
        native.rotary_(qkv.view(B * T, 3 * H, D)[:, :2 * H], sin.reshape(B * T, R), cos.reshape(B * T, R))
        return
    if path == TRITON and _FALLBACKS.ok("rotary"):
        from gptj.kernels.triton_elementwise import rotary_qk_ as triton_rotary

        try:
            triton_rotary(qkv.view(B * T, -1), H, D, sin.reshape(B * T, R), cos.reshape(B * T, R))
            return
        except Exception as e:  # noqa: BLE001 - a Triton or GPU this was not built for: torch's ops from now on
            _FALLBACKS.fail("rotary", "the Triton rotary", e, "torch's ops rotate from now on")
    PLAIN_OPS.rotary_qk_(qkv, sin, cos)


_FALLBACKS = Fallbacks(log)  # the Triton rotary's failure, once: later calls take torch's ops


def gelu_into(x: torch.Tensor, out: torch.Tensor, fast: bool) -> None:
    """out = gelu_new(x). Float32 keeps gelu_new's exact (HF's) ops. Below float32, one pass that
    computes in float32 and rounds once (gelu_new's six ops round after each), so as close to the
    float32 result or closer: gptj.native's when `fast` (policy.native_elementwise), else torch's
    tanh GELU written straight into out (one kernel, not one and a copy)."""
    if fast:
        native.gelu(x, out=out)
    elif exact(x.dtype):
        PLAIN_OPS.gelu_into(x, out)
    else:
        torch.ops.aten.gelu.out(x, approximate="tanh", out=out)


def _fusable(block: nn.Module) -> bool:
    """A float block below float32, or a block with quantized projections (policy.fusable); a Llama
    block as the model file has it (a tensor-parallel one keeps its linears)."""
    plain_llama = type(block) is LlamaBlock and block.w_qkv is None
    plain_gptj = isinstance(block, Block) and block.w_in is None  # (not fused already)
    if not (plain_llama or plain_gptj):
        return False
    q = block.attn.q_proj
    return fusable(q.weight.dtype if type(q) is nn.Linear else None)  # None: quantized


def fuse_model(model: nn.Module, mode: str = "auto") -> int:
    """Fuse a model's blocks (fuse_block) when its weights are quantized or below float32.

    Returns how many. Float32 models (the exact path) and mode "off" are left unchanged.
    """
    if mode not in PACK_MODES:
        raise ValueError(f"kernel mode must be one of {', '.join(PACK_MODES)}, got {mode!r}")
    blocks = model.transformer.h
    if mode == "off" or not any(_fusable(b) for b in blocks):
        return 0
    count = 0
    for i in range(len(blocks)):
        if _fusable(blocks[i]):
            fuse_block(blocks[i])
            count += 1
    return count


def prepare_for_serving(model: nn.Module, mode: str = "auto", max_rows: int | None = None,
                        progress: bool | None = None) -> dict[str, int]:
    """What the engine does to a model it takes over: fuse the blocks, then pack bfloat16 linears
    (max_rows: the engine's most sequences per decode step, see pack_model).

    Layer by layer, each layer's old weights freed before the next is touched, so memory holds the
    weights plus at most one layer's (or lm_head's) copy in flight: a loaded checkpoint's tensors
    map their own pages of the file (gptj.weights.hf), which leave memory with the tensor.
    progress: a bar over the layers on stderr; None: for a big model on a terminal (gptj.weights.io.auto_progress).
    """
    from tqdm import tqdm

    from gptj.weights.io import auto_progress

    if mode not in PACK_MODES:
        raise ValueError(f"kernel mode must be one of {', '.join(PACK_MODES)}, got {mode!r}")
    blocks = model.transformer.h
    fuse = mode != "off" and any(_fusable(b) for b in blocks)
    if mode == "off":
        progress = False
    elif progress is None:  # (auto_progress counts a GPT-J checkpoint's tensors: other models get no bar)
        progress = isinstance(getattr(model, "config", None), GPTJConfig) and auto_progress(model.config)
    fused = packed = 0
    for i in tqdm(range(len(blocks)), desc="preparing kernels", unit="layer", disable=not progress):
        if fuse and _fusable(blocks[i]):
            fuse_block(blocks[i])  # its plain weights are freed here
            fused += 1
        packed += pack_model(blocks[i], mode, max_rows)
    packed += pack_model(model, mode, max_rows)  # lm_head (the blocks' linears are PackedLinear by now)
    choose_methods(model, model.transformer.wte.weight.dtype)  # the quantized layers' kernels, from one probe
    return {"fused_blocks": fused, "packed_linears": packed}
