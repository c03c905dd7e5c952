"""benchmarks/serve_vs_vllm.py and offline_vs_vllm.py on a Llama folder (issue 59's peer table): the
settings and prompts they pick, without vLLM (pure logic, and a tiny Llama calibrated for w8a8)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import offline_vs_vllm
        import serve_vs_vllm
    finally:
        sys.path.remove(str(BENCH))
    return serve_vs_vllm, offline_vs_vllm


def folder(tmp_path: Path, model_type: str | None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({} if model_type is None else {"model_type": model_type}))
    return tmp_path


def test_model_type_reads_the_folder_and_defaults_to_gptj(bench, tmp_path):
    serve, _ = bench
    assert serve.model_type(folder(tmp_path / "l", "llama")) == "llama"
    assert serve.model_type(folder(tmp_path / "g", None)) == "gptj"
    assert serve.model_type(tmp_path / "missing") == "gptj"


def test_llama_servers_get_a_max_model_len(bench, tmp_path):
    """Every setting, gptj's and vLLM's, gets --max-model-len 2048 unless it gives one (either spelling)."""
    serve, _ = bench
    assert serve.with_max_model_len("--dtype bfloat16") == "--dtype bfloat16 --max-model-len 2048"
    assert serve.with_max_model_len("--max-model-len 4096") == "--max-model-len 4096"
    assert serve.with_max_model_len("--max-model-len=1024 --x") == "--max-model-len=1024 --x"
    assert serve.with_max_model_len("") == "--max-model-len 2048"
    p = serve.build_parser()
    args = argparse.Namespace(model=tmp_path, gptj_variants={"gptj-bf16": "--dtype bfloat16 --threads 2",
                                                             "gptj-int8": "--quantize int8 --max-model-len 1024"},
                              vllm_variants={"vllm-bf16": "--dtype bfloat16"})
    serve.llama_settings(p, args)
    assert args.gptj_variants == {"gptj-bf16": "--dtype bfloat16 --threads 2 --max-model-len 2048",
                                  "gptj-int8": "--quantize int8 --max-model-len 1024"}
    assert args.vllm_variants == {"vllm-bf16": "--dtype bfloat16 --max-model-len 2048"}


def test_offline_workload_llama_is_greedy_gptj_keeps_both_modes(bench, tmp_path):
    _, offline = bench
    p = offline.build_parser()
    gptj = argparse.Namespace(model=folder(tmp_path / "g", "gptj"), modes=None, gptj_quantize="w8a8")
    assert offline.workload(p, gptj) == "gptj-99" and gptj.modes == ["beam", "greedy"]
    llama = folder(tmp_path / "l", "llama")
    for quantize in ("int4", "w8a8"):
        args = argparse.Namespace(model=llama, modes=None, gptj_quantize=quantize)
        assert offline.workload(p, args) == "llama3.1-8b" and args.modes == ["greedy"]
    with pytest.raises(SystemExit) as e:
        offline.workload(p, argparse.Namespace(model=llama, modes=["beam", "greedy"], gptj_quantize="none"))
    assert e.value.code == 2


def test_offline_llama_prompts_are_the_llama_sample_set_in_its_format(bench, monkeypatch, tmp_path):
    """llama3.1-8b's bundled records, the llama prompt, tokenized with the folder's tokenizer."""
    _, offline = bench
    import gptj.tokenizer
    from gptj.mlperf.dataset import DEFAULT_LLAMA_DATASET, load_llama_records

    seen = []

    class Fake:
        def encode_batch(self, texts):
            seen.extend(texts)
            return [[0, len(t)] for t in texts]

    monkeypatch.setattr(gptj.tokenizer, "tokenizer_for_model", lambda model: Fake())
    ids = offline.load_prompts(tmp_path, "llama3.1-8b", 3)
    records = load_llama_records(DEFAULT_LLAMA_DATASET)[:3]
    assert seen == [r.input for r in records] and all(t.startswith("Summarize the following news") for t in seen)
    assert ids == [[0, len(r.input)] for r in records]
    assert offline.vllm_max_model_len([[1] * 100], 128) == 2048
    assert offline.vllm_max_model_len([[1] * 2000], 128) == 2128


def test_a_llama_w8a8_copy_is_calibrated_on_the_llama_set(bench, tmp_path):
    """--quantize w8a8 on a Llama folder serves a copy calibrated on llama3.1-8b's bundled prompts
    (its prompt format, the folder's tokenizer), made once; it loads with every linear W8A8."""
    from gptj.cli import main
    from gptj.mlperf.dataset import DEFAULT_LLAMA_DATASET
    from gptj.quant import W8A8Linear
    from gptj.weights.io import load_model

    serve, _ = bench
    assert main(["init", "--preset", "llama-tiny", "--out", str(tmp_path / "m")]) == 0
    out = serve.calibrated_copy(tmp_path / "m", tmp_path / "work")
    record = json.loads((out / "config.json").read_text())["calibration"]
    assert record["samples"] == 8 and record["dataset"] == Path(DEFAULT_LLAMA_DATASET).name
    assert serve.calibrated_copy(tmp_path / "m", tmp_path / "work") == out  # made once
    model = load_model(out, quantize="w8a8")
    assert all(type(model.get_submodule(n)) is W8A8Linear for n in model.config.quantization["modules"])
