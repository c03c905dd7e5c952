"""The engine's decode attention under torch.compile: same results as eager, batch invariant, clean fallback."""

import logging

import pytest
import torch

from gptj.decode import GenerationConfig
from gptj.engine import Engine, EngineConfig
from gptj.engine import attention as att
from gptj.engine.attention.reference import ReferenceAttention, group_eager, one_eager
from gptj.policy import attention_path
from gptj.errors import GptjError
from test_engine import CFG, MIXED, prompts_of

needs_compile = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the decode attention is compiled on CUDA only: torch 2.13's CPU code for it was wrong "
           "(policy.compile_trusted); no GPU here")
DEVICE = "cuda"  # where the compiled forms run (the tests that need it skip without one)
pytestmark = pytest.mark.cuda  # gpu_check.py's tests step (-m cuda)


def _inputs(dtype, N=3, H=4, P=37, T=5, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return r(N, H, D), r(H, P, D), r(H, P, D), r(N, H, T, D), r(N, H, T, D)


def _float32_attention_bound(q, k, v):
    """|float32 attention - exact| <= max|v| (2 D u S + (2 L + 6) u): a score is off by <= D u S
    (S = max sum|q k| / sqrt(D)) and moves its probability by <= twice that relatively; L exps and
    L weighted values are summed (Higham 3.1). q (B..., D); k, v (B..., L, D)."""
    u, D, L = 2.0**-24, q.shape[-1], k.shape[-2]
    S = float((k.double().abs() @ q.double().abs().unsqueeze(-1)).max()) / D**0.5
    return float(v.abs().max()) * (2 * D * u * S + (2 * L + 6) * u)


@needs_compile
@pytest.mark.parametrize("dtype, tol", [(torch.float32, None), (torch.bfloat16, 2e-2)])
def test_compiled_attention_equals_eager(dtype, tol):
    """float32: both within the float32 bound of the exact result (so of each other by twice it)."""
    decode = ReferenceAttention(compiled=True)
    assert decode.compiled
    for T in (1, 5, 9):  # 1: the first step of a beam group; then growing tails
        q, pk, pv, tk, tv = (x.to(DEVICE) for x in _inputs(dtype, T=T, seed=T))
        keys = torch.cat([pk.expand(q.shape[0], *pk.shape), tk], 2)  # (N, H, P + T, D)
        values = torch.cat([pv.expand(q.shape[0], *pv.shape), tv], 2)
        bound = 2 * _float32_attention_bound(q, keys, values)
        rtol, atol = (0, bound) if tol is None else (tol, tol)
        torch.testing.assert_close(decode.group(q, pk, pv, tk, tv).float(),
                                   group_eager(q, pk, pv, tk, tv).float(), rtol=rtol, atol=atol)
        for L in (3, 40):
            bound = 2 * _float32_attention_bound(q[0], pk[:, :L], pv[:, :L])
            rtol, atol = (0, bound) if tol is None else (tol, tol)
            torch.testing.assert_close(decode.one(q[0], pk[:, :L], pv[:, :L]).float(),
                                       one_eager(q[0], pk[:, :L], pv[:, :L]).float(), rtol=rtol, atol=atol)
    assert decode.compiled  # no fallback happened


def test_auto_compiles_below_float32_only_and_modes_are_checked():
    """(The reference backend's forms: kernels "off".)"""
    def compiled(mode, dtype, device=DEVICE):
        return attention_path(device, dtype, "off", mode).compiled

    assert not compiled("auto", torch.float32) and compiled("auto", torch.bfloat16)
    assert compiled("on", torch.float32) and not compiled("off", torch.bfloat16)
    # the CPU runs the eager forms whatever the mode (policy.compile_trusted)
    assert not any(compiled(mode, torch.bfloat16, "cpu") for mode in ("auto", "on", "off"))
    with pytest.raises(GptjError, match="engine compile must be one of"):
        EngineConfig(compile="yes")


def test_a_failing_compile_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="gptj.engine.attention"):
        decode = ReferenceAttention(compiled=True)  # (built only: no GPU needed)
    assert not decode.compiled
    assert "torch.compile failed (RuntimeError: no C++ compiler)" in caplog.text
    q, pk, pv, tk, tv = _inputs(torch.float32)
    assert torch.equal(decode.group(q, pk, pv, tk, tv), group_eager(q, pk, pv, tk, tv))


def test_a_compiled_form_failing_at_run_time_falls_back(caplog):
    decode = ReferenceAttention(compiled=False)
    decode.compiled = True

    def fails(*args):
        raise RuntimeError("inductor: cannot build")

    decode._one = decode._group = fails
    q, pk, pv, tk, tv = _inputs(torch.float32)
    with caplog.at_level(logging.WARNING, logger="gptj.engine.attention"):
        out = decode.one(q[0], pk, pv)
    assert torch.equal(out, one_eager(q[0], pk, pv))
    assert not decode.compiled and "inductor: cannot build" in caplog.text


@needs_compile
def test_compiled_engine_requests_together_equal_each_alone(monkeypatch):
    from hf_ref import make_pair

    calls = []
    for name in ("one", "group"):
        real = getattr(ReferenceAttention, name)
        monkeypatch.setattr(ReferenceAttention, name,
                            lambda self, *a, _real=real: (self.compiled and calls.append(1)) or _real(self, *a))
    model = make_pair(CFG, seed=1, std=0.3, eos_bias=4.0)[0].to(DEVICE)
    prompts = prompts_of([5, 17, 1, 30, 8, 12])
    engine = Engine(model, EngineConfig(max_seqs=16, compile="on", kernels="off"))
    assert engine.attention.compiled
    together = engine.generate(prompts, MIXED)
    assert calls  # the compiled forms ran
    alone = [Engine(model, EngineConfig(max_seqs=8, compile="on", kernels="off")).generate([p], [g])[0]
             for p, g in zip(prompts, MIXED)]
    assert together == alone
    assert engine.attention.compiled  # it really ran compiled
    # and the compiled float32 engine's greedy tokens are the exact path's on this model
    greedy = GenerationConfig(max_new_tokens=12)
    eager = Engine(model, EngineConfig(max_seqs=4, compile="off", kernels="off")).generate(prompts[:3], greedy)
    assert engine.generate(prompts[:3], greedy) == eager



def poison_kv_pools(monkeypatch):
    """From now on, all KV memory (gptj.engine.attention.PagedKV) starts filled with NaN (reading
    unwritten memory then shows)."""
    init = att.PagedKV.__init__

    def poisoned(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for t in (*self.k, *self.v):
            t.fill_(float("nan"))

    monkeypatch.setattr(att.PagedKV, "__init__", poisoned)


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_unwritten_kv_memory_is_never_read(monkeypatch, compile_mode):
    """KV pools filled with NaN before use: every request's tokens are unchanged."""
    from hf_ref import make_pair

    model = make_pair(CFG, seed=1, std=0.3, eos_bias=4.0)[0]
    prompts = prompts_of([5, 17, 1, 30, 8, 12])
    clean = Engine(model, EngineConfig(max_seqs=16, compile=compile_mode)).generate(prompts, MIXED)
    poison_kv_pools(monkeypatch)
    engine = Engine(model, EngineConfig(max_seqs=16, compile=compile_mode))
    assert torch.isnan(engine.runner.kv.k[0]).all()
    assert engine.generate(prompts, MIXED) == clean


def test_bfloat16_engine_never_reads_unwritten_kv(monkeypatch, kernel_path):
    """The bfloat16 engine (fused blocks; with gptj.native: its attention and, at <= 4 rows a
    step, its GEMV layout; without: oneDNN's and torch's): NaN-filled pools change nothing."""
    from gptj import kernels
    from gptj.weights.io import model_from_state_dict, random_state_dict

    prompts = prompts_of([5, 17, 1, 30, 8, 12])

    def run():
        model = model_from_state_dict(CFG, random_state_dict(CFG, seed=4, dtype=torch.bfloat16, std=0.3))
        kernels.prepare_for_serving(model, "auto", max_rows=4)
        engine = Engine(model, EngineConfig(max_seqs=4, compile="off"))  # (compiled forms: tests above)
        assert (engine.attention.name == "cpu-native") is (kernel_path != "fallback")
        if kernels.can_pack(torch.bfloat16, "cpu"):
            assert model.lm_head.layout == ("native" if kernel_path != "fallback" else "onednn")
        return engine.generate(prompts, MIXED)

    clean = run()
    poison_kv_pools(monkeypatch)
    assert run() == clean

