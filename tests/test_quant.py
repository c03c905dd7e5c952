"""Weight-only quantization: int8/int4 layers against a dequantized reference, error bounds,
whole models, quantized checkpoints, and refusals."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from gptj import native, policy, quant
from gptj.bench import quant_report
from gptj.config import GPTJConfig, get_preset
from gptj.errors import CheckpointError, GptjError
from gptj.models.gptj import build_model
from gptj.weights.io import convert, load_model, random_state_dict, save_checkpoint

CFG = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=256)
G = 32  # int4 group size for CFG (n_embd 64)
IDS = torch.tensor([[15496, 995, 11, 428, 318, 257, 1332, 286, 262, 3288, 13, 632]])


def make_linear(n_in, n_out, bias, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        lin.weight[3] *= 10  # one row with an outlier scale
        if bias:
            lin.bias.normal_(0, 0.1)
    return lin


def dequant_rows(mode, features=(128, 96), dtype=torch.bfloat16):
    """The fewest rows whose call of `dtype` activations dequantizes the weight (gptj.policy.linear_path)
    for a layer of `features` (in, out), native kernels or not. (Where gptj.native's int4 GEMM takes
    bfloat16 int4 calls of every size, none does: the tests of the dequantized path switch it off with
    `no_int4_gemm`.)"""
    rows = next((rows for rows in range(1, 1 << 16)
                 if policy.linear_path("cpu", dtype, rows, mode, features) in (policy.DEQUANTIZE, policy.UPCAST)), None)
    assert rows is not None, f"no {mode} call of {dtype} activations dequantizes here"
    return rows


@pytest.fixture
def no_int4_gemm(monkeypatch):
    """The policy without gptj.native's int4 kernels (tests of the paths they would take over; their own below)."""
    monkeypatch.setattr(policy, "native_int4_rows", lambda device, dtype, caps=None: range(0))


def quantized(lin, mode):
    return quant.Int8Linear.from_float(lin) if mode == "int8" else quant.Int4Linear.from_float(lin, G)


def rel_err(y, ref):
    return float((y.float() - ref).abs().max() / ref.abs().max())


# --- layers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("path", ["kernel", "dequant"])
def test_linear_matches_dequantized_reference(mode, dtype, bias, path, kernel_path, no_int4_gemm):
    """Each path of an Int8/Int4 linear (its CPU kernel: gptj.native's GEMV or torch's; the dequantized
    matmul) against the float32 product with the dequantized weight, native kernels on and off."""
    lin = make_linear(128, 96, bias)
    m = quantized(lin, mode)
    rows = 3 if path == "kernel" else dequant_rows(mode, dtype=dtype)
    x = torch.randn(1, rows, 128).to(dtype)
    assert m.use_kernel(x) == (path == "kernel")
    y = m(x)
    assert y.dtype == dtype and y.shape == (1, rows, 96)
    ref = F.linear(x.float(), m.dequantized_weight(torch.float32), None if lin.bias is None else lin.bias.detach())
    # The CPU kernels compute in bfloat16; float32 through F.linear is exact up to summation order:
    # each side within K * u * sum|x w| of the exact dot product (K = 128 inputs, u = 2^-24).
    tol = 2 * 128 * 2.0**-24 if (path == "dequant" and dtype == torch.float32) else 1.5e-2
    assert rel_err(y, ref) < tol


def test_cuda_int8_and_int4_calls_run_triton_at_every_row_count(monkeypatch):
    """On CUDA with Triton, int8 and int4 calls of 16-bit activations never dequantize the whole weight:
    gptj.quant.cuda's GEMV plans up to TRITON_MAX_ROWS, its GEMM plans past; bfloat16 int4 keeps
    torch's tinygemm up to 16 rows only. float32 activations dequantize past 16 rows, fp8 runs
    torch._scaled_mm there. Without Triton: the dequantized matmul (bfloat16 int4: tinygemm up to
    KERNEL_MAX_ROWS["int4"] first)."""
    path = policy.linear_path
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    monkeypatch.setattr(policy, "triton_available", lambda: True)
    monkeypatch.setattr(policy, "fp8_supported", lambda device: True)
    for rows in (1, 16, 17, 512, 4096):
        for dtype in (bf16, f16):
            assert path("cuda", dtype, rows, "int8", (4096, 4096)) == policy.TRITON, (dtype, rows)
        assert path("cuda", f16, rows, "int4") == policy.TRITON, rows
    assert path("cuda", bf16, 1, "int4") == path("cuda", bf16, 16, "int4") == policy.WEIGHT_ONLY
    assert path("cuda", bf16, 17, "int4") == path("cuda", bf16, 4096, "int4") == policy.TRITON
    for mode in ("int8", "int4"):
        assert path("cuda", f32, 16, mode) == policy.TRITON
        assert path("cuda", f32, 17, mode) == policy.DEQUANTIZE
    assert path("cuda", bf16, 17, "fp8", (4096, 4096)) == policy.SCALED_MM
    monkeypatch.setattr(policy, "triton_available", lambda: False)
    for rows in (1, 17, 512, 4096):
        assert path("cuda", bf16, rows, "int8") == path("cuda", f16, rows, "int4") == policy.DEQUANTIZE
    most = policy.KERNEL_MAX_ROWS["int4"]
    assert path("cuda", bf16, 17, "int4") == path("cuda", bf16, most, "int4") == policy.WEIGHT_ONLY
    assert path("cuda", bf16, most + 1, "int4") == policy.DEQUANTIZE


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("bf16_arithmetic", [True, False])
def test_many_bf16_rows_dequantize_in_float32_where_the_cpu_lacks_bf16(mode, bf16_arithmetic, monkeypatch,
                                                                         no_int4_gemm):
    """Past the kernels' rows a bfloat16 call on a CPU without bfloat16 arithmetic (faked here) runs
    the float32 call's math and rounds it once (UPCAST); with it, the dequantized matmul in bfloat16."""
    monkeypatch.setattr(policy, "cpu_bf16", lambda: bf16_arithmetic)
    m = quantized(make_linear(128, 96, True), mode)
    x = torch.randn(dequant_rows(mode, dtype=torch.float32), 128).to(torch.bfloat16)  # float32's too
    path = policy.linear_path(x.device, x.dtype, x.shape[0], mode)
    assert path == (policy.DEQUANTIZE if bf16_arithmetic else policy.UPCAST) and not m.use_kernel(x)
    assert policy.linear_path(x.device, torch.float32, x.shape[0], mode) == policy.DEQUANTIZE
    y, y32 = m(x), m(x.float())
    assert y.dtype == torch.bfloat16
    if not bf16_arithmetic:
        assert torch.equal(y, y32.to(torch.bfloat16))
    else:  # bfloat16 sums: within bfloat16's rounding of the float32 result, not equal to it
        assert not torch.equal(y, y32.to(torch.bfloat16)) and rel_err(y, y32) < 1.5e-2


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_dequant_path_in_chunks(monkeypatch, mode, no_int4_gemm):
    lin = make_linear(64, 560, True)  # 560 = 2 * 256 + 48 rows: chunks of 256 and a tail
    m = quantized(lin, mode)
    x = torch.randn(dequant_rows(mode, (64, 560), dtype=torch.float32), 64)
    whole = m(x)
    monkeypatch.setattr(quant.ops, "DEQUANT_CHUNK_ELEMENTS", 1)
    assert len(list(quant._row_chunks(560, 64))) == 3
    torch.testing.assert_close(m(x), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunks"])
def test_int4s_many_rows_take_the_native_unpacking_of_the_cpu_layout(monkeypatch, chunked, kernel_path,
                                                                     no_int4_gemm):
    """bfloat16 int4 calls past the kernel's rows take the weight from gptj.native's unpacking of
    torch's CPU layout (whole blocks, native kernels loaded; a partial last block, and every block
    without them, torch's unpacking): the same
    dequantized values (tests/test_native.py, bit for bit), so each within bfloat16's rounding of
    the float32 product, in one chunk or several."""
    lin = make_linear(256, 560, True)  # 560: 8 blocks of 64 and 48 rows (lm_head's 50,400 end so)
    m = quant.Int4Linear.from_float(lin, 64)
    if chunked:
        monkeypatch.setattr(quant.ops, "DEQUANT_CHUNK_ELEMENTS", 1)  # chunks of 256 rows
    x = torch.randn(policy.int4_kernel_max_rows("cpu", torch.bfloat16) + 1, 256).bfloat16()
    native_unpacks = kernel_path != "fallback" and quant.cpu_int4_layout() is not None
    assert not m.use_kernel(x) and m._native_dequant(x) == native_unpacks
    y = m(x)
    ref = F.linear(x.float(), m.dequantized_weight(torch.float32), lin.bias.detach())
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) < 1.5e-2
    monkeypatch.setattr(quant.Int4Linear, "_native_dequant", lambda self, x2: False)
    assert rel_err(m(x), y.float()) < 1.5e-2


def test_int4_layers_take_the_native_int4_gemm_where_it_runs(monkeypatch):
    """Where the policy gives bfloat16 int4 calls gptj.native's int4 kernels (AVX512-BF16 without AMX: the
    GEMV at 2 rows, the GEMM at 70; AVX2: the vector layer's GEMV at both), a layer's whole blocks of rows take
    them and a last partial block (560 = 8 x 64 + 48 rows, as lm_head's 50,400 end) the dequantized matmul:
    that block's columns equal the dequantized path's bit for bit, the others within bfloat16's rounding of
    it and of the float32 product. A weight they cannot take (not in torch's CPU layout) takes the
    dequantized matmul."""
    if not {policy.INT4_NATIVE_MIN_ROWS, 70} <= set(policy.native_int4_rows("cpu", torch.bfloat16)[:71]):
        pytest.skip("gptj.native's int4 kernels do not run here (AVX512-BF16 without AMX, or AVX2; the library loaded)")
    lin = make_linear(256, 560, True)
    m = quant.Int4Linear.from_float(lin, 64)
    calls = []
    real = native.linear_int4
    monkeypatch.setattr(native, "linear_int4", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    ref_w = m.dequantized_weight(torch.float32)
    for rows in (policy.INT4_NATIVE_MIN_ROWS, 70):
        x = torch.randn(rows, 256).bfloat16()
        assert policy.linear_path("cpu", x.dtype, rows, "int4") == policy.NATIVE and not m.use_kernel(x)
        y = m(x)
        assert calls[-1] == rows
        dq = m._dequant_linear(x) + m.bias.to(torch.bfloat16)  # the dequantized path's output
        full = 560 // quant.cpu_int4_layout()[0] * quant.cpu_int4_layout()[0]
        assert torch.equal(y[:, full:], dq[:, full:])
        assert rel_err(y, dq.float()) < 1.5e-2
        assert rel_err(y, F.linear(x.float(), ref_w, lin.bias.detach())) < 1.5e-2
    n = len(calls)
    m._to_portable()  # the portable layout (where torch's is unknown): the GEMM cannot read it
    m._prepared = True
    assert not m._native_gemm_ready()
    assert rel_err(m(x), y.float()) < 1.5e-2 and len(calls) == n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dequantized_chunks_reuse_one_buffer_outside_autograd(monkeypatch, dtype):
    """chunked_linear converts each chunk of the weight into one buffer kept from call to call (CPU,
    no autograd), with the numbers of a tensor per chunk, which is what it does where autograd records
    the call: there backward needs every chunk, and gets the right gradient."""
    monkeypatch.setattr(quant.ops, "DEQUANT_CHUNK_ELEMENTS", 1)  # 560 rows: chunks of 256, 256 and 48
    monkeypatch.setattr(quant.ops._scratch, "buffers", {}, raising=False)  # none from an earlier test
    m = quantized(make_linear(64, 560, False), "int8")
    x = torch.randn(dequant_rows("int8", (64, 560), dtype=dtype), 64).to(dtype)
    path = policy.linear_path(x.device, dtype, x.shape[0], "int8", (64, 560))
    key = (torch.float32 if path == policy.UPCAST else dtype, x.device)  # UPCAST: float32 sums (no bf16 arithmetic)
    with torch.inference_mode():  # the buffer is made here (as an engine's call makes it) ...
        y_inf = m(x)
    with torch.no_grad():  # ... and written outside inference mode after
        y = m(x)
        assert torch.equal(y, y_inf)
        buf = quant.ops._scratch.buffers[key]
        assert buf.numel() == 256 * 64 and torch.equal(m(x), y)
        assert quant.ops._scratch.buffers[key].data_ptr() == buf.data_ptr()
    xg = x.clone().requires_grad_()
    yg = m(xg)
    assert torch.equal(yg.detach(), y)
    yg.float().square().sum().backward()
    w = m.dequantized_weight(torch.float32)
    ref = (2 * yg.detach().float()) @ w  # d(sum y^2)/dx = 2 y W
    assert xg.grad.dtype == dtype and rel_err(xg.grad, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantization_error_is_at_most_half_a_step(mode):
    torch.manual_seed(1)
    w = torch.randn(64, 256) * 0.05
    w[0] = 0.0  # an all-zero row
    w[1] = 0.3  # a constant row
    w[2, :128] = torch.linspace(-1.0, -0.99, 128)  # narrow, all-negative groups
    w[3, 7] = 5.0  # an outlier
    w = w.to(torch.bfloat16).float()
    if mode == "int8":
        q, s = quant.quantize_int8(w)
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and s.dtype == torch.bfloat16
        step = s.float()[:, None].expand_as(w)
        dq = quant.dequantize_int8(q, s)
    else:
        packed, s, z = quant.quantize_int4(w, G)
        assert packed.dtype == torch.uint8 and packed.shape == (64, 128) and s.shape == z.shape == (64, 256 // G)
        step = s.float().repeat_interleave(G, dim=1)
        dq = quant.dequantize_int4(packed, s, z)
    assert bool(((w - dq).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all())
    assert bool((s.float() > 0).all())
    if mode == "int4":
        assert float((w[1] - dq[1]).abs().max()) == 0.0  # a constant group is exact (zero = the value)


def test_int4_portable_layout_is_high_nibble_first():
    q = torch.tensor([[1, 2, 15, 0]])
    assert quant.pack_int4(q).tolist() == [[0x12, 0xF0]]
    r = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(r)), r)


def test_cpu_kernel_layout_unpacks_and_packs_by_chunks(monkeypatch):
    layout = quant.cpu_int4_layout()
    if layout is None:
        pytest.skip("this torch build's CPU int4 layout is unknown (modules keep a portable copy)")
    for n in (16, 48, 64, 256, 560):
        q = torch.randint(0, 16, (n, 64), dtype=torch.uint8)
        whole = quant._pack_cpu_int4(q)
        assert torch.equal(quant._unpack_cpu_int4(whole, layout), q)
        monkeypatch.setattr(quant.ops, "_PACK_CHUNK_ROWS", 256)
        assert torch.equal(quant._pack_cpu_int4(q), whole)
        assert torch.equal(quant._pack_cpu_int4(quant.pack_int4(q), portable=True), whole)
        monkeypatch.undo()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_state_dict_is_the_portable_layout_and_survives_moves(mode):
    lin = make_linear(128, 96, True)
    m = quantized(lin, mode)
    expected = quant.quantize_weight(lin.weight.detach(), mode, G if mode == "int4" else None)
    sd = m.state_dict()
    assert set(sd) == {"bias", *expected}
    for k, t in expected.items():
        assert torch.equal(sd[k], t), k
    x = torch.randn(2, 128)
    y = m(x)
    m.to(torch.float32).to("cpu")  # casts would touch the scales; moves repack int4
    assert m.weight_scale.dtype == torch.bfloat16
    assert torch.equal(m(x), y)
    assert all(torch.equal(m.state_dict()[k], t) for k, t in expected.items())
    fresh = quantized(make_linear(128, 96, True, seed=5), mode)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), y)


# --- whole models ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def float_sd():
    return random_state_dict(CFG, seed=0, std=0.1)


def float_model(sd, dtype=torch.float32):
    model = build_model(CFG)
    model.load_state_dict(sd)
    return model.to(dtype).eval()


def greedy(model, ids, n):
    """Greedy decoding by full recompute (no cache), so it only needs model.forward."""
    ids = ids.clone()
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids, logits_to_keep=1)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, -n:].tolist()


# Random weights are the hard case (no redundancy, 50400 near-tied logits): int8 is about as close
# as a bfloat16 cast; int4 (group 32) moves logits ~20% and flips many near-ties, but its top-1
# stays among the float model's top 5.
@pytest.mark.parametrize("mode, max_rel, min_agree, min_top5", [("int8", 0.04, 0.9, 0.98), ("int4", 0.3, 0.6, 0.9)])
def test_quantized_model_close_to_float(float_sd, mode, max_rel, min_agree, min_top5):
    ref_model = float_model(float_sd)
    model = float_model(float_sd)
    q = quant.quantize_model(model, mode, group_size=G if mode == "int4" else None)
    assert model.config.quantization == q and q["mode"] == mode
    assert "transformer.h.0.attn.q_proj" in q["modules"] and "lm_head" in q["modules"]  # lm_head by default
    assert isinstance(model.lm_head, quant.Int8Linear if mode == "int8" else quant.Int4Linear)
    assert isinstance(model.transformer.wte, nn.Embedding)  # the embedding stays float
    ids = torch.randint(0, CFG.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = ref_model(ids), model(ids)
    assert rel_err(out, ref) < max_rel
    top1 = out.argmax(-1, keepdim=True)
    assert float((top1 == ref.argmax(-1, keepdim=True)).float().mean()) >= min_agree
    assert float((top1 == ref.topk(5, -1).indices).any(-1).float().mean()) >= min_top5
    if mode == "int8":  # greedy decoding (one row per step: the kernel path) follows the float model
        tokens, ref_tokens = greedy(model, IDS, 8), greedy(ref_model, IDS, 8)
        assert sum(a == b for a, b in zip(tokens, ref_tokens)) >= 7, (tokens, ref_tokens)


def test_skip_keeps_modules_float(float_sd):
    model = float_model(float_sd)
    q = quant.quantize_model(model, "int8", skip=("lm_head", "transformer.h.1.*"))
    assert "lm_head" not in q["modules"] and not any(m.startswith("transformer.h.1.") for m in q["modules"])
    assert type(model.lm_head) is nn.Linear
    assert isinstance(model.transformer.h[0].mlp.fc_in, quant.Int8Linear)
    assert type(model.transformer.h[1].mlp.fc_in) is nn.Linear


# --- checkpoints ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory, float_sd):
    return save_checkpoint(float_sd, CFG, tmp_path_factory.mktemp("q") / "float", with_tokenizer=False)


@pytest.fixture(scope="module")
def q8_ckpt(tmp_path_factory, float_ckpt):
    return convert(float_ckpt, tmp_path_factory.mktemp("q") / "q8", quantize="int8")


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("mode, dtype", [("int8", torch.float32), ("int4", torch.bfloat16)])
def test_quantized_checkpoint_round_trips(tmp_path, float_sd, float_ckpt, mode, dtype):
    g = G if mode == "int4" else None
    out = convert(float_ckpt, tmp_path / "q", quantize=mode, group_size=g, dtype=dtype)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["mode"] == mode and cfg["quantization"]["group_size"] == g
    assert cfg["quantization"]["version"] == 1 and "lm_head" in cfg["quantization"]["modules"]
    assert cfg["torch_dtype"] == str(dtype).removeprefix("torch.")
    # The file holds exactly what quantize_state_dict makes (the portable layout).
    # Weights are quantized from the tensors as stored (float32 here); `dtype` is for the float ones.
    expected, qdict = quant.quantize_state_dict(float_sd, CFG, mode, g)
    expected = {k: t.to(dtype) if t.is_floating_point() and not quant.is_quant_param(k) else t
                for k, t in expected.items()}
    assert qdict == cfg["quantization"]
    stored = load_file(str(out / "model.safetensors"))
    assert set(stored) == set(expected)
    for k, t in expected.items():
        assert torch.equal(stored[k], t.to(stored[k].dtype) if quant.is_quant_param(k) else t), k
        assert stored[k].dtype == (quant.SCALE_DTYPE if quant.is_quant_param(k) else t.dtype)
    # Loading it = quantizing the float checkpoint on load: same tensors, same logits.
    a = load_model(out, dtype=dtype)
    b = load_model(float_ckpt, dtype=dtype, quantize=mode, group_size=g)
    assert a.config == b.config and a.config.quantization == qdict
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb) == set(expected)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(logits(a), logits(b))
    assert torch.equal(logits(a, IDS[:, :1]), logits(b, IDS[:, :1]))  # one row: the kernel path
    # Asking for the quantization it already has is a no-op.
    c = load_model(out, dtype=dtype, quantize=mode, group_size=g)
    assert torch.equal(logits(c), logits(a))


def test_saving_a_quantized_model_keeps_it(tmp_path, float_sd):
    model = float_model(float_sd)
    quant.quantize_model(model, "int4", group_size=G)
    out = save_checkpoint(model.state_dict(), model.config, tmp_path / "m", with_tokenizer=False)
    assert torch.equal(logits(load_model(out)), logits(model))


def test_config_json_records_the_quantization(q8_ckpt):
    cfg = GPTJConfig.from_json_file(q8_ckpt / "config.json")
    assert cfg.quantization["mode"] == "int8" and cfg.replace(quantization=None) == CFG


@pytest.mark.parametrize("kwargs, message", [
    ({"quantize": "int3"}, "unknown quantization mode 'int3'"),
    ({"quantize": "int4", "group_size": 100}, "bad int4 group size 100"),
    ({"quantize": "int4", "group_size": 128}, "group size 128 does not divide the 64 inputs"),
    ({"quantize": "int8", "group_size": 32}, "group size applies to int4 and w4a8 only"),
    ({"group_size": 32}, "needs a quantization mode"),
])
def test_bad_mode_or_group_size(tmp_path, float_ckpt, float_sd, kwargs, message):
    with pytest.raises(GptjError, match=message):
        load_model(float_ckpt, **kwargs)
    with pytest.raises(GptjError, match=message):
        convert(float_ckpt, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
    if "quantize" in kwargs:
        with pytest.raises(GptjError, match=message):
            quant.quantize_model(float_model(float_sd), kwargs["quantize"], kwargs.get("group_size"))


def test_quantizing_a_quantized_checkpoint_differently_is_refused(tmp_path, float_ckpt, q8_ckpt, float_sd):
    q8 = q8_ckpt
    with pytest.raises(GptjError, match="already quantized as int8; cannot quantize it as int4"):
        load_model(q8, quantize="int4", group_size=G)
    q4 = convert(float_ckpt, tmp_path / "q4", quantize="int4", group_size=G)
    with pytest.raises(GptjError, match=r"already quantized as int4 \(group size 32\); cannot quantize it as int4 "
                                        r"\(group size 64\)"):
        load_model(q4, quantize="int4", group_size=64)
    with pytest.raises(GptjError, match="already quantized"):
        convert(q4, tmp_path / "again", quantize="int8")
    assert not (tmp_path / "again").exists()
    model = load_model(q4)
    with pytest.raises(GptjError, match="already quantized"):
        quant.quantize_model(model, "int8")
    with pytest.raises(GptjError, match="already quantized"):
        quant.quantize_state_dict(float_sd, model.config, "int8")


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8"])
def test_hf_transformers_refuses_a_quantized_folder(tmp_path, float_ckpt, mode):
    """Without config.json's quantization_config, from_pretrained loads gptj's int8 weights as floats
    (only `weight_scale | UNEXPECTED` said) and generates garbage; with it, a ValueError."""
    transformers = pytest.importorskip("transformers", reason="HF transformers is not installed")
    out = convert(float_ckpt, tmp_path / mode, quantize=mode, group_size=G if mode == "int4" else None)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "gptj" and qc["mode"] == mode and "quant_method" not in qc
    with pytest.raises(ValueError, match="quant_method"):
        transformers.AutoModelForCausalLM.from_pretrained(out)
    assert "quantization_config" not in json.loads((float_ckpt / "config.json").read_text())
    transformers.AutoModelForCausalLM.from_pretrained(float_ckpt)  # a float folder still loads


def test_gptj_loads_quantized_folders_with_and_without_quantization_config(tmp_path, q8_ckpt):
    """The entry is for HF transformers only: a folder written before it existed loads the same."""
    old = rewrite(q8_ckpt, tmp_path / "old", change_config=lambda c: c.pop("quantization_config"))
    a, b = load_model(q8_ckpt), load_model(old)
    assert a.config == b.config and a.config.quantization["mode"] == "int8"
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(logits(a), logits(b))


def rewrite(src, dst, change_tensors=None, change_config=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if change_config:
        change_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "model.safetensors"))
    if change_tensors:
        change_tensors(sd)
    from safetensors.torch import save_file

    save_file(sd, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("how, message", [
    ("float-weight", r"transformer.h.0.attn.q_proj.weight has dtype float32, expected int8"),
    ("no-scale", "missing tensor transformer.h.1.mlp.fc_in.weight_scale"),
    ("zero-scale", "lm_head.weight_scale has scales that are not positive"),
    ("bad-mode", "unknown quantization mode 'int3'"),
    ("bad-module", "quantization names 'transformer.h.0.ln_1'"),
    ("extra-field", "unknown field 'bits'"),
])
def test_bad_quantized_checkpoint_is_refused(tmp_path, q8_ckpt, how, message):
    q8 = q8_ckpt
    tensors = config = None
    if how == "float-weight":
        def tensors(sd):
            sd["transformer.h.0.attn.q_proj.weight"] = sd["transformer.h.0.attn.q_proj.weight"].float()
    elif how == "no-scale":
        def tensors(sd):
            del sd["transformer.h.1.mlp.fc_in.weight_scale"]
    elif how == "zero-scale":
        def tensors(sd):
            sd["lm_head.weight_scale"][5] = 0
    elif how == "bad-mode":
        def config(c):
            c["quantization"]["mode"] = "int3"
    elif how == "bad-module":
        def config(c):
            c["quantization"]["modules"].append("transformer.h.0.ln_1")
    else:
        def config(c):
            c["quantization"]["bits"] = 8
    bad = rewrite(q8, tmp_path / "bad", tensors, config)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


# --- report ---------------------------------------------------------------------------------------


def test_quantization_report(float_ckpt):
    rep = quant_report.quantization_report(float_ckpt, modes=("int8", "int4"), n_prompts=2, max_tokens=24, group_size=G)
    assert rep["prompts"] == 2 and rep["positions"] == 48 and rep["dtype"] == "bfloat16"
    assert list(rep["modes"]) == ["bfloat16", "int8", "int4"]  # the unquantized bfloat16 model as a yardstick
    for mode in ("bfloat16", "int8", "int4"):
        r = rep["modes"][mode]
        assert 0.5 <= r["top1_agreement"] <= 1.0
        assert 0 < r["mean_abs_logit_error"] <= r["max_abs_logit_error"]
        assert r["weight_bytes"] < rep["float32_weight_bytes"]
    assert rep["modes"]["int8"]["mean_abs_logit_error"] < rep["modes"]["int4"]["mean_abs_logit_error"]
    assert rep["modes"]["int4"]["weight_bytes"] < rep["modes"]["int8"]["weight_bytes"]
    text = quant_report.format_report(rep)
    assert "int8" in text and "int4" in text and "top-1" in text
    json.dumps(rep)  # plain JSON


def test_int4_default_group_fits_the_layers():
    assert quant.make_quantization(get_preset("small"), "int4")["group_size"] == quant.DEFAULT_GROUP_SIZE
    assert quant.make_quantization(CFG, "int4")["group_size"] == 64  # 128 > the 64 inputs of tiny's q_proj
    odd = GPTJConfig(n_layer=1, n_embd=96, n_head=4, rotary_dim=8, n_inner=384)
    assert quant.make_quantization(odd, "int4")["group_size"] == 32
    none_fits = GPTJConfig(n_layer=1, n_embd=48, n_head=4, rotary_dim=8, n_inner=192)
    with pytest.raises(GptjError, match=r"no int4 group size .* divides the 48 inputs of transformer\.h\.0\.attn"):
        quant.make_quantization(none_fits, "int4")
    with pytest.raises(GptjError, match="group size 128 does not divide the 64 inputs"):  # asked for: kept
        quant.make_quantization(CFG, "int4", 128)


def test_quantization_report_defaults_run_on_the_tiny_preset(tmp_path, capsys):
    from gptj.cli import main

    tiny = save_checkpoint(random_state_dict(get_preset("tiny"), seed=0), get_preset("tiny"), tmp_path / "tiny")
    assert main(["quant-report", "--model", str(tiny), "--prompts", "1", "--max-prompt-tokens", "8", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["modes"]["int4"]["group_size"] == 64 and rep["modes"]["int8"]["group_size"] is None
    assert rep["modes"]["int8"]["one_token_ms"] > 0 and rep["fastest"]["prefill_tok_s"] in rep["modes"]
    # --quantize names the modes too; --no-speed times nothing
    assert main(["quant-report", "--model", str(tiny), "--prompts", "1", "--max-prompt-tokens", "8", "--json",
                 "--quantize", "int8", "--no-speed"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert list(rep["modes"]) == ["int8"] and "fastest" not in rep  # --dtype auto: tiny's float32, the reference itself
    assert "one_token_ms" not in rep["modes"]["int8"]


def test_quantization_report_refuses_quantized_checkpoints(q8_ckpt):
    with pytest.raises(GptjError, match="needs a float checkpoint"):
        quant_report.quantization_report(q8_ckpt, prompts=[[1, 2, 3]])


def test_bfloat16_int8_linear_with_bias_at_decode_rows(kernel_path):
    """bfloat16 model, few rows: the bias rides in the int8 kernel call (gptj.native's, then torch's)."""
    lin = make_linear(128, 96, True).to(torch.bfloat16)
    m = quantized(lin, "int8")
    assert m.bias.dtype == torch.bfloat16
    for rows in (1, 8):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        y = m(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
        ref = F.linear(x.float(), m.dequantized_weight(torch.float32), m.bias.float())
        assert rel_err(y, ref) < 1.5e-2


def test_an_int8_weight_off_a_64_byte_boundary_runs_torchs_kernel_as_an_aligned_one():
    """A checkpoint's int8 weight is a view of its mapped file and may start anywhere (gptj.weights.hf):
    torch's weight-only int8 kernel faulted on such a one (64 x 64 at 3,000 bytes into a mapping). The
    layer copies it once, on its first call of that kernel, and gives the aligned weight's numbers."""
    import mmap

    from gptj.quant.base import pin_path
    from gptj.quant.int8 import WEIGHT_ALIGN

    lin = nn.Linear(64, 64)
    ref = quant.Int8Linear.from_float(lin)
    layer = quant.Int8Linear.from_float(lin)
    mapped = mmap.mmap(-1, 16384)
    view = torch.frombuffer(mapped, dtype=torch.int8, count=64 * 64, offset=3000).view(64, 64)
    view.copy_(layer.weight)
    layer.weight = view
    assert layer.weight.data_ptr() % WEIGHT_ALIGN
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    for m in (ref, layer):
        pin_path(m, policy.WEIGHT_ONLY, torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
    assert torch.equal(got, ref(x)) and layer.weight.data_ptr() % WEIGHT_ALIGN == 0
    assert not layer.weight.is_inference()  # still usable outside inference mode (LoRA training's backward)
