"""The CUDA backend: the whole decode batch of a layer in one Triton kernel launch, reading the
blocks in place; a prompt chunk after the first, or over quantized blocks, by a Triton kernel over its
blocks in place (a whole prompt over float blocks: SDPA on its own keys, the reference's path);
stores by one Triton kernel for a layer's keys and values (int8 and e4m3 quantized in it): the
reference's values bit for bit, in one launch where indexing and the quantizer take two to twenty.

The kernels (engine/attention/triton_paged.py) run one program per (decode group, KV head). A group's
rows — one sequence, or the beams of one request — are one tile of queries (R, D), a row per query
head of the KV head where models group their query heads (Llama's grouped-query attention; one for
GPT-J), so each KV head's blocks are read once for all of them: the group's shared blocks (its
prompt) are read once for all of its rows, then each row's own blocks. Scores and softmax are float32 (HF's rule),
the softmax online (flash-decoding's running max and sum, one pass over the keys and values);
quantized blocks (int8 or e4m3) are read in place with their per-token-head scales. The step's
groups come as the same int32 DecodeTables gptj.native reads, made once per step and copied to the
GPU in one go. The tile of rows is the step's largest group rounded up to a power of two, and a
compiled reduction's order follows the tile: a group's rows are the same bit for bit in any step of
the same tile, and within the arithmetic's bound across tiles (on an H200 they differed in the last
bits).

A second decode kernel, "dot", reads the group's shared blocks by tl.dot (tensor cores) on a tile of
max(16, R) rows, as the prefill kernel does (float32: IEEE; 16-bit: q and keys in their dtype, the
probabilities rounded to the values' dtype before P.V, HF's rule, float32 sums; quantized blocks
dequantized to the compute dtype), then moves the running softmax to the R rows and reads each row's
own blocks as "sum" does (blocks under 16 tokens: "sum"). Its output is within the same arithmetic's
bound, not the same bits. CudaAttention.decode_variant chooses (no user flag): "auto", the default,
chooses per group, by the group's own rows (decode_launches): single sequences run "sum" at tile 1,
groups of 2 rows or more (beam search: a group's rows share its prompt) "dot" at the step's tile, in
a second launch over the same tables (each program of the other kind's group returns at once). So a
single sequence's row is computed alike in every step, whatever else the step decodes (before,
"auto" followed the step's largest group, and a greedy row beside a beam group took "dot"'s rounded
probabilities: a difference of ~2^-9), and a beam group's rows as the tile promise above says. At
MLPerf's shape "dot" takes well under half of "sum"'s time a step (figures:
docs/PERFORMANCE.md#gpu); "dot" at tile 1 is not timed.

Split-KV (flash-decoding's): a group's shared tokens are read in spans of SPLIT_SPAN (256) tokens, a
program (group, head, span) each, the spans' running softmaxes merged in order by a second kernel
(_merge_splits_kernel; a group of one span stores its output at once, and no merge runs where no group
has two). Without it a batch-1 step had 16 programs a layer (one per head) on a GPU of 132 SMs, however
long the context; at 2k tokens it has 128. A group's spans follow its own shared length, never the
step's, so a row is the same bit for bit in a launch of any splits (tests/test_attention_backends.py);
the launch's splits cover the step's longest group (graphs: a sequence's most tokens, fixed per
bucket). Not yet timed on a GPU (the partials: under 1 % of the span's KV bytes).

num_warps follows the tile (decode_tiles): a group's own blocks are read as an (R, B, D) float32
tile, whose registers grow with R; benchmarks/gpu_compile.py compiles every variant for sm_90a on a
CPU and reports the registers and spills the choice gives.

The kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1), which is how they
are tested without a GPU (in float32 and float16: the interpreter has no bfloat16 arithmetic).
"""

from __future__ import annotations

import logging
import math

import torch

from gptj.engine.attention.base import StepMetadata, host_tensor, row_tile
from gptj.engine.attention.kv_cache import PagedKV
from gptj.engine.attention.reference import ReferenceAttention
from gptj.engine.attention import triton_paged  # the decode and prefill kernels

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl

    from gptj.quant.cuda import quantize_values, row_scale  # the quantizers' jit helpers (the KV store's)
except ImportError:  # policy.attention_path chooses this backend only where Triton is installed
    triton = None


if triton is not None:
    @triton.jit
    def _store_one(x_ptr, c_ptr, s_ptr, n, h, dst, sdst, s_xn, s_xh, D, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
        """Token n's head h of x into its block row (dst: the row's first value, sdst: its scale's place);
        QUANT 1 int8, 2 e4m3: per head vector s = max |x| / qmax (at least 2^-120), q = x / s rounded to
        nearest (int8: ties to even) within +-qmax, in float32 with IEEE divisions: torch's forms'
        values (gptj.quant.ops.quantize_rows_int8 / quantize_rows_fp8), bit for bit."""
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        x = tl.load(x_ptr + n.to(tl.int64) * s_xn + h * s_xh + d, mask=dmask, other=0.0)
        if QUANT == 0:
            tl.store(c_ptr + dst + d, x.to(c_ptr.dtype.element_ty), mask=dmask)
        else:
            xf = x.to(tl.float32)
            scale = row_scale(tl.max(tl.abs(xf), axis=0), QUANT)
            tl.store(c_ptr + dst + d, quantize_values(xf, scale, QUANT).to(c_ptr.dtype.element_ty), mask=dmask)
            tl.store(s_ptr + sdst, scale)

    @triton.jit
    def _store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, blocks_ptr, offsets_ptr,
                      s_kn, s_kh, s_vn, s_vh, s_cb, s_ch, s_ct, s_sb, s_sh, D,
                      BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
        """Program (token, head): its key and value into their block row, in one launch for both."""
        n = tl.program_id(0)
        h = tl.program_id(1)
        block = tl.load(blocks_ptr + n).to(tl.int64)
        offset = tl.load(offsets_ptr + n).to(tl.int64)
        dst = block * s_cb + h * s_ch + offset * s_ct
        sdst = block * s_sb + h * s_sh + offset
        _store_one(k_ptr, kc_ptr, ks_ptr, n, h, dst, sdst, s_kn, s_kh, D, BLOCK_D, QUANT)
        _store_one(v_ptr, vc_ptr, vs_ptr, n, h, dst, sdst, s_vn, s_vh, D, BLOCK_D, QUANT)


_STORE_QUANT = {torch.int8: 1, torch.float8_e4m3fn: 2}

if triton is not None:
    @triton.jit(do_not_specialize=["C"])  # the step's copies: one binary for any number
    def _copy_kernel(t_ptr, copies_ptr, C, layer_stride, block_stride, head_stride, row, H,
                     CHUNK: tl.constexpr):
        """Program (c, layer * H + head): the first n tokens of block src into block dst, one head
        of one layer (its rows 0..n-1 are n * row contiguous elements: row = D, 1 for scales),
        copies (3, C): rows src, dst, n. The elements move as integers of their width: bits."""
        c = tl.program_id(0)
        lh = tl.program_id(1)
        src = tl.load(copies_ptr + c).to(tl.int64)
        dst = tl.load(copies_ptr + C + c).to(tl.int64)
        n = tl.load(copies_ptr + 2 * C + c)
        base = (lh // H).to(tl.int64) * layer_stride + (lh % H).to(tl.int64) * head_stride
        a = t_ptr + base + src * block_stride
        b = t_ptr + base + dst * block_stride
        size = n * row
        for start in range(0, size, CHUNK):
            i = start + tl.arange(0, CHUNK)
            m = i < size
            tl.store(b + i, tl.load(a + i, mask=m), mask=m)


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
COPY_CHUNK = 1024  # elements a loop step of _copy_kernel (2 KiB of bfloat16: a few per head block)


def copy_blocks(stacked: list[torch.Tensor], copies: list[tuple[int, int, int]]) -> None:
    """PagedKV.copy by the Triton kernel: block dst gets block src's first n tokens in every layer and
    head of each tensor of `stacked` (PagedKV.stacked: keys and values (L, n_blocks, H, B, D), scales
    (L, n_blocks, H, B), contiguous), each (src, dst, n) of `copies` (dst blocks fresh: no dst is a
    src). Only the n tokens move, where the reference's indexing moves whole blocks through a gather and
    a scatter (its cost at MLPerf's shape: docs/PERFORMANCE.md#gpu); the rows from n on are not the
    sequence's yet (PagedKV.copy). One launch per tensor, the table of copies
    moved to the device in one copy."""
    if not copies:
        return
    device = stacked[0].device
    table = host_tensor([c[0] for c in copies] + [c[1] for c in copies] + [c[2] for c in copies], torch.int32)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    else:
        table = table.to(device)
    for t in stacked:
        if not t.is_contiguous() or t.element_size() not in _INT_OF_WIDTH:
            raise ValueError("copy_blocks: contiguous KV tensors of 1, 2 or 4 bytes an element")
        bits = t.view(_INT_OF_WIDTH[t.element_size()])
        L, _, H = t.shape[:3]
        head = t[0, 0, 0].numel()  # B * D (B for scales)
        row = t.stride(3) if t.dim() == 5 else 1
        _copy_kernel[(len(copies), L * H)](bits, table, len(copies), t.stride(0), t.stride(1), t.stride(2), row, H,
                                           CHUNK=min(COPY_CHUNK, triton.next_power_of_2(head)))


def store_kv(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, blocks: torch.Tensor,
             offsets: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Token n's key and value k[n], v[n] (N, H, D), each head's D values contiguous, into block
    blocks[n], row offsets[n] of kc, vc (n_blocks, H, B, D) contiguous: one kernel for both, where
    indexing takes two (float) or some twenty (int8 / e4m3 with their k_scale, v_scale (n_blocks, H,
    B): the quantizer's passes). The values stored are PagedKV.write's, bit for bit."""
    if triton is None:
        raise RuntimeError("the CUDA attention backend needs Triton (pip install triton)")
    N, H, D = k.shape
    quant = _STORE_QUANT.get(kc.dtype, 0)
    if (k.stride(-1) != 1 or v.stride(-1) != 1 or v.shape != k.shape or not kc.is_contiguous()
            or not vc.is_contiguous() or (quant and k_scale is None)):
        raise ValueError("store_kv: heads with contiguous values, contiguous KV blocks (and scales if quantized)")
    if N == 0:
        return
    ks, vs = (k_scale, v_scale) if quant else (kc, vc)
    _store_kernel[(N, H)](k, v, kc, vc, ks, vs, blocks, offsets, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                          kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0) if quant else 0,
                          ks.stride(1) if quant else 0, D, BLOCK_D=triton.next_power_of_2(D), QUANT=quant)


PREFILL_TILE = 16  # queries per program (tl.dot's smallest tile); key blocks of 16 tokens or more
DECODE_VARIANTS = ("sum", "dot", "auto")  # paged_decode's kernels (CudaAttention.decode_variant)
DOT_MIN_ROWS = 2  # "auto": the "dot" kernel for steps whose largest group has this many rows or more


ANY_ROWS = 1 << 30  # a launch's upper bound on a group's rows where it takes them all


def decode_launches(variant: str, max_rows: int, block_size: int) -> list[tuple[str, int, int, int]]:
    """The decode kernels a step launches, as (kernel "sum" or "dot", tile of rows, lo, hi): each
    launch computes the groups of lo to hi rows (a program of another group returns at once), for a
    step whose largest group has max_rows rows over blocks of block_size tokens (tl.dot needs 16).
    `variant` as paged_decode takes it: "sum" and "dot" run every group in that kernel at the step's
    tile; "auto" chooses per group, by the group's own rows: single sequences "sum" at tile 1 (alike
    in any step: a greedy row beside beam groups is computed as it is alone), groups of DOT_MIN_ROWS
    rows or more (beams sharing their prompt's blocks) "dot" at the step's tile."""
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"paged_decode: variant {variant!r}, not one of {', '.join(DECODE_VARIANTS)}")
    tile = row_tile(max_rows)
    dot = "dot" if block_size >= PREFILL_TILE else "sum"
    if variant == "sum":
        return [("sum", tile, 1, ANY_ROWS)]
    if variant == "dot":
        return [(dot, tile, 1, ANY_ROWS)]
    if max_rows < DOT_MIN_ROWS:
        return [("sum", 1, 1, ANY_ROWS)]
    return [("sum", 1, 1, DOT_MIN_ROWS - 1), (dot, tile, DOT_MIN_ROWS, ANY_ROWS)]


# float32 values of an (R, KEYS, D) tile a thread of the decode kernels holds at 4 warps (keys; the
# values and products as many again): 64 compiles to ~128 registers with no spills for sm_90a (tile 2
# over blocks of 16 heads of 256: benchmarks/gpu_compile.py), where a whole block a step at tile 4 or
# more spilled (tile 8: 1.4-2.9 KB; 16 warps did not help: they allow 128 registers a thread).
TILE_VALUES_PER_THREAD = 64
# from this tile on, 8 warps: "dot" at 4 warps spilled 20-64 B at tiles 4 and 16 (bf16) under Triton 3.9,
# 8 B at tile 2 (int8 / e4m3 KV) under 3.6; at 8 warps none under either (docs/GPU.md, "Compiled without a GPU")
WIDE_TILE = 2
# grouped-query attention's tiles (a lane per row and query head) read at most this many keys a step:
# at Llama-3.1-8B's heads (4 query heads a KV head, 128 values) tile 1's 4 lanes x 16 keys spilled 8 B
# (int8 KV, 8 warps, sm_90a, Triton 3.9: benchmarks/gpu_compile.py), 8 keys none (109 registers)
GROUPED_KEYS = 8


def decode_tiles(tile: int, block_size: int, head_dim: int, group: int = 1) -> tuple[int, int]:
    """(KEYS, num_warps) of a decode kernel over groups of `tile` rows, `group` lanes a row (a KV
    head's query heads, a power of two; 1 without grouping): the tokens of a block read a loop step (a
    power of two dividing block_size) so that an (R, KEYS, D) tile of float32 keys (R: the lanes) is
    TILE_VALUES_PER_THREAD values a thread of 4 warps (grouped: GROUPED_KEYS at most), and the warps
    (8 from WIDE_TILE lanes). A row's sums follow KEYS: a group's rows are the same bit for bit in any
    step of the same tile (and block size). Tile 1 over blocks of 16 (single sequences, the default)
    reads a whole block a step, as the kernel did before KEYS."""
    lanes = tile * group
    budget = TILE_VALUES_PER_THREAD * 32 * 4 // (lanes * triton.next_power_of_2(head_dim))
    keys = 1 << max(0, budget.bit_length() - 1) if budget else 1
    if group > 1:
        keys = min(keys, GROUPED_KEYS)
    return min(block_size, keys), 8 if lanes >= WIDE_TILE else 4


def kv_groups(name: str, heads: int, kc: torch.Tensor) -> tuple[int, int, int]:
    """(KV heads, GROUP query heads each, GP: GROUP rounded up to a power of two) of blocks kc
    (n_blocks, KV heads, B, D) read by `heads` query heads (grouped-query attention: query head h
    reads KV head h // GROUP; the kernels' tile has GP lanes per KV head and row)."""
    kv_heads = kc.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{name}: {heads} query heads are not whole groups of the blocks' {kv_heads} KV heads")
    group = heads // kv_heads
    return kv_heads, group, triton.next_power_of_2(group)


def paged_prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, start: int,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt chunk's causal attention over its sequence's blocks, in place (the Triton kernel).

    q (T, H, D): the queries of positions start .. start + T - 1, each head's D values contiguous;
    kc, vc (n_blocks, KH, B, D) contiguous with B >= 16, KH dividing H (query head h reads KV head
    h // (H // KH): kv_groups; a program a tile of queries and KV head), the chunk's own keys and values already
    stored (float, or int8 / e4m3 with scales as paged_decode's); table: the sequence's blocks (int64),
    at least ceil((start + T) / B). -> (T, H, D) in q's dtype: float32 scores and softmax; below
    float32 the probabilities are rounded to the values' dtype before the sum (HF's rule)."""
    if triton is None:
        raise RuntimeError("the CUDA attention backend needs Triton (pip install triton)")
    T, H, D = q.shape
    B = kc.shape[2]
    if q.stride(-1) != 1 or not kc.is_contiguous() or not vc.is_contiguous() or B < PREFILL_TILE:
        raise ValueError("paged_prefill: contiguous heads and KV blocks of at least 16 tokens")
    kv_heads, group, gp = kv_groups("paged_prefill", H, kc)
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    quantized = k_scale is not None
    ks, vs = (k_scale, v_scale) if quantized else (kc, vc)
    triton_paged._paged_prefill_kernel[(triton.cdiv(T, PREFILL_TILE), kv_heads)](
        q, kc, vc, ks, vs, out, table, start, T, 1.0 / math.sqrt(D), D,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0) if quantized else 0, ks.stride(1) if quantized else 0, out.stride(0), out.stride(1),
        B=B, BLOCK_M=PREFILL_TILE, BLOCK_D=triton.next_power_of_2(D), QUANTIZED=quantized,
        IEEE=q.dtype == torch.float32, GROUP=group, GP=gp)
    return out


# A group's shared tokens are read in spans of SPLIT_SPAN tokens, each span by a program of its own (the
# launch's third axis), merged after (split-KV, flash-decoding's): at batch 1 a layer's 16 programs (one
# per head) would leave most of a GPU's 132 SMs idle, at 2k tokens 8 spans give 128. The partials move
# (D + 2) floats per row, head and span, under 1 % of the span's keys and values (256 tokens of 2 x D).
# The rule depends on a group's own length only (never the step's), so a row's arithmetic does not
# depend on its neighbours; a multiple of every block size (16, 32, 64) and of KEYS.
SPLIT_SPAN = 256


def decode_splits(max_shared: int, span: int = SPLIT_SPAN) -> int:
    """The splits a decode launch runs for groups of up to max_shared shared tokens (at least one)."""
    return max(1, -(-max_shared // span))


def paged_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: tuple[torch.Tensor, ...],
                 max_rows: int, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                 variant: str = "sum", max_shared: int = 0, span: int = SPLIT_SPAN) -> torch.Tensor:
    """Decode attention of a whole batch over paged blocks (the Triton kernel) -> (N, H, D) of
    out_dtype: float32 sums rounded once to it (in the kernel, as a cast after it would round them).
    variant: "sum" (float32 on CUDA cores throughout), "dot" (the shared blocks by tl.dot, as the
    module says; blocks of fewer than 16 tokens, below tl.dot's smallest tile, run "sum") or "auto"
    (per group: "sum" for single sequences, "dot" for groups of DOT_MIN_ROWS rows or more):
    decode_launches.

    q (N, H, D), each head's D values contiguous; kc, vc (n_blocks, KH, B, D) contiguous, KH dividing
    H (query head h reads KV head h // (H // KH): kv_groups; a program a group and KV head, its tile
    a lane per row and query head of it), float, or
    int8 or e4m3 with k_scale, v_scale (n_blocks, KH, B) float32 (the value is q * scale); tables: the
    step's DecodeTables (row0, stab, soff, slen, otab, olen) on q's device; max_rows: the most rows
    of one group; max_shared: the most shared tokens of one group (DecodeTables.max_shared), which
    sets the launch's splits (decode_splits): a group's spans of `span` tokens (SPLIT_SPAN; a multiple
    of the block size) each run as a program of their own, merged by a second kernel. A row's result
    depends on its group's length and the span only: the same bits in a launch of any splits that
    cover its group (a smaller max_shared than the groups' is still right: the last split takes the
    rest). Block ids and lengths are the caller's to keep in range."""
    if triton is None:
        raise RuntimeError("the CUDA attention backend needs Triton (pip install triton)")
    N, H, D = q.shape
    B = kc.shape[2]
    if q.stride(-1) != 1 or not kc.is_contiguous() or not vc.is_contiguous():
        raise ValueError("paged_decode: q's heads and the KV blocks must be contiguous")
    if span < 1 or span % B:
        raise ValueError(f"paged_decode: a span of {span} tokens is not a multiple of the block size {B}")
    kv_heads, group, gp = kv_groups("paged_decode", H, kc)
    row0, stab, soff, slen, otab, olen = tables
    out = torch.empty((N, H, D), dtype=out_dtype, device=q.device)
    S = decode_splits(max_shared, span)
    # the splits' partials: (acc) and (m, den) per (row, head, split), and each row's spans; with one
    # split none (a float32 and an int32 element: the kernel's pointer types alike in every launch; made
    # here, not kept: a captured step reads only its own tensors, tests/test_graphs.py)
    shape = (N, H, S) if S > 1 else (1, 1, 1)
    pacc = torch.empty((*shape, D if S > 1 else 1), dtype=torch.float32, device=q.device)
    pml = torch.empty((*shape, 2), dtype=torch.float32, device=q.device)
    pspan = torch.empty(shape[:2], dtype=torch.int32, device=q.device)
    quantized = k_scale is not None
    ks, vs = (k_scale, v_scale) if quantized else (kc, vc)  # (unread when not quantized)
    args = (q, kc, vc, ks, vs, out, row0, stab, soff, slen, otab, olen, pacc, pml, pspan, otab.shape[1])
    strides = (1.0 / math.sqrt(D), H, D, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
               ks.stride(0) if quantized else 0, ks.stride(1) if quantized else 0, out.stride(0), out.stride(1))
    grid = (len(soff), kv_heads, S)
    for kernel, tile, lo, hi in decode_launches(variant, max_rows, B):
        keys, warps = decode_tiles(tile, B, D, gp)  # the tile's lanes: rows x the group's query heads
        sizes = dict(B=B, KEYS=keys, SPAN=span, BLOCK_R=tile, BLOCK_D=triton.next_power_of_2(D),
                     QUANTIZED=quantized, GROUP=group, GP=gp, num_warps=warps)
        if kernel == "dot":
            triton_paged._paged_decode_dot_kernel[grid](*args, lo, hi, S, *strides, DOT_R=max(PREFILL_TILE, tile * gp),
                                                        IEEE=q.dtype == torch.float32, **sizes)
        else:
            triton_paged._paged_decode_kernel[grid](*args, lo, hi, S, *strides, **sizes)
    if S > 1:
        triton_paged._merge_splits_kernel[(N, H)](pacc, pml, pspan, out, H, S, D, out.stride(0), out.stride(1),
                                                  BLOCK_D=triton.next_power_of_2(D))
    return out


class CudaAttention(ReferenceAttention):
    """Decode and stores by the Triton kernels; prefill as the module says. If the decode or
    prefill kernel fails (a Triton or GPU this was not built for), it logs one warning and attends
    as the reference does from then on (`kernel_ok` False; graphs.py then stops replaying); if the
    store kernel fails, only the stores go back to the reference's indexing (`store_ok` False)."""

    name = "cuda"
    reads_tables = True
    stairs = False  # (the Triton decode kernel owns as many tokens in every row of a group)
    decode_variant = "auto"  # paged_decode's kernels ("auto", "sum" or "dot": decode_launches; no user flag)

    @property
    def kernel_ok(self) -> bool:
        """Whether the decode and prefill kernels run here (Triton is installed, and neither failed)."""
        return triton is not None and self.fallbacks.ok("attention")

    @property
    def store_ok(self) -> bool:
        """Whether the store and copy kernels run here."""
        return triton is not None and self.fallbacks.ok("store")

    def decode(self, kv: PagedKV, layer: int, q: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        if self.kernel_ok:
            tables = meta.tables
            try:
                return paged_decode(q, kv.k[layer], kv.v[layer], tables.astuple(), tables.max_rows, *kv.scales(layer),
                                    out_dtype=kv.compute, variant=self.decode_variant, max_shared=tables.max_shared)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run here: the reference's forms
                self._kernel_failed("decode", e)
        return super().decode(kv, layer, q, meta)

    def copy(self, kv: PagedKV, copies) -> None:
        """The copy-on-write by the Triton kernel (copy_blocks: only each copy's tokens); the
        reference's indexing where it cannot run (with the store kernel's flag: both move KV bytes)."""
        if self.store_ok and copies:
            try:
                copy_blocks(kv.stacked, copies)
                return
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run here: the reference's indexing
                self._kernel_failed("copy", e)
        super().copy(kv, copies)

    def store(self, kv: PagedKV, layer: int, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
              offsets: torch.Tensor) -> None:
        """One Triton kernel for the keys and values (their quantizing included), the reference's
        values; the reference's indexing where the kernel cannot run."""
        if self.store_ok and k.stride(-1) == v.stride(-1) == 1:
            try:
                store_kv(k, v, kv.k[layer], kv.v[layer], blocks, offsets, *kv.scales(layer))
                return
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run here: the reference's indexing
                self._kernel_failed("store", e)
        super().store(kv, layer, k, v, blocks, offsets)

    def _kernel_failed(self, which: str, error: Exception) -> None:
        """One warning (gptj.fallback); the store or copy kernel's failure turns off both (the KV's
        writes go back to indexing), another's the attention."""
        if which in ("store", "copy"):
            self.fallbacks.fail("store", f"the Triton {which} kernel", error,
                                "keys and values are stored and copied by indexing")
        else:
            self.fallbacks.fail("attention", f"the Triton {which} kernel", error,
                                "attention runs the reference backend's forms")

    def prefill(self, kv: PagedKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata, i: int) -> torch.Tensor:
        """A whole prompt from position 0 over float blocks: SDPA on the chunk's own keys (no gather,
        the reference's path). A later chunk, or quantized blocks: the Triton kernel over the blocks in
        place (blocks of 16 tokens or more; else the reference's gather)."""
        seg = meta.segments[i]
        if (seg.start == 0 and not kv.quantized) or not self.kernel_ok or kv.block_size < PREFILL_TILE:
            return super().prefill(kv, layer, q, k, v, meta, i)
        try:
            return paged_prefill(q, kv.k[layer], kv.v[layer], meta.slots[i].table, seg.start, *kv.scales(layer))
        except Exception as e:  # noqa: BLE001 - as decode's
            self._kernel_failed("prefill", e)
            return super().prefill(kv, layer, q, k, v, meta, i)
