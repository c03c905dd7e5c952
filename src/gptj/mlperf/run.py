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
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gptj.decode import GenerationConfig
from gptj.errors import GptjError
from gptj.mlperf.remote import API_KEY_ENV  # with `server`: sent as "Authorization: Bearer KEY" (kept out of the logs)
from gptj.mlperf.sut import SCENARIOS, Batching, default_batching

MODES = ("performance", "accuracy")
MODEL_NAME = "gptj"  # the key of LoadGen's built-in mlperf.conf


@dataclass
class MLPerfConfig:
    model: Path | None = None  # the model folder; with `server`, optional (tokenizer and notes only)
    scenario: str = "Offline"
    mode: str = "accuracy"
    dataset: Path | None = None  # None: the bundled sample set
    max_examples: int | None = None
    log_dir: Path | None = None  # None: mlperf-logs/<timestamp>-<scenario>-<mode>
    user_conf: Path | None = None
    target_qps: float | None = None
    target_latency_ms: float | None = None
    min_duration_ms: int | None = None
    min_query_count: int | None = None
    max_batch_size: int | None = None
    batch_wait_ms: float | None = None
    gen: GenerationConfig = field(default_factory=GenerationConfig.mlperf)
    kv_slots: int | None = None  # None: enough for max_batch_size samples
    quantize: str | None = None  # "int8" / "int4": weight-only, on load
    compile: str = "auto"  # the engine's decode attention by torch.compile: auto / on / off
    kernels: str = "auto"  # the engine's fused blocks and packed weights: auto / off
    group_size: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    progress: bool = True
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    server: str | None = None  # a gptj server's URL: run the samples there, over HTTP
    server_model: str | None = None  # which of its models (None: the only one it serves)
    server_concurrency: int = 64  # requests in flight at once

    def __post_init__(self) -> None:
        if self.model is None and self.server is None:
            raise GptjError("give a model folder (--model DIR), or a server to run against (--server URL)")
        if isinstance(self.server_concurrency, bool) or not isinstance(self.server_concurrency, int) or \
                self.server_concurrency < 1:
            raise GptjError(f"server_concurrency must be an integer >= 1, got {self.server_concurrency!r}")
        if self.scenario not in SCENARIOS:
            raise GptjError(f"unknown scenario {self.scenario!r} (choose from {', '.join(SCENARIOS)})")
        if self.mode not in MODES:
            raise GptjError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.user_conf is not None and not Path(self.user_conf).is_file():
            raise GptjError(f"{self.user_conf}: user.conf not found")

    @property
    def batching(self) -> Batching:
        # A server batches by itself: the SUT forwards each sample at once instead of holding it.
        wait_ms = 0.0 if self.server is not None and self.batch_wait_ms is None else self.batch_wait_ms
        return default_batching(self.scenario, self.max_batch_size, wait_ms)


def official_differences(gen: GenerationConfig) -> list[str]:
    """How `gen` differs from MLPerf gptj-99's generation settings (empty: official)."""
    official = GenerationConfig.mlperf()
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


def test_settings(cfg: MLPerfConfig, performance_sample_count: int):
    """LoadGen settings: its built-in gptj mlperf.conf, then user.conf, then the flags."""
    import mlperf_loadgen as lg

    settings = lg.TestSettings()
    if cfg.user_conf is not None:
        settings.FromConfig(str(cfg.user_conf), MODEL_NAME, cfg.scenario, 1)
    else:
        settings.FromConfig("", MODEL_NAME, cfg.scenario, 0)  # only the built-in mlperf.conf
    settings.scenario = getattr(lg.TestScenario, cfg.scenario)
    settings.mode = lg.TestMode.AccuracyOnly if cfg.mode == "accuracy" else lg.TestMode.PerformanceOnly
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
    if cfg.min_duration_ms is not None:
        settings.min_duration_ms = cfg.min_duration_ms
    if cfg.min_query_count is not None:
        settings.min_query_count = cfg.min_query_count
    return settings


@dataclass
class RunResult:
    log_dir: Path
    result_line: str | None  # LoadGen's "Result is : VALID" line (performance mode)
    metric: str | None  # the scenario's headline number, as LoadGen printed it
    accuracy: object | None  # EvaluationResult (accuracy mode)
    stats: object  # SUTStats
    notes: list[str]
    remote: dict | None = None  # with a server: its url, model, max_model_len, concurrency, 429 retries


# MLPerfConfig fields that only the in-process engine uses, and their defaults.
_ENGINE_ONLY = {"kv_slots": None, "quantize": None, "group_size": None, "compile": "auto", "kernels": "auto",
                "dtype": "float32", "device": "cpu"}


def _engine_backend(cfg: MLPerfConfig, model_dir: Path, longest: int):  # noqa: ANN202
    """The engine on its thread, the model loaded there (a load error is raised here)."""
    from gptj.mlperf.sut import EngineBackend

    return EngineBackend(functools.partial(_build_engine, cfg, model_dir, longest))


def _build_engine(cfg: MLPerfConfig, model_dir: Path, longest: int):  # noqa: ANN202 - Engine
    from gptj.engine import Engine, EngineConfig
    from gptj.engine.kv import groups_from_memory
    from gptj.parallel import lockstep
    from gptj.runtime import parse_dtype

    model = lockstep.load_model(model_dir, parse_dtype(cfg.dtype), cfg.device, quantize=cfg.quantize,
                                group_size=cfg.group_size)
    if longest + cfg.gen.max_new_tokens > model.config.n_positions:
        raise GptjError(f"the longest prompt ({longest} tokens) + max_new_tokens {cfg.gen.max_new_tokens} exceeds "
                        f"the model's {model.config.n_positions} positions")
    # KV memory for max_batch_size samples: a prompt slot each (as long as the longest prompt) and a
    # tail of max_new_tokens per beam; as many as fit in 80% of the free memory if fewer. --kv-slots
    # sets the number of sequences (samples x beams) directly.
    K = cfg.gen.num_beams
    samples = cfg.batching.max_batch_size
    slot_len = longest + cfg.gen.max_new_tokens
    if cfg.kv_slots is None:
        samples = min(samples, groups_from_memory(model.config, model.transformer.wte.weight.dtype,
                                                  model.transformer.wte.weight.device, slot_len, cfg.gen.max_new_tokens, K,
                                                  fraction=0.8))
    n_seqs = cfg.kv_slots or samples * K
    if n_seqs < K:
        raise GptjError(f"KV memory holds {n_seqs} sequences, fewer than num_beams {K}; "
                        "use a smaller --dtype or fewer beams")
    engine_config = EngineConfig(n_slots=n_seqs, slot_len=slot_len, max_new_tokens=cfg.gen.max_new_tokens,
                                 n_prompts=max(1, n_seqs // K), max_batch_size=cfg.batching.max_batch_size * K,
                                 compile=cfg.compile, kernels=cfg.kernels)
    return Engine(model, engine_config)


def _check_fits_server(cfg: MLPerfConfig, backend, longest: int) -> None:  # noqa: ANN001 - HTTPBackend
    limit = backend.max_model_len
    if limit is not None and longest + cfg.gen.max_new_tokens > limit:
        raise GptjError(f"the longest prompt ({longest} tokens) + max_new_tokens {cfg.gen.max_new_tokens} exceeds "
                        f"the server model {backend.model!r}'s max_model_len {limit}")


def run(cfg: MLPerfConfig) -> RunResult:
    import mlperf_loadgen as lg
    from tqdm import tqdm

    from gptj.mlperf import report
    from gptj.mlperf.dataset import Dataset
    from gptj.mlperf.sut import QSL, SUT
    from gptj.tokenizer import tokenizer_for_model

    model_dir = Path(cfg.model) if cfg.model is not None else None
    remote = backend = None
    if cfg.server is not None:
        from gptj.mlperf.remote import HTTPBackend

        if model_dir is not None and not model_dir.is_dir():
            raise GptjError(f"{model_dir}: no such model folder (with --server, --model only supplies the tokenizer)")
        # First, so a wrong URL fails before anything is loaded; its threads start with the first request.
        remote = HTTPBackend(cfg.server, model_name=cfg.server_model, concurrency=cfg.server_concurrency,
                             api_key=os.environ.get(API_KEY_ENV) or None)
    try:
        tokenizer = tokenizer_for_model(model_dir)
        dataset = Dataset.load(cfg.dataset, tokenizer=tokenizer, max_examples=cfg.max_examples)
        longest = max(len(ids) for ids in dataset.input_ids)
        if remote is not None:
            _check_fits_server(cfg, remote, longest)
            backend = remote
        else:
            backend = _engine_backend(cfg, model_dir, longest)
        log_dir = Path(cfg.log_dir) if cfg.log_dir is not None else default_log_dir(cfg.scenario, cfg.mode)
        log_dir.mkdir(parents=True, exist_ok=True)
        notes = report.notes_for(cfg, model_dir, official_differences(cfg.gen))
        if remote is not None:
            ignored = [f"--{k.replace('_', '-')}" for k, v in _ENGINE_ONLY.items() if getattr(cfg, k) != v]
            notes.insert(0, f"samples ran on a remote gptj server: {remote.url}, model {remote.model!r}, "
                            f"{cfg.server_concurrency} requests in flight at most; its dtype, device and batching "
                            "are the server's" + (f" ({', '.join(ignored)} did not apply)" if ignored else ""))
            if model_dir is None:
                notes.insert(1, f"the served model was not checked to be GPT-J 6B (its folder on the server: "
                                f"{remote.model_card.get('root', 'unknown')}); --model DIR with its config.json "
                                "would say")
        for note in notes:
            print(f"note: {note}", file=sys.stderr)

        settings = test_settings(cfg, len(dataset))
        log_settings = lg.LogSettings()
        log_settings.log_output.outdir = str(log_dir)
        log_settings.log_output.copy_summary_to_stdout = False
        log_settings.enable_trace = False
    except BaseException:
        for opened in {id(b): b for b in (remote, backend) if b is not None}.values():
            opened.close()
        raise

    total = len(dataset) if cfg.mode == "accuracy" else None
    bar = tqdm(total=total, desc=f"{cfg.scenario} {cfg.mode}", unit="sample", disable=not cfg.progress)
    qsl = QSL(dataset, settings.performance_sample_count_override)
    sut = SUT(backend, dataset, cfg.gen, cfg.batching, on_complete=bar.update)
    try:
        lg.StartTestWithLogSettings(sut.sut, qsl.qsl, settings, log_settings)
    finally:
        sut.stop()
        qsl.destroy()
        bar.close()
    if sut.error is not None:
        if isinstance(sut.error, GptjError):
            raise sut.error
        raise RuntimeError(f"generation failed during the run: {sut.error!r}") from sut.error

    accuracy = None
    if cfg.mode == "accuracy":
        from gptj.mlperf.evaluate import evaluate_log

        accuracy = evaluate_log(log_dir, dataset.references, tokenizer=tokenizer)
    summary = report.parse_loadgen_summary(log_dir / "mlperf_log_summary.txt")
    remote_info = None
    if remote is not None:
        remote_info = {"url": remote.url, "model": remote.model, "max_model_len": remote.max_model_len,
                       "concurrency": remote.concurrency, "retries": remote.retries}
    result = RunResult(log_dir, summary.get("result_line"), summary.get("metric"), accuracy, sut.stats, notes,
                       remote_info)
    report.write_bundle(cfg, result, dataset, summary)
    return result
