"""Serving LoRA adapters: several adapters over one base model in one engine, batched together
(gptj.lora.attach_adapters, the engine's per-row adapter ids), each request's tokens equal to its
adapter alone; the prefix cache keeps each adapter's KV apart; `gptj serve --lora NAME=DIR` and
`gptj generate --lora DIR`."""

from __future__ import annotations

import json

import pytest
import torch

from gptj.cli import main
from gptj.decode import GenerationConfig, generate
from gptj.engine import EngineConfig
from gptj.errors import GptjError
from gptj.lora import LoRAConfig, apply_lora, attach_adapter, lora_modules, merge_lora, read_adapter, save_adapter
from gptj.runtime.build import build_engine
from gptj.tokenizer import load_tokenizer
from gptj.weights.io import load_model
from serve_util import running_server
from test_serve import call

PROMPTS = [[5, 17, 300, 2, 9], [41, 7, 1000, 12], list(range(100, 140))]  # the last: 2 full KV blocks
GEN = GenerationConfig(max_new_tokens=6)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """Two trained-looking adapters on different linears: x on q and v, y on k, out_proj and the MLP."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for k, (name, targets) in enumerate([("x", ("q_proj", "v_proj")), ("y", ("k_proj", "out_proj", "fc_in", "fc_out"))]):
        model = load_model(tiny_checkpoint)
        config = LoRAConfig(rank=4, alpha=8, target_modules=targets)
        apply_lora(model, config)
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=g) * 0.3)
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.3)
        out[name] = str(save_adapter(model, config, root / name))
    return out


def alone(checkpoint, adapter: str | None, prompt) -> list[int]:
    """The reference: the plain model with this one adapter attached (unmerged), no engine."""
    model = load_model(checkpoint)
    if adapter is not None:
        attach_adapter(model, read_adapter(adapter))
    return generate(model, [prompt], GEN)[0]


def test_requests_of_different_adapters_share_steps_and_each_gets_its_adapters_tokens(tiny_checkpoint, adapters):
    """In float32 (where a batch cannot flip a token), each request of a step that mixes the base and
    two adapters gets the tokens its adapter gives alone, on the plain model."""
    engine = build_engine(load_model(tiny_checkpoint), EngineConfig(max_seqs=16),
                          adapters=[("x", adapters["x"]), ("y", adapters["y"])])
    assert engine.adapters == ["x", "y"] and engine.runner.lora and engine.runner.graphs is None
    jobs = [(p, a) for p in PROMPTS for a in (None, "x", "y")]
    reqs = [engine.add_request(p, GEN, adapter=a) for p, a in jobs]
    while engine.has_work:
        engine.step()
    assert max(engine.decode_batch_sizes) == len(jobs)  # all nine decoded in the same steps
    outputs = {}
    for (p, a), req in zip(jobs, reqs):
        assert req.output == alone(tiny_checkpoint, adapters.get(a), p), (a, p)
        outputs.setdefault(tuple(p), set()).add(tuple(req.output))
    assert all(len(v) == 3 for v in outputs.values())  # the adapters change the tokens


def fused_float32(checkpoint):
    """The float32 model with its blocks fused as the serving kernels fuse bfloat16 ones: q|k|v|fc_in
    in one linear, out_proj and fc_out side by side in another (w_out)."""
    from gptj.kernels import fuse_block

    model = load_model(checkpoint)
    for block in model.transformer.h:
        fuse_block(block)
    assert model.transformer.h[0].w_out is not None
    return model


def int8_fused(checkpoint):
    from gptj.kernels import prepare_for_serving

    model = load_model(checkpoint, quantize="int8")
    prepare_for_serving(model)
    assert model.transformer.h[0].w_in is not None and model.transformer.h[0].w_out is None
    return model


@pytest.mark.parametrize("make, quantize", [(fused_float32, None), (int8_fused, "int8")])
def test_adapters_on_the_serving_kernels_fused_blocks(tiny_checkpoint, adapters, make, quantize):
    """The serving kernels fuse q|k|v|fc_in into one linear, and out_proj with fc_out (float weights) or
    not (int8): an adapter adds to its slices. One forward of three prompts, rows of the base, x and
    y, against each adapter alone on the plain model: the same numbers up to float32 summation order
    (the fused block's rotary and GELU run other ops), far closer than the adapters' own effect."""
    from gptj.lora import attach_adapters

    ids = torch.tensor([p[:4] for p in PROMPTS])
    fused = make(tiny_checkpoint)
    modules = attach_adapters(fused, [read_adapter(adapters["x"]), read_adapter(adapters["y"])], ["x", "y"])
    for m in modules:
        m.select([-1] * 4 + [0] * 4 + [1] * 4)
    with torch.inference_mode():
        got = fused(ids).float()
        for i, name in enumerate((None, "x", "y")):
            plain = load_model(tiny_checkpoint, quantize=quantize)
            if name is not None:
                attach_adapter(plain, read_adapter(adapters[name]))
            want = plain(ids[i:i + 1])[0].float()
            scale = float(want.abs().max())
            assert float((got[i] - want).abs().max()) <= 1e-4 * scale, name
            if name is not None:
                base = load_model(tiny_checkpoint, quantize=quantize)(ids[i:i + 1])[0].float()
                assert float((want - base).abs().max()) > 100 * 1e-4 * scale


def test_the_prefix_cache_keeps_each_adapters_kv_apart(tiny_checkpoint, adapters):
    engine = build_engine(load_model(tiny_checkpoint), EngineConfig(max_seqs=4), adapters=[("x", adapters["x"])])
    long = PROMPTS[2]
    engine.generate([long], GEN)  # the base's blocks cached
    hits = engine.stats().prefix_hit_tokens
    out = engine.add_request(long, GEN, adapter="x")
    while engine.has_work:
        engine.step()
    assert engine.stats().prefix_hit_tokens == hits  # the base's KV is not x's
    assert out.output == alone(tiny_checkpoint, adapters["x"], long)
    again = engine.add_request(long, GEN, adapter="x")
    while engine.has_work:
        engine.step()
    assert engine.stats().prefix_hit_tokens > hits and again.output == out.output  # x's own KV is reused
    with pytest.raises(GptjError, match="no LoRA adapter 'z' here"):
        engine.add_request(long, GEN, adapter="z")


def test_serve_lora_names_each_adapter_as_a_model(tiny_checkpoint, adapters):
    tok = load_tokenizer()
    with running_server({"base": tiny_checkpoint}, lora=(("x", adapters["x"]), ("y", adapters["y"])),
                        max_batch_size=8) as url:
        status, body, _ = call(url, "GET", "/v1/models")
        assert status == 200 and {m["id"]: m["parent"] for m in body["data"]} == {"base": None, "x": "base",
                                                                                   "y": "base"}
        assert {m["id"]: m["root"] for m in body["data"]}["x"] == adapters["x"]
        for name, adapter in (("base", None), ("x", adapters["x"]), ("y", adapters["y"])):
            status, body, _ = call(url, body={"model": name, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0})
            assert status == 200, body
            want = tok.decode(alone(tiny_checkpoint, adapter, PROMPTS[0]), skip_special_tokens=True)
            assert body["choices"][0]["text"] == want, name
        status, body, _ = call(url, body={"model": "z", "prompt": PROMPTS[0], "max_tokens": 2})
        assert status == 404


def test_serve_lora_bad_input_is_one_line(tiny_checkpoint, adapters, tmp_path, capsys):
    cases = [(["--model", f"a={tiny_checkpoint}", "--model", f"b={tiny_checkpoint}", "--lora", f"x={adapters['x']}"],
              "--lora serves adapters over one --model"),
             (["--model", str(tiny_checkpoint), "--lora", f"x={tmp_path}"], "not a LoRA adapter folder")]
    for args, said in cases:
        assert main(["serve", "--port", "0", *args]) == 1
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_generate_lora_merges_the_adapter(tiny_checkpoint, adapters, capsys):
    assert main(["generate", "--model", str(tiny_checkpoint), "--lora", adapters["y"], "--prompt-ids",
                 ",".join(map(str, PROMPTS[1])), "--max-new-tokens", "6", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    merged = load_model(tiny_checkpoint)
    merge_lora(merged, read_adapter(adapters["y"]))
    assert got == generate(merged, [PROMPTS[1]], GEN)[0] == alone(tiny_checkpoint, adapters["y"], PROMPTS[1])
    assert got != alone(tiny_checkpoint, None, PROMPTS[1])
    # merged before quantizing: int8 of the merged weights
    assert main(["generate", "--model", str(tiny_checkpoint), "--lora", adapters["y"], "--quantize", "int8",
                 "--prompt-ids", "5,17", "--max-new-tokens", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    assert main(["generate", "--model", str(tiny_checkpoint), "--lora", adapters["y"], "--quantize", "w8a8",
                 "--prompt-ids", "5", "--max-new-tokens", "1"]) == 1
    assert "--lora with --quantize w8a8 is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("fuse", [False, True])
def test_llama_adapters_served_unmerged_each_get_their_merged_models_tokens(tmp_path, fuse):
    """Llama adapters (PEFT's names for LlamaForCausalLM) served over one Llama engine, unmerged and
    batched with the base: each request gets the tokens of the model with its adapter merged (float32).
    `fuse`: the engine's blocks fused as the serving kernels fuse them below float32 (q|k|v and
    gate|up one linear each): an adapter adds to its slices of them."""
    from safetensors.torch import save_file

    from gptj.weights.peft import CONFIG_FILE, WEIGHTS_FILE

    assert main(["init", "--preset", "llama-tiny", "--out", str(tmp_path / "m")]) == 0
    base = load_model(tmp_path / "m")
    c = base.config
    shapes = {"q_proj": (c.n_head * c.head_dim, c.n_embd), "k_proj": (c.n_kv_head * c.head_dim, c.n_embd),
              "o_proj": (c.n_embd, c.n_head * c.head_dim), "up_proj": (c.inner_dim, c.n_embd),
              "down_proj": (c.n_embd, c.inner_dim)}
    parent = {"q_proj": "self_attn", "k_proj": "self_attn", "o_proj": "self_attn", "up_proj": "mlp", "down_proj": "mlp"}
    folders = {}
    for k, targets in enumerate([("q_proj", "o_proj"), ("k_proj", "up_proj", "down_proj")]):
        g, sd = torch.Generator().manual_seed(k), {}
        for i in range(c.n_layer):
            for t in targets:
                out, inp = shapes[t]
                key = f"base_model.model.model.layers.{i}.{parent[t]}.{t}"
                sd[f"{key}.lora_A.weight"] = torch.randn(4, inp, generator=g) * 0.3
                sd[f"{key}.lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.3
        folder = tmp_path / f"a{k}"
        folder.mkdir()
        save_file(sd, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(LoRAConfig(rank=4, alpha=8, target_modules=targets).peft_json()))
        folders[f"a{k}"] = str(folder)
    served = load_model(tmp_path / "m")
    if fuse:
        from gptj.kernels.fused import fuse_block

        for block in served.transformer.h:
            fuse_block(block)
        assert not hasattr(served.transformer.h[0].attn, "k_proj") and served.transformer.h[0].w_gate_up is not None
    engine = build_engine(served, EngineConfig(max_seqs=8), adapters=list(folders.items()))
    gen = GenerationConfig(max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    prompts = [[5, 17, 300, 2, 9], [41, 7, 100, 12]]  # (llama-tiny's 512-id vocabulary)
    jobs = [(p, a) for p in prompts for a in (None, *folders)]
    reqs = [engine.add_request(p, gen, adapter=a) for p, a in jobs]
    while engine.has_work:
        engine.step()
    outputs = set()
    for (p, a), req in zip(jobs, reqs):
        want = load_model(tmp_path / "m")
        if a is not None:
            merge_lora(want, read_adapter(folders[a]))
        assert req.output == generate(want, [p], gen)[0], (a, p)
        outputs.add((tuple(p), tuple(req.output)))
    assert len(outputs) == len(jobs)  # each adapter changes the tokens
