"""`gptj submission`: the official tree, checked by MLCommons' own submission checker; its bad
input; and the LoadGen options submitters reach for (query counts, audit.config).

MLCommons' checker and compliance tests are used from the project's sibling folder
../shared/mlperf-inference (a copy of github.com/mlcommons/inference's tools/submission and
compliance/); the tests that need them skip, saying so, where it is absent."""

import contextlib
import hashlib
import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from gptj.cli import EXIT_CHECKER_ERRORS, main
from gptj.mlperf import rules, submission, sysdesc

# `gptj mlperf` sets torch's thread count for the process: each test gives the next one its count back
pytestmark = pytest.mark.usefixtures("keep_torch_threads")

INFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "mlperf-inference"
HAS_CHECKER = (INFERENCE / "tools" / "submission" / "submission_checker" / "main.py").is_file()
needs_inference = pytest.mark.skipif(
    not HAS_CHECKER,
    reason=f"MLCommons' submission checker is not at {INFERENCE} (a copy of github.com/mlcommons/inference)")

# Short runs of a tiny model on the bundled 30-sample set: each flag below shortens what an
# official run must have, and the checker's errors about exactly that are the only ones allowed (64
# queries: the fewest with which LoadGen's early stopping can judge a SingleStream run).
SHORT = ["--min-duration-ms", "200", "--min-query-count", "64", "--num-beams", "1", "--max-new-tokens", "12",
         "--min-new-tokens", "0", "--target-qps", "50", "--quiet"]
ALLOWED_ERRORS = {
    # the bundled set has 30 samples: the official run has 13,368 performance samples ...
    "performance sample count": r"performance_sample_count, found 30, needs to be >= 13368",
    # ... and its accuracy run covers all 13,368 (the checker's spelling)
    "accuracy data set size": r"accurcy run does not cover all dataset, accuracy samples: 30, dataset size: 13368",
    # --min-duration-ms 200 (official: 600 s)
    "min duration": r"Test duration less than 600s in user config\. expected=600000, found=200",
    # the checker's v5.0 tables lack gptj in OFFLINE_MIN_SPQ_SINCE_V4: its min_query_count_check raises
    # on every Offline gptj result, full-length or not (see test_the_checker_knows_gptj_only_in_v5_0)
    "checker: Offline min query count": r"Execution occurred in running check \S+/Offline/performance/run_1/"
                                        r"mlperf_log_detail\.txt\. Running min_query_count_check in PerformanceCheck",
    # the consequences of the above, as the checker sums them up
    "a check group failed": r"Some (performance|accuracy) checks Checks failed for: ",
    "no result": r"NoResults ",
    "summary": r"SUMMARY: submission has errors",
}
ALLOWED_CLOSED = {
    # random weights: ROUGE is 0 (in the open division the checker only warns)
    "accuracy target": r"accuracy not met",
}


def complete_desc(path: Path, **fields) -> Path:
    """A system description with what no program knows filled in (as a submitter would)."""
    data = {"status": "available", "cooling": "air", "host_memory_configuration": "1x 24 GB (virtual machine)",
            "host_storage_type": "SSD", "host_networking": "Ethernet", "host_network_card_count": "1", **fields}
    path.write_text(json.dumps(data))
    return path


def submit(tiny_checkpoint, root: Path, *extra: str, division="open", category="edge", desc=True):
    runs = root / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    if desc:
        complete_desc(runs / "system_desc.json")
    return main(["submission", "--model", str(tiny_checkpoint), "--out", str(root / "out"), "--runs-dir", str(runs),
                 "--submitter", "gptjteam", "--system-name", "cpu2", "--division", division, "--category", category,
                 "--round", "v5.0", *SHORT, *extra])


def checker_errors(log: Path) -> list[str]:
    text = log.read_text()
    assert "Traceback" not in text, text[-2000:]
    return [line.split(" ERROR] ", 1)[1] for line in text.splitlines() if " ERROR] " in line]


def unexpected(errors: list[str], allowed: dict[str, str]) -> list[str]:
    return [e for e in errors if not any(re.search(p, e) for p in allowed.values())]


@pytest.fixture(scope="module")
def short_submission(tiny_checkpoint, tmp_path_factory):
    """One short open edge submission (its runs and tree), made once: checked by MLCommons' checker
    where it is present (test_open_edge_tree_...), and copied by the tests that damage a copy of it.
    Returns its folder and what the command printed (stdout, stderr)."""
    root = tmp_path_factory.mktemp("made")
    extra = ["--mlperf-inference", str(INFERENCE)] if HAS_CHECKER else []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = submit(tiny_checkpoint, root, *extra)
    assert rc == (EXIT_CHECKER_ERRORS if HAS_CHECKER else 0), err.getvalue()[-2000:]
    return root, out.getvalue(), err.getvalue()


@needs_inference
def test_open_edge_tree_passes_the_checker_but_for_what_only_a_full_length_run_satisfies(
        tiny_checkpoint, short_submission, tmp_path, capsys):
    made, out, err = short_submission
    assert "MLCommons' checker: submission has errors" in out, err[-2000:]
    log = made / "runs" / "checker.log"
    errors = checker_errors(log)
    assert unexpected(errors, ALLOWED_ERRORS) == []
    text = log.read_text()
    tree = made / "out" / "open" / "gptjteam"
    for scenario in ("Offline", "SingleStream"):
        # every structural check group passed (the folder layout, the system, the measurements)
        assert f"All system checks checks passed for: {tree}/results/cpu2" in text
        assert f"All measurement checks checks passed for: {tree}/measurements/cpu2/gptj-99/{scenario}/" \
               f"cpu2_gptj_{scenario}.json" in text
        # the round's seeds, and the SingleStream run's early stopping, are right
        assert "rng_seed is wrong" not in text and "Early stopping condition was not met" not in text
        # accuracy.txt parses: the checker warns about each of the four scores (random weights)
        assert len(re.findall(rf"{scenario}/accuracy/mlperf_log_detail\.txt accuracy not met", text)) == 4
        acc = tree / "results" / "cpu2" / "gptj-99" / scenario / "accuracy"
        original = made / "runs" / scenario / "accuracy" / "mlperf_log_accuracy.json"
        digest = hashlib.sha256(original.read_bytes()).hexdigest()
        assert (acc / "accuracy.txt").read_text().splitlines()[-1] == f"hash={digest}"
        assert (acc / "mlperf_log_accuracy.json").stat().st_size <= submission.MAX_ACCURACY_LOG_BYTES
        meas = tree / "measurements" / "cpu2" / "gptj-99" / scenario
        assert f"gptj.{scenario}.min_duration = 200" in (meas / "user.conf").read_text()
        assert "gptj submission" in (meas / "README.md").read_text()
    assert json.loads((tree / "systems" / "cpu2.json").read_text())["framework"].startswith("gptj ")
    assert (tree / "code" / "gptj" / "mlperf" / "submission.py").is_file()

    # Assembling again reuses every run (none is made), and gives the same tree (the READMEs name the
    # command that assembled it): on a copy, which the other tests' copies do not see.
    made_copy(short_submission, tmp_path)
    tree = tmp_path / "out" / "open" / "gptjteam"

    def files():
        return {p.relative_to(tree): p.read_bytes() for p in tree.rglob("*") if p.is_file() and p.name != "README.md"}

    before = files()
    assert submit(tiny_checkpoint, tmp_path, "--assemble-only", "--force") == 0
    err = capsys.readouterr().err
    assert err.count("reusing") == 4 and "->" not in err
    assert files() == before
    assert "--assemble-only" in (tree / "measurements" / "cpu2" / "gptj-99" / "Offline" / "README.md").read_text()


@needs_inference
def test_closed_division_writes_the_compliance_tests_the_checker_reads(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    # Closed runs MLPerf's generation settings (4 beams, up to 128 tokens: minutes on 2 cores). What this
    # test checks is the compliance folders, so it lets the short settings through; that the closed
    # division refuses them is test_bad_input's.
    from gptj.mlperf import run as mlperf_run

    monkeypatch.setattr(mlperf_run, "official_differences", lambda gen: [])
    rc = submit(tiny_checkpoint, tmp_path, "--mlperf-inference", str(INFERENCE), "--max-examples", "8",
                division="closed")
    assert rc == EXIT_CHECKER_ERRORS, capsys.readouterr().err[-2000:]
    log = tmp_path / "runs" / "checker.log"
    allowed = {**ALLOWED_ERRORS, **ALLOWED_CLOSED,
               "performance sample count": r"performance_sample_count, found 8, needs to be >= 13368",
               "accuracy data set size": r"accurcy run does not cover all dataset, accuracy samples: 8, "}
    assert unexpected(checker_errors(log), allowed) == []
    text = log.read_text()
    tree = tmp_path / "out" / "closed" / "gptjteam"
    for scenario in ("Offline", "SingleStream"):
        assert f"All compliance check checks passed for: {tree}/compliance/cpu2/gptj-99/{scenario}/" in text
        verify = (tree / "compliance" / "cpu2" / "gptj-99" / scenario / "TEST06" / "verify_accuracy.txt").read_text()
        assert "EOS check pass: True" in verify and "Sample length check pass: True" in verify
        assert ("First token check pass: Skipped" if scenario == "Offline" else "First token check pass: True") \
            in verify
        # the compliance run ran with TEST06's audit.config, kept in its folder; the result runs did not
        runs = tmp_path / "runs" / scenario
        assert (runs / "TEST06" / "audit.config").read_bytes() == \
            (INFERENCE / "compliance" / "TEST06" / "audit.config").read_bytes()
        assert not (runs / "performance" / "audit.config").exists()


def _tree_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.parametrize("case, message", [
    ("empty field", "the system description needs cooling"),
    ("bad status", "status is 'shipping'"),
    ("contradicts a flag", "submitter is 'someone-else' but the command says 'gptjteam'"),
    ("round without gptj", "MLPerf Inference v5.1 has no GPT-J benchmark"),
    ("closed, unofficial generation", "the closed division runs MLPerf's generation settings; these differ: "
                                      "max_new_tokens=12"),
    ("closed without compliance tests", "needs MLCommons' compliance test TEST06: give a checkout"),
    ("closed, w8a8 calibrated on the evaluation set", "calibrated on MLPerf's calibration list "
                                                      "(cnn_dailymail_calibration.json); this w8a8 model was "
                                                      "calibrated on 'cnn_sample.json'"),
])
def test_bad_input_is_one_line_before_any_run(tiny_checkpoint, tmp_path, capsys, case, message):
    runs = tmp_path / "runs"
    runs.mkdir()
    desc = {"empty field": {"cooling": ""}, "bad status": {"status": "shipping"},
            "contradicts a flag": {"submitter": "someone-else"}}.get(case, {})
    complete_desc(runs / "system_desc.json", **desc)
    extra = ["--round", "v5.1"] if case == "round without gptj" else []
    division = "closed" if case.startswith("closed") else "open"
    model = tiny_checkpoint
    if case.startswith("closed") and "unofficial" not in case:
        extra = ["--num-beams", "4", "--max-new-tokens", "128", "--min-new-tokens", "30"]
    if "w8a8" in case:  # calibrated on the bundled evaluation samples, which the closed division forbids
        model = shutil.copytree(tiny_checkpoint, tmp_path / "model")
        assert main(["calibrate", "--model", str(model), "--samples", "2", "--dtype", "float32"]) == 0
        extra += ["--quantize", "w8a8"]
        capsys.readouterr()
    rc = main(["submission", "--model", str(model), "--out", str(tmp_path / "out"), "--runs-dir", str(runs),
               "--submitter", "gptjteam", "--system-name", "cpu2", "--division", division, "--category", "edge",
               *SHORT, *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # nothing written ...
    assert sorted(p.name for p in runs.iterdir()) == ["system_desc.json"]  # ... and no run made


def test_a_missing_description_is_written_for_the_submitter_to_complete(tiny_checkpoint, tmp_path, capsys):
    rc = submit(tiny_checkpoint, tmp_path, desc=False)
    err = capsys.readouterr().err.strip()
    written = tmp_path / "runs" / "system_desc.json"
    assert rc == 1 and len(err.splitlines()) == 1 and f"{written}: wrote the system description" in err
    data = json.loads(written.read_text())
    assert set(sysdesc.REQUIRED) <= set(data)
    assert data["submitter"] == "gptjteam" and data["system_type"] == "edge" and data["division"] == "open"
    blanks = [k for k in sysdesc.MEANINGFUL if not str(data[k]).strip()]
    assert "status" in blanks and "cooling" in blanks and all(k in err for k in blanks)
    assert not (tmp_path / "out").exists()


def made_copy(short_submission, tmp_path: Path) -> None:
    for name in ("runs", "out"):
        shutil.copytree(short_submission[0] / name, tmp_path / name)


def test_assembling_names_a_missing_run_or_a_run_of_other_settings(tiny_checkpoint, short_submission, tmp_path,
                                                                   capsys):
    made_copy(short_submission, tmp_path)
    tree = tmp_path / "out" / "open" / "gptjteam"
    before = {p: p.read_bytes() for p in _tree_files(tree)}
    runs = tmp_path / "runs"

    def assemble(*extra):
        rc = submit(tiny_checkpoint, tmp_path, "--assemble-only", "--force", *extra)
        err = capsys.readouterr().err.strip()
        assert rc == 1 and len(err.splitlines()) == 1, err
        assert {p: p.read_bytes() for p in _tree_files(tree)} == before  # the tree is untouched
        return err

    capsys.readouterr()
    # other settings than the runs were made with
    assert "not the Offline performance run asked for: generation.max_new_tokens 12 (wanted 8)" in \
        assemble("--max-new-tokens", "8")
    # a run of the wrong scenario where another belongs
    shutil.move(runs / "SingleStream" / "performance", tmp_path / "ss-performance")
    shutil.copytree(runs / "Offline" / "performance", runs / "SingleStream" / "performance")
    assert "not the SingleStream performance run asked for: scenario 'Offline' (wanted 'SingleStream')" in assemble()
    # a missing run
    shutil.rmtree(runs / "SingleStream" / "performance")
    assert f"{runs / 'SingleStream' / 'performance'}: no such run" in assemble()
    # an interrupted one
    shutil.copytree(runs / "Offline" / "accuracy", runs / "SingleStream" / "performance")
    made = json.loads((runs / "Offline" / "accuracy" / "run.json").read_text())
    made["interrupted"] = {"loadgen_finished": False}
    (runs / "Offline" / "accuracy" / "run.json").write_text(json.dumps(made))
    assert "Offline/accuracy: the run was interrupted" in assemble()
    shutil.rmtree(runs / "SingleStream" / "performance")
    shutil.move(tmp_path / "ss-performance", runs / "SingleStream" / "performance")
    made["interrupted"] = None
    (runs / "Offline" / "accuracy" / "run.json").write_text(json.dumps(made))
    # a run LoadGen judged INVALID (here: an Offline query done before the min duration), which the checker rejects
    summary = runs / "Offline" / "performance" / "mlperf_log_summary.txt"
    text = summary.read_text()
    assert "Result is : VALID" in text and "Min duration satisfied : Yes" in text
    summary.write_text(text.replace("Result is : VALID", "Result is : INVALID")
                       .replace("Min duration satisfied : Yes", "Min duration satisfied : NO"))
    detail_log = summary.with_name("mlperf_log_detail.txt")  # LoadGen's detail log says the same
    text = detail_log.read_text()
    assert '"key": "result_validity", "value": "VALID"' in text
    detail_log.write_text(text.replace('"key": "result_validity", "value": "VALID"',
                                       '"key": "result_validity", "value": "INVALID"'))
    err = assemble()
    assert "Offline performance" in err and "is INVALID (min duration not satisfied)" in err and "--target-qps" in err


def _cut(path: Path, keep: float = 0.5, at_line_end: bool = False) -> None:
    """A file cut short, as a full disk or a killed copy leaves it."""
    data = path.read_bytes()
    n = int(len(data) * keep)
    if at_line_end:
        n = data.rindex(b"\n", 0, n) + 1
    path.write_bytes(data[:n])


def _drop_one_sample(path: Path) -> None:
    path.write_text(json.dumps(json.loads(path.read_text())[1:]))


def _other_min_duration(path: Path) -> None:
    text = path.read_text()
    assert '"key": "requested_min_duration_ms", "value": 200,' in text
    path.write_text(text.replace('"key": "requested_min_duration_ms", "value": 200,',
                                 '"key": "requested_min_duration_ms", "value": 300,'))


@pytest.mark.parametrize("run, file, damage, message", [
    ("SingleStream/performance", "mlperf_log_summary.txt", _cut,
     "mlperf_log_summary.txt is cut short (no 'errors encountered' line at its end)"),
    ("Offline/performance", "mlperf_log_detail.txt", _cut, "mlperf_log_detail.txt is cut short"),
    ("Offline/accuracy", "mlperf_log_detail.txt", lambda p: _cut(p, 0.9, at_line_end=True),
     "mlperf_log_detail.txt is cut short (no power_end record: the test's end)"),
    ("Offline/accuracy", "mlperf_log_accuracy.json", lambda p: _cut(p, 0.7),
     "mlperf_log_accuracy.json is not valid JSON"),
    ("SingleStream/accuracy", "mlperf_log_accuracy.json", _drop_one_sample,
     "mlperf_log_accuracy.json answers 29 of the 30 samples"),
    ("SingleStream/performance", "mlperf_log_detail.txt", _other_min_duration,
     "LoadGen ran it with requested_min_duration_ms 300, not 200"),
])
def test_a_damaged_run_is_named_and_nothing_is_assembled(tiny_checkpoint, short_submission, tmp_path, capsys,
                                                         run, file, damage, message):
    """--assemble-only, and the normal path before it reuses a run, read every run's logs: a summary
    or detail log cut short, an accuracy log that is not JSON or misses a sample, a run LoadGen made
    with other settings than run.json records: one line naming the run's folder and what is wrong,
    exit 1, no tree."""
    made_copy(short_submission, tmp_path)
    shutil.rmtree(tmp_path / "out")
    folder = tmp_path / "runs" / run
    damage(folder / file)
    capsys.readouterr()
    for extra in (["--assemble-only"], []):
        rc = submit(tiny_checkpoint, tmp_path, *extra)
        err = capsys.readouterr().err.strip()
        assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert f"{folder}: the {run.replace('/', ' ')} run is damaged: {message}" in err
        assert ("remove that folder" in err) is not bool(extra)
        assert not (tmp_path / "out").exists()
    assert "->" not in err  # nothing was run again


def test_truncation_keeps_head_and_tail_and_hashes_the_whole_log(tmp_path):
    entries = [{"seq_id": i, "qsl_idx": i, "data": f"{i:064x}" * 4, "token_count": 16} for i in range(200)]
    src = tmp_path / "mlperf_log_accuracy.json"
    src.write_text(json.dumps(entries, indent=1))
    dst = tmp_path / "truncated.json"
    digest = submission.truncate_accuracy_log(src, dst)
    text, whole = dst.read_text(), src.read_text()
    assert digest == hashlib.sha256(src.read_bytes()).hexdigest()
    keep = submission.TRUNCATE_KEEP_CHARS
    assert text == whole[:keep] + "\n\n...\n\n" + whole[-keep:]
    assert len(text.encode()) <= submission.MAX_ACCURACY_LOG_BYTES
    small = tmp_path / "small.json"
    small.write_text(json.dumps(entries[:3]))
    submission.truncate_accuracy_log(small, dst)
    assert dst.read_text() == small.read_text()  # a small log is kept whole


def test_a_gpu_run_describes_its_accelerator(monkeypatch, tmp_path):
    """On CUDA (faked here: a GPU's properties and its sysfs PCIe link) the probe names the GPU, its
    memory, its link to the host and how many the runs use; the submitter fills in only what no
    program can know, and the checker's rules pass."""
    from types import SimpleNamespace

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, pci_domain_id=0,
                            pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    link = tmp_path / "0000:1b:00.0"
    link.mkdir()
    (link / "current_link_speed").write_text("32.0 GT/s PCIe\n")
    (link / "current_link_width").write_text("16\n")
    monkeypatch.setattr(sysdesc, "PCI_DEVICES", tmp_path)
    probed = sysdesc.probe("cuda")
    assert probed["accelerator_model_name"] == "NVIDIA H100 80GB HBM3" and probed["accelerators_per_node"] == "1"
    assert probed["accelerator_memory_capacity"] == "80 GiB" and probed["accelerator_memory_configuration"] == "HBM3"
    assert probed["accelerator_host_interconnect"] == "PCIe 5.0 x16"
    assert probed["accelerator_interconnect"].startswith(sysdesc.NOT_APPLICABLE)
    assert probed["other_software_stack"].endswith("CUDA 12.8")
    assert sysdesc.probe("cuda", world=4)["accelerators_per_node"] == "4"
    props.name = "NVIDIA H200"  # no memory kind in its name; no sysfs link: blanks for the submitter
    monkeypatch.setattr(sysdesc, "PCI_DEVICES", tmp_path / "none")
    probed = sysdesc.probe("cuda")
    assert probed["accelerator_memory_configuration"] == "" and probed["accelerator_host_interconnect"] == ""
    desc = sysdesc.merge(probed, {"status": "Available", "cooling": "air", "host_memory_configuration": "16x 64 GB",
                                  "host_storage_type": "SSD", "host_networking": "Ethernet",
                                  "host_network_card_count": "1", "accelerator_memory_configuration": "HBM3e",
                                  "accelerator_host_interconnect": "PCIe 5.0 x16"},
                         {"submitter": "a", "system_name": "b", "division": "closed", "system_type": "datacenter"}, "f")
    sysdesc.check(desc, "f")


def test_the_probed_description_has_every_field_the_checker_requires():
    probed = sysdesc.probe("cpu")
    assert set(sysdesc.REQUIRED) <= set(probed)
    assert probed["accelerators_per_node"] == "0" and probed["accelerator_model_name"] == sysdesc.NOT_APPLICABLE
    assert int(probed["host_processor_core_count"]) >= 1 and probed["framework"].startswith("gptj ")
    # what no program can know stays blank, to be filled by the submitter
    assert probed["cooling"] == "" and probed["host_memory_configuration"] == ""
    desc = sysdesc.merge(probed, {"status": "Available", "cooling": "air", "host_memory_configuration": "8x 32 GB",
                                  "host_storage_type": "SSD", "host_networking": "Ethernet",
                                  "host_network_card_count": "1", "framework": ""},
                         {"submitter": "a", "system_name": "b", "division": "open", "system_type": "edge"}, "f")
    assert desc["framework"] == probed["framework"]  # an empty value does not erase a probed one
    sysdesc.check(desc, "f")
    for bad, message in ((dict(number_of_nodes="one"), "number_of_nodes must be a whole number"),
                         (dict(is_network="false"), "is_network is for the network division")):
        with pytest.raises(Exception, match=message):
            sysdesc.check({**desc, **bad}, "f")


@needs_inference
def test_the_checker_knows_gptj_only_in_v5_0(monkeypatch):
    """rules.py's facts about the checker: gptj in round v5.0 only, and its Offline defect."""
    monkeypatch.syspath_prepend(str(INFERENCE / "tools" / "submission"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    from submission_checker import constants

    for name in rules.BENCHMARKS:
        assert name in constants.MODEL_CONFIG["v5.0"]["models"]
        for dropped in rules.DROPPED:
            assert name not in constants.MODEL_CONFIG[dropped]["models"]
        assert name not in constants.OFFLINE_MIN_SPQ_SINCE_V4
        assert constants.MODEL_CONFIG["v5.0"]["performance-sample-count"][name] == \
            rules.ROUNDS["v5.0"].performance_sample_count
        assert constants.MODEL_CONFIG["v5.0"]["dataset-size"][name] == rules.ROUNDS["v5.0"].dataset_size
    for category, scenarios in rules.ROUNDS["v5.0"].scenarios.items():
        assert sorted(constants.MODEL_CONFIG["v5.0"][f"required-scenarios-{category}"]["gptj-99"]) == \
            sorted(scenarios)
    assert constants.MODEL_CONFIG["v5.0"]["seeds"] == rules.ROUNDS["v5.0"].seeds
    assert "gptj-99" in constants.MODEL_CONFIG["v5.0"]["models_TEST06"]


# --- gptj mlperf: the options a submitter reaches for ------------------------------------------------


def detail(log_dir: Path) -> dict:
    out = {}
    for line in (log_dir / "mlperf_log_detail.txt").read_text().splitlines():
        if line.startswith(":::MLLOG"):
            record = json.loads(line[len(":::MLLOG"):])
            out.setdefault(record["key"], record["value"])
    return out


def mlperf(tiny_checkpoint, log_dir, *extra):
    return main(["mlperf", "--model", str(tiny_checkpoint), "--log-dir", str(log_dir), "--mode", "performance",
                 "--num-beams", "1", "--max-new-tokens", "4", "--min-new-tokens", "0", "--quiet", *extra])


@pytest.mark.parametrize("scenario", ["SingleStream", "Server"])
def test_a_short_run_issues_what_loadgen_raises_its_min_query_count_to(tiny_checkpoint, tmp_path, capsys, scenario):
    """--min-query-count is a minimum LoadGen may raise (equal issue: whole passes over the
    performance samples): the run follows LoadGen's count, so its min queries are satisfied. Only
    --max-query-count caps a run, and a cap below LoadGen's minimum is said before the run (it will
    be INVALID) and after it, with the setting that fixes it."""
    extra = ["--target-latency-ms", "20"] if scenario == "SingleStream" else ["--target-qps", "200"]
    args = ["--scenario", scenario, "--min-duration-ms", "100", "--min-query-count", "7",
            "--performance-sample-count", "10", *extra]
    assert mlperf(tiny_checkpoint, tmp_path / "a", *args) == 0
    d = detail(tmp_path / "a")
    assert d["effective_performance_sample_count"] == 10 and d["effective_max_query_count"] == 0  # no cap
    # LoadGen's count, more than the 7 asked (SingleStream: its raised minimum; Server: its schedule)
    assert d["result_query_count"] > 7 and d["result_min_queries_met"] is True and d["result_min_duration_met"] is True
    if scenario == "SingleStream":
        assert d["result_query_count"] == d["effective_min_query_count"]
    capsys.readouterr()
    assert mlperf(tiny_checkpoint, tmp_path / "b", *args, "--max-query-count", "7") == 0
    out, err = capsys.readouterr()
    d = detail(tmp_path / "b")
    assert d["result_query_count"] == 7 and d["result_validity"] == "INVALID"
    summary = (tmp_path / "b" / "summary.md").read_text()
    if scenario == "SingleStream":  # LoadGen's minimum is above the cap
        minimum = d["effective_min_query_count"]
        assert d["result_min_queries_met"] is False
        assert f"the run will be INVALID (min queries): --max-query-count 7 stops it before LoadGen's minimum of " \
               f"{minimum} queries" in err
        why = f"min queries not satisfied: 7 queries issued, LoadGen's minimum is {minimum}; --max-query-count 7 " \
              f"stopped it: raise it to {minimum} or drop it"
    else:  # the schedule over the min duration is cut short
        assert d["result_min_duration_met"] is False
        assert "the run will be INVALID (min duration): --max-query-count 7 ends it before" in err
        why = "min duration not satisfied: --max-query-count 7 stopped the run before 100 ms; raise it or drop it"
    assert f"INVALID: {why}" in out and f"- {why}" in summary


def test_a_stray_audit_config_changes_nothing_and_a_given_one_applies(tiny_checkpoint, tmp_path, monkeypatch):
    stray = tmp_path / "cwd"
    stray.mkdir()
    # an audit config that would change the run: accuracy logging, more queries, no equal issue
    (stray / "audit.config").write_text("*.*.mode = 2\n*.*.accuracy_log_sampling_target = 100\n"
                                        "*.*.min_query_count = 11\n*.*.sample_concatenate_permutation = 0\n")
    args = ["--scenario", "SingleStream", "--target-latency-ms", "20", "--min-duration-ms", "100",
            "--min-query-count", "5", "--round", "v5.0"]
    assert mlperf(tiny_checkpoint, tmp_path / "clean", *args) == 0
    monkeypatch.chdir(stray)
    assert mlperf(tiny_checkpoint, tmp_path / "stray", *args) == 0
    clean, with_stray = detail(tmp_path / "clean"), detail(tmp_path / "stray")
    for key in ("effective_min_query_count", "result_query_count", "effective_sample_concatenate_permutation",
                "effective_accuracy_log_sampling_target", "effective_qsl_rng_seed"):
        assert with_stray[key] == clean[key], key
    assert with_stray["effective_qsl_rng_seed"] == rules.ROUNDS["v5.0"].seeds["qsl_rng_seed"]
    text = (tmp_path / "stray" / "mlperf_log_detail.txt").read_text()
    assert "Found Audit Config" not in text and not (tmp_path / "stray" / "audit.config").exists()

    assert mlperf(tiny_checkpoint, tmp_path / "audited", *args, "--audit-config", str(stray / "audit.config")) == 0
    audited = detail(tmp_path / "audited")
    assert audited["effective_sample_concatenate_permutation"] is False
    assert audited["effective_accuracy_log_sampling_target"] == 100
    # what gptj reports asking for is what LoadGen used: the audit config's count, over the flag's
    asked = json.loads((tmp_path / "audited" / "run.json").read_text())["run_length"]["asked"]
    assert audited["effective_min_query_count"] == 11
    assert asked["min_query_count"] == {"value": 11, "source": "--audit-config"}
    assert asked["min_duration_ms"]["source"] == "--min-duration-ms"  # a key the audit config leaves alone
    assert (tmp_path / "audited" / "audit.config").read_text() == (stray / "audit.config").read_text()


def test_help_and_docs_agree_on_what_min_query_count_does(capsys):
    """--min-query-count is a minimum LoadGen may raise, the same in `gptj mlperf` and `gptj
    submission` (their help) and in docs/SUBMISSION.md; none of them says it stops a run."""
    import re

    helps = {}
    for command in ("mlperf", "submission"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        helps[command] = re.search(r"--min-query-count MIN_QUERY_COUNT (.+?) --max-query-count", text).group(1)
        assert "LoadGen may raise it" in helps[command] and "the run issues what LoadGen asks" in helps[command]
        assert "stops there" not in text and "stop a SingleStream or Server run there (default and 0: no cap" in text
    assert helps["mlperf"] == helps["submission"]
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "SUBMISSION.md").read_text().split())
    assert "`--min-query-count` is LoadGen's min_query_count, a minimum" in docs and "the same in `gptj mlperf` and " \
        "`gptj submission`" in docs and "the run issues what LoadGen asks for" in docs
    assert "stops at `--min-query-count`" not in docs


def test_calibration_md_says_how_each_quantization_was_made(tmp_path):
    """calibration.md: float; int8 / int4 at load from the weights alone (int4: its groups); W8A8 with
    its calibration's dataset and size (at load from a calibrated float folder, or in a checkpoint)."""
    from types import SimpleNamespace

    def text(config: dict | None, quantize: str | None = None, group_size: int | None = None) -> str:
        folder = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        if config is not None:
            (folder / "config.json").write_text(json.dumps(config))
        run = SimpleNamespace(model=folder, spec=SimpleNamespace(quantize=quantize, group_size=group_size))
        return submission.calibration_text(run)

    record = {"alpha": 0.5, "dataset": rules.CALIBRATION_LIST, "samples": 1000, "tokens": 812345}
    assert "No quantization" in text({})
    assert "int8 per output channel when the model loads, from the weights alone" in text({}, "int8")
    assert "groups of 64 inputs" in text({}, "int4", 64) and "groups of 128 (gptj's default)" in text({}, "int4")
    w8a8 = text({"calibration": record}, "w8a8")
    assert "when the model loads" in w8a8 and "alpha 0.5" in w8a8 and "on 1000 samples (812345 tokens) of " \
        f"{rules.CALIBRATION_LIST}" in w8a8 and "no calibration data" not in w8a8
    stored = text({"quantization": {"mode": "w8a8", "group_size": None, "calibration": record}})
    assert "in the checkpoint (gptj convert --quantize)" in stored and "812345 tokens" in stored
    assert "groups of 32 inputs" in text({"quantization": {"mode": "int4", "group_size": 32}})
