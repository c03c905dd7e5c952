"""MLPerf Inference llama3.1-8b / llama3.1-8b-edge accuracy: ROUGE on CNN-DailyMail summaries.

Reproduces MLCommons' `language/llama3.1-8b/evaluation.py` (mlcommons/inference):

1. LoadGen's `mlperf_log_accuracy.json`, ONE entry per `qsl_idx`, the first seen; `data` is the hex
   of the response's token ids, little-endian int64 (`--dtype int32`: int32). As gpt-j's
   (`gptj.mlperf.evaluate.read_accuracy_log`).
2. Detokenize with the model's tokenizer (the reference: Llama-3.1-8B-Instruct's, through
   `AutoTokenizer.from_pretrained(..., use_fast=False)`: Llama 3 has no slow tokenizer, so the fast
   one), `batch_decode(ids, skip_special_tokens=True)`. No `clean_up_tokenization_spaces` argument,
   so the tokenizer's tokenizer_config.json decides: in the transformers the reference pins
   (4.46.2, its requirements.txt), where it says true (Llama-3.1-8B-Instruct's does) transformers'
   `clean_up_tokenization` runs (" ." -> ".", ...). `HFTokenizer.clean_up_tokenization_spaces` carries
   that setting here. (transformers 5 ignores it for a BPE tokenizer unless the config also sets
   `clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`: gptj follows the
   pinned 4.46.2, which produced the accuracy targets.)
3. `postprocess_text` (strip; one sentence per line with `nltk.sent_tokenize`) and HF
   `evaluate.load("rouge").compute(..., use_stemmer=True, use_aggregator=False)`: per-sample
   rouge_score F-measures (`gptj.mlperf.evaluate.per_sample_f1`, shared with gpt-j).
4. Each ROUGE is `round(np.mean(f) * 100, 4)` (numpy's rounding of a float64, which the reference
   then prints as a string: `'rouge1': '38.7792'`); `gen_len` = characters of the post-processed
   predictions, summed; `gen_num` = their count.

Targets (`gptj.mlperf.rules.LLAMA_ACCURACY`): each ROUGE (rougeLsum too) >= 99% of the BF16
reference's and gen_len within 90%..110% of its, over the whole set (13,368 samples; edge 5,000).
A subset (gptj's 30-sample stand-in, `--max-examples`) is flagged: its gen_len bounds are scaled
per sample and its ROUGE is indicative only. A log answering fewer samples than the run had is
not a result (`complete` False), as for gpt-j.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptj.errors import GptjError
from gptj.mlperf import evaluate as ev
from gptj.mlperf.rules import llama_accuracy

ROUGE_TYPES = ev.ROUGE_TYPES
LABELS = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L", "rougeLsum": "ROUGE-Lsum",
          "gen_len": "gen_len"}


def decode_prediction(tokenizer: Any, ids: Sequence[int]) -> str:
    """One response's text as the reference's `batch_decode(ids, skip_special_tokens=True)` gives it."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        text = ev.clean_up_tokenization(text)
    return text


def score(predictions: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """The reference's result: rouge1/rouge2/rougeL/rougeLsum (mean per-sample F1 x 100, numpy-rounded to
    4 decimals, as floats here), gen_len (int) and gen_num."""
    if len(predictions) != len(references):
        raise GptjError(f"{len(predictions)} predictions but {len(references)} references: they must pair up")
    if not predictions:
        raise GptjError("no predictions to score")
    preds, f1 = ev.per_sample_f1(predictions, references)
    result: dict[str, Any] = {k: float(round(np.mean(v) * 100, 4)) for k, v in f1.items()}
    result["gen_len"] = int(sum(len(p) for p in preds))
    result["gen_num"] = len(preds)
    return result


def thresholds(benchmark: str, gen_num: int | None = None) -> dict[str, tuple[float, float | None]]:
    """metric -> (lowest passing value, highest or None) for `benchmark` over `gen_num` samples (None: the
    whole set; fewer: gen_len's bounds scaled per sample)."""
    rule = llama_accuracy(benchmark)
    out: dict[str, tuple[float, float | None]] = {
        k: (v * rule.rouge_fraction, None) for k, v in rule.reference_rouge.items()}
    scale = 1.0 if gen_num is None or gen_num == rule.dataset_size else gen_num / rule.dataset_size
    gen_len = rule.reference_gen_len * scale
    out["gen_len"] = (gen_len * rule.gen_len_low, gen_len * rule.gen_len_high)
    return out


@dataclasses.dataclass
class LlamaEvaluation:
    """Scores of one llama3.1-8b accuracy log, and whether each target is met."""

    benchmark: str
    scores: dict[str, Any]  # rouge1, rouge2, rougeL, rougeLsum, gen_len, gen_num
    bounds: dict[str, tuple[float, float | None]]
    expected_samples: int
    subset: bool
    notes: list[str] = dataclasses.field(default_factory=list)
    duplicates_dropped: int = 0
    log_path: str | None = None

    @property
    def met(self) -> dict[str, bool]:
        return {k: self.scores[k] >= lo and (hi is None or self.scores[k] <= hi) for k, (lo, hi) in self.bounds.items()}

    @property
    def passed(self) -> bool:
        return all(self.met.values())

    @property
    def complete(self) -> bool:
        return self.scores["gen_num"] >= self.expected_samples

    def to_json(self) -> dict[str, Any]:
        return {"benchmark": self.benchmark, **self.scores, "subset": self.subset, "complete": self.complete,
                "expected_samples": self.expected_samples, "passed": self.passed,
                "thresholds": {k: list(v) for k, v in self.bounds.items()}, "met": self.met,
                "notes": list(self.notes), "duplicates_dropped": self.duplicates_dropped, "log_path": self.log_path}


def evaluate_log(log_dir_or_file: str | Path, references: Sequence[str], tokenizer: Any, *,
                 benchmark: str = "llama3.1-8b", dtype: str = "int64",
                 expected_samples: int | None = None) -> LlamaEvaluation:
    """Score LoadGen's accuracy log (the file or its folder) against `references` (by qsl_idx), decoding
    with `tokenizer` (the model's: `gptj.tokenizer.tokenizer_for_model(checkpoint)`)."""
    rule = llama_accuracy(benchmark)
    file = ev._log_file(log_dir_or_file)
    by_idx, duplicates = ev._read_log(file, dtype)
    if not by_idx:
        raise GptjError(f"accuracy log {file} has no entries (was the run in accuracy mode?)")
    outside = [i for i in by_idx if i >= len(references)]
    if outside:
        raise GptjError(f"accuracy log {file}: qsl_idx {outside[0]} has no reference (outside the "
                        f"{len(references)} references)")
    preds = []
    for idx, ids in by_idx.items():
        try:
            preds.append(decode_prediction(tokenizer, ids))
        except GptjError as e:
            raise GptjError(f"accuracy log {file}, qsl_idx {idx}: {e}") from e
    scores = score(preds, [references[i] for i in by_idx])
    gen_num = scores["gen_num"]
    notes = []
    if gen_num < len(references):
        notes.append(f"the log covers {gen_num} of the {len(references)} references; only those are scored")
    subset = gen_num != rule.dataset_size
    if subset:
        notes.append(f"subset: {gen_num} samples, not the full {rule.dataset_size}; the gen_len bounds are scaled "
                     "per sample; ROUGE on a subset is indicative, not a submission result")
    if duplicates:
        notes.append(f"{duplicates} duplicate log entries ignored (the first per qsl_idx counts)")
    return LlamaEvaluation(benchmark, scores, thresholds(benchmark, gen_num),
                           expected_samples if expected_samples is not None else len(references), subset, notes,
                           duplicates, str(file))


def accuracy_line(result: LlamaEvaluation) -> str:
    """The reference's printed result dict: ROUGE as quoted strings, gen_len and gen_num as plain integers
    (the submission checker's patterns read `'rouge1': '38.7792'` and `'gen_len': 8167644`)."""
    s = result.scores
    return repr({**{k: f"{s[k]}" for k in ROUGE_TYPES}, "gen_len": int(s["gen_len"]), "gen_num": int(s["gen_num"])})


def format_report(result: LlamaEvaluation) -> str:
    """Scores and PASS/FAIL for the benchmark, each criterion with its bound(s)."""
    s = result.scores
    lines = ["ROUGE F-measure, % (0-100): " + "  ".join(f"{LABELS[k]} {s[k]:.4f}" for k in ROUGE_TYPES),
             f"gen_len {s['gen_len']:,} characters over gen_num {s['gen_num']:,} predictions"]
    if not result.complete:
        lines.insert(0, f"NOT A RESULT: the accuracy log answers {s['gen_num']:,} of the "
                        f"{result.expected_samples:,} samples: these scores are not a result")
    parts = []
    for k, (lo, hi) in result.bounds.items():
        bound = f">= {lo:,.6f}".rstrip("0").rstrip(".") if hi is None else f"in [{lo:,.1f}, {hi:,.1f}]"
        parts.append(f"{LABELS[k]} {s[k]:,} {bound}{'' if result.met[k] else ' FAILED'}")
    verdict = "no result" if not result.complete else "PASS" if result.passed else "FAIL"
    lines.append(f"{result.benchmark}: {verdict}  ({'; '.join(parts)})")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
