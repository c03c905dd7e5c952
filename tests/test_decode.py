"""Tests for gptj.decode: token-for-token parity with HF transformers' generate.

Small random GPT-J models with the real 50400-token vocabulary; the same weights go into
gptj's model and HF's GPTJForCausalLM (tests/hf_ref.py). The lm_head bias of EOS is raised
in some models so that generations end, exercising EOS handling, min_new_tokens and early
stopping.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gptj.config import GPTJConfig
from gptj.decode import (
    EOS_TOKEN_ID,
    MAX_INPUT_TOKENS,
    GenerationConfig,
    beam_search,
    block_eos,
    generate,
    left_pad,
    top_k_filter,
    top_p_filter,
    warp,
)
from gptj.errors import GptjError
from hf_ref import EOS, hf_generate, make_pair

TINY = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=256, n_positions=256)


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS, (n,), generator=g).tolist() for n in lengths]


PROMPTS = random_prompts((5, 9, 1, 12), seed=5)  # different lengths: a left-padded batch


@pytest.fixture(scope="module")
def eos_pair():
    """EOS is likely: greedy rows end after a few tokens, beams after min_new_tokens."""
    return make_pair(TINY, seed=1, std=0.3, eos_bias=10.0)


@pytest.fixture(scope="module")
def plain_pair():
    """EOS no more likely than any token: generations run to max_new_tokens."""
    return make_pair(TINY, seed=2, std=0.3)


# --- greedy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg, eos_bias", [
    (TINY, 0.0),
    (TINY, 8.0),  # some rows end early and then emit pads in HF's batch
    (GPTJConfig(n_layer=3, n_embd=128, n_head=4, rotary_dim=None, n_positions=128), 0.0),  # full-head rotary
    (GPTJConfig(n_layer=2, n_embd=96, n_head=4, rotary_dim=16, n_positions=128), 6.0),  # head_dim 24
    (GPTJConfig(n_layer=3, n_embd=128, n_head=8, rotary_dim=16, n_positions=128), 0.0),  # rotary = head_dim
], ids=["tiny", "tiny-eos", "full-rotary", "head24", "8heads"])
def test_greedy_matches_hf(cfg, eos_bias):
    ours, hf = make_pair(cfg, seed=3, std=0.3, eos_bias=eos_bias)
    want = hf_generate(hf, PROMPTS, max_new_tokens=24, do_sample=False)
    got = generate(ours, PROMPTS, GenerationConfig(max_new_tokens=24))
    assert got == want
    if eos_bias >= 8.0:
        assert any(len(t) < 24 and t[-1] == EOS for t in got), "EOS should end some rows"


def test_greedy_min_new_tokens_matches_hf(eos_pair):
    ours, hf = eos_pair
    want = hf_generate(hf, PROMPTS, max_new_tokens=20, min_new_tokens=6, do_sample=False)
    got = generate(ours, PROMPTS, GenerationConfig(max_new_tokens=20, min_new_tokens=6))
    assert got == want
    assert all(len(t) >= 7 for t in got)
    # Without min_new_tokens some prompt ends earlier: the constraint did something.
    free = generate(ours, PROMPTS, GenerationConfig(max_new_tokens=20))
    assert any(len(t) < 7 for t in free)


def test_greedy_without_eos_runs_to_max(eos_pair):
    ours, hf = eos_pair
    got = generate(ours, PROMPTS, GenerationConfig(max_new_tokens=10, eos_token_id=None))
    assert all(len(t) == 10 for t in got)
    assert any(EOS in t[:-1] for t in got)  # EOS generated, but it does not stop anything
    ids, mask = left_pad(PROMPTS, EOS)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=EOS,
                           eos_token_id=None)[:, ids.shape[1]:].tolist()
    assert got == want


# --- beam search -----------------------------------------------------------------------------


def hf_beam(hf, prompts, **kwargs):
    """HF beam search: (new tokens cut after EOS, sequences_scores)."""
    ids, mask = left_pad(prompts, EOS)
    kwargs.setdefault("pad_token_id", EOS)
    kwargs.setdefault("eos_token_id", EOS)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, return_dict_in_generate=True,
                          output_scores=True, **kwargs)
    tokens = []
    for row in out.sequences[:, ids.shape[1]:].tolist():
        tokens.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return tokens, out.sequences_scores.tolist()


def test_mlperf_beam_search_matches_hf(eos_pair):
    ours, hf = eos_pair
    gen = GenerationConfig.mlperf(max_new_tokens=64)
    want, want_scores = hf_beam(hf, PROMPTS, num_beams=4, min_new_tokens=30, max_new_tokens=64,
                                early_stopping=True)
    ids, mask = left_pad(PROMPTS, EOS)
    got, scores = beam_search(ours, ids, mask, gen)
    assert got == want
    assert generate(ours, PROMPTS, gen) == want
    assert scores == pytest.approx(want_scores, rel=1e-5, abs=1e-6)
    # Every hypothesis ended with EOS, after min_new_tokens, before max_new_tokens: early stopping.
    assert all(t[-1] == EOS and EOS not in t[:-1] and 31 <= len(t) < 64 for t in got)
    # Without min_new_tokens the beams end much earlier: min_new_tokens blocked EOS.
    early = generate(ours, PROMPTS, gen.replace(min_new_tokens=0))
    assert all(t[-1] == EOS and len(t) <= 30 for t in early)
    assert early == hf_beam(hf, PROMPTS, num_beams=4, max_new_tokens=64, early_stopping=True)[0]


def test_mlperf_beam_search_to_max_length_matches_hf(plain_pair):
    """No EOS within max_new_tokens: the running beams become the hypotheses at the end."""
    ours, hf = plain_pair
    prompts = PROMPTS[:2]
    want, want_scores = hf_beam(hf, prompts, num_beams=4, min_new_tokens=30, max_new_tokens=40,
                                early_stopping=True)
    got, scores = beam_search(ours, *left_pad(prompts, EOS), GenerationConfig.mlperf(max_new_tokens=40))
    assert got == want
    assert all(len(t) == 40 for t in got)
    assert scores == pytest.approx(want_scores, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("num_beams, length_penalty, early_stopping, min_new", [
    (2, 1.0, False, 0),
    (3, 0.6, True, 4),
    (4, 2.0, False, 3),
    (3, -0.5, True, 0),
    (4, 1.5, "never", 5),
], ids=["b2-lp1-nostop", "b3-lp0.6", "b4-lp2-nostop", "b3-lp-0.5", "b4-never"])
def test_beam_search_variants_match_hf(num_beams, length_penalty, early_stopping, min_new):
    ours, hf = make_pair(TINY, seed=4, std=0.3, eos_bias=7.0)
    prompts = PROMPTS[:3]
    kwargs = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
                  min_new_tokens=min_new, max_new_tokens=16)
    want, want_scores = hf_beam(hf, prompts, **kwargs)
    got, scores = beam_search(ours, *left_pad(prompts, EOS), GenerationConfig(**kwargs))
    assert got == want
    assert scores == pytest.approx(want_scores, rel=1e-5, abs=1e-6)


# --- left-padded batches -----------------------------------------------------------------------


@pytest.mark.parametrize("gen", [
    GenerationConfig(max_new_tokens=20),
    GenerationConfig.mlperf(max_new_tokens=40),
], ids=["greedy", "beam"])
def test_batch_equals_prompts_alone(eos_pair, gen):
    ours, _ = eos_pair
    batch = generate(ours, PROMPTS, gen)
    alone = [generate(ours, [p], gen)[0] for p in PROMPTS]
    assert batch == alone


# --- sampling --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(temperature=0.7, top_k=40, top_p=0.9),
    dict(top_p=0.6),
    dict(top_k=5, temperature=1.3),
    dict(min_new_tokens=5, temperature=0.9),
], ids=["plain", "t-k-p", "p", "k-t", "min-new"])
def test_sampling_matches_hf_with_the_same_seed(eos_pair, kwargs):
    """HF samples with torch's global RNG; a Generator seeded alike draws the same numbers."""
    ours, hf = eos_pair
    torch.manual_seed(11)
    want = hf_generate(hf, PROMPTS, do_sample=True, max_new_tokens=16, **kwargs)
    got = generate(ours, PROMPTS, GenerationConfig(do_sample=True, seed=11, max_new_tokens=16, **kwargs))
    assert got == want
    torch.manual_seed(11)  # seed=None: the global RNG, exactly as HF
    assert generate(ours, PROMPTS, GenerationConfig(do_sample=True, max_new_tokens=16, **kwargs)) == want


def test_sampling_is_reproducible_per_seed(plain_pair):
    ours, _ = plain_pair
    gen = GenerationConfig(do_sample=True, seed=1, max_new_tokens=12)
    first = generate(ours, PROMPTS, gen)
    assert generate(ours, PROMPTS, gen) == first
    assert generate(ours, PROMPTS, gen.replace(seed=2)) != first


def test_sampling_degenerate_cases_are_greedy(plain_pair):
    ours, _ = plain_pair
    greedy = generate(ours, PROMPTS, GenerationConfig(max_new_tokens=12))
    assert generate(ours, PROMPTS, GenerationConfig(do_sample=True, top_k=1, seed=3, max_new_tokens=12)) == greedy
    assert generate(ours, PROMPTS, GenerationConfig(do_sample=True, temperature=0.0, max_new_tokens=12)) == greedy


def test_sampling_respects_min_new_tokens(eos_pair):
    ours, _ = eos_pair
    for seed in range(3):
        free = generate(ours, PROMPTS, GenerationConfig(do_sample=True, seed=seed, max_new_tokens=12))
        held = generate(ours, PROMPTS, GenerationConfig(do_sample=True, seed=seed, max_new_tokens=12,
                                                        min_new_tokens=6))
        assert any(len(t) < 7 for t in free)
        assert all(EOS not in t[:6] for t in held)


# --- logits processors against HF's ---------------------------------------------------------


def test_processors_match_hf():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 1000, generator=g) * 3
    ids = torch.zeros(3, 7, dtype=torch.long)  # 7 tokens, prompt of 4: 3 new so far
    for k in (1, 5, 50, 2000):
        assert torch.equal(top_k_filter(scores, k), TopKLogitsWarper(k)(ids, scores))
    for p in (0.05, 0.5, 0.9, 1.0 - 1e-6):
        assert torch.equal(top_p_filter(scores, p), TopPLogitsWarper(p)(ids, scores))
    gen = GenerationConfig(min_new_tokens=4, eos_token_id=17)
    assert torch.equal(block_eos(scores, 3, gen), MinNewTokensLengthLogitsProcessor(4, 4, 17)(ids, scores))
    assert torch.equal(block_eos(scores, 4, gen), scores)
    gen = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    hf_chain = TopPLogitsWarper(0.8)(ids, TopKLogitsWarper(20)(ids, TemperatureLogitsWarper(0.7)(ids, scores)))
    assert torch.equal(warp(scores, gen), hf_chain)


# --- configuration and validation ----------------------------------------------------------------


def test_mlperf_preset():
    gen = GenerationConfig.mlperf()
    assert (gen.num_beams, gen.min_new_tokens, gen.max_new_tokens, gen.early_stopping) == (4, 30, 128, True)
    assert (gen.eos_token_id, gen.pad_token_id, gen.do_sample, gen.length_penalty) == (EOS_TOKEN_ID, 50256,
                                                                                       False, 1.0)
    assert gen.method == "beam"
    assert MAX_INPUT_TOKENS == 1919
    assert GenerationConfig().method == "greedy"
    assert GenerationConfig(do_sample=True).method == "sample"


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=0), dict(max_new_tokens=-1), dict(max_new_tokens=1.5), dict(min_new_tokens=-1),
    dict(num_beams=0), dict(num_beams=True), dict(temperature=-0.1), dict(temperature=float("nan")),
    dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.01), dict(top_p=-0.5), dict(seed=-3), dict(seed="x"),
    dict(length_penalty=float("inf")), dict(early_stopping="sometimes"), dict(eos_token_id=-1),
    dict(pad_token_id=None), dict(do_sample="yes"), dict(do_sample=True, num_beams=4),
])
def test_invalid_generation_config(kwargs):
    with pytest.raises(GptjError):
        GenerationConfig(**kwargs)


@pytest.mark.parametrize("prompts, gen", [
    ([], GenerationConfig()),
    ([[]], GenerationConfig()),
    ([[1, 2], []], GenerationConfig()),
    ([[1, 50400]], GenerationConfig()),
    ([[-1]], GenerationConfig()),
    ([[1, 2.0]], GenerationConfig()),
    ("hello", GenerationConfig()),
    (["hello"], GenerationConfig()),
    ([[1] * 200], GenerationConfig(max_new_tokens=57)),  # 257 > n_positions 256
    ([[1]], GenerationConfig(eos_token_id=50400)),
    ([[1]], GenerationConfig(pad_token_id=60000)),
], ids=["no-prompts", "empty", "one-empty", "id-too-big", "negative", "float", "str", "str-list",
        "too-long", "eos-vocab", "pad-vocab"])
def test_invalid_prompts(plain_pair, prompts, gen):
    ours, _ = plain_pair
    with pytest.raises(GptjError):
        generate(ours, prompts, gen)


def test_longest_allowed_prompt(plain_pair):
    ours, _ = plain_pair
    got = generate(ours, [[1] * 200], GenerationConfig(max_new_tokens=56, eos_token_id=None))
    assert len(got[0]) == 56
