"""gptj.kernels.triton_elementwise: a fused block's rotary in one Triton kernel (CUDA below float32;
here under Triton's interpreter on CPU, in float16: the interpreter has no bfloat16 arithmetic), and
the policy that sends a fused block there."""

from __future__ import annotations

import pytest
import torch

from gptj import policy
from gptj.fallback import Fallbacks
from gptj.kernels import fused
from gptj.models.gptj import Block, rope_table, rotary_tables, rotate_every_two
from test_attention_backends import DEVICE, triton_reason

pytestmark = pytest.mark.cuda  # gpu_check.py's tests step (-m cuda)
REASON = triton_reason("the Triton rotary")
needs_triton = pytest.mark.skipif(REASON is not None, reason=str(REASON))
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[DTYPE]  # half an ulp, relative: the one rounding


@needs_triton
@pytest.mark.parametrize("H, D, R", [(3, 16, 16), (4, 64, 32), (2, 256, 64), (2, 24, 6)],
                         ids=["full", "partial", "gptj-heads", "odd-pairs"])
def test_rotary_rotates_each_tokens_q_and_k_pairs_in_place(H, D, R):
    """Within one rounding of the exact rotation (the products of two values of the dtype are exact
    in float32, their sum rounded once there, 2^-24 of the terms, then once to the dtype); v, the
    rest of the row and the dims past R are untouched."""
    from gptj.kernels.triton_elementwise import rotary_qk_

    g = torch.Generator().manual_seed(H * D + R)
    T, W = 7, 3 * H * D + 40
    y = torch.randn(T, W, generator=g).to(DTYPE).to(DEVICE)
    sin, cos = (t.reshape(T, R).to(DEVICE) for t in rotary_tables(rope_table(64, R), torch.arange(30, 30 + T)[None],
                                                                   DTYPE))
    before = y.clone()
    rotary_qk_(y, H, D, sin, cos)
    qk = before[:, :2 * H * D].view(T, 2 * H, D)[..., :R].double()
    s, c = sin.double()[:, None], cos.double()[:, None]
    want = qk * c + rotate_every_two(qk) * s
    terms = (qk * c).abs() + (rotate_every_two(qk) * s).abs()
    got = y[:, :2 * H * D].view(T, 2 * H, D)
    assert ((got[..., :R].double() - want).abs() <= UNIT * want.abs() + 2.0**-23 * terms).all()
    assert torch.equal(got[..., R:], before[:, :2 * H * D].view(T, 2 * H, D)[..., R:])
    assert torch.equal(y[:, 2 * H * D:], before[:, 2 * H * D:])


@needs_triton
def test_rotary_refuses_what_it_cannot_rotate():
    from gptj.kernels.triton_elementwise import rotary_qk_

    y = torch.zeros(3, 100, dtype=DTYPE, device=DEVICE)
    sin = torch.zeros(3, 8, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="rotary_qk_"):
        rotary_qk_(y, 4, 16, sin, sin)  # rows narrower than q and k
    with pytest.raises(ValueError, match="rotary_qk_"):
        rotary_qk_(y, 2, 16, sin[:, :7], sin[:, :7])  # an odd width
    with pytest.raises(ValueError, match="rotary_qk_"):
        rotary_qk_(y, 2, 4, sin, sin)  # wider than a head


def test_the_policy_sends_a_fused_blocks_rotary_to_triton_on_cuda_below_float32(monkeypatch):
    monkeypatch.setattr(policy, "triton_available", lambda: True)
    assert policy.elementwise_path("cuda", torch.bfloat16) == policy.TRITON
    assert policy.elementwise_path("cuda", torch.float16) == policy.TRITON
    assert policy.elementwise_path("cuda", torch.float32) == policy.TORCH
    assert policy.elementwise_path("cpu", torch.float32) == policy.TORCH
    assert policy.elementwise_path("cpu", torch.bfloat16) == (policy.NATIVE if policy.native_available()
                                                                else policy.TORCH)
    monkeypatch.setattr(policy, "triton_available", lambda: False)
    assert policy.elementwise_path("cuda", torch.bfloat16) == policy.TORCH


@needs_triton
def test_a_fused_block_on_the_triton_path_computes_what_torchs_ops_do(monkeypatch):
    """The fused block with its rotary by the Triton kernel (float32 inside, one rounding) against
    the same block by torch's ops (each op rounded): q and k differ by about one rounding, which the
    attention and the projections carry to the output: within a few roundings of its largest value."""
    from gptj.config import GPTJConfig

    cfg = GPTJConfig(n_layer=1, n_embd=64, n_head=4, rotary_dim=8, n_inner=128, n_positions=64)
    torch.manual_seed(0)
    block = fused.fuse_block(Block(cfg).to(DTYPE).to(DEVICE))
    h = torch.randn(1, 9, 64).to(DTYPE).to(DEVICE)
    sin, cos = rotary_tables(rope_table(64, 8).to(DEVICE), torch.arange(9, device=DEVICE)[None], DTYPE)
    outs = {}
    for path in (policy.TORCH, policy.TRITON):
        block.ops = fused.KernelOps(path)
        with torch.inference_mode():
            outs[path] = block(h, sin, cos, None, None, 0).double()
    scale = outs[policy.TORCH].abs().max()
    diff = (outs[policy.TRITON] - outs[policy.TORCH]).abs().max()
    assert 0 < diff <= 4 * UNIT * scale  # the two roundings differ, by about one of them
    assert not torch.equal(outs[policy.TRITON], h.double())  # the block did something


def test_a_triton_rotary_that_fails_falls_back_to_torchs_ops_with_one_warning(monkeypatch, caplog):
    """A Triton or GPU the kernel was not built for: the rotary runs torch's ops (the same rotation)
    from then on, with one warning, instead of failing every forward."""
    from gptj.kernels import triton_elementwise

    calls = []

    def broken(*args):  # noqa: ANN002
        calls.append(1)
        raise RuntimeError("no such GPU\nmore")

    monkeypatch.setattr(triton_elementwise, "rotary_qk_", broken)
    monkeypatch.setattr(fused, "_FALLBACKS", Fallbacks(fused.log))
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(1, 5, 3, 2, 16, generator=g).to(DTYPE)
    sin, cos = rotary_tables(rope_table(64, 8), torch.arange(5)[None], DTYPE)
    want = qkv.clone()
    fused.rotary_qk_(want, sin, cos, policy.TORCH)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            got = qkv.clone()
            fused.rotary_qk_(got, sin, cos, policy.TRITON)
            assert torch.equal(got, want)
    assert len(calls) == 1 and [r.message for r in caplog.records if "Triton rotary" in r.message] == [
        "the Triton rotary failed (RuntimeError: no such GPU); torch's ops rotate from now on"]
