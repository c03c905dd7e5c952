"""`gptj mlperf`: one LoadGen run (scenario x mode) and its results bundle.

    config -> dataset (tokenized into RAM) -> model -> QSL + SUT -> LoadGen -> log folder:
        mlperf_log_{summary,detail,accuracy,trace}  (LoadGen's own)
        run.json       the exact command, settings, generation config, SUT batching stats
        system.json    CPU/GPU, torch, dtype, versions
        accuracy.json  ROUGE scores and pass/fail (accuracy mode)
        latency.png    latency distribution (performance mode)
        summary.md     what a person reads first

With `server` set, the SUT's backend is a gptj server over HTTP (gptj.mlperf.remote) instead of
the engine in this process: no model is loaded here (a local `model` folder only supplies the
tokenizer and the config for the notes), and the server's settings (dtype, device, batching) apply.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import os
import re
import sys
import threading
import time
from pathlib import Path

from gptj.decode import GenerationConfig
from gptj.errors import GptjError
from gptj.mlperf.remote import API_KEY_ENV  # with `server`: sent as "Authorization: Bearer KEY" (kept out of the logs)
from gptj.mlperf.config import MODEL_NAME, MLPerfConfig, RunResult, Threads
from gptj.mlperf.loadgen import Interrupted, interrupted_logs, run_loadgen
from gptj.parallel.context import SINGLE, ParallelContext

def choose_threads(cfg: MLPerfConfig, ctx: ParallelContext = SINGLE) -> Threads:
    """--threads if given; else the usable cores less RESERVED_CORES; under --tp/--pp, this rank's
    share of the cores (as the launcher set it), less the reserve."""
    import torch

    from gptj.threads import RESERVED_CORES, compute_threads, usable_cores

    cores = usable_cores()
    if cfg.threads is not None:
        return Threads(compute_threads(cfg.threads), cfg.threads, cores, 0, "requested (--threads)")
    if ctx.parallel:
        share = torch.get_num_threads()
        return Threads(max(1, share - RESERVED_CORES), None, cores, RESERVED_CORES,
                       f"default: this rank's share of {share} of the {cores} usable cores" + _kept(RESERVED_CORES))
    return Threads(compute_threads(None, RESERVED_CORES), None, cores, RESERVED_CORES,
                   f"default: the {cores} usable cores" + _kept(RESERVED_CORES))


def _kept(reserve: int) -> str:
    return f", less {reserve} kept for LoadGen and the SUT" if reserve else ""


def official_differences(gen: GenerationConfig, official: GenerationConfig | None = None) -> list[str]:
    """How `gen` differs from MLPerf gptj-99's generation settings, or `official` (empty: official)."""
    official = official or GenerationConfig.mlperf()
    return [f"{f.name}={getattr(gen, f.name)!r} (official {getattr(official, f.name)!r})"
            for f in dataclasses.fields(GenerationConfig) if getattr(gen, f.name) != getattr(official, f.name)]


def default_log_dir(scenario: str, mode: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("mlperf-logs") / f"{stamp}-{scenario}-{mode}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def test_settings(cfg: MLPerfConfig, performance_sample_count: int, expected_latency_s: float | None = None):
    """LoadGen settings: its built-in gptj mlperf.conf, then user.conf, then the round's seeds
    (cfg.round) and the flags, then --audit-config (last, as LoadGen applies it).

    `performance_sample_count`: the data set's size (the most performance samples there can be).
    `expected_latency_s` (SingleStream): the calibrated latency, used when neither
    --target-latency-ms nor user.conf gives one."""
    import mlperf_loadgen as lg

    # FromConfig's kind 1 (a user.conf) loads the built-in mlperf.conf again the first time a process
    # uses it, over whatever was set before; kind 2 (an audit config) applies the file's keys alone.
    settings = lg.TestSettings()
    model = cfg.loadgen_model  # Interactive: LoadGen's Server scenario, with llama3_1-8b-interactive's keys
    settings.FromConfig("", model, cfg.scenario, 0)  # the built-in mlperf.conf
    if cfg.user_conf is not None:
        settings.FromConfig(str(cfg.user_conf), model, cfg.scenario, 1)
    if cfg.round is not None:
        from gptj.mlperf.rules import apply_seeds

        apply_seeds(settings, cfg.round)
    settings.scenario = getattr(lg.TestScenario, cfg.scenario)
    settings.mode = lg.TestMode.AccuracyOnly if cfg.mode == "accuracy" else lg.TestMode.PerformanceOnly
    if cfg.token_latencies or cfg.llama:  # llama: each answer's token count, its first token when made
        settings.use_token_latencies = True
    if cfg.performance_sample_count is not None:
        settings.performance_sample_count_override = cfg.performance_sample_count
    # The real set has 13,368 samples; a smaller set is used whole.
    if settings.performance_sample_count_override == 0 or settings.performance_sample_count_override > \
            performance_sample_count:
        settings.performance_sample_count_override = performance_sample_count
    if cfg.target_qps is not None:
        settings.offline_expected_qps = cfg.target_qps
        settings.server_target_qps = cfg.target_qps
    if cfg.target_latency_ms is not None:
        ns = int(cfg.target_latency_ms * 1e6)
        settings.single_stream_expected_latency_ns = ns
        settings.server_target_latency_ns = ns
    elif expected_latency_s is not None:
        settings.single_stream_expected_latency_ns = max(1, int(expected_latency_s * 1e9))
    if cfg.min_duration_ms is not None:
        settings.min_duration_ms = cfg.min_duration_ms
    if cfg.min_query_count is not None:
        settings.min_query_count = cfg.min_query_count
    cap = query_cap(cfg)
    if cap is not None:
        settings.max_query_count = cap
    if cfg.audit_config is not None:  # LoadGen applies it over all of the above: so the plan does too
        settings.FromConfig(str(cfg.audit_config), model, cfg.scenario, 2)
    return settings


def audited_keys(cfg: MLPerfConfig) -> set[str]:
    """The settings --audit-config sets for this run's scenario (`model.scenario.key = value` lines,
    `*` matching any model or scenario)."""
    if cfg.audit_config is None:
        return set()
    keys = set()
    for line in Path(cfg.audit_config).read_text().splitlines():
        name = line.split("#", 1)[0].split("=", 1)[0].strip()
        parts = name.split(".")
        if len(parts) == 3 and parts[0] in ("*", cfg.loadgen_model) and parts[1] in ("*", cfg.scenario):
            keys.add(parts[2])
    return keys


def query_cap(cfg: MLPerfConfig) -> int | None:
    """LoadGen's max_query_count: --max-query-count (None or 0: no cap). --min-query-count caps
    nothing: LoadGen may raise the minimum (equal issue rounds it up to whole passes over the
    performance samples; SingleStream also to 2 x min duration / expected latency), and a run stopped
    below LoadGen's minimum is INVALID, so a short run issues what LoadGen asks for. Offline has one
    query: its samples follow min_query_count and the expected QPS, and no cap applies."""
    if cfg.scenario == "Offline" or cfg.mode == "accuracy":
        return None
    return cfg.max_query_count or None


EARLY_STOPPING_CONFIDENCE = 0.99  # LoadGen's early-stopping confidence
# Queries over the percentile's latency that LoadGen's early stopping counts with at the least:
# SingleStream judges its own percentile, so one query is always above it; a Server run can have
# every query within its latency bound.
EARLY_STOPPING_OVER = {"SingleStream": 1, "Server": 0}


def early_stopping_min_queries(scenario: str, percentile: float, over: int | None = None) -> int | None:
    """The fewest queries with which LoadGen's early stopping can pass a SingleStream or Server run
    (None: Offline, which has none): the smallest n for which `over` (default EARLY_STOPPING_OVER)
    queries above the `percentile` latency out of n leave at most 1 - confidence probability of the
    true percentile being above it (binomial tail). SingleStream at p90: 64; Server at p99: 459,
    the counts LoadGen's summary names when a run has too few."""
    from math import comb

    if scenario not in EARLY_STOPPING_OVER or not 0 < percentile < 1:
        return None
    t = EARLY_STOPPING_OVER[scenario] if over is None else over
    n = t
    while True:
        n += 1
        tail = sum(comb(n, k) * (1 - percentile) ** k * percentile ** (n - k) for k in range(t + 1))
        if tail <= 1 - EARLY_STOPPING_CONFIDENCE:
            return n


def invalid_forecast(cfg: MLPerfConfig, settings, performance_samples: int) -> list[str]:  # noqa: ANN001
    """Notes, before a performance run starts, for what will make it INVALID whatever the system
    does, each naming the setting that fixes it: a cap below LoadGen's minimum query count, and
    fewer queries than LoadGen's early stopping needs to judge the run."""
    if cfg.mode != "performance" or cfg.scenario == "Offline":
        return []
    out = []
    n, _ = planned_queries(settings, cfg.scenario, performance_samples)
    uncapped, how = _uncapped_queries(settings, cfg.scenario, performance_samples)
    if n < uncapped:
        source = "--max-query-count" if cfg.max_query_count else "the audit config's max_query_count"
        if cfg.scenario == "SingleStream":  # LoadGen's min_query_count is its count
            out.append(f"the run will be INVALID (min queries): {source} {n:,} stops it before LoadGen's minimum of "
                       f"{uncapped:,} queries ({how}); raise --max-query-count to {uncapped:,} or drop it")
        else:  # Server: the schedule spans the min duration; cut short, it spans less
            out.append(f"the run will be INVALID (min duration): {source} {n:,} ends it before the {uncapped:,} "
                       f"queries LoadGen schedules ({how}); raise --max-query-count to {uncapped:,} or drop it")
    percentile = settings.single_stream_target_latency_percentile if cfg.scenario == "SingleStream" \
        else settings.server_target_latency_percentile
    need = early_stopping_min_queries(cfg.scenario, percentile)
    if need is not None and n < need:
        what = "queries" if cfg.scenario == "SingleStream" else "queries, all within the latency bound,"
        out.append(f"the run will be INVALID (early stopping): LoadGen's early stopping needs at least {need:,} "
                   f"{what} to judge the {percentile * 100:g}th percentile latency and this run issues "
                   f"{'' if cfg.scenario == 'SingleStream' else 'about '}{n:,}; "
                   f"--min-query-count {need} fixes it")
    return out


AUDIT_CONFIG = "audit.config"


def audit_config_path(cfg: MLPerfConfig, log_dir: Path) -> Path:
    """The audit config LoadGen reads for this run: --audit-config, copied into the run's folder
    (which keeps it); else a path in that folder where none is, so that an audit.config left in the
    working directory (LoadGen's default place to look) changes nothing."""
    import shutil

    path = log_dir.resolve() / AUDIT_CONFIG
    if cfg.audit_config is not None:
        if Path(cfg.audit_config).resolve() != path:
            shutil.copyfile(cfg.audit_config, path)
    else:
        path.unlink(missing_ok=True)  # a former compliance run's, in a folder used again
    return path


def user_conf_sets_expected_latency(path: Path | None, model: str = MODEL_NAME) -> bool:
    """Whether a user.conf sets `model`'s SingleStream target_latency (LoadGen's expected latency)."""
    if path is None:
        return False
    pattern = re.compile(rf"^\s*({re.escape(model)}|\*)\.(SingleStream|\*)\.target_latency\s*=")
    return any(pattern.match(line) for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines())


def needs_calibration(cfg: MLPerfConfig) -> bool:
    """SingleStream performance runs with no expected latency given: LoadGen's default (10 ms) sets
    the query count, 2 x min duration / expected latency (in equal-issue mode, as gptj's mlperf.conf
    has it), so a slow SUT would run far longer than asked."""
    return cfg.scenario == "SingleStream" and cfg.mode == "performance" and cfg.target_latency_ms is None \
        and not user_conf_sets_expected_latency(cfg.user_conf, cfg.loadgen_model)


CALIBRATION_SAMPLES = 2  # timed, after one untimed warm-up sample
# How the expected latency is timed, said alike by the note before it and the run's summary after.
CALIBRATION_HOW = f"{CALIBRATION_SAMPLES} samples one at a time, after 1 untimed warm-up sample"


def calibrate_latency(backend, dataset, gen: GenerationConfig,  # noqa: ANN001 - a Backend, a Dataset
                      samples: int = CALIBRATION_SAMPLES) -> float:
    """Seconds per sample run alone, as SingleStream runs them: the mean over `samples` samples
    spread over the set, after one warm-up (the first steps of a fresh engine are slower)."""
    n = len(dataset)
    picks = [round(i * (n - 1) / max(1, samples - 1)) for i in range(samples)] if samples > 1 else [0]
    times = []
    for k, index in enumerate([picks[0], *picks]):
        done = threading.Event()
        errors: list[str] = []

        def on_done(tokens, error, errors=errors, done=done) -> None:  # noqa: ANN001
            if error is not None:
                errors.append(error)
            done.set()

        start = time.perf_counter()
        backend.submit(dataset.input_ids[index], gen, on_done=on_done)
        done.wait()
        if errors:
            raise GptjError(f"calibrating the expected latency: sample {index}: {errors[0]}")
        if k > 0:
            times.append(time.perf_counter() - start)
    return sum(times) / len(times)


def planned_queries(settings, scenario: str, performance_samples: int) -> tuple[int, str]:  # noqa: ANN001
    """The queries (Offline: samples in its one query) LoadGen will issue in a performance run, as
    its test_settings_internal.cc and GenerateQueries derive them, and how; a SingleStream or
    Server run stops at max_query_count (when set)."""
    n, how = _uncapped_queries(settings, scenario, performance_samples)
    cap = int(settings.max_query_count)
    if scenario != "Offline" and cap and n > cap:
        return cap, (how + "; " if how else "") + f"LoadGen's {n:,} stopped at max_query_count {cap:,}"
    return n, how


def _uncapped_queries(settings, scenario: str, performance_samples: int) -> tuple[int, str]:  # noqa: ANN001
    asked = int(settings.min_query_count)
    duration_s = settings.min_duration_ms / 1000
    n_perf = max(1, performance_samples)
    equal_issue = bool(settings.sample_concatenate_permutation)

    def whole_passes(n: int) -> int:
        return n if n % n_perf == 0 else n + n_perf - n % n_perf

    if scenario == "Offline":
        by_qps = int(1.1 * duration_s * settings.offline_expected_qps)
        n = max(asked, by_qps)
        how = f"1.1 x min duration {duration_s:g} s x expected QPS {settings.offline_expected_qps:g} = {by_qps}" \
            if by_qps > asked else ""
        if equal_issue and whole_passes(n) != n:
            n = whole_passes(n)
            how = (how + "; " if how else "") + f"rounded up to whole passes over the {n_perf} performance samples"
        return n, how
    if scenario == "SingleStream":
        n, how = asked, ""
        if equal_issue:
            qps = 1e9 / settings.single_stream_expected_latency_ns
            expected = int(2.0 * duration_s * qps)
            if expected > n:
                n = expected
                how = (f"2 x min duration {duration_s:g} s / expected latency "
                       f"{settings.single_stream_expected_latency_ns / 1e6:.1f} ms = {expected}")
            n += n_perf - n % n_perf  # as LoadGen: a whole pass more when already whole
            how = (how + "; " if how else "") + f"rounded up to whole passes over the {n_perf} performance samples"
        return n, how
    # Server: every query of the schedule (about target QPS x min duration), at least min_query_count
    n = whole_passes(asked) if equal_issue else asked
    how = f"rounded up to whole passes over the {n_perf} performance samples" if n != asked else ""
    by_qps = int(settings.server_target_qps * duration_s)
    if by_qps > n:
        n, how = by_qps, f"about target QPS {settings.server_target_qps:g} x min duration {duration_s:g} s"
    return n, how


def count_note(cfg: MLPerfConfig, settings, performance_samples: int) -> str | None:  # noqa: ANN001
    """A note when LoadGen will issue more queries than min_query_count asks (performance runs)."""
    if cfg.mode != "performance":
        return None
    n, how = planned_queries(settings, cfg.scenario, performance_samples)
    asked = int(settings.min_query_count)
    if n <= asked:
        return None if n == asked or cfg.scenario == "Offline" else \
            f"LoadGen issues {n:,} queries, fewer than the {asked:,} asked: {how}"
    what = "samples in its query" if cfg.scenario == "Offline" else "queries"
    if "min_query_count" in audited_keys(cfg):
        source = "the audit config's min_query_count"
    elif cfg.min_query_count is not None:
        source = "--min-query-count"
    else:
        source = "mlperf.conf's min_query_count"
    return f"LoadGen raises the {what} to {n:,} from the {asked:,} asked ({source}): {how}"


def asked_settings(cfg: MLPerfConfig, settings, expected_s: float | None) -> dict:  # noqa: ANN001
    """The run-length settings asked for (after mlperf.conf, user.conf, the flags), each with its source."""
    conf = "user.conf / mlperf.conf" if cfg.user_conf is not None else "mlperf.conf"
    audited = audited_keys(cfg)

    def src(flag_value: object, flag: str, key: str = "") -> str:
        if key in audited:
            return "--audit-config"
        return flag if flag_value is not None else conf

    out: dict = {"min_query_count": {"value": int(settings.min_query_count),
                                     "source": src(cfg.min_query_count, "--min-query-count", "min_query_count")},
                 "min_duration_ms": {"value": int(settings.min_duration_ms),
                                     "source": src(cfg.min_duration_ms, "--min-duration-ms", "min_duration")},
                 "performance_sample_count": {"value": int(settings.performance_sample_count_override),
                                              "source": src(cfg.performance_sample_count,
                                                            "--performance-sample-count",
                                                            "performance_sample_count_override")}}
    if settings.max_query_count:
        out["max_query_count"] = {"value": int(settings.max_query_count),
                                  "source": "--max-query-count" if cfg.max_query_count else "--min-query-count"}
    if cfg.scenario == "Offline":
        out["expected_qps"] = {"value": settings.offline_expected_qps, "source": src(cfg.target_qps, "--target-qps")}
    elif cfg.scenario == "Server" and cfg.llama:  # LoadGen judges token latencies (report.token_latency_lines)
        out["target_qps"] = {"value": settings.server_target_qps, "source": src(cfg.target_qps, "--target-qps")}
    elif cfg.scenario == "Server":
        out["target_qps"] = {"value": settings.server_target_qps, "source": src(cfg.target_qps, "--target-qps")}
        out["target_latency_ms"] = {"value": settings.server_target_latency_ns / 1e6,
                                    "source": src(cfg.target_latency_ms, "--target-latency-ms")}
    else:
        if cfg.target_latency_ms is not None:
            source = "--target-latency-ms"
        elif expected_s is not None:
            source = f"timed on {CALIBRATION_HOW}"
        elif user_conf_sets_expected_latency(cfg.user_conf, cfg.loadgen_model):
            source = "user.conf"
        else:
            source = "LoadGen's default"
        out["expected_latency_ms"] = {"value": round(settings.single_stream_expected_latency_ns / 1e6, 3),
                                      "source": source}
    return out


def flags_that_do_not_apply(cfg: MLPerfConfig) -> list[str]:
    """Flags given that this scenario/mode has no use for, each with why (said, not ignored silently)."""
    out = []
    if cfg.scenario == "SingleStream":
        if cfg.target_qps is not None:
            out.append("--target-qps does not apply to SingleStream (one query at a time; --target-latency-ms sets "
                       "its expected latency)")
        if cfg.max_batch_size is not None or cfg.batch_wait_ms is not None:
            out.append("--max-batch-size / --batch-wait-ms do not apply to SingleStream (one sample at a time)")
    if cfg.scenario == "Server" and cfg.llama and cfg.target_latency_ms is not None:
        out.append(f"--target-latency-ms does not apply to {cfg.benchmark} {cfg.scenario_name}: LoadGen judges its "
                   "p99 time to first token and time per output token against mlperf.conf's limits")
    if cfg.scenario == "Offline" and cfg.target_latency_ms is not None:
        out.append("--target-latency-ms does not apply to Offline (it has no latency bound; --target-qps sets "
                   "its expected QPS)")
    if cfg.mode == "accuracy":
        given = [f for f, v in (("--target-qps", cfg.target_qps), ("--target-latency-ms", cfg.target_latency_ms),
                                ("--min-duration-ms", cfg.min_duration_ms),
                                ("--min-query-count", cfg.min_query_count)) if v is not None]
        if given:
            out.append(f"{', '.join(given)}: an accuracy run issues every sample once, whatever these say")
    return out


def engine_config(cfg: MLPerfConfig, longest: int):  # noqa: ANN201 - EngineConfig
    """The run's engine: what --max-seqs / --max-model-len ask, else a batch of samples x beams
    sequences (cfg.batching.max_batch_size x num_beams) as long as the longest prompt + max_new_tokens."""
    import dataclasses

    asked = cfg.engine
    return dataclasses.replace(asked, max_seqs=asked.max_seqs or cfg.batching.max_batch_size * cfg.gen.num_beams,
                               max_len=asked.max_len or longest + cfg.gen.max_new_tokens)


def _engine_backend(cfg: MLPerfConfig, model_dir: Path, longest: int, threads: int,
                    ctx: ParallelContext):  # noqa: ANN202
    """The engine on its thread, the model loaded there (a load error is raised here)."""
    from gptj.mlperf.sut import EngineBackend

    return EngineBackend(functools.partial(_build_engine, cfg, model_dir, longest, threads), ctx)


def with_tokenizer_eos(cfg: MLPerfConfig, tokenizer) -> MLPerfConfig:  # noqa: ANN001 - a Tokenizer
    """llama: `cfg` generating until any of the tokenizer's EOS ids (Llama 3.1 Instruct has three;
    min_new_tokens holds them all back), as the reference's vLLM does. gptj: as it is."""
    if not cfg.llama:
        return cfg
    if cfg.model is None or not (Path(cfg.model) / "tokenizer.json").is_file():
        raise GptjError(f"{cfg.benchmark} needs the model's own tokenizer: {cfg.model} has no tokenizer.json")
    gen = cfg.gen.replace(eos_token_id=tuple(tokenizer.eos_token_ids), pad_token_id=tokenizer.pad_token_id)
    return dataclasses.replace(cfg, gen=gen)


_ENGINE_THREAD_TORCH_THREADS = [None]  # what torch.get_num_threads() said on the engine's thread (run.json)


def _build_engine(cfg: MLPerfConfig, model_dir: Path, longest: int, threads: int,
                  ctx: ParallelContext):  # noqa: ANN202 - Engine
    import torch

    from gptj.runtime.build import build_engine, load_model

    # On the engine's own thread too: torch keeps OpenMP's thread count per thread (a thread takes
    # the process-wide value only when it first computes), so set it where the steps run.
    torch.set_num_threads(threads)
    _ENGINE_THREAD_TORCH_THREADS[0] = torch.get_num_threads()
    bars = None if cfg.progress else False  # --quiet: none; else gptj.weights.io.auto_progress decides
    spec = cfg.spec.at(model_dir)
    model = load_model(spec, ctx, progress=bars)
    if longest + cfg.gen.max_new_tokens > model.config.n_positions:
        raise GptjError(f"the longest prompt ({longest} tokens) + max_new_tokens {cfg.gen.max_new_tokens} exceeds "
                        f"the model's {model.config.n_positions} positions")
    engine = engine_config(cfg, longest)
    if engine.max_seqs < cfg.gen.num_beams:
        raise GptjError(f"--max-seqs {engine.max_seqs} is fewer than num_beams {cfg.gen.num_beams} (a sample's "
                        "beams run together)")
    return build_engine(model, engine, progress=bars, warm=cfg.gen, ctx=ctx)  # CUDA: graphs captured before LoadGen


def _check_fits_server(cfg: MLPerfConfig, backend, longest: int) -> None:  # noqa: ANN001 - HTTPBackend
    limit = backend.max_model_len
    if limit is not None and longest + cfg.gen.max_new_tokens > limit:
        raise GptjError(f"the longest prompt ({longest} tokens) + max_new_tokens {cfg.gen.max_new_tokens} exceeds "
                        f"the server model {backend.model!r}'s max_model_len {limit}")


def run(cfg: MLPerfConfig, ctx: ParallelContext = SINGLE) -> RunResult:
    """One LoadGen run as `cfg` asks; `ctx`: under --tp / --pp, this process is the job's rank 0."""
    import numpy as np
    import torch
    from tqdm import tqdm

    from gptj.mlperf.sut import QSL, SUT
    from gptj.tokenizer import tokenizer_for_model

    model_dir = Path(cfg.model) if cfg.model is not None else None
    tokenizer = tokenizer_for_model(model_dir)
    cfg = with_tokenizer_eos(cfg, tokenizer)
    threads = choose_threads(cfg, ctx)
    torch.set_num_threads(threads.compute)
    remote = None
    if cfg.server is not None:
        from gptj.mlperf.remote import HTTPBackend

        if model_dir is not None and not model_dir.is_dir():
            raise GptjError(f"{model_dir}: no such model folder (with --server, --model only supplies the tokenizer)")
        # First, so a wrong URL fails before anything is loaded; its threads start with the first request.
        remote = HTTPBackend(cfg.server, model_name=cfg.server_model, concurrency=cfg.server_concurrency,
                             api_key=os.environ.get(API_KEY_ENV) or None)
    setup = _prepare(cfg, ctx, model_dir, threads, remote, tokenizer)

    dataset = setup.dataset
    total = len(dataset) if cfg.mode == "accuracy" else None
    bar = tqdm(total=total, desc=f"{cfg.scenario} {cfg.mode}", unit="sample", disable=not cfg.progress)
    qsl = QSL(dataset, setup.performance_samples)
    sut = SUT(setup.backend, dataset, cfg.gen, cfg.batching, on_complete=bar.update,
              first_token_at_end=(cfg.token_latencies or cfg.llama) and cfg.gen.num_beams > 1,
              token_dtype=np.int32 if cfg.llama else np.int64)  # llama: int32, as its reference SUT sends
    finished = run_loadgen(sut, qsl, setup.settings, setup.log_settings, cfg.scenario, setup.audit)
    interrupted = sut.interrupted
    if finished:
        sut.stop()
        qsl.destroy()
    bar.close()
    if sut.error is not None and not interrupted:
        if isinstance(sut.error, GptjError):
            raise sut.error
        raise RuntimeError(f"generation failed during the run: {sut.error!r}") from sut.error
    return _results(cfg, setup, sut.stats, finished, interrupted, threads, remote)


@dataclasses.dataclass
class _Setup:
    """What a run settles before LoadGen's test: the data, the backend the SUT sends samples to (the
    engine here, or a gptj server), the log folder, the notes, and LoadGen's settings."""

    tokenizer: object
    dataset: object  # gptj.mlperf.dataset.Dataset
    backend: object  # an EngineBackend or an HTTPBackend
    log_dir: Path
    notes: list[str]
    # LoadGen's part (_settle)
    settings: object = None  # mlperf_loadgen.TestSettings
    performance_samples: int = 0
    asked: dict | None = None  # asked_settings: what the flags and files asked for
    log_settings: object = None  # mlperf_loadgen.LogSettings
    audit: Path | None = None


def _prepare(cfg: MLPerfConfig, ctx: ParallelContext, model_dir: Path | None, threads: Threads,
             remote, tokenizer) -> _Setup:  # noqa: ANN001 - an HTTPBackend or None, a Tokenizer
    """The run up to LoadGen's test: the dataset tokenized, the backend started (with `remote`: the
    server, checked to fit the longest prompt; else the engine, its model loaded), the log folder,
    the notes printed, the settings made. Whatever fails, the backends opened are closed."""
    from gptj.mlperf import report
    from gptj.mlperf.config import llama_generation
    from gptj.mlperf.dataset import Dataset

    backend = None
    try:
        dataset = Dataset.load(cfg.dataset, tokenizer=tokenizer, max_examples=cfg.max_examples,
                               benchmark=cfg.benchmark if cfg.llama else "gptj-99")
        longest = max(len(ids) for ids in dataset.input_ids)
        if remote is not None:
            _check_fits_server(cfg, remote, longest)
            backend = remote
        else:
            backend = _engine_backend(cfg, model_dir, longest, threads.compute, ctx)
        log_dir = Path(cfg.log_dir) if cfg.log_dir is not None else default_log_dir(cfg.scenario_name, cfg.mode)
        log_dir.mkdir(parents=True, exist_ok=True)
        differences = official_differences(cfg.gen, llama_generation(tokenizer)) if cfg.llama \
            else official_differences(cfg.gen)
        notes = report.notes_for(cfg, model_dir, differences)
        if remote is not None:
            notes[:0] = _remote_notes(cfg, remote, model_dir)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        return _settle(cfg, _Setup(tokenizer, dataset, backend, log_dir, notes))
    except BaseException:
        for opened in {id(b): b for b in (remote, backend) if b is not None}.values():
            opened.close()
        raise


def _remote_notes(cfg: MLPerfConfig, remote, model_dir: Path | None) -> list[str]:  # noqa: ANN001 - HTTPBackend
    """What the notes say first of a run whose samples a gptj server answered."""
    from gptj.runtime.flags import flags_given

    ignored = flags_given(cfg.spec, cfg.engine)
    notes = [f"samples ran on a remote gptj server: {remote.url}, model {remote.model!r}, "
             f"{cfg.server_concurrency} requests in flight at most; its dtype, device and batching "
             "are the server's" + (f" ({', '.join(ignored)} did not apply)" if ignored else "")]
    if model_dir is None:
        notes.append(f"the served model was not checked to be GPT-J 6B (its folder on the server: "
                     f"{remote.model_card.get('root', 'unknown')}); --model DIR with its config.json "
                     "would say")
    return notes


def _settle(cfg: MLPerfConfig, setup: _Setup) -> _Setup:
    """LoadGen's settings for the run (SingleStream's expected latency timed on the backend where
    needed), the notes they add (printed, and kept with the others), its log settings and audit
    config -> the setup with them."""
    import mlperf_loadgen as lg

    expected_s = None
    if needs_calibration(cfg):
        print(f"note: timing {CALIBRATION_HOW} for SingleStream's expected latency (--target-latency-ms gives "
              "it instead)", file=sys.stderr)
        expected_s = calibrate_latency(setup.backend, setup.dataset, cfg.gen)
    settings = test_settings(cfg, len(setup.dataset), expected_s)
    performance_samples = min(settings.performance_sample_count_override, len(setup.dataset))
    more = flags_that_do_not_apply(cfg)
    if (count := count_note(cfg, settings, performance_samples)) is not None:
        more.append(count)
    more += invalid_forecast(cfg, settings, performance_samples)
    for note in more:
        print(f"note: {note}", file=sys.stderr)
    log_settings = lg.LogSettings()
    log_settings.log_output.outdir = str(setup.log_dir)
    log_settings.log_output.copy_summary_to_stdout = False
    log_settings.enable_trace = False
    return dataclasses.replace(setup, notes=setup.notes + more, settings=settings,
                               performance_samples=performance_samples,
                               asked=asked_settings(cfg, settings, expected_s), log_settings=log_settings,
                               audit=audit_config_path(cfg, setup.log_dir))


def _results(cfg: MLPerfConfig, setup: _Setup, stats, finished: bool, interrupted: bool,  # noqa: ANN001
             threads: Threads, remote) -> RunResult:  # noqa: ANN001 - an HTTPBackend or None
    """The run's RunResult after LoadGen's test (`stats`: the SUT's; scored in accuracy mode, judged
    in performance mode), its results bundle written; Interrupted after a Ctrl-C, once the bundle is
    written."""
    from gptj.mlperf import report

    log_dir, dataset = setup.log_dir, setup.dataset
    accuracy = None
    if cfg.mode == "accuracy" and not interrupted and cfg.llama:
        from gptj.mlperf import evaluate_llama

        accuracy = evaluate_llama.evaluate_log(log_dir, dataset.references, setup.tokenizer, benchmark=cfg.benchmark,
                                               dtype="int32", expected_samples=len(dataset))
    elif cfg.mode == "accuracy" and not interrupted:
        from gptj.mlperf.evaluate import evaluate_log

        accuracy = evaluate_log(log_dir, dataset.references, tokenizer=setup.tokenizer, expected_samples=len(dataset))
    summary = report.parse_loadgen_summary(log_dir / "mlperf_log_summary.txt") if finished else {}
    remote_info = None
    if remote is not None:
        remote_info = {"url": remote.url, "model": remote.model, "max_model_len": remote.max_model_len,
                       "concurrency": remote.concurrency, "retries": remote.retries}
    if remote is None:
        threads = dataclasses.replace(threads, engine_thread=_ENGINE_THREAD_TORCH_THREADS[0])
    used = report.loadgen_effective(log_dir) if finished else {}
    engine = setup.backend.engine.stats() if remote is None else None  # the engine's thread is idle now
    drafts = {"drafted": engine.draft_tokens, "accepted": engine.accepted_tokens} \
        if engine is not None and cfg.gen.prompt_lookup_num_tokens else None
    result = RunResult(log_dir, summary.get("result_line"), summary.get("metric"), accuracy, stats, setup.notes,
                       remote_info, threads, settings={"asked": setup.asked, "loadgen": used},
                       engine_times=engine.times if engine is not None else None, speculation=drafts)
    if cfg.mode == "performance" and finished:
        result.invalid_reasons = report.invalid_reasons(cfg, summary, result.settings, interrupted, log_dir)
        if cfg.llama:  # MLPerf's llama metric is tokens per second (SingleStream: its latency, as for gptj)
            result.token_latencies = report.token_latencies(log_dir)
            key = next((k for k in ("Completed tokens per second", "Tokens per second") if k in summary), None)
            if key is not None and cfg.scenario != "SingleStream":
                result.metric = f"{key}: {summary[key]}"
    if interrupted:
        result.interrupted = interrupted_logs(log_dir, finished)
    report.write_bundle(cfg, result, dataset, summary)
    if interrupted:
        raise Interrupted(log_dir, finished)
    return result
