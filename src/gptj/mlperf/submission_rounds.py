"""What differs between the rounds and benchmarks `gptj submission` writes (issue 59): where each file
of the tree goes (the checker's v5 and v6 layouts), the seeds a llama run takes from LoadGen, and how
MLCommons' TEST06 reads a benchmark's accuracy log.

    v5 (gptj-99, round v5.0)          v6 (llama3.1-8b, llama3.1-8b-edge, round v6.1)
    code/gptj/                        src/gptj/
    measurements/<sut>/<b>/<s>/       results/<sut>/<b>/<s>/   measurements.json (was <sut>_gptj_<s>.json),
      user.conf, README.md                                      user.conf, README.md
    compliance/<sut>/<b>/<s>/TEST06/  results/<sut>/<b>/<s>/TEST06/

(the checker's constants.py: SRC_PATH, MEASUREMENTS_PATH, COMPLIANCE_PATH and TEST06_ACC_PATH per round).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gptj.errors import GptjError
from gptj.mlperf.rules import GPTJ_BENCHMARKS, Round

IMPLEMENTATION = "gptj"
GPTJ_EOS_TOKEN_ID = 50256  # GPT-J's end of text (TEST06's EOS check)


@dataclass(frozen=True)
class ScenarioFolders:
    results: Path  # results/<sut>/<benchmark>/<scenario>: accuracy/ and performance/run_1/
    measurements: Path  # the implementation's json, user.conf, README.md
    measurements_json: str  # that json's file name
    compliance: Path  # where MLCommons' verification writes its TEST06/ folder


def source_folder(tree: Path, rnd: Round) -> Path:
    """Where the implementation's source goes (the checker's SRC_PATH)."""
    return tree / ("code" if rnd.layout == "v5" else "src") / IMPLEMENTATION


def scenario_folders(tree: Path, rnd: Round, system: str, benchmark: str, scenario: str) -> ScenarioFolders:
    rel = Path(system) / benchmark / scenario
    results = tree / "results" / rel
    if rnd.layout == "v5":
        return ScenarioFolders(results, tree / "measurements" / rel, f"{system}_{IMPLEMENTATION}_{scenario}.json",
                               tree / "compliance" / rel)
    return ScenarioFolders(results, results, "measurements.json", results)


def loadgen_seeds(loadgen_model: str, scenario: str) -> dict[str, int]:
    """The seeds of LoadGen's built-in mlperf.conf for a model name and (LoadGen's) scenario."""
    import mlperf_loadgen as lg

    settings = lg.TestSettings()
    settings.FromConfig("", loadgen_model, scenario, 0)
    return {key: getattr(settings, key) for key in ("qsl_rng_seed", "sample_index_rng_seed", "schedule_rng_seed")}


def check_loadgen_seeds(benchmark: str, loadgen_model: str, scenario: str, rnd: Round) -> None:
    """A llama run takes LoadGen's built-in seeds: they must be the round's (else the checker rejects
    every result), which only a LoadGen of that round has. Said in one line before any run."""
    if benchmark in GPTJ_BENCHMARKS:
        return  # gptj runs set the round's seeds themselves (MLPerfConfig.round)
    found = loadgen_seeds(loadgen_model, scenario)
    if found != rnd.seeds:
        from importlib import metadata

        try:
            version = metadata.version("mlcommons-loadgen")
        except metadata.PackageNotFoundError:
            version = "?"
        raise GptjError(f"LoadGen {version}'s built-in mlperf.conf has other seeds for {loadgen_model} than round "
                        f"{rnd.name}'s (qsl_rng_seed {found['qsl_rng_seed']}, not {rnd.seeds['qsl_rng_seed']}): "
                        f"install the mlcommons-loadgen of round {rnd.name}")


def test06_arguments(benchmark: str, model: Path | None) -> tuple[int, str]:
    """(EOS id, token id dtype) for MLCommons' TEST06 run_verification.py: GPT-J's 50256 in int64;
    a llama model's tokenizer's EOS (tokenizer_config.json's eos_token) in int32, as its SUT logs."""
    if benchmark in GPTJ_BENCHMARKS:
        return GPTJ_EOS_TOKEN_ID, "int64"
    if model is None:
        raise GptjError(f"TEST06 of {benchmark} needs the model folder (its tokenizer's EOS id)")
    from gptj.tokenizer import load_tokenizer

    return load_tokenizer(model).eos_token_id, "int32"
