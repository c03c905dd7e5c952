"""`gptj submission --benchmark llama3.1-8b | llama3.1-8b-edge` (issue 59): a tiny Llama's runs written as a
round v6.1 tree (the newest round of MLCommons' checker with llama3.1-8b) that the checker reads, its only
errors those a shortened run on a 4-sample set causes; the round's rules as gptj holds them, checked
against the checker's own tables; bad input in one line before any run.

MLCommons' checker and TEST06 are used from ../shared/mlperf-inference (as tests/test_mlperf_submission.py);
the tests that need them skip, saying so, where it is absent."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from gptj.cli import EXIT_CHECKER_ERRORS, main
from gptj.mlperf import rules, submission, submission_rounds

from test_mlperf_llama_run import llama_dir, short_set  # noqa: F401 - the tiny Llama and its short prompts
from test_mlperf_submission import HAS_CHECKER, INFERENCE, checker_errors, complete_desc, unexpected

pytestmark = pytest.mark.usefixtures("keep_torch_threads")
needs_inference = pytest.mark.skipif(
    not HAS_CHECKER,
    reason=f"MLCommons' submission checker is not at {INFERENCE} (a copy of github.com/mlcommons/inference)")

# Short runs: each flag shortens what an official run must have; the checker's errors about exactly that
# are the only ones allowed. 64 SingleStream queries: the fewest with which LoadGen's early stopping judges.
# Offline issues one query of max(64, target_qps x 0.2 s x 1.1) samples, which must last the 200 ms: at
# --target-qps 1000 that is 220 samples (a fast CPU ran this tiny model at 390 samples/s, so 64 ended early).
SHORT = ["--min-duration-ms", "200", "--min-query-count", "64", "--max-new-tokens", "8", "--target-qps", "1000",
         "--quiet"]


def allowed_errors(samples: int, dataset: int) -> dict[str, str]:
    return {
        # the short set has `samples` samples: the official run has `dataset` performance samples ...
        "performance sample count": rf"performance_sample_count, found {samples}, needs to be >= {dataset}",
        # ... and its accuracy run covers all of them (the checker's spelling)
        "accuracy data set size": rf"accurcy run does not cover all dataset, accuracy samples: {samples}, "
                                  rf"dataset size: {dataset}",
        # --min-duration-ms 200 (official: 600 s)
        "min duration": r"Test duration less than 600s in user config\. expected=600000, found=200",
        # the consequences of the above, as the checker sums them up
        "a check group failed": r"Some (performance|accuracy) checks Checks failed for: ",
        "no result": r"NoResults ",
        "summary": r"SUMMARY: submission has errors",
    }


def submit(llama_dir, short_set, root: Path, benchmark: str, *extra: str, division="open"):  # noqa: F811
    runs = root / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    complete_desc(runs / "system_desc.json")
    return main(["submission", "--model", str(llama_dir), "--benchmark", benchmark, "--dataset", str(short_set),
                 "--out", str(root / "out"), "--runs-dir", str(runs), "--submitter", "gptjteam",
                 "--system-name", "cpu2", "--division", division, *SHORT, *extra])


@pytest.fixture(scope="module")
def edge_submission(llama_dir, short_set, tmp_path_factory):  # noqa: F811
    """One short open llama3.1-8b-edge submission (SingleStream + Offline), made once. Returns its folder and
    what the command printed."""
    root = tmp_path_factory.mktemp("edge")
    extra = ["--mlperf-inference", str(INFERENCE)] if HAS_CHECKER else []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = submit(llama_dir, short_set, root, "llama3.1-8b-edge", *extra)
    assert rc == (EXIT_CHECKER_ERRORS if HAS_CHECKER else 0), err.getvalue()[-2000:]
    return root, out.getvalue(), err.getvalue()


def test_edge_tree_is_in_round_v6_1s_layout(edge_submission):
    made, out, err = edge_submission
    tree = made / "out" / "open" / "gptjteam"
    assert err.count("->") == 4  # four runs: each scenario's performance and accuracy (no TEST06 for edge)
    assert (tree / "src" / "gptj" / "mlperf" / "submission.py").is_file() and not (tree / "code").exists()
    assert not (tree / "measurements").exists() and not (tree / "compliance").exists()
    system = json.loads((tree / "systems" / "cpu2.json").read_text())
    assert system["system_type"] == "edge" and system["division"] == "open"
    assert sorted(p.name for p in (tree / "results" / "cpu2" / "llama3.1-8b-edge").iterdir()) == \
        ["Offline", "SingleStream"]
    for scenario in ("Offline", "SingleStream"):
        folder = tree / "results" / "cpu2" / "llama3.1-8b-edge" / scenario
        assert sorted(p.name for p in folder.iterdir()) == \
            ["README.md", "accuracy", "measurements.json", "performance", "user.conf"]
        assert set(json.loads((folder / "measurements.json").read_text())) >= {
            "input_data_types", "retraining", "starting_weights_filename", "weight_data_types",
            "weight_transformations"}
        conf = (folder / "user.conf").read_text()
        assert f"llama3_1-8b-edge.{scenario}.min_duration = 200" in conf and "(its seeds, round v6.1's)" in conf
        assert "`src/gptj`" in (folder / "README.md").read_text()
        summary = (folder / "performance" / "run_1" / "mlperf_log_summary.txt").read_text()
        assert f"Scenario : {scenario}" in summary and "Result is : VALID" in summary
        lines = (folder / "accuracy" / "accuracy.txt").read_text().splitlines()
        # MLCommons' evaluation.py's printed dict: ROUGE as quoted strings, gen_len and gen_num as integers
        assert re.fullmatch(r"\{'rouge1': '[\d.]+', 'rouge2': '[\d.]+', 'rougeL': '[\d.]+', 'rougeLsum': '[\d.]+', "
                            r"'gen_len': \d+, 'gen_num': 4\}", lines[0]), lines[0]
        original = made / "runs" / scenario / "accuracy" / "mlperf_log_accuracy.json"
        assert lines[-1] == f"hash={hashlib.sha256(original.read_bytes()).hexdigest()}"
        detail = (folder / "performance" / "run_1" / "mlperf_log_detail.txt").read_text()
        for key, value in rules.LLAMA_ROUNDS["llama3.1-8b-edge"]["v6.1"].seeds.items():  # the round's seeds
            assert f'"key": "effective_{key}", "value": {value},' in detail


def test_assembling_again_reuses_every_run_and_gives_the_same_tree(edge_submission, llama_dir, short_set,  # noqa: F811
                                                                   tmp_path, capsys):
    made = edge_submission[0]
    for name in ("runs", "out"):
        shutil.copytree(made / name, tmp_path / name)
    tree = tmp_path / "out" / "open" / "gptjteam"

    def files():
        return {p.relative_to(tree): p.read_bytes() for p in tree.rglob("*") if p.is_file() and p.name != "README.md"}

    before = files()
    assert submit(llama_dir, short_set, tmp_path, "llama3.1-8b-edge", "--assemble-only", "--force") == 0
    err = capsys.readouterr().err
    assert err.count("reusing") == 4 and "->" not in err
    assert files() == before
    # a run of other settings is named, and the tree left as it was
    assert submit(llama_dir, short_set, tmp_path, "llama3.1-8b-edge", "--assemble-only", "--force",
                  "--max-new-tokens", "6") == 1
    err = capsys.readouterr().err.strip()
    assert "not the Offline performance run asked for: generation.max_new_tokens 8 (wanted 6)" in err
    assert len(err.splitlines()) == 1 and files() == before


@needs_inference
def test_edge_tree_passes_the_checker_but_for_what_only_a_full_length_run_satisfies(edge_submission):
    made, out, err = edge_submission
    assert "MLCommons' checker: submission has errors" in out, err[-2000:]
    log = made / "runs" / "checker.log"
    text = log.read_text()
    assert "--version v6.1" in text.splitlines()[0]
    errors = checker_errors(log)
    assert unexpected(errors, allowed_errors(4, 5000)) == [], errors
    tree = made / "out" / "open" / "gptjteam"
    assert f"All system checks checks passed for: {tree}/results/cpu2" in text
    for scenario in ("Offline", "SingleStream"):
        folder = f"{tree}/results/cpu2/llama3.1-8b-edge/{scenario}"
        assert f"All measurement checks checks passed for: {folder}/measurements.json" in text
        # accuracy.txt parses: the checker warns about each ROUGE score and gen_len (random weights)
        assert len(re.findall(rf"{scenario}/accuracy/mlperf_log_detail\.txt accuracy not met: expected", text)) == 5
        assert f"{folder}/accuracy/mlperf_log_detail.txt not hash value" not in text
    # the round's seeds, token latencies, SingleStream's early stopping: right
    for wrong in ("rng_seed is wrong", "Early stopping condition was not met", "use_token_latencies flag"):
        assert wrong not in text
    # what the short runs cause, and nothing else: each kind at least once
    kinds = {kind for kind, pattern in allowed_errors(4, 5000).items() if any(re.search(pattern, e) for e in errors)}
    assert kinds == set(allowed_errors(4, 5000))


@needs_inference
def test_the_llama_rounds_are_the_checkers(monkeypatch):
    """rules.py's llama3.1-8b facts against the checker's tables: v6.1 is its newest round, and has both
    benchmarks with these scenarios, seeds, sizes and compliance tests; LoadGen's built-in seeds are its."""
    monkeypatch.syspath_prepend(str(INFERENCE / "tools" / "submission"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    from submission_checker import constants

    newest = max(constants.MODEL_CONFIG, key=lambda v: tuple(int(x) for x in v[1:].split(".")))
    assert newest == rules.LLAMA_ROUND == "v6.1"
    table = constants.MODEL_CONFIG["v6.1"]
    for benchmark, rounds in rules.LLAMA_ROUNDS.items():
        rnd = rounds["v6.1"]
        assert benchmark in table["models"] and table["seeds"] == rnd.seeds
        assert table["dataset-size"][benchmark] == rnd.dataset_size
        assert table["performance-sample-count"][benchmark] == rnd.performance_sample_count
        for category, scenarios in rnd.scenarios.items():
            assert sorted(table[f"required-scenarios-{category}"][benchmark]) == sorted(scenarios)
            assert sorted(table[f"optional-scenarios-{category}"].get(benchmark, ())) == \
                sorted(rnd.optional.get(category, ()))
        assert (benchmark in table["models_TEST06"]) == (rnd.compliance == ("TEST06",))
        for scenario in ("Offline", "Server"):
            if scenario in rules.SCENARIOS[benchmark]:
                model = rules.loadgen_model_name(benchmark, scenario)
                assert submission_rounds.loadgen_seeds(model, scenario) == rnd.seeds
    assert constants.MEASUREMENTS_PATH["v6.1"].endswith("/results/{system}/{benchmark}/{scenario}/measurements.json")
    assert constants.TEST06_ACC_PATH["v6.1"].endswith("/results/{system}/{benchmark}/{scenario}/TEST06/"
                                                      "verify_accuracy.txt")
    assert constants.SRC_PATH["v6.1"].endswith("/src")
    # the system description's fields are the same in every round: gptj's probe fills v6.1's too
    from gptj.mlperf import sysdesc

    assert list(sysdesc.REQUIRED) == constants.SYSTEM_DESC_REQUIRED_FIELDS
    assert list(sysdesc.MEANINGFUL) == constants.SYSTEM_DESC_MEANINGFUL_RESPONSE_REQUIRED_FIELDS


def test_scenarios_and_categories_of_a_llama_submission():
    pick = rules.submission_scenarios
    assert pick("llama3.1-8b", None, "datacenter") == ("Offline", "Server")
    assert pick("llama3.1-8b", "v6.1", "datacenter", ("Interactive", "Offline")) == ("Offline", "Interactive")
    assert pick("llama3.1-8b", None, "datacenter", ("Offline", "Server", "Interactive")) == \
        ("Offline", "Server", "Interactive")
    assert pick("llama3.1-8b-edge", None, "edge") == ("Offline", "SingleStream")
    assert pick("gptj-99", None, "datacenter") == ("Offline", "Server")
    for benchmark, category, asked, message in [
        ("llama3.1-8b", "datacenter", ("Offline",), "runs Offline, and Server and/or Interactive"),
        ("llama3.1-8b", "datacenter", ("Server",), "runs Offline, and Server and/or Interactive"),
        ("llama3.1-8b-edge", "edge", ("Offline", "Server"), "runs Offline and SingleStream"),
        ("llama3.1-8b", "edge", None, "llama3.1-8b has no edge category in round v6.1: use --category datacenter"),
    ]:
        with pytest.raises(Exception, match=re.escape(message)):
            pick(benchmark, None, category, asked)
    assert rules.default_round("llama3.1-8b") == "v6.1" and rules.default_round("gptj-99") == "v5.0"
    assert rules.submission_categories("llama3.1-8b-edge") == ("edge",)
    assert rules.submission_categories("gptj-99") == ("datacenter", "edge")
    with pytest.raises(Exception, match="gptj submits llama3.1-8b for MLPerf Inference v6.1 only"):
        rules.submission_round("llama3.1-8b", "v5.1")


@pytest.mark.parametrize("extra, message", [
    (["--benchmark", "llama3.1-8b", "--round", "v6.0"], "gptj submits llama3.1-8b for MLPerf Inference v6.1 only"),
    (["--benchmark", "llama3.1-8b", "--category", "edge"], "llama3.1-8b has no edge category in round v6.1"),
    (["--benchmark", "llama3.1-8b", "--scenarios", "Offline,SingleStream"], "--scenarios Offline,SingleStream: a "
                                                                            "datacenter llama3.1-8b submission"),
    (["--benchmark", "llama3.1-8b-edge", "--division", "closed", "--max-new-tokens", "8"],
     "the closed division runs MLPerf's generation settings; these differ: max_new_tokens=8 (official 128)"),
    (["--benchmark", "llama3.1-8b", "--division", "closed"], "needs MLCommons' compliance test TEST06: give a "
                                                             "checkout"),
    (["--benchmark", "gptj-99"], "--benchmark gptj-99 needs a gptj model"),
])
def test_bad_input_is_one_line_before_any_run(llama_dir, tmp_path, capsys, extra, message):  # noqa: F811
    runs = tmp_path / "runs"
    runs.mkdir()
    complete_desc(runs / "system_desc.json")
    args = ["submission", "--model", str(llama_dir), "--out", str(tmp_path / "out"), "--runs-dir", str(runs),
            "--submitter", "gptjteam", "--system-name", "cpu2", "--quiet"]
    if "--division" not in extra:
        args += ["--division", "open"]
    rc = main(args + extra)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in runs.iterdir()) == ["system_desc.json"]  # no run made


def test_loadgen_of_another_round_is_named_before_any_run(monkeypatch):
    rnd = rules.submission_round("llama3.1-8b-edge")
    submission_rounds.check_loadgen_seeds("llama3.1-8b-edge", "llama3_1-8b-edge", "Offline", rnd)
    monkeypatch.setattr(submission_rounds, "loadgen_seeds", lambda model, scenario: {**rnd.seeds, "qsl_rng_seed": 1})
    with pytest.raises(Exception, match="built-in mlperf.conf has other seeds for llama3_1-8b-edge than round "
                                        "v6.1's .* install the mlcommons-loadgen of round v6.1"):
        submission_rounds.check_loadgen_seeds("llama3.1-8b-edge", "llama3_1-8b-edge", "Offline", rnd)


def closed_datacenter(llama_dir, runs_dir, scenarios="Offline,Server"):  # noqa: F811
    from gptj.mlperf.config import MLPerfConfig

    return submission.SubmissionConfig(
        out=runs_dir / "out", submitter="gptjteam", system_name="cpu2", division="closed", category=None,
        benchmark="llama3.1-8b", run=MLPerfConfig(model=llama_dir, benchmark="llama3.1-8b", max_query_count=0),
        scenarios=tuple(scenarios.split(",")), runs_dir=runs_dir, mlperf_inference=INFERENCE)


@needs_inference
def test_a_closed_datacenter_plan_runs_test06_in_each_scenario_and_puts_it_in_results(llama_dir, tmp_path):  # noqa: F811
    """The fast half of test_closed_datacenter_tree_...: what a closed llama3.1-8b submission runs (each
    scenario's performance, accuracy and TEST06 runs, Interactive as LoadGen's Server with its own model
    name, TEST06 with MLCommons' audit.config and token counts), where v6.1 wants TEST06's folder, and how
    MLCommons' run_verification.py is asked to read a llama log."""
    sub = closed_datacenter(llama_dir, tmp_path, "Offline,Interactive")
    assert sub.category == "datacenter" and sub.round == "v6.1" and sub.scenarios == ("Offline", "Interactive")
    runs = submission.plan(sub)
    assert [r.label for r in runs] == ["Offline performance", "Offline accuracy", "Offline TEST06",
                                       "Interactive performance", "Interactive accuracy", "Interactive TEST06"]
    for run in runs:
        assert run.cfg.round is None and run.cfg.llama  # LoadGen's built-in seeds: the round's (prepare checks)
        assert run.seeds == (None if run.kind == "TEST06" else rules.LLAMA_ROUNDS["llama3.1-8b"]["v6.1"].seeds)
        assert run.folder == tmp_path / run.scenario / run.kind
        assert (run.cfg.audit_config == INFERENCE / "compliance" / "TEST06" / "audit.config") == \
            (run.kind == "TEST06") == run.cfg.token_latencies
        if run.scenario == "Interactive":
            assert run.cfg.scenario == "Server" and run.cfg.loadgen_model == "llama3_1-8b-interactive"
    folders = submission_rounds.scenario_folders(tmp_path, sub.round_rules, "cpu2", "llama3.1-8b", "Interactive")
    assert folders.compliance == folders.results == folders.measurements == \
        tmp_path / "results" / "cpu2" / "llama3.1-8b" / "Interactive"
    from gptj.tokenizer import load_tokenizer

    eos, dtype = submission_rounds.test06_arguments("llama3.1-8b", llama_dir)
    assert (eos, dtype) == (load_tokenizer(llama_dir).eos_token_id, "int32") and eos == 511  # <|eot_id|>
    assert submission_rounds.test06_arguments("gptj-99", None) == (50256, "int64")


@pytest.mark.slow
@needs_inference
def test_closed_datacenter_tree_passes_the_checker_but_for_what_only_a_full_length_run_satisfies(
        llama_dir, short_set, tmp_path, capsys, monkeypatch):  # noqa: F811
    """Offline + Server with TEST06 (~20 s on 2 cores: 459 Server queries for early stopping, 100 per TEST06
    run). Closed runs MLPerf's generation (up to 128 tokens): the short settings are let through here, as
    in test_mlperf_submission's closed test."""
    from gptj.mlperf import run as mlperf_run

    monkeypatch.setattr(mlperf_run, "official_differences", lambda gen, official=None: [])
    rc = submit(llama_dir, short_set, tmp_path, "llama3.1-8b", "--mlperf-inference", str(INFERENCE),
                "--min-query-count", "459", "--target-qps", "100", division="closed")
    assert rc == EXIT_CHECKER_ERRORS, capsys.readouterr().err[-2000:]
    log = tmp_path / "runs" / "checker.log"
    allowed = {**allowed_errors(4, 13368),
               # closed: Offline's one query holds the whole set (13,368 samples), the short run 459
               "Offline samples per query": r"Required minimum samples per query not met by user config, "
                                            r"Expected=13368, Found=459"}
    errors = checker_errors(log)
    assert unexpected(errors, allowed) == [], errors
    text = log.read_text()
    tree = tmp_path / "out" / "closed" / "gptjteam"
    for scenario in ("Offline", "Server"):
        folder = tree / "results" / "cpu2" / "llama3.1-8b" / scenario
        assert f"All compliance check checks passed for: {folder}/" in text
        verify = (folder / "TEST06" / "verify_accuracy.txt").read_text()
        assert "EOS check pass: True" in verify and "Sample length check pass: True" in verify
        assert ("First token check pass: Skipped" if scenario == "Offline" else "First token check pass: True") \
            in verify
    assert "Failed extra check for TTFT and TPOT" not in text  # Server's token latencies within its limits


def test_gptj_99_still_needs_its_category_and_round(tiny_checkpoint, tmp_path, capsys):
    """--category is optional now (a llama benchmark has one): gptj-99 still asks for it, and stays v5.0."""
    runs = tmp_path / "runs"
    runs.mkdir()
    complete_desc(runs / "system_desc.json")
    args = ["submission", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "out"), "--runs-dir", str(runs),
            "--submitter", "gptjteam", "--system-name", "cpu2", "--division", "open", "--quiet"]
    for extra, message in ((), "gptj-99 needs --category (datacenter or edge)"), \
            (("--category", "edge", "--round", "v6.1"), "MLPerf Inference v6.1 has no GPT-J benchmark"), \
            (("--category", "edge", "--scenarios", "Offline"), "--scenarios Offline: an edge gptj-99 submission in "
                                                               "round v5.0 runs Offline and SingleStream"):
        assert main([*args, *extra]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and sorted(p.name for p in runs.iterdir()) == ["system_desc.json"]
