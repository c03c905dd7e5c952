"""`gptj submission`: the runs an MLPerf submission of gptj-99 (round v5.0) or llama3.1-8b[-edge] (round
v6.1) needs, and the official tree made from them.

    plan      the round's scenarios for the benchmark and category (llama3.1-8b: Offline, and Server and/or
              Interactive): a performance and an accuracy run each, and (closed division) the compliance
              tests the checker reads (TEST06; none for llama3.1-8b-edge)
    runs      each in its own folder under runs_dir (<Scenario>/<performance|accuracy|TEST06>), made with
              `gptj mlperf`'s run(); a complete run with the same identity is reused, so a stopped
              submission goes on where it stopped and runs made before can be assembled
    assemble  <out>/<division>/<submitter>/{code,documentation,measurements,results,systems,compliance}
              (v6.1: {src,documentation,results,systems}, see submission_rounds), filled beside its
              target and moved into place whole; accuracy logs truncated as MLCommons'
              truncate_accuracy_log.py does (the untouched originals stay in runs_dir)
    check     MLCommons' submission checker, when a checkout of mlcommons/inference is given

Everything that can be wrong with the input (system description, a run of other settings, a missing
run, a damaged one, a round without the benchmark) is found before the first run starts. A run taken as made
is read first (`damage`): LoadGen's summary states its result and is whole, the detail log is whole
:::MLLOG records to the test's end, the accuracy log is JSON covering every sample of an accuracy
run, and LoadGen logged the settings the run records."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gptj.errors import GptjError
from gptj.files import atomic_write_text, move_into_place, temp_sibling
from gptj.mlperf import rules
from gptj.mlperf import submission_rounds as layout
from gptj.mlperf.config import MLPerfConfig

MAX_ACCURACY_LOG_BYTES = 10 * 1024  # the checker's MAX_ACCURACY_LOG_SIZE
TRUNCATE_KEEP_CHARS = 4096  # head and tail kept by MLCommons' truncate_accuracy_log.py
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
IMPLEMENTATION = layout.IMPLEMENTATION


@dataclass
class SubmissionConfig:
    out: Path
    submitter: str
    system_name: str
    division: str
    category: str | None  # None: the benchmark's only one (llama3.1-8b datacenter, llama3.1-8b-edge edge)
    benchmark: str
    run: MLPerfConfig  # the settings every run shares (its scenario, mode, log_dir, audit_config are set per run)
    round: str | None = None  # None: the benchmark's (rules.default_round: gptj v5.0, llama v6.1)
    scenarios: tuple[str, ...] | None = None  # None: the round's required ones (and llama3.1-8b's Server)
    runs_dir: Path | None = None  # None: mlperf-runs/<system>-<benchmark>-<division>
    system_desc: Path | None = None  # None: <runs_dir>/system_desc.json
    mlperf_inference: Path | None = None  # a checkout of mlcommons/inference: compliance tests, the checker
    assemble_only: bool = False
    force: bool = False  # replace an existing <out>/<division>/<submitter>
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for what, value in (("--submitter", self.submitter), ("--system-name", self.system_name)):
            if not NAME_RE.fullmatch(value or ""):
                raise GptjError(f"{what} {value!r}: use letters, digits, '_', '.' and '-' (it names folders)")
        for what, value, allowed in (("--division", self.division, rules.DIVISIONS),
                                     ("--benchmark", self.benchmark, rules.SUBMISSION_BENCHMARKS)):
            if value not in allowed:
                raise GptjError(f"{what} {value!r}: choose from {', '.join(allowed)}")
        self.round = self.round or rules.default_round(self.benchmark)
        categories = rules.submission_categories(self.benchmark, self.round)
        if self.category is None:
            if len(categories) != 1:
                raise GptjError(f"{self.benchmark} needs --category ({' or '.join(categories)})")
            self.category = categories[0]
        if self.category not in rules.CATEGORIES:
            raise GptjError(f"--category {self.category!r}: choose from {', '.join(rules.CATEGORIES)}")
        self.scenarios = rules.submission_scenarios(self.benchmark, self.round, self.category, self.scenarios)
        if self.runs_dir is None:
            self.runs_dir = Path("mlperf-runs") / f"{self.system_name}-{self.benchmark}-{self.division}"
        if self.system_desc is None:
            self.system_desc = Path(self.runs_dir) / "system_desc.json"

    @property
    def tree(self) -> Path:
        return Path(self.out) / self.division / self.submitter

    @property
    def round_rules(self) -> rules.Round:
        return rules.submission_round(self.benchmark, self.round)


@dataclass(frozen=True)
class PlannedRun:
    scenario: str
    kind: str  # performance, accuracy, or a compliance test (TEST06)
    cfg: MLPerfConfig
    seeds: dict | None = None  # the round's seeds, which LoadGen must log (None: not checked)

    @property
    def folder(self) -> Path:
        return Path(self.cfg.log_dir)

    @property
    def label(self) -> str:
        return f"{self.scenario} {self.kind}"


def compliance_dir(sub: SubmissionConfig, test: str) -> Path:
    if sub.mlperf_inference is None:
        raise GptjError(f"the {sub.division} division needs MLCommons' compliance test {test}: give a checkout of "
                        "github.com/mlcommons/inference with --mlperf-inference DIR")
    path = Path(sub.mlperf_inference) / "compliance" / test
    if not (path / "audit.config").is_file() or not (path / "run_verification.py").is_file():
        raise GptjError(f"{path}: no {test} audit.config and run_verification.py there (is --mlperf-inference a "
                        "checkout of github.com/mlcommons/inference?)")
    return path


def plan(sub: SubmissionConfig) -> list[PlannedRun]:
    """Every run the submission needs, in the order they run."""
    runs, rnd, shared = [], sub.round_rules, sub.run
    # a gptj run sets the round's seeds; a llama run takes LoadGen's built-in ones (prepare checks them)
    round_seeds = None if shared.llama else sub.round
    if shared.llama:  # what run() generates with, and records as the run's identity: the tokenizer's EOS ids
        from gptj.mlperf.run import with_tokenizer_eos
        from gptj.tokenizer import tokenizer_for_model

        shared = with_tokenizer_eos(shared, tokenizer_for_model(shared.model))
    for scenario in sub.scenarios:
        kinds = [("performance", "performance", None), ("accuracy", "accuracy", None)]
        tests = rnd.compliance if sub.division == "closed" else ()
        kinds += [(test, "performance", compliance_dir(sub, test) / "audit.config") for test in tests]
        for kind, mode, audit in kinds:
            cfg = dataclasses.replace(shared, scenario=scenario, mode=mode, round=round_seeds, audit_config=audit,
                                      token_latencies=kind in rules.TOKEN_COUNT_TESTS,
                                      log_dir=Path(sub.runs_dir) / scenario / kind)
            seeds = rnd.seeds if kind in ("performance", "accuracy") else None
            runs.append(PlannedRun(scenario, kind, cfg, seeds))
    return runs


# --- a run already made: complete, and the run asked for? -------------------------------------------


def _differences(found: dict, wanted: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(found) | set(wanted)):
        a, b = found.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} (wanted {b!r})")
    return out


def run_status(run: PlannedRun) -> tuple[str, str]:
    """("done" | "missing" | "incomplete" | "different" | "damaged", why) for the run's folder."""
    folder = run.folder
    if not folder.exists():
        return "missing", f"{folder}: no such run"
    try:
        made = json.loads((folder / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "incomplete", f"{folder}: no readable run.json (the run did not finish)"
    needed = ["mlperf_log_summary.txt", "mlperf_log_detail.txt", "mlperf_log_accuracy.json"]
    if run.kind == "accuracy":
        needed.append("accuracy.txt")
    absent = [n for n in needed if not (folder / n).is_file() or (folder / n).stat().st_size == 0]
    if made.get("interrupted") or absent:
        why = "was interrupted" if made.get("interrupted") else f"lacks {', '.join(absent)}"
        return "incomplete", f"{folder}: the run {why}"
    identity = made.get("identity")
    if not isinstance(identity, dict):
        return "different", f"{folder}: run.json has no identity (made by an older gptj); run it again"
    diff = _differences(identity, json.loads(json.dumps(run.cfg.identity())))  # as run.json holds it (tuples: lists)
    if diff:
        return "different", f"{folder}: not the {run.label} run asked for: {'; '.join(diff[:3])}"
    what = damage(run, made)
    if what is not None:
        return "damaged", f"{folder}: the {run.label} run is damaged: {what}"
    return "done", ""


# --- a run's logs: whole, and of the settings asked for -----------------------------------------------

# The last line of every mlperf_log_summary.txt LoadGen finishes ("No errors encountered during test.",
# "1 ERROR encountered. See detailed log."): a summary cut short lacks it.
_SUMMARY_END = re.compile(r"^(No errors|\d+ ERRORS?) encountered\b")
_RESULT = re.compile(r"^Result is : (VALID|INVALID)$")
_MODES = {"performance": "PerformanceOnly", "accuracy": "AccuracyOnly"}


def _detail_records(path: Path) -> tuple[dict[str, object], str | None]:
    """The :::MLLOG records of a detail log by key (the first of each), and what is wrong with the
    file (None: every line a whole record, the file ending with a newline)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    records: dict[str, object] = {}
    if not text.endswith("\n"):
        return records, f"{path.name} is cut short (its last line is not whole)"
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not line.startswith(":::MLLOG"):
            return records, f"{path.name} line {n} is not a :::MLLOG record"
        try:
            record = json.loads(line[len(":::MLLOG"):])
        except ValueError:
            return records, f"{path.name} line {n} is not a whole :::MLLOG record"
        if isinstance(record, dict) and "key" in record:
            records.setdefault(record["key"], record.get("value"))
    return records, None


def _accuracy_entries(path: Path) -> tuple[list | None, str | None]:
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{path.name} is not valid JSON ({str(e).splitlines()[0]})"
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("qsl_idx"), int)
                                                 for e in entries):
        return None, f"{path.name} is not LoadGen's list of {{qsl_idx, data}} entries"
    return entries, None


def damage(run: PlannedRun, made: dict) -> str | None:
    """What is wrong with a finished run's logs (None: nothing), in a few words: LoadGen's summary
    states its result and ends as LoadGen ends it; the detail log is whole :::MLLOG records up to the
    test's end; the accuracy log is JSON and (accuracy runs) answers every sample of the run's data
    set; and what LoadGen logs it ran is the scenario, mode, seeds and run length the run asked for."""
    folder = run.folder
    from gptj.mlperf.report import parse_loadgen_summary

    summary_path = folder / "mlperf_log_summary.txt"
    lines = [line.strip() for line in summary_path.read_text(encoding="utf-8", errors="replace").splitlines()
             if line.strip()]
    if not lines or not _SUMMARY_END.match(lines[-1]):
        return f"{summary_path.name} is cut short (no 'errors encountered' line at its end)"
    summary = parse_loadgen_summary(summary_path)
    mode = _MODES["accuracy" if run.kind == "accuracy" else "performance"]
    if mode == "PerformanceOnly":
        if not _RESULT.match(summary.get("result_line", "")):
            return f"{summary_path.name} states no result ('Result is : VALID' or 'INVALID')"
        for key, wanted in (("Scenario", run.cfg.scenario), ("Mode", mode)):
            if summary.get(key) != wanted:
                return f"{summary_path.name} says {key.lower()} {summary.get(key)!r}, not {wanted!r}"

    records, wrong = _detail_records(folder / "mlperf_log_detail.txt")
    if wrong is not None:
        return wrong
    ends = ["power_end"] + (["result_validity", "num_errors"] if mode == "PerformanceOnly" else [])
    missing = [key for key in ends if key not in records]
    if missing:
        return f"mlperf_log_detail.txt is cut short (no {', '.join(missing)} record: the test's end)"
    if mode == "PerformanceOnly" and records["result_validity"] != summary["result_line"].rsplit(" ", 1)[1]:
        return (f"mlperf_log_detail.txt says {records['result_validity']} but {summary_path.name} says "
                f"{summary['result_line'].rsplit(' ', 1)[1]}")
    wanted = {"effective_scenario": run.cfg.scenario, "effective_test_mode": mode}  # Interactive: LoadGen's Server
    if run.seeds is not None:
        wanted.update({f"effective_{key}": value for key, value in run.seeds.items()})
    asked = (made.get("run_length") or {}).get("asked") or {}
    for key, logged in (("min_duration_ms", "requested_min_duration_ms"),
                        ("min_query_count", "requested_min_query_count"),
                        ("performance_sample_count", "requested_performance_sample_count_override")):
        if isinstance(asked.get(key), dict) and "value" in asked[key]:
            wanted[logged] = asked[key]["value"]
    for key, value in wanted.items():
        if records.get(key) != value:
            return f"LoadGen ran it with {key.removeprefix('effective_')} {records.get(key)!r}, not {value!r}"

    entries, wrong = _accuracy_entries(folder / "mlperf_log_accuracy.json")
    if wrong is not None:
        return wrong
    if run.kind == "accuracy":
        samples = (made.get("dataset") or {}).get("samples")
        answered = {e["qsl_idx"] for e in entries}
        if not isinstance(samples, int) or samples < 1:
            return "run.json does not say how many samples its data set had"
        if answered != set(range(samples)):
            return (f"mlperf_log_accuracy.json answers {len(answered & set(range(samples))):,} of the {samples:,} "
                    "samples")
        text = (folder / "accuracy.txt").read_text(encoding="utf-8", errors="replace")
        if not text.startswith("{'rouge1': "):
            return "accuracy.txt holds no result line"
    return None


# --- the tree ---------------------------------------------------------------------------------------


def truncate_accuracy_log(src: Path, dst: Path) -> str:
    """Copy an accuracy log as MLCommons' truncate_accuracy_log.py leaves it: whole when small,
    else its first and last TRUNCATE_KEEP_CHARS characters around "\\n\\n...\\n\\n". Returns the
    sha256 of the whole file (the `hash=` line of accuracy.txt)."""
    data = src.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    text = data.decode("utf-8")
    if len(data) > MAX_ACCURACY_LOG_BYTES:
        text = text[:TRUNCATE_KEEP_CHARS] + "\n\n...\n\n" + text[-TRUNCATE_KEEP_CHARS:]
    dst.write_text(text, encoding="utf-8")
    return digest


def user_conf_text(runs: list[PlannedRun], scenario: str, round_name: str | None = None) -> str:
    """The scenario's settings over mlperf.conf, in user.conf's syntax (what the runs were given)."""
    perf = next(r.cfg for r in runs if r.scenario == scenario and r.kind == "performance")
    made = json.loads((Path(perf.log_dir) / "run.json").read_text(encoding="utf-8"))
    asked = (made.get("run_length") or {}).get("asked") or {}
    keys = {"min_query_count": "min_query_count", "min_duration_ms": "min_duration",
            "performance_sample_count": "performance_sample_count_override", "max_query_count": "max_query_count",
            "expected_qps": "target_qps", "target_qps": "target_qps", "target_latency_ms": "target_latency",
            "expected_latency_ms": "target_latency"}
    seeds = f"{perf.round} seeds" if perf.round else f"its seeds, round {round_name}'s" if round_name else "its seeds"
    lines = [f"# {IMPLEMENTATION}: what the {scenario} runs set over LoadGen's built-in mlperf.conf ({seeds})"]
    for key, conf_key in keys.items():
        if key in asked and asked[key]["source"] not in ("mlperf.conf", "user.conf / mlperf.conf"):
            lines.append(f"{perf.loadgen_model}.{perf.scenario}.{conf_key} = {asked[key]['value']:g}")
    return "\n".join(lines) + "\n"


def _weights(cfg: MLPerfConfig) -> tuple[str, str]:
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(cfg.spec.dtype, cfg.spec.dtype)
    if cfg.spec.quantize:
        return f"{cfg.spec.quantize} (linears), {dtype} (others)", \
            f"weight-only {cfg.spec.quantize} quantization of the linear layers, per output channel, on load"
    return dtype, "none" if dtype == "fp32" else f"cast to {dtype}"


def implementation_json(cfg: MLPerfConfig) -> dict:
    weights, transformations = _weights(cfg)
    return {"input_data_types": "int64 (token ids)", "retraining": "No",
            "starting_weights_filename": Path(cfg.model).name if cfg.model is not None else "served model",
            "weight_data_types": weights, "weight_transformations": transformations}


def measurements_readme(sub: SubmissionConfig, runs: list[PlannedRun], scenario: str) -> str:
    import gptj

    source = layout.source_folder(Path(), sub.round_rules).as_posix()
    lines = [f"# {sub.benchmark} {scenario} on {sub.system_name}", "",
             f"Implementation: gptj {gptj.__version__} (`pip install {gptj.DISTRIBUTION}`; its source is in "
             f"`{source}`), LoadGen's built-in mlperf.conf with the {sub.round} seeds, and `user.conf` here.", "",
             "## How the runs were made", ""]
    for run in runs:
        if run.scenario != scenario:
            continue
        made = json.loads((run.folder / "run.json").read_text(encoding="utf-8"))
        lines += [f"- {run.kind}: `{' '.join(map(str, made.get('command') or []))}`"]
        for note in made.get("notes") or []:
            lines.append(f"  - note: {note}")
    lines += ["", "The submission was assembled with:", "", f"    {' '.join(sub.run.argv)}", ""]
    return "\n".join(lines)


def _copy_source(dst: Path) -> None:
    """The implementation's source (gptj's Python and C files) into code/gptj."""
    import gptj

    root = Path(gptj.__file__).parent
    for src in sorted(root.rglob("*")):
        if src.is_file() and src.suffix in (".py", ".c") and "__pycache__" not in src.parts:
            target = dst / src.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)


def _verify_test06(sub: SubmissionConfig, run: PlannedRun, out: Path) -> None:
    """MLCommons' TEST06 verification of the run's accuracy log, written to out/TEST06."""
    script = compliance_dir(sub, "TEST06") / "run_verification.py"
    eos, dtype = layout.test06_arguments(sub.benchmark, sub.run.model)
    cmd = [sys.executable, str(script), "-c", str(run.folder), "-o", str(out), "-s", run.scenario,
           "-e", str(eos), "-d", dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    if done.returncode != 0 or not (out / "TEST06" / "verify_accuracy.txt").is_file():
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise GptjError(f"TEST06 verification of {run.folder} failed: {last[0]}")


def assemble(sub: SubmissionConfig, runs: list[PlannedRun], system: dict) -> Path:
    """Write <out>/<division>/<submitter> from the runs (all done), whole or not at all, in the round's
    layout (submission_rounds)."""
    target = sub.tree
    if target.exists() and not sub.force:
        raise GptjError(f"{target} exists; --force replaces it")
    tmp = temp_sibling(target)
    try:
        system_dir = tmp / "systems"
        system_dir.mkdir()
        (system_dir / f"{sub.system_name}.json").write_text(json.dumps(system, indent=2) + "\n", encoding="utf-8")
        _copy_source(layout.source_folder(tmp, sub.round_rules))
        doc = tmp / "documentation"
        doc.mkdir()
        (doc / "calibration.md").write_text(calibration_text(sub.run), encoding="utf-8")
        for scenario in sub.scenarios:
            _assemble_scenario(sub, runs, scenario, layout.scenario_folders(tmp, sub.round_rules, sub.system_name,
                                                                            sub.benchmark, scenario))
        move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _assemble_scenario(sub: SubmissionConfig, runs: list[PlannedRun], scenario: str,
                       folders: layout.ScenarioFolders) -> None:
    meas = folders.measurements
    meas.mkdir(parents=True, exist_ok=True)
    (meas / folders.measurements_json).write_text(json.dumps(implementation_json(sub.run), indent=2) + "\n",
                                                  encoding="utf-8")
    (meas / "user.conf").write_text(user_conf_text(runs, scenario, sub.round), encoding="utf-8")
    (meas / "README.md").write_text(measurements_readme(sub, runs, scenario), encoding="utf-8")
    for run in (r for r in runs if r.scenario == scenario):
        if run.kind == "performance":
            dst = folders.results / "performance" / "run_1"
            dst.mkdir(parents=True)
            for name in ("mlperf_log_summary.txt", "mlperf_log_detail.txt"):
                shutil.copyfile(run.folder / name, dst / name)
        elif run.kind == "accuracy":
            dst = folders.results / "accuracy"
            dst.mkdir(parents=True)
            for name in ("mlperf_log_summary.txt", "mlperf_log_detail.txt"):
                shutil.copyfile(run.folder / name, dst / name)
            digest = truncate_accuracy_log(run.folder / "mlperf_log_accuracy.json", dst / "mlperf_log_accuracy.json")
            text = (run.folder / "accuracy.txt").read_text(encoding="utf-8").rstrip("\n")
            (dst / "accuracy.txt").write_text(f"{text}\nhash={digest}\n", encoding="utf-8")
        else:  # a compliance test: MLCommons' verification writes its folder
            folders.compliance.mkdir(parents=True, exist_ok=True)
            _verify_test06(sub, run, folders.compliance)


def calibration_text(cfg: MLPerfConfig) -> str:
    """calibration.md: how the run's weights (and activations) are quantized, and on what data."""
    mode, group_size, calibration, stored = _quantization(cfg)
    when = "in the checkpoint (gptj convert --quantize)" if stored else "when the model loads"
    if mode is None:
        how = "No quantization: the weights run as given (cast to the run's dtype); no calibration data is used."
    elif mode in ("int4", "w4a8"):
        groups = f"groups of {group_size}" if group_size else "groups of 128 (gptj's default)"
        inputs = ("each linear's inputs are rounded to int8 as it runs, per block of 32 inputs (a scale each: the "
                  "largest magnitude / 127), with no calibration data either." if mode == "w4a8" else
                  "activations stay in the run's float dtype.")
        how = (f"The linear layers' weights are quantized to int4 (asymmetric, a scale and a zero point per "
               f"{groups} inputs of each output channel) {when}, from the weights alone: no calibration data "
               f"is used; {inputs}")
    elif mode == "w8a8":
        c = calibration or {}
        how = (f"The linear layers' weights are quantized to int8 per output channel {when}, and their inputs to "
               "int8 per token as each runs, after SmoothQuant's per-channel smoothing factors (alpha "
               f"{c.get('alpha', '?')}), calibrated by `gptj calibrate` on {c.get('samples', '?')} samples "
               f"({c.get('tokens', '?')} tokens) of {c.get('dataset', '?')}: each linear's largest input per "
               "channel over those samples.")
    else:
        how = (f"The linear layers' weights are quantized to {mode} per output channel {when}, from the weights "
               "alone: no calibration data is used; activations stay in the run's float dtype"
               + (" (or are quantized to fp8 per token where the GPU has fp8 units)." if mode == "fp8" else "."))
    return f"# Calibration\n\n{how}\n"


# --- the checker ------------------------------------------------------------------------------------


@dataclass
class CheckerResult:
    passed: bool
    summary: str  # its SUMMARY line (or why there is none)
    log: Path
    errors: list[str]


def run_checker(inference: Path, submission_root: Path, round_name: str, log: Path) -> CheckerResult:
    """MLCommons' submission checker on `submission_root` (its output kept in `log`)."""
    tools = Path(inference) / "tools" / "submission"
    if not (tools / "submission_checker" / "main.py").is_file():
        raise GptjError(f"{tools}: no submission_checker there (is --mlperf-inference a checkout of "
                        "github.com/mlcommons/inference?)")
    csv = log.with_suffix(".csv")
    cmd = [sys.executable, "-m", "submission_checker.main", "--input", str(Path(submission_root).resolve()),
           "--version", round_name, "--csv", str(csv.resolve())]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tools.resolve())}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=str(log.parent.resolve()), env=env)
    output = done.stdout + done.stderr
    atomic_write_text(log, f"$ {' '.join(cmd)}\n{output}")
    summary = next((line.split("SUMMARY:", 1)[1].strip() for line in output.splitlines() if "SUMMARY:" in line),
                   f"no SUMMARY line (exit {done.returncode})")
    errors = [line for line in output.splitlines() if " ERROR]" in line]
    return CheckerResult(done.returncode == 0 and summary == "submission looks OK", summary, log, errors)


# --- the whole job ----------------------------------------------------------------------------------


def check_division(sub: SubmissionConfig) -> None:
    """The closed division runs MLPerf's generation settings (the open one may change anything)."""
    if sub.division != "closed":
        return
    if sub.run.gen.prompt_lookup_num_tokens:
        raise GptjError("--speculate: MLPerf's closed division does not allow speculative decoding; submit it in "
                        "--division open")
    from gptj.mlperf.run import official_differences

    if sub.run.llama:
        from gptj.mlperf.config import llama_generation

        diff = official_differences(sub.run.gen, llama_generation())
    else:
        diff = official_differences(sub.run.gen)
    if diff:
        raise GptjError(f"the closed division runs MLPerf's generation settings; these differ: {', '.join(diff)}")
    calibration = _w8a8_calibration(sub.run)
    if calibration is not None and calibration.get("dataset") != rules.CALIBRATION_LIST:
        raise GptjError(f"the closed division allows quantization calibrated on MLPerf's calibration list "
                        f"({rules.CALIBRATION_LIST}); this w8a8 model was calibrated on {calibration.get('dataset')!r} "
                        f"(gptj calibrate --dataset {rules.CALIBRATION_LIST})")


def _w8a8_calibration(run: MLPerfConfig) -> dict | None:
    """The calibration record of the W8A8 model a run loads (None: not W8A8, or no local folder)."""
    mode, _, calibration, _ = _quantization(run)
    return (calibration or {}) if mode == "w8a8" else None


def _quantization(run: MLPerfConfig) -> tuple[str | None, int | None, dict | None, bool]:
    """How the run's model is quantized: (mode, int4 group size, W8A8 calibration record, whether the
    checkpoint holds it), from the model folder's config.json and the run's --quantize (None: float)."""
    folder, config = run.model, {}
    if folder is not None and (Path(folder) / "config.json").is_file():
        try:
            config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}  # loading reports a bad config.json
    stored = config.get("quantization") if isinstance(config, dict) else None
    if isinstance(stored, dict) and stored.get("mode"):
        return stored["mode"], stored.get("group_size"), stored.get("calibration"), True
    mode = run.spec.quantize
    calibration = config.get("calibration") if mode == "w8a8" and isinstance(config, dict) else None
    return mode, run.spec.group_size, calibration, False


def prepare(sub: SubmissionConfig) -> tuple[dict, list[PlannedRun], list[tuple[str, str]]]:
    """Everything checked before the first run: (system description, runs, each run's status)."""
    from gptj.mlperf import sysdesc

    check_division(sub)
    if sub.tree.exists() and not sub.force:
        raise GptjError(f"{sub.tree} exists; --force replaces it")
    flags = {"submitter": sub.submitter, "system_name": sub.system_name, "division": sub.division,
             "system_type": sub.category}
    Path(sub.system_desc).parent.mkdir(parents=True, exist_ok=True)
    system = sysdesc.resolve(Path(sub.system_desc), sysdesc.probe(sub.run.spec.device, sub.run.spec.world), flags)
    if sub.mlperf_inference is not None and not (Path(sub.mlperf_inference) / "tools" / "submission").is_dir():
        raise GptjError(f"{sub.mlperf_inference}: not a checkout of github.com/mlcommons/inference "
                        "(no tools/submission)")
    runs = plan(sub)
    for run in runs:  # a llama run's seeds are LoadGen's own: the round's?
        if run.seeds is not None:
            layout.check_loadgen_seeds(sub.benchmark, run.cfg.loadgen_model, run.cfg.scenario, sub.round_rules)
    statuses = [run_status(r) for r in runs]
    problems = [why for r, (state, why) in zip(runs, statuses)
                if state in ("different", "damaged") or (sub.assemble_only and state != "done")]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        hint = "" if sub.assemble_only else "; remove that folder to make the run again"
        raise GptjError(f"{problems[0]}{more}{hint}")
    for r, (state, _) in zip(runs, statuses):  # a run made before that LoadGen judged INVALID
        if state == "done" and (reason := invalid_reason(r)) is not None:
            raise GptjError(reason)
    return system, runs, statuses


# LoadGen's summary lines for what makes a performance run INVALID, and what to change for each.
_INVALID_BECAUSE = {
    "Min duration satisfied": "min duration",
    "Min queries satisfied": "min query count",
    "Early stopping satisfied": "early stopping",
    "Performance constraints satisfied": "performance constraints",
}


def invalid_reason(planned: PlannedRun) -> str | None:
    """Why LoadGen judged a performance run INVALID (None: VALID, or not a result performance run).
    The checker rejects an INVALID result, so the submission stops here with what to change."""
    if planned.kind != "performance":
        return None
    from gptj.mlperf.report import invalid_reasons, parse_loadgen_summary

    summary = parse_loadgen_summary(planned.folder / "mlperf_log_summary.txt")
    if "INVALID" not in summary.get("result_line", ""):
        return None
    failed = [what for key, what in _INVALID_BECAUSE.items() if summary.get(key, "").upper().startswith("NO")]
    try:
        made = json.loads((planned.folder / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        made = {}
    reasons = invalid_reasons(planned.cfg, summary, made.get("run_length"), bool(made.get("interrupted")))
    return f"{planned.label} in {planned.folder} is INVALID ({', '.join(failed) or 'see its summary'} not " \
           f"satisfied): remove the folder and run again with what fixes it: {'; '.join(reasons)}"


def submit(sub: SubmissionConfig, on_run=None, say=None):  # noqa: ANN001, ANN201
    """Make the runs still missing, assemble the tree, run the checker when it is at hand.

    `on_run(planned, result)` after each run made; `say(line)` for progress lines.
    Returns (tree folder, CheckerResult or None)."""
    from gptj.mlperf.run import run as run_one

    say = say or (lambda line: print(line, file=sys.stderr))
    system, runs, statuses = prepare(sub)
    for i, (planned, (state, _)) in enumerate(zip(runs, statuses), 1):
        if state == "done":
            say(f"[{i}/{len(runs)}] {planned.label}: reusing {planned.folder}")
            continue
        if planned.folder.exists():  # an interrupted or unfinished run of ours: made again from scratch
            shutil.rmtree(planned.folder)
        say(f"[{i}/{len(runs)}] {planned.label} -> {planned.folder}")
        result = run_one(planned.cfg)
        if on_run is not None:
            on_run(planned, result)
        if (reason := invalid_reason(planned)) is not None:
            raise GptjError(reason)
    tree = assemble(sub, runs, system)
    say(f"submission tree: {tree}")
    checker = None
    if sub.mlperf_inference is not None:
        checker = run_checker(Path(sub.mlperf_inference), Path(sub.out), sub.round,
                              Path(sub.runs_dir) / "checker.log")
    return tree, checker
