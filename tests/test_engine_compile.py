"""The engine's decode attention under torch.compile: same results as eager, batch invariant, clean fallback."""

import logging

import pytest
import torch

from gptj.decode import GenerationConfig
from gptj.engine import Engine, EngineConfig
from gptj.engine import attention as att
from gptj.errors import GptjError
from test_engine import CFG, MIXED, prompts_of


def _inputs(dtype, N=3, H=4, P=37, T=5, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return r(N, H, D), r(H, P, D), r(H, P, D), r(N, H, T, D), r(N, H, T, D)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_compiled_attention_equals_eager(dtype, tol):
    decode = att.DecodeAttention("on", dtype)
    assert decode.compiled
    for T in (1, 5, 9):  # 1: the first step of a beam group; then growing tails
        q, pk, pv, tk, tv = _inputs(dtype, T=T, seed=T)
        torch.testing.assert_close(decode.group(q, pk, pv, tk, tv).float(),
                                   att.group_eager(q, pk, pv, tk, tv).float(), rtol=tol, atol=tol)
        for L in (3, 40):
            torch.testing.assert_close(decode.one(q[0], pk[:, :L], pv[:, :L]).float(),
                                       att.one_eager(q[0], pk[:, :L], pv[:, :L]).float(), rtol=tol, atol=tol)
    assert decode.compiled  # no fallback happened


def test_auto_compiles_below_float32_only_and_modes_are_checked():
    assert not att.DecodeAttention("auto", torch.float32).compiled
    assert att.DecodeAttention("auto", torch.bfloat16).compiled
    assert not att.DecodeAttention("off", torch.bfloat16).compiled
    with pytest.raises(ValueError, match="one of auto, on, off"):
        att.DecodeAttention("always", torch.float32)
    with pytest.raises(GptjError, match="engine compile must be one of"):
        EngineConfig(compile="yes")


def test_a_failing_compile_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="gptj.engine.attention"):
        decode = att.DecodeAttention("on", torch.float32)
    assert not decode.compiled
    assert "torch.compile failed (RuntimeError: no C++ compiler)" in caplog.text
    q, pk, pv, tk, tv = _inputs(torch.float32)
    assert torch.equal(decode.group(q, pk, pv, tk, tv), att.group_eager(q, pk, pv, tk, tv))


def test_a_compiled_form_failing_at_run_time_falls_back(caplog):
    decode = att.DecodeAttention("off", torch.float32)
    decode.compiled = True

    def fails(*args):
        raise RuntimeError("inductor: cannot build")

    decode._one = decode._group = fails
    q, pk, pv, tk, tv = _inputs(torch.float32)
    with caplog.at_level(logging.WARNING, logger="gptj.engine.attention"):
        out = decode.one(q[0], pk, pv)
    assert torch.equal(out, att.one_eager(q[0], pk, pv))
    assert not decode.compiled and "inductor: cannot build" in caplog.text


def test_compiled_engine_requests_together_equal_each_alone():
    from hf_ref import make_pair

    model = make_pair(CFG, seed=1, std=0.3, eos_bias=4.0)[0]
    prompts = prompts_of([5, 17, 1, 30, 8, 12])
    engine = Engine(model, EngineConfig(n_slots=16, compile="on"))
    assert engine.attention.compiled
    together = engine.generate(prompts, MIXED)
    alone = [Engine(model, EngineConfig(n_slots=8, compile="on")).generate([p], [g])[0]
             for p, g in zip(prompts, MIXED)]
    assert together == alone
    assert engine.attention.compiled  # it really ran compiled
    # and the compiled float32 engine's greedy tokens are the exact path's on this model
    greedy = GenerationConfig(max_new_tokens=12)
    eager = Engine(model, EngineConfig(n_slots=4, compile="off")).generate(prompts[:3], greedy)
    assert engine.generate(prompts[:3], greedy) == eager


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_all_rows_in_one_compiled_call_equal_group_by_group(dtype, tol):
    """rows_sums over pools whose unused positions hold NaN: lone sequences and a beam group mixed."""
    g = torch.Generator().manual_seed(7)
    H, D, S, L = 4, 16, 3, 40
    pk, pv = (torch.full((S, H, L, D), float("nan")).to(dtype) for _ in range(2))
    tk, tv = (torch.full((S + 2, H, 10, D), float("nan")).to(dtype) for _ in range(2))
    plens, tl = [25, 9, 31], 4  # slot 0: lone (25 incl. its new tokens), 1: lone, 2: a beam group of 3
    for s, n in enumerate(plens):
        pk[s, :, :n], pv[s, :, :n] = (torch.randn(H, n, D, generator=g).to(dtype) for _ in range(2))
    tails = [2, 3, 4]
    for t in tails:
        tk[t, :, :tl], tv[t, :, :tl] = (torch.randn(H, tl, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(5, H, D, generator=g).to(dtype)
    pslot, plen = torch.tensor([0, 1, 2, 2, 2]), torch.tensor([25, 9, 31, 31, 31])
    tslot, tlen = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([0, 0, tl, tl, tl])
    got = att.DecodeAttention("on", dtype).rows(q, pk, pv, pslot, plen, tk, tv, tslot, tlen, 31, tl)
    want = torch.cat([att.one_eager(q[0], pk[0, :, :25], pv[0, :, :25])[None],
                      att.one_eager(q[1], pk[1, :, :9], pv[1, :, :9])[None],
                      att.group_eager(q[2:], pk[2, :, :31], pv[2, :, :31], tk[tails, :, :tl], tv[tails, :, :tl])])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
