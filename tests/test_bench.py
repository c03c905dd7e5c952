"""gptj bench latency: every figure is there, positive and finite; one JSON object; one-line errors.

No timing assertions: the figures are wall-clock measurements.
"""

import argparse
import json
import math

import pytest

from gptj.bench.latency import REQUIRED_KEYS, add_bench_parser, cmd_bench, format_latency, run_latency, weight_bytes_per_step
from gptj.config import get_preset
from gptj.errors import GptjError
from gptj.weights.io import load_model, random_state_dict, save_checkpoint

SMALL = dict(batch_size=2, prompt_len=8, new_tokens=4, warmup=0, repeats=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = get_preset("tiny")
    return save_checkpoint(random_state_dict(cfg, seed=0), cfg, tmp_path_factory.mktemp("bench") / "tiny")


def _parser():
    parser = argparse.ArgumentParser(prog="gptj")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_run_latency_reports_every_figure(tiny):
    r = run_latency(tiny, dtype="float32", **SMALL)
    for key in REQUIRED_KEYS + ("prefill_tok_s", "decode_step_ms", "kv_gb_s", "prefill_gflop_s"):
        assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r[key])
    assert (r["batch_size"], r["prompt_len"], r["new_tokens"], r["dtype"], r["quantize"]) == (2, 8, 4, "float32", None)
    text = format_latency(r)
    assert "decode" in text and "prefill" in text


def _params_from_shapes(cfg) -> int:
    """GPT-J's parameters from its shapes: wte; per layer ln_1, q/k/v/out (no bias), fc_in, fc_out
    (with bias); ln_f; lm_head with bias."""
    E, inner, V = cfg.n_embd, cfg.inner_dim, cfg.vocab_size
    layer = 2 * E + 4 * E * E + (E * inner + inner) + (inner * E + E)
    return V * E + cfg.n_layer * layer + 2 * E + (E * V + V)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_model_params_counts_the_config_not_the_repacked_modules(preset):
    from gptj.bench.latency import model_params

    cfg = get_preset(preset)
    assert model_params(cfg) == _params_from_shapes(cfg)


def test_run_latency_reports_params_of_the_model_before_repacking(tiny):
    # bfloat16: the engine fuses the blocks (and packs the linears into buffers where oneDNN can),
    # so counting model.parameters() after it comes out short.
    r = run_latency(tiny, dtype="bfloat16", **SMALL)
    assert r["params"] == _params_from_shapes(get_preset("tiny"))
    assert f"({r['params'] / 1e9:.2f}B params)" in format_latency(r)


def test_weight_bytes_count_embedding_rows_read_only(tiny):
    model = load_model(tiny)
    cfg = model.config
    all_bytes = sum(p.numel() * 4 for p in model.parameters())
    wte = cfg.vocab_size * cfg.n_embd * 4
    assert weight_bytes_per_step(model, 1) == all_bytes - wte + cfg.n_embd * 4
    assert weight_bytes_per_step(model, 3) == all_bytes - wte + 3 * cfg.n_embd * 4


def test_cmd_bench_json_prints_one_object(tiny, capsys):
    args = _parser().parse_args(["bench", "latency", "--model", str(tiny), "--batch-size", "1", "--prompt-len", "4",
                                 "--max-new-tokens", "3", "--warmup", "0", "--repeats", "1", "--json"])
    assert cmd_bench(args) == 0
    out = capsys.readouterr().out
    (line,) = out.strip().splitlines()
    obj = json.loads(line)
    for key in REQUIRED_KEYS:
        assert obj[key] > 0
    assert obj["dtype"] == "float32"  # the default, --dtype auto: the checkpoint's (tiny's: float32)


def test_bad_model_path_is_a_gptj_error(tmp_path):
    with pytest.raises(GptjError):
        run_latency(tmp_path / "missing", **SMALL)
    args = _parser().parse_args(["bench", "latency", "--model", str(tmp_path / "missing")])
    with pytest.raises(GptjError):
        cmd_bench(args)


def test_bad_settings_are_gptj_errors(tiny):
    with pytest.raises(GptjError, match="new_tokens"):
        run_latency(tiny, new_tokens=1, warmup=0, repeats=1)
    with pytest.raises(GptjError, match="positions"):
        run_latency(tiny, prompt_len=2048, new_tokens=2, warmup=0, repeats=1)
    with pytest.raises(GptjError, match="quantization"):
        run_latency(tiny, quantize="int3", **SMALL)


def test_quantize_runs_or_says_why(tiny):
    import inspect

    if "quantize" not in inspect.signature(load_model).parameters:
        with pytest.raises(GptjError, match="gptj.quant"):
            run_latency(tiny, quantize="int8", **SMALL)
    else:
        r = run_latency(tiny, quantize="int8", **SMALL)
        assert r["quantize"] == "int8" and all(r[k] > 0 for k in REQUIRED_KEYS)
