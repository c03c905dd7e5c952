"""Every attention backend (gptj.engine.attention) against exact arithmetic and against the reference:
decode over a paged pool (single sequences with partial blocks, beam groups sharing a prompt, a
group with no shared block), float and int8 KV; the metadata a step builds; an engine on each
backend gives the reference's tokens, and requests together equal each alone.

The CUDA backend's Triton kernel runs here under Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1 without a GPU): in float32 and float16, since the interpreter has no bfloat16
arithmetic (triton-lang/triton issues 4972, 11584). gptj.native's backend runs where the CPU has
it (bfloat16). On a GPU the same tests run the compiled kernel on CUDA tensors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gptj import native, policy
from gptj.config import GPTJConfig
from gptj.decode import GenerationConfig
from gptj.engine import Engine, EngineConfig
from gptj.engine import attention as att
from gptj.engine.attention.reference import ReferenceAttention
from gptj.models.gptj import build_model
from test_engine import CFG, MIXED, prompts_of
from conftest import use_isa
from test_engine import model  # noqa: F401 - the fixture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_reason(what: str = "the CUDA backend's kernels") -> str | None:
    """Why Triton kernels (`what`) cannot run here, or None."""
    if not policy.triton_available():
        return f"Triton is not installed ({what}): pip install triton"
    import triton

    if DEVICE == "cpu" and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        return (f"Triton {triton.__version__}'s interpreter cannot run loops bounded by loaded values under "
                "numpy 2.4 (3.9's can): pip install 'triton>=3.9'")
    return None


needs_triton = pytest.mark.skipif(triton_reason() is not None, reason=str(triton_reason()))
needs_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (benchmarks/gpu_check.py runs it there)")
pytestmark = pytest.mark.cuda  # gpu_check.py's tests step (-m cuda)
# MIXED's requests, at most 5 new tokens each: Triton's interpreter runs each kernel program in Python
SHORT_MIXED = [g.replace(max_new_tokens=min(g.max_new_tokens, 5), min_new_tokens=min(g.min_new_tokens, 3))
               for g in MIXED]
# the unit roundoff of each compute dtype (bfloat16 keeps 8 significant bits, float16 11, float32 24)
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


@pytest.fixture(scope="module")
def two_heads(model):  # noqa: F811 - the fixture
    """test_engine's model (2 layers, 4 heads of 16) with its very weights read as 2 heads of 32: the
    engine tests on the Triton kernels run a program per (decode group, head) and per (stored token,
    head), so under the interpreter (a program at a time, in Python) half the heads take half the
    time; two heads still check each head's own slice of q, the blocks and the output."""
    net = build_model(dataclasses.replace(CFG, n_head=2))
    net.load_state_dict(model.state_dict())  # the weights' shapes do not depend on the heads
    return net.eval()


def backends() -> list:
    """(backend, compute dtype) pairs this machine runs, each with a skip reason where it cannot."""
    cuda_reason = triton_reason()
    native_reason = native.unavailable_reason()
    return [
        pytest.param("cuda", torch.float32, marks=pytest.mark.skipif(cuda_reason is not None, reason=str(cuda_reason))),
        pytest.param("cuda", torch.float16, marks=pytest.mark.skipif(cuda_reason is not None, reason=str(cuda_reason))),
        # the "dot" decode kernel (CudaAttention.decode_variant): the shared blocks by tl.dot
        pytest.param("cuda/dot", torch.float32, marks=pytest.mark.skipif(cuda_reason is not None,
                                                                         reason=str(cuda_reason))),
        pytest.param("cuda/dot", torch.float16, marks=pytest.mark.skipif(cuda_reason is not None,
                                                                         reason=str(cuda_reason))),
        *(pytest.param(f"cpu-native/{isa.name}", torch.bfloat16, marks=pytest.mark.skipif(
            native_reason is not None or DEVICE != "cpu", reason=f"native kernels unavailable: {native_reason}"))
          for isa in native.ISAS),  # each ISA's library (conftest.use_isa skips the ones this CPU lacks)
        pytest.param("reference", torch.float32),
        pytest.param("reference", torch.bfloat16),
    ]


def make_pool(H: int, D: int, B: int, n_blocks: int, storage: str, compute: torch.dtype, seed: int) -> att.PagedKV:
    """Every block filled with random keys and values (int8 / e4m3: rounded as the engine stores them)."""
    cfg = GPTJConfig(n_layer=1, n_embd=H * D, n_head=H, rotary_dim=8, n_inner=4 * H * D, n_positions=512)
    dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(storage, compute)
    kv = att.PagedKV(cfg, n_blocks, B, dtype, DEVICE, n_head=H, compute=compute)
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n_blocks * B, H, D, generator=g).to(compute).to(DEVICE) for _ in range(2))
    slots = torch.arange(n_blocks * B, device=DEVICE)
    kv.write(0, k, v, slots // B, slots % B)
    return kv


def exact_values(kv: att.PagedKV, blocks: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) (H, length, D) of a block table in float64: what the pool holds, exactly."""
    index = torch.tensor(blocks, dtype=torch.long, device=DEVICE)
    H, D = kv.k[0].shape[1], kv.k[0].shape[3]
    out = []
    for cache, scales in ((kv.k[0], kv.k_scale[0] if kv.quantized else None),
                          (kv.v[0], kv.v_scale[0] if kv.quantized else None)):
        x = cache[index].double()
        if scales is not None:
            x = x * scales[index].double()[..., None]
        out.append(x.transpose(0, 1).reshape(H, -1, D)[:, :length])
    return out[0], out[1]


def groups_of(B: int, perm: list[int]) -> list[att.DecodeGroup]:
    return [att.DecodeGroup(perm[:3], 3 * B - 5, [[]], 0),  # one sequence, its last block partial
            att.DecodeGroup(perm[3:4], 1, [[]], 0),  # one sequence of one token
            att.DecodeGroup(perm[4:6], 2 * B, [perm[6:8], perm[8:10], perm[10:12]], B + 3),  # 3 beams
            att.DecodeGroup([], 0, [perm[12:13], perm[13:14]], 5)]  # 2 beams, a prompt shorter than a block


@pytest.mark.parametrize("backend, compute", backends())
@pytest.mark.parametrize("storage", ["float", "int8", "fp8"])
@pytest.mark.parametrize("B, H, D", [(8, 3, 48), (16, 2, 256)], ids=["B8-3x48", "B16-2x256"])
def test_decode_is_within_the_arithmetics_bound_of_exact(backend, compute, storage, B, H, D, monkeypatch):
    """Each row's attention over [its group's shared blocks | its own] against float64 over the same
    stored values. Bound, from the arithmetic (u: the compute dtype's unit roundoff): scores rounded
    to the dtype and keys/values dequantized to it move each score by <= u (max|s| + max sum|q k| /
    sqrt(D)) =: delta, so the probabilities by factors within e^(+-2 delta) and the output by <= 2.01
    delta max|v|; probabilities and values rounded to the dtype (<= 2u p.|v|) and the output's own
    rounding (u |out|); float32 sums and the online softmax's rescales (<= (4 L + 16) 2^-24 max|v|).

    The cuda backend's "dot" kernel (shared blocks by tl.dot) is held to the same bound, derived for
    its arithmetic: its scores are float32 sums of exact products of q and keys in the compute dtype
    (quantized keys dequantized to it: <= u sum|q k| / sqrt(D), in delta); below float32 each
    probability is rounded to the dtype before P.V, a relative error <= u per probability, so <= u
    p.|v| on the output (the first u of the 2u p.|v| term: the reference rounds them too, HF's rule),
    and dequantized values rounded to the dtype add <= u p.|v| (the second); float32 (IEEE) and the
    denominators as the "sum" kernel's. Blocks of 8 tokens are below tl.dot's tile (the "sum" kernel
    runs): only B16 runs it."""
    variant = "sum"
    if backend == "cuda/dot":
        if B < 16:
            pytest.skip("blocks under 16 tokens: paged_decode runs the sum kernel for the dot variant")
        backend, variant = "cuda", "dot"
    if backend.startswith("cpu-native/"):
        backend, isa = backend.split("/")
        use_isa(monkeypatch, isa)
    if backend == "cpu-native" and D % 16:
        pytest.skip("gptj.native reads heads of a multiple of 16")
    if backend == "cpu-native" and storage == "fp8":
        pytest.skip("gptj.native does not read e4m3 blocks (the policy sends them to the reference)")
    kv = make_pool(H, D, B, 20, storage, compute, seed=B + D)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(1)).tolist()
    groups = groups_of(B, perm)
    impl = att.make_backend(policy.AttentionPath(backend, False))
    if backend == "cuda":
        impl.decode_variant = variant  # each kernel by name (the default, "auto", picks by the step's groups)
    meta = impl.build(kv, groups, [0] * 7, [0] * 7)
    q = torch.randn(7, H, D, generator=torch.Generator().manual_seed(2)).to(compute).to(DEVICE)
    got = impl.decode(kv, 0, q, meta).double()
    assert got.shape == (7, H, D) and got.dtype == torch.float64
    assert_within_the_bound(kv, groups, q, got, UNIT[compute])
    assert getattr(impl, "kernel_ok", True)  # the kernel ran (not the reference's forms after a failure)


def assert_within_the_bound(kv: att.PagedKV, groups: list[att.DecodeGroup], q: torch.Tensor, got: torch.Tensor,
                            u: float) -> None:
    """Each row of `got` (N, H, D) float64 within the decode test's bound (its docstring) of float64
    attention over the stored values; u: the compute dtype's unit roundoff."""
    D = q.shape[-1]
    row = 0
    for g in groups:
        for own in g.own:
            k, v = exact_values(kv, g.shared + own, g.shared_len + g.own_len)
            qn = q[row].double()
            s = (qn[:, None, :] * k).sum(-1) / D**0.5  # (H, L)
            p = torch.softmax(s, -1)
            want = (p[..., None] * v).sum(-2)
            delta = u * (s.abs().amax(-1) + (qn[:, None, :] * k).abs().sum(-1).amax(-1) / D**0.5)
            vmax = v.abs().amax((1, 2))[:, None]
            L = k.shape[1]
            pv = (p[..., None] * v.abs()).sum(-2)  # (H, D): p @ v.abs() would broadcast to (H, H, D)
            bound = u * (want.abs() + 2 * pv) + (2.01 * delta[:, None] + (4 * L + 16) * 2.0**-24) * vmax
            assert bound.shape == want.shape
            err = (got[row] - want).abs()
            assert (err <= bound).all(), (row, float((err / bound).max()))
            row += 1
    assert row == len(got)


def test_auto_runs_the_dot_kernel_for_beam_groups_and_the_sum_kernel_for_single_sequences():
    """CudaAttention's default decode variant "auto", per group: tensor cores (dot, at the step's tile)
    for groups whose rows share their prompt's blocks (beam search), "sum" at tile 1 for single
    sequences, "sum" over blocks below tl.dot's 16-token tile whatever was asked; "sum" and "dot" run
    every group at the step's tile; a variant it does not know is refused."""
    from gptj.engine.attention import cuda

    every = cuda.ANY_ROWS
    assert cuda.CudaAttention.decode_variant == "auto"
    assert cuda.decode_launches("auto", 1, 16) == [("sum", 1, 1, every)]
    assert cuda.decode_launches("auto", 3, 16) == [("sum", 1, 1, 1), ("dot", 4, 2, every)]
    assert cuda.decode_launches("auto", 9, 8) == [("sum", 1, 1, 1), ("sum", 16, 2, every)]
    assert cuda.decode_launches("dot", 1, 16) == [("dot", 1, 1, every)]
    assert cuda.decode_launches("sum", 4, 16) == [("sum", 4, 1, every)]
    assert cuda.decode_launches("dot", 4, 8) == [("sum", 4, 1, every)]
    with pytest.raises(ValueError, match="variant 'tensor'"):
        cuda.decode_launches("tensor", 1, 16)


@needs_triton
@pytest.mark.parametrize("compute", [torch.float32, torch.float16])
def test_the_dot_kernel_on_a_group_of_sixteen_rows_is_within_the_bound(compute):
    """The "dot" decode kernel where the tile of rows is tl.dot's (a group of 9 beams: 16 rows, no
    move between tiles) beside a one-row group, int8 blocks: within the decode test's bound."""
    H, D, B = 2, 64, 16
    kv = make_pool(H, D, B, 16, "int8", compute, seed=11)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(12)).tolist()
    groups = [att.DecodeGroup(perm[:2], 2 * B, [[b] for b in perm[2:11]], 6),  # 9 beams
              att.DecodeGroup(perm[11:13], B + 1, [[]], 0)]
    impl = att.make_backend(policy.AttentionPath("cuda", False))
    impl.decode_variant = "dot"
    meta = impl.build(kv, groups, [0] * 10, [0] * 10)
    assert meta.tables.max_rows == 9
    q = torch.randn(10, H, D, generator=torch.Generator().manual_seed(13)).to(compute).to(DEVICE)
    assert_within_the_bound(kv, groups, q, impl.decode(kv, 0, q, meta).double(), UNIT[compute])
    assert impl.kernel_ok


@needs_triton
@pytest.mark.parametrize("variant, B", [("sum", 8), ("dot", 16)])  # dot: blocks of 16 (tl.dot's tile)
@pytest.mark.parametrize("storage", ["float", "int8", "fp8"])
def test_the_cuda_kernel_gives_each_row_what_it_gives_it_alone(storage, variant, B):
    """Batch invariance at a tile: a group's rows computed with the whole step's groups equal the
    same group computed alone in the same tile of rows, bit for bit (one program per group and head:
    nothing is shared across groups). The tile (the step's largest group, to a power of two) shapes
    the compiled reduction, and its order: on an H200 (2026-11-27) a group's rows differed in their
    last bits between tiles, so across tiles the promise is the arithmetic's bound (the test above),
    and CUDA graphs are captured per tile. Both decode kernels ("dot": the shared blocks by tl.dot on a
    tile of 16 rows, whatever the group's)."""
    kv = make_pool(2, 64, B, 20, storage, torch.float32, seed=3)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(4)).tolist()
    groups = groups_of(B, perm)
    impl = att.make_backend(policy.AttentionPath("cuda", False))
    impl.decode_variant = variant
    q = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    meta = impl.build(kv, groups, [0] * 7, [0] * 7)
    together = impl.decode(kv, 0, q, meta)
    row = 0
    for g in groups:
        alone_meta = impl.build(kv, [g], [0] * g.rows, [0] * g.rows)
        assert alone_meta.tables.max_rows == g.rows <= meta.tables.max_rows
        alone_meta.tables.max_rows = meta.tables.max_rows  # the step's tile
        alone = impl.decode(kv, 0, q[row:row + g.rows], alone_meta)
        assert torch.equal(alone, together[row:row + g.rows])
        row += g.rows
    assert impl.kernel_ok


@needs_triton
@pytest.mark.parametrize("storage", ["float", "int8"])
def test_auto_computes_a_single_sequence_alike_beside_beam_groups(storage):
    """Batch invariance under the default "auto": a single sequence's row is the same bit for bit in a
    step of single sequences and in a step that also decodes beam groups (whose shared prompt blocks
    "dot" reads by tl.dot, rounding the probabilities to the compute dtype): each group's kernel is
    chosen by its own rows, not by the step's largest group. float16 (the interpreter has no bfloat16
    arithmetic; bfloat16 rounds the same way, coarser)."""
    B = 16
    kv = make_pool(2, 64, B, 20, storage, torch.float16, seed=21)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(22)).tolist()
    groups = groups_of(B, perm)  # single sequences (rows 0 and 1) beside groups of 3 and 2 beams
    impl = att.make_backend(policy.AttentionPath("cuda", False))
    assert impl.decode_variant == "auto"
    q = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(23)).to(torch.float16).to(DEVICE)
    together = impl.decode(kv, 0, q, impl.build(kv, groups, [0] * 7, [0] * 7))
    singles = impl.decode(kv, 0, q[:2], impl.build(kv, groups[:2], [0] * 2, [0] * 2))
    assert torch.equal(together[:2], singles)
    beams = impl.decode(kv, 0, q[2:], impl.build(kv, groups[2:], [0] * 5, [0] * 5))
    assert torch.equal(together[2:], beams)  # beam groups: "dot" at the same tile either way
    assert impl.kernel_ok


@needs_triton
@pytest.mark.parametrize("storage, variant", [("float", "sum"), ("int8", "dot")])
def test_split_kv_decode_is_within_the_bound_and_alike_in_launches_of_any_splits(storage, variant):
    """Split-KV decode (paged_decode's spans: a group's shared tokens a span a program, merged after),
    with spans of one block so that the test's groups have 3, 1, 2 and 1 spans: every row within the
    decode test's bound of exact (the merge is the online softmax's rescale, a span at a time, in
    float32: inside its (4 L + 16) 2^-24 term); each group alone in a launch of its own splits equals
    it in a launch of more splits beside the others, bit for bit (a row's spans follow its own length,
    not the step's); and a launch of fewer splits than a group's spans (its last split reads the rest)
    is within the bound too. float16 (the interpreter has no bfloat16 arithmetic)."""
    from gptj.engine.attention import cuda

    B, H, D = 16, 2, 64
    kv = make_pool(H, D, B, 20, storage, torch.float16, seed=31)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(32)).tolist()
    groups = groups_of(B, perm)
    q = torch.randn(7, H, D, generator=torch.Generator().manual_seed(33)).to(torch.float16).to(DEVICE)
    impl = att.make_backend(policy.AttentionPath("cuda", False))
    scales = kv.scales(0)

    def decode(gs, qs, max_shared):
        t = impl.build(kv, gs, [0] * len(qs), [0] * len(qs)).tables
        return cuda.paged_decode(qs, kv.k[0], kv.v[0], t.astuple(), 4, *scales, out_dtype=torch.float16,
                                 variant=variant, max_shared=max_shared, span=B)

    assert [cuda.decode_splits(g.shared_len, B) for g in groups] == [3, 1, 2, 1]
    together = decode(groups, q, 6 * B)  # 6 splits: 3 more than any group's
    assert_within_the_bound(kv, groups, q, together.double(), UNIT[torch.float16])
    row = 0
    for g in groups:
        alone = decode([g], q[row:row + g.rows], g.shared_len)
        assert torch.equal(alone, together[row:row + g.rows])
        row += g.rows
    assert_within_the_bound(kv, groups, q, decode(groups, q, 2 * B).double(), UNIT[torch.float16])


@needs_triton
@pytest.mark.parametrize("storage", ["float32", "float16", "int8", "fp8"])
def test_the_cuda_backends_copy_on_write_moves_each_copys_tokens_and_nothing_else(storage):
    """CudaAttention.copy (the Triton kernel): block dst gets the first n tokens of block src in every
    layer and head, keys, values and (int8 / e4m3) their scales, bit for bit; the dst rows from n on
    and every other block keep what they held (the reference's indexing copies whole blocks: only the
    first n rows are the contract). Heads of 48 values: rows not a power of two."""
    L, H, B, D, n_blocks = 3, 2, 8, 48, 10
    cfg = GPTJConfig(n_layer=L, n_embd=H * D, n_head=H, rotary_dim=8, n_inner=4 * H * D, n_positions=512)
    dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "float16": torch.float16}.get(storage, torch.float32)
    kv = att.PagedKV(cfg, n_blocks, B, dtype, DEVICE, compute=torch.float32)
    g = torch.Generator().manual_seed(7)
    for t in kv.stacked:  # random bits in every byte (any pattern must move as it is)
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8).to(DEVICE))
    before = [t.view(torch.uint8).clone() for t in kv.stacked]
    copies = [(1, 5, 3), (2, 6, B), (4, 7, 0), (1, 8, 1)]
    impl = att.make_backend(policy.AttentionPath("cuda", False))
    impl.copy(kv, copies)
    assert impl.store_ok  # the kernel ran, not the reference's indexing after a failure
    for t, old in zip(kv.stacked, before):
        want = old.view(t.dtype).clone()
        for src, dst, n in copies:
            want[:, dst, :, :n] = want[:, src, :, :n]
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))
    assert any(not torch.equal(t.view(torch.uint8), old) for t, old in zip(kv.stacked, before))


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "fp8"])
def test_copy_on_write_on_a_cpu_moves_each_copys_tokens_and_nothing_else(storage):
    """PagedKV.copy on a CPU (kv_cache.copy_rows): block dst gets the first n tokens of block src in every
    layer and head, keys, values and (int8 / e4m3) scales, bit for bit; the dst rows from n on and every
    other block keep what they held. copy_whole_blocks (the indexed copy of other devices without a
    kernel of their own) moves whole blocks: the same first n rows."""
    from gptj.engine.attention.kv_cache import copy_whole_blocks

    L, H, B, D, n_blocks = 3, 2, 8, 48, 10
    cfg = GPTJConfig(n_layer=L, n_embd=H * D, n_head=H, rotary_dim=8, n_inner=4 * H * D, n_positions=512)
    dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}.get(storage, torch.float32)
    kv = att.PagedKV(cfg, n_blocks, B, dtype, "cpu", compute=torch.float32)
    g = torch.Generator().manual_seed(8)
    for t in kv.stacked:  # random bits in every byte (any pattern must move as it is)
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    before = [t.view(torch.uint8).clone() for t in kv.stacked]
    copies = [(1, 5, 3), (2, 6, B), (4, 7, 0), (1, 8, 1)]
    kv.copy(copies)
    for t, old in zip(kv.stacked, before):
        want = old.view(t.dtype).clone()  # (rows in the tensor's own dtype: a scale is 4 bytes)
        for src, dst, n in copies:
            want[:, dst, :, :n] = want[:, src, :, :n]
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))
    whole = [old.clone() for old in before]
    copy_whole_blocks(whole, copies)
    for t, old in zip(whole, before):
        for src, dst, n in copies:
            assert torch.equal(t[:, dst], old[:, src])
        untouched = [b for b in range(n_blocks) if b not in {dst for _, dst, _ in copies}]
        assert torch.equal(t[:, untouched], old[:, untouched])


def test_a_step_builds_its_index_tensors_once_on_the_kvs_device():
    """build: the write slots, each group's blocks and each segment's slots, all on the KV's device;
    the DecodeTables a kernel reads (gptj.native's layout: int32, own tables padded with block 0)."""
    kv = make_pool(2, 16, 8, 20, "float", torch.float32, seed=0)
    groups = groups_of(8, list(range(20)))
    seg = att.PrefillSegment([15, 16, 17], 5, 10)  # positions 5 .. 14: blocks 15 and 16
    meta = att.build_step(kv, groups, [1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6], [seg])
    assert meta.write_blocks.tolist() == [1, 2, 3, 4, 5, 6, 7] and meta.n_decode == 7
    shared, own = meta.group_blocks[2]
    assert shared.tolist() == [4, 5] and own.tolist() == [[6, 7], [8, 9], [10, 11]]
    slots = meta.slots[0]
    assert slots.blocks.tolist() == [15, 15, 15, 16, 16, 16, 16, 16, 16, 16]
    assert slots.offsets.tolist() == [5, 6, 7, 0, 1, 2, 3, 4, 5, 6] and slots.table.tolist() == [15, 16]
    assert slots.positions.tolist() == list(range(5, 15))
    t = meta.tables
    assert t.row0.tolist() == [0, 1, 2, 5, 7] and t.soff.tolist() == [0, 3, 4, 6] and t.max_rows == 3
    assert t.stab.tolist() == [0, 1, 2, 3, 4, 5] and t.slen.tolist() == [3 * 8 - 5, 1, 16, 0]
    assert t.olen.tolist() == [0, 0, 11, 5] and t.otab.tolist()[2:] == [[6, 7], [8, 9], [10, 11], [12, 0], [13, 0]]
    assert all(x.dtype == torch.int32 and x.device.type == DEVICE for x in t.astuple())
    assert all(x.device.type == DEVICE for x in (meta.write_blocks, shared, own, slots.blocks, slots.table))


def test_the_policy_names_one_backend_per_device_and_dtype(monkeypatch):
    """cpu-native for a bfloat16 model on a CPU with gptj.native; cuda on CUDA with Triton; the
    reference otherwise (kernels "off", float32 on CPU, Triton missing)."""
    monkeypatch.setattr(policy, "native_available", lambda: True)
    monkeypatch.setattr(policy, "triton_available", lambda: True)
    path = policy.attention_path
    assert path("cpu", torch.bfloat16, "auto", "auto").backend == policy.CPU_NATIVE
    assert path("cpu", torch.int8, "auto", "auto", torch.bfloat16).backend == policy.CPU_NATIVE
    assert path("cpu", torch.bfloat16, "auto", "auto", head_dim=40).backend == policy.REFERENCE
    assert path("cpu", torch.float32, "auto", "auto").backend == policy.REFERENCE
    assert path("cpu", torch.bfloat16, "off", "auto").backend == policy.REFERENCE
    assert path("cpu", torch.float8_e4m3fn, "auto", "auto", torch.bfloat16).backend == policy.REFERENCE
    for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn):
        assert path("cuda", dtype, "auto", "auto", torch.bfloat16).backend == policy.CUDA
    assert path("cuda", torch.bfloat16, "off", "auto") == policy.AttentionPath(policy.REFERENCE, True)
    monkeypatch.setattr(policy, "triton_available", lambda: False)
    assert path("cuda", torch.bfloat16, "auto", "off") == policy.AttentionPath(policy.REFERENCE, False)
    assert set(att.BACKENDS) == {policy.REFERENCE, policy.CPU_NATIVE, policy.CUDA}


@needs_triton
def test_an_engine_on_the_cuda_backend_gives_the_references_tokens(two_heads):
    """float32: greedy, sampled and beam requests sharing steps, through the Triton kernel, give the
    reference backend's tokens; and each request's tokens alone are its tokens together."""
    prompts = prompts_of([5, 17, 1, 30, 8, 12])
    model = two_heads.to(DEVICE)

    def engine(backend: str, max_seqs: int = 16) -> Engine:
        e = Engine(model, EngineConfig(max_seqs=max_seqs, block_size=8, kernels="off"))
        e.runner.attention = att.make_backend(policy.AttentionPath(backend, False))
        return e

    gens = SHORT_MIXED
    cuda = engine("cuda")
    assert isinstance(cuda.attention, ReferenceAttention) and cuda.attention.name == "cuda"
    together = cuda.generate(prompts, gens)
    assert together == engine("reference").generate(prompts, gens)
    # the beam request alone (the kernel's batch invariance itself: test_the_cuda_kernel_gives_each_row...)
    assert engine("cuda", 8).generate([prompts[2]], [gens[2]])[0] == together[2]


@needs_gpu
def test_on_cuda_float32_tokens_are_hfs_and_bfloat16_is_batch_invariant():
    """The engine on CUDA (the cuda backend): float32 greedy and MLPerf beam search give HF
    transformers' tokens on the same GPU; bfloat16 requests together give their tokens alone."""
    from hf_ref import EOS, cut_at_eos, make_pair

    ours, hf = make_pair(CFG, seed=1, std=0.3, eos_bias=4.0)
    ours, hf = ours.to("cuda"), hf.to("cuda")
    prompts = prompts_of([5, 17, 30, 8])
    engine = Engine(ours, EngineConfig(max_seqs=16))
    assert engine.attention.name == "cuda"
    for gen, hf_args in ((GenerationConfig(max_new_tokens=16), {}),
                         (GenerationConfig.mlperf(max_new_tokens=24, min_new_tokens=6),
                          dict(num_beams=4, min_new_tokens=6, early_stopping=True))):
        got = engine.generate(prompts, gen)
        for prompt, tokens in zip(prompts, got):
            ids = torch.tensor([prompt], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen.max_new_tokens,
                              do_sample=False, pad_token_id=EOS, eos_token_id=EOS, **hf_args)
            assert tokens == cut_at_eos(out[0, len(prompt):].tolist())
    bf16 = ours.to(torch.bfloat16)
    together = Engine(bf16, EngineConfig(max_seqs=16)).generate(prompts, MIXED[:4])
    alone = [Engine(bf16, EngineConfig(max_seqs=8)).generate([p], [g])[0] for p, g in zip(prompts, MIXED[:4])]
    assert together == alone


@needs_triton
@pytest.mark.parametrize("compute", [torch.float32, torch.float16])
@pytest.mark.parametrize("storage", ["float", "int8", "fp8"])
@pytest.mark.parametrize("B, start", [(16, 0), (16, 13), (32, 21)])
def test_the_cuda_prefill_kernel_is_within_the_arithmetics_bound_of_exact(compute, storage, B, start):
    """A prompt chunk's causal attention over its blocks in place (the Triton kernel), against float64
    over the same stored values: 37 queries (tiles of 16 and a partial one) after `start` stored
    tokens. The blocks past the chunk hold NaN: never read. Bound as the decode test's (u: the
    compute dtype's unit roundoff; below float32 the probabilities are rounded to it)."""
    from gptj.engine.attention.cuda import paged_prefill

    H, D, T = 2, 64, 37
    kv = make_pool(H, D, B, 12, storage, compute, seed=B + start)
    end = start + T
    blocks = torch.randperm(12, generator=torch.Generator().manual_seed(7))[:-(-end // B)].tolist()
    last, row = blocks[-1], (end - 1) % B + 1
    for cache in (kv.k[0], kv.v[0]) if not kv.quantized else (kv.k_scale[0], kv.v_scale[0]):
        cache[last, :, row:] = float("nan")  # unwritten memory past the chunk
    q = torch.randn(T, H, D, generator=torch.Generator().manual_seed(8)).to(compute).to(DEVICE)
    table = torch.tensor(blocks, device=DEVICE)
    got = paged_prefill(q, kv.k[0], kv.v[0], table, start, *kv.scales(0)).double()
    assert got.shape == (T, H, D) and got.dtype == torch.float64 and not got.isnan().any()
    k, v = exact_values(kv, blocks, end)  # (H, end, D)
    qd = q.double().transpose(0, 1)  # (H, T, D)
    s = qd @ k.transpose(1, 2) / D**0.5  # (H, T, end)
    causal = torch.arange(end, device=DEVICE)[None, :] > torch.arange(start, end, device=DEVICE)[:, None]
    p = torch.softmax(s.masked_fill(causal, float("-inf")), -1)
    want = (p @ v).transpose(0, 1)  # (T, H, D)
    u = UNIT[compute]
    delta = u * (s.abs().amax(-1) + (qd.abs() @ k.abs().transpose(1, 2)).amax(-1) / D**0.5)  # (H, T)
    vmax = v.abs().amax((1, 2))[:, None, None]  # (H, 1, 1)
    bound = (u * (want.abs().transpose(0, 1) + 2 * (p @ v.abs())) +
             (2.01 * delta[..., None] + (4 * end + 16) * 2.0**-24) * vmax).transpose(0, 1)
    err = (got - want).abs()
    assert (err <= bound).all(), float((err / bound).max())


@needs_triton
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_chunked_prefill_on_the_cuda_backend_gives_the_references_tokens(two_heads, kv_dtype, monkeypatch):
    """Prompts prefilled in chunks of 16 (the later chunks through the Triton prefill kernel, over
    their blocks in place; quantized blocks: every chunk), float32: the reference backend's tokens."""
    from gptj.engine.attention import cuda

    starts = []
    real = cuda.paged_prefill
    monkeypatch.setattr(cuda, "paged_prefill", lambda q, kc, vc, table, start, *sc: starts.append(start) or
                        real(q, kc, vc, table, start, *sc))
    prompts = prompts_of([30, 45, 7])
    gen = GenerationConfig(max_new_tokens=4)

    def run(backend: str) -> list[list[int]]:
        e = Engine(two_heads.to(DEVICE), EngineConfig(max_seqs=4, block_size=16, prefill_chunk=16, kernels="off",
                                                      kv_dtype=kv_dtype))
        e.runner.attention = att.make_backend(policy.AttentionPath(backend, False))
        out = e.generate(prompts, gen)
        assert getattr(e.runner.attention, "kernel_ok", True)
        return out

    assert run("cuda") == run("reference")
    assert any(start > 0 for start in starts)  # later chunks ran through the kernel
    assert (0 in starts) == (kv_dtype != "auto")  # a prompt's first chunk too, over quantized blocks only


@needs_triton
@pytest.mark.parametrize("storage", ["float", "int8"])
def test_the_cuda_kernel_rounds_its_output_as_a_cast_would(storage):
    """paged_decode's out_dtype: the float32 sums rounded once in the kernel, bit for bit the cast of
    its float32 output (the backend asks for the compute dtype: one kernel less a layer)."""
    from gptj.engine.attention.cuda import paged_decode

    compute = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    kv = make_pool(2, 64, 8, 20, storage, compute, seed=6)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(7)).tolist()
    impl = att.make_backend(policy.AttentionPath("cuda", False))
    meta = impl.build(kv, groups_of(8, perm), [0] * 7, [0] * 7)
    q = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(8)).to(compute).to(DEVICE)
    args = (q, kv.k[0], kv.v[0], meta.tables.astuple(), meta.tables.max_rows, *kv.scales(0))
    wide = paged_decode(*args)
    assert wide.dtype == torch.float32
    narrow = paged_decode(*args, out_dtype=compute)
    assert narrow.dtype == compute and torch.equal(narrow, wide.to(compute))
    assert torch.equal(impl.decode(kv, 0, q, meta), narrow)


@needs_triton
@pytest.mark.parametrize("storage", ["float", "int8", "fp8"])
def test_the_cuda_store_writes_what_the_reference_writes(storage):
    """store_kv (one kernel for keys and values, quantizing included) against PagedKV.write: every
    block, value and scale the same bit for bit; the tokens' heads read from a fused block's strided
    q|k|v rows; int8 ties (x / s = k + 1/2) round to even, as torch.round does."""
    from gptj.engine.attention.cuda import store_kv

    if storage == "fp8" and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversions need FP8 units")
    compute = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    H, D, B, N = 3, 64, 8, 11
    ours, ref = (make_pool(H, D, B, 6, storage, compute, seed=9) for _ in range(2))
    g = torch.Generator().manual_seed(10)
    qkv = torch.randn(N, 3, H, D + 5, generator=g)[..., :D].to(compute).to(DEVICE)  # strided heads
    qkv[0, 1, 0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # amax 127: s = 1, ties at x.5
    qkv[0, 1, 0, 4:] = 0
    # e4m3's ties and subnormals at s = 1 (amax 448): 2^-10 -> 0, 3 x 2^-10 -> 2^-8, 17 -> 16, 19 -> 20
    qkv[0, 2, 0, :8] = torch.tensor([448.0, 2.0**-10, 3 * 2.0**-10, 17.0, 19.0, -19.0, 0.01, -(2.0**-10)])
    qkv[0, 2, 0, 8:] = 0
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(6 * B, generator=g)[:N].to(DEVICE)
    blocks, offsets = slots // B, slots % B
    store_kv(k, v, ours.k[0], ours.v[0], blocks, offsets, *ours.scales(0))
    ref.write(0, k, v, blocks, offsets)
    for a, b in zip(ours.stacked, ref.stacked):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    if storage == "int8":
        row = ours.k[0][blocks[0], 0, offsets[0], :4].tolist()
        assert row == [127, 2, -4, 0]  # ties to even
    if storage == "fp8":
        row = ours.v[0][blocks[0], 0, offsets[0], :6].float().tolist()
        assert row == [448.0, 0.0, 2.0**-8, 16.0, 20.0, -20.0]  # ties to even, subnormals included
    impl = att.make_backend(policy.AttentionPath("cuda", False))
    impl.store(ours, 0, k.flip(0), v.flip(0), blocks, offsets)  # the backend's store is this kernel
    ref.write(0, k.flip(0), v.flip(0), blocks, offsets)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(ours.stacked, ref.stacked))
