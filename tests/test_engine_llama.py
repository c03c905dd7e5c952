"""The engine runs Llama (gptj.models.llama): grouped-query attention over paged KV memory.

A tiny random Llama (4 query heads of 16; 2 KV heads: GQA, 1: multi-query, 4: multi-head), drawn
with weights of std 0.3 (norms 1 + 0.1 noise, as tests/test_llama_model.py draws them) so logits are
far from flat. The engine's tokens are compared with gptj.decode's on the same model (float32: the
exact path, a contiguous KV cache, left-padded batches): greedy with chunked prefill, prefix caching,
beam search. KV heads fewer than query heads run where gptj.policy.attention_path sends them
(float32: the reference).
"""

from __future__ import annotations

import pytest
import torch

from gptj import policy
from gptj.decode import GenerationConfig, beam_search, generate, left_pad
from gptj.engine import Engine, EngineConfig
from gptj.kernels import prepare_for_serving
from gptj.models.llama import Block, LlamaConfig, build_model
from gptj.runtime.build import build_engine

U = 2.0 ** -24  # float32's unit roundoff
U_BF16 = 2.0 ** -8  # bfloat16's
KV_HEADS = [2, 1, 4]  # grouped-query, multi-query, multi-head


def tiny(kv: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv, head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=500000.0, max_position_embeddings=256, bos_token_id=0, eos_token_ids=(1,))
    model = build_model(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "ln" in name else 0.3 * noise)
    return model.to(dtype)


@pytest.fixture(scope="module", params=KV_HEADS, ids=[f"kv{kv}" for kv in KV_HEADS])
def model(request):
    return tiny(request.param)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 200, (n,), generator=g).tolist() for n in lengths]


GREEDY = GenerationConfig(max_new_tokens=16, eos_token_id=None, pad_token_id=0)


def bound(logits: torch.Tensor, layers: int = 2, reduction: int = 128) -> float:
    """tests/test_llama_model.py's: what float32 rounding allows between two evaluations of the same
    math with sums ordered differently ((3 reduction stages per layer + the head) x at most
    `reduction` terms x u, relative to the largest logit)."""
    return (3 * layers + 1) * reduction * U * float(logits.abs().max())


def test_grouped_query_attention_runs_where_the_kv_heads_divide_the_query_heads():
    # whole groups of query heads per KV head: the choice of a model with one KV head per query head
    # (the kernels read KV head h // group; tests/test_attention_gqa.py); other counts: the reference
    for device in ("cpu", "cuda"):
        for dtype in (torch.bfloat16, torch.float32):
            for mode in ("auto", "off"):
                path = policy.attention_path(device, dtype, mode, "auto", dtype, 16, heads=6, kv_heads=4)
                assert path.backend == policy.REFERENCE
    for device, dtype in (("cpu", torch.bfloat16), ("cpu", torch.float32), ("cuda", torch.bfloat16)):
        for kv in (4, 2, 1):
            assert (policy.attention_path(device, dtype, "auto", "auto", dtype, 64, heads=4, kv_heads=kv)
                    == policy.attention_path(device, dtype, "auto", "auto", dtype, 64))


def test_the_paged_kv_holds_the_kv_heads(model):
    engine = Engine(model, EngineConfig(max_seqs=4, block_size=8, kv_blocks=16))
    kv = engine.runner.kv
    assert kv.k[0].shape[1:] == (model.config.num_key_value_heads, 8, 16)
    assert engine.runner.attention.name == policy.REFERENCE  # float32


def test_greedy_with_chunked_prefill_equals_decode(model):
    """A batch of prompts of different lengths (left-padded by decode, each its own blocks in the
    engine), prefilled 4 tokens a step while the others decode; each step's chosen token's logprob
    against the eager model's over the whole sequence, within float32's bound."""
    prompts = prompts_of([5, 17, 1, 9, 12])
    want = generate(model, prompts, GREEDY)
    engine = Engine(model, EngineConfig(max_seqs=4, block_size=8, prefill_chunk=4, prefix_caching=False))
    reqs = [engine.add_request(p, GREEDY, logprobs=0) for p in prompts]
    while engine.has_work:
        engine.step()
    assert [r.output for r in reqs] == want
    assert max(engine.decode_batch_sizes) > 1  # rows of different lengths shared steps
    for req, prompt in zip(reqs, prompts):
        seq = torch.tensor([prompt + req.output[:-1]])
        with torch.no_grad():
            logits = model(seq)[0, len(prompt) - 1:]  # (new tokens, V): no cache, no padding
        exact = torch.log_softmax(logits, dim=-1)[torch.arange(len(req.output)), req.output]
        got = torch.tensor([t.logprob for t in req.token_logprobs])
        assert [t.token for t in req.token_logprobs] == req.output
        torch.testing.assert_close(got, exact, rtol=0, atol=2 * bound(logits))


def test_a_shared_prefix_is_computed_once_and_gives_decodes_tokens(model):
    prefix = prompts_of([24], seed=11)[0]  # three full blocks of 8
    prompts = [prefix + tail for tail in prompts_of([5, 3], seed=12)]
    want = generate(model, prompts, GREEDY)
    engine = Engine(model, EngineConfig(max_seqs=4, block_size=8, prefill_chunk=8))
    got = [engine.generate([p], GREEDY)[0] for p in prompts]  # one after another: the first fills the cache
    assert got == want
    assert engine.stats().prefix_hit_tokens == 24  # the second request's prefix: read, not computed


def test_beam_search_equals_decode(model):
    """num_beams 3 over prompts whose last blocks are partial: the beams share the prompt's blocks and
    copy the partial one on write; the engine's best hypotheses are decode.beam_search's."""
    prompts = prompts_of([11, 6, 19], seed=3)
    gen = GenerationConfig(max_new_tokens=10, num_beams=3, eos_token_id=None, pad_token_id=0)
    ids, mask = left_pad(prompts, gen.pad_token_id, torch.device("cpu"))
    want, _ = beam_search(model, ids, mask, gen)
    engine = Engine(model, EngineConfig(max_seqs=12, block_size=8, prefill_chunk=8))
    assert engine.generate(prompts, gen) == want
    engine.kv.check()


def test_build_engine_takes_llama_as_it_is():
    """build_engine: the KV plan of its KV heads, the serving kernels leaving Llama's blocks unfused
    (GPT-J's fused q|k|v|fc_in is not Llama's layout), greedy and beams equal to decode's."""
    model = tiny(2, seed=5)
    prompts = prompts_of([7, 13], seed=6)
    beams = GenerationConfig(max_new_tokens=6, num_beams=3, eos_token_id=None, pad_token_id=0)
    want = [generate(model, [p], g)[0] for p, g in zip(prompts, (GREEDY, beams))]
    engine = build_engine(model, EngineConfig(max_seqs=4, block_size=16, kv_blocks=16, prefill_chunk=4))
    assert all(isinstance(b, Block) and hasattr(b.attn, "q_proj") for b in model.transformer.h)
    assert engine.runner.kv.k[0].shape[1] == 2
    assert engine.generate(prompts, [GREEDY, beams]) == want


def test_bfloat16_first_step_is_within_the_bound_of_float32():
    """A bfloat16 Llama served as the engine serves it (prepare_for_serving: q|k|v and gate|up fused,
    its linears packed where oneDNN can): the first step's logprobs against float32's. Each of the
    roughly 3 roundings per stage (input, product, output) of the 3 stages per layer and the head
    moves a value by at most u_bf16 relative to the normalized activations, first order."""
    prompts = prompts_of([9, 4, 14], seed=8)
    exact_model = tiny(2, seed=9)
    model = tiny(2, torch.bfloat16, seed=9)
    assert prepare_for_serving(model, "auto", max_rows=4)["fused_blocks"] == 2
    engine = Engine(model, EngineConfig(max_seqs=4, block_size=8, prefill_chunk=8))
    gen = GenerationConfig(max_new_tokens=1, eos_token_id=None, pad_token_id=0)
    reqs = [engine.add_request(p, gen, logprobs=5) for p in prompts]
    while engine.has_work:
        engine.step()
    for req, prompt in zip(reqs, prompts):
        with torch.no_grad():
            logits = exact_model(torch.tensor([prompt]))[0, -1]
        exact = torch.log_softmax(logits, dim=-1)
        allowed = 2 * 3 * (3 * 2 + 1) * U_BF16 * float(logits.abs().max())
        for token, logprob in req.token_logprobs[0].top:
            assert abs(logprob - float(exact[token])) <= allowed


def test_int8_llama_blocks_fuse_into_the_same_projections(monkeypatch):
    """An int8 Llama's serving blocks fuse too (q|k|v and gate|up, each row keeping its scale): each
    slice of a fused projection is the plain projection's output exactly (the GEMV sums each row of
    the weight alone), and an engine over the fused blocks decodes the tokens of one over the plain."""
    import copy

    from gptj.kernels import fused
    from gptj.quant import quantize_model

    plain = tiny(2, torch.bfloat16, seed=3)
    quantize_model(plain, "int8")
    model, unfused = copy.deepcopy(plain), copy.deepcopy(plain)
    assert prepare_for_serving(model, max_rows=4)["fused_blocks"] == 2
    x = torch.randn(1, 5, plain.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        for p, f in zip(plain.transformer.h, model.transformer.h):
            got = [*f.w_qkv(x).split(f.qkv_sizes, -1), *f.w_gate_up(x).chunk(2, -1)]
            want = [p.attn.q_proj(x), p.attn.k_proj(x), p.attn.v_proj(x), p.mlp.gate_proj(x), p.mlp.up_proj(x)]
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    monkeypatch.setattr(fused, "_fusable", lambda block: False)
    assert prepare_for_serving(unfused, max_rows=4)["fused_blocks"] == 0
    prompts, config = prompts_of([9, 4, 14], seed=11), EngineConfig(max_seqs=4, block_size=16, kv_blocks=32)
    assert Engine(model, config).generate(prompts, GREEDY) == Engine(unfused, config).generate(prompts, GREEDY)
