"""What MLPerf Inference requires of a gptj-99 (round v5.0) or llama3.1-8b / llama3.1-8b-edge (round v6.1,
at the end of this file) submission, per round: plain facts, cited, in one place.

Sources (facts, not code): MLCommons' submission checker, tools/submission/submission_checker/
constants.py of mlcommons/inference (b66003e, Aug 2026), and LoadGen's built-in mlperf.conf.

- The checker knows gptj-99 / gptj-99.9 only in its "v5.0" tables: v5.1 (and later) dropped
  GPT-J, so `--version v5.1` crashes its loader on a closed gptj result and fails every open one
  ("model not known"). v5.0 is the round a gptj submission can target; the others are refused here.
- LoadGen's built-in mlperf.conf (LoadGen >= 4.1 reads no mlperf.conf file) holds gptj's settings:
  performance_sample_count 13,368, equal-issue mode, min duration 600 s, Offline min_query_count
  13,368, Server target latency 20 s, inferred token latencies (scaling factor 69). Only the seeds
  change from round to round; a run for a round sets that round's seeds (the checker's "seeds").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gptj.errors import GptjError

BENCHMARKS = ("gptj-99", "gptj-99.9")
# The closed division allows quantization calibrated on MLPerf's calibration list for gpt-j only
# (mlcommons/inference, language/gpt-j: 1,000 CNN-DailyMail training-set articles), never on the
# evaluation set.
CALIBRATION_LIST = "cnn_dailymail_calibration.json"
DIVISIONS = ("closed", "open")
CATEGORIES = ("edge", "datacenter")
STATUSES = ("available", "preview", "rdi")  # the checker's VALID_AVAILABILITIES


@dataclass(frozen=True)
class Round:
    name: str
    seeds: dict[str, int]  # LoadGen TestSettings attribute -> the round's value
    scenarios: dict[str, tuple[str, ...]]  # category -> required scenarios (closed: exactly these)
    compliance: tuple[str, ...]  # compliance tests a closed result needs
    dataset_size: int = 13368  # the accuracy run must cover all of it (every division)
    performance_sample_count: int = 13368  # at least this many performance samples
    # category -> scenarios of which a closed result needs at least one (llama3.1-8b: Server, Interactive)
    optional: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the tree's layout: "v5" (measurements/, compliance/ and code/ beside results/) or "v6" (from v6.0:
    # measurements.json, user.conf, README.md and the compliance folders in results/<sut>/<benchmark>/
    # <scenario>/, the source in src/)
    layout: str = "v5"


ROUNDS = {
    "v5.0": Round(
        name="v5.0",
        seeds={"qsl_rng_seed": 6023615788873153749, "sample_index_rng_seed": 15036839855038426416,
               "schedule_rng_seed": 9933818062894767841},
        scenarios={"datacenter": ("Offline", "Server"), "edge": ("Offline", "SingleStream")},
        compliance=("TEST06",),
    ),
}
DEFAULT_ROUND = "v5.0"

# Compliance tests that read each answer's token count and first token from the accuracy log (TEST06's
# sample-length and first-token checks): LoadGen logs them only with use_token_latencies, which gptj's
# mlperf.conf leaves off (it infers token latencies instead).
TOKEN_COUNT_TESTS = ("TEST06",)

# Rounds whose checker has no gptj: asking for one is an error that says so.
DROPPED = ("v5.1", "v6.0", "v6.1")


def get_round(name: str) -> Round:
    if name in ROUNDS:
        return ROUNDS[name]
    if name in DROPPED:
        raise GptjError(f"MLPerf Inference {name} has no GPT-J benchmark (its submission checker knows gptj-99 and "
                        f"gptj-99.9 only in round v5.0): use --round v5.0")
    raise GptjError(f"unknown MLPerf round {name!r} (gptj can target: {', '.join(ROUNDS)})")


def apply_seeds(settings, round_name: str) -> None:  # noqa: ANN001 - a LoadGen TestSettings
    """Give LoadGen's settings the round's seeds (everything else of gptj's conf is LoadGen's own)."""
    for key, value in get_round(round_name).seeds.items():
        setattr(settings, key, value)


def required_scenarios(round_name: str, category: str) -> tuple[str, ...]:
    if category not in CATEGORIES:
        raise GptjError(f"unknown category {category!r} (choose from {', '.join(CATEGORIES)})")
    return get_round(round_name).scenarios[category]


def compliance_tests(round_name: str, division: str) -> tuple[str, ...]:
    """The compliance tests the checker reads for a gptj result (it checks none in the open division)."""
    return get_round(round_name).compliance if division == "closed" else ()


# ----------------------------------------------------------------- llama3.1-8b accuracy (issue 59)


@dataclass(frozen=True)
class LlamaAccuracy:
    """One llama3.1-8b benchmark's accuracy rule: ROUGE F-measures (%, 4 decimals, as MLCommons'
    language/llama3.1-8b/evaluation.py prints them) each >= `rouge_fraction` of the BF16 reference's,
    and gen_len (characters of the post-processed predictions) within [gen_len_low, gen_len_high] x
    the reference's, over the whole data set of `dataset_size` samples."""

    benchmark: str
    reference_rouge: dict[str, float]  # rouge1, rouge2, rougeL, rougeLsum
    reference_gen_len: int
    dataset_size: int
    rouge_fraction: float = 0.99
    gen_len_low: float = 0.9
    gen_len_high: float = 1.1


# The BF16 reference's scores: language/llama3.1-8b/README.md, "Accuracy Target" (datacenter) and its
# "Edge" subsection, which are also the submission checker's tables (tools/submission/
# submission_checker/constants.py: "accuracy-target" 0.99 x each ROUGE and 0.9 x GEN_LEN,
# "accuracy-upper-limit" 1.1 x GEN_LEN, "accuracy-sample-count"/"performance-sample-count" 13,368 and
# 5,000). The edge set is the README's 5,000-sample `sample_cnn_eval_5000.json`.
LLAMA_ACCURACY = {
    "llama3.1-8b": LlamaAccuracy(
        "llama3.1-8b", {"rouge1": 38.7792, "rouge2": 15.9075, "rougeL": 24.4957, "rougeLsum": 35.793},
        reference_gen_len=8167644, dataset_size=13368),
    "llama3.1-8b-edge": LlamaAccuracy(
        "llama3.1-8b-edge", {"rouge1": 39.06, "rouge2": 16.1147, "rougeL": 24.6375, "rougeLsum": 36.124},
        reference_gen_len=3051113, dataset_size=5000),
}


def llama_accuracy(benchmark: str) -> LlamaAccuracy:
    if benchmark not in LLAMA_ACCURACY:
        raise GptjError(f"unknown llama benchmark {benchmark!r} (one of {', '.join(LLAMA_ACCURACY)})")
    return LLAMA_ACCURACY[benchmark]


# ----------------------------------------------------------------- which benchmark a run is (issue 59)

GPTJ_BENCHMARKS = BENCHMARKS
LLAMA_BENCHMARKS = tuple(LLAMA_ACCURACY)
RUN_BENCHMARKS = GPTJ_BENCHMARKS + LLAMA_BENCHMARKS  # what `gptj mlperf --benchmark` runs
# config.json's model_type each benchmark's model has (gptj.models.registry's architectures)
ARCHITECTURE = {"gptj-99": "gptj", "gptj-99.9": "gptj", "llama3.1-8b": "llama", "llama3.1-8b-edge": "llama"}
DEFAULT_BENCHMARK = {"gptj": "gptj-99", "llama": "llama3.1-8b"}  # by architecture

# The scenarios each benchmark runs in. gptj: any of LoadGen's three (as before; the submission
# checker's v5.0 tables ask datacenter Offline + Server, edge Offline + SingleStream). llama3.1-8b:
# the checker's datacenter tables (constants.py, "required-scenarios-datacenter" Offline, "optional-
# scenarios-datacenter" Interactive and Server); llama3.1-8b-edge: its edge tables, SingleStream
# and Offline. Interactive is LoadGen's Server scenario under the model name llama3_1-8b-interactive.
SCENARIOS = {
    "gptj-99": ("Offline", "Server", "SingleStream"), "gptj-99.9": ("Offline", "Server", "SingleStream"),
    "llama3.1-8b": ("Offline", "Server", "Interactive"), "llama3.1-8b-edge": ("Offline", "SingleStream"),
}

# Token latency limits (p99, ms): LoadGen's built-in mlperf.conf, llama3_1-8b.Server.ttft_latency /
# tpot_latency and llama3_1-8b-interactive.Server's (also the checker's LLM_LATENCY_LIMITS).
TOKEN_LATENCY_LIMITS_MS = {("llama3.1-8b", "Server"): {"ttft": 2000, "tpot": 100},
                           ("llama3.1-8b", "Interactive"): {"ttft": 500, "tpot": 30}}


def check_benchmark(benchmark: str) -> str:
    if benchmark not in RUN_BENCHMARKS:
        raise GptjError(f"unknown benchmark {benchmark!r} (choose from {', '.join(RUN_BENCHMARKS)})")
    return benchmark


def check_scenario(benchmark: str, scenario: str) -> None:
    """A one-line GptjError where `benchmark` has no `scenario`."""
    allowed = SCENARIOS[check_benchmark(benchmark)]
    if scenario not in allowed:
        whose = [b for b in RUN_BENCHMARKS if scenario in SCENARIOS[b] and ARCHITECTURE[b] == ARCHITECTURE[benchmark]]
        why = f" ({scenario} is {' and '.join(whose)}'s)" if whose else ""
        raise GptjError(f"{benchmark} has no {scenario} scenario{why}: choose from {', '.join(allowed)}")


def loadgen_model_name(benchmark: str, scenario: str) -> str:
    """The model name LoadGen's mlperf.conf and user.conf know the run by."""
    if benchmark in GPTJ_BENCHMARKS:
        return "gptj"
    name = benchmark.replace("3.1", "3_1")  # llama3_1-8b, llama3_1-8b-edge
    return f"{name}-interactive" if scenario == "Interactive" else name


# ----------------------------------------------------------------- llama3.1-8b submissions (issue 59)

# The newest round of the submission checker's tables (MODEL_CONFIG's keys v5.0, v5.1, v6.0, v6.1)
# with llama3.1-8b and llama3.1-8b-edge is v6.1. Its seeds are those of LoadGen's built-in mlperf.conf
# (mlcommons-loadgen 6.0), which a llama run uses as it is (--round sets gptj-99's seeds only): so v6.1
# is the round gptj submits llama for, checked against LoadGen before any run
# (gptj.mlperf.submission_rounds.check_loadgen_seeds). v6.1's tables: llama3.1-8b is a datacenter
# benchmark, Offline required and Server or Interactive (at least one) besides; llama3.1-8b-edge an edge
# one, Offline and SingleStream; TEST06 for llama3.1-8b (models_TEST06, Interactive included), no
# compliance test for llama3.1-8b-edge; 13,368 and 5,000 samples; results in v6's layout.
LLAMA_ROUND = "v6.1"
_V6_1_SEEDS = {"qsl_rng_seed": 2085463073848966840, "sample_index_rng_seed": 2747215439041700203,
               "schedule_rng_seed": 16159082839903944936}
LLAMA_ROUNDS = {
    "llama3.1-8b": {"v6.1": Round(
        name="v6.1", seeds=_V6_1_SEEDS, scenarios={"datacenter": ("Offline",)}, compliance=("TEST06",),
        optional={"datacenter": ("Server", "Interactive")}, layout="v6")},
    "llama3.1-8b-edge": {"v6.1": Round(
        name="v6.1", seeds=_V6_1_SEEDS, scenarios={"edge": ("Offline", "SingleStream")}, compliance=(),
        dataset_size=5000, performance_sample_count=5000, layout="v6")},
}
SUBMISSION_BENCHMARKS = GPTJ_BENCHMARKS + LLAMA_BENCHMARKS  # what `gptj submission --benchmark` takes


def default_round(benchmark: str) -> str:
    return LLAMA_ROUND if benchmark in LLAMA_ROUNDS else DEFAULT_ROUND


def submission_round(benchmark: str, name: str | None = None) -> Round:
    """What round `name` (None: the benchmark's default) requires of a `benchmark` submission."""
    if benchmark not in LLAMA_ROUNDS:
        return get_round(name or DEFAULT_ROUND)
    name = name or LLAMA_ROUND
    if name not in LLAMA_ROUNDS[benchmark]:
        raise GptjError(f"gptj submits {benchmark} for MLPerf Inference {LLAMA_ROUND} only (the newest round of "
                        f"MLCommons' checker, whose seeds are LoadGen's built-in ones that llama runs use), "
                        f"not {name}: use --round {LLAMA_ROUND}")
    return LLAMA_ROUNDS[benchmark][name]


def submission_categories(benchmark: str, round_name: str | None = None) -> tuple[str, ...]:
    return tuple(submission_round(benchmark, round_name).scenarios)


def submission_scenarios(benchmark: str, round_name: str | None, category: str,
                         asked: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The scenarios a submission runs: `asked`, checked against the round's required and optional ones
    (None: the required ones and the first optional one, e.g. llama3.1-8b's Offline and Server)."""
    rnd = submission_round(benchmark, round_name)
    if category not in rnd.scenarios:
        raise GptjError(f"{benchmark} has no {category} category in round {rnd.name}: use --category "
                        f"{' or '.join(rnd.scenarios)}")
    required, optional = rnd.scenarios[category], rnd.optional.get(category, ())
    if asked is None:
        return required + optional[:1]
    unknown = [s for s in asked if s not in required + optional]
    missing = [s for s in required if s not in asked]
    if unknown or missing or (optional and not set(optional) & set(asked)) or len(set(asked)) != len(asked):
        need = " and ".join(required) + (f", and {' and/or '.join(optional)}" if optional else "")
        article = "an" if category[0] in "aeiou" else "a"
        raise GptjError(f"--scenarios {','.join(asked)}: {article} {category} {benchmark} submission in round "
                        f"{rnd.name} runs {need}")
    return tuple(s for s in required + optional if s in asked)
