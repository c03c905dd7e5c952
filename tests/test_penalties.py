"""Issue 55 item 16: frequency, presence and repetition penalties and logit_bias, as vLLM applies them
(HF's rule for repetition): the rule on small logits, HF's processor and generate, the engine's batched
sampler against gptj.decode's path, and the server's parameters."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from gptj.config import GPTJConfig
from gptj.decode import GenerationConfig, block_eos, check_prompts, generate, penalize, penalty_args, warp
from gptj.engine import Engine, EngineConfig
from gptj.engine import sampler as sampler_module
from gptj.engine.request import Request
from gptj.engine.sampler import NOT_FINITE, choose
from gptj.errors import GptjError
from hf_ref import hf_generate, make_pair
from test_sampler import count_host_reads

V = 8


def col(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None]


# --- the rule, on small logits ---------------------------------------------------------------------

# Values and penalties are powers of two and small sums of them: every result below is exact in float32.
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 0.0, -4.0, 1.0, 3.0, -0.5],
                       [1.0, 1.0, -2.0, 4.0, 0.25, -8.0, 0.0, 2.0]])
COUNTS = torch.tensor([[2.0, 1, 0, 0, 3, 0, 0, 0],   # output tokens of row 0: 0 0 1 4 4 4
                       [0.0, 0, 1, 1, 0, 0, 0, 0]])  # row 1: 2 3
# each row's prompt then output tokens (row 0: prompt 5; row 1: prompt 0 6), the shorter row going on
# with its own first token
TOKENS = torch.tensor([[5, 0, 0, 1, 4, 4, 4],
                       [0, 6, 2, 3, 0, 0, 0]])


def test_repetition_divides_positive_and_multiplies_other_logits_of_prompt_and_output_tokens():
    got = penalize(LOGITS, repetition=col(2.0, 0.5), tokens=TOKENS)
    want = [[1.0, -2.0, 0.5, 0.0, -8.0, 0.5, 3.0, -0.5],  # seen: 0 1 4 5 (a penalty > 1 lowers each)
            [2.0, 1.0, -1.0, 8.0, 0.25, -8.0, 0.0, 2.0]]  # seen: 0 2 3 6 (< 1 raises; 0 stays 0)
    assert got.tolist() == want


def test_frequency_subtracts_per_output_occurrence_and_presence_once():
    freq = penalize(LOGITS, frequency=col(0.5, -1.0), tokens=TOKENS, counts=COUNTS)
    assert freq.tolist() == [[1.0, -1.5, 0.5, 0.0, -5.5, 1.0, 3.0, -0.5],  # prompt token 5 untouched
                             [1.0, 1.0, -1.0, 5.0, 0.25, -8.0, 0.0, 2.0]]
    pres = penalize(LOGITS, presence=col(2.0, 0.25), tokens=TOKENS, counts=COUNTS)
    assert pres.tolist() == [[0.0, -3.0, 0.5, 0.0, -6.0, 1.0, 3.0, -0.5],
                             [1.0, 1.0, -2.25, 3.75, 0.25, -8.0, 0.0, 2.0]]


def test_logit_bias_then_repetition_then_frequency_then_presence():
    """vLLM's order: the bias is added to the raw logit, the repetition penalty scales the sum."""
    bias = (torch.tensor([0, 1, 1]), torch.tensor([2, 6, 5]), torch.tensor([-1.5, 100.0, -100.0]))
    got = penalize(LOGITS, bias=bias, repetition=col(2.0, 1.0), tokens=TOKENS, frequency=col(0.5, 0.0),
                   presence=col(1.0, 0.0), counts=COUNTS)
    # row 0: token 0: 2 / 2 - 0.5 * 2 - 1 = -1; token 2 (not seen): 0.5 - 1.5 = -1; token 4: -4 * 2 - 1.5 - 1
    assert got.tolist() == [[-1.0, -3.5, -1.0, 0.0, -10.5, 0.5, 3.0, -0.5],
                            [1.0, 1.0, -2.0, 4.0, 0.25, -108.0, 100.0, 2.0]]
    assert LOGITS[0, 0] == 2.0  # the input is not written


def test_neutral_settings_leave_a_row_exactly_as_it_was():
    """The engine applies each operation to every penalized row of a step, with neutral values for the
    rows that lack it: those are exact no-ops (infinities, NaN and negative zero included)."""
    x = torch.tensor([[1.5, -0.0, float("-inf"), float("inf"), 3e38, -7.25, 0.0, 1e-40]])
    x = torch.cat([x, torch.tensor([[float("nan")] + [1.0] * (V - 1)])])
    got = penalize(x, repetition=col(1.0, 1.0), tokens=torch.arange(V).repeat(2, 1),
                   frequency=col(0.0, 0.0), presence=col(0.0, 0.0), counts=torch.full((2, V), 3.0))
    assert got[0].tolist() == x[0].tolist() and torch.equal(got[0].signbit(), x[0].signbit())
    assert got[1, 0].isnan() and got[1, 1:].tolist() == x[1, 1:].tolist()


def test_repetition_penalty_equals_hf_processor():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 50400, generator=g) * 4
    ids = torch.randint(0, 50400, (3, 40), generator=g)
    ids[:, 20:] = ids[:, :20]  # repeats
    for p in (1.3, 0.7, 2.0):
        want = RepetitionPenaltyLogitsProcessor(p)(ids, scores.clone())
        got = penalize(scores, **penalty_args([GenerationConfig(repetition_penalty=p)] * 3, "cpu", tokens=ids))
        assert torch.equal(got, want), p


# --- settings -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings,message", [
    (dict(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2]"),
    (dict(presence_penalty=-3.0), "presence_penalty must be in [-2, 2]"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be from 0.01 to 100"),
    (dict(repetition_penalty=5e-324), "repetition_penalty must be from 0.01 to 100"),  # (the fuzzer's: logits inf)
    (dict(repetition_penalty=1e300), "repetition_penalty must be from 0.01 to 100"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be from 0.01 to 100"),
    (dict(logit_bias={5: 101.0}), "logit_bias[5] must be in [-100, 100]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id must be an integer >= 0"),
    (dict(logit_bias={"5": 1.0}), "logit_bias token id must be an integer >= 0"),
    (dict(logit_bias="x"), "logit_bias must map token ids to biases"),
    (dict(num_beams=2, presence_penalty=0.5), "not supported with beam search"),
    (dict(num_beams=2, logit_bias={1: 1.0}), "not supported with beam search"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(GptjError, match=None) as err:
        GenerationConfig(**settings)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_logit_bias_is_kept_hashable_and_checked_against_the_vocabulary():
    gen = GenerationConfig(logit_bias={9: 1.0, 3: -2})
    assert gen.logit_bias == ((3, -2.0), (9, 1.0)) and hash(gen) == hash(GenerationConfig(logit_bias=[(3, -2), (9, 1)]))
    assert GenerationConfig(logit_bias={}).logit_bias is None and not GenerationConfig(logit_bias={}).penalized
    assert GenerationConfig(repetition_penalty=1.0, frequency_penalty=0.0).penalized is False
    model = make_pair(GPTJConfig(n_layer=1, n_embd=32, n_head=4, rotary_dim=8, n_inner=64, n_positions=64))[0]
    check_prompts(model, [[1, 2]], GenerationConfig(max_new_tokens=4, logit_bias={50399: 1.0}))
    with pytest.raises(GptjError, match=r"logit_bias token id 50400 is outside the vocabulary \[0, 50400\)"):
        check_prompts(model, [[1, 2]], GenerationConfig(max_new_tokens=4, logit_bias={50400: 1.0}))


# --- the engine's sampler ---------------------------------------------------------------------------------

W = 50


def request(rid: str, gen: GenerationConfig, prompt: list[int], output: list[int]) -> Request:
    req = Request(rid, list(prompt), gen)
    req.output = list(output)
    if gen.sampling:
        req.generator = torch.Generator().manual_seed(gen.seed)
    return req


def reference_scores(logits: torch.Tensor, gen: GenerationConfig, prompt: list[int], output: list[int]) -> torch.Tensor:
    """What gptj.decode's path gives one request's row, its token state built from scratch."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).float()[None]
    scores = block_eos(logits, len(output), gen)
    tokens = torch.tensor([prompt + output])
    return penalize(scores, **penalty_args([gen], "cpu", tokens, counts)) if gen.penalized else scores


MIX = [dict(), dict(repetition_penalty=1.8), dict(frequency_penalty=1.5, presence_penalty=-0.5),
       dict(logit_bias={7: 3.0, 11: -100.0}), dict(presence_penalty=2.0, logit_bias={3: 1.0}, min_new_tokens=9,
                                                   eos_token_id=4),
       dict(repetition_penalty=0.6, frequency_penalty=-2.0)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_step_of_mixed_requests_chooses_each_as_decodes_path_alone_with_one_host_read(sampled, monkeypatch):
    """Six requests, four penalized differently, one without: one step's tokens are those each gets from
    its own penalized row (decode's rule), with the step's one device-to-host copy and nothing more;
    then, several steps on, the incremental token state still equals one built from scratch."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, W, (n,), generator=g).tolist() for n in (3, 5, 2, 4, 6, 1)]
    outputs = [torch.randint(0, W, (n,), generator=g).tolist() for n in (4, 6, 2, 0, 3, 8)]
    extra = dict(do_sample=True, temperature=0.8, top_k=30) if sampled else {}
    gens = [GenerationConfig(max_new_tokens=40, **kw, **extra, **({"seed": 50 + i} if sampled else {}))
            for i, kw in enumerate(MIX)]
    reqs = [request(f"r{i}", gen, p, o) for i, (gen, p, o) in enumerate(zip(gens, prompts, outputs))]
    for step in range(6):
        logits = torch.randn(len(reqs), W, generator=g) * 2  # one forward's rows, in order (views)
        states = [req.generator.get_state() if sampled else None for req in reqs]  # to draw again alone
        reads = count_host_reads(monkeypatch)
        choices = choose(logits, {req: range(i, i + 1) for i, req in enumerate(reqs)})
        assert reads == ["tolist"]
        monkeypatch.undo()
        for i, req in enumerate(reqs):
            want_scores = reference_scores(logits[i:i + 1], req.gen, req.prompt, req.output)
            if sampled:
                twin = torch.Generator()
                twin.set_state(states[i])
                probs = torch.softmax(warp(want_scores, req.gen), dim=-1)
                want = int(torch.multinomial(probs, 1, generator=twin)[0, 0])
            else:
                want = int(want_scores.argmax())
            assert choices[req].tokens == [want], (step, i)
            req.output.append(want)
    for req in reqs[1:]:  # the penalized ones (the unpenalized one holds no state): as of the last step,
        if req.gen.penalties:  # which saw all but the token it chose
            held = req.output[:-1]
            want = torch.bincount(torch.tensor(held), minlength=W).float()
            assert torch.equal(req.counts, want) and req.counted == len(held)
            state, n = req.tokens_state.tolist(), len(req.prompt) + len(held)  # prompt, output, then its first
            assert state[:n] == req.prompt + held and set(state[n:]) == {req.prompt[0]}
            assert len(state) >= len(req.prompt) + req.gen.max_new_tokens
    assert reqs[0].counts is None


def test_a_step_without_penalties_makes_no_extra_pass(monkeypatch):
    """The common case costs nothing: no penalize call and no token state, whatever the step holds."""
    calls = []
    monkeypatch.setattr(sampler_module, "penalize", lambda *a, **k: calls.append(1))
    logits = torch.randn(3, W, generator=torch.Generator().manual_seed(1))
    reqs = [request("a", GenerationConfig(), [1], [2]),
            request("b", GenerationConfig(do_sample=True, seed=1, top_p=0.9), [1], []),
            request("c", GenerationConfig(repetition_penalty=1.0, frequency_penalty=0.0, logit_bias={}), [1], [])]
    choose(logits, {req: range(i, i + 1) for i, req in enumerate(reqs)})
    assert calls == [] and all(req.counts is None for req in reqs)


def test_the_token_state_is_updated_in_place_while_the_step_holds_the_same_requests():
    """Steps with the same penalized requests in the same order write their stacked counts in place;
    a request joining copies the stack once, and each request then holds a row of the new one."""
    reqs = [request(f"r{i}", GenerationConfig(presence_penalty=1.0), [1, 2], []) for i in range(3)]
    logits = torch.zeros(4, W)
    choose(logits, {req: range(i, i + 1) for i, req in enumerate(reqs)})
    storage = reqs[0].counts.untyped_storage().data_ptr()
    held = reqs[0].tokens_state.untyped_storage().data_ptr()
    assert all(r.counts.untyped_storage().data_ptr() == storage for r in reqs)
    for step in range(3):
        for req in reqs:
            req.output.append(step + 5)
        choose(logits, {req: range(i, i + 1) for i, req in enumerate(reqs)})
        assert all(r.counts.untyped_storage().data_ptr() == storage for r in reqs)
        assert all(r.tokens_state.untyped_storage().data_ptr() == held for r in reqs)
    assert reqs[1].tokens_state[:5].tolist() == [1, 2, 5, 6, 7]
    assert all(r.counts[5:8].tolist() == [1.0, 1.0, 1.0] and r.counts.sum() == 3 for r in reqs)
    late = request("late", GenerationConfig(presence_penalty=1.0), [3], [9, 9])
    choose(logits, {req: range(i, i + 1) for i, req in enumerate(reqs + [late])})
    moved = late.counts.untyped_storage().data_ptr()
    assert moved != storage and all(r.counts.untyped_storage().data_ptr() == moved for r in reqs)
    assert late.counts[9] == 2 and reqs[2].counts.sum() == 3


def test_a_penalized_request_whose_logits_are_not_finite_fails_alone():
    logits = torch.randn(3, W, generator=torch.Generator().manual_seed(4))
    logits[1, 3] = float("nan")
    gens = [GenerationConfig(presence_penalty=1.0), GenerationConfig(presence_penalty=1.0),
            GenerationConfig(do_sample=True, seed=2, repetition_penalty=1.5)]
    reqs = [request(f"r{i}", gen, [1], [2]) for i, gen in enumerate(gens)]
    logits[2] = float("inf")
    choices = choose(logits, {req: range(i, i + 1) for i, req in enumerate(reqs)})
    assert choices[reqs[1]].error == NOT_FINITE["greedy"] and choices[reqs[2]].error == NOT_FINITE["sampled"]
    assert choices[reqs[0]].error is None
    assert choices[reqs[0]].tokens == [int(reference_scores(logits[:1], gens[0], [1], [2]).argmax())]


# --- whole generations: the engine and gptj.decode's path -------------------------------------------------

CFG = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=128, n_positions=256)
FAVOURED = 4242  # a token the tests bias up so that unpenalized decoding repeats it


@pytest.fixture(scope="module")
def pair():
    return make_pair(CFG, seed=2, std=0.02)  # logits within about +-1: a bias of 1.5 makes a token the best


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50000, (n,), generator=g).tolist() for n in lengths]


def test_decode_path_with_a_repetition_penalty_equals_hf_generate(pair):
    model, hf = pair
    (prompt,) = prompts_of([9], seed=5)
    for settings in (dict(), dict(do_sample=True, temperature=0.9, top_k=40)):
        for p in (1.4, 0.8):
            gen = GenerationConfig(max_new_tokens=20, eos_token_id=None, repetition_penalty=p, **settings)
            torch.manual_seed(7)
            ours = generate(model, [prompt], gen)[0]
            torch.manual_seed(7)
            assert ours == hf_generate(hf, [prompt], max_new_tokens=20, repetition_penalty=p, eos_token_id=None,
                                       **settings)[0]


ENGINE_MIX = [
    dict(),
    dict(logit_bias={FAVOURED: 1.5}),
    dict(logit_bias={FAVOURED: 1.5}, presence_penalty=2.0),
    dict(logit_bias={FAVOURED: 1.5}, frequency_penalty=2.0),
    dict(logit_bias={FAVOURED: 1.5}, repetition_penalty=8.0),
    dict(do_sample=True, seed=3, temperature=0.7, logit_bias={FAVOURED: 100.0}, presence_penalty=1.0),
    dict(do_sample=True, seed=4, top_p=0.9, repetition_penalty=0.5, frequency_penalty=-0.5),
    dict(do_sample=True, seed=5),
]


def test_the_engine_and_decode_path_give_the_same_tokens_with_and_without_penalties(pair):
    """float32, token for token: the engine's batched rows (penalized and not in the same steps, requests
    joining and leaving) against gptj.decode's path alone; the unpenalized requests keep their own
    tokens, and each penalty changes what it must (a favoured token that repeats without it does not)."""
    model = pair[0]
    prompts = prompts_of([5, 11, 3, 20, 7, 9, 14, 6], seed=1)
    gens = [GenerationConfig(max_new_tokens=10 + i, eos_token_id=None, **kw) for i, kw in enumerate(ENGINE_MIX)]
    engine = Engine(model, EngineConfig(max_seqs=16))
    together = engine.generate(prompts, gens)
    assert max(engine.decode_batch_sizes) == len(gens)  # all in the same steps
    alone = [generate(model, [p], g)[0] for p, g in zip(prompts, gens)]
    assert together == alone
    assert together[0] == Engine(model, EngineConfig(max_seqs=4)).generate([prompts[0]], gens[0])[0]
    assert together[-1] == generate(model, [prompts[-1]], gens[-1])[0]
    # decode's path on a left-padded batch: each row's own tokens (the pads are no prompt tokens)
    assert generate(model, prompts[2:5], gens[4]) == [generate(model, [p], gens[4])[0] for p in prompts[2:5]]
    favoured = together[1]
    assert favoured == [FAVOURED] * len(favoured)  # the bias alone: the favoured token every time
    for out in together[2:5]:  # presence, frequency, repetition: it comes once, then never again
        assert out[0] == FAVOURED and out.count(FAVOURED) == 1, out
    assert together[5] == [FAVOURED] * len(together[5])  # a bias of 100 outweighs a presence penalty of 1


# --- the server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from gptj.cli import main
    from serve_util import server_thread

    root = tmp_path_factory.mktemp("penalties")
    assert main(["init", "--preset", "tiny", "--out", str(root / "tiny"), "--seed", "1"]) == 0
    with server_thread({"tiny": root / "tiny"}, max_batch_size=8) as thread:
        yield thread.url


def complete(url: str, **fields) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a completion of [1, 2, 3] (greedy, 8 tokens, token ids returned)."""
    import json
    import urllib.error
    import urllib.request

    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            **fields}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def tokens(url: str, **fields) -> list[int]:
    status, body, _ = complete(url, **fields)
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def test_served_logit_bias_forces_and_bans_tokens(served):
    plain = tokens(served)
    assert len(set(plain)) == len(plain)  # (the tiny model does not repeat itself)
    assert tokens(served, logit_bias={str(FAVOURED): 100}) == [FAVOURED] * 8
    banned = tokens(served, logit_bias={str(plain[0]): -100})
    assert plain[0] not in banned and banned[0] != plain[0]
    assert tokens(served, logit_bias={str(plain[3]): 0.0}) == plain  # a zero bias changes nothing


@pytest.mark.parametrize("penalty", [dict(presence_penalty=2.0), dict(frequency_penalty=2.0),
                                     dict(repetition_penalty=8.0)], ids=lambda d: next(iter(d)))
def test_served_penalty_stops_a_favoured_token_repeating(served, penalty):
    """A bias of 1.5 makes the tiny model (logits within about +-1) repeat a token; each penalty, large
    enough, lets it come once and never again; the same request without the bias is unchanged."""
    favoured = tokens(served, logit_bias={str(FAVOURED): 1.5})
    assert favoured == [FAVOURED] * 8
    out = tokens(served, logit_bias={str(FAVOURED): 1.5}, **penalty)
    assert out[0] == FAVOURED and out.count(FAVOURED) == 1, out
    assert tokens(served, **penalty) == tokens(served)  # no repeats to penalize: the same tokens


def test_served_sampling_takes_the_penalties_too(served):
    out = tokens(served, temperature=1.0, seed=3, logit_bias={str(FAVOURED): 100}, presence_penalty=2.0,
                 frequency_penalty=-2.0, repetition_penalty=1.1, max_tokens=6)
    assert out == [FAVOURED] * 6  # +100 outweighs every penalty


def test_served_unknown_fields_are_accepted_ignored_and_reported(served, caplog):
    import logging

    plain = tokens(served)
    with caplog.at_level(logging.WARNING, logger="gptj.serve"):
        status, body, headers = complete(served, response_format={"type": "text"}, foo=[1, 2])
    assert status == 200 and body["choices"][0]["token_ids"] == plain
    assert any("unknown fields are ignored: response_format, foo" in r.getMessage() for r in caplog.records)
    named = {k.lower(): v for k, v in headers.items()}
    assert named["x-gptj-ignored-fields"] == "response_format,foo"
    assert "x-gptj-ignored-fields" not in {k.lower() for k in complete(served)[2]}  # none ignored: no header
    import json
    import urllib.request

    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True, "user_tag": "x"}
    req = urllib.request.Request(served + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # a stream says it too
        assert r.headers["X-Gptj-Ignored-Fields"] == "user_tag" and b"data: [DONE]" in r.read()


@pytest.mark.parametrize("fields,message,param", [
    (dict(frequency_penalty="a"), "frequency_penalty: expected a number", "frequency_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty must be from -2 to 2, got 2.5", "frequency_penalty"),
    (dict(presence_penalty=-3), "presence_penalty must be from -2 to 2, got -3", "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty must be from 0.01 to 100 (1 is off), got 0", "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty: expected a number", "repetition_penalty"),
    (dict(logit_bias=[1, 2]), "logit_bias: expected an object", "logit_bias"),
    (dict(logit_bias={"5": "x"}), "logit_bias.5: expected a number", "logit_bias.5"),
    (dict(logit_bias={"50400": 1}), "logit_bias key '50400' is not a token id of the vocabulary [0, 50400)",
     "logit_bias"),
    (dict(logit_bias={"abc": 1}), "logit_bias key 'abc' is not a token id of the vocabulary [0, 50400)",
     "logit_bias"),
    (dict(logit_bias={"-1": 1}), "logit_bias key '-1' is not a token id of the vocabulary [0, 50400)",
     "logit_bias"),
    (dict(logit_bias={"7": 100.5}), "logit_bias['7'] must be from -100 to 100, got 100.5", "logit_bias"),
    (dict(use_beam_search=True, n=2, presence_penalty=0.5), "presence_penalty is not supported with use_beam_search",
     "presence_penalty"),
    (dict(use_beam_search=True, n=2, logit_bias={"7": 1}), "logit_bias is not supported with use_beam_search",
     "logit_bias"),
    (dict(stream_options={"include_usage": True, "extra": 1}), "unknown field 'stream_options.extra'",
     "stream_options.extra"),
])
def test_served_bad_values_and_types_of_known_fields_are_a_400_naming_them(served, fields, message, param):
    status, body, _ = complete(served, **fields)
    assert status == 400, body
    assert message in body["error"]["message"] and body["error"]["param"] == param


def test_served_neutral_values_and_beam_search_without_penalties_still_work(served):
    plain = tokens(served)
    assert tokens(served, frequency_penalty=0, presence_penalty=0.0, repetition_penalty=1, logit_bias={}) == plain
    status, body, _ = complete(served, use_beam_search=True, n=2, frequency_penalty=0, logit_bias={})
    assert status == 200 and len(body["choices"]) == 2
