"""The plain data of one `gptj mlperf` run: its settings (MLPerfConfig), the compute threads it
chose (Threads) and what it produced (RunResult). run.py does the run; report.py writes it up;
both import these from here, below either of them."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gptj.decode import GenerationConfig
from gptj.engine.config import EngineConfig
from gptj.errors import GptjError
from gptj.mlperf.sut import SCENARIOS, Batching, default_batching
from gptj.runtime.spec import ModelSpec

MODES = ("performance", "accuracy")
MODEL_NAME = "gptj"  # the key of LoadGen's built-in mlperf.conf (gptj-99; rules.loadgen_model_name: any benchmark)


def model_architecture(model_dir: Path | str | None) -> str | None:
    """The model folder's config.json model_type ("gptj", "llama"); None where there is no folder or no
    readable config.json (a slim GPT-J checkpoint has none): loading the model says what is wrong."""
    import json

    if model_dir is None:
        return None
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) else None


def choose_benchmark(benchmark: str | None, model_dir: Path | str | None) -> str:
    """`benchmark` as asked (checked to fit the model folder's architecture), else the architecture's
    (gptj-99 for GPT-J, llama3.1-8b for Llama; gptj-99 where the folder does not say)."""
    from gptj.mlperf import rules

    arch = model_architecture(model_dir)
    if benchmark is None:
        return rules.DEFAULT_BENCHMARK.get(arch or "gptj", "gptj-99")
    rules.check_benchmark(benchmark)
    if arch is not None and arch in rules.DEFAULT_BENCHMARK and rules.ARCHITECTURE[benchmark] != arch:
        raise GptjError(f"--benchmark {benchmark} needs a {rules.ARCHITECTURE[benchmark]} model, and {model_dir} is "
                        f"{arch} (its benchmark: {rules.DEFAULT_BENCHMARK[arch]})")
    return benchmark


def llama_generation(tokenizer=None, **overrides: object) -> GenerationConfig:  # noqa: ANN001 - a Tokenizer
    """MLPerf llama3.1-8b's generation (language/llama3.1-8b/SUT_VLLM.py's sampling parameters):
    greedy (temperature 0, top_k 1), 1 to 128 new tokens, no beam search, stopping at any of the
    tokenizer's EOS ids (vLLM's stop ids; None: the EOS ids are set later, run.with_tokenizer_eos)."""
    eos = {} if tokenizer is None else {"eos_token_id": tuple(tokenizer.eos_token_ids),
                                        "pad_token_id": tokenizer.pad_token_id}
    return GenerationConfig(**{"num_beams": 1, "min_new_tokens": 1, "max_new_tokens": 128, **eos, **overrides})


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
    # LoadGen's max_query_count for a SingleStream or Server run (None or 0: no cap; below LoadGen's
    # minimum query count, the run is INVALID)
    max_query_count: int | None = None
    performance_sample_count: int | None = None  # None: mlperf.conf's (13,368), at most the data set's size
    audit_config: Path | None = None  # a compliance test's audit.config (None: none, whatever the cwd holds)
    # LoadGen's use_token_latencies: it logs each answer's token count, and its first token (TEST06
    # checks both); beam search reports an answer's first token when the search ends
    token_latencies: bool = False
    round: str | None = None  # an MLPerf round's seeds (rules.ROUNDS); None: LoadGen's built-in mlperf.conf's
    max_batch_size: int | None = None  # samples per batch (the SUT's; the engine runs x num_beams sequences)
    batch_wait_ms: float | None = None
    gen: GenerationConfig | None = None  # None: the benchmark's (GenerationConfig.mlperf(), llama_generation())
    spec: ModelSpec = field(default_factory=ModelSpec)  # how the model runs here (its path: `model`)
    # the engine's size as asked; max_seqs / max_len not given come from the run (see run.engine_config)
    engine: EngineConfig = field(default_factory=EngineConfig)
    threads: int | None = None  # torch compute threads; None: the usable cores less gptj.threads.RESERVED_CORES
    progress: bool = True
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    server: str | None = None  # a gptj server's URL: run the samples there, over HTTP
    server_model: str | None = None  # which of its models (None: the only one it serves)
    server_concurrency: int = 64  # requests in flight at once
    # gptj-99, gptj-99.9, llama3.1-8b, llama3.1-8b-edge (rules.RUN_BENCHMARKS); None: the model folder's
    # architecture's (choose_benchmark). Its generation is `gen`'s: run_config / llama_generation.
    benchmark: str | None = None
    # llama3.1-8b's Interactive scenario: LoadGen's Server (which `scenario` then says) with the conf of
    # llama3_1-8b-interactive (scenario="Interactive" is taken as scenario "Server", interactive True)
    interactive: bool = False

    def __post_init__(self) -> None:
        if self.model is None and self.server is None:
            raise GptjError("give a model folder (--model DIR), or a server to run against (--server URL)")
        if self.scenario == "Interactive":
            self.scenario, self.interactive = "Server", True
        self.benchmark = choose_benchmark(self.benchmark, self.model)
        if self.scenario in SCENARIOS:
            from gptj.mlperf.rules import check_scenario

            check_scenario(self.benchmark, self.scenario_name)
        if self.interactive and self.scenario != "Server":
            raise GptjError(f"the Interactive scenario is LoadGen's Server, not {self.scenario}")
        if self.gen is None:
            self.gen = llama_generation() if self.llama else GenerationConfig.mlperf()
        if self.llama and self.round is not None:
            raise GptjError(f"--round sets gptj-99's round seeds (v5.0): a {self.benchmark} run takes LoadGen's "
                            "built-in mlperf.conf's seeds")
        if self.server is not None and self.gen.prompt_lookup_num_tokens:
            raise GptjError("--speculate with --server: the server drafts as its own --speculate says "
                            "(gptj serve --speculate ngram)")
        if isinstance(self.server_concurrency, bool) or not isinstance(self.server_concurrency, int) or \
                self.server_concurrency < 1:
            raise GptjError(f"server_concurrency must be an integer >= 1, got {self.server_concurrency!r}")
        if self.scenario not in SCENARIOS:
            raise GptjError(f"unknown scenario {self.scenario!r} (choose from {', '.join(SCENARIOS)})")
        if self.mode not in MODES:
            raise GptjError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.threads is not None:
            from gptj.threads import compute_threads

            compute_threads(self.threads)  # a bad value fails here, in one line
        if self.user_conf is not None and not Path(self.user_conf).is_file():
            raise GptjError(f"{self.user_conf}: user.conf not found")
        if self.audit_config is not None and not Path(self.audit_config).is_file():
            raise GptjError(f"{self.audit_config}: audit config not found")
        if self.round is not None:
            from gptj.mlperf.rules import get_round

            get_round(self.round)
        if self.min_query_count is not None and self.max_query_count and self.max_query_count < self.min_query_count:
            raise GptjError(f"--max-query-count {self.max_query_count} is below --min-query-count "
                            f"{self.min_query_count}")

    @property
    def llama(self) -> bool:
        return self.benchmark != "gptj-99" and self.benchmark != "gptj-99.9"

    @property
    def scenario_name(self) -> str:
        """The scenario as MLPerf names it: Interactive for llama3.1-8b's, else LoadGen's."""
        return "Interactive" if self.interactive else self.scenario

    @property
    def loadgen_model(self) -> str:
        """The model name of LoadGen's mlperf.conf / user.conf keys for this run."""
        from gptj.mlperf.rules import loadgen_model_name

        return loadgen_model_name(self.benchmark, self.scenario_name)

    def identity(self) -> dict:
        """What makes two runs the same run (JSON values): recorded in run.json, compared when a
        submission reuses or assembles runs already made. Not where the logs go, threads or bars."""
        import hashlib

        def path(p: Path | str | None) -> str | None:
            return None if p is None else str(Path(p).resolve())

        def content(p: Path | None) -> str | None:
            return None if p is None else hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16]

        llama = {"benchmark": self.benchmark, "interactive": self.interactive} if self.llama else {}
        return {
            **llama, "scenario": self.scenario, "mode": self.mode, "model": path(self.model), "server": self.server,
            "dataset": path(self.dataset), "max_examples": self.max_examples, "round": self.round,
            "token_latencies": self.token_latencies,
            "generation": dataclasses.asdict(self.gen),
            "spec": {k: v for k, v in dataclasses.asdict(self.spec).items() if k != "path"},
            "user_conf": content(self.user_conf), "audit_config": content(self.audit_config),
            "run_length": {k: getattr(self, k) for k in (
                "target_qps", "target_latency_ms", "min_duration_ms", "min_query_count", "max_query_count",
                "performance_sample_count")},
        }

    @property
    def batching(self) -> Batching:
        # A server batches by itself: the SUT forwards each sample at once instead of holding it.
        wait_ms = 0.0 if self.server is not None and self.batch_wait_ms is None else self.batch_wait_ms
        from gptj.device import named_device

        return default_batching(self.scenario, self.max_batch_size, wait_ms, named_device(self.spec.device).type)


@dataclass(frozen=True)
class Threads:
    """The compute threads a run used, and why."""

    compute: int
    requested: int | None  # --threads
    usable_cores: int
    reserve: int  # cores kept for LoadGen and the SUT (0 when --threads decides)
    why: str
    engine_thread: int | None = None  # torch.get_num_threads() on the engine's thread (None: remote)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class RunResult:
    log_dir: Path
    result_line: str | None  # LoadGen's "Result is : VALID" line (performance mode)
    metric: str | None  # the scenario's headline number, as LoadGen printed it
    accuracy: object | None  # EvaluationResult (accuracy mode)
    stats: object  # SUTStats
    notes: list[str]
    remote: dict | None = None  # with a server: its url, model, max_model_len, concurrency, 429 retries
    threads: Threads | None = None
    interrupted: dict | None = None  # after a Ctrl-C: what LoadGen left (see gptj.mlperf.loadgen.interrupted_logs)
    settings: dict | None = None  # {"asked": asked_settings(), "loadgen": what LoadGen's detail log says it used}
    engine_times: object | None = None  # the local engine's StepTimes over the run (None: a remote server's)
    # --speculate: the local engine's draft tokens verified and accepted over the run (None: no speculation)
    speculation: dict | None = None
    # an INVALID performance run: each condition LoadGen found unmet, why, and the setting that fixes it
    invalid_reasons: list[str] = field(default_factory=list)
    # llama performance runs: LoadGen's TTFT / TPOT (report.token_latencies: p99, mean, limits; ns)
    token_latencies: dict | None = None
