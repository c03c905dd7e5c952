"""gptj's batch-1 decode on a Llama-3.1-8B-shaped model against llama.cpp at equal bits, and HF transformers.

    gptj-bf16, gptj-int8, gptj-int4   gptj's engine (what `gptj generate` runs) on the HF folder; int8 / int4
                                       quantized at load (`load_model(quantize=...)`, as `gptj generate --quantize`)
    llama.cpp-bf16, -q8_0, -q4_0       llama-cpp-python (llama.cpp) on a GGUF written from the same folder by
                                       `export_gguf` (BF16), then quantized by llama.cpp's own quantizer
                                       (`llama_model_quantize` with its default parameters, as `llama-quantize`)
    hf-bf16                            transformers' LlamaForCausalLM.generate, bfloat16
    gptj-w8a8 (asked for by name)      gptj's engine with `--quantize w8a8` on a calibrated copy of the folder
                                       (serve_vs_vllm.calibrated_copy: 8 prompts of the bundled llama3.1-8b
                                       set), against Q8_0: both int8 weights and int8 activations
    gptj-w4a8 (asked for by name)      gptj's engine with `--quantize w4a8`: int4's weights (groups of 128), x
                                       rounded to int8 per 32 inputs, against Q4_0 (x rounded to Q8_0's blocks
                                       of 32): the same kind of arithmetic

Equal bits: gptj-bf16 / llama.cpp-bf16, gptj-int8 (per-channel int8) / Q8_0 (int8 blocks of 32, an f16
scale each), gptj-int4 (groups of 128) / Q4_0 (blocks of 32). llama.cpp's default quantization keeps
its own choices: Q4_0 writes output.weight (the LM head) as Q6_K; the table's MB/token column says what
each variant reads per token.

Decode tok/s with prefill removed, as benchmarks/compare_peers.py measures it (its gptj helpers and its
`run_decode` are reused): batch 1, a fixed prompt of --prompt-len random token ids, greedy, exactly
--new-tokens new tokens (EOS ignored); each variant generates 1 and N tokens, tok/s =
(N - 1) / (median t_N - median t_1). Every variant runs in a process of its own (loaded, warmed up
untimed, timed, gone: the full model's variants do not fit in memory together), with --threads compute
threads (torch.set_num_threads; llama.cpp's n_threads and n_threads_batch); the variants alternate within
each of --rounds rounds (reversed every other round).

Before measuring, the GGUF export is checked (`check_export`): a small Llama (hidden 256, GQA 8/2 heads,
llama3 rope scaling with a short original context so that every rope band matters, 2 layers, the
stand-in byte-level BPE tokenizer), exported in float32, must give llama.cpp's logits equal to gptj's
float32 logits within 1e-3 of the largest |logit| at every prompt position and decode step, and the
same greedy tokens; exports without the Q/K permutation or without rope_freqs must fail that bound.

    python benchmarks/llama_shapes.py --out /tmp/llama-8b-w2 --layers 2      # the model (once)
    flock /tmp/gptj-bench.lock python benchmarks/llama_peers.py --model /tmp/llama-8b-w2 \\
        --work-dir /tmp/llama-peers --prompt-len 128 --new-tokens 64 --rounds 2 \\
        --json-out /tmp/llama-peers-results/w2.json
    python benchmarks/llama_peers.py --check-only --json    # the export check alone
    python benchmarks/llama_peers.py --smoke --json         # a tiny model, a few tokens: does it run?

Needs `pip install gguf llama-cpp-python` for the llama.cpp variants and the check (skipped with a
one-line note when absent), transformers for hf-bf16.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from gptj.bench.latency import random_prompts
from gptj.engine import EngineConfig
from gptj.models.llama import HF_NAMES, Llama3RopeScaling, LlamaConfig, rope_frequencies
from gptj.weights.hf import iter_hf_tensors, weight_files
from gptj.weights.io import load_model

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)
import compare_peers

VARIANTS = ("gptj-bf16", "gptj-int8", "gptj-int4", "llama.cpp-bf16", "llama.cpp-q8_0", "llama.cpp-q4_0", "hf-bf16")
# llama-quantize --pure: every matrix Q4_0, the LM head too (the default writes it Q6_K); not measured unless asked
EXTRA_VARIANTS = ("llama.cpp-q4_0-pure", "gptj-w8a8", "gptj-w4a8")
EQUAL_BITS = {"gptj-bf16": "llama.cpp-bf16", "gptj-int8": "llama.cpp-q8_0", "gptj-int4": "llama.cpp-q4_0"}
GGML_TYPE_F32 = 0  # ggml's type id, for llama.cpp's KV cache in the float32 check

# --- GGUF export ------------------------------------------------------------------------------

# HF LlamaForCausalLM's tensor name -> GGUF's (llama.cpp's LLM_ARCH_LLAMA); {i} is the layer.
GGUF_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
ROPE_FREQS = "rope_freqs.weight"
assert set(GGUF_NAMES) == set(HF_NAMES)  # every tensor gptj's Llama loads has a GGUF name


def gguf_names(config: LlamaConfig) -> dict[str, str]:
    """HF name -> GGUF name for every tensor of `config` (output.weight absent with tied embeddings:
    llama.cpp then reads token_embd for the LM head)."""
    names = {}
    for hf, gg in GGUF_NAMES.items():
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        layers = range(config.num_hidden_layers) if "{i}" in hf else [None]
        names.update({hf.format(i=i): gg.format(i=i) for i in layers})
    return names


def to_rotary_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q_proj / k_proj rows from HF's rotate-half layout to llama.cpp's (LLM_ARCH_LLAMA ropes adjacent pairs).

    HF rotates dims i and i + D/2 of each head by frequency i; llama.cpp rotates dims 2i and 2i + 1.
    Within each head, output row 2i takes HF row i and row 2i + 1 takes HF row i + D/2, so llama.cpp's
    pair i is HF's pair i (same angle); q.k is unchanged since q and k are permuted alike."""
    rows = w.shape[0]
    D = rows // heads
    return w.reshape(heads, 2, D // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def from_rotary_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `to_rotary_pairs`."""
    D = w.shape[0] // heads
    return w.reshape(heads, D // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_factors(config: LlamaConfig) -> torch.Tensor | None:
    """(D/2,) float32: llama.cpp's per-frequency divisors (rope_freqs) giving gptj's llama3-scaled
    frequencies, theta_i / factor_i = scaled_i; None without rope scaling."""
    if config.rope_scaling is None:
        return None
    plain = rope_frequencies(config.replace(rope_scaling=None))
    return (plain / rope_frequencies(config)).float()


def gguf_vocab(folder: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the folder's byte-level BPE tokenizer.json for
    tokenizer.ggml.model "gpt2": every id below vocab_size named (ids the tokenizer lacks: "[PADn]",
    unused), special added tokens as control tokens, other added tokens user-defined."""
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise SystemExit(f"{folder}/tokenizer.json: a BPE tokenizer is needed for GGUF's gpt2 model, "
                         f"got {model.get('type')!r}")
    tokens: list[str | None] = [None] * vocab_size
    types = [int(gguf.TokenType.NORMAL)] * vocab_size
    for text, i in model["vocab"].items():
        if i < vocab_size:
            tokens[i] = text
    for added in spec.get("added_tokens", []):
        i = added["id"]
        if i < vocab_size:
            tokens[i] = added["content"]
            types[i] = int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i] = f"[PAD{i}]"
            types[i] = int(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges  # type: ignore[return-value]


def read_llama_config(folder: Path) -> LlamaConfig:
    return LlamaConfig.from_hf_dict(json.loads((folder / "config.json").read_text()), source=str(folder))


def _tensors(folder: Path) -> Iterator[tuple[str, tuple[int, ...], object]]:
    for name, shape, read, _file in iter_hf_tensors(weight_files(folder)):
        if not name.endswith("rotary_emb.inv_freq"):
            yield name, shape, read


def export_gguf(folder: str | os.PathLike, out: str | os.PathLike, dtype: str = "bf16", permute: bool = True,
                rope: bool = True) -> Path:
    """Write the HF Llama folder as a GGUF for llama.cpp (general.architecture "llama"): matrices in
    `dtype` ("bf16", "f32", or "q8_0": quantized by the gguf package's Q8_0 quantizer, what
    `llama-quantize` makes of every matrix for Q8_0, without a BF16 file first), norms and rope_freqs in
    float32, streamed one tensor at a time (never the whole model in memory). `permute` / `rope` off write
    deliberately wrong files (the check's negative controls)."""
    import gguf
    from gguf.quants import quantize as quantize_q8_0

    folder, out = Path(folder), Path(out)
    config = read_llama_config(folder)
    names = gguf_names(config)
    matrix_type = {"bf16": gguf.GGMLQuantizationType.BF16, "f32": gguf.GGMLQuantizationType.F32,
                   "q8_0": gguf.GGMLQuantizationType.Q8_0}[dtype]
    q8_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0]  # (32 weights, 34 bytes)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(folder.name)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_file_type({"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f32": gguf.LlamaFileType.ALL_F32,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    tokens, types, merges = gguf_vocab(folder, config.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the stand-in's split is close to GPT-2's; text is never tokenized here
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if config.bos_token_id is not None:
        w.add_bos_token_id(config.bos_token_id)
        w.add_add_bos_token(True)
    w.add_eos_token_id(config.eos_token_ids[0])

    factors = rope_factors(config) if rope else None
    if factors is not None:
        w.add_tensor_info(ROPE_FREQS, tuple(factors.shape), factors.numpy().dtype, factors.numel() * 4)
    listed = []
    for name, shape, _read in _tensors(folder):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in names:
            raise SystemExit(f"{folder}: unexpected tensor {name}")
        if len(shape) == 2 and matrix_type == gguf.GGMLQuantizationType.BF16:
            w.add_tensor_info(names[name], shape, torch.empty(0, dtype=torch.int16).numpy().dtype,
                              shape[0] * shape[1] * 2, raw_dtype=matrix_type)
        elif len(shape) == 2 and matrix_type == gguf.GGMLQuantizationType.Q8_0:
            row = shape[1] // q8_bytes[0] * q8_bytes[1]  # a row's bytes
            w.add_tensor_info(names[name], (shape[0], row), torch.empty(0, dtype=torch.uint8).numpy().dtype,
                              shape[0] * row, raw_dtype=matrix_type)
        else:
            n = 1
            for s in shape:
                n *= s
            w.add_tensor_info(names[name], shape, torch.empty(0).numpy().dtype, n * 4)
        listed.append(name)
    if set(listed) != set(names):
        raise SystemExit(f"{folder}: missing tensors {sorted(set(names) - set(listed))[:3]}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    if factors is not None:
        w.write_tensor_data(factors.numpy())
    q_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, _shape, read in _tensors(folder):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        t = read()
        if permute and name.endswith("self_attn.q_proj.weight"):
            t = to_rotary_pairs(t, q_heads)
        elif permute and name.endswith("self_attn.k_proj.weight"):
            t = to_rotary_pairs(t, kv_heads)
        if t.dim() == 2 and matrix_type == gguf.GGMLQuantizationType.BF16:
            data = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        elif t.dim() == 2 and matrix_type == gguf.GGMLQuantizationType.Q8_0:
            data = quantize_q8_0(t.float().contiguous().numpy(), matrix_type)
        else:
            data = t.float().contiguous().numpy()
        w.write_tensor_data(data)
        del t, data
    w.close()
    tmp.replace(out)
    return out


QUANT_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
                "q4_0-pure": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def quantize_gguf(src: str | os.PathLike, out: str | os.PathLike, kind: str, threads: int = 2) -> Path:
    """llama.cpp's quantizer (`llama_model_quantize`, default parameters: `llama-quantize SRC OUT Q8_0`;
    "q4_0-pure": `llama-quantize --pure`)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_FTYPES[kind])
    params.nthread = threads
    params.pure = kind.endswith("-pure")
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {kind}) returned {rc}")
    tmp.replace(out)
    return out


def gguf_bytes_per_token(path: Path) -> tuple[int, dict[str, str]]:
    """(bytes a batch-1 step reads: every tensor, one row of token_embd; {tensor kind: ggml type})."""
    import gguf

    total, kinds = 0, {}
    for t in gguf.GGUFReader(str(path)).tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            n //= int(t.shape[-1])  # ggml's shape is (hidden, vocab): one row read per token
        total += n
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.removesuffix(".weight")
        kinds[kind] = t.tensor_type.name
    return total, kinds


# --- the export's check -----------------------------------------------------------------------

CHECK_CONFIG = LlamaConfig(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
    # original context 64: wavelengths below 16 kept, above 64 slowed 8x, between blended, so each band
    # turns by a radian or more within the prompt and a wrong rope_freqs shows in the logits
    rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=64),
    bos_token_id=0, eos_token_ids=(1,))
CHECK_STD = 0.1  # weights' std: attention scores of O(1) (0.02 leaves attention near uniform, blind to rope)
CHECK_REL_TOL = 1e-3  # of max |logit|; see check_export


def write_check_model(folder: Path, config: LlamaConfig = CHECK_CONFIG, dtype: torch.dtype = torch.float32) -> Path:
    """The check's small Llama folder with the stand-in byte-level BPE (as llama_shapes.py writes, trained
    on a few of the bundled articles)."""
    from gptj.mlperf.dataset import DEFAULT_DATASET, load_examples
    from gptj.tokenizer import write_standin_tokenizer
    from gptj.weights.hf_model import random_folder

    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    texts = [t for e in load_examples(DEFAULT_DATASET)[:4] for t in (e.input, e.output)]
    return random_folder(config, folder, seed=0, dtype=dtype, std=CHECK_STD, overwrite=True,
                         extra=lambda f: write_standin_tokenizer(f, texts, config.vocab_size))


def write_smoke_model(folder: Path) -> Path:
    """--smoke's model: the check's shape in bfloat16 with 50,304 ids (compare_peers' gptj decode passes
    GPT-J's pad id, 50256, which the engine checks against the vocabulary), llama_shapes' filled tokenizer."""
    import llama_shapes
    from gptj.weights.hf_model import random_folder

    config = CHECK_CONFIG.replace(vocab_size=50304)
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    return random_folder(config, folder, seed=0, dtype=torch.bfloat16, overwrite=True,
                         extra=lambda f: llama_shapes.write_full_vocab_tokenizer(f, config.vocab_size))


def llama_cpp_model(path: Path, n_ctx: int, threads: int, n_batch: int = 512, logits_all: bool = False,
                    f32_kv: bool = False):
    from llama_cpp import Llama

    kv = dict(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32) if f32_kv else {}
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                 n_threads_batch=threads, logits_all=logits_all, verbose=False, **kv)


def llama_cpp_teacher_forced(path: Path, prompt: list[int], forced: list[int], threads: int):
    """llama.cpp's float32 logits (numpy, one row per prompt position, then per forced token) with
    float32 KV, feeding `forced` one token at a time after the prompt."""
    import numpy as np

    llm = llama_cpp_model(path, n_ctx=len(prompt) + len(forced) + 8, threads=threads, logits_all=True, f32_kv=True)
    llm.eval(prompt)
    for tok in forced[:-1]:
        llm.eval([tok])
    rows = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    llm.close()
    return rows


def check_export(work: Path, threads: int = 2, prompt_len: int = 48, steps: int = 8) -> dict:
    """llama.cpp on `export_gguf`'s float32 GGUF of CHECK_CONFIG against gptj's float32 model.

    Both compute the same float32 math in different orders (and llama.cpp builds rope angles by
    repeated multiplication): their logits differ by float32 rounding, ~1e-5 of the logits' scale
    here. The bound, 1e-3 of max |logit|, is 100x that, and far below what a wrong layout does: the
    same export without the Q/K permutation, or without rope_freqs, is measured too and must exceed it
    (reported as negative controls). Greedy: gptj's greedy continuation is fed to both (teacher
    forcing), every step's argmax must agree."""
    import numpy as np

    folder = write_check_model(work / "check-model")
    config = read_llama_config(folder)
    model = load_model(folder, dtype=torch.float32)
    prompt = random_prompts(1, prompt_len, config.vocab_size, seed=7)[0]
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):  # gptj's greedy continuation (full forwards: the model is tiny)
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        ref = model(torch.tensor([ids[:-1]]))[0].numpy()  # logits at every prompt and decode position
    forced = ids[prompt_len:]
    scale = float(np.abs(ref).max())
    result = {"config": {"hidden": config.hidden_size, "layers": config.num_hidden_layers,
                         "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                         "head_dim": config.head_dim, "vocab": config.vocab_size,
                         "rope_scaling": config.rope_scaling.to_hf_dict()},
              "prompt_len": prompt_len, "steps": steps, "max_abs_logit": scale,
              "bound": CHECK_REL_TOL * max(1.0, scale)}
    for label, kw in (("export", {}), ("without_permutation", {"permute": False}), ("without_rope_freqs",
                                                                                   {"rope": False})):
        path = export_gguf(folder, work / f"check-{label}.gguf", "f32", **kw)
        got = llama_cpp_teacher_forced(path, prompt, forced, threads)
        diff = float(np.abs(got - ref).max())
        greedy = [int(r.argmax()) for r in got[prompt_len - 1:]]
        result[label] = {"max_abs_dlogit": diff, "greedy_equal": greedy == forced,
                         "prompt_max_abs_dlogit": float(np.abs(got[:prompt_len] - ref[:prompt_len]).max())}
        if label == "export":
            result["gptj_tokens"], result["llama_cpp_tokens"] = forced, greedy
    result["ok"] = (result["export"]["max_abs_dlogit"] <= result["bound"] and result["export"]["greedy_equal"]
                    and all(result[k]["max_abs_dlogit"] > result["bound"]
                            for k in ("without_permutation", "without_rope_freqs")))
    return result


# --- the variants, each in a process of its own -----------------------------------------------


def weight_bytes_hf(model: torch.nn.Module) -> int:
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size()


def llama_cpp_impl(name: str, path: Path, threads: int, prompt_len: int, new_tokens: int) -> compare_peers.Impl:
    """llama.cpp through llama-cpp-python's Llama: eval the prompt, then one token at a time, each the
    argmax of the last logits (llama_get_logits_ith; logits_all off, as generation runs it)."""
    import llama_cpp
    import numpy as np

    n_batch = max(512, prompt_len)
    llm = llama_cpp_model(path, n_ctx=prompt_len + new_tokens + 16, threads=threads, n_batch=n_batch)
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).argmax())

    def decode(prompts: list[list[int]], n: int) -> list[list[int]]:
        if len(prompts) != 1:
            raise ValueError("llama.cpp here decodes batch 1")
        llm.reset()
        llm.eval(prompts[0])
        out = []
        for i in range(n):
            out.append(last_argmax())
            if i < n - 1:
                llm.eval([out[-1]])
        return [out]

    return compare_peers.Impl(name, decode, lambda p, g: [], gguf_bytes_per_token(path)[0], close=llm.close)


def hf_llama_impl(name: str, folder: Path, dtype: torch.dtype) -> compare_peers.Impl:
    """transformers' LlamaForCausalLM from the same folder (from_pretrained), greedy generate, EOS off."""
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    hf.generation_config.eos_token_id = None

    @torch.inference_mode()
    def decode(prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(prompts)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    return compare_peers.Impl(name, decode, lambda p, g: [], weight_bytes_hf(hf))


def gguf_path(work: Path, folder: Path, kind: str) -> Path:
    return work / f"{folder.name}-{kind}.gguf"


def make_impl(variant: str, folder: Path, work: Path, threads: int, prompt_len: int,
              new_tokens: int) -> compare_peers.Impl:
    family, kind = variant.split("-", 1)
    if family == "gptj":
        quantize = None if kind == "bf16" else kind
        if kind == "w8a8":  # its smoothing factors: a calibrated copy, made once under the work dir
            from serve_vs_vllm import calibrated_copy

            folder = calibrated_copy(folder, work)

        def load() -> torch.nn.Module:
            return load_model(folder, dtype=torch.bfloat16, quantize=quantize)

        return compare_peers.gptj_impl(variant, load(), load)
    if family == "llama.cpp":
        return llama_cpp_impl(variant, gguf_path(work, folder, kind), threads, prompt_len, new_tokens)
    if family == "hf":
        return hf_llama_impl(variant, folder, torch.bfloat16)
    raise ValueError(variant)


def worker(args: argparse.Namespace) -> None:
    """One variant: load (timed apart), then compare_peers.run_decode's warm-up and timed calls; one JSON line."""
    torch.set_num_threads(args.threads)
    if not args.adapt_threads:
        compare_peers.ASKED = EngineConfig()  # --threads at every step, as `gptj generate --threads N`
    vocab = read_llama_config(Path(args.model)).vocab_size
    t0 = time.perf_counter()
    impl = make_impl(args.worker, Path(args.model), Path(args.work_dir), args.threads, args.prompt_len,
                     args.new_tokens)
    load_s = time.perf_counter() - t0
    res = compare_peers.run_decode([impl], 1, args.prompt_len, args.new_tokens, args.warmup, args.repeats, vocab)
    r = res[impl.name]
    impl.close()
    print("RESULT " + json.dumps({"variant": impl.name, "load_s": load_s, "t1": r["first_token_s"],
                                  "tN": r["total_s"], "decode_tok_s": r["decode_tok_s"],
                                  "weight_bytes": impl.weight_bytes, "tokens": r["tokens"][0]}), flush=True)


def run_worker(variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--model", str(args.model), "--work-dir", str(args.work_dir),
           "--threads", str(args.threads), "--prompt-len", str(args.prompt_len), "--new-tokens",
           str(args.new_tokens), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    if args.adapt_threads:
        cmd.append("--adapt-threads")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# --- setup, rounds, report --------------------------------------------------------------------


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def missing(variant: str) -> str | None:
    import importlib.util

    need = {"llama.cpp": ("gguf", "llama_cpp"), "hf": ("transformers",)}.get(variant.split("-", 1)[0], ())
    absent = [m for m in need if importlib.util.find_spec(m) is None]
    return f"{', '.join(absent)} not installed" if absent else None


def prepare_ggufs(variants: list[str], folder: Path, work: Path, threads: int,
                  direct: bool = False) -> dict[str, dict]:
    """The GGUF files the llama.cpp variants need: BF16 by export_gguf, Q8_0 / Q4_0 from it by llama.cpp's
    quantizer; the BF16 file is deleted afterwards when llama.cpp-bf16 is not measured (disk). `direct`:
    each of BF16 and Q8_0 written by export_gguf straight from the folder (no BF16 file for Q8_0: a
    full-depth model on a small disk)."""
    kinds = [v.split("-", 1)[1] for v in variants if v.startswith("llama.cpp-")]
    if not kinds:
        return {}
    work.mkdir(parents=True, exist_ok=True)
    bf16 = gguf_path(work, folder, "bf16")
    info = {}
    needed = [k for k in kinds if not gguf_path(work, folder, k).is_file()]
    if direct:
        for k in needed:
            t0 = time.perf_counter()
            export_gguf(folder, gguf_path(work, folder, k), k)
            info[f"export_{k}_s"] = time.perf_counter() - t0
            note(f"exported {gguf_path(work, folder, k)} in {info[f'export_{k}_s']:.0f} s")
        needed = []
    if needed and not bf16.is_file():
        t0 = time.perf_counter()
        export_gguf(folder, bf16, "bf16")
        info["export_bf16_s"] = time.perf_counter() - t0
        note(f"exported {bf16} in {info['export_bf16_s']:.0f} s")
    for k in kinds:
        path = gguf_path(work, folder, k)
        if k != "bf16" and not path.is_file():
            t0 = time.perf_counter()
            quantize_gguf(bf16, path, k, threads)
            info[f"quantize_{k}_s"] = time.perf_counter() - t0
            note(f"quantized {path} in {info[f'quantize_{k}_s']:.0f} s")
    if "bf16" not in kinds and bf16.is_file():
        bf16.unlink()
    files = {}
    for k in kinds:
        path = gguf_path(work, folder, k)
        nbytes, types = gguf_bytes_per_token(path)
        files[f"llama.cpp-{k}"] = {"path": str(path), "file_bytes": path.stat().st_size, "bytes_per_token": nbytes,
                                   "tensor_types": types}
    return {"timings": info, "files": files}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def summarize(rounds: list[dict[str, dict]], variants: list[str], new_tokens: int) -> dict[str, dict]:
    out = {}
    for v in variants:
        runs = [r[v] for r in rounds if v in r]
        if not runs:
            continue
        t1 = statistics.median(r["t1"] for r in runs)
        tn = statistics.median(r["tN"] for r in runs)
        out[v] = {"decode_tok_s": (new_tokens - 1) / (tn - t1) if tn > t1 else None, "t1_s": t1, "tN_s": tn,
                  "per_round_tok_s": [(new_tokens - 1) / (r["tN"] - r["t1"]) if r["tN"] > r["t1"] else None
                                      for r in runs],
                  "weight_bytes": runs[0]["weight_bytes"], "load_s": [r["load_s"] for r in runs],
                  "tokens": runs[-1]["tokens"]}
    return out


def _f(x: float | None, d: int = 2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def report(summary: dict[str, dict], args: argparse.Namespace) -> tuple[str, dict]:
    cols = max(len(s["per_round_tok_s"]) for s in summary.values())
    head = ["variant", "MB/token"] + [f"round {i + 1} tok/s" for i in range(cols)] + [
        "decode tok/s", "t_1 s", f"t_{args.new_tokens} s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v, s in summary.items():
        rounds = [_f(x) for x in s["per_round_tok_s"]] + [""] * (cols - len(s["per_round_tok_s"]))
        lines.append("| " + " | ".join([v, f"{s['weight_bytes'] / 1e6:.0f}", *rounds, _f(s["decode_tok_s"]),
                                        _f(s["t1_s"]), _f(s["tN_s"])]) + " |")
    ratios = {}
    pairs = [*EQUAL_BITS.items(), ("gptj-int4", "llama.cpp-q4_0-pure"), ("gptj-w8a8", "llama.cpp-q8_0"),
             ("gptj-w4a8", "llama.cpp-q4_0"), ("gptj-w4a8", "gptj-int4"),
             *((o, "hf-bf16") for o in EQUAL_BITS)]
    for ours, peer in pairs:
        if ours in summary and peer in summary:
            a, b = summary[ours]["decode_tok_s"], summary[peer]["decode_tok_s"]
            per = [x / y if x and y else None for x, y in zip(summary[ours]["per_round_tok_s"],
                                                             summary[peer]["per_round_tok_s"])]
            ratios[f"{ours} / {peer}"] = {"ratio": a / b if a and b else None, "per_round": per}
    if ratios:
        lines += ["", "| gptj / peer | ratio (medians) | per round |", "|---|---|---|"]
        lines += [f"| {k} | {_f(r['ratio'])}× | {', '.join(_f(x) for x in r['per_round'])} |"
                  for k, r in ratios.items()]
    same = {}
    for a, b in (("gptj-bf16", "hf-bf16"), ("gptj-bf16", "llama.cpp-bf16"), ("gptj-int8", "llama.cpp-q8_0"),
                 ("gptj-int4", "llama.cpp-q4_0"), ("gptj-bf16", "gptj-int8")):
        if a in summary and b in summary:
            same[f"{a} vs {b}"] = first_difference(summary[a]["tokens"], summary[b]["tokens"])
    if same:
        lines += ["", "Greedy tokens: " + "; ".join(
            f"{k}: {'identical' if d is None else f'first differ at new token {d}'}" for k, d in same.items())]
    return "\n".join(lines), {"ratios": ratios, "first_token_difference": same}


SMOKE = dict(prompt_len=8, new_tokens=24, rounds=1, warmup=1, repeats=3, check_steps=2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/llama-8b-w2"),
                    help="an HF Llama folder (benchmarks/llama_shapes.py writes one; made with --layers if absent)")
    ap.add_argument("--layers", type=int, default=2, help="llama_shapes.py's --layers when --model is absent")
    ap.add_argument("--work-dir", type=Path, default=Path(os.environ.get("GPTJ_BENCH_DIR", "/tmp/llama-peers")),
                    help="GGUF files and the check's model")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed 1- and N-token calls per process")
    ap.add_argument("--repeats", type=int, default=1, help="timed 1- and N-token calls per process (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--adapt-threads", action="store_true",
                    help="gptj chooses its threads from step times (its commands without --threads); default: "
                         "--threads at every step")
    ap.add_argument("--check-steps", type=int, default=8, help="greedy steps of the export check")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--direct-export", action="store_true",
                    help="write llama.cpp-q8_0's GGUF with the gguf package's Q8_0 quantizer straight from the folder "
                         "(no BF16 GGUF first: full depth on a small disk); only the bf16 and q8_0 variants")
    ap.add_argument("--check-only", action="store_true", help="the export check, no measurement")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (tables to stderr)")
    ap.add_argument("--json-out", type=Path, help="also write the figures to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = _smoke.parse_args(ap, SMOKE, argv)
    if args.worker:
        return worker(args)
    out = sys.stderr if args.json else sys.stdout
    torch.set_num_threads(args.threads)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS + EXTRA_VARIANTS:
            ap.error(f"unknown variant {v!r}")
    if args.direct_export and any(v.startswith("llama.cpp-") and v not in ("llama.cpp-bf16", "llama.cpp-q8_0")
                                  for v in variants):
        ap.error("--direct-export writes only llama.cpp-bf16's and llama.cpp-q8_0's files")
    if args.new_tokens < 2 or args.rounds < 1:
        ap.error("--new-tokens must be >= 2 and --rounds >= 1")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "torch": torch.__version__}
    try:
        import llama_cpp

        result["llama_cpp"] = {"version": llama_cpp.__version__,
                               "system_info": llama_cpp.llama_print_system_info().decode()}
    except ImportError:
        pass
    if args.smoke:
        args.model = write_smoke_model(args.work_dir / "smoke-model")
    elif not (args.model / "config.json").is_file():
        import llama_shapes

        note(f"writing {args.model} ({args.layers} layers)")
        llama_shapes.write_model(args.model, args.layers)

    if not args.skip_check:
        if why := missing("llama.cpp-bf16"):
            note(f"skipping the export check: {why}")
        else:
            check = check_export(args.work_dir, args.threads, steps=args.check_steps)
            result["check"] = check
            print(f"export check: max |dlogit| {check['export']['max_abs_dlogit']:.2e} (bound {check['bound']:.2e}, "
                  f"max |logit| {check['max_abs_logit']:.2f}), greedy equal {check['export']['greedy_equal']}; "
                  f"without the Q/K permutation {check['without_permutation']['max_abs_dlogit']:.2e}, "
                  f"without rope_freqs {check['without_rope_freqs']['max_abs_dlogit']:.2e}: "
                  f"{'ok' if check['ok'] else 'FAILED'}", file=out, flush=True)
            if not check["ok"]:
                raise SystemExit("the GGUF export does not reproduce gptj's logits: not measuring")
    if not args.check_only:
        for v in list(variants):
            if why := missing(v):
                note(f"skipping {v}: {why}")
                variants.remove(v)
        result["gguf"] = prepare_ggufs(variants, args.model, args.work_dir, args.threads, args.direct_export)
        gc.collect()
        rounds: list[dict[str, dict]] = []
        for r in range(args.rounds):
            rounds.append({})
            for v in variants if r % 2 == 0 else variants[::-1]:
                res = run_worker(v, args)
                rounds[-1][v] = res
                note(f"round {r + 1} {v}: t_1 {res['t1']:.2f} s, t_{args.new_tokens} {res['tN']:.2f} s, "
                     f"load {res['load_s']:.0f} s")
        summary = summarize(rounds, variants, args.new_tokens)
        config = read_llama_config(args.model)
        print(f"\n{args.model}: hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab "
              f"{config.vocab_size}; batch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
              f"{args.threads} threads, {args.rounds} rounds; torch {torch.__version__}"
              + (f", llama_cpp {result['llama_cpp']['version']}" if "llama_cpp" in result else "") + "\n",
              file=out)
        table, extra = report(summary, args)
        print(table, file=out, flush=True)
        result.update(extra)
        result["rounds"] = rounds
        result["results"] = {v: {k: x for k, x in s.items() if k != "tokens"} for v, s in summary.items()}
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
