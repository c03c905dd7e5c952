"""Prompt-lookup speculation inside continuous batching (issue 60): gptj.engine.draft's n-gram drafts,
verified in the engine's step (engine/scheduler.py's Verify, engine/update.py's _accept).

The claim under test: a greedy request's tokens are those of decoding without speculation. Drafts
from the n-gram drafter itself (random prompts that repeat spans), and from an oracle that knows
the answer and spoils one token of some drafts, so that whole drafts, partial drafts and rejected
drafts all occur; with chunked prefill, prefix sharing, preemption and stalls (a small KV pool), EOS
and min_new_tokens inside a draft; on the tiny GPT-J and a tiny Llama (grouped-query attention).
A draft's tokens are decode rows (engine/input_batch.py), each at its own position, run by the decode
kernels as a token decoded alone is: float32 mostly, and bfloat16 on every kernel path, where each
token's log-probability from a draft's row equals, bit for bit, the one decoding it alone gives.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

import gptj.engine.scheduler as scheduler_module
from gptj.config import get_preset
from gptj.decode import GenerationConfig
from gptj.engine import Engine, EngineConfig
from gptj.engine.draft import ngram_draft
from gptj.weights.io import model_from_state_dict, random_state_dict

from test_engine_llama import tiny as tiny_llama


# --- the drafter ---------------------------------------------------------------------------------


def test_draft_is_what_followed_the_longest_suffix_seen_before():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # suffix [6, 7] occurred at 1 and 5; the most recent (5) was followed by 9, 2, 6, 7
    assert ngram_draft(tokens, 3, max_ngram=2) == [9, 2, 6]
    # suffix [2, 6, 7] never occurred before; [6, 7] did
    assert ngram_draft(tokens, 3, max_ngram=3) == [9, 2, 6]
    # the longest suffix wins over a more recent shorter one: [1, 2] occurred at 0 (then 3), [2] at 4 (then 9)
    assert ngram_draft([1, 2, 3, 7, 2, 9, 1, 2], 2, max_ngram=2) == [3, 7]
    assert ngram_draft([1, 2, 3, 7, 2, 9, 1, 2], 2, max_ngram=1) == [9, 1]


def test_draft_copies_on_over_itself_past_the_end_and_is_empty_without_a_match():
    # what followed the first 4 is the last token; the copy goes on over what it drafted (period 1)
    assert ngram_draft([4, 4], 5, max_ngram=3) == [4, 4, 4, 4, 4]
    # [8, 9] last occurred 3 tokens ago: the text's period is 3, so the draft repeats its last 3 tokens
    assert ngram_draft([1, 8, 9, 5, 8, 9], 7, max_ngram=2) == [5, 8, 9, 5, 8, 9, 5]
    assert ngram_draft([1, 8, 9, 5, 8, 9], 2, max_ngram=2) == [5, 8]  # k within what followed: no repeat
    assert ngram_draft([1, 2, 3], 5, max_ngram=3) == []
    assert ngram_draft([7], 5, max_ngram=3) == []
    assert ngram_draft([1, 2, 1, 2], 0, max_ngram=3) == []
    assert ngram_draft([1, 2, 9, 1, 2], 5, max_ngram=2, min_ngram=2) == [9, 1, 2, 9, 1]
    assert ngram_draft([3, 2, 9, 1, 2], 5, max_ngram=2, min_ngram=2) == []  # [1, 2] never before; [2] too short


def test_generation_config_says_which_requests_speculate():
    on = GenerationConfig(prompt_lookup_num_tokens=4)
    assert on.speculates and not GenerationConfig().speculates and not on.replace(prompt_lookup_num_tokens=0).speculates
    assert not on.replace(num_beams=2).speculates  # beams and penalties decode as before
    assert on.replace(do_sample=True, temperature=0.7).speculates
    assert not on.replace(repetition_penalty=1.2).speculates
    assert on.replace(do_sample=True, temperature=0.0).speculates  # temperature 0 is greedy
    with pytest.raises(Exception, match="max_matching_ngram_size"):
        GenerationConfig(max_matching_ngram_size=0)


# --- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gptj_tiny():
    cfg = get_preset("tiny").replace(vocab_size=256, bos_token_id=0, eos_token_id=1)  # a small vocabulary: the steps' logits are cheap
    return model_from_state_dict(cfg, random_state_dict(cfg, seed=3, std=0.3))


def repeating_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat spans of themselves (what a summary's article gives the drafter)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        span = [rng.randrange(2, vocab) for _ in range(rng.randrange(6, 14))]
        prompts.append([rng.randrange(2, vocab) for _ in range(i)] + span * 3 + span[:rng.randrange(1, 5)])
    return prompts


SMALL = dict(max_seqs=8, max_len=192)  # a small KV pool (the default plans one from free memory)


def run(model, prompts, gen, config=EngineConfig(**SMALL), after_step=None):
    """Each prompt's tokens, finish reasons, and the engine's stats."""
    engine = Engine(model, config)
    reqs = [engine.add_request(p, gen) for p in prompts]
    while engine.has_work:
        engine.step()
        if after_step is not None:
            after_step(engine)
    return [r.output for r in reqs], [r.finish_reason for r in reqs], engine


CONFIGS = {
    "whole": EngineConfig(**SMALL),
    "chunked": EngineConfig(prefill_chunk=24, **SMALL),  # drafts and chunks share the step's token budget
    "small-pool": EngineConfig(kv_blocks=16, block_size=8, max_seqs=8),  # preemptions, stalls, drafts without room
    "no-prefix-cache": EngineConfig(prefix_caching=False, **SMALL),
}


def same_tokens(model, name, n=4, new=16):
    prompts = repeating_prompts(model.config.vocab_size, n)
    prompts += [prompts[0][:20] + [5, 6, 7]]  # shares a prefix with the first: its blocks come from the cache
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=new, eos_token_id=None)
    plain, _, _ = run(model, prompts, gen, CONFIGS[name])
    spec, _, engine = run(model, prompts, gen.replace(prompt_lookup_num_tokens=4), CONFIGS[name])
    assert spec == plain
    stats = engine.stats()
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens
    if name == "small-pool":
        assert stats.preemptions + stats.stalls > 0  # the pool was short while drafts ran


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_are_those_without_speculation(gptj_tiny, name):
    same_tokens(gptj_tiny, name, *((6, 24) if name == "small-pool" else ()))  # (enough to fill the small pool)


@pytest.fixture(scope="module")
def trained_copier():
    """The tiny preset trained here (a few seconds) on what a summary asks of a model: continuing a
    span of its prompt. Each sequence is a random span of COPIER_PERIOD tokens, repeated; the loss is on
    the repeats (it learns to repeat what came COPIER_PERIOD tokens before). Trained, its choices come
    from what it learned, and its drafts are taken: the verifying rows run whole drafts and long
    accepted runs, as a summarizer's copying would."""
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(vocab_size=64, bos_token_id=0, eos_token_id=1)
    model = model_from_state_dict(cfg, random_state_dict(cfg, seed=5, std=0.02))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = torch.Generator().manual_seed(0)
    n = COPIER_PERIOD
    for _ in range(COPIER_STEPS):
        x = torch.randint(2, cfg.vocab_size, (16, n), generator=rng).repeat(1, 3)
        logits = model(x[:, :-1])[:, n - 1:]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, n:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model.requires_grad_(False)


COPIER_STEPS, COPIER_PERIOD = 200, 12  # (its loss falls below 0.1 by step 150)


@pytest.mark.parametrize("name", ["chunked", "small-pool"])
def test_a_trained_copier_takes_its_drafts_and_the_same_tokens(trained_copier, name):
    same_tokens(trained_copier, name, *((6, 24) if name == "small-pool" else (4, 24)))
    rng = random.Random(7)
    spans = [[rng.randrange(2, 64) for _ in range(COPIER_PERIOD)] for _ in range(3)]
    prompts = [[rng.randrange(2, 64) for _ in range(5)] + span * 2 + span[:3] for span in spans]
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=24, eos_token_id=None)
    out, _, engine = run(trained_copier, prompts, gen.replace(prompt_lookup_num_tokens=4), CONFIGS[name])
    assert out == [(span * 9)[3:27] for span in spans]  # it continues the span
    stats = engine.stats()
    assert stats.accepted_tokens >= 0.8 * stats.draft_tokens > 0  # a copier's drafts are right


def test_on_every_kernel_path(gptj_tiny, kernel_path):
    same_tokens(gptj_tiny, "chunked", 2, 12)


class Oracle:
    """A drafter that knows each prompt's answer (from a run without speculation): its drafts are the
    true continuation, with the token at a rotating position of every other draft spoiled, so that
    drafts are taken whole, in part, or not at all. Counts what it should be accepted."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.answers, self.vocab, self.calls = answers, vocab, 0
        self.drafted = self.accepted = 0

    def __call__(self, tokens, k, max_ngram, min_ngram=1):
        prompt = next(p for p in self.answers if tuple(tokens[:len(p)]) == p and len(tokens) - len(p) <= 64)
        done = len(tokens) - len(prompt)
        truth = self.answers[prompt][done:done + k]
        draft = list(truth)
        self.calls += 1
        if self.calls % 2 and draft:
            at = self.calls % len(draft)
            draft[at] = (draft[at] + 1) % self.vocab
        take = 0  # drafted tokens taken: as far as they are the answer's
        while take < len(draft) and draft[take] == truth[take]:
            take += 1
        self.drafted += len(draft)
        self.accepted += take
        return draft


def with_oracle(monkeypatch, model, prompts, gen, config=EngineConfig(**SMALL)):
    plain, reasons, _ = run(model, prompts, gen, config)
    answers = {tuple(p): out for p, out in zip(prompts, plain)}
    oracle = Oracle(answers, model.config.vocab_size)
    monkeypatch.setattr(scheduler_module, "ngram_draft", oracle)  # it sees prompt + output, as the drafter
    return plain, reasons, oracle


def test_oracle_drafts_are_taken_as_far_as_they_are_right(gptj_tiny, monkeypatch):
    prompts = repeating_prompts(gptj_tiny.config.vocab_size, 3, seed=1)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=20, eos_token_id=None)
    plain, _, oracle = with_oracle(monkeypatch, gptj_tiny, prompts, gen)
    spec, reasons, engine = run(gptj_tiny, prompts, gen.replace(prompt_lookup_num_tokens=5))
    assert spec == plain and reasons == ["length"] * len(prompts)
    stats = engine.stats()
    assert (stats.draft_tokens, stats.accepted_tokens) == (oracle.drafted, oracle.accepted)
    assert stats.accepted_tokens > stats.draft_tokens // 3  # half the drafts are right all the way
    # without drafts: one step a token, the first at admission; each accepted one saves its request a step
    assert stats.steps < gen.max_new_tokens


def test_eos_and_min_new_tokens_inside_a_draft(gptj_tiny, monkeypatch):
    prompts = repeating_prompts(gptj_tiny.config.vocab_size, 2, seed=2)
    free, _, _ = run(gptj_tiny, prompts, GenerationConfig(pad_token_id=0, max_new_tokens=20, eos_token_id=None))
    eos = free[0][6]  # a token the first answer produces at step 7: EOS lies inside some draft
    for gen in (GenerationConfig(pad_token_id=0, max_new_tokens=20, eos_token_id=eos),
                GenerationConfig(pad_token_id=0, max_new_tokens=20, eos_token_id=eos, min_new_tokens=9)):  # masked at first
        monkeypatch.undo()
        plain, reasons, oracle = with_oracle(monkeypatch, gptj_tiny, prompts, gen)
        spec, spec_reasons, engine = run(gptj_tiny, prompts, gen.replace(prompt_lookup_num_tokens=5))
        assert spec == plain and spec_reasons == reasons and "stop" in reasons
        assert engine.stats().accepted_tokens > 0


def test_rejected_draft_slots_are_never_read(gptj_tiny, monkeypatch):
    """After every step, each running sequence's KV slots past its length (where rejected draft
    tokens were written) are filled with large values: were any read with a nonzero weight, the
    tokens would change."""
    prompts = repeating_prompts(gptj_tiny.config.vocab_size, 3, seed=4)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=16, eos_token_id=None)
    plain, _, oracle = with_oracle(monkeypatch, gptj_tiny, prompts, gen)

    def poison(engine):
        B = engine.kv.block_size
        for req in engine.scheduler.running:
            for seq in req.seqs:
                for p in range(seq.length, len(seq.blocks) * B):
                    for t in engine.runner.kv.stacked[:2]:
                        t[:, seq.blocks[p // B], :, p % B, :] = 1e4

    spec, _, engine = run(gptj_tiny, prompts, gen.replace(prompt_lookup_num_tokens=5), after_step=poison)
    assert spec == plain
    assert engine.stats().draft_tokens > engine.stats().accepted_tokens > 0  # some drafts were rejected


def test_llama_grouped_query_attention(monkeypatch):
    model = tiny_llama(kv=2)
    prompts = repeating_prompts(model.config.vocab_size, 3, seed=5)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=12, eos_token_id=None)
    spec, _, engine = run(model, prompts, gen.replace(prompt_lookup_num_tokens=4), CONFIGS["chunked"])
    assert spec == run(model, prompts, gen, CONFIGS["chunked"])[0] and engine.stats().draft_tokens > 0
    plain, _, oracle = with_oracle(monkeypatch, model, prompts, gen)
    spec, _, engine = run(model, prompts, gen.replace(prompt_lookup_num_tokens=4))
    assert spec == plain and engine.stats().accepted_tokens == oracle.accepted > 0


def wide_bf16_gptj(n_embd: int = 256, quantize: str | None = None) -> torch.nn.Module:
    cfg = get_preset("tiny").replace(vocab_size=256, bos_token_id=0, eos_token_id=1, n_embd=n_embd, n_head=8)
    model = model_from_state_dict(cfg, random_state_dict(cfg, seed=3, std=0.3)).to(torch.bfloat16)
    if quantize:  # int4 (gptj.native's int4 GEMV) or w4a8 (x rounded row by row): a row's sums do not depend
        from gptj.quant import quantize_model  # on the call

        quantize_model(model, quantize, 128)
    return model


def check_drafts_change_no_bit(model, monkeypatch, config: EngineConfig, prompts: int = 3,
                               new_tokens: int = 16) -> None:
    """With the serving kernels (build_engine), oracle drafts (some rejected) give each token and its
    log-probability bit for bit as decoding without drafts does."""
    from gptj.runtime.build import build_engine

    prompts = repeating_prompts(model.config.vocab_size, prompts, seed=8)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=new_tokens, eos_token_id=None)

    def run_with(g):
        engine = build_engine(model, config, free_bytes=1 << 30)
        reqs = [engine.add_request(p, g, logprobs=1) for p in prompts]
        while engine.has_work:
            engine.step()
        return [(r.output, [lp.logprob for lp in r.token_logprobs]) for r in reqs], engine.stats()

    plain, _ = run_with(gen)
    oracle = Oracle({tuple(p): out for p, (out, _) in zip(prompts, plain)}, model.config.vocab_size)
    monkeypatch.setattr(scheduler_module, "ngram_draft", oracle)
    spec, stats = run_with(gen.replace(prompt_lookup_num_tokens=5))
    assert spec == plain
    assert stats.accepted_tokens == oracle.accepted > 0 and stats.draft_tokens > stats.accepted_tokens


@pytest.mark.parametrize("arch", ["gptj", "llama", "gptj-int4", "gptj-w4a8"])
def test_bfloat16_draft_rows_are_decode_rows(arch, kernel_path, monkeypatch):
    """In bfloat16, with the serving kernels (build_engine): a draft's rows run the decode kernels at
    their own positions, so each token's log-probability is the one decoding it alone gives, bit for
    bit (the kernels sum each row in one fixed order, whatever rows share the call), and the tokens
    are the same. (Run as a prompt chunk of their own, the prefill kernels' sums differed in the last
    bits, and some tokens with them.)"""
    if arch == "gptj-w4a8" and kernel_path == "fallback":
        pytest.skip("w4a8's fallback is F.linear in float32 on the rounded x, which sums 1 and 6 rows in different "
                    "orders: exact w4a8 drafts are gptj.native's (w4a8.c sums each output alone)")
    model = (tiny_llama(kv=2, dtype=torch.bfloat16) if arch == "llama" else
             wide_bf16_gptj(quantize=arch.partition("-")[2] or None))
    check_drafts_change_no_bit(model, monkeypatch, EngineConfig(**SMALL))


def test_bfloat16_drafts_at_width_through_the_native_gemv(kernel_path, monkeypatch):
    """One request at a time (max_seqs 1: the bfloat16 linears take gptj.native's layout,
    policy.NATIVE_LAYOUT_MAX_ROWS) at a width where the GEMV's sums span its accumulators and K's
    chunks (n_embd 1024; fc_out's K 4096): a step of 1 row and one of 6 rows (a draft of 5) sum each
    output in the same order (gemv.c's CHAINS), so the drafts change no bit. Before that change the
    one-row GEMV summed with 4 accumulators and 3+ rows with one, and this failed on the native path."""
    if kernel_path == "fallback":
        pytest.skip("torch's own bfloat16 linear sums 1 and 6 rows in different orders at this width: exact "
                    "bfloat16 drafts there are gptj.native's (float32 drafts are exact on every path: test_on_every_kernel_path)")
    check_drafts_change_no_bit(wide_bf16_gptj(1024), monkeypatch, EngineConfig(max_seqs=1, max_len=192), prompts=2,
                               new_tokens=24)


def test_greedy_drafts_rows_come_to_the_host_in_the_steps_one_copy(gptj_tiny, monkeypatch):
    """A step where greedy requests verify drafts beside greedy requests that decode plainly reads the
    device once (the sampler's one copy: `choose`'s, the drafts' rows with the rest); the tokens are
    those without drafts."""
    prompts = repeating_prompts(gptj_tiny.config.vocab_size, 4, seed=9)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=12, eos_token_id=None)
    plain, _, oracle = with_oracle(monkeypatch, gptj_tiny, prompts, gen)
    engine = Engine(gptj_tiny, EngineConfig(**SMALL))
    reqs = [engine.add_request(p, gen.replace(prompt_lookup_num_tokens=4) if i % 2 else gen)
            for i, p in enumerate(prompts)]
    reads, mixed = [], []
    tolist, apply = torch.Tensor.tolist, engine.updater.apply

    def counted(t):
        reads.append(1)
        return tolist(t)

    def apply_counting(sched, result):
        reads.clear()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", counted)
            out = apply(sched, result)
        if sched.verify and sched.decode and not sched.prefill:
            mixed.append(len(reads))
        return out

    monkeypatch.setattr(engine.updater, "apply", apply_counting)
    while engine.has_work:
        engine.step()
    assert [r.output for r in reqs] == plain
    assert mixed and set(mixed) == {1} and engine.stats().accepted_tokens > 0


def test_beams_ignore_it(gptj_tiny):
    prompts = repeating_prompts(gptj_tiny.config.vocab_size, 2, seed=6)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=8, num_beams=2, eos_token_id=None)
    plain, _, _ = run(gptj_tiny, prompts, gen)
    spec, _, engine = run(gptj_tiny, prompts, gen.replace(prompt_lookup_num_tokens=4))
    assert spec == plain and engine.stats().draft_tokens == 0


def test_seeded_sampling_gives_the_same_tokens(gptj_tiny, monkeypatch):
    """Each request draws from its own generator once per token with and without drafts (the draws
    stop at the first token that is not the draft's), so a seed's tokens are the same; the oracle's
    drafts are the tokens of the run without them, so most are taken."""
    prompts = repeating_prompts(gptj_tiny.config.vocab_size, 3, seed=9)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=20, do_sample=True, temperature=0.8, top_k=20,
                           top_p=0.9, eos_token_id=None)
    gens = [gen.replace(seed=s) for s in (1, 2, 3)]
    engine = Engine(gptj_tiny, EngineConfig(**SMALL))
    reqs = [engine.add_request(p, g) for p, g in zip(prompts, gens)]
    while engine.has_work:
        engine.step()
    plain = [r.output for r in reqs]
    oracle = Oracle({tuple(p): out for p, out in zip(prompts, plain)}, gptj_tiny.config.vocab_size)
    monkeypatch.setattr(scheduler_module, "ngram_draft", oracle)
    engine = Engine(gptj_tiny, EngineConfig(**SMALL))
    reqs = [engine.add_request(p, g.replace(prompt_lookup_num_tokens=4)) for p, g in zip(prompts, gens)]
    while engine.has_work:
        engine.step()
    assert [r.output for r in reqs] == plain
    stats = engine.stats()
    assert (stats.draft_tokens, stats.accepted_tokens) == (oracle.drafted, oracle.accepted)
    assert stats.accepted_tokens > 0 and stats.steps < gen.max_new_tokens


def test_logprobs_come_from_the_verified_rows(gptj_tiny):
    prompts = repeating_prompts(gptj_tiny.config.vocab_size, 2, seed=7)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=12, eos_token_id=None)
    outs = []
    for g in (gen, gen.replace(prompt_lookup_num_tokens=4)):
        engine = Engine(gptj_tiny, EngineConfig(**SMALL))
        reqs = [engine.add_request(p, g, logprobs=2) for p in prompts]
        while engine.has_work:
            engine.step()
        outs.append(reqs)
    for plain, spec in zip(*outs):
        assert spec.output == plain.output
        assert [lp.token for lp in spec.token_logprobs] == spec.output
        # the same token's log-probability from a draft row and a decode row: float32 rounding apart
        for a, b in zip(plain.token_logprobs, spec.token_logprobs):
            assert abs(a.logprob - b.logprob) <= 1e-4 * max(1.0, abs(a.logprob))
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_drafts_back_off_when_they_are_never_right(gptj_tiny, monkeypatch):
    """Every draft wrong (its tokens one off the answer's): the request drafts 5, 2, 1 tokens, then
    one token after every DRAFT_WAIT steps; the tokens are still those without drafts."""
    from gptj.engine.update import DRAFT_WAIT

    prompts = repeating_prompts(gptj_tiny.config.vocab_size, 1, seed=8)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=40, eos_token_id=None)
    plain, _, _ = run(gptj_tiny, prompts, gen)
    answer, V = plain[0], gptj_tiny.config.vocab_size
    drafts = []

    def wrong(tokens, k, max_ngram, min_ngram=1):
        done = len(tokens) - len(prompts[0])
        drafts.append([(t + 1) % V for t in answer[done:done + k]])
        return drafts[-1]

    monkeypatch.setattr(scheduler_module, "ngram_draft", wrong)
    spec, _, engine = run(gptj_tiny, prompts, gen.replace(prompt_lookup_num_tokens=5))
    assert spec == plain and engine.stats().accepted_tokens == 0
    assert [len(d) for d in drafts[:4]] == [5, 2, 1, 1]
    assert len(drafts) <= 3 + gen.max_new_tokens // (DRAFT_WAIT + 1) + 1
    assert engine.stats().draft_tokens == sum(map(len, drafts))


# --- the server ----------------------------------------------------------------------------------


def test_served_requests_choose_speculation_and_metrics_count_it(tmp_path, monkeypatch):
    """A request's `speculate` field turns it on ('ngram') or off ('off') over the server's --speculate;
    the tokens are the same; /metrics counts the drafted and accepted tokens as the engine does.
    (`gptj init`'s random model copies nothing: the drafts come from an oracle that knows the answer.)"""
    from gptj.cli import main
    from serve_util import server_thread
    from test_serve import call, metric

    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "tiny"), "--seed", "1"]) == 0
    body = {"model": "tiny", "prompt": "one two three four", "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}
    with server_thread({"tiny": tmp_path / "tiny"}) as server:
        status, out, _ = call(server.url, body=body)
    assert status == 200, out
    prompt, plain = out["choices"][0]["prompt_token_ids"], out["choices"][0]["token_ids"]
    monkeypatch.setattr(scheduler_module, "ngram_draft", Oracle({tuple(prompt): plain}, 50400))
    for settings, field, drafts in (({}, {}, False), ({}, {"speculate": "ngram"}, True),
                                    ({"speculate_tokens": 3}, {}, True),
                                    ({"speculate_tokens": 3}, {"speculate": "off"}, False)):
        with server_thread({"tiny": tmp_path / "tiny"}, **settings) as server:
            status, out, _ = call(server.url, body=body | field)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == plain
            drafted = metric(server.url, "gptj_spec_draft_tokens_total", model="tiny")
            accepted = metric(server.url, "gptj_spec_accepted_tokens_total", model="tiny")
            stats = server.state.models["tiny"].engine.stats()
            assert (drafted, accepted) == (stats.draft_tokens, stats.accepted_tokens)
            assert (accepted > 0) == (drafted > 0) == drafts, (settings, field)
            status, out, _ = call(server.url, body=body | {"speculate": "sometimes"})
            assert status == 400 and "speculate" in json.dumps(out)


def test_generate_flag(tmp_path, capsys):
    """`gptj generate --speculate ngram` prints what it prints without it; beams say once that it does not apply."""
    from gptj.cli import main

    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "tiny"), "--seed", "1"]) == 0
    args = ["generate", "--model", str(tmp_path / "tiny"), "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-new-tokens", "6",
            "--json"]
    capsys.readouterr()
    outs = []
    for extra in ([], ["--speculate", "ngram", "--speculate-tokens", "3", "--speculate-ngram", "2"]):
        assert main(args + extra) == 0
        outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 6
    assert main(args + ["--speculate", "ngram", "--num-beams", "2"]) == 0
    assert capsys.readouterr().err.count("--speculate") == 1


def test_bench_latency_reports_drafts(gptj_tiny, monkeypatch):
    """`gptj bench latency --speculate ngram`'s figures: the drafted and accepted tokens of the timed runs
    and the decode tokens per step; drafts from an oracle of the run's answers, right ones and then
    ones that are always one off."""
    from gptj.bench.latency import measure_latency, random_prompts

    B, P, N = 2, 8, 6
    prompts = random_prompts(B, P, gptj_tiny.config.vocab_size, 0)  # the timed run's (warmup 0, seed 0)
    gen = GenerationConfig(pad_token_id=0, max_new_tokens=N, min_new_tokens=N, eos_token_id=None)
    answers, _, _ = run(gptj_tiny, prompts, gen)
    for spoil in (0, 1):
        oracle = Oracle({tuple(p): [(t + spoil) % 256 for t in a] for p, a in zip(prompts, answers)}, 256)
        monkeypatch.setattr(scheduler_module, "ngram_draft", oracle)
        r = measure_latency(gptj_tiny, batch_size=B, prompt_len=P, new_tokens=N, warmup=0, repeats=1,
                            engine=EngineConfig(max_seqs=B, max_len=64), speculation={"prompt_lookup_num_tokens": 2})
        assert (r["draft_tokens"], r["accepted_tokens"]) == (oracle.drafted, oracle.accepted if not spoil else 0)
        assert (r["tokens_per_step"] > 1.5) if not spoil else (r["tokens_per_step"] == 1.0)
