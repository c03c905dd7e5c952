"""`gptj mlperf`: one LoadGen run (scenario x mode) and its results bundle.

    config -> dataset (tokenized into RAM) -> model -> QSL + SUT -> LoadGen -> log folder:
        mlperf_log_{summary,detail,accuracy,trace}  (LoadGen's own)
        run.json       the exact command, settings, generation config, SUT batching stats
        system.json    CPU/GPU, torch, dtype, versions
        accuracy.json  ROUGE scores and pass/fail (accuracy mode)
        latency.png    latency distribution (performance mode)
        summary.md     what a person reads first
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gptj.decode import GenerationConfig
from gptj.errors import GptjError
from gptj.mlperf.sut import SCENARIOS, Batching, default_batching

MODES = ("performance", "accuracy")
MODEL_NAME = "gptj"  # the key of LoadGen's built-in mlperf.conf


@dataclass
class MLPerfConfig:
    model: Path
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

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise GptjError(f"unknown scenario {self.scenario!r} (choose from {', '.join(SCENARIOS)})")
        if self.mode not in MODES:
            raise GptjError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.user_conf is not None and not Path(self.user_conf).is_file():
            raise GptjError(f"{self.user_conf}: user.conf not found")

    @property
    def batching(self) -> Batching:
        return default_batching(self.scenario, self.max_batch_size, self.batch_wait_ms)


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


def run(cfg: MLPerfConfig) -> RunResult:
    import mlperf_loadgen as lg
    from tqdm import tqdm

    from gptj.mlperf import report
    from gptj.mlperf.dataset import Dataset
    from gptj.engine import EngineConfig
    from gptj.engine.kv import groups_from_memory
    from gptj.mlperf.sut import QSL, SUT, EngineBackend
    from gptj.runtime import parse_dtype, resolve_device
    from gptj.tokenizer import tokenizer_for_model
    from gptj.weights.io import load_model

    model_dir = Path(cfg.model)
    tokenizer = tokenizer_for_model(model_dir)
    dataset = Dataset.load(cfg.dataset, tokenizer=tokenizer, max_examples=cfg.max_examples)
    model = load_model(model_dir, dtype=parse_dtype(cfg.dtype), device=resolve_device(cfg.device),
                       quantize=cfg.quantize, group_size=cfg.group_size)
    longest = max(len(ids) for ids in dataset.input_ids)
    if longest + cfg.gen.max_new_tokens > model.config.n_positions:
        raise GptjError(f"the longest prompt ({longest} tokens) + max_new_tokens {cfg.gen.max_new_tokens} exceeds "
                        f"the model's {model.config.n_positions} positions")

    log_dir = Path(cfg.log_dir) if cfg.log_dir is not None else default_log_dir(cfg.scenario, cfg.mode)
    log_dir.mkdir(parents=True, exist_ok=True)
    notes = report.notes_for(cfg, model_dir, official_differences(cfg.gen))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)

    settings = test_settings(cfg, len(dataset))
    log_settings = lg.LogSettings()
    log_settings.log_output.outdir = str(log_dir)
    log_settings.log_output.copy_summary_to_stdout = False
    log_settings.enable_trace = False

    total = len(dataset) if cfg.mode == "accuracy" else None
    bar = tqdm(total=total, desc=f"{cfg.scenario} {cfg.mode}", unit="sample", disable=not cfg.progress)
    qsl = QSL(dataset, settings.performance_sample_count_override)
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
    backend = EngineBackend(model, engine_config)
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
    result = RunResult(log_dir, summary.get("result_line"), summary.get("metric"), accuracy, sut.stats, notes)
    report.write_bundle(cfg, result, dataset, summary)
    return result
