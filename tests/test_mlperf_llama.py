"""llama3.1-8b's MLPerf data set and scoring (issue 59): the cnn_eval.json format {input, tok_input, output},
the bundled stand-in made from gptj-99's articles, the accuracy rules, and the scores checked against MLCommons'
language/llama3.1-8b/evaluation.py itself (run from ../shared/mlperf-inference; skipped where it is not there)."""

from __future__ import annotations

import ast
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from gptj.cli import main
from gptj.errors import GptjError
from gptj.mlperf import evaluate_llama as el
from gptj.mlperf.dataset import (
    DEFAULT_DATASET,
    DEFAULT_LLAMA_DATASET,
    LLAMA_PROMPT_TEMPLATE,
    Dataset,
    llama_prompt,
    load_examples,
    load_llama_records,
    write_llama_sample,
)
from gptj.mlperf.rules import LLAMA_ACCURACY, llama_accuracy
from gptj.tokenizer import load_tokenizer

INFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "mlperf-inference"
LLAMA_REF = INFERENCE / "language" / "llama3.1-8b"
CONSTANTS = INFERENCE / "tools" / "submission" / "submission_checker" / "constants.py"
needs_reference = pytest.mark.skipif(
    not (LLAMA_REF / "evaluation.py").is_file(),
    reason=f"MLCommons' llama3.1-8b reference is not at {LLAMA_REF} (a copy of github.com/mlcommons/inference)")
needs_checker = pytest.mark.skipif(not CONSTANTS.is_file(), reason=f"MLCommons' submission checker is not at "
                                   f"{CONSTANTS.parent}")

# language/llama3.1-8b/download_cnndm.py, instruction_template["llama"], written out.
REFERENCE_TEMPLATE = ("Summarize the following news article in 128 tokens. Please output the summary only, "
                      "without any other text.\n\nArticle:\n{input}\n\nSummary:")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def llama_bpe(vocab_size: int) -> Backend:
    """A small Llama-3-shaped tokenizer: byte-level BPE of `vocab_size` ids trained on the bundled
    articles, SPECIALS after them, BOS added by the post-processor."""
    examples = load_examples(DEFAULT_DATASET)
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s?\p{L}+|\s?\p{N}{1,3}|\s?[^\s\p{L}\p{N}]+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([e.input for e in examples] + [e.output for e in examples], trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[0]} $A",
                                                       special_tokens=[(SPECIALS[0], tok.token_to_id(SPECIALS[0]))])
    return tok


def _tokenizer_dir(path: Path, clean_up: bool) -> Path:
    """llama_bpe(1000) saved as an HF tokenizer folder."""
    tok = llama_bpe(1000)
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    # Llama-3.1-8B-Instruct's tokenizer_config.json says clean_up_tokenization_spaces: true, which the reference's
    # pinned transformers 4.46.2 applies on decode; transformers 5 applies it to a BPE tokenizer only when told to
    # with the second key (so the script runs here as it ran there).
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[2],
           "model_max_length": 131072, "clean_up_tokenization_spaces": clean_up,
           "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": clean_up}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return _tokenizer_dir(tmp_path_factory.mktemp("llama") / "tok", clean_up=True)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def _write_log(path: Path, entries, dtype="<i8") -> Path:
    log = [{"seq_id": n, "qsl_idx": idx, "data": np.asarray(ids, dtype=dtype).tobytes().hex().upper(),
            "token_count": len(ids)} for n, (idx, ids) in enumerate(entries)]
    path.write_text(json.dumps(log))
    return path


# ------------------------------------------------------------------------------ data set


def test_template_is_the_references():
    assert LLAMA_PROMPT_TEMPLATE == REFERENCE_TEMPLATE
    if (LLAMA_REF / "download_cnndm.py").is_file():  # the reference's script, read
        assert json.dumps(REFERENCE_TEMPLATE)[1:-1] in (LLAMA_REF / "download_cnndm.py").read_text()


def test_bundled_stand_in_is_gptj_samples_articles_and_references(tmp_path):
    gptj, llama = load_examples(DEFAULT_DATASET), load_llama_records(DEFAULT_LLAMA_DATASET)
    assert len(llama) == len(gptj) == 30
    for e, r in zip(gptj, llama):
        assert r.input == REFERENCE_TEMPLATE.format(input=e.input) == llama_prompt(e.input)
        assert r.output == e.output and r.tok_input is None
    # made by write_llama_sample, never by hand: remaking it gives the same bytes
    assert write_llama_sample(tmp_path / "x.json").read_bytes() == DEFAULT_LLAMA_DATASET.read_bytes()


def test_load_tokenizes_with_the_models_tokenizer(tok):
    ds = Dataset.load(benchmark="llama3.1-8b", tokenizer=tok, max_examples=3)
    assert ds.benchmark == "llama3.1-8b" and len(ds) == 3 and ds.num_available == 30 and ds.num_truncated == 0
    assert ds.prompts == [r.input for r in load_llama_records(DEFAULT_LLAMA_DATASET)[:3]]
    assert ds.input_ids[0] == tok.encode(ds.prompts[0]) and ds.input_ids[0][0] == tok.bos_token_id
    assert ds.references[0] == load_examples(DEFAULT_DATASET)[0].output
    with pytest.raises(GptjError, match=r"30 entries without tok_input .*give the model's tokenizer"):
        Dataset.load(benchmark="llama3.1-8b-edge")
    with pytest.raises(GptjError, match="no data set format for benchmark 'llama2-70b'"):
        Dataset.load(benchmark="llama2-70b")


def test_tok_input_is_used_as_it_is(tmp_path):
    ids = list(range(1, 3000))  # longer than gptj-99's 1919: the reference truncates nothing
    path = tmp_path / "cnn_eval.json"
    path.write_text(json.dumps([{"instruction": "x", "input": "a prompt", "tok_input": ids, "output": "ref"}]))
    ds = Dataset.load(path, benchmark="llama3.1-8b-edge")  # no tokenizer needed
    assert ds.input_ids == [ids] and ds.max_input_tokens == len(ids) and ds.benchmark == "llama3.1-8b-edge"


@pytest.mark.parametrize("data, message", [
    ({"a": 1}, "top level must be a JSON list of examples, got object"),
    ([], "contains no examples"),
    ([["x"]], "entry 0: must be an object with keys input, tok_input, output, got list"),
    ([{"input": "p", "output": "r"}], "entry 0: missing key 'tok_input'"),
    ([{"input": 3, "tok_input": None, "output": "r"}], "entry 0: 'input' must be a string, got number"),
    ([{"input": " ", "tok_input": None, "output": "r"}], "entry 0: 'input' is empty"),
    ([{"input": "p", "tok_input": "1 2", "output": "r"}], "'tok_input' must be a list of token ids or null, got st"),
    ([{"input": "p", "tok_input": [], "output": "r"}], "entry 0: 'tok_input' is empty"),
    ([{"input": "p", "tok_input": [1, -2], "output": "r"}], "'tok_input' holds -2, not a non-negative integer"),
    ([{"input": "p", "tok_input": [1, True], "output": "r"}], "'tok_input' holds True"),
    ([{"input": "p", "tok_input": [1], "output": "r"}, {"input": "p", "tok_input": [1], "output": None}],
     "entry 1: 'output' must be a string, got null"),
])
def test_malformed_files_fail_in_one_line(tmp_path, data, message):
    path = tmp_path / "cnn_eval.json"
    path.write_text(json.dumps(data))
    with pytest.raises(GptjError, match=re.escape(message)) as e:
        Dataset.load(path, benchmark="llama3.1-8b")
    assert "\n" not in str(e.value) and str(path) in str(e.value)


# ------------------------------------------------------------------------------ rules


def test_rules_are_mlperfs():
    assert {k: (r.reference_rouge, r.reference_gen_len, r.dataset_size) for k, r in LLAMA_ACCURACY.items()} == {
        "llama3.1-8b": ({"rouge1": 38.7792, "rouge2": 15.9075, "rougeL": 24.4957, "rougeLsum": 35.793}, 8167644,
                        13368),
        "llama3.1-8b-edge": ({"rouge1": 39.06, "rouge2": 16.1147, "rougeL": 24.6375, "rougeLsum": 36.124}, 3051113,
                             5000)}
    with pytest.raises(GptjError, match="unknown llama benchmark"):
        llama_accuracy("gptj-99")


@needs_checker
def test_thresholds_are_the_submission_checkers():
    config = runpy.run_path(str(CONSTANTS))
    names = {"ROUGE1": "rouge1", "ROUGE2": "rouge2", "ROUGEL": "rougeL", "ROUGELSUM": "rougeLsum",
             "GEN_LEN": "gen_len"}
    rounds = [r for r, c in config["MODEL_CONFIG"].items() if "llama3.1-8b" in c["accuracy-target"]]
    assert rounds
    for r in rounds:
        c = config["MODEL_CONFIG"][r]
        for bench in LLAMA_ACCURACY:
            mine = el.thresholds(bench)
            target = c["accuracy-target"][bench]
            assert {names[k]: v for k, v in zip(target[::2], target[1::2])} == {k: lo for k, (lo, _) in mine.items()}
            upper = c["accuracy-upper-limit"][bench]
            assert upper == ("GEN_LEN", mine["gen_len"][1])
            assert c["performance-sample-count"][bench] == LLAMA_ACCURACY[bench].dataset_size
    line = el.accuracy_line(el.LlamaEvaluation("llama3.1-8b", {"rouge1": 38.7792, "rouge2": 15.9, "rougeL": 24.5,
                                                               "rougeLsum": 35.8, "gen_len": 8167644,
                                                               "gen_num": 13368}, {}, 13368, False))
    for key, metric in names.items():  # the checker reads our printed line
        found = re.match(config["ACC_PATTERN"][key], line)
        assert found, key
        assert float(found.group(1)) == {"rouge1": 38.7792, "rouge2": 15.9, "rougeL": 24.5, "rougeLsum": 35.8,
                                         "gen_len": 8167644}[metric]


def test_pass_fail_and_subset_bounds():
    full = el.thresholds("llama3.1-8b")
    assert full["gen_len"] == pytest.approx((0.9 * 8167644, 1.1 * 8167644))
    sub = el.thresholds("llama3.1-8b-edge", 50)
    assert sub["gen_len"] == pytest.approx((0.9 * 3051113 / 100, 1.1 * 3051113 / 100))
    assert sub["rougeLsum"] == (36.124 * 0.99, None)
    scores = {"rouge1": 38.7792 * 0.99, "rouge2": 16, "rougeL": 25, "rougeLsum": 36, "gen_len": 8167644,
              "gen_num": 13368}
    ok = el.LlamaEvaluation("llama3.1-8b", scores, full, 13368, False)
    assert ok.passed and ok.complete
    too_long = el.LlamaEvaluation("llama3.1-8b", scores | {"gen_len": 8984409}, full, 13368, False)
    assert not too_long.passed and too_long.met == {**ok.met, "gen_len": False}
    assert "FAIL" in el.format_report(too_long) and "gen_len 8,984,409 in [7,350,879.6, 8,984,408.4] FAILED" in \
        el.format_report(too_long)


# ------------------------------------------------------------------------------ scoring


def _predictions(tok, n):
    """Token ids per qsl_idx for the first n bundled samples: part of each reference (some words out of
    order, sentences cut), with spaces before punctuation (what clean-up removes), a special token inside
    and EOS at the end; then the log entries out of order with a duplicate (the first counts)."""
    refs = [r.output for r in load_llama_records(DEFAULT_LLAMA_DATASET)[:n]]
    eot, eos = tok.encode(SPECIALS[2], add_special_tokens=False), tok.encode(SPECIALS[1], add_special_tokens=False)
    entries = []
    for i, ref in enumerate(refs):
        words = ref.replace(",", " ,").replace(".", " .").split(" ")
        k = max(3, len(words) * (i + 2) // (n + 2))
        text = " ".join(words[:k] + words[k + 8:k:-1])  # a prefix, then words out of order
        entries.append((i, tok.encode(text, add_special_tokens=False)[:60] + eot
                        + tok.encode(" and more .", add_special_tokens=False) + eos))
    entries = entries[::-1] + [(0, tok.encode("a duplicate", add_special_tokens=False))]
    return entries


def test_scores_match_the_formulas(tmp_path, tok):
    entries = _predictions(tok, 6)
    _write_log(tmp_path / "mlperf_log_accuracy.json", entries)
    refs = [r.output for r in load_llama_records(DEFAULT_LLAMA_DATASET)]
    result = el.evaluate_log(tmp_path, refs, tok, benchmark="llama3.1-8b")
    texts = [el.decode_prediction(tok, ids) for _, ids in sorted(entries[:-1])]
    assert " ." not in texts[0] and "<|" not in texts[0] and "and more." in texts[0]
    assert result.scores == el.score(texts, refs[:6]) and result.scores["gen_num"] == 6
    assert result.duplicates_dropped == 1 and result.subset and not result.complete
    assert "NOT A RESULT" in el.format_report(result)


def _run_reference(tmp_path: Path, tok_dir: Path, dataset: Path, log: Path) -> dict:
    """MLCommons' evaluation.py, run as it is, in a subprocess. Offline stand-ins for what it fetches or
    imports but this machine lacks: `nltk.download` (a no-op; `nltk.sent_tokenize` is gptj's punkt_tab-model
    split, which test_mlperf_evaluate checks equals NLTK's), HF `evaluate.load("rouge")` (which downloads its
    metric script: here what that script computes, rouge_score per sample), `datasets` (imported, unused) and
    `pandas.read_json` (the records' columns as lists)."""
    runner = tmp_path / "run_reference.py"
    runner.write_text(f'''
import json, runpy, sys, types
import nltk
from rouge_score import rouge_scorer
from gptj.mlperf.evaluate import sent_tokenize

nltk.download = lambda *a, **k: True
nltk.sent_tokenize = sent_tokenize

class Rouge:
    def compute(self, predictions, references, rouge_types=None, use_aggregator=True, use_stemmer=False,
                tokenizer=None):
        rouge_types = rouge_types or ["rouge1", "rouge2", "rougeL", "rougeLsum"]
        scorer = rouge_scorer.RougeScorer(rouge_types=rouge_types, use_stemmer=use_stemmer, tokenizer=tokenizer)
        assert not use_aggregator
        scores = [scorer.score(ref, pred) for ref, pred in zip(references, predictions)]
        return {{k: [s[k].fmeasure for s in scores] for k in scores[0]}}

evaluate = types.ModuleType("evaluate")
evaluate.load = lambda name: Rouge()
datasets = types.ModuleType("datasets")
datasets.load_dataset = datasets.load_from_disk = None

class Column(list):
    def tolist(self):
        return list(self)

class Frame:
    def __init__(self, records):
        for key in records[0]:
            setattr(self, key, Column(r[key] for r in records))

pandas = types.ModuleType("pandas")
pandas.read_json = lambda path: Frame(json.load(open(path)))
sys.modules.update(evaluate=evaluate, datasets=datasets, pandas=pandas)
sys.path.insert(0, {str(LLAMA_REF)!r})
sys.argv = ["evaluation.py", "--mlperf-accuracy-file", {str(log)!r}, "--dataset-file", {str(dataset)!r},
            "--model-name", {str(tok_dir)!r}]
runpy.run_path({str(LLAMA_REF / "evaluation.py")!r}, run_name="__main__")
''')
    done = subprocess.run([sys.executable, str(runner)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    return ast.literal_eval(re.sub(r"np\.\w+\(([^)]*)\)", r"\1", line))  # numpy 2 prints np.int64(N)


@needs_reference
@pytest.mark.parametrize("clean_up", [True, False])
def test_scores_match_mlcommons_evaluation_py(tmp_path, clean_up):
    tok_dir = _tokenizer_dir(tmp_path / "tok", clean_up)
    tok = load_tokenizer(tok_dir)
    # the reference's Dataset reads tok_input: a real-format file, ids from the test tokenizer
    records = load_llama_records(DEFAULT_LLAMA_DATASET)[:8]
    dataset = tmp_path / "cnn_eval.json"
    dataset.write_text(json.dumps([{"input": r.input, "tok_input": tok.encode(r.input), "output": r.output}
                                   for r in records]))
    log = _write_log(tmp_path / "mlperf_log_accuracy.json", _predictions(tok, 8))
    theirs = _run_reference(tmp_path, tok_dir, dataset, log)
    refs = Dataset.load(dataset, benchmark="llama3.1-8b").references
    mine = el.evaluate_log(log, refs, tok, benchmark="llama3.1-8b")
    assert ast.literal_eval(el.accuracy_line(mine)) == theirs
    assert 0 < mine.scores["rouge1"] < 100 and mine.scores["gen_num"] == 8


def test_gptj_evaluate_cli(tmp_path, tok, tok_dir, capsys):
    _write_log(tmp_path / "mlperf_log_accuracy.json", _predictions(tok, 30))
    rc = main(["evaluate", "--benchmark", "llama3.1-8b", "--tokenizer", str(tok_dir), "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("{'rouge1': '") and "llama3.1-8b: FAIL" in out and "subset: 30 samples" in out
    assert main(["evaluate", "--benchmark", "llama3.1-8b-edge", "--log-dir", str(tmp_path)]) != 0
    assert "needs --tokenizer" in capsys.readouterr().err
