"""Weight-only quantization: int8 per output channel, int4 per group, as module swaps.

The model stays the plain-math GPT-J of `gptj.model`; `quantize_model` replaces its
`nn.Linear` layers (q/k/v/out_proj, mlp.fc_in/fc_out and lm_head; the embedding `wte`
stays float) with `Int8Linear` / `Int4Linear`. Activations keep the model's float dtype;
only the weights are quantized, gpt-fast style.

Schemes (all scales and zeros are bfloat16 VALUES, the dtype the kernels consume):

  int8  per output channel, symmetric, range [-127, 127] (-128 is never used):
            scale[n] = max_k |w[n, k]| / 127  (rounded UP to bfloat16, so nothing clips)
            q[n, k]  = clamp(round(w[n, k] / scale[n]), -127, 127)
            w ~= q * scale                                  |w - w~| <= scale / 2
  int4  per group of `group_size` consecutive inputs (32, 64, 128 or 256; default 128, or the
        largest that divides the layers' inputs where 128 does not),
        asymmetric with a float zero point, as the tinygemm kernels (CPU and CUDA) define it:
            w ~= (q - 8) * scale + zero,   q in [0, 15]     |w - w~| <= scale / 2
        scale ~= (max - min) / 15 and zero ~= min + 8 * scale, both bfloat16, chosen so that
        [zero - 8 * scale, zero + 7 * scale] covers the group's [min, max].

Checkpoint layout (portable: plain safetensors, no kernel-specific packing), for a
quantized linear `M` (e.g. `transformer.h.0.attn.q_proj`):

  int8:  M.weight        int8     (out, in)
         M.weight_scale  bfloat16 (out,)
  int4:  M.weight        uint8    (out, in / 2)  two 4-bit values per byte, HIGH nibble first:
                                  byte[n, j] = q[n, 2j] << 4 | q[n, 2j + 1]
                                  (the input layout of torch._convert_weight_to_int4pack on CUDA)
         M.weight_scale  bfloat16 (out, in / group_size)
         M.weight_zero   bfloat16 (out, in / group_size)
  both:  M.bias          the model's float dtype, as before (fc_in, fc_out, lm_head)

config.json records `"quantization": {"version": 1, "mode": "int8"|"int4", "group_size": null|g,
"modules": [every quantized module name]}`; the format is read from there, never guessed.
HF transformers cannot load these checkpoints (it does not know this format); gptj can.

Kernels. The packed layout the CPU int4 kernel wants is made at load time, on the device
(see `Int4Linear.prepare`). Which kernel runs depends on how many rows (tokens) a call has:

  CPU, rows <= KERNEL_MAX_ROWS[mode]:  torch._weight_int8pack_mm / torch._weight_int4pack_mm_for_cpu
      in bfloat16 (activations of other dtypes are cast to bfloat16 for the call: the kernels'
      float32 paths are not vectorized and measured 10-30x slower than their bfloat16 paths,
      slower than a float32 F.linear on the unquantized weight).
  otherwise (prefill, CUDA, odd shapes):  dequantize the weight to the activation dtype, a
      chunk of output rows at a time, and use F.linear: weight-only kernels pay for decode
      (memory bound), not for big prefills (compute bound).
  CUDA int4 with bfloat16 activations and few rows: torch._weight_int4pack_mm when it packs
      (guarded; not tested here: this project's CI has no GPU).
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptj.errors import CheckpointError, GptjError

QUANT_MODES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the tinygemm kernels (CPU and CUDA) accept
DEFAULT_GROUP_SIZE = 128
QUANT_VERSION = 1
SCALE_DTYPE = torch.bfloat16  # scales and zeros: bfloat16 values (the kernels need them in the activation dtype)
KERNEL_DTYPE = torch.bfloat16  # the CPU kernels run in bfloat16 (their float32 paths are 10-30x slower)

# Row threshold: calls with at most this many rows (tokens) use the weight-only kernel; bigger
# ones dequantize the weight (a chunk at a time) and use F.linear. Measured with a throwaway
# script on this project's 2-core AVX512 CPU box (min of 7 runs; the box was shared, so +-50%),
# forcing each path on 4096x4096, 16384x4096 (fc_in) and 4096x16384 (fc_out) layers:
#   4096x4096, bf16, ms      rows: 1     8    64   128   256   512  1024
#   int8 kernel                    0.7   7.9   32    64     -     -     -
#   int8 dequantize + F.linear      23    26   40    48     -     -     -
#   int4 kernel                    0.5     -   14    25    50   101   337
#   int4 dequantize + F.linear       -     -   44    58    65   186   377
#   bfloat16 F.linear (unquantized) 2.1    -   16    24    72    95     -
# int8: the kernel wins up to 64 rows, dequantizing from 128 on, for all three shapes. int4: the
# CPU kernel stays close to a bfloat16 GEMM per row and dequantizing its layout is expensive, so
# the crossover is between 512 and 1024 rows. float32 activations: the kernels run in bfloat16
# (see KERNEL_DTYPE) and win to even more rows, but the dequantize path keeps float32 precision,
# so the bfloat16 crossovers are used for every activation dtype.
KERNEL_MAX_ROWS = {"int8": 16, "int4": 512}

# Largest weight chunk (elements) dequantized at once in the big-rows path: bounds the
# temporary to 32 MiB of bfloat16 (a 4096x4096 layer in one go; lm_head in 13 chunks).
DEQUANT_CHUNK_ELEMENTS = 4096 * 4096

_QUANT_KEYS = {"version", "mode", "group_size", "modules"}


# --- quantizing tensors ------------------------------------------------------------------------


def _ceil_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 values rounded UP to the nearest bfloat16 (exactly representable) value."""
    bits = x.float().contiguous().view(torch.int32)
    bits = (bits + 0xFFFF) & -0x10000  # clear the low 16 bits, rounding toward +inf (x > 0)
    return bits.view(torch.float32).to(SCALE_DTYPE)


def _row_chunks(n_rows: int, n_cols: int) -> Iterable[tuple[int, int]]:
    """Row ranges of about DEQUANT_CHUNK_ELEMENTS elements; boundaries at multiples of 256 rows
    (whole blocks of the CPU int4 layout, so a chunk of its packed rows unpacks on its own)."""
    step = max(256, DEQUANT_CHUNK_ELEMENTS // max(1, n_cols) // 256 * 256)
    for a in range(0, n_rows, step):
        yield a, min(n_rows, a + step)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (out, in), scale bfloat16 (out,)) with w ~= q * scale[:, None], |error| <= scale / 2.

    Computed in float32 a chunk of rows at a time (no float32 copy of a big weight).
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise GptjError(f"int8 quantization needs a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=SCALE_DTYPE, device=w.device)
    for a, b in _row_chunks(*w.shape):
        wf = w[a:b].float()
        s = _ceil_bf16((wf.abs().amax(dim=1) / 127).clamp_(min=2.0**-120))
        q[a:b] = torch.round(wf / s.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[a:b] = s
    return q, scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) values 0..15 -> the portable layout: uint8 (out, in / 2), high nibble first."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The portable layout uint8 (out, in / 2) -> uint8 values 0..15 (out, in)."""
    return torch.stack((packed >> 4, packed & 15), dim=-1).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 (out, in/2), scale bf16 (out, groups), zero bf16 (out, groups)).

    w ~= (q - 8) * scale + zero per group of `group_size` inputs, |error| <= scale / 2.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise GptjError(f"int4 quantization needs a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    N, K = w.shape
    check_group_size(group_size)
    if K % group_size:
        raise GptjError(f"int4 group size {group_size} does not divide the weight's {K} inputs")
    G = K // group_size
    packed = torch.empty(N, K // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(N, G, dtype=SCALE_DTYPE, device=w.device)
    zero = torch.empty(N, G, dtype=SCALE_DTYPE, device=w.device)
    for a, b in _row_chunks(N, K):
        wf = w[a:b].float().view(b - a, G, group_size)
        lo, hi = wf.amin(dim=-1), wf.amax(dim=-1)
        s0 = _ceil_bf16(((hi - lo) / 15).clamp_(min=2.0**-120)).float()
        z = (lo + 8 * s0).to(SCALE_DTYPE).float()  # bfloat16 rounding moves the range a little:
        s = _ceil_bf16(torch.maximum(s0, torch.maximum((z - lo) / 8, (hi - z) / 7)))  # widen to cover it
        sf = s.float()
        q = torch.round((wf - z[..., None]) / sf[..., None]).add_(8).clamp_(0, 15)
        packed[a:b] = pack_int4(q.view(b - a, K))
        scale[a:b] = s
        zero[a:b] = z.to(SCALE_DTYPE)
    return packed, scale, zero


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in float32, rounded once to `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - 8) * scale + zero in float32 from the portable layout, rounded once to `dtype`."""
    return _dequant_int4_values(unpack_int4(packed), scale, zero, dtype)


def _dequant_int4_values(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    N, K = q.shape
    G = scale.shape[1]
    w = (q.view(N, G, K // G).float() - 8) * scale.float()[..., None] + zero.float()[..., None]
    return w.view(N, K).to(dtype)


def check_group_size(group_size: object) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:
        raise GptjError(f"bad int4 group size {group_size!r} (choose from {', '.join(map(str, INT4_GROUP_SIZES))})")
    return group_size


def check_mode(mode: object) -> str:
    if mode not in QUANT_MODES:
        raise GptjError(f"unknown quantization mode {mode!r} (choose from {', '.join(QUANT_MODES)})")
    return mode  # type: ignore[return-value]


def quantize_weight(w: torch.Tensor, mode: str, group_size: int | None = None) -> dict[str, torch.Tensor]:
    """One float weight -> its checkpoint tensors: {"weight", "weight_scale"[, "weight_zero"]}."""
    check_mode(mode)
    if mode == "int8":
        q, s = quantize_int8(w)
        return {"weight": q, "weight_scale": s}
    packed, s, z = quantize_int4(w, group_size if group_size is not None else DEFAULT_GROUP_SIZE)
    return {"weight": packed, "weight_scale": s, "weight_zero": z}


# --- the CPU int4 kernel's packed layout ---------------------------------------------------------
#
# torch._convert_weight_to_int4pack_for_cpu(int32 (N, K) values 0..15, innerKTiles) returns
# uint8 (N, K/2) in a layout that depends on the CPU build (AVX512: blocks of 64 rows, AVX2: 32,
# ...). To avoid keeping a second, portable copy of every int4 weight in memory, we unpack it
# for the big-rows path and for state_dict(). The layout is not documented, so it is probed
# once per process against candidates; if none matches, modules keep the portable copy too.

_PACK_CHUNK_ROWS = 4096  # a multiple of every block size: packing by chunks = packing at once


def _pack_cpu_int4(q: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """Values 0..15 (N, K), or the portable layout (N, K/2) if `portable`, -> the CPU kernel's
    packed uint8 (N, K/2), a chunk of rows at a time (small int32 temporaries)."""
    N = q.shape[0]
    K = q.shape[1] * (2 if portable else 1)
    out = torch.empty(N, K // 2, dtype=torch.uint8)
    for a in range(0, N, _PACK_CHUNK_ROWS):
        b = min(N, a + _PACK_CHUNK_ROWS)
        rows = unpack_int4(q[a:b]) if portable else q[a:b]
        out[a:b] = torch._convert_weight_to_int4pack_for_cpu(rows.to(torch.int32), 1)
    return out


def _unpack_cpu_int4(packed: torch.Tensor, layout: tuple[int, bool]) -> torch.Tensor:
    """Inverse of `_pack_cpu_int4` for `layout` = (block rows, full blocks store rows i and i + block/2
    in one byte (else rows 2i and 2i + 1)); partial blocks at the end store row pairs (2i, 2i + 1)."""
    block, split = layout
    N, K = packed.shape[0], packed.shape[1] * 2
    flat = packed.reshape(-1)
    out = torch.empty(N, K, dtype=torch.uint8, device=packed.device)
    n_full = N // block
    if n_full:
        blk = flat[: n_full * block * K // 2].view(n_full, K, block // 2)
        if split:
            rows = torch.cat((blk & 15, blk >> 4), dim=2)
        else:
            rows = torch.stack((blk & 15, blk >> 4), dim=3).view(n_full, K, block)
        out[: n_full * block] = rows.permute(0, 2, 1).reshape(n_full * block, K)
    tail = N - n_full * block
    if tail:
        blk = flat[n_full * block * K // 2:].view(K, tail // 2)
        out[n_full * block:] = torch.stack((blk & 15, blk >> 4), dim=2).view(K, tail).t()
    return out


@functools.cache
def cpu_int4_layout() -> tuple[int, bool] | None:
    """The CPU int4 kernel's packed layout in this process (probed), or None if unknown."""
    if not hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        return None
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, 16, (n, 64), generator=gen, dtype=torch.uint8)
              for n in (16, 32, 48, 64, 80, 112, 128, 176)]
    try:
        packed = [_pack_cpu_int4(q) for q in probes]
    except (RuntimeError, NotImplementedError):
        return None
    for layout in ((64, True), (32, True), (64, False), (32, False), (16, False)):
        if all(torch.equal(_unpack_cpu_int4(p, layout), q) for p, q in zip(packed, probes)):
            return layout
    return None


def _cpu_int4_kernel_ok(out_features: int) -> bool:
    """torch >= 2.6 has the CPU int4 ops under these names; the packing wants out_features % 16 == 0."""
    return (hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
            and out_features % 16 == 0)


# --- modules ---------------------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _finish(m: nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A quantized linear's (rows, out) product plus its bias, in x's leading shape."""
    if m.bias is not None:
        y = y + m.bias.to(y.dtype)
    return y.view(*x.shape[:-1], m.out_features)


NATIVE_MAX_ROWS = 8  # int8: gptj.native's GEMV (1.4-3x _weight_int8pack_mm up to 8 rows, measured)
_NATIVE: list = []


def _native():  # noqa: ANN202 - the gptj.native module, or None where its kernels cannot be built
    if not _NATIVE:
        from gptj import native

        _NATIVE.append(native if native.available() else None)
    return _NATIVE[0]


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, q int8 per output channel. Buffers as in the checkpoint."""

    mode = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=SCALE_DTYPE, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.float32, device=device)
                             if bias else None)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device,
                dtype=linear.weight.dtype)
        m.weight, m.weight_scale = quantize_int8(linear.weight.detach())
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m.prepare()

    def prepare(self) -> Int8Linear:
        """Make the module ready for its device (int8 needs no packing: scales to bfloat16)."""
        if self.weight_scale.dtype != SCALE_DTYPE:
            self.weight_scale = self.weight_scale.to(SCALE_DTYPE)
        return self

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        super()._apply(fn, recurse)
        return self.prepare()  # .to(float32) would cast the scales: they stay bfloat16 values

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.weight, self.weight_scale, dtype)

    def use_kernel(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and _rows(x) <= KERNEL_MAX_ROWS["int8"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x.device.type == "cpu" and _rows(x) <= NATIVE_MAX_ROWS and _native() is not None:
            if x.dtype == KERNEL_DTYPE and self.bias is not None and self.bias.dtype == KERNEL_DTYPE:
                # bfloat16 in and out: the kernel adds the bias (one rounding, no extra pass)
                y = _native().linear_int8(x2, self.weight, self.weight_scale, self.bias)
                return y.view(*x.shape[:-1], self.out_features)
            y = _native().linear_int8(x2.to(KERNEL_DTYPE), self.weight, self.weight_scale).to(x.dtype)
        elif self.use_kernel(x):
            y = torch._weight_int8pack_mm(x2.to(KERNEL_DTYPE).contiguous(), self.weight, self.weight_scale)
            y = y.to(x.dtype)
        else:
            y = self._dequant_linear(x2)
        return _finish(self, y, x)

    def _dequant_linear(self, x2: torch.Tensor) -> torch.Tensor:
        dt = x2.dtype
        chunks = list(_row_chunks(self.out_features, self.in_features))
        if len(chunks) == 1:
            return F.linear(x2, self.weight.to(dt)) * self.weight_scale.to(dt)
        y = torch.empty(x2.shape[0], self.out_features, dtype=dt, device=x2.device)
        for a, b in chunks:
            y[:, a:b] = F.linear(x2, self.weight[a:b].to(dt)) * self.weight_scale[a:b].to(dt)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(nn.Module):
    """y = x @ ((q - 8) * scale + zero).T + bias, q 4-bit per group of `group_size` inputs.

    `state_dict()` always gives the portable checkpoint layout. In memory, after `prepare()` on
    CPU, `weight` holds the CPU kernel's packed layout instead (same shape and dtype) when this
    process knows how to unpack it (`cpu_int4_layout()`), so no second copy is kept; `layout`
    says which ("portable" or "cpu").
    """

    mode = "int4"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int = DEFAULT_GROUP_SIZE,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_group_size(group_size)
        if in_features % group_size or in_features % 2:
            raise GptjError(f"int4 group size {group_size} does not divide in_features {in_features}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        G = in_features // group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, G, dtype=SCALE_DTYPE, device=device))
        self.register_buffer("weight_zero", torch.zeros(out_features, G, dtype=SCALE_DTYPE, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.float32, device=device)
                             if bias else None)
        self.layout = "portable"
        self._kernel_weight: torch.Tensor | None = None  # packed for the kernel (CPU or CUDA)
        self._scales_and_zeros: torch.Tensor | None = None  # (groups, out, 2) bfloat16, as the kernels want
        self._prepared = False

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Linear:
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size,
                device=linear.weight.device, dtype=linear.weight.dtype)
        m.weight, m.weight_scale, m.weight_zero = quantize_int4(linear.weight.detach(), group_size)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m.prepare()

    # layouts

    def nibbles(self) -> torch.Tensor:
        """The 4-bit values, uint8 (out, in), whatever the layout in memory."""
        if self.layout == "cpu":
            return _unpack_cpu_int4(self.weight, cpu_int4_layout())
        return unpack_int4(self.weight)

    def portable_weight(self) -> torch.Tensor:
        return self.weight if self.layout == "portable" else pack_int4(self.nibbles())

    def _to_portable(self) -> None:
        if self.layout != "portable":
            self.weight = self.portable_weight()
            self.layout = "portable"
        self._kernel_weight = self._scales_and_zeros = None
        self._prepared = False

    def prepare(self) -> Int4Linear:
        """Pack the weight for the kernel of its device (once; again after a move or a load)."""
        if self._prepared or self.weight.device.type == "meta":
            return self
        for name in ("weight_scale", "weight_zero"):
            if getattr(self, name).dtype != SCALE_DTYPE:
                setattr(self, name, getattr(self, name).to(SCALE_DTYPE))
        self._to_portable()
        sz = torch.stack((self.weight_scale, self.weight_zero), dim=-1).transpose(0, 1).contiguous()
        device = self.weight.device
        if device.type == "cpu" and _cpu_int4_kernel_ok(self.out_features):
            packed = _pack_cpu_int4(self.weight, portable=True)
            self._scales_and_zeros = sz
            if cpu_int4_layout() is not None:
                self.weight, self.layout = packed, "cpu"  # the only copy
            else:
                self._kernel_weight = packed  # unknown layout: keep the portable copy for unpacking
        elif device.type == "cuda" and hasattr(torch, "_convert_weight_to_int4pack"):
            inner = next((t for t in (8, 4, 2) if self.in_features % (16 * t) == 0), None)
            if inner is not None and self.out_features % 8 == 0:
                try:  # torch >= 2.5 takes the portable uint8 (out, in/2) layout; not tested here (no GPU)
                    self._kernel_weight = torch._convert_weight_to_int4pack(self.weight.contiguous(), inner)
                    self._scales_and_zeros = sz
                except (RuntimeError, NotImplementedError):
                    self._kernel_weight = None
        self._prepared = True
        return self

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        self._to_portable()  # the packed layouts are device specific
        super()._apply(fn, recurse)
        return self.prepare()

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001 - nn.Module's signature
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.portable_weight()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        self._to_portable()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _dequant_int4_values(self.nibbles(), self.weight_scale, self.weight_zero, dtype)

    # forward

    def use_kernel(self, x: torch.Tensor) -> bool:
        if self._scales_and_zeros is None or _rows(x) > KERNEL_MAX_ROWS["int4"]:
            return False
        if x.device.type == "cpu":
            return True
        return x.device.type == "cuda" and x.dtype == torch.bfloat16 and self._kernel_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._prepared:
            self.prepare()
        x2 = x.reshape(-1, self.in_features)
        if self.use_kernel(x):
            if x.device.type == "cpu":
                w = self.weight if self.layout == "cpu" else self._kernel_weight
                y = torch._weight_int4pack_mm_for_cpu(x2.to(KERNEL_DTYPE).contiguous(), w, self.group_size,
                                                      self._scales_and_zeros)
            else:
                y = torch._weight_int4pack_mm(x2.contiguous(), self._kernel_weight, self.group_size,
                                              self._scales_and_zeros)
            y = y.to(x.dtype)
        else:
            y = self._dequant_linear(x2)
        return _finish(self, y, x)

    def _nibbles_rows(self, a: int, b: int) -> torch.Tensor:
        if self.layout == "cpu":  # a, b are multiples of 256 (or b = out_features): whole blocks
            return _unpack_cpu_int4(self.weight[a:b], cpu_int4_layout())
        return unpack_int4(self.weight[a:b])

    def _dequant_rows(self, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows a:b of the weight in `dtype`: one fused multiply-add, zero' = zero - 8 * scale."""
        s = self.weight_scale[a:b].float()
        zp = (self.weight_zero[a:b].float() - 8 * s).to(dtype)
        q = self._nibbles_rows(a, b).view(b - a, s.shape[1], self.group_size).to(dtype)
        return torch.addcmul(zp[..., None], q, s.to(dtype)[..., None]).view(b - a, self.in_features)

    def _dequant_linear(self, x2: torch.Tensor) -> torch.Tensor:
        dt = x2.dtype
        chunks = list(_row_chunks(self.out_features, self.in_features))
        if len(chunks) == 1:
            return F.linear(x2, self._dequant_rows(0, self.out_features, dt))
        y = torch.empty(x2.shape[0], self.out_features, dtype=dt, device=x2.device)
        for a, b in chunks:
            y[:, a:b] = F.linear(x2, self._dequant_rows(a, b, dt))
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group_size={self.group_size}, layout={self.layout}")


QuantLinear = (Int8Linear, Int4Linear)


# --- whole models ------------------------------------------------------------------------------------


def _float_meta_model(config: Any) -> nn.Module:
    from gptj.model import build_model

    return build_model(config.replace(quantization=None), device="meta")


def linear_names(model_or_config: Any) -> list[str]:
    """Names of every linear layer of a model (or of a float model with this config), in module order."""
    model = model_or_config if isinstance(model_or_config, nn.Module) else _float_meta_model(model_or_config)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | Int8Linear | Int4Linear)]


def _in_features(config: Any) -> dict[str, int]:
    """Module name -> in_features of every nn.Linear of a GPT-J with `config`."""
    return {n: m.in_features for n, m in _float_meta_model(config).named_modules() if isinstance(m, nn.Linear)}


def fitting_group_size(in_features: Mapping[str, int]) -> int:
    """The default int4 group for layers with these inputs (module name -> in_features):
    DEFAULT_GROUP_SIZE where it divides them all, else the largest supported size that does
    (the tiny preset's 64 inputs take 64); GptjError naming a layer if none does."""
    fits = [g for g in INT4_GROUP_SIZES if all(k % g == 0 for k in in_features.values())]
    if DEFAULT_GROUP_SIZE in fits:
        return DEFAULT_GROUP_SIZE
    if not fits:
        name, k = next((n, k) for n, k in in_features.items() if k % min(INT4_GROUP_SIZES))  # none fits: one fails 32
        raise GptjError(f"no int4 group size ({', '.join(map(str, INT4_GROUP_SIZES))}) divides the {k} inputs of "
                        f"{name} (skip that layer, or use int8)")
    return max(fits)


def make_quantization(config: Any, mode: str, group_size: int | None = None,
                      skip: Sequence[str] = ()) -> dict[str, Any]:
    """The `quantization` entry of config.json for quantizing a float GPT-J with `config`.

    mode: "int8" (per output channel; group_size must be None) or "int4" (group_size in
    32/64/128/256 dividing every quantized layer's inputs; by default 128, or where 128 does not
    divide them (small models) the largest size that does, see `fitting_group_size`). skip: module
    names or fnmatch patterns kept in float (e.g. "lm_head", "transformer.h.0.*"). wte is never quantized.
    """
    check_mode(mode)
    if mode == "int8":
        if group_size is not None:
            raise GptjError("int8 quantization is per output channel: a group size applies to int4 only")
    elif group_size is not None:
        group_size = check_group_size(group_size)
    if isinstance(skip, str):
        skip = (skip,)
    in_features = _in_features(config)
    modules = [n for n in in_features if not any(fnmatch.fnmatchcase(n, p) for p in skip)]
    if not modules:
        raise GptjError("nothing to quantize: every linear layer is skipped")
    if mode == "int4" and group_size is None:
        group_size = fitting_group_size({n: in_features[n] for n in modules})
    if mode == "int4":
        for n in modules:
            if in_features[n] % group_size:
                raise GptjError(f"int4 group size {group_size} does not divide the {in_features[n]} inputs of {n} "
                                f"(choose a group size that does, or skip it)")
    return {"version": QUANT_VERSION, "mode": mode, "group_size": group_size, "modules": sorted(modules)}


def check_quantization(q: object, config: Any, source: str = "config") -> dict[str, Any]:
    """Validate a recorded `quantization` entry against the model's shape; CheckpointError if bad."""
    if not isinstance(q, Mapping):
        raise CheckpointError(f"{source}: 'quantization' must be an object, got {type(q).__name__}")
    unknown, missing = set(q) - _QUANT_KEYS, _QUANT_KEYS - set(q)
    if unknown:
        raise CheckpointError(f"{source}: 'quantization' has unknown field {sorted(unknown)[0]!r}")
    if missing:
        raise CheckpointError(f"{source}: 'quantization' is missing field {sorted(missing)[0]!r}")
    if q["version"] != QUANT_VERSION:
        raise CheckpointError(f"{source}: quantization version {q['version']!r} is not supported "
                              f"(this gptj reads version {QUANT_VERSION})")
    mode, group_size, modules = q["mode"], q["group_size"], q["modules"]
    try:
        check_mode(mode)
        if mode == "int8" and group_size is not None:
            raise GptjError("int8 quantization has no group size (it is per output channel)")
        if mode == "int4":
            check_group_size(group_size)
    except GptjError as e:
        raise CheckpointError(f"{source}: {e}") from None
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise CheckpointError(f"{source}: quantization 'modules' must be a non-empty list of module names")
    in_features = _in_features(config)
    for m in modules:
        if m not in in_features:
            raise CheckpointError(f"{source}: quantization names {m!r}, not a linear layer of this model")
        if mode == "int4" and in_features[m] % group_size:
            raise CheckpointError(f"{source}: int4 group size {group_size} does not divide the inputs of {m}")
    return {"version": QUANT_VERSION, "mode": mode, "group_size": group_size, "modules": sorted(set(modules))}


def same_request(recorded: Mapping[str, Any], mode: str, group_size: int | None) -> bool:
    """Whether asking for (mode, group_size) is satisfied by a checkpoint quantized as `recorded`."""
    check_mode(mode)
    if mode == "int8" and group_size is not None:
        raise GptjError("int8 quantization is per output channel: a group size applies to int4 only")
    if mode == "int4" and group_size is not None:
        check_group_size(group_size)
    return recorded["mode"] == mode and (group_size is None or recorded["group_size"] == group_size)


def quantized_specs(config: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name -> (shape, dtype) of every tensor of a checkpoint with `config` (dtype None: any float).

    For a float config these are the float tensors; a config with `quantization` replaces each
    quantized weight with its quantized tensors.
    """
    meta = _float_meta_model(config)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
        n: (tuple(t.shape), None) for n, t in meta.state_dict().items()}
    q = config.quantization
    if not q:
        return specs
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    modules = set(q["modules"])
    for name, spec in specs.items():
        module, _, leaf = name.rpartition(".")
        if module in modules and leaf == "weight":
            N, K = spec[0]
            if q["mode"] == "int8":
                out[name] = ((N, K), torch.int8)
                out[f"{module}.weight_scale"] = ((N,), None)
            else:
                G = K // q["group_size"]
                out[name] = ((N, K // 2), torch.uint8)
                out[f"{module}.weight_scale"] = ((N, G), None)
                out[f"{module}.weight_zero"] = ((N, G), None)
        else:
            out[name] = spec
    return out


def is_quant_param(name: str) -> bool:
    """Scales and zeros: float tensors kept as bfloat16 whatever the model's dtype."""
    return name.endswith((".weight_scale", ".weight_zero"))


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def swap_quantized_modules(model: nn.Module, quantization: Mapping[str, Any]) -> nn.Module:
    """Replace the linears `quantization` names with EMPTY quantized modules on the same device
    (for loading a quantized state dict with `load_state_dict(assign=True)`; then `prepare_model`)."""
    for name in quantization["modules"]:
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise GptjError(f"{name} is not a float nn.Linear (already quantized?)")
        kw = {"device": lin.weight.device, "dtype": lin.weight.dtype}
        if quantization["mode"] == "int8":
            new = Int8Linear(lin.in_features, lin.out_features, lin.bias is not None, **kw)
        else:
            new = Int4Linear(lin.in_features, lin.out_features, lin.bias is not None, quantization["group_size"], **kw)
        _set_module(model, name, new)
    return model


def prepare_model(model: nn.Module) -> nn.Module:
    """Pack every quantized module for its device (after loading)."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.prepare()
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


def quantize_model(model: nn.Module, mode: str, group_size: int | None = None,
                   skip: Sequence[str] = ()) -> dict[str, Any]:
    """Quantize a float GPT-J in place (module swaps); returns the `quantization` dict, also set on
    `model.config` so that saving the model records it. lm_head is quantized unless skipped.
    A pipeline stage (`gptj.parallel.pp`) quantizes the layers it holds."""
    if is_quantized(model):
        raise GptjError("the model is already quantized")
    q = make_quantization(model.config, mode, group_size, skip)
    present = dict(model.named_modules())
    with torch.no_grad():
        for name in q["modules"]:
            lin = present.get(name)
            if lin is None:  # a layer of another pipeline stage
                continue
            new = Int8Linear.from_float(lin) if mode == "int8" else Int4Linear.from_float(lin, q["group_size"])
            _set_module(model, name, new)
    model.config = model.config.replace(quantization=q)
    return q


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], config: Any, mode: str,
                        group_size: int | None = None, skip: Sequence[str] = ()
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A float state dict -> (the quantized checkpoint's tensors, the `quantization` dict)."""
    if config.quantization:
        raise GptjError("the config is already quantized")
    q = make_quantization(config, mode, group_size, skip)
    weights = {f"{m}.weight" for m in q["modules"]}
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name in weights:
            module = name[: -len(".weight")]
            for leaf, qt in quantize_weight(t, mode, q["group_size"]).items():
                out[f"{module}.{leaf}"] = qt
        else:
            out[name] = t
    return out, q



__all__ = [
    "QUANT_MODES", "INT4_GROUP_SIZES", "DEFAULT_GROUP_SIZE", "KERNEL_MAX_ROWS", "Int8Linear", "Int4Linear",
    "quantize_int8", "quantize_int4", "dequantize_int8", "dequantize_int4", "pack_int4", "unpack_int4",
    "quantize_weight", "quantize_model", "quantize_state_dict", "make_quantization", "check_quantization",
    "quantized_specs", "swap_quantized_modules", "prepare_model", "is_quantized", "linear_names",
    "cpu_int4_layout",
]
