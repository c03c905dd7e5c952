"""The continuous-batching engine: batch invariance, admission while running, cancellation, capacity."""

import threading

import time

import pytest
import torch

from gptj.config import GPTJConfig
from gptj.decode import GenerationConfig, generate
from gptj.engine import Engine, EngineConfig, EngineLoop
from gptj.engine.core import ABORTED, FAILED, FINISHED, RUNNING
from gptj.errors import GptjError
from gptj.kernels import prepare_for_serving
from hf_ref import make_pair

CFG = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=128, n_positions=256)


@pytest.fixture(scope="module")
def model():
    return make_pair(CFG, seed=1, std=0.3, eos_bias=4.0)[0]


def held_blocks(engine):
    stats = engine.stats()
    return stats.blocks_total - stats.blocks_free


def all_free(engine):
    engine.kv.check()
    return held_blocks(engine) == 0


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50000, (n,), generator=g).tolist() for n in lengths]


MIXED = [
    GenerationConfig(max_new_tokens=12),
    GenerationConfig(max_new_tokens=14, do_sample=True, seed=3, top_k=40, temperature=0.8),
    GenerationConfig.mlperf(max_new_tokens=20, min_new_tokens=6),
    GenerationConfig(max_new_tokens=10, num_beams=2, length_penalty=0.5),
    GenerationConfig(max_new_tokens=9, min_new_tokens=9),
    GenerationConfig(max_new_tokens=16, do_sample=True, seed=11, top_p=0.9),
]


def test_mixed_requests_together_equal_each_alone(model):
    prompts = prompts_of([5, 17, 1, 30, 8, 12])
    engine = Engine(model, EngineConfig(max_seqs=16))
    start = time.perf_counter()
    together = engine.generate(prompts, MIXED)
    wall = time.perf_counter() - start
    assert max(engine.decode_batch_sizes) > 4  # they really shared steps
    times = engine.stats().times  # where the steps' time went: every step counted, the phases within the wall time
    assert times.steps == engine.steps and times.decode_rows == sum(engine.decode_batch_sizes)
    assert min(times.schedule, times.forward, times.wait, times.update) >= 0
    assert times.schedule + times.forward + times.wait + times.update <= wall
    # the steps that prefilled: at least one (every prompt fits one chunk here, so at most one per prompt),
    # their time within the phases'; the decode-only steps' mean is what is left over the rest
    assert 1 <= times.prefill_steps <= len(prompts) and times.prefill_steps < times.steps
    phases = times.schedule + times.forward + times.wait + times.update
    assert 0 < times.prefill_seconds <= phases
    assert times.decode_step_ms() == pytest.approx(1000 * (phases - times.prefill_seconds)
                                                   / (times.steps - times.prefill_steps))
    for prompt, gen, got in zip(prompts, MIXED, together):
        assert got == generate(model, [prompt], gen)[0]  # the exact reference path, alone
        assert got == Engine(model, EngineConfig(max_seqs=4)).generate([prompt], gen)[0]  # the engine, alone
    assert all_free(engine) and not engine.has_work


def test_a_request_arriving_while_others_run_joins_at_the_next_step(model):
    engine = Engine(model, EngineConfig(max_seqs=8))
    a = engine.add_request(prompts_of([6])[0], GenerationConfig(max_new_tokens=30, eos_token_id=None))
    for _ in range(5):
        engine.step()
    assert a.status == RUNNING and len(a.output) == 5
    b = engine.add_request(prompts_of([9], seed=1)[0], GenerationConfig(max_new_tokens=3, eos_token_id=None))
    engine.step()
    assert b.status == RUNNING and len(b.output) == 1 and len(a.output) == 6  # admitted without draining A
    while not b.done:
        engine.step()
    assert b.status == FINISHED and a.status == RUNNING  # B finished while A still runs
    assert 2 in engine.decode_batch_sizes


def test_cancel_frees_kv_memory(model):
    engine = Engine(model, EngineConfig(max_seqs=6))
    beam = engine.add_request(prompts_of([10])[0], GenerationConfig.mlperf(max_new_tokens=40))
    greedy = engine.add_request(prompts_of([4])[0], GenerationConfig(max_new_tokens=40, eos_token_id=None))
    engine.step()
    engine.step()
    held = {b for s in beam.seqs + greedy.seqs for b in s.blocks}
    assert len(beam.seqs) == 4 and held_blocks(engine) == len(held)  # 4 beams + 1 greedy
    assert engine.abort(beam.request_id)
    assert beam.status == ABORTED and beam.finish_reason == "abort"
    assert held_blocks(engine) == len(greedy.seqs[0].blocks)  # every block of the beams is back
    assert not engine.abort(beam.request_id)  # already done
    engine.step()
    assert greedy.status == RUNNING


def test_more_requests_than_kv_capacity_wait_and_all_complete(model):
    prompts = prompts_of([3, 8, 5, 11, 2, 7, 4])
    gens = [GenerationConfig(max_new_tokens=8), GenerationConfig(max_new_tokens=6, num_beams=2)] * 3 + [
        GenerationConfig(max_new_tokens=5)]
    engine = Engine(model, EngineConfig(max_seqs=2))
    outputs = engine.generate(prompts, gens)
    assert max(engine.decode_batch_sizes) <= 2
    assert outputs == [generate(model, [p], g)[0] for p, g in zip(prompts, gens)]
    assert all_free(engine)


def test_loop_admits_while_running_and_cancels(model):
    engine = Engine(model, EngineConfig(max_seqs=4))
    loop = EngineLoop(engine)
    try:
        started = threading.Event()
        first = loop.submit(prompts_of([6])[0], GenerationConfig(max_new_tokens=200, eos_token_id=None),
                            on_token=lambda req, tok: started.set() if len(req.output) >= 3 else None)
        assert started.wait(30)
        second = loop.submit(prompts_of([5], seed=2)[0], GenerationConfig(max_new_tokens=4, eos_token_id=None))
        assert len(second.result(timeout=30)) == 4
        assert not first.done()  # the second finished while the first was still running
        first.cancel()
        req = first.request(timeout=30)
        assert req.status == ABORTED and 3 <= len(req.output) < 200
    finally:
        loop.shutdown()
    assert all_free(engine)


def test_loop_batch_wait_gathers_a_burst_and_builds_on_its_thread(model):
    gen = GenerationConfig(max_new_tokens=3, eos_token_id=None)
    built_on = []

    def build():
        built_on.append(threading.current_thread().name)
        return Engine(model, EngineConfig(max_seqs=4))

    loop = EngineLoop(build, batch_wait_ms=2000)  # the wait ends early once a full batch waits
    try:
        handles = [loop.submit(p, gen) for p in prompts_of([4, 5, 6, 7])]
        outputs = [h.result(timeout=60) for h in handles]
    finally:
        loop.shutdown()
    assert built_on == ["gptj-engine"]
    assert loop.engine.decode_batch_sizes[0] == 4  # all four started together
    assert outputs == [generate(model, [p], gen)[0] for p in prompts_of([4, 5, 6, 7])]

    def broken():
        raise GptjError("no such model")

    with pytest.raises(GptjError, match="no such model"):
        EngineLoop(broken)


def test_bad_requests_are_refused_and_failures_are_isolated(model, monkeypatch):
    engine = Engine(model, EngineConfig(max_seqs=2, max_len=64))
    with pytest.raises(GptjError, match="exceeds the engine's 64 tokens"):
        engine.add_request([1] * 60, GenerationConfig(max_new_tokens=10))
    with pytest.raises(GptjError, match="num_beams 4 exceeds"):
        engine.add_request([1, 2], GenerationConfig.mlperf(max_new_tokens=8))
    with pytest.raises(GptjError, match="outside the vocabulary"):
        engine.add_request([50400], GenerationConfig(max_new_tokens=8))

    ok = engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=6))
    engine.step()
    real_forward = type(model).forward
    calls = {"n": 0}

    def flaky(self, input_ids, *args, **kwargs):
        if input_ids.shape[1] > 1:  # fail the next prefill only
            calls["n"] += 1
            raise RuntimeError("simulated device error")
        return real_forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", flaky)
    bad = engine.add_request([4, 5, 6, 7], GenerationConfig(max_new_tokens=6))
    while not (ok.done and bad.done):
        engine.step()
    assert calls["n"] == 1 and bad.status == FAILED and "simulated device error" in bad.error
    assert ok.status == FINISHED and len(ok.output) >= 1 and all_free(engine)


@pytest.mark.parametrize("mode, group_size", [("int8", None), ("int4", 32)])
def test_quantized_model_on_the_engine_matches_the_reference_path(mode, group_size):
    from gptj.quant import quantize_model

    model = make_pair(CFG, seed=2, std=0.3)[0]
    quantize_model(model, mode, group_size=group_size)
    prompts = prompts_of([4, 11, 7], seed=5)
    gens = [GenerationConfig(max_new_tokens=8), GenerationConfig(max_new_tokens=6, num_beams=3),
            GenerationConfig(max_new_tokens=7, do_sample=True, seed=1)]
    alone = [generate(model, [p], g)[0] for p, g in zip(prompts, gens)]  # before the serving kernels fuse it
    assert prepare_for_serving(model, "auto", max_rows=8)["fused_blocks"] == CFG.n_layer
    engine = Engine(model, EngineConfig(max_seqs=8))
    assert engine.runner.kv.k[0].dtype == torch.float32  # KV in the activations' dtype, not the int weights'
    assert engine.generate(prompts, gens) == alone


def test_chunked_prefill_equals_whole_prompts_and_interleaves_with_decode(model):
    prompts = prompts_of([23, 5, 40, 9], seed=7)
    gens = [GenerationConfig(max_new_tokens=8), GenerationConfig.mlperf(max_new_tokens=10, min_new_tokens=3),
            GenerationConfig(max_new_tokens=12, do_sample=True, seed=4, top_k=30), GenerationConfig(max_new_tokens=6)]
    whole = Engine(model, EngineConfig(max_seqs=16))
    want = [whole.add_request(p, g, logprobs=2, prompt_logprobs=3) if g.num_beams == 1 else whole.add_request(p, g)
            for p, g in zip(prompts, gens)]
    while whole.has_work:
        whole.step()
    chunked = Engine(model, EngineConfig(max_seqs=16, prefill_chunk=7))
    got = [chunked.add_request(p, g, logprobs=2, prompt_logprobs=3) if g.num_beams == 1 else chunked.add_request(p, g)
           for p, g in zip(prompts, gens)]
    steps_with_decode_while_prefilling = 0
    while chunked.has_work:
        decoding_before = len(chunked.decode_batch_sizes)
        prefilling = any(r.n_prefilled < len(r.prompt) for r in chunked.running)
        chunked.step()
        steps_with_decode_while_prefilling += prefilling and len(chunked.decode_batch_sizes) > decoding_before
    assert [r.output for r in got] == [r.output for r in want]
    for a, b in zip(got, want):
        if b.gen.num_beams > 1:
            continue
        assert [e is None for e in a.prompt_token_logprobs] == [e is None for e in b.prompt_token_logprobs]
        assert len(a.prompt_token_logprobs) == len(b.prompt)
        for x, y in zip(a.prompt_token_logprobs[1:] + a.token_logprobs, b.prompt_token_logprobs[1:] + b.token_logprobs):
            assert x.token == y.token and x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    # 77 prompt tokens at 7 per step: the prompts took many steps, during which the others decoded
    assert steps_with_decode_while_prefilling >= 5
    assert all_free(chunked)
