"""Grouped-query attention (GQA: kv_heads < heads, Llama) in the fast attention backends: query head h
reads KV head h // (heads // kv_heads).

- gptj.native's paged decode and prefill, on every ISA this CPU runs (and the generic library): a
  grouped call gives, bit for bit, what the same kernel gives over the KV heads repeated for each
  query head (the per-head arithmetic is the same; only where the rows are read from differs), and
  that is within the arithmetic's bound of float64 (tests/test_attention_backends.py's bound);
- the CUDA backend's Triton kernels (Triton's interpreter on CPU without a GPU): within the same bound
  (their tiles hold a KV head's group of query heads, so sums may be ordered otherwise than per head);
- an engine serving a bfloat16 llama-tiny on the native backend against the reference backend;
- gptj.policy.attention_path choosing the fast backends for grouped models.
"""

from __future__ import annotations

import pytest
import torch

from gptj import native, policy
from gptj.decode import GenerationConfig, generate
from gptj.engine import Engine, EngineConfig
from gptj.engine import attention as att
from test_attention_backends import (DEVICE, UNIT, assert_within_the_bound, exact_values, groups_of, make_pool,
                                     triton_reason)
from test_engine_llama import U_BF16, bound, prompts_of, tiny

# (query heads, KV heads): grouped (groups of 4, and of 3: the Triton tiles' lanes past a group masked),
# multi-query, one KV head per query head
SHAPES = [(8, 2), (6, 2), (4, 1), (4, 4)]
SHAPE_IDS = [f"{h}over{k}" for h, k in SHAPES]
needs_triton = pytest.mark.skipif(triton_reason() is not None, reason=str(triton_reason()))
on_cpu = pytest.mark.skipif(DEVICE != "cpu", reason="gptj.native reads CPU blocks (test_attention_backends' pools "
                            "are on the GPU here)")


def repeated(kv: att.PagedKV, group: int, storage: str, compute: torch.dtype) -> att.PagedKV:
    """A pool of kv's blocks with each KV head repeated for its `group` query heads: what a kernel
    without grouping reads for the same attention."""
    n_blocks, KH, B, D = kv.k[0].shape
    out = make_pool(KH * group, D, B, n_blocks, storage, compute, seed=0)
    pairs = [(out.k[0], kv.k[0]), (out.v[0], kv.v[0])]
    if kv.quantized:
        pairs += [(out.k_scale[0], kv.k_scale[0]), (out.v_scale[0], kv.v_scale[0])]
    for dst, src in pairs:
        dst.copy_(src.repeat_interleave(group, dim=1))
    return out


def decode_case(H: int, KH: int, B: int, D: int, storage: str, compute: torch.dtype, seed: int):
    """(grouped pool, the pool repeated, decode groups, q (7, H, D)): test_attention_backends' groups
    (a sequence with a partial block, one of one token, 3 beams sharing a prompt, 2 beams without one)."""
    kv = make_pool(KH, D, B, 20, storage, compute, seed=seed)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    q = torch.randn(7, H, D, generator=torch.Generator().manual_seed(seed + 2)).to(compute).to(DEVICE)
    return kv, repeated(kv, H // KH, storage, compute), groups_of(B, perm), q


def decode_on(backend: str, kv: att.PagedKV, groups: list[att.DecodeGroup], q: torch.Tensor,
              variant: str | None = None) -> torch.Tensor:
    impl = att.make_backend(policy.AttentionPath(backend, False))
    if variant is not None:
        impl.decode_variant = variant
    meta = impl.build(kv, groups, [0] * len(q), [0] * len(q))
    out = impl.decode(kv, 0, q, meta)
    assert getattr(impl, "kernel_ok", True)  # the kernel ran, not the reference's forms after a failure
    return out


# --- gptj.native -------------------------------------------------------------------------------------

@on_cpu
@pytest.mark.parametrize("H, KH, B", [(h, k, b) for (h, k), b in zip(SHAPES, (16, 8, 16, 8))], ids=SHAPE_IDS)
@pytest.mark.parametrize("storage", ["bfloat16", "int8"])
def test_native_decode_reads_each_query_heads_kv_head(native_isa, H, KH, storage, B):
    """Grouped decode = the same kernel over the KV heads repeated, bit for bit (each query head's
    scores, softmax and sums are the same operations on the same values), and within the decode
    bound of float64 (bfloat16's u: q and the output rounded to it; float32 scores and sums)."""
    kv, rep, groups, q = decode_case(H, KH, B, 32, storage, torch.bfloat16, seed=3 * H + KH + B)
    got = decode_on("cpu-native", kv, groups, q)
    assert got.shape == (7, H, 32)
    assert torch.equal(got, decode_on("cpu-native", rep, groups, q))
    assert_within_the_bound(rep, groups, q, got.double(), UNIT[torch.bfloat16])


def prefill_bound(kv: att.PagedKV, blocks: list[int], q: torch.Tensor, start: int, got: torch.Tensor, u: float,
                  group: int) -> None:
    """test_attention_backends' prefill bound, the KV heads repeated for their query heads: a score
    moves by <= u (max|s| + max sum|q k| / sqrt(D)) =: delta (keys dequantized / products rounded to
    the compute dtype), the output by 2.01 delta max|v|; probabilities rounded to the dtype before P.V
    and the values' own rounding 2u p.|v|, the output's rounding u |out|, float32 sums (4L + 16) 2^-24."""
    T, H, D = q.shape
    end = start + T
    k, v = (x.cpu().repeat_interleave(group, dim=0) for x in exact_values(kv, blocks, end))  # (H, end, D)
    qd = q.cpu().double().transpose(0, 1)
    s = qd @ k.transpose(1, 2) / D**0.5
    causal = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    p = torch.softmax(s.masked_fill(causal, float("-inf")), -1)
    want = (p @ v).transpose(0, 1)
    delta = u * (s.abs().amax(-1) + (qd.abs() @ k.abs().transpose(1, 2)).amax(-1) / D**0.5)
    vmax = v.abs().amax((1, 2))[:, None, None]
    bound = (u * (want.abs().transpose(0, 1) + 2 * (p @ v.abs()))
             + (2.01 * delta[..., None] + (4 * end + 16) * 2.0**-24) * vmax).transpose(0, 1)
    err = (got.cpu().double() - want).abs()
    assert (err <= bound).all(), float((err / bound).max())


@on_cpu
@pytest.mark.parametrize("H, KH, storage", [(h, k, s) for (h, k), s in zip(SHAPES, ("int8", "bfloat16") * 2)],
                         ids=SHAPE_IDS)
def test_native_prefill_reads_each_query_heads_kv_head(native_isa, H, KH, storage):
    """A chunk of 37 queries (tiles of 16 and a partial one) after 13 stored tokens: grouped = the
    kernel over the KV heads repeated, bit for bit, and within the prefill bound of float64."""
    B, D, T, start = 16, 32, 37, 13
    kv = make_pool(KH, D, B, 8, storage, torch.bfloat16, seed=H + KH)
    rep = repeated(kv, H // KH, storage, torch.bfloat16)
    blocks = torch.randperm(8, generator=torch.Generator().manual_seed(5))[:-(-(start + T) // B)].tolist()
    table = torch.tensor(blocks, dtype=torch.int32)
    q = torch.randn(T, H, D, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    got = native.prefill_paged(q, kv.k[0], kv.v[0], table, start, *kv.scales(0))
    assert got.shape == (T, H, D)
    assert torch.equal(got, native.prefill_paged(q, rep.k[0], rep.v[0], table, start, *rep.scales(0)))
    prefill_bound(kv, blocks, q, start, got, UNIT[torch.bfloat16], H // KH)


@on_cpu
def test_native_refuses_query_heads_that_are_not_whole_groups(native_isa):
    kv = make_pool(2, 32, 16, 4, "bfloat16", torch.bfloat16, seed=0)
    q = torch.zeros(3, 3, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not match queries of 3 heads"):
        one = torch.tensor([0, 1], dtype=torch.int32)
        native.attention_paged(q[:1], kv.k[0], kv.v[0], one, one[:1], one[:1] * 0, one[1:], one[None, :1], one[:1] * 0)
    with pytest.raises(ValueError, match="a multiple of their 2 heads"):
        native.prefill_paged(q, kv.k[0], kv.v[0], torch.tensor([0], dtype=torch.int32), 0)


# --- an engine on the native backend -------------------------------------------------------------------

@pytest.mark.skipif(native.unavailable_reason() is not None, reason=f"native: {native.unavailable_reason()}")
def test_a_bfloat16_llama_on_the_native_backend_follows_the_reference():
    """llama-tiny (4 query heads over 2 KV heads; bfloat16, the native backend's only dtype) greedy on
    cpu-native against the same engine with the reference backend put in its place. Both are
    bfloat16 arithmetic of the same model, each within test_engine_llama's first-step bound of
    float32 (`allowed`, relative to the largest logit) at every position (each position's logits are
    that computation over the same tokens), so while the tokens agree their logprobs differ by at
    most 2 x allowed, and where they part the native run's token must be one the bound allows (its
    reference logprob within 2 x allowed of the reference's top); after that the sequences differ
    and are not compared. That bound is loose (tenths of a logit here), and on this model the
    tokens happened to agree throughout when written (AVX2), which the test
    does not hold: another ISA's rounding may part them at a close step."""
    model = tiny(2, torch.bfloat16, seed=9)
    prompts = prompts_of([9, 4, 14, 21], seed=8)
    gen = GenerationConfig(max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    runs = {}
    for backend in (policy.CPU_NATIVE, policy.REFERENCE):
        engine = Engine(model, EngineConfig(max_seqs=4, block_size=8, prefill_chunk=8))
        assert engine.runner.attention.name == policy.CPU_NATIVE  # the policy's choice for a grouped model
        engine.runner.attention = att.make_backend(policy.AttentionPath(backend, False))
        reqs = [engine.add_request(p, gen, logprobs=5) for p in prompts]
        while engine.has_work:
            engine.step()
        runs[backend] = reqs
    exact_model = tiny(2, seed=9)  # float32: the logits' scale the bound is relative to
    for prompt, fast, ref in zip(prompts, runs[policy.CPU_NATIVE], runs[policy.REFERENCE]):
        with torch.no_grad():
            logits = exact_model(torch.tensor([prompt + ref.output[:-1]]))[0, len(prompt) - 1:]
        allowed = 2 * 3 * (3 * 2 + 1) * U_BF16 * float(logits.abs().max())
        for a, b in zip(fast.token_logprobs, ref.token_logprobs):
            if a.token != b.token:
                ref_of = dict(b.top)
                assert a.token in ref_of and ref_of[a.token] >= b.logprob - 2 * allowed
                break
            assert abs(a.logprob - b.logprob) <= 2 * allowed


# --- the policy --------------------------------------------------------------------------------------

def test_the_policy_sends_grouped_models_to_the_fast_backends(monkeypatch):
    """Where a model with one KV head per query head gets cpu-native (a bfloat16 model, native kernels
    available) or cuda (Triton), grouped ones whose KV heads divide the query heads do too; uneven
    groups, float32 on a CPU, kernels "off", or no native library: the reference."""
    monkeypatch.setattr(policy, "native_available", lambda: True)
    monkeypatch.setattr(policy, "triton_available", lambda: True)
    path = policy.attention_path
    for heads, kv in ((32, 8), (4, 1), (8, 2), (4, 4)):
        for kv_dtype in (torch.bfloat16, torch.int8):
            assert path("cpu", kv_dtype, "auto", "auto", torch.bfloat16, 128, heads=heads, kv_heads=kv).backend \
                == policy.CPU_NATIVE
        assert path("cpu", torch.bfloat16, "off", "auto", torch.bfloat16, 128, heads=heads, kv_heads=kv).backend \
            == policy.REFERENCE
        assert path("cpu", torch.float32, "auto", "auto", torch.float32, 128, heads=heads, kv_heads=kv).backend \
            == policy.REFERENCE
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert path("cuda", dtype, "auto", "auto", dtype, 128, heads=heads, kv_heads=kv).backend == policy.CUDA
    assert path("cpu", torch.bfloat16, "auto", "auto", torch.bfloat16, 128, heads=6, kv_heads=4).backend \
        == policy.REFERENCE
    assert path("cuda", torch.bfloat16, "auto", "auto", torch.bfloat16, 128, heads=6, kv_heads=4).backend \
        == policy.REFERENCE
    monkeypatch.setattr(policy, "native_available", lambda: False)
    assert path("cpu", torch.bfloat16, "auto", "auto", torch.bfloat16, 128, heads=32, kv_heads=8).backend \
        == policy.REFERENCE


# --- the CUDA backend's Triton kernels ------------------------------------------------------------------

# Triton's interpreter runs a program at a time in Python (~0.2 s each here): few heads, and one KV
# head per query head left to tests/test_attention_backends.py
@needs_triton
@pytest.mark.parametrize("H, KH, variant, storage, compute", [
    (3, 1, "sum", "int8", torch.float32), (4, 1, "dot", "float", torch.float16), (3, 1, "dot", "int8", torch.float16),
    (4, 2, "sum", "float", torch.float16)], ids=["3over1-sum-int8-fp32", "4over1-dot-fp16", "3over1-dot-int8-fp16",
                                                  "4over2-sum-fp16"])
def test_the_cuda_decode_kernels_read_each_query_heads_kv_head(H, KH, variant, storage, compute):
    """The "sum" and "dot" kernels (a program per decode group and KV head, a lane per row and query
    head) within test_attention_backends' decode bound of float64 over the KV heads repeated for their
    query heads (u: the compute dtype's; the interpreter has no bfloat16), int8 and float blocks; a
    group of 3 query heads fills 3 of its 4 lanes a row."""
    kv, rep, groups, q = decode_case(H, KH, 16, 32, storage, compute, seed=5 * H + KH)
    got = decode_on("cuda", kv, groups, q, variant)
    assert got.shape == (7, H, 32)
    assert_within_the_bound(rep, groups, q, got.double(), UNIT[compute])


@needs_triton
def test_the_cuda_split_kv_decode_of_a_grouped_model_is_within_the_bound():
    """Split-KV (spans of one block; the merge kernel runs per row and query head) over 4 query heads of
    one KV head, float32: within the decode bound (a sequence of 3 blocks, 3 beams sharing 2)."""
    from gptj.engine.attention.cuda import paged_decode

    kv, rep, groups, q = decode_case(4, 1, 16, 32, "float", torch.float32, seed=31)
    groups = [groups[0], groups[2]]  # 1 + 3 rows
    q = q[torch.tensor([0, 2, 3, 4])]
    impl = att.make_backend(policy.AttentionPath("cuda", False))
    meta = impl.build(kv, groups, [0] * 4, [0] * 4)
    got = paged_decode(q, kv.k[0], kv.v[0], meta.tables.astuple(), meta.tables.max_rows, max_shared=48, span=16)
    assert_within_the_bound(rep, groups, q, got.double(), UNIT[torch.float32])


@needs_triton
@pytest.mark.parametrize("H, KH, storage, compute", [(3, 1, "int8", torch.float32), (4, 2, "float", torch.float16)],
                         ids=["3over1-int8-fp32", "4over2-fp16"])
def test_the_cuda_prefill_kernel_reads_each_query_heads_kv_head(H, KH, storage, compute):
    """37 queries after 13 stored tokens, a program per tile of 16 queries and KV head: within the
    prefill bound of float64 over the KV heads repeated (below float32 the probabilities are rounded
    to the dtype: the bound's 2u p.|v|)."""
    from gptj.engine.attention.cuda import paged_prefill

    B, D, T, start = 16, 32, 37, 13
    kv = make_pool(KH, D, B, 8, storage, compute, seed=H + KH)
    blocks = torch.randperm(8, generator=torch.Generator().manual_seed(5))[:-(-(start + T) // B)].tolist()
    q = torch.randn(T, H, D, generator=torch.Generator().manual_seed(6)).to(compute).to(DEVICE)
    got = paged_prefill(q, kv.k[0], kv.v[0], torch.tensor(blocks, device=DEVICE), start, *kv.scales(0))
    assert got.shape == (T, H, D)
    prefill_bound(kv, blocks, q, start, got, UNIT[compute], H // KH)


@needs_triton
def test_a_float32_llama_on_the_cuda_backend_gives_decodes_tokens():
    """llama-tiny (4 query heads over 2 KV heads), float32, on the cuda backend's kernels (the
    interpreter on CPU tensors without a GPU): prompts prefilled 4 tokens a chunk (the chunks after the
    first by the prefill kernel), decoded by the decode kernel; the tokens are gptj.decode's and each
    chosen token's logprob within test_engine_llama's float32 bound of the eager model's."""
    model = tiny(2, seed=0)
    prompts = prompts_of([6, 9], seed=4)
    gen = GenerationConfig(max_new_tokens=4, eos_token_id=None, pad_token_id=0)
    want = generate(model, prompts, gen)
    engine = Engine(tiny(2, seed=0).to(DEVICE), EngineConfig(max_seqs=2, block_size=16, prefill_chunk=4,
                                                            prefix_caching=False))
    engine.runner.attention = att.make_backend(policy.AttentionPath(policy.CUDA, False))
    reqs = [engine.add_request(p, gen, logprobs=0) for p in prompts]
    while engine.has_work:
        engine.step()
    assert engine.runner.attention.kernel_ok and [r.output for r in reqs] == want
    for req, prompt in zip(reqs, prompts):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + req.output[:-1]]))[0, len(prompt) - 1:]
        exact = torch.log_softmax(logits, dim=-1)[torch.arange(len(req.output)), req.output]
        got = torch.tensor([t.logprob for t in req.token_logprobs])
        torch.testing.assert_close(got, exact, rtol=0, atol=2 * bound(logits))


@needs_triton
def test_the_cuda_kernels_refuse_query_heads_that_are_not_whole_groups():
    from gptj.engine.attention.cuda import paged_decode, paged_prefill

    kv = make_pool(2, 32, 16, 4, "float", torch.float32, seed=0)
    q = torch.zeros(3, 3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="3 query heads are not whole groups of the blocks' 2 KV heads"):
        paged_prefill(q, kv.k[0], kv.v[0], torch.tensor([0], device=DEVICE), 0)
    with pytest.raises(ValueError, match="3 query heads are not whole groups"):
        paged_decode(q, kv.k[0], kv.v[0], (None,) * 6, 1)
