"""`gptj mlperf` with the real LoadGen: scenarios, modes, the results bundle, bad input."""

import json

import numpy as np
import pytest
import torch

from gptj.cli import main
from gptj.decode import GenerationConfig, generate
from gptj.mlperf.dataset import Dataset
from gptj.mlperf import run as mlperf_run  # its test_settings() is no pytest test
from gptj.mlperf.run import MLPerfConfig, planned_queries
from gptj.threads import RESERVED_CORES
from gptj.weights.io import load_model

# `gptj mlperf` sets torch's thread count for the process: each test gives the next one its count back
pytestmark = pytest.mark.usefixtures("keep_torch_threads")


def mlperf(tiny_checkpoint, log_dir, *extra):
    return main(["mlperf", "--model", str(tiny_checkpoint), "--log-dir", str(log_dir), "--quiet", *extra])


def read_accuracy_log(log_dir):
    entries = json.loads((log_dir / "mlperf_log_accuracy.json").read_text())
    return {e["qsl_idx"]: np.frombuffer(bytes.fromhex(e["data"]), np.int64).tolist() for e in entries}, entries


def test_offline_accuracy_answers_every_sample_once_as_generate_does(tiny_checkpoint, tmp_path, capsys):
    log_dir = tmp_path / "acc"
    args = ["--scenario", "Offline", "--mode", "accuracy", "--max-new-tokens", "12", "--min-new-tokens", "4",
            "--max-batch-size", "4"]
    assert mlperf(tiny_checkpoint, log_dir, *args) == 0
    out = capsys.readouterr().out
    assert "ROUGE" in out.upper() and "summary.md" in out
    answers, entries = read_accuracy_log(log_dir)
    dataset = Dataset.load()
    assert sorted(e["qsl_idx"] for e in entries) == list(range(len(dataset)))  # each exactly once

    model = load_model(tiny_checkpoint)
    gen = GenerationConfig.mlperf(max_new_tokens=12, min_new_tokens=4)
    with torch.inference_mode():
        for i, prompt in enumerate(dataset.input_ids):
            assert answers[i] == generate(model, [prompt], gen)[0], f"sample {i}"

    run = json.loads((log_dir / "run.json").read_text())
    assert run["sut"]["samples"] == len(dataset) and run["sut"]["duplicate_answers"] == 0
    assert run["sut"]["max_batch"] == 4 and run["official_generation"] is False
    assert run["sut"]["first_tokens"] == 0  # beam search: no token is final before the search ends
    accuracy = json.loads((log_dir / "accuracy.json").read_text())
    assert accuracy["gen_num"] == len(dataset)
    assert main(["evaluate", "--log-dir", str(log_dir), "--json"]) == 0  # re-scoring gives the same result
    assert json.loads(capsys.readouterr().out) == accuracy
    assert (log_dir / "accuracy.txt").read_text().startswith("{'rouge1': ")
    summary = (log_dir / "summary.md").read_text()
    assert "not the official gptj-99 generation settings" in summary and "not GPT-J 6B" in summary
    assert json.loads((log_dir / "system.json").read_text())["torch"] == torch.__version__


@pytest.mark.parametrize("scenario, extra", [
    ("Offline", ["--target-qps", "50"]),
    ("Server", ["--target-qps", "400", "--max-batch-size", "8", "--batch-wait-ms", "20"]),
    ("SingleStream", ["--target-latency-ms", "20"]),
])
def test_performance_runs_write_a_summary(tiny_checkpoint, tmp_path, capsys, scenario, extra):
    log_dir = tmp_path / scenario
    args = ["--scenario", scenario, "--mode", "performance", "--num-beams", "1", "--min-new-tokens", "0",
            "--max-new-tokens", "4", "--max-examples", "12", "--min-duration-ms", "200", "--min-query-count", "24",
            "--max-query-count", "0"]  # no cap: LoadGen's own count, which gptj predicts
    assert mlperf(tiny_checkpoint, log_dir, *args, *extra) == 0
    out = capsys.readouterr().out
    assert "Result is" in out
    summary = (log_dir / "summary.md").read_text()
    assert "Result is" in summary and "latency.png" in summary
    assert (log_dir / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Result is" in (log_dir / "mlperf_log_summary.txt").read_text()
    run = json.loads((log_dir / "run.json").read_text())
    sut = run["sut"]
    assert sut["samples"] >= 24
    # the engine's steps over the run (greedy, 4 new tokens: at least a step per token), phases adding up
    steps = run["engine_steps"]
    assert steps["steps"] >= 4 and steps["mean_decode_rows"] > 0
    assert steps["step_ms"] == pytest.approx(sum(steps[f"{k}_ms"] for k in ("schedule", "forward", "wait", "update")),
                                             abs=0.01)
    assert f"engine: {steps['steps']} steps" in out and f"- engine: {steps['steps']} steps" in summary
    # Every run-length flag acted, and the summary shows the value asked for beside LoadGen's.
    asked, used = run["run_length"]["asked"], run["run_length"]["loadgen"]
    assert asked["min_query_count"] == {"value": 24, "source": "--min-query-count"}
    assert asked["min_duration_ms"] == {"value": 200, "source": "--min-duration-ms"}
    assert used["min_duration_ms"] == 200
    assert "min query count" in summary and "asked 24 (--min-query-count)" in summary
    # LoadGen's query count is the one gptj predicts (and notes when above the 24 asked).
    cfg = MLPerfConfig(model=tiny_checkpoint, scenario=scenario, mode="performance", min_duration_ms=200, min_query_count=24,
                       max_query_count=0, target_qps=float(extra[1]) if extra[0] == "--target-qps" else None,
                       target_latency_ms=float(extra[1]) if extra[0] == "--target-latency-ms" else None)
    planned, _ = planned_queries(mlperf_run.test_settings(cfg, 12), scenario, 12)
    if scenario == "Offline":
        assert used["samples_per_query"] == planned
    elif scenario == "SingleStream":
        assert used["min_query_count"] == planned and asked["expected_latency_ms"]["source"] == "--target-latency-ms"
        assert used["target_qps"] == pytest.approx(1000 / float(extra[1]))
    else:
        assert used["result_query_count"] >= 24
    assert ("LoadGen raises the" in summary) == (planned > 24)
    if scenario == "Server":  # 400 QPS of arrivals against a CPU: queries pile up and are batched together
        assert sut["max_batch"] > 1 and sut["batches"] < sut["samples"]
    if scenario == "SingleStream":
        assert sut["max_batch"] == 1


def test_single_stream_times_its_expected_latency_so_a_short_run_stays_short(tiny_checkpoint, tmp_path, capsys):
    """With no --target-latency-ms, LoadGen's 10 ms default would set SingleStream's query count
    (2 x min duration / expected latency: 210 here, whatever --min-query-count says); gptj times a
    few samples and gives LoadGen that latency instead."""
    log_dir = tmp_path / "ss"
    args = ["--scenario", "SingleStream", "--mode", "performance", "--num-beams", "1", "--min-new-tokens", "0",
            "--max-new-tokens", "4", "--max-examples", "6", "--min-duration-ms", "1000", "--min-query-count", "10",
            "--max-query-count", "0"]  # no cap: LoadGen's own count (test_mlperf_submission checks the cap)
    assert mlperf(tiny_checkpoint, log_dir, *args) == 0
    err = capsys.readouterr().err
    # the note before the timing and the summary after it say the same count (one phrase, CALIBRATION_HOW)
    assert "timing 2 samples one at a time, after 1 untimed warm-up sample" in err
    run = json.loads((log_dir / "run.json").read_text())
    asked, used = run["run_length"]["asked"], run["run_length"]["loadgen"]
    expected = asked["expected_latency_ms"]
    assert expected["source"] == "timed on 2 samples one at a time, after 1 untimed warm-up sample"
    assert expected["value"] > 0
    assert used["target_qps"] == pytest.approx(1000 / expected["value"], rel=1e-3)  # LoadGen took it
    # LoadGen's count follows from the timed latency, as gptj predicts it and says so.
    cfg = MLPerfConfig(model=tiny_checkpoint, scenario="SingleStream", mode="performance", min_duration_ms=1000,
                       min_query_count=10, max_query_count=0)
    planned, _ = planned_queries(mlperf_run.test_settings(cfg, 6, expected["value"] / 1000), "SingleStream", 6)
    # (LoadGen stops at both its count and the minimum duration: where the queries ran faster than the two
    # timed samples said, as on a loaded machine, it ran a few more to fill the duration: CI saw 126 of 120)
    assert used["min_query_count"] == planned <= used["result_query_count"]
    summary = (log_dir / "summary.md").read_text()
    assert f"LoadGen raises the queries to {planned:,} from the 10 asked (--min-query-count)" in summary
    assert "expected latency: asked" in summary and "(timed on 2 samples one at a time, after 1 untimed" in summary


def test_flags_a_scenario_has_no_use_for_are_named(tiny_checkpoint, tmp_path, capsys):
    log_dir = tmp_path / "ss"
    args = ["--scenario", "SingleStream", "--mode", "accuracy", "--num-beams", "1", "--min-new-tokens", "0",
            "--max-new-tokens", "2", "--max-examples", "2", "--target-qps", "5", "--max-batch-size", "4"]
    assert mlperf(tiny_checkpoint, log_dir, *args) == 0
    err = capsys.readouterr().err
    assert "--target-qps does not apply to SingleStream" in err and "--max-batch-size / --batch-wait-ms" in err
    assert "--target-qps: an accuracy run issues every sample once" in err
    assert "timing" not in err  # accuracy runs need no expected latency
    assert "--target-qps does not apply" in (log_dir / "summary.md").read_text()


@pytest.mark.parametrize("threads", [None, 2])
def test_compute_threads_are_chosen_honoured_and_recorded(tiny_checkpoint, tmp_path, capsys, threads):
    import os

    log_dir = tmp_path / "t"
    args = ["--scenario", "Offline", "--mode", "accuracy", "--num-beams", "1", "--min-new-tokens", "0",
            "--max-new-tokens", "2", "--max-examples", "2"] + (["--threads", str(threads)] if threads else [])
    assert mlperf(tiny_checkpoint, log_dir, *args) == 0
    recorded = json.loads((log_dir / "run.json").read_text())["threads"]
    cores = len(os.sched_getaffinity(0))
    if threads is None:  # the usable cores less those kept for LoadGen and the SUT (none)
        assert recorded["compute"] == max(1, cores - RESERVED_CORES) and recorded["requested"] is None
        assert recorded["why"].startswith("default")
    else:
        assert recorded["compute"] == recorded["requested"] == threads and recorded["why"] == "requested (--threads)"
    assert recorded["engine_thread"] == recorded["compute"]  # set where the engine's steps run
    summary = (log_dir / "summary.md").read_text()
    assert f"- compute threads: {recorded['compute']} ({recorded['why']})" in summary


def test_greedy_reports_first_tokens(tiny_checkpoint, tmp_path, capsys):
    """With token latencies asked for in user.conf, LoadGen's summary has first-token latencies."""
    log_dir = tmp_path / "tok"
    (tmp_path / "user.conf").write_text("gptj.Server.use_token_latencies = 1\ngptj.Server.target_qps = 50\n")
    args = ["--scenario", "Server", "--mode", "performance", "--num-beams", "1", "--min-new-tokens", "0",
            "--max-new-tokens", "3", "--max-examples", "4", "--min-duration-ms", "100", "--min-query-count", "8",
            "--user-conf", str(tmp_path / "user.conf")]
    assert mlperf(tiny_checkpoint, log_dir, *args) == 0
    sut = json.loads((log_dir / "run.json").read_text())["sut"]
    assert sut["first_tokens"] == sut["samples"] >= 8  # FirstTokenComplete for every greedy sample
    summary = (log_dir / "mlperf_log_summary.txt").read_text()
    assert "first token latency" in summary.lower()


@pytest.mark.parametrize("setup, message", [
    ("missing-dataset", "no-such.json"),
    ("malformed-dataset", "bad.json"),
    ("not-gptj", "not a GPT-J config: model_type 'bert' is not supported"),
    ("missing-model", "no such file or directory"),
])
def test_bad_inputs_fail_in_one_line(tiny_checkpoint, tmp_path, capsys, setup, message):
    args = ["mlperf", "--model", str(tiny_checkpoint), "--log-dir", str(tmp_path / "logs"), "--quiet"]
    if setup == "missing-dataset":
        args += ["--dataset", str(tmp_path / "no-such.json")]
    elif setup == "malformed-dataset":
        (tmp_path / "bad.json").write_text('[{"instruction": "x", "input": ')
        args += ["--dataset", str(tmp_path / "bad.json")]
    elif setup == "not-gptj":
        (tmp_path / "llama").mkdir()
        (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "bert"}))
        args[2] = str(tmp_path / "llama")
    else:
        args[2] = str(tmp_path / "nothing")
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_silences_the_model_load_bars(tiny_checkpoint, tmp_path, capsys, monkeypatch, quiet):
    """Loading and preparing a big model draws bars on a terminal; --quiet draws none (this tiny
    model counts as big here, and stderr as a terminal)."""
    import sys

    import gptj.weights.io as weights_io

    monkeypatch.setattr(weights_io, "PROGRESS_MIN_PARAMS", 0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    args = ["mlperf", "--model", str(tiny_checkpoint), "--log-dir", str(tmp_path / "run"), "--max-examples", "1",
            "--num-beams", "1", "--max-new-tokens", "2", "--min-new-tokens", "0", "--dtype", "bfloat16",
            "--compile", "off"] + (["--quiet"] if quiet else [])
    assert main(args) == 0
    err = capsys.readouterr().err
    assert ("preparing kernels" in err) is not quiet and ("tensor/s" in err or "tensor]" in err) is not quiet, err


def test_truncated_prompts_are_counted_in_the_summary_and_run_json(tiny_checkpoint, tmp_path, capsys):
    """Inputs over 1919 tokens are cut as the reference cuts them; the run says how many were."""
    long = " ".join(["word"] * 2500)  # a token each, and the template's own: over 1919
    (tmp_path / "eval.json").write_text(json.dumps([
        {"instruction": "Summarize the following news article:", "input": long, "output": "a summary"},
        {"instruction": "Summarize the following news article:", "input": "A short article.", "output": "short"}]))
    log_dir = tmp_path / "run"
    assert mlperf(tiny_checkpoint, log_dir, "--dataset", str(tmp_path / "eval.json"), "--num-beams", "1",
                  "--min-new-tokens", "0", "--max-new-tokens", "2") == 0
    run = json.loads((log_dir / "run.json").read_text())
    assert run["dataset"] == {"path": str(tmp_path / "eval.json"), "samples": 2, "max_input_tokens": 1919,
                              "truncated_prompts": 1}
    assert "1 prompts longer than 1919 tokens, truncated" in (log_dir / "summary.md").read_text()


@pytest.mark.parametrize("device, scenario, size", [("cpu", "Offline", 8), ("cpu", "Server", 8),
                                                    ("cuda", "Offline", 256), ("cuda:1", "Server", 64),
                                                    ("cuda", "SingleStream", 1)])
def test_the_default_batch_follows_the_device(tiny_checkpoint, device, scenario, size):
    """--max-batch-size's default per device (sut.DEFAULT_BATCH: a GPU runs many samples per step for
    the cost of few); what is given wins; the engine's sequences follow it (x num_beams)."""
    from gptj.mlperf.run import engine_config
    from gptj.runtime.spec import ModelSpec

    cfg = MLPerfConfig(model=tiny_checkpoint, scenario=scenario, spec=ModelSpec(device=device))
    assert cfg.batching.max_batch_size == size
    assert engine_config(cfg, 100).max_seqs == size * cfg.gen.num_beams
    if scenario != "SingleStream":
        assert MLPerfConfig(model=tiny_checkpoint, scenario=scenario, max_batch_size=3,
                            spec=ModelSpec(device=device)).batching.max_batch_size == 3


SHORT_PERF = ["--mode", "performance", "--num-beams", "1", "--min-new-tokens", "0", "--max-new-tokens", "2",
              "--max-examples", "8", "--performance-sample-count", "8", "--min-duration-ms", "100"]


@pytest.mark.parametrize("scenario, extra, percentile", [
    ("SingleStream", ["--target-latency-ms", "20"], 0.9),
    ("Server", ["--target-qps", "100"], 0.99),
])
def test_too_few_queries_for_early_stopping_is_foretold_and_the_invalid_summary_names_the_fix(
        tiny_checkpoint, tmp_path, capsys, scenario, extra, percentile):
    """A short run with fewer queries than LoadGen's early stopping needs is INVALID whatever the
    system does: gptj says so before the run, with the count LoadGen needs, and after it summary.md
    and the printed report name the unmet condition and the --min-query-count that fixes it, the
    same count LoadGen's own summary asks for."""
    from gptj.mlperf.report import parse_loadgen_summary
    from gptj.mlperf.run import early_stopping_min_queries

    log_dir = tmp_path / scenario
    assert mlperf(tiny_checkpoint, log_dir, "--scenario", scenario, *SHORT_PERF, "--min-query-count", "8",
                  *extra) == 0
    out, err = capsys.readouterr()
    need = early_stopping_min_queries(scenario, percentile)
    assert f"the run will be INVALID (early stopping): LoadGen's early stopping needs at least {need} " in err
    loadgen = parse_loadgen_summary(log_dir / "mlperf_log_summary.txt")
    assert loadgen["result_line"] == "Result is : INVALID" and loadgen["Early stopping satisfied"] == "NO"
    said = loadgen["early_stopping"]
    if scenario == "SingleStream":  # "Need to process at least 64 queries for early stopping."
        assert f"Need to process at least {need} queries" in said
    else:  # "Processed 16 queries. Would need to run at least 443 more queries, ..."
        import re

        done, more = (int(re.search(p, said).group(1)) for p in (r"Processed (\d+) queries", r"at least (\d+) more"))
        assert done + more == need
    summary = (log_dir / "summary.md").read_text()
    assert "Why INVALID, and what fixes it:" in summary
    line = next(x for x in summary.splitlines() if x.startswith("- early stopping not satisfied"))
    assert f"give --min-query-count {need}" in line and said.split(".")[0] in line
    assert f"  INVALID: {line[2:]}" in out


def test_a_short_single_stream_run_with_enough_queries_is_valid(tiny_checkpoint, tmp_path, capsys):
    """The README's kind of quick run: --min-query-count at early stopping's 64, the count LoadGen
    raises it to followed: VALID, and nothing says otherwise."""
    log_dir = tmp_path / "ss"
    assert mlperf(tiny_checkpoint, log_dir, "--scenario", "SingleStream", *SHORT_PERF, "--min-query-count", "64",
                  "--target-latency-ms", "20") == 0
    out, err = capsys.readouterr()
    assert "Result is : VALID" in out and "INVALID" not in out and "will be INVALID" not in err
    summary = (log_dir / "summary.md").read_text()
    assert "- Result is : VALID" in summary and "Why INVALID" not in summary
    run = json.loads((log_dir / "run.json").read_text())
    assert run["run_length"]["loadgen"]["result_query_count"] >= 64


@pytest.mark.parametrize("user_conf", [True, False])
def test_settings_keep_the_flags_and_the_rounds_seeds_under_user_conf_and_audit_config(tmp_path, user_conf):
    """In a fresh process (LoadGen reloads its built-in mlperf.conf the first time a process reads a
    user.conf, over what was set before): the round's seeds and --min-duration-ms survive a user.conf
    and an audit config that leave them alone, and the audit config's own keys apply. (The audit config
    was read as a user.conf: a --min-duration-ms 100 run took mlperf.conf's 10 minutes.)"""
    import subprocess
    import sys

    (tmp_path / "user.conf").write_text("*.SingleStream.target_latency = 25\n")
    (tmp_path / "audit.config").write_text("*.*.min_query_count = 11\n")
    probe = f"""
from pathlib import Path, PosixPath
from gptj.mlperf.config import MLPerfConfig
from gptj.mlperf.rules import ROUNDS
from gptj.mlperf.run import test_settings
cfg = MLPerfConfig(model=Path("unused"), scenario="SingleStream", mode="performance", min_duration_ms=100, round="v5.0",
                   user_conf={repr(tmp_path / "user.conf") if user_conf else None},
                   audit_config=Path({str(tmp_path / "audit.config")!r}))
s = test_settings(cfg, 30)
seed = ROUNDS["v5.0"].seeds["qsl_rng_seed"]
print(s.min_duration_ms, s.min_query_count, s.qsl_rng_seed == seed)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["100", "11", "True"], out
