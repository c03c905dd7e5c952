"""W4A8 (gptj.quant.w4a8): int4's weights times activations rounded to int8 per block of 32 inputs.

The rounding of x against its definition; the packed layout against int4's values; gptj.native's
GEMM (w4a8.c) on exact integer sums (every ISA's library this CPU runs, the same bits from each FMA
library) and against a float64 reference within float32's bound; the layer's paths, its checkpoint
(int4's tensors), the policy's routes; whole models, fused serving blocks and the CLI.
"""

from __future__ import annotations

import copy
import ctypes
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from gptj import native, policy
from gptj.cli import main
from gptj.config import GPTJConfig
from gptj.errors import GptjError
from gptj.engine import Engine, EngineConfig
from gptj.decode import GenerationConfig
from gptj.kernels import fused, prepare_for_serving
from gptj.models.gptj import build_model
from gptj.quant import Int4Linear, W4A8Linear, quantize_model
from gptj.quant.base import pin_path
from gptj.quant.ops import (_dequant_int4_values, pack_w4a8, quantize_blocks_int8, quantize_int4, round_blocks_int8,
                            unpack_int4, unpack_w4a8)
from gptj.weights.io import convert, load_model, random_state_dict, save_checkpoint
from test_engine_llama import prompts_of, tiny

U = 2.0 ** -24  # float32's unit roundoff


def int4_parts(N: int, K: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[1] *= 20  # a row of another scale
    packed, s, z = quantize_int4(w, group)
    return unpack_int4(packed), s, z


def bound(xr: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group: int) -> torch.Tensor:
    """What float32 allows the kernel per output: its sums (w4a8.c) are FMA chains of K / 32 block terms
    per group, then 2 per group, on exact integers: (K / 32 + 2 G + 2) roundings of u, each at most the
    largest partial sum, which is at most the sum of the terms' magnitudes, S = sum_g |s_g| sum_k |x'_k| q_k +
    |z_g - 8 s_g| |X_g| (float64)."""
    M, K = xr.shape
    N, G = s.shape
    ax = xr.abs().view(M, G, group)
    sd, zc = s.double(), (z.double() - 8 * s.double())
    A = torch.einsum("mgk,ngk->mng", ax, q.double().view(N, G, group))
    X = xr.view(M, G, group).sum(-1).abs()
    S = (A * sd.abs()[None]).sum(-1) + X @ zc.abs().T
    return (K // 32 + 2 * G + 2) * U * S


def upcast_bound(xr: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The float32 fallback's (UPCAST): x' and the weight each rounded once to float32, then F.linear's K
    terms summed: (K + 3) u times the sum of |x'| |w|."""
    return (xr.shape[1] + 3) * U * (xr.abs() @ _dequant_int4_values(q, s, z, torch.float64).abs().T)


# --- the rounding of x and the layout -----------------------------------------------------------


def test_x_is_rounded_per_block_of_32_to_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 128, generator=g) * torch.tensor([1.0, 100.0, 1e-3, 7.0]).repeat_interleave(32)
    x[2, 32:64] = 0  # a block of zeros
    q, d = quantize_blocks_int8(x)
    assert q.dtype == torch.int8 and d.shape == (3, 4)
    assert torch.equal(d, x.view(3, 4, 32).abs().amax(-1) / torch.full((3, 4), 127.0))
    assert torch.equal(q[2, 32:64], torch.zeros(32, dtype=torch.int8)) and d[2, 1] == 0
    assert int(q.abs().max()) == 127 and bool((q != -128).all())
    err = (round_blocks_int8(x) - x.double()).abs().view(3, 4, 32)
    assert bool((err <= d.double()[..., None] / 2 * (1 + 2 * U)).all())


def test_the_packed_layout_holds_int4s_values_as_w4a8c_reads_them():
    q, s, z = int4_parts(32, 64, 32)
    packed, sz = pack_w4a8(q, s, z)
    assert packed.shape == (32, 32) and packed.dtype == torch.uint8 and sz.shape == (2, 2, 2, 16)
    assert torch.equal(unpack_w4a8(packed), q)
    units = packed.view(2, 8, 64)  # (panel, unit of 8 inputs, byte)
    for p, u, c, j in [(0, 0, 0, 0), (1, 3, 15, 3), (0, 7, 9, 2)]:
        byte = int(units[p, u, 4 * c + j])
        assert byte & 15 == q[16 * p + c, 8 * u + j] and byte >> 4 == q[16 * p + c, 8 * u + 4 + j]
    assert torch.equal(sz[1, 1, 0], s[16:32, 1]) and torch.equal(sz[1, 1, 1], z[16:32, 1])


# --- gptj.native's GEMM -------------------------------------------------------------------------


# the last: w4a8.c takes rows in blocks of 256 KB of rounded x (32 rows of 8,192 inputs), so 45 rows are
# two blocks, the second ending in a tile of 5 rows
@pytest.mark.parametrize("N, K, M, group", [(64, 256, 1, 128), (48, 512, 3, 64), (32, 1024, 5, 32), (16, 96, 9, 32),
                                            (32, 8192, 45, 128)])
def test_the_gemm_is_within_float32s_bound_of_the_exact_product(native_isa, N, K, M, group):
    q, s, z = int4_parts(N, K, group, seed=N + M)
    packed, sz = pack_w4a8(q, s, z)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 3
    y = native.linear_w4a8(x, packed, sz, group)
    xr = round_blocks_int8(x)
    exact = xr @ _dequant_int4_values(q, s, z, torch.float64).T
    assert bool(((y.double() - exact).abs() <= bound(xr, q, s, z, group)).all())


def test_the_integer_sums_are_exact_at_the_extremes(native_isa):
    """q 15 against x rounded to +-127 everywhere (the largest int16 pair sums vpmaddubsw makes: no
    saturation), s 1 and z 8 (weights q - 8 + 8 = q): the sums are integers below 2^24, so every float32
    step is exact and y is the integer product."""
    N, K, group = 32, 256, 128
    q = torch.full((N, K), 15, dtype=torch.uint8)
    q[5] = torch.arange(K) % 16
    s, z = torch.ones(N, K // group, dtype=torch.bfloat16), torch.full((N, K // group), 8.0, dtype=torch.bfloat16)
    packed, sz = pack_w4a8(q, s, z)
    x = torch.full((2, K), 127.0)
    x[1, ::3] = -127.0
    y = native.linear_w4a8(x, packed, sz, group)
    assert torch.equal(y, x @ q.float().T)


def _call(lib: ctypes.CDLL, x, packed, sz, group: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], packed.shape[0])
    assert lib.gemm_w4a8(x.data_ptr(), packed.data_ptr(), sz.data_ptr(), y.data_ptr(), x.shape[0], packed.shape[0],
                         x.shape[1], group, y.shape[1], 2) == 0
    return y


def test_every_fma_library_gives_the_same_bits():
    """Each output is one lane's FMA chain in a fixed order on exact integers, so the AVX-512 and AVX2
    libraries agree bit for bit (2 threads, 1 to 6 rows)."""
    libs = {name: native.open_isa(name) for name in ("avx512-bf16", "avx512", "avx2")}
    libs = {k: v for k, v in libs.items() if v is not None}
    if len(libs) < 2:
        pytest.skip(f"this CPU runs {len(libs)} of the FMA libraries ({', '.join(libs) or 'none'}): nothing to compare")
    for N, K, rows in ((1024, 512, (1, 2, 6)), (64, 8192, (45,))):  # 45 rows of 8,192: two blocks of rows
        q, s, z = int4_parts(N, K, 128)
        packed, sz = pack_w4a8(q, s, z)
        x = torch.randn(max(rows), K, generator=torch.Generator().manual_seed(2))
        for M in rows:
            ys = [_call(lib, x[:M].contiguous(), packed, sz, 128) for lib in libs.values()]
            assert all(torch.equal(ys[0], y) for y in ys[1:]), f"{M} rows: {list(libs)} differ"


def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(native_isa):
    """x is rounded row by row and each output summed alone: batch-invariant (a verifying step's rows
    decode as each row alone)."""
    for K, M in ((256, 7), (8192, 41)):  # 41 rows of 8,192: two blocks of rows (above)
        q, s, z = int4_parts(64, K, 64)
        packed, sz = pack_w4a8(q, s, z)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(4))
        whole = native.linear_w4a8(x, packed, sz, 64)
        for m in range(M):
            assert torch.equal(native.linear_w4a8(x[m:m + 1].contiguous(), packed, sz, 64), whole[m:m + 1]), (K, m)


def test_a_nan_or_an_infinity_in_x_makes_its_rows_outputs_non_finite(native_isa):
    """A NaN or an infinity in a block of x gives the block's d NaN, so the row's outputs are NaN, as the
    definition's (round_blocks_int8) are: a vector max drops NaNs, and before this the kernel rounded a NaN
    to -127 and returned finite numbers. The other rows are what they are without them."""
    q, s, z = int4_parts(64, 256, 128)
    packed, sz = pack_w4a8(q, s, z)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    clean = native.linear_w4a8(x, packed, sz, 128)
    for bad in (float("nan"), float("inf"), float("-inf")):
        xb = x.clone()
        xb[1, 5] = xb[3, 200] = bad  # the first block of row 1, the last group of row 3
        y = native.linear_w4a8(xb, packed, sz, 128)
        assert not torch.isfinite(y[[1, 3]]).any(), bad
        assert torch.equal(y[[0, 2, 4]], clean[[0, 2, 4]]), bad
        ref = round_blocks_int8(xb) @ _dequant_int4_values(q, s, z, torch.float64).T
        assert not torch.isfinite(ref[[1, 3]]).any(), bad  # the definition's too


def test_bad_arguments_are_refused_in_one_line():
    if not native.w4a8_available():
        pytest.skip(f"gptj.native is not loaded here: {native.unavailable_reason()}")
    q, s, z = int4_parts(32, 64, 32)
    packed, sz = pack_w4a8(q, s, z)
    with pytest.raises(ValueError, match="x must be a contiguous float32"):
        native.linear_w4a8(torch.zeros(1, 64, dtype=torch.bfloat16), packed, sz, 32)
    with pytest.raises(ValueError, match="groups of a multiple of 32 inputs"):
        native.linear_w4a8(torch.zeros(1, 64), packed, sz, 16)
    with pytest.raises(ValueError, match="scales must be"):
        native.linear_w4a8(torch.zeros(1, 64), packed, sz[:1].contiguous(), 32)


# --- the layer ----------------------------------------------------------------------------------


def layer(N: int = 96, K: int = 256, group: int = 64, bias: bool = True) -> tuple[nn.Linear, W4A8Linear]:
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=bias)
    return lin, W4A8Linear.from_float(lin, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_of_the_layer_is_the_rounded_product(kernel_path, dtype):
    lin, m = layer()
    x = torch.randn(4, 256).to(dtype)
    want_native = kernel_path != "fallback"
    assert m.path(x) == (policy.NATIVE if want_native else policy.UPCAST)
    y = m(x)
    assert y.dtype == dtype
    q, s, z = m.nibbles(), m.weight_scale, m.weight_zero
    xr = round_blocks_int8(x.float())
    exact = xr @ _dequant_int4_values(q, s, z, torch.float64).T + lin.bias.detach().double()
    tol = (bound(xr, q, s, z, 64) if want_native else upcast_bound(xr, q, s, z)) + 2 * U * exact.abs()  # + the bias
    if dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * exact.abs()  # rounded once to bfloat16
    assert bool(((y.double() - exact).abs() <= tol).all())


def test_the_checkpoint_is_int4s_and_survives_loads_and_moves():
    lin, m = layer(bias=False)
    assert m.layout == "w4a8"
    int4 = Int4Linear.from_float(lin, 64)
    sd = m.state_dict()
    assert sd.keys() == int4.state_dict().keys()
    assert all(torch.equal(sd[k], int4.state_dict()[k]) for k in sd)
    x = torch.randn(2, 256)
    y = m(x)
    again = W4A8Linear(256, 96, False, 64)
    again.load_state_dict(sd)
    assert torch.equal(again(x), y)
    m.to(torch.float64).to(torch.float32)  # casts keep the scales bfloat16 values, the panels repacked
    assert m.layout == "w4a8" and torch.equal(m(x), y)


def test_the_policy_routes_w4a8():
    caps = policy.Capabilities.probe("cpu")
    plan = policy.linear_plan(caps, torch.bfloat16, "w4a8", (256, 96))
    if caps.native_gemv:
        assert plan.spans[0] == (0, policy.ALL_ROWS, policy.NATIVE)
    assert plan.path(1 << 20) == (policy.NATIVE if caps.native_gemv else policy.UPCAST)
    assert policy.linear_plan(caps, torch.bfloat16, "w4a8", (256, 200)).path(1) == policy.UPCAST  # outputs not in 16s
    no_native = policy.Capabilities(**{**caps.__dict__, "native_gemv": False})
    assert policy.linear_plan(no_native, torch.bfloat16, "w4a8", (256, 96)).spans == ((0, policy.ALL_ROWS,
                                                                                       policy.UPCAST),)
    cuda = policy.Capabilities(**{**caps.__dict__, "device": "cuda"})
    assert policy.linear_plan(cuda, torch.bfloat16, "w4a8", (256, 96)).path(8) == policy.UPCAST


# --- models -------------------------------------------------------------------------------------

CFG = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=256)
IDS = torch.tensor([[15496, 995, 11, 428, 318, 257, 1332, 286, 262, 3288, 13, 632]])


def test_a_w4a8_model_is_as_close_to_float_as_int4s_test_asks():
    """W4A8 against the float model, held to tests/test_quant.py's int4 thresholds for the same model,
    group and ids (largest logit error under 0.3 of the largest logit; top-1 agreement 0.6, within the
    float top 5 0.9), and its layers W4A8's."""
    base = build_model(CFG).eval()
    base.load_state_dict(random_state_dict(CFG, seed=0))
    w4a8 = copy.deepcopy(base)
    q = quantize_model(w4a8, "w4a8", group_size=32)
    assert q["mode"] == "w4a8" and q["group_size"] == 32 and "lm_head" in q["modules"]
    assert all(type(m) is W4A8Linear for n, m in w4a8.named_modules() if n in q["modules"])
    ids = torch.randint(0, CFG.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = base(ids)[0], w4a8(ids)[0]
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.3
    top1 = got.argmax(-1, keepdim=True)
    assert float((top1 == ref.argmax(-1, keepdim=True)).float().mean()) >= 0.6
    assert float((top1 == ref.topk(5, -1).indices).any(-1).float().mean()) >= 0.9


def test_fused_serving_blocks_give_the_plain_blocks_outputs_exactly(monkeypatch):
    """q|k|v and gate|up fuse into one W4A8 layer each: x is rounded once per row, and each output is summed
    alone, so a slice of the fused output is the plain layer's bit for bit, and an engine over fused
    blocks decodes the tokens of one over the plain blocks (gptj.native's GEMM: F.linear, the fallback's,
    may sum a wider weight in another order)."""
    if not native.w4a8_available():
        pytest.skip(f"gptj.native is not loaded here: {native.unavailable_reason()}")
    plain = tiny(2, torch.bfloat16, seed=3)
    quantize_model(plain, "w4a8")
    model, unfused = copy.deepcopy(plain), copy.deepcopy(plain)
    assert prepare_for_serving(model, max_rows=4)["fused_blocks"] == 2
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        for p, f in zip(plain.transformer.h, model.transformer.h):
            assert type(f.w_qkv) is W4A8Linear
            got = [*f.w_qkv(x).split(f.qkv_sizes, -1), *f.w_gate_up(x).chunk(2, -1)]
            want = [p.attn.q_proj(x), p.attn.k_proj(x), p.attn.v_proj(x), p.mlp.gate_proj(x), p.mlp.up_proj(x)]
            assert all(torch.equal(g, w) for g, w in zip(got, want))
    monkeypatch.setattr(fused, "_fusable", lambda block: False)
    assert prepare_for_serving(unfused, max_rows=4)["fused_blocks"] == 0
    prompts = prompts_of([9, 4, 14], seed=11)
    config, greedy = EngineConfig(max_seqs=4, block_size=16, kv_blocks=32), GenerationConfig(
        max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert Engine(model, config).generate(prompts, greedy) == Engine(unfused, config).generate(prompts, greedy)


def test_a_w4a8_checkpoint_holds_int4s_tensors_and_loads_as_w4a8(tmp_path):
    src = tmp_path / "float"
    save_checkpoint(random_state_dict(CFG, seed=0), CFG, src)
    convert(src, tmp_path / "int4", quantize="int4")
    convert(src, tmp_path / "w4a8", quantize="w4a8")
    config = json.loads((tmp_path / "w4a8" / "config.json").read_text())
    assert config["quantization"]["mode"] == "w4a8" and config["quantization"]["group_size"] == 64
    a, b = (load_file(next((tmp_path / d).glob("*.safetensors"))) for d in ("int4", "w4a8"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = load_model(tmp_path / "w4a8")
    assert isinstance(model.transformer.h[0].attn.q_proj, W4A8Linear)
    with torch.no_grad():
        direct = build_model(CFG).eval()
        direct.load_state_dict(random_state_dict(CFG, seed=0))
        quantize_model(direct, "w4a8")
        assert torch.equal(model(IDS), direct(IDS))


def test_gptj_generate_runs_w4a8(tmp_path, capsys):
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "tiny"), "--seed", "1"]) == 0
    code = main(["generate", "--model", str(tmp_path / "tiny"), "--quantize", "w4a8", "--dtype", "bfloat16",
                 "--prompt-ids", "15496,995,11", "--max-new-tokens", "4", "--json"])
    out = capsys.readouterr().out
    assert code == 0 and len(json.loads(out.splitlines()[-1])["token_ids"]) == 4


def test_the_upcast_path_is_the_fallback_everywhere(monkeypatch):
    _, m = layer()
    x = torch.randn(3, 256)
    native_y = m(x)
    pin_path(m, policy.UPCAST, torch.float32)
    q, s, z = m.nibbles(), m.weight_scale, m.weight_zero
    xr = round_blocks_int8(x)
    tol = bound(xr, q, s, z, 64) + upcast_bound(xr, q, s, z) + 4 * U * native_y.abs().double()
    assert bool(((m(x).double() - native_y.double()).abs() <= tol).all())


def test_the_commands_refuse_w4a8_off_a_cpu(tmp_path, capsys, monkeypatch):
    """Only gptj.native's GEMM runs W4A8 at speed, on CPUs: elsewhere the commands refuse it in one line, before
    the load (here the device a GPU would resolve to is faked: this machine may have none)."""
    from gptj import device

    device.check_w4a8_device("cpu")
    with pytest.raises(GptjError, match=r"w4a8 runs on CPUs .*this runs on cuda \(use --quantize int4"):
        device.check_w4a8_device("cuda")
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "tiny"), "--seed", "1"]) == 0
    monkeypatch.setattr(device, "resolve_device", lambda name: torch.device("cuda"))
    assert main(["generate", "--model", str(tmp_path / "tiny"), "--quantize", "w4a8", "--prompt-ids", "1,2",
                 "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "w4a8 runs on CPUs" in err, err
