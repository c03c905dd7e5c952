"""Issue 55: a request whose numbers go non-finite fails alone (greedy, sampled and beam search
alike) while the requests sharing its steps get exactly their tokens; a loop that stops fails what it
holds and takes no more; a model whose logits overflow is refused at load."""

from __future__ import annotations

import math

import pytest
import torch

from gptj.decode import GenerationConfig
from gptj.engine import EngineConfig, EngineLoop
from gptj.engine.loop import EngineStopped
from gptj.engine.request import FAILED, FINISHED
from gptj.errors import GptjError
from gptj.runtime.build import build_engine
from gptj.weights.io import load_model, random_state_dict, save_checkpoint

GREEDY = GenerationConfig(max_new_tokens=6)
SAMPLED = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, top_k=20, seed=7)
BEAMS = GenerationConfig(max_new_tokens=6, num_beams=2)
GOOD = {"greedy": ([5, 17, 300, 2, 9], GREEDY), "sampled": ([41, 7, 1000, 12], SAMPLED),
        "beams": ([8, 8, 90, 3, 4, 5], BEAMS)}
BAD_VALUES = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}


def _engine(checkpoint):
    return build_engine(load_model(checkpoint), EngineConfig(max_seqs=16))


def _corrupting(engine, bad: dict[str, float], after: int = 1):
    """The runner's logits of each request in `bad` (request id -> value) set to that value once it
    has `after` new tokens (beams: after that many steps): its numbers go bad mid-generation, in a
    step it shares with the others."""
    run = engine.runner.run
    steps: dict[str, int] = {}

    def corrupted(scheduled):
        result = run(scheduled)
        for req in result.rows:  # (each request's rows of the step's one logits tensor)
            logits = result.of(req)
            steps[req.request_id] = steps.get(req.request_id, -1) + 1
            if req.request_id in bad and steps[req.request_id] >= after:
                with torch.inference_mode():  # (the runner's logits are inference tensors)
                    logits.fill_(bad[req.request_id])
        return result

    engine.runner.run = corrupted


@pytest.mark.parametrize("value", list(BAD_VALUES))
def test_a_request_whose_logits_go_non_finite_fails_alone_and_the_others_keep_their_tokens(tiny_checkpoint, value):
    reference = _engine(tiny_checkpoint)
    want = {kind: reference.generate([prompt], gen)[0] for kind, (prompt, gen) in GOOD.items()}

    engine = _engine(tiny_checkpoint)
    _corrupting(engine, {f"bad-{kind}": BAD_VALUES[value] for kind in GOOD})
    good = {kind: engine.add_request(prompt, gen, request_id=kind) for kind, (prompt, gen) in GOOD.items()}
    bad = {kind: engine.add_request(prompt, gen, request_id=f"bad-{kind}", logprobs=0 if kind != "beams" else None)
           for kind, (prompt, gen) in GOOD.items()}
    while engine.has_work:
        engine.step()
    assert max(engine.decode_batch_sizes) >= 6  # (beams count twice): the bad ones shared decode steps
    for kind, req in bad.items():
        assert req.status == FAILED and req.finish_reason == "error", kind
        assert "not finite" in req.error, (kind, req.error)
        if kind != "beams":
            assert len(req.output) == 1  # its first token came before its numbers went bad
    for kind, req in good.items():
        assert req.status == FINISHED and req.output == want[kind], kind
    engine.kv.check()
    assert engine.kv.free == engine.kv.n_blocks - engine.kv.cached  # the failed requests' blocks came back
    # and the engine goes on: the same requests again get the same tokens
    assert engine.generate([p for p, _ in GOOD.values()], [g for _, g in GOOD.values()]) == list(want.values())


def test_a_step_where_every_request_goes_non_finite_fails_them_all_and_nothing_else(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    _corrupting(engine, {"a": math.nan, "b": math.nan}, after=0)
    reqs = [engine.add_request([1, 2, 3], SAMPLED, request_id=rid) for rid in ("a", "b")]
    while engine.has_work:
        engine.step()
    assert all(r.status == FAILED and r.output == [] for r in reqs)


def test_a_stopped_loop_fails_what_it_holds_and_refuses_more(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    loop = EngineLoop(engine)
    step = engine.step

    def broken():
        raise MemoryError("out of memory in a step")

    engine.step = broken
    handle = loop.submit([1, 2, 3], GREEDY)
    req = handle.request(timeout=60)
    assert req.status == FAILED and "engine loop stopped: MemoryError: out of memory in a step" in req.error
    assert loop.failure == "MemoryError: out of memory in a step"
    with pytest.raises(EngineStopped, match="the engine stopped: MemoryError"):
        loop.submit([1, 2, 3], GREEDY)
    engine.step = step
    loop.shutdown()


def test_a_model_whose_logits_overflow_is_refused_at_load(tiny_checkpoint, tmp_path):
    """Finite weights too large for float32 (the head scaled by 1e38: each weight finite, their dot
    products with a hidden state of norm ~8 past float32's 3.4e38): every weight passes the loader's
    finiteness check, and the engine's probe refuses the model in one line."""
    from gptj.config import get_preset

    cfg = get_preset("tiny")
    sd = random_state_dict(cfg, seed=5, std=0.3)
    sd["lm_head.weight"] = sd["lm_head.weight"] * 1e38
    assert all(torch.isfinite(t).all() for t in sd.values())
    path = save_checkpoint(sd, cfg, tmp_path / "huge")
    with pytest.raises(GptjError, match="the model gives logits that are not finite") as e:
        _engine(path)
    assert "\n" not in str(e.value)
    build_engine(load_model(tiny_checkpoint), EngineConfig(max_seqs=4)).probe()  # a sound model passes, again
