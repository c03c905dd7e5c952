"""Does it matter which thread loads the model and which runs the engine?

Runs the same Offline-style job (the bundled MLPerf prompts, greedy, N new tokens, all submitted
at once) in three layouts, each in a fresh subprocess, alternating, R rounds:

    main     load, warm up and run on the main thread (what `gptj generate` does)
    same     load, warm up and run on one worker thread (EngineLoop(build), the server since issue 5)
    cross    load on the main thread, warm up and run on a worker thread (the server before)
    released the same, the main thread's OpenMP team let go before the run (gptj.threads.
             release_openmp_threads: what EngineLoop(engine) does with an engine built on its caller)

and prints output tokens/s of each and the ratios to `main`.

    python benchmarks/engine_thread.py --model /tmp/gptj-02b --dtype bfloat16 --rounds 2
    python benchmarks/engine_thread.py --model /tmp/tiny --smoke --json   # one round, a few tokens: does it run?
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)


def job(model: str, dtype: str, layout: str, n_prompts: int, new_tokens: int, batch: int) -> float:
    from gptj.decode import GenerationConfig
    from gptj.engine import Engine
    from gptj.engine.config import EngineConfig
    from gptj.mlperf.dataset import Dataset
    from gptj.runtime.build import build_engine, load_model
    from gptj.runtime.spec import ModelSpec
    from gptj.tokenizer import load_tokenizer

    ids = [list(p) for p in Dataset.load(None, tokenizer=load_tokenizer()).input_ids]
    prompts = (ids * (n_prompts // len(ids) + 1))[:n_prompts]
    gen = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=None)
    result: dict[str, float] = {}

    def build() -> Engine:
        model = load_model(ModelSpec(path=model_dir, dtype=dtype))
        return build_engine(model, EngineConfig(max_seqs=batch, max_len=max(map(len, prompts)) + new_tokens))

    def run(engine: Engine) -> None:
        engine.generate(prompts[:1], gen)  # warm-up
        start = time.perf_counter()
        out = engine.generate(prompts, gen)
        result["tok_s"] = sum(map(len, out)) / (time.perf_counter() - start)

    model_dir = model
    if layout == "main":
        run(build())
    elif layout == "same":
        t = threading.Thread(target=lambda: run(build()))
        t.start()
        t.join()
    else:
        engine = build()
        if layout == "released":
            from gptj.threads import release_openmp_threads

            release_openmp_threads()
        t = threading.Thread(target=lambda: run(engine))
        t.start()
        t.join()
    return result["tok_s"]


SMOKE = dict(rounds=1, prompts=2, new_tokens=4, batch=2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one layout, print JSON
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (the lines go to stderr)")
    args = _smoke.parse_args(ap, SMOKE, argv)
    log = sys.stderr if args.json else sys.stdout
    if args.one:
        print(json.dumps(job(args.model, args.dtype, args.one, args.prompts, args.new_tokens, args.batch)))
        return 0
    results: dict[str, list[float]] = {"main": [], "same": [], "cross": [], "released": []}
    for _ in range(args.rounds):
        for layout in results:
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--dtype", args.dtype, "--one",
                                  layout, "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
                                  "--batch", str(args.batch)], capture_output=True, text=True, check=True)
            results[layout].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(results["main"])
    print(f"{args.prompts} prompts x {args.new_tokens} new tokens, batch {args.batch}, {args.dtype}, "
          f"{args.rounds} rounds (median)", file=log)
    for layout, values in results.items():
        med = statistics.median(values)
        print(f"  {layout:8s}  {med:7.1f} tok/s  {med / base:5.2f}x main   runs: "
              + ", ".join(f"{v:.1f}" for v in values), file=log)
    if args.json:
        print(json.dumps({"prompts": args.prompts, "new_tokens": args.new_tokens, "batch": args.batch,
                          "dtype": args.dtype, "rounds": args.rounds,
                          "layouts": {layout: {"tok_s": statistics.median(v), "over_main": statistics.median(v) / base,
                                               "runs": v} for layout, v in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
