"""Pipeline parallel: PP=2 (two gloo processes) equals PP=1 in float32, micro-batches overlapping."""

from __future__ import annotations

import pytest
import torch

from gptj.decode import generate
from gptj.engine import Engine, EngineConfig
from gptj.parallel.pp import OtherStage, PipelineStage
from test_parallel_tp import GENS, PROMPTS, full_model, reference_tokens, spawn_ranks


def _pp_job(rank: int, world: int) -> dict:
    stage = PipelineStage(full_model(), rank, world, micro_batches=2)
    with torch.inference_mode():
        logits = stage(torch.tensor(PROMPTS[:1] * 2))
    sends = stage.sends
    tokens = {name: generate(stage, PROMPTS, gen) for name, gen in GENS.items()}
    engine = Engine(stage, EngineConfig(max_seqs=8, kernels="off", compile="off"))
    engine_tokens = {name: engine.generate(PROMPTS, gen) for name, gen in GENS.items()}
    owned = [i for i, b in enumerate(stage.transformer.h) if not isinstance(b, OtherStage)]
    return {"logits": logits, "sends": sends, "tokens": tokens, "engine": engine_tokens, "owned": owned}


def _grid_job(rank: int, world: int) -> dict:
    """--tp 2 --pp 2: rank r is tensor rank r % 2 of stage r // 2."""
    from gptj.parallel.context import ParallelContext

    ctx = ParallelContext.join(tp=2, pp=2)
    model = ctx.share(full_model())
    reduce = model.transformer.h[2 if rank >= 2 else 0].all_reduce
    with torch.inference_mode():
        logits = model(torch.tensor(PROMPTS[:1] * 2))
    calls, sends = reduce.calls, model.sends
    tokens = {name: generate(model, PROMPTS, gen) for name, gen in GENS.items()}
    engine = Engine(model, EngineConfig(max_seqs=8, kernels="off", compile="off"))
    engine_tokens = {name: engine.generate(PROMPTS, gen) for name, gen in GENS.items()}
    owned = [i for i, b in enumerate(model.transformer.h) if not isinstance(b, OtherStage)]
    return {"logits": logits, "calls": calls, "tokens": tokens, "engine": engine_tokens, "owned": owned,
            "heads": model.kv_heads, "sends": sends}


def test_tp2_pp2_grid_equals_one_process(tmp_path):
    ranks = spawn_ranks(_grid_job, 4, tmp_path)
    assert [r["owned"] for r in ranks] == [[0], [0], [1, 2], [1, 2]]  # stages: layer 0 | layers 1-2
    assert [r["heads"] for r in ranks] == [2, 2, 2, 2]  # each tensor rank: half the heads
    # one all-reduce per layer of the rank's stage (two micro-batches each), stage 0 sends both on
    assert [r["calls"] for r in ranks] == [2, 2, 4, 4] and [r["sends"] for r in ranks] == [2, 2, 0, 0]
    with torch.inference_mode():
        want = full_model()(torch.tensor(PROMPTS[:1] * 2))
    for name in GENS:
        want_tokens, want_engine = reference_tokens(name)
        for rank in ranks:
            assert rank["tokens"][name] == want_tokens and rank["engine"][name] == want_engine
    for rank in ranks:
        torch.testing.assert_close(rank["logits"], want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return spawn_ranks(_pp_job, 2, tmp_path_factory.mktemp("pp"))


def test_pp2_logits_equal_pp1_on_every_rank(pp2):
    with torch.inference_mode():
        want = full_model()(torch.tensor(PROMPTS[:1] * 2))
    for rank in pp2:
        torch.testing.assert_close(rank["logits"], want, rtol=1e-5, atol=1e-5)


def test_layers_are_split_and_micro_batches_flow(pp2):
    assert pp2[0]["owned"] == [0] and pp2[1]["owned"] == [1, 2]  # 3 layers over 2 ranks
    assert pp2[0]["sends"] == 2 and pp2[1]["sends"] == 0  # two micro-batches of one row, sent on


@pytest.mark.parametrize("name", sorted(GENS))
def test_pp2_tokens_equal_pp1(pp2, name):
    want, engine_want = reference_tokens(name)
    for rank in pp2:
        assert rank["tokens"][name] == want
        assert rank["engine"][name] == engine_want


def test_cli_generate_pp2_equals_pp1(tmp_path, capsys):
    import json

    from gptj.cli import main

    model = tmp_path / "tiny"
    assert main(["init", "--preset", "tiny", "--out", str(model), "--seed", "1"]) == 0
    capsys.readouterr()
    args = ["generate", "--model", str(model), "--prompt", "Hello world", "--prompt-ids", "5,6,7",
            "--max-new-tokens", "6", "--json"]
    for quant in ([], ["--quantize", "int8"]):
        # quantized: each stage quantizes its own layers as the whole model would (the same tokens)
        outs = []
        for pp in ("1", "2"):
            assert main(args + quant + ["--pp", pp]) == 0
            outs.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
        assert outs[0] == outs[1] and len(outs[0]) == 2
        if not quant:  # tensor x pipeline: 4 ranks, 2 stages of 2 tensor ranks
            assert main(args + ["--pp", "2", "--tp", "2"]) == 0
            assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == outs[0]
    # a Llama (its stand-in tokenizer, grouped-query attention): two stages, each its layers' KV heads;
    # two tensor ranks, each half the query and KV heads (gptj.parallel.tp_llama; the 2 x 2 grid: GPT-J's above)
    llama = tmp_path / "llama"
    assert main(["init", "--preset", "llama-tiny", "--out", str(llama)]) == 0
    capsys.readouterr()
    outs = []
    for grid in (["--pp", "1"], ["--pp", "2"], ["--tp", "2"]):
        assert main(["generate", "--model", str(llama), "--prompt", "The storm hit", "--max-new-tokens", "6", "--json",
                     *grid]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert all(out == outs[0] for out in outs) and len(outs[0]["token_ids"]) == 6
    assert main(["generate", "--model", str(llama), "--prompt", "x", "--tp", "3"]) == 1
    assert "needs num_attention_heads (4) divisible by 3" in capsys.readouterr().err
    # `gptj convert --tp 2` writes each rank's shard; the ranks read only theirs (the whole files gone)
    assert main(["convert", str(llama), "--out", str(tmp_path / "llama-tp2"), "--tp", "2", "--quiet"]) == 0
    for f in (tmp_path / "llama-tp2").glob("model*.safetensors*"):
        f.unlink()
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "llama-tp2"), "--prompt", "The storm hit", "--max-new-tokens",
                 "6", "--json", "--tp", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == outs[0]
