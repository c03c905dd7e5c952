"""gptj against its peers on the same weights, in one process: HF transformers and CTranslate2.

    gptj   the engine (what `gptj generate` and the MLPerf SUT run): float32, bfloat16, and
           int8 / int4 / W4A8 / W8A8 weights when gptj.quant is present
    hf     transformers' GPTJForCausalLM.generate, float32 and bfloat16: the MLPerf reference's
           backend, loaded from the same folder with from_pretrained (public API only)
    ct2    CTranslate2's Generator, int8 and float32 (CPU has no bfloat16 in CTranslate2); the
           model converted from the same folder with its TransformersConverter

Two measurements, implementations alternated within every round so machine noise hits all alike:

    decode   B random prompts of --prompt-len tokens, greedy, exactly --new-tokens new tokens
             (no EOS); each implementation is timed generating 1 and N tokens, and decode tok/s
             = B * (N - 1) / (median t_N - median t_1), which removes prefill from the figure
    offline  MLPerf gptj-99's shape: the first --offline-samples prompts of the bundled CNN-DM
             sample set (200-900 tokens), beam 4, 30 to 128 new tokens, early stopping, EOS on.
             gptj: all samples admitted to the engine together (the SUT's Offline batch);
             hf: one sample at a time, as the reference's backend; ct2: generate_batch with
             beam_size 4, max_batch_size --ct2-offline-batch (default 1; CTranslate2 sorts by length and
             batches itself; within a batch it forwards the shortest prompt's length at once and
             feeds the rest of longer prompts one token per step, so mixed lengths cost it steps).
             Each implementation first generates 2 tokens for one sample, not timed (first calls).

CTranslate2's Generator is loaded before each timed call and deleted after it, untimed: alive, its
worker thread's OpenMP team slowed every parallel region of torch and gptj.native (ct2_impl).

Models have random weights (`random_state_dict(std=0.02)`), written once under --work-dir:

    0.2b   n_embd 1024, 8 layers, 16 heads, rotary 64, vocab 50400   (0.20B params)
    wide   n_embd 4096, 2 layers, 16 heads, rotary 64, vocab 50400   (GPT-J 6B's width; 0.81B)

    python benchmarks/compare_peers.py --models 0.2b,wide --modes decode,offline
    python benchmarks/compare_peers.py --quick            # fewer tokens, samples and repeats
    python benchmarks/compare_peers.py --smoke --json     # the tiny model, a few tokens: does it run?
    python benchmarks/compare_peers.py --models 0.2b --modes decode --batch-sizes 1 --background 0,2
                                                          # quiet, then beside two busy processes

Peers that are not installed (`pip install 'gptj[bench]'` brings them) are skipped with a one-line
note; so are gptj's quantized variants when `load_model` takes no `quantize` argument. A decode
figure is left out ("-", null) when noise makes N tokens take no longer than 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptj.bench.latency import engine_config, make_engine, random_prompts, weight_bytes_per_step
from gptj.config import GPTJConfig, get_preset
from gptj.decode import EOS_TOKEN_ID, GenerationConfig
from gptj.engine import Engine, EngineConfig
from gptj.errors import GptjError
from gptj.runtime.build import build_engine
from gptj.models.gptj import build_model, count_parameters
from gptj.weights.io import load_model, random_state_dict, save_checkpoint

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)

MODELS = {
    "0.2b": GPTJConfig(n_embd=1024, n_layer=8, n_head=16, rotary_dim=64),
    "wide": GPTJConfig(n_embd=4096, n_layer=2, n_head=16, rotary_dim=64),
    "tiny": get_preset("tiny"),  # a smoke test of this script, not a benchmark
}
ALL_VARIANTS = ("gptj-fp32", "gptj-bf16", "gptj-int8", "gptj-int4", "gptj-w4a8", "gptj-w8a8", "hf-fp32", "hf-bf16",
                "ct2-int8", "ct2-fp32")
QUANTIZED = ("int8", "int4", "w4a8", "w8a8")  # gptj's kinds loaded with --quantize (in bfloat16)
CALIBRATION_SAMPLES = 8  # gptj-w8a8: the model folder is calibrated once, on the bundled set's first prompts
MLPERF = GenerationConfig.mlperf()  # beam 4, 30..128 new tokens, early stopping, EOS 50256
# gptj's engine as its commands run it without --threads: compute threads chosen from its step times
# (EngineConfig.adapt_threads); --fixed-threads keeps --threads for every step
ASKED = EngineConfig(adapt_threads=True)


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# --- implementations --------------------------------------------------------------------------


@dataclass
class Impl:
    name: str
    decode: Callable[[list[list[int]], int], list[list[int]]]
    offline: Callable[[list[list[int]], GenerationConfig], list[list[int]]]
    weight_bytes: int  # per batch-1 decode step
    close: Callable[[], None] = field(default=lambda: None)
    # untimed, around every call of decode and offline: ready() makes what the call needs, idle() lets go of
    # what would slow the others between calls (CTranslate2's threads: see ct2_impl)
    ready: Callable[[], None] = field(default=lambda: None)
    idle: Callable[[], None] = field(default=lambda: None)


def gptj_impl(name: str, model: torch.nn.Module, reload: Callable[[], torch.nn.Module]) -> Impl:
    """gptj's engine on `model`. An engine packs the model's linears for its own rows per step, once
    (gptj.policy.pack_layout: the native GEMV's layout up to 4 rows, oneDNN's above, on CPUs with
    bfloat16 arithmetic), so an engine of other rows than the model's first gets a fresh copy
    (`reload`), as a server of that batch size would have: otherwise batch 8 after batch 1 ran on
    batch 1's layout (0.70x the tok/s on an AMX Xeon)."""
    engines: dict[tuple[int, int], Engine] = {}
    held = {"model": model, "rows": None}

    def model_for(rows: int) -> torch.nn.Module:
        if held["rows"] not in (None, rows):
            engines.clear()
            held["model"] = None
            gc.collect()
            held["model"] = reload()
        held["rows"] = rows
        return held["model"]

    def decode(prompts: list[list[int]], n: int) -> list[list[int]]:
        key = (len(prompts), len(prompts[0]) + n)
        if key not in engines:
            m = model_for(len(prompts))
            engines.clear()
            engines[key] = make_engine(m, len(prompts), len(prompts[0]), n, asked=ASKED)
        gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, eos_token_id=None)
        return engines[key].generate(prompts, gen)

    def offline(prompts: list[list[int]], gen: GenerationConfig) -> list[list[int]]:
        m = model_for(len(prompts) * gen.num_beams)
        engines.clear()
        # The SUT's Offline batch: every sample's beams in KV at once, all prompts admitted together.
        engine = build_engine(m, dataclasses.replace(
            engine_config(len(prompts), max(map(len, prompts)), gen.max_new_tokens, gen.num_beams, asked=ASKED),
            max_prefill_tokens=sum(map(len, prompts))))
        return engine.generate(prompts, gen)

    threads = torch.get_num_threads()  # --threads: what the peers after it compute with
    # its engine may have moved this thread to fewer threads (EngineConfig.adapt_threads): give the
    # peers theirs back after each call
    return Impl(name, decode, offline, weight_bytes_per_step(model, 1), idle=lambda: torch.set_num_threads(threads))


def hf_impl(name: str, model_dir: Path, dtype: torch.dtype, gptj_model: torch.nn.Module) -> Impl:
    """transformers' GPTJForCausalLM loaded from the same folder with its public from_pretrained, in
    `dtype` (a second copy of the weights: loaded as transformers' version loads them, float32 or as
    stored, then cast, which is exact and works alike on transformers 4.x and 5.x); gptj_model, the
    same weights in the same dtype, checks its logits."""
    import transformers

    hf = transformers.GPTJForCausalLM.from_pretrained(str(model_dir)).to(dtype).eval()
    with torch.inference_mode():  # same weights, same math: logits must agree
        ids = torch.tensor([[464, 2068, 7586, 21831]])
        diff = (hf(ids).logits.float() - gptj_model(ids).float()).abs().max().item()
    tol = 1e-3 if dtype == torch.float32 else 0.1
    if diff > tol:
        raise RuntimeError(f"HF and gptj logits differ by {diff} on the same weights")

    @torch.inference_mode()
    def generate(prompts: list[list[int]], gen: GenerationConfig) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[gen.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        beams = dict(num_beams=gen.num_beams, early_stopping=gen.early_stopping) if gen.num_beams > 1 else {}
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=gen.max_new_tokens,
                          min_new_tokens=gen.min_new_tokens, do_sample=False, pad_token_id=gen.pad_token_id,
                          eos_token_id=gen.eos_token_id, **beams)
        return out[:, width:].tolist()

    def decode(prompts: list[list[int]], n: int) -> list[list[int]]:
        return generate(prompts, GenerationConfig(max_new_tokens=n, min_new_tokens=n, eos_token_id=None))

    def offline(prompts: list[list[int]], gen: GenerationConfig) -> list[list[int]]:
        # The reference's backend: one query at a time through model.generate.
        rows = [generate([p], gen)[0] for p in prompts]
        return [r[: r.index(EOS_TOKEN_ID) + 1] if EOS_TOKEN_ID in r else r for r in rows]

    return Impl(name, decode, offline, weight_bytes_per_step(gptj_model, 1))


def ct2_dir(model_dir: Path, work: Path, quantization: str) -> Path:
    import ctranslate2

    out = work / f"ct2-{quantization}"
    if not (out / "model.bin").is_file():
        note(f"converting {model_dir} for CTranslate2 ({quantization}) -> {out}")
        ctranslate2.converters.TransformersConverter(str(model_dir)).convert(
            str(out), quantization=quantization, force=True)
    return out


def ct2_impl(name: str, model_dir: Path, work: Path, compute_type: str, threads: int,
             offline_batch: int = 1) -> Impl:
    """CTranslate2's Generator, loaded before each timed call and deleted after it (untimed). Its worker
    thread runs OpenMP regions on the same libgomp as torch; while that thread lives, libgomp counts its
    team beside torch's, finds more threads than cores, and lets every team spin only briefly before
    sleeping, so each of torch's and gptj.native's parallel regions pays a wake-up: kept alive between
    calls, it slowed gptj's batch-1 decode by 13-40 % and HF's by up to 45 % (docs/PERFORMANCE.md,
    "Which thread runs the engine"). Deleting it ends the thread and its team."""
    import ctranslate2

    path = ct2_dir(model_dir, work, "int8" if compute_type == "int8" else "float32")
    held: dict[str, ctranslate2.Generator] = {}

    def ready() -> None:
        if "gen" not in held:
            held["gen"] = ctranslate2.Generator(str(path), device="cpu", compute_type=compute_type,
                                                inter_threads=1, intra_threads=threads)

    def idle() -> None:
        held.pop("gen", None)
        gc.collect()

    vocab = json.loads((path / "vocabulary.json").read_text(encoding="utf-8"))

    def tokens(prompts: list[list[int]]) -> list[list[str]]:
        return [[vocab[t] for t in p] for p in prompts]

    def decode(prompts: list[list[int]], n: int) -> list[list[int]]:
        res = held["gen"].generate_batch(tokens(prompts), max_length=n, min_length=n, beam_size=1,
                                         include_prompt_in_result=False)
        return [r.sequences_ids[0] for r in res]

    def offline(prompts: list[list[int]], cfg: GenerationConfig) -> list[list[int]]:
        res = held["gen"].generate_batch(tokens(prompts), beam_size=cfg.num_beams, min_length=cfg.min_new_tokens,
                                         max_length=cfg.max_new_tokens, length_penalty=cfg.length_penalty,
                                         end_token=[EOS_TOKEN_ID], return_end_token=True,
                                         include_prompt_in_result=False, max_batch_size=offline_batch)
        return [r.sequences_ids[0] for r in res]

    size = sum(f.stat().st_size for f in path.iterdir() if f.name == "model.bin")
    cfg = json.loads((model_dir / "config.json").read_text())
    wte = cfg["vocab_size"] * cfg["n_embd"] * (1 if compute_type == "int8" else 4)
    return Impl(name, decode, offline, max(size - wte, 0), close=idle, ready=ready, idle=idle)


# --- measurement ------------------------------------------------------------------------------


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_decode(impls: list[Impl], batch: int, prompt_len: int, new_tokens: int, warmup: int,
               repeats: int, vocab: int) -> dict[str, dict]:
    prompts = random_prompts(batch, prompt_len, vocab, seed=batch)
    times: dict[str, dict[int, list[float]]] = {i.name: {1: [], new_tokens: []} for i in impls}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(warmup + repeats):
        order = impls if r % 2 == 0 else impls[::-1]
        for impl in order:
            for n in (1, new_tokens):
                impl.ready()
                t, out = timed(lambda: impl.decode(prompts, n))
                impl.idle()
                if n == new_tokens:
                    outputs[impl.name] = out
                    if any(len(o) != n for o in out):
                        raise RuntimeError(f"{impl.name}: expected {n} new tokens, got {[len(o) for o in out]}")
                if r >= warmup:
                    times[impl.name][n].append(t)
    result = {}
    for impl in impls:
        t1, tn = statistics.median(times[impl.name][1]), statistics.median(times[impl.name][new_tokens])
        if tn <= t1:  # noise larger than the decode time: no figure rather than a huge one
            note(f"{impl.name} batch {batch}: {new_tokens} tokens took no longer than 1 ({tn:.4f} s <= {t1:.4f} s); "
                 "no decode tok/s (more --new-tokens or --repeats)")
        result[impl.name] = {"decode_tok_s": batch * (new_tokens - 1) / (tn - t1) if tn > t1 else None,
                             "first_token_s": t1, "total_s": tn, "tokens": outputs[impl.name]}
    return result


def run_offline(impls: list[Impl], prompts: list[list[int]], gen: GenerationConfig, rounds: int) -> dict[str, dict]:
    times: dict[str, list[float]] = {i.name: [] for i in impls}
    outputs: dict[str, list[list[int]]] = {}
    warm = dataclasses.replace(gen, max_new_tokens=2, min_new_tokens=2)
    for impl in impls:  # first-call costs (kernel builds, allocations) out of the way, not counted
        impl.ready()
        impl.offline(prompts[:1], warm)
        impl.idle()
    for r in range(rounds):
        for impl in impls if r % 2 == 0 else impls[::-1]:
            impl.ready()
            t, out = timed(lambda: impl.offline(prompts, gen))
            impl.idle()
            times[impl.name].append(t)
            outputs[impl.name] = out
            note(f"offline {impl.name}: {t:.1f} s, {sum(map(len, out))} new tokens")
    result = {}
    for impl in impls:
        t = statistics.median(times[impl.name])
        n_tok = sum(map(len, outputs[impl.name]))
        result[impl.name] = {"samples_s": len(prompts) / t, "tok_s": n_tok / t, "seconds": t, "new_tokens": n_tok,
                             "tokens": outputs[impl.name]}
    return result


# --- setup and report -------------------------------------------------------------------------


def prepare_model(name: str, work: Path) -> Path:
    path = work / name / "hf"
    if not (path / "config.json").is_file():
        cfg = MODELS[name]
        note(f"writing {name} random weights -> {path}")
        save_checkpoint(random_state_dict(cfg, seed=0, std=0.02), cfg, path, overwrite=True)
    return path


PEER_MODULES = {"hf": ("transformers", "pip install transformers"),
                "ct2": ("ctranslate2", "pip install ctranslate2")}


def missing_peer(family: str) -> str | None:
    """A one-line note when the peer `family` cannot be imported here, else None."""
    if family not in PEER_MODULES:
        return None
    module, install = PEER_MODULES[family]
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"{module} is not installed ({install}, or pip install 'gptj[bench]'): {e}"
    return None


def calibrate_folder(model_dir: Path) -> None:
    """W8A8's smoothing factors for a benchmark model, from the bundled set's first prompts (gptj calibrate)."""
    from gptj.mlperf.dataset import Dataset
    from gptj.weights.io import calibrate

    data = Dataset.load(max_examples=CALIBRATION_SAMPLES)
    note(f"calibrating {model_dir} for w8a8 on {len(data)} prompts of {data.path.name}")
    calibrate(model_dir, data.input_ids, data.path.name, dtype=torch.bfloat16)


def build_impls(variants: Sequence[str], model_dir: Path, work: Path, threads: int,
                ct2_offline_batch: int = 1) -> list[Impl]:
    has_quant = "quantize" in inspect.signature(load_model).parameters
    impls: list[Impl] = []
    gptj_models: dict[str, torch.nn.Module] = {}  # hf-X checks its logits against gptj-X

    def load_gptj(kind: str) -> torch.nn.Module:
        dtype = torch.bfloat16 if kind == "bf16" or kind in QUANTIZED else torch.float32
        kwargs = {"quantize": kind} if kind in QUANTIZED else {}
        if kind == "w8a8" and not json.loads((model_dir / "config.json").read_text()).get("calibration"):
            calibrate_folder(model_dir)
        return load_model(model_dir, dtype=dtype, **kwargs)

    def gptj_model(kind: str) -> torch.nn.Module:
        if kind not in gptj_models:
            gptj_models[kind] = load_gptj(kind)
        return gptj_models[kind]

    for v in variants:
        family, kind = v.split("-")
        if why := missing_peer(family):
            note(f"skipping {v}: {why}")
            continue
        try:
            if family == "gptj":
                if kind in QUANTIZED and not has_quant:
                    note(f"skipping {v}: load_model takes no quantize argument (gptj.quant not present)")
                    continue
                impl = gptj_impl(v, gptj_model(kind), functools.partial(load_gptj, kind))
            elif family == "hf":
                impl = hf_impl(v, model_dir, torch.bfloat16 if kind == "bf16" else torch.float32, gptj_model(kind))
            elif family == "ct2":
                impl = ct2_impl(v, model_dir, work / model_dir.parent.name, kind.replace("fp32", "float32"), threads,
                                ct2_offline_batch)
            else:
                raise ValueError(v)
        except GptjError as e:
            note(f"skipping {v}: {e}")
            continue
        impls.append(impl)
    return impls


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}×"


def report(model: str, cfg: GPTJConfig, impls: list[Impl], decode: dict[int, dict], offline: dict | None,
           args: argparse.Namespace, bandwidth: float | None) -> str:
    names = [i.name for i in impls]
    params = count_parameters(build_model(cfg, device="meta"))
    lines = [f"### {model}: n_embd {cfg.n_embd}, {cfg.n_layer} layers, {cfg.n_head} heads, "
             f"{params / 1e9:.2f}B params", ""]
    head = ["impl", "weights MB/token"]
    if bandwidth:
        head.append(f"roofline tok/s @ {bandwidth:.0f} GB/s")
    for b in decode:
        head.append(f"batch {b} decode tok/s")
    if offline:
        head += ["offline samples/s", "offline new tok"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for impl in impls:
        row = [impl.name, f"{impl.weight_bytes / 1e6:.0f}"]
        if bandwidth:
            row.append(f"{bandwidth * 1e9 / impl.weight_bytes:.1f}")
        row += [_fmt(decode[b][impl.name]["decode_tok_s"]) for b in decode]
        if offline:
            row += [_fmt(offline[impl.name]["samples_s"], 3), str(offline[impl.name]["new_tokens"])]
        lines.append("| " + " | ".join(row) + " |")
    ours = [n for n in names if n.startswith("gptj")]
    peers = [n for n in names if not n.startswith("gptj")]
    if ours and peers:
        lines += ["", "Ratios gptj / peer (> 1: gptj faster):", ""]
        cols = [f"{p} b{b}" for p in peers for b in decode] + ([f"{p} offline" for p in peers] if offline else [])
        lines += ["| gptj \\ peer | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
        for o in ours:
            row = [o]
            for p in peers:
                row += [_ratio(decode[b][o]["decode_tok_s"], decode[b][p]["decode_tok_s"]) for b in decode]
            if offline:
                row += [f"{offline[o]['samples_s'] / offline[p]['samples_s']:.2f}×" for p in peers]
            lines.append("| " + " | ".join(row) + " |")
    agree = [f"{pair}: {'identical' if same else 'differ'}" for pair, same in agreement(decode, offline).items()]
    if agree:
        lines += ["", "Greedy/beam tokens: " + "; ".join(agree) + "."]
    return "\n".join(lines)


def agreement(decode: dict[int, dict], offline: dict | None) -> dict[str, bool]:
    """"A vs B batch N" / "A vs B offline" -> whether the two produced the same tokens."""
    same = {}
    for b in decode:
        for a, c in (("gptj-fp32", "hf-fp32"), ("gptj-fp32", "ct2-fp32"), ("gptj-bf16", "hf-bf16")):
            if a in decode[b] and c in decode[b]:
                same[f"{a} vs {c} batch {b}"] = decode[b][a]["tokens"] == decode[b][c]["tokens"]
    for a, c in (("gptj-fp32", "hf-fp32"), ("gptj-fp32", "ct2-fp32")):
        if offline and a in offline and c in offline:
            same[f"{a} vs {c} offline"] = offline[a]["tokens"] == offline[c]["tokens"]
    return same


SMOKE = dict(models="tiny", batch_sizes="1,2", prompt_len=8, new_tokens=4, warmup=0, repeats=1, offline_samples=1,
             offline_new_tokens=8, membw_gb=0.05)


def start_busy(n: int) -> list:
    """n processes that spin on the CPU until stopped: other work sharing the cores."""
    import atexit
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    atexit.register(stop_busy, procs)  # (an error or Ctrl-C on the way leaves none spinning)
    return procs


def stop_busy(procs: list) -> None:
    for p in procs:
        p.kill()
        p.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="0.2b,wide", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--modes", default="decode,offline", help="comma-separated, of decode and offline (default both)")
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS), help=f"of {', '.join(ALL_VARIANTS)}")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, help="default 64 (--quick: 32)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, help="default 3 (--quick: 1)")
    ap.add_argument("--offline-samples", type=int, help="default 8 (--quick: 4)")
    ap.add_argument("--offline-rounds", type=int, default=1)
    ap.add_argument("--offline-new-tokens", type=int, default=MLPERF.max_new_tokens,
                    help=f"offline's most new tokens (default {MLPERF.max_new_tokens}, MLPerf's; at least "
                         f"min({MLPERF.min_new_tokens}, this))")
    ap.add_argument("--ct2-offline-batch", type=int, default=1,
                    help="CTranslate2's max_batch_size for offline (default 1, one sample at a time: its fastest "
                         "on mixed prompt lengths, measured 4.6x its batch of 8 on the 0.2b model's 8 samples)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bandwidth", type=float, help="GB/s for the roofline column (default: measure it)")
    ap.add_argument("--membw-gb", type=float, default=1.0, help="buffer for measuring the bandwidth (default 1 GB)")
    ap.add_argument("--work-dir", default=os.environ.get("GPTJ_BENCH_DIR", "/tmp/gptj-peers"))
    ap.add_argument("--json-out", help="also write all figures (without tokens) to this file")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (tables to stderr)")
    ap.add_argument("--quick", action="store_true", help="32 new tokens, 1 repeat, 4 offline samples")
    ap.add_argument("--background", default="0",
                    help="busy processes beside the measurement, one run per value (e.g. 0,2: quiet, then two "
                         "processes spinning on the cores, as a shared machine has)")
    ap.add_argument("--fixed-threads", action="store_true",
                    help="gptj computes with --threads at every step (default: as its commands without --threads, "
                         "choosing its threads from its step times)")
    args = _smoke.parse_args(ap, SMOKE, argv)
    for name, full, quick in (("new_tokens", 64, 32), ("repeats", 3, 1), ("offline_samples", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    out = sys.stderr if args.json else sys.stdout

    torch.set_num_threads(args.threads)
    global ASKED
    if args.fixed_threads:
        ASKED = EngineConfig()
    try:
        levels = [int(n) for n in args.background.split(",")]
        assert levels and min(levels) >= 0
    except (ValueError, AssertionError):
        ap.error(f"--background takes counts of busy processes, e.g. 0,2; got {args.background!r}")
    work = Path(args.work_dir)
    modes = {m for m in args.modes.split(",") if m}
    if not modes or modes - {"decode", "offline"}:
        ap.error(f"--modes takes decode, offline or decode,offline; got {args.modes!r}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in ALL_VARIANTS:
            ap.error(f"unknown variant {v!r}")
    for model in args.models.split(","):
        if model not in MODELS:
            ap.error(f"unknown model {model!r} (choose from {', '.join(MODELS)})")
    if args.offline_new_tokens < 1:
        ap.error("--offline-new-tokens must be >= 1")
    offline_gen = dataclasses.replace(MLPERF, max_new_tokens=args.offline_new_tokens,
                                      min_new_tokens=min(MLPERF.min_new_tokens, args.offline_new_tokens))
    bandwidth = args.bandwidth
    if bandwidth is None:
        sys.path.insert(0, str(Path(__file__).parent))
        import membw

        bandwidth = membw.measure(gb=args.membw_gb, threads=args.threads, repeats=3)["sum"]["median_gb_s"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, read bandwidth {bandwidth:.1f} GB/s; "
          f"decode: prompt {args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeats} "
          f"after {args.warmup} warm-up; offline: {args.offline_samples} samples, beam {offline_gen.num_beams}, "
          f"{offline_gen.min_new_tokens}..{offline_gen.max_new_tokens} new tokens, {args.offline_rounds} round(s)\n",
          file=out, flush=True)

    everything = {}
    for model, load in [(m, n) for m in args.models.split(",") for n in levels]:
        cfg = MODELS[model]
        model_dir = prepare_model(model, work)
        impls = build_impls(variants, model_dir, work, args.threads, args.ct2_offline_batch)
        busy = start_busy(load)
        if load:
            note(f"{model}: beside {load} busy process(es)")
        decode: dict[int, dict] = {}
        if "decode" in modes:
            for b in batch_sizes:
                note(f"{model}: decode batch {b}")
                decode[b] = run_decode(impls, b, args.prompt_len, args.new_tokens, args.warmup, args.repeats,
                                       cfg.vocab_size)
        offline = None
        if "offline" in modes:
            from gptj.mlperf.dataset import Dataset

            prompts = Dataset.load(max_examples=args.offline_samples).input_ids
            note(f"{model}: offline, prompts of {[len(p) for p in prompts]} tokens")
            offline = run_offline(impls, prompts, offline_gen, args.offline_rounds)
        stop_busy(busy)
        title = model if load == 0 else f"{model}, beside {load} busy process(es)"
        print(report(title, cfg, impls, decode, offline, args, bandwidth), file=out, flush=True)
        print(f"\n(load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())})\n", file=out, flush=True)
        everything[model if levels == [0] else f"{model}@{load}busy"] = {
            "decode": {b: {n: {k: v for k, v in r.items() if k != "tokens"} for n, r in d.items()}
                       for b, d in decode.items()},
            "offline": {n: {k: v for k, v in r.items() if k != "tokens"} for n, r in (offline or {}).items()},
            "weight_bytes": {i.name: i.weight_bytes for i in impls},
            "identical_tokens": agreement(decode, offline),
        }
        for impl in impls:
            impl.close()
        del impls
        gc.collect()
    result = {"bandwidth_gb_s": bandwidth, "args": vars(args), "results": everything}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
