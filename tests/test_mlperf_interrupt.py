"""Ctrl-C during `gptj mlperf`: one line, exit 130, and a results folder that reads.

Each case runs the real CLI in a subprocess and sends it SIGINT once LoadGen's test is under way
(its detail log has begun), to its whole process group, as a terminal's Ctrl-C does (with --tp, the
ranks get it too). The runs are set up to last far longer than the test: a 10-minute
minimum duration, so only the interrupt can end them early.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gptj.mlperf.dataset import Dataset

HANG_GUARD_S = 600  # only so that a regression cannot hang the suite; no speed is asserted


def interrupt_run(tiny_checkpoint, log_dir, *extra):
    cmd = [sys.executable, "-m", "gptj.cli", "mlperf", "--model", str(tiny_checkpoint), "--log-dir", str(log_dir),
           "--quiet", "--num-beams", "1", "--min-new-tokens", "0", "--max-new-tokens", "8",
           "--min-duration-ms", "600000", *extra]
    # A process that starts with SIGINT ignored keeps ignoring it (Python installs no KeyboardInterrupt
    # handler then), and children inherit an ignored signal: in a full run a test module before this
    # one can leave the pytest worker ignoring SIGINT (seen 2026-11-28: the run hung 600 s). The child
    # gets the default, as a shell's foreground command has.
    inherited = signal.getsignal(signal.SIGINT)
    if inherited == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    detail = log_dir / "mlperf_log_detail.txt"
    while proc.poll() is None and not (detail.is_file() and detail.stat().st_size > 0):
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    time.sleep(0.5)  # samples in flight
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"gptj mlperf did not stop on SIGINT: {err[-2000:]}")
    return proc.returncode, out, err


@pytest.mark.parametrize("scenario, extra", [
    ("Offline", ["--target-qps", "100"]),  # one query of 66,000 samples
    ("Server", ["--target-qps", "5"]),  # a Poisson schedule 10 minutes long
    ("SingleStream", ["--target-latency-ms", "1"]),  # 1.2 million queries expected
    ("Server", ["--target-qps", "5", "--tp", "2"]),  # rank 0 leads LoadGen's run, rank 1 follows it
])
def test_ctrl_c_stops_cleanly_with_readable_logs(tiny_checkpoint, tmp_path, scenario, extra):
    log_dir = tmp_path / scenario
    code, out, err = interrupt_run(tiny_checkpoint, log_dir, "--scenario", scenario, "--mode", "performance", *extra)
    assert code == 130, err[-3000:]
    assert "terminate called" not in err and "Traceback" not in err and "Fatal Python" not in err
    lines = [line for line in err.splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("gptj mlperf: interrupted"), err[-3000:]
    assert str(log_dir) in lines[0]

    run = json.loads((log_dir / "run.json").read_text())  # ours: whole (written atomically)
    info = run["interrupted"]
    assert info is not None and run["sut"]["answered_empty_after_interrupt"] >= 0
    summary = (log_dir / "summary.md").read_text()
    assert "Interrupted (Ctrl-C): not a result" in summary
    # LoadGen's logs: every detail line a whole MLLOG record, the accuracy log valid JSON.
    records = [json.loads(line.split(":::MLLOG", 1)[1]) for line in
               (log_dir / "mlperf_log_detail.txt").read_text().splitlines() if line.startswith(":::MLLOG")]
    assert any(r["key"] == "effective_scenario" for r in records)
    assert isinstance(json.loads((log_dir / "mlperf_log_accuracy.json").read_text()), list)
    loadgen_summary = (log_dir / "mlperf_log_summary.txt").read_text()
    if info["loadgen_finished"]:  # LoadGen ended its test: its summary is whole, and says the run is invalid
        assert "Result is : INVALID" in loadgen_summary and "Result is" in summary
    else:  # its schedule still ran: summary.md says which of its files stop at the interrupt
        assert loadgen_summary == "" and "mlperf_log_summary.txt" in " ".join(info["incomplete"])
        assert "incomplete: `mlperf_log_detail.txt`" in summary
    if scenario == "Offline":  # one query: answering the rest at once ends LoadGen's test
        assert info["loadgen_finished"] and run["sut"]["answered_empty_after_interrupt"] > 0
    if scenario == "Server":  # a schedule's arrivals cannot be hurried
        assert not info["loadgen_finished"]


def test_ctrl_c_in_an_accuracy_run_ends_loadgens_test_and_scores_nothing(tiny_checkpoint, tmp_path):
    """SingleStream accuracy: the bundled set (30 samples), each long (4 beams, 128 tokens); once interrupted the rest
    are answered at once, so LoadGen ends its test and every log of it is whole."""
    log_dir = tmp_path / "acc"
    code, out, err = interrupt_run(tiny_checkpoint, log_dir, "--scenario", "SingleStream", "--mode", "accuracy",
                                   "--num-beams", "4", "--min-new-tokens", "128", "--max-new-tokens", "128")
    assert code == 130 and "terminate called" not in err and "Traceback" not in err, err[-3000:]
    run = json.loads((log_dir / "run.json").read_text())
    assert run["interrupted"]["loadgen_finished"] is True
    entries = json.loads((log_dir / "mlperf_log_accuracy.json").read_text())
    assert sorted(e["qsl_idx"] for e in entries) == list(range(len(Dataset.load())))  # each answered once
    empty = sum(1 for e in entries if e["data"] == "")
    assert empty == run["sut"]["answered_empty_after_interrupt"] > 0
    assert not (log_dir / "accuracy.json").exists()  # a partial run is not scored
    assert out == ""  # no scores printed either
