"""The results bundle of one run: run.json, system.json, accuracy.json, latency.png, summary.md."""

from __future__ import annotations

import dataclasses
import io
import math
import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import gptj
from gptj.files import atomic_write_bytes, atomic_write_json, atomic_write_text

if TYPE_CHECKING:
    from gptj.mlperf.dataset import Dataset
    from gptj.mlperf.config import MLPerfConfig, RunResult

# The headline metric of each scenario, as LoadGen's summary names it.
METRIC_KEYS = {
    "Offline": "Samples per second",
    "Server": "Completed samples per second",
    "SingleStream": "90.0th percentile latency (ns)",
}


def accuracy_report(accuracy) -> str:  # noqa: ANN001 - an EvaluationResult or a LlamaEvaluation
    """The accuracy run's scores as `gptj evaluate` prints them (gptj-99's or llama3.1-8b's)."""
    from gptj.mlperf import evaluate, evaluate_llama

    if isinstance(accuracy, evaluate_llama.LlamaEvaluation):
        return evaluate_llama.format_report(accuracy)
    return evaluate.format_report(accuracy)


def _accuracy_line(accuracy) -> str:  # noqa: ANN001 - as accuracy_report's
    """What an MLPerf submission's accuracy.txt holds: the reference evaluation's result line."""
    from gptj.mlperf import evaluate, evaluate_llama

    if isinstance(accuracy, evaluate_llama.LlamaEvaluation):
        return evaluate_llama.accuracy_line(accuracy)
    return evaluate.accuracy_line(accuracy)


def notes_for(cfg: MLPerfConfig, model_dir: Path | None, differences: list[str]) -> list[str]:
    """What a reader must know to interpret the numbers."""
    notes = _speculation_notes(cfg)
    if cfg.llama:
        return notes + _llama_notes(cfg, model_dir, differences)
    try:
        from gptj.config import GPTJConfig

        if model_dir is None:  # a remote server's model: nothing here to look at
            raise FileNotFoundError
        config = GPTJConfig.from_json_file(model_dir / "config.json")
        if config.n_layer != 28 or config.n_embd != 4096:
            notes.append(f"the model is not GPT-J 6B ({config.n_layer} layers, n_embd {config.n_embd}): "
                         "demo weights, scores are not meaningful (real weights cannot be downloaded here)")
    except Exception:  # noqa: BLE001 - a slim checkpoint has no config.json; nothing to note
        pass
    if differences:
        notes.append("not the official gptj-99 generation settings: " + ", ".join(differences))
    if cfg.dataset is None:
        notes.append("dataset: gptj's bundled sample set, not CNN-DailyMail's 13,368-sample cnn_eval.json")
    if cfg.max_examples is not None:
        notes.append(f"dataset limited to the first {cfg.max_examples} examples")
    return notes


def _speculation_notes(cfg: MLPerfConfig) -> list[str]:
    """What --speculate means for this run: the open division's, and nothing at all under beam search."""
    gen = cfg.gen
    if not gen.prompt_lookup_num_tokens:
        return []
    if not gen.speculates:
        return [f"--speculate changes nothing here: {gen.method} requests are not drafted for "
                "(greedy and sampled ones without penalties are)"]
    return [f"speculative decoding (prompt lookup: up to {gen.prompt_lookup_num_tokens} tokens drafted from "
            f"n-grams of up to {gen.max_matching_ngram_size}): for MLPerf's open division only (the closed "
            "division forbids it)"]


def _llama_notes(cfg: MLPerfConfig, model_dir: Path | None, differences: list[str]) -> list[str]:
    """notes_for a llama3.1-8b run."""
    from gptj.mlperf.rules import llama_accuracy

    notes = []
    try:
        import json

        c = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        if (c.get("num_hidden_layers"), c.get("hidden_size"), c.get("vocab_size")) != (32, 4096, 128256):
            notes.append(f"the model is not Llama-3.1-8B ({c.get('num_hidden_layers')} layers, hidden size "
                         f"{c.get('hidden_size')}): demo weights, scores are not meaningful")
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    if differences:
        notes.append(f"not the official {cfg.benchmark} generation settings: " + ", ".join(differences))
    if cfg.dataset is None:
        size = llama_accuracy(cfg.benchmark).dataset_size
        notes.append(f"dataset: gptj's bundled llama stand-in, not MLCommons' {size:,}-sample {cfg.benchmark} data set")
    if cfg.max_examples is not None:
        notes.append(f"dataset limited to the first {cfg.max_examples} examples")
    return notes


# What LoadGen's detail log says of token latencies (use_token_latencies), in ns.
_TOKEN_KEYS = {"ttft_p99": "result_first_token_99.00_percentile_latency_ns",
               "ttft_mean": "result_first_token_mean_latency_ns",
               "tpot_p99": "result_time_per_output_token_99.00_percentile_ns",
               "tpot_mean": "result_time_to_output_token_mean",
               "ttft_limit": "requested_server_ttft_latency", "tpot_limit": "requested_server_tpot_latency",
               "tokens_per_s": "result_completed_tokens_per_second"}


def token_latencies(log_dir: Path) -> dict[str, float]:
    """TTFT and TPOT (p99, mean; ns) and their Server limits from mlperf_log_detail.txt's :::MLLOG records
    (empty: no token latencies logged)."""
    import json

    wanted = {v: k for k, v in _TOKEN_KEYS.items()}
    out: dict[str, float] = {}
    path = log_dir / "mlperf_log_detail.txt"
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(":::MLLOG") and any(k in line for k in wanted):
            try:
                record = json.loads(line[len(":::MLLOG"):])
            except ValueError:
                continue
            if record.get("key") in wanted and isinstance(record.get("value"), int | float):
                out[wanted[record["key"]]] = record["value"]
    return out


def token_latency_lines(cfg: MLPerfConfig, tokens: dict[str, float]) -> list[str]:
    """summary.md's TTFT / TPOT section: p99 and mean, against the scenario's limits (Server,
    Interactive: p99 TTFT and TPOT; LoadGen's performance constraints)."""
    from gptj.mlperf.rules import TOKEN_LATENCY_LIMITS_MS

    if not tokens:
        return []
    limits = TOKEN_LATENCY_LIMITS_MS.get((cfg.benchmark, cfg.scenario_name), {})
    lines = ["## Token latencies (LoadGen)", ""]
    for key, label in (("ttft", "TTFT (time to first token)"), ("tpot", "TPOT (time per output token)")):
        p99, mean = tokens.get(f"{key}_p99"), tokens.get(f"{key}_mean")
        if p99 is None:
            continue
        text = f"- {label}: p99 {p99 / 1e6:,.1f} ms, mean {mean / 1e6:,.1f} ms" if mean is not None else \
            f"- {label}: p99 {p99 / 1e6:,.1f} ms"
        limit = limits.get(key)
        if limit is not None:
            text += f"; limit p99 {limit:,} ms: {'met' if p99 <= limit * 1e6 else 'NOT MET'}"
        lines.append(text)
    if not limits:
        lines.append(f"- {cfg.scenario_name} has no token latency limit (Server: TTFT 2,000 ms / TPOT 100 ms; "
                     "Interactive: 500 / 30 ms, p99)")
    return lines + [""]


def parse_loadgen_summary(path: Path) -> dict[str, str]:
    """The fields of mlperf_log_summary.txt ("key : value" lines), plus result_line and metric."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    early: list[str] | None = None  # the "Early Stopping Result:" block's lines
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if early is not None:
            if not line.strip() or line.startswith("="):
                out["early_stopping"] = " ".join(early)
                early = None
            else:
                early.append(line.strip().lstrip("* ").strip())
                continue
        # token latencies (llama): a TTFT and a TPOT block, read as one
        if line.startswith(("Early Stopping Result", "TTFT Early Stopping Result", "TPOT Early Stopping Result")):
            early = [out.pop("early_stopping")] if out.get("early_stopping") else []
            continue
        m = re.match(r"^\s*([^:]+?)\s*:\s*(.+?)\s*$", line)
        if m and m.group(1) not in out:
            out[m.group(1)] = m.group(2)
        if line.startswith("Result is"):
            out["result_line"] = line.strip()
    if early is not None:
        out["early_stopping"] = " ".join(early)
    scenario = out.get("Scenario")
    key = METRIC_KEYS.get(scenario or "")
    if key and key in out:
        out["metric"] = f"{key}: {out[key]}"
    return out


# What LoadGen says it used (its detail log), beside what was asked (run.asked_settings).
# generated_samples_per_query: what an Offline query held (effective_samples_per_query rounded up
# to whole passes over the performance samples), the samples answered.
_EFFECTIVE_KEYS = ("effective_min_query_count", "effective_min_duration_ms", "effective_target_qps",
                   "effective_target_latency_ns", "effective_samples_per_query", "generated_query_count",
                   "generated_samples_per_query", "result_query_count")


def loadgen_effective(log_dir: Path) -> dict[str, object]:
    """The run-length values LoadGen used, from the :::MLLOG records of mlperf_log_detail.txt."""
    import json

    out: dict[str, object] = {}
    path = log_dir / "mlperf_log_detail.txt"
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.startswith(":::MLLOG"):
            continue
        try:
            record = json.loads(line[len(":::MLLOG"):])
        except ValueError:
            continue
        key = record.get("key")
        if key in _EFFECTIVE_KEYS and key not in out:
            out[key.removeprefix("effective_")] = record.get("value")
    return out


def _no(summary: dict[str, str], key: str) -> bool:
    return summary.get(key, "").strip().upper().startswith("NO")


def invalid_reasons(cfg: MLPerfConfig, summary: dict[str, str], settings: dict | None,
                    interrupted: bool = False, result_dir: Path | None = None) -> list[str]:
    """For an INVALID performance run: each condition LoadGen's summary says is not satisfied, in
    one line with why and the setting that fixes it (empty: the run is VALID, or no summary)."""
    if "INVALID" not in summary.get("result_line", ""):
        return []
    asked = (settings or {}).get("asked") or {}
    used = (settings or {}).get("loadgen") or {}
    issued = used.get("result_query_count")
    cap = (asked.get("max_query_count") or {}).get("value")
    minimum = used.get("min_query_count")
    out = []
    if interrupted:
        out.append("interrupted: samples answered empty after Ctrl-C; run it again to the end")
    if _no(summary, "Min queries satisfied"):
        why = f"{issued} queries issued, LoadGen's minimum is {minimum}"
        if cap and minimum is not None and cap < minimum:
            fix = f"--max-query-count {cap} stopped it: raise it to {minimum} or drop it"
        else:
            fix = "see mlperf_log_detail.txt for why it ended early"
        out.append(f"min queries not satisfied: {why}; {fix}")
    if _no(summary, "Min duration satisfied"):
        duration = used.get("min_duration_ms")
        if cfg.scenario == "Offline":
            measured = summary.get("Samples per second", "?")
            held = used.get("generated_samples_per_query", used.get("samples_per_query", "?"))
            out.append(f"min duration not satisfied: the query of {held} samples was "
                       f"done before {duration} ms, at {measured} samples/s; give --target-qps above that (with a "
                       "margin) for a longer query, or a shorter --min-duration-ms")
        elif cap and issued is not None and issued >= cap:
            out.append(f"min duration not satisfied: --max-query-count {cap} stopped the run before {duration} ms; "
                       "raise it or drop it")
        elif cfg.scenario == "SingleStream":
            mean = summary.get("Mean latency (ns)")
            latency = f" ({int(mean) / 1e6:.1f} ms)" if mean and mean.isdigit() else ""
            out.append(f"min duration not satisfied: the {issued} queries were done before {duration} ms, so the "
                       f"expected latency was above the latency measured{latency}; give --target-latency-ms "
                       "at or below it, or a larger --min-query-count")
        else:
            out.append(f"min duration not satisfied: the queries were done before {duration} ms; give a larger "
                       "--min-query-count or --target-qps")
    if _no(summary, "Early stopping satisfied"):
        text = summary.get("early_stopping", "")
        need = re.search(r"at least (\d+) queries", text)
        more = re.search(r"at least (\d+) more queries", text)
        done = re.search(r"[Pp]rocessed (\d+) queries", text)
        if need:
            fix = f"give --min-query-count {need.group(1)}"
        elif more and done:
            fix = f"give --min-query-count {int(done.group(1)) + int(more.group(1))} (enough if every query stays " \
                  "within the latency bound; else also a lower --target-qps)"
        else:
            fix = "give more queries (--min-query-count), or a lower --target-qps"
        said = " ".join(text.split()).rstrip(".") or "it could not judge the percentile latency"
        out.append(f"early stopping not satisfied (LoadGen: {said}); {fix}")
    if _no(summary, "Performance constraints satisfied") and getattr(cfg, "llama", False):
        tokens = token_latencies(result_dir) if result_dir is not None else {}
        over = [f"{k.upper()} p99 {tokens[f'{k}_p99'] / 1e6:,.1f} ms against {tokens[f'{k}_limit'] / 1e6:,.0f} ms"
                for k in ("ttft", "tpot") if f"{k}_p99" in tokens and f"{k}_limit" in tokens
                and tokens[f"{k}_p99"] > tokens[f"{k}_limit"]]
        completed = summary.get("Completed samples per second", "?")
        out.append(f"performance constraints not satisfied: {'; '.join(over) or 'a token latency is over its limit'}; "
                   f"give a lower --target-qps (the system completed {completed} samples/s)")
    elif _no(summary, "Performance constraints satisfied"):
        p99 = summary.get("99.00 percentile latency (ns)")
        target = used.get("target_latency_ns")
        over = f" ({int(p99) / 1e9:.2f} s against a bound of {target / 1e9:g} s)" if p99 and p99.isdigit() \
            and isinstance(target, int | float) else ""
        completed = summary.get("Completed samples per second", "?")
        out.append(f"performance constraints not satisfied: the latency percentile is over the target latency{over}; "
                   f"give a lower --target-qps (the system completed {completed} samples/s)")
    if not out:
        out.append("LoadGen's summary names no unmet condition; see mlperf_log_summary.txt")
    return out


def _settings_lines(cfg: MLPerfConfig, result: RunResult) -> list[str]:
    """Each run-length setting as asked (and where from) beside what LoadGen used."""
    if result.settings is None or cfg.mode != "performance":
        return []
    asked, used = result.settings["asked"], result.settings["loadgen"]
    lines = ["## Run length: asked and used", ""]

    def line(label: str, key: str, unit: str, used_value: object) -> None:
        if key not in asked:
            return
        a = asked[key]
        text = f"- {label}: asked {a['value']:g}{unit} ({a['source']})"
        if used_value is not None:
            text += f"; LoadGen used {used_value}{unit}"
        lines.append(text)

    line("min query count" if cfg.scenario != "Offline" else "min query count (Offline: samples in its query)",
         "min_query_count", "", used.get("min_query_count"))
    line("min duration", "min_duration_ms", " ms", used.get("min_duration_ms"))
    line("expected QPS", "expected_qps", "", used.get("target_qps"))
    line("target QPS", "target_qps", "", used.get("target_qps"))
    latency = used.get("target_latency_ns")
    line("target latency", "target_latency_ms", " ms", None if latency is None else latency / 1e6)
    qps = used.get("target_qps")
    line("expected latency", "expected_latency_ms", " ms",
         None if not isinstance(qps, int | float) or not qps else round(1000 / qps, 3))
    if used.get("result_query_count") is not None:  # an Offline query's samples: those it held, answered
        per = used.get("generated_samples_per_query", used.get("samples_per_query"))
        lines.append(f"- queries issued: {used['result_query_count']}"
                     + (f" ({per} samples)" if cfg.scenario == "Offline" and per is not None else ""))
    return lines + [""]


def system_description(cfg: MLPerfConfig) -> dict[str, object]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    remote = {}
    if cfg.server is not None:  # this machine only ran LoadGen and the HTTP client
        remote = {"server": cfg.server, "server_model": cfg.server_model,
                  "note": "cpu/gpu/device/dtype describe the LoadGen client, not the server that generated"}

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu,
        "device": cfg.spec.device, "dtype": cfg.spec.dtype, "python": platform.python_version(),
        "platform": platform.platform(), "torch": torch.__version__, "gptj": gptj.__version__,
        "mlcommons-loadgen": version("mlcommons-loadgen"), "transformers": version("transformers"),
        **remote,
    }


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def latency_plot(latencies_s: list[float], first_token_s: list[float], title: str,
                 issued_s: list[float] | None = None) -> bytes:
    """PNG of latency_figure()."""
    import matplotlib.pyplot as plt

    fig = latency_figure(latencies_s, first_token_s, title, issued_s)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _plain_log_ticks(axis, low: float, high: float) -> None:  # noqa: ANN001 - a matplotlib Axis
    """Log-axis ticks as plain numbers (50, 100, 2,000), not 5x10^1; the 2s and 5s between powers of
    ten are labelled too when the data spans less than two decades."""
    from matplotlib.ticker import FuncFormatter

    def plain(v: float, _pos: object = None) -> str:
        return f"{v:,.0f}" if v >= 1 else f"{v:g}"

    few_decades = high / max(low, 1e-12) < 100

    def minor(v: float, _pos: object = None) -> str:
        lead = round(v / 10 ** math.floor(math.log10(v))) if v > 0 else 0
        return plain(v) if few_decades and lead in (2, 5) else ""

    axis.set_major_formatter(FuncFormatter(plain))
    axis.set_minor_formatter(FuncFormatter(minor))


def latency_figure(latencies_s: list[float], first_token_s: list[float], title: str,
                   issued_s: list[float] | None = None):  # noqa: ANN201 - a matplotlib Figure
    """The latency CDF on a log axis (a long tail does not squash the main mode), p50/p90/p99
    marked; with `issued_s` (Server, SingleStream), beside it each sample's latency over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ms = np.sort(np.asarray(latencies_s, dtype=float) * 1000)
    over_time = issued_s is not None and len(issued_s) == len(latencies_s) and len(ms) > 1
    fig, axes = plt.subplots(1, 2 if over_time else 1, figsize=(12 if over_time else 7, 4.2), dpi=100,
                             squeeze=False)
    ax = axes[0][0]
    ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", color="#4878a8", label="issue → complete")
    if first_token_s:
        ft = np.sort(np.asarray(first_token_s, dtype=float) * 1000)
        ax.step(ft, np.arange(1, len(ft) + 1) / len(ft), where="post", color="#e3a33b", label="issue → first token")
    for q, style in ((50, "-"), (90, "--"), (99, ":")):
        v = _percentile(list(ms), q)
        ax.axvline(v, color="black", linestyle=style, linewidth=1, label=f"p{q} {v:,.0f} ms")
    if ms[0] > 0:
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis, ms[0], ms[-1])
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of samples at or below")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    if over_time:
        t0 = min(issued_s)
        ax2 = axes[0][1]
        ax2.scatter([t - t0 for t in issued_s], np.asarray(latencies_s) * 1000, s=6, color="#4878a8", alpha=0.7)
        if min(latencies_s) > 0:
            ax2.set_yscale("log")
            _plain_log_ticks(ax2.yaxis, ms[0], ms[-1])
        ax2.set_xlabel("issued at (s since the first sample)")
        ax2.set_ylabel("latency (ms, log scale)")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.set_title("latency over the run")
    fig.tight_layout()
    return fig


def _settings_dict(cfg: MLPerfConfig) -> dict[str, object]:
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("gen", "argv")}
    d["generation"] = dataclasses.asdict(cfg.gen)
    d["batching"] = dataclasses.asdict(cfg.batching)
    return d


def summary_markdown(cfg: MLPerfConfig, result: RunResult, dataset: Dataset, loadgen: dict[str, str],
                     system: dict[str, object]) -> str:
    st = result.stats
    lines = [f"# gptj MLPerf {cfg.benchmark if cfg.llama else 'gptj-99'} — {cfg.scenario_name}, {cfg.mode}", ""]
    remote = result.remote
    if remote is not None:
        lines.append(f"- model: `{remote['model']}` on the gptj server at `{remote['url']}` "
                     f"(remote, over HTTP: the server's dtype, device and batching; up to {remote['concurrency']} "
                     f"requests in flight, {remote['retries']} retried after HTTP 429)")
    else:
        lines.append(f"- model: `{cfg.model}` ({cfg.spec.dtype} on {cfg.spec.device})")
    truncated = f"{dataset.num_truncated} prompts longer than {dataset.max_input_tokens} tokens, truncated to it as " \
        "the reference does" if not cfg.llama else "its token ids as they are, untruncated, as the reference's"
    lines += [f"- dataset: `{dataset.path}` ({len(dataset)} samples; {truncated})",
              f"- command: `{' '.join(cfg.argv)}`",
              f"- {'LoadGen client' if remote is not None else 'system'}: {system['cpu']}, {system['cpu_count']} "
              f"CPUs, GPU {system['gpu'] or 'none'}, torch {system['torch']}, LoadGen {system['mlcommons-loadgen']}"]
    if result.threads is not None:
        t = result.threads
        lines.append(f"- compute threads: {t.compute} ({t.why})" + (" — unused here: the server computes"
                                                                  if remote is not None else ""))
    lines.append("")
    if result.interrupted is not None:
        info = result.interrupted
        lines += ["## Interrupted (Ctrl-C): not a result", "", f"- {info['note']}",
                  f"- {st.interrupted} samples were answered empty after the interrupt"]
        lines += [f"- incomplete: `{f.split(' ', 1)[0]}` {f.split(' ', 1)[1] if ' ' in f else ''}".rstrip()
                  for f in info.get("incomplete", [])]
        lines.append("")
    if result.notes:
        lines += ["## Read this first", ""] + [f"- {n}" for n in result.notes] + [""]
    if cfg.mode == "performance":
        lines += ["## LoadGen result", "", f"- {result.result_line or 'no result line (see mlperf_log_detail.txt)'}"]
        if result.metric:
            lines.append(f"- {result.metric}")
        for key in ("Min duration satisfied", "Min queries satisfied", "Early stopping satisfied",
                    "Performance constraints satisfied"):
            if key in loadgen:
                lines.append(f"- {key}: {loadgen[key]}")
        if result.invalid_reasons:
            lines += ["", "Why INVALID, and what fixes it:", ""] + [f"- {r}" for r in result.invalid_reasons]
        lines += [""] + token_latency_lines(cfg, result.token_latencies or {}) + _settings_lines(cfg, result)
        lines += ["![latency distribution](latency.png)", ""]
    if result.accuracy is not None:
        lines += ["## Accuracy", "", "```", accuracy_report(result.accuracy).rstrip(), "```", ""]
        if cfg.llama:  # its token ids are int32, as the reference SUT's (evaluation.py --dtype int32)
            data = f" --dataset {cfg.dataset}" if cfg.dataset is not None else ""
            lines += [f"Scored again by `gptj evaluate --benchmark {cfg.benchmark} --tokenizer {cfg.model} --log-dtype "
                      f"int32 --log-dir {result.log_dir}{data}` (MLCommons' evaluation.py: `--dtype int32`).", ""]
    lat = st.latencies_s
    lines += ["## SUT", "",
              f"- samples answered: {st.samples} in {st.batches} batches "
              f"(mean batch {st.mean_batch:.2f}, largest {st.max_batch}; policy: max {cfg.batching.max_batch_size}, "
              f"wait {cfg.batching.wait_ms:g} ms{', sorted by length' if cfg.batching.sort_by_length else ''})",
              f"- new tokens: {st.new_tokens}",
              *([f"- engine: {result.engine_times.line()}"] if result.engine_times is not None else []),
              *([f"- speculation: {result.speculation['accepted']} of {result.speculation['drafted']} drafted "
                 "tokens accepted"] if result.speculation is not None else []),
              f"- latency as the SUT saw it: p50 {_percentile(lat, 50) * 1000:.1f} ms, "
              f"p90 {_percentile(lat, 90) * 1000:.1f} ms, p99 {_percentile(lat, 99) * 1000:.1f} ms", ""]
    lines += ["## Files", "",
              "- `mlperf_log_summary.txt`, `mlperf_log_detail.txt`, `mlperf_log_accuracy.json`: LoadGen's logs",
              "- `run.json`: the command, settings, generation config and batching stats",
              "- `system.json`: the machine and software versions"]
    if result.accuracy is not None:
        lines.append("- `accuracy.json`: ROUGE scores and pass/fail; `accuracy.txt`: the reference's result line")
    if cfg.mode == "performance":
        lines.append("- `latency.png`: per-sample latency, as a CDF on a log axis"
                     + ("; and over the run" if cfg.scenario != "Offline" else ""))
    return "\n".join(lines) + "\n"


def _engine_times_json(times) -> dict | None:  # noqa: ANN001 - gptj.engine.config.StepTimes
    """The engine's steps over the run: their count, and each phase's mean ms a step."""
    if times is None:
        return None
    return {"steps": times.steps, **{f"{k}_ms" if k != "decode_rows" else "mean_decode_rows": round(v, 3)
                                     for k, v in times.per_step_ms().items()}}


def write_bundle(cfg: MLPerfConfig, result: RunResult, dataset: Dataset, loadgen: dict[str, str]) -> None:
    d = result.log_dir
    st = result.stats
    system = system_description(cfg)
    atomic_write_json(d / "system.json", system)
    atomic_write_json(d / "run.json", {
        "command": cfg.argv, "identity": cfg.identity(), "settings": _settings_dict(cfg), "notes": result.notes, "remote": result.remote,
        "official_generation": not any("generation settings" in n for n in result.notes),
        "threads": result.threads.to_json() if result.threads is not None else None,
        "interrupted": result.interrupted,
        "run_length": result.settings,
        "dataset": {"path": str(dataset.path) if dataset.path is not None else None, "samples": len(dataset),
                    "max_input_tokens": dataset.max_input_tokens, "truncated_prompts": dataset.num_truncated},
        "loadgen": {k: v for k, v in loadgen.items() if k in ("result_line", "metric", "Scenario", "Mode")},
        "sut": {"samples": st.samples, "batches": st.batches, "max_batch": st.max_batch,
                "mean_batch": round(st.mean_batch, 3), "batch_sizes": dict(sorted(st.batch_sizes.items())),
                "new_tokens": st.new_tokens, "first_tokens": len(st.first_token_s),
                "duplicate_answers": sum(1 for c in st.answered.values() if c > 1),
                "answered_empty_after_interrupt": st.interrupted},
        "engine_steps": _engine_times_json(result.engine_times),
        "speculation": result.speculation,
        **({"benchmark": cfg.benchmark, "scenario": cfg.scenario_name, "loadgen_model": cfg.loadgen_model,
            "token_latencies_ns": result.token_latencies} if cfg.llama else {}),
    })
    if result.accuracy is not None:
        atomic_write_json(d / "accuracy.json", result.accuracy.to_json())
        atomic_write_text(d / "accuracy.txt", _accuracy_line(result.accuracy) + "\n")
    if cfg.mode == "performance" and st.latencies_s:
        png = latency_plot(st.latencies_s, st.first_token_s, f"gptj {cfg.scenario}: {len(st.latencies_s)} samples",
                           st.issued_s if cfg.scenario != "Offline" else None)
        atomic_write_bytes(d / "latency.png", png)
    atomic_write_text(d / "summary.md", summary_markdown(cfg, result, dataset, loadgen, system))
