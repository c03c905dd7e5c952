"""Two commits of gptj side by side on this machine: did a change keep the speed?

The commit `--before` runs from a git worktree (made under --work), the current tree as it is; each
cell alternates them in rounds (before, after, after, before, ...), so drift on a noisy machine falls
on both. Cells:

    latency   `gptj bench latency` decode and prefill tokens/s, batch 1 and 8, per --modes (bfloat16,
              int8, int4, w8a8), on a 2-layer bfloat16 model of GPT-J's widths (4,096 / 16,384)
    offline   `gptj mlperf --scenario Offline --mode performance` on the bundled articles (4 beams,
              30-128 new tokens, as gptj-99 runs them): LoadGen's samples per second, on a 2-layer model
              of width 1,024
    serve     benchmarks/serve_load.py against `gptj serve` at 1, 8 and 32 clients (random 128-token
              prompts, 32 new tokens each): output tokens/s, on the width-1,024 model

    python benchmarks/ab_commits.py --before 9324a2b --parts latency,offline,serve --rounds 2 --json

Each process runs with PYTHONPATH set to its tree's src/, so the same venv serves both. Writes the
models once under --work. The ratios are after / before of the medians per cell.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def tree_of(commit: str, work: Path) -> Path:
    """A worktree of `commit` under `work` (removed again by drop_tree)."""
    tree = work / f"tree-{commit}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)
    return tree


def drop_tree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)


def run(tree: Path, cmd: list[str], timeout: float = 3600) -> str:
    env = {"PYTHONPATH": str(tree / "src"), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{tree.name}: {' '.join(cmd[:6])} ...: {proc.stderr.strip().splitlines()[-3:]}")
    return proc.stdout


def latency(tree: Path, model: Path, mode: str, batch: int, threads: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "gptj.cli", "bench", "latency", "--model", str(model), "--batch-size", str(batch),
           "--prompt-len", "64", "--max-new-tokens", "16", "--threads", str(threads), "--dtype", "bfloat16", "--json"]
    if mode != "bfloat16":
        cmd += ["--quantize", mode]
    r = json.loads(run(tree, cmd).strip().splitlines()[-1])
    return {"decode_tok_s": r["decode_tok_s"], "prefill_tok_s": r["prefill_tok_s"]}


def offline(tree: Path, model: Path, threads: int, work: Path) -> dict[str, float]:
    logs = Path(tempfile.mkdtemp(dir=work, prefix="offline-"))
    run(tree, [sys.executable, "-m", "gptj.cli", "mlperf", "--model", str(model), "--scenario", "Offline", "--mode",
               "performance", "--max-examples", "8", "--min-query-count", "8", "--min-duration-ms", "0",
               "--dtype", "bfloat16", "--threads", str(threads), "--log-dir", str(logs), "--quiet"])
    summary = (logs / "mlperf_log_summary.txt").read_text()
    line = next(x for x in summary.splitlines() if x.startswith("Samples per second"))
    return {"samples_s": float(line.split(":")[1])}


def serve(tree: Path, model: Path, clients: int, threads: int) -> dict[str, float]:
    out = run(tree, [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--model", f"m={model}",
                     "--serve-args", f"--dtype bfloat16 --threads {threads} --max-batch-size 32",
                     "--dataset", "random", "--input-len", "128", "--max-tokens", "32", "--ignore-eos",
                     "--rates", "inf", "--num-prompts", str(max(8, clients * 2)), "--max-concurrency", str(clients),
                     "--json"])
    return {"output_tok_s": json.loads(out)["results"][0]["output_throughput"]}


def cells(parts: list[str], modes: list[str], batches: list[int]) -> list[tuple[str, tuple]]:
    out = []
    if "latency" in parts:
        out += [(f"latency {m} b{b}", ("latency", m, b)) for m in modes for b in batches]
    if "offline" in parts:
        out.append(("offline", ("offline",)))
    if "serve" in parts:
        out += [(f"serve c{c}", ("serve", c)) for c in (1, 8, 32)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the commit to compare against (a worktree of it is made)")
    p.add_argument("--parts", type=lambda s: s.split(","), default=["latency"])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["bfloat16", "int8", "int4", "w8a8"])
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    p.add_argument("--rounds", type=int, default=2, help="rounds per commit and cell (default 2)")
    p.add_argument("--model", type=Path, help="one model folder for every part (default: the two made under --work)")
    p.add_argument("--keep-tree", action="store_true", help="keep --before's worktree for the next run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gptj-ab")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from cpu_kinds import make_model

    args.work.mkdir(parents=True, exist_ok=True)
    wide = args.model or args.work / "w4096"
    narrow = args.model or args.work / "w1024"
    if "latency" in args.parts and not wide.exists():
        make_model(wide, 4096, 2, calibrated="w8a8" in args.modes)
    if {"offline", "serve"} & set(args.parts) and not narrow.exists():
        make_model(narrow, 1024, 2, calibrated=False)
    trees = {"before": tree_of(args.before, args.work), "after": ROOT}
    try:
        results = compare(args, trees, wide, narrow)
    finally:
        if not args.keep_tree:
            drop_tree(trees["before"])
    if args.json:
        print(json.dumps({"before": args.before, "results": results}))


def compare(args: argparse.Namespace, trees: dict[str, Path], wide: Path, narrow: Path) -> dict:
    """{cell: {figure: before, after, ratio, runs}} over the cells, rounds alternated."""
    results = {}
    for name, cell in cells(args.parts, args.modes, args.batches):
        got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for r in range(args.rounds):
            for which in (("before", "after") if r % 2 == 0 else ("after", "before")):
                tree = trees[which]
                if cell[0] == "latency":
                    got[which].append(latency(tree, wide, cell[1], cell[2], args.threads))
                elif cell[0] == "offline":
                    got[which].append(offline(tree, narrow, args.threads, args.work))
                else:
                    got[which].append(serve(tree, narrow, cell[1], args.threads))
        row = {}
        for key in got["before"][0]:
            b = statistics.median(x[key] for x in got["before"])
            a = statistics.median(x[key] for x in got["after"])
            row[key] = {"before": round(b, 2), "after": round(a, 2), "ratio": round(a / b, 3),
                        "runs": {w: [round(x[key], 2) for x in got[w]] for w in got}}
        results[name] = row
        print(f"{name}: " + "  ".join(f"{k} {v['before']} -> {v['after']} ({v['ratio']}x)" for k, v in row.items()),
              file=sys.stderr, flush=True)
    return results


if __name__ == "__main__":
    main()
