"""engine/sampler.py: the whole step's tokens in batched ops and one device-to-host read, and the
same tokens as the per-request rules of gptj.decode (greedy_or_sample's, BeamSearch's)."""

from __future__ import annotations

import pytest
import torch

from gptj.beam import BeamSearch, stacked_rows
from gptj.decode import GenerationConfig, block_eos, warp
from gptj.engine.request import Request
from gptj.engine.sampler import choose

V = 50


def request(rid: str, gen: GenerationConfig, output: list[int] | None = None) -> Request:
    req = Request(rid, [1, 2, 3], gen)
    req.output = list(output or [])
    if gen.sampling and gen.seed is not None:
        req.generator = torch.Generator().manual_seed(gen.seed)
    return req


def one_tensor(items) -> tuple[torch.Tensor, dict[Request, range]]:
    """(request, its logits) pairs in the runner's form: one tensor, and each request's rows of it."""
    items, rows, at = list(items), {}, 0
    for req, logits in items:
        rows[req] = range(at, at + logits.shape[0])
        at += logits.shape[0]
    return torch.cat([logits for _, logits in items]), rows


def count_host_reads(monkeypatch) -> list[str]:
    """Every tensor read back to the host (tolist, item, bool, int, float) from now on, by name."""
    reads: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name: reads.append(_name) or _real(self, *a))
    return reads


def test_a_mixed_step_is_chosen_with_one_host_read_and_each_rule_as_alone(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = {k: torch.randn(n, V, generator=g) for k, n in (("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 3))}
    eos = int(logits["b"][0].argmax())  # b's best token is its EOS, blocked until 4 new tokens
    gens = {"a": GenerationConfig(max_new_tokens=8),
            "b": GenerationConfig(max_new_tokens=8, min_new_tokens=4, eos_token_id=eos),
            "c": GenerationConfig(max_new_tokens=8, do_sample=True, seed=7, top_k=10, temperature=0.7),
            "d": GenerationConfig(max_new_tokens=8, do_sample=True, seed=9, top_p=0.8),
            "e": GenerationConfig(max_new_tokens=8, num_beams=3, eos_token_id=None)}
    reqs = {k: request(k, gen, output=[5]) for k, gen in gens.items()}
    reqs["e"].beam = BeamSearch(1, gens["e"], "cpu")
    twin = BeamSearch(1, gens["e"], "cpu")  # the same search, stepped alone
    reqs["e"].seqs = [None] * 3  # (n_seqs: its three beams)

    step = one_tensor([(reqs[k], logits[k]) for k in "abcde"])
    reads = count_host_reads(monkeypatch)
    choices = choose(*step)
    assert reads == ["tolist"]  # the whole step: one read
    monkeypatch.undo()

    assert choices[reqs["a"]].tokens == [int(logits["a"][0].argmax())]
    want_b = int(block_eos(logits["b"], 1, gens["b"])[0].argmax())
    assert choices[reqs["b"]].tokens == [want_b] and want_b != eos
    for k in "cd":  # the request's own generator, as gptj.decode draws
        probs = torch.softmax(warp(block_eos(logits[k], 1, gens[k]), gens[k]), dim=-1)
        want = int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(gens[k].seed))[0, 0])
        assert choices[reqs[k]].tokens == [want]
    source, tokens = twin.step(logits["e"])
    e = choices[reqs["e"]]
    assert (e.source, e.tokens, e.done) == (source.tolist(), tokens.tolist(), False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_rows_take_the_first_of_tied_largest_logits_as_argmax_does(dtype, kernel_path, monkeypatch):
    """The greedy choice is torch.argmax's (HF's) on every row, where logits tie (few distinct values:
    the first index of the largest) and where a row holds NaN: by gptj.native's argmax where the policy
    says (float32 logits on a CPU with the native kernels), by torch's elsewhere."""
    from gptj import native

    calls = []
    real = native.argmax_rows
    monkeypatch.setattr(native, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 4, (6, 50400), generator=g).to(dtype)
    logits[2, 7] = float("nan")
    reqs = [request(f"r{i}", GenerationConfig(max_new_tokens=4)) for i in range(6)]
    choices = choose(logits, {req: range(i, i + 1) for i, req in enumerate(reqs)})
    assert [choices[req].tokens[0] for req in reqs] == torch.argmax(logits, dim=-1).tolist()
    assert calls == ([(6, 50400)] if dtype is torch.float32 and kernel_path != "fallback" else [])


def test_a_beam_search_is_done_when_its_last_token_is_chosen():
    gen = GenerationConfig(max_new_tokens=2, num_beams=2, eos_token_id=None)
    req = request("r", gen)
    req.beam = BeamSearch(1, gen, "cpu")
    req.seqs = [None] * 2
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    assert choose(logits, {req: range(2)})[req].done is False
    assert choose(logits, {req: range(2)})[req].done is True and req.beam.finished


@pytest.mark.parametrize("prompts", [(1, 1, 1), (2, 1, 3)], ids=["one-prompt-each", "2-1-3-prompts"])
def test_beam_searches_at_different_steps_advance_together_as_each_alone(prompts):
    """BeamSearch.step_all (the sampler's batched pass) on searches started at different steps (the
    engine's: one prompt each; decode.beam_search's: a batch of prompts), joining, ending and coming
    in another order (their state stacked between steps, gathered when the set or order changes): the
    same beams, tokens, hypotheses and done flags as stepping each alone, bit for bit. EOS is made likely at some steps,
    so hypotheses finish, min_new_tokens blocks EOS early, and searches end."""
    gen = GenerationConfig(num_beams=3, max_new_tokens=7, min_new_tokens=2, eos_token_id=7, early_stopping=True)
    g = torch.Generator().manual_seed(3)
    streams = []  # each search's logits, step by step: (B * 3, V)
    for b in prompts:
        stream = []
        for t in range(12):
            x = torch.randn(b * 3, V, generator=g)
            if t % 3 == 2:
                x[:, 7] += 3.0  # EOS among the top candidates
            stream.append(x)
        streams.append(stream)
    together = [BeamSearch(b, gen, "cpu") for b in prompts]
    alone = [BeamSearch(b, gen, "cpu") for b in prompts]
    starts = [0, 2, 3]  # search i takes its first token at step starts[i]
    finished = set()
    for t in range(12):
        active = [i for i in range(3) if starts[i] <= t and i not in finished]
        if not active:
            break
        if t % 4 == 3:  # the searches in another order than the last step's: their rows gathered, not read as stacked
            active.reverse()
        got = BeamSearch.step_all([together[i] for i in active], [streams[i][t - starts[i]] for i in active])
        for i, (source, tokens) in zip(active, got):
            want_source, want_tokens = alone[i].step(streams[i][t - starts[i]])
            assert torch.equal(source, want_source) and torch.equal(tokens, want_tokens)
            assert bool(together[i].done_now) == bool(alone[i].done_now)
            for name in ("fin_scores", "fin_tokens", "fin_lens", "fin_valid", "run_scores", "improvable"):
                assert torch.equal(getattr(together[i], name), getattr(alone[i], name)), name
            if together[i].finished:
                finished.add(i)
                for b in range(prompts[i]):
                    assert together[i].ranked(b) == alone[i].ranked(b) and together[i].ranked(b)
    assert finished == {0, 1, 2}


def test_sampled_rows_warped_together_draw_what_each_draws_alone():
    """Six sampled requests, each with its own temperature / top_k / top_p (some none), warped in one
    batch: every request draws, from its own generator, the token gptj.decode's warp gives it alone."""
    settings = [dict(temperature=0.7, top_k=5), dict(top_p=0.6), dict(temperature=1.3, top_k=3, top_p=0.9),
                dict(), dict(top_k=V + 10), dict(temperature=0.5, top_p=0.95)]
    g = torch.Generator().manual_seed(5)
    logits = [torch.randn(1, V, generator=g) * 0.5 for _ in settings]  # flat: the filters decide draws
    for trial in range(12):
        gens = [GenerationConfig(max_new_tokens=8, do_sample=True, seed=100 * trial + i, **kw)
                for i, kw in enumerate(settings)]
        reqs = [request(f"s{i}", gen, output=[1, 2]) for i, gen in enumerate(gens)]
        choices = choose(*one_tensor(zip(reqs, logits)))
        for req, gen, x in zip(reqs, gens, logits):
            probs = torch.softmax(warp(block_eos(x, 2, gen), gen), dim=-1)
            want = int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(gen.seed))[0, 0])
            assert choices[req].tokens == [want], (gen, trial)


def test_stacked_rows_is_a_view_of_rows_in_order_and_a_copy_otherwise():
    """stacked_rows equals torch.cat always; it is a view of the caller's tensor only where the parts lie
    one after another in one storage (a forward's logits handed out in order), else a fresh copy."""
    base = torch.randn(7, V, generator=torch.Generator().manual_seed(2))
    in_order = [base[0:2], base[2:3], base[3:7]]
    joined = stacked_rows(in_order)
    assert torch.equal(joined, torch.cat(in_order)) and joined.data_ptr() == base.data_ptr()
    other = torch.randn(2, V)
    for parts in ([base[2:3], base[0:2]],  # out of order
                  [base[0:2], base[3:5]],  # a gap
                  [base[0:1].expand(3, -1), base[1:2]],  # a beam request's first step: one row, expanded
                  [base[:, :V - 1][0:2], base[:, :V - 1][2:4]],  # rows of a narrower view: not contiguous
                  [base[0:2], other]):  # two storages
        joined = stacked_rows(parts)
        assert torch.equal(joined, torch.cat(parts))
        assert joined.untyped_storage().data_ptr() not in (base.untyped_storage().data_ptr(),
                                                           other.untyped_storage().data_ptr())


def test_the_engines_beam_pass_writes_over_its_own_rows_only():
    """choose advances beams over the runner's logits in place (the log-probabilities written over the
    beam rows: update.py reads no beam request's logits); the greedy rows of the same forward, which
    update.py reads again for log-probabilities, are left as they were, and every choice equals the
    one made on a copy. BeamSearch.step (decode.beam_search's, a caller's tensor) writes
    over nothing."""
    gen_beam = GenerationConfig(max_new_tokens=8, num_beams=3, eos_token_id=None)
    gen_greedy = GenerationConfig(max_new_tokens=8)
    forward = torch.randn(2 + 3 + 3 + 1, V, generator=torch.Generator().manual_seed(4))  # rows as the runner's
    kept = forward.clone()
    spans = {"g1": (0, 1), "b1": (1, 4), "b2": (4, 7), "g2": (7, 8)}

    def step(logits):
        reqs = {k: request(k, gen_beam if k[0] == "b" else gen_greedy, output=[5]) for k in spans}
        for k in ("b1", "b2"):
            reqs[k].beam = BeamSearch(1, gen_beam, "cpu")
            reqs[k].seqs = [None] * 3
        choices = choose(logits, {reqs[k]: range(*spans[k]) for k in spans})
        return {k: (c.tokens, c.source, c.done) for k, c in ((k, choices[reqs[k]]) for k in spans)}

    apart = step(kept.clone())
    shared = step(forward)
    assert shared == apart
    assert torch.equal(forward[0], kept[0]) and torch.equal(forward[7], kept[7])  # the greedy rows
    assert not torch.equal(forward[1:7], kept[1:7])  # (the beam rows: the pass reused them)

    search = BeamSearch(1, gen_beam, "cpu")
    mine = kept[1:4].clone()
    search.step(mine)
    assert torch.equal(mine, kept[1:4])
    # two searches' logits joined by a copy, which the pass then owns and writes over: the callers'
    # tensors are untouched, and tensors that autograd tracks (left out of place) give the same choices
    graded = [kept[1:4].clone().requires_grad_(), kept[4:7].clone().requires_grad_()]
    plain = [kept[1:4].clone(), kept[4:7].clone()]
    got = BeamSearch.step_all([BeamSearch(1, gen_beam, "cpu") for _ in graded], graded)
    want = BeamSearch.step_all([BeamSearch(1, gen_beam, "cpu") for _ in plain], plain)
    assert all(torch.equal(g, w) for pair_g, pair_w in zip(got, want) for g, w in zip(pair_g, pair_w))
    assert torch.equal(plain[0], kept[1:4]) and torch.equal(plain[1], kept[4:7])  # the copy's, not the caller's
