"""gptj.mlperf.evaluate: the MLPerf gptj accuracy script (ROUGE on hand-made LoadGen logs)."""

from __future__ import annotations

import json
from pathlib import Path

import nltk
import numpy as np
import pytest

from gptj.errors import GptjError
from gptj.mlperf import evaluate as ev
from gptj.tokenizer import load_tokenizer

EOS = 50256


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def hexdata(ids, dtype="<i8") -> str:
    # LoadGen writes upper-case hex of the response bytes.
    return np.asarray(ids, dtype=dtype).tobytes().hex().upper()


def write_log(path: Path, entries) -> Path:
    """entries: (qsl_idx, token ids) pairs, written in the given order."""
    log = [{"seq_id": n, "qsl_idx": idx, "data": hexdata(ids), "token_count": len(ids)}
           for n, (idx, ids) in enumerate(entries)]
    path.write_text(json.dumps(log))
    return path


def f1(p: float, r: float) -> float:
    return 2 * p * r / (p + r)


# ------------------------------------------------------------------ scores from logs


def test_prediction_equal_to_reference_scores_100(tmp_path, tok):
    refs = ["The cat sat on the mat. It was happy.", "Stocks fell sharply on Monday."]
    # Written out of order (and with EOS at the end, which is dropped).
    write_log(tmp_path / ev.ACCURACY_LOG_NAME,
              [(1, tok.encode(refs[1]) + [EOS]), (0, tok.encode(refs[0]))])
    result = ev.evaluate_log(tmp_path, refs, tokenizer=tok)  # a directory works
    assert (result.rouge1, result.rouge2, result.rougeL, result.rougeLsum) == (100.0,) * 4
    assert result.gen_num == 2
    # gen_len counts the post-processed text: sentences joined by one newline.
    assert result.gen_len == len("The cat sat on the mat.\nIt was happy.") + len(refs[1])
    assert result.duplicates_dropped == 0
    json.dumps(result.to_json())  # plain JSON types


def test_hand_computed_rouge(tmp_path, tok):
    # No token longer than 3 characters, so the Porter stemmer changes nothing.
    ref, pred = "the cat sat on the mat", "the cat sat"
    log = write_log(tmp_path / "log.json", [(0, tok.encode(pred))])
    result = ev.evaluate_log(log, [ref], tokenizer=tok)
    # unigrams: 3 of 3 predicted are in the reference (6 tokens): P = 1, R = 3/6
    assert result.rouge1 == round(f1(1, 3 / 6) * 100, 4) == 66.6667
    # bigrams: (the cat), (cat sat) of the reference's 5: P = 2/2, R = 2/5
    assert result.rouge2 == round(f1(1, 2 / 5) * 100, 4) == 57.1429
    # LCS "the cat sat" = 3: same as ROUGE-1; one sentence, so Lsum = L
    assert result.rougeL == result.rougeLsum == 66.6667
    assert result.gen_len == len(pred) and result.gen_num == 1


def test_partial_overlap_with_repeats(tok):
    # Clipped counts: "the" twice in the prediction but once in the reference.
    ref, pred = "a dog bit the man", "the the dog bit"
    s = ev.score([pred], [ref])
    assert s["rouge1"] == round(f1(3 / 4, 3 / 5) * 100, 4)  # the, dog, bit
    assert s["rouge2"] == round(f1(1 / 3, 1 / 4) * 100, 4)  # (dog bit)
    assert s["rougeL"] == round(f1(2 / 4, 2 / 5) * 100, 4)  # LCS "dog bit" (or "the ..."): 2
    # Mean over samples of per-sample F1, not a pooled F1.
    both = ev.score([pred, ref], [ref, ref])
    assert both["rouge1"] == round((f1(3 / 4, 3 / 5) + 1) / 2 * 100, 4)


def test_rougelsum_splits_sentences_onto_lines():
    ref, pred = "The cat sat. The dog ran.", "The dog ran. The cat sat."
    s = ev.score([pred], [ref])
    # Over the whole text the LCS is 3 of 6 tokens; per sentence line every token matches.
    assert s["rougeL"] == 50.0
    assert s["rougeLsum"] == 100.0
    assert s["rouge1"] == 100.0


def test_postprocess_text_strips_and_puts_one_sentence_per_line():
    preds, targets = ev.postprocess_text(
        ["  Mr. Smith went to Washington. He arrived at 5 p.m. on Monday.  \n"],
        ["\nThe U.S. government said so! What? Yes."],
    )
    assert preds == ["Mr. Smith went to Washington.\nHe arrived at 5 p.m. on Monday."]
    assert targets == ["The U.S. government said so!\nWhat?\nYes."]


def test_sent_tokenize_matches_nltk_with_punkt_tab(tmp_path, monkeypatch):
    """Written out as NLTK's punkt_tab files, the same model gives nltk.sent_tokenize's split."""
    import punkt

    model = punkt.load_model("english")
    d = tmp_path / "tokenizers" / "punkt_tab" / "english"
    d.mkdir(parents=True)
    (d / "abbrev_types.txt").write_text("\n".join(sorted(model.abbrev_types)))
    (d / "sent_starters.txt").write_text("\n".join(sorted(model.sent_starters)))
    (d / "collocations.tab").write_text("\n".join("\t".join(c) for c in sorted(model.collocations)))
    (d / "ortho_context.tab").write_text(
        "\n".join(f"{k}\t{v}" for k, v in sorted(model.ortho_context.items())))
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    from nltk.tokenize import _get_punkt_tokenizer

    _get_punkt_tokenizer.cache_clear()
    try:
        texts = [
            "Mr. Smith went to Washington. He arrived at 5 p.m. on Monday. The U.S. said no.",
            "Dr. J. R. Jones, 45, of St. Louis, was named CEO of Acme Corp. in Jan. 2015. "
            "Shares rose 3.5 per cent. 'It's great,' he said... Then he left!",
            "Police say the man, who was wearing a No. 9 shirt, fled. He's still at large.",
            "one sentence without a full stop",
        ]
        for text in texts:
            assert ev.sent_tokenize(text) == nltk.sent_tokenize(text)
    finally:
        _get_punkt_tokenizer.cache_clear()


def test_punkt_model_is_nltk_punkt_tab_english():
    """Row counts and byte sizes of NLTK's punkt_tab/english files (upstream nltk_data)."""
    import punkt

    m = punkt.load_model("english")

    def size(rows):
        return len(rows), len("\n".join(rows).encode())

    assert size(sorted(m.abbrev_types)) == (156, 619)
    assert size(sorted(m.sent_starters)) == (39, 241)
    assert size(sorted("\t".join(c) for c in m.collocations)) == (37, 594)
    assert size(sorted(f"{k}\t{v}" for k, v in m.ortho_context.items())) == (20366, 236303)


def test_decode_cleans_up_tokenization_spaces_like_the_reference(tok):
    ids = tok.encode("Hello , world . It 's done !") + [EOS]
    assert ev.decode_prediction(tok, ids) == "Hello, world. It's done!"
    assert ev.clean_up_tokenization("do n't , I 'm , we 're , we 've , ' x ?") == \
        "don't, I'm, we're, we've,'x?"


def test_duplicates_first_entry_wins(tmp_path, tok):
    ref = "the cat sat on the mat"
    log = tmp_path / "log.json"
    log.write_text(json.dumps([
        {"seq_id": 0, "qsl_idx": 0, "data": hexdata(tok.encode(ref))},
        {"seq_id": 1, "qsl_idx": 0, "data": hexdata(tok.encode("completely different words"))},
        {"seq_id": 2, "qsl_idx": 0, "data": "not hex: later duplicates are not decoded"},
    ]))
    assert ev.read_accuracy_log(log) == {0: tok.encode(ref)}
    result = ev.evaluate_log(log, [ref], tokenizer=tok)
    assert result.rouge1 == 100.0 and result.gen_num == 1
    assert result.duplicates_dropped == 2
    assert any("duplicate" in n for n in result.notes)


def test_read_accuracy_log_sorted_by_qsl_idx_and_int32(tmp_path):
    log = write_log(tmp_path / "log.json", [(5, [1, 2]), (2, [50399]), (0, [])])
    assert ev.read_accuracy_log(log) == {0: [], 2: [50399], 5: [1, 2]}
    assert list(ev.read_accuracy_log(log)) == [0, 2, 5]
    log32 = tmp_path / "log32.json"
    log32.write_text(json.dumps([{"seq_id": 0, "qsl_idx": 3, "data": hexdata([7, 50256], "<i4")}]))
    assert ev.read_accuracy_log(log32, dtype="int32") == {3: [7, 50256]}


def test_log_covering_some_samples_scores_those(tmp_path, tok):
    refs = ["the cat sat on the mat", "the dog ran", "a bird flew"]
    write_log(tmp_path / "log.json", [(2, tok.encode("a bird flew"))])
    result = ev.evaluate_log(tmp_path / "log.json", refs, tokenizer=tok)
    assert result.gen_num == 1 and result.num_references == 3
    assert result.rouge1 == 100.0
    assert result.subset
    assert any("covers 1 of the 3" in n for n in result.notes)
    assert not result.complete and result.expected_samples == 3  # scored, but not a result


def _dataset(path: Path, outputs) -> Path:
    path.write_text(json.dumps([{"instruction": "Summarize", "input": "x", "output": o} for o in outputs]))
    return path


def test_evaluate_on_an_interrupted_run_says_how_much_it_covered_and_exits_non_zero(tmp_path, tok, capsys):
    """A log that answers 2 of the data set's 3 samples (a run stopped early): the scores are
    printed, marked as no result, with how many samples were covered, and the exit is non-zero."""
    from gptj.cli import EXIT_NOT_A_RESULT, main

    refs = ["the cat sat on the mat", "the dog ran", "a bird flew"]
    dataset = _dataset(tmp_path / "cnn_eval.json", refs)
    run = tmp_path / "run"
    run.mkdir()
    write_log(run / ev.ACCURACY_LOG_NAME, [(0, tok.encode(refs[0])), (2, tok.encode(refs[2]))])
    assert main(["evaluate", "--log-dir", str(run), "--dataset", str(dataset)]) == EXIT_NOT_A_RESULT != 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "NOT A RESULT: the accuracy log answers 2 of the 3 samples (an interrupted or " \
                                  "partial run): these scores are not a result"
    assert "ROUGE-1 100.0000" in out  # still scored, on what was answered
    assert "PASS" not in out and "FAIL" not in out and "gptj-99:   no result (2 of 3 samples answered)" in out
    assert len(err.strip().splitlines()) == 1 and "answers 2 of the 3 samples" in err
    assert main(["evaluate", "--log-dir", str(run), "--dataset", str(dataset), "--json"]) == EXIT_NOT_A_RESULT
    data = json.loads(capsys.readouterr().out)
    assert data["complete"] is False and data["expected_samples"] == 3 and data["gen_num"] == 2
    assert ev.main(["--mlperf-accuracy-file", str(run), "--dataset-file", str(dataset)]) == EXIT_NOT_A_RESULT
    assert "NOT A RESULT" in capsys.readouterr().out

    # The run's own record counts: a run of the first 2 examples (--max-examples 2) that answered both is whole ...
    write_log(run / ev.ACCURACY_LOG_NAME, [(0, tok.encode(refs[0])), (1, tok.encode(refs[1]))])
    record = {"dataset": {"path": None, "samples": 2}, "interrupted": None}
    (run / "run.json").write_text(json.dumps(record))
    assert main(["evaluate", "--log-dir", str(run), "--dataset", str(dataset)]) == 0
    out = capsys.readouterr().out
    assert "NOT A RESULT" not in out and "FAIL" in out
    # ... and one its run.json marks interrupted is not, though it answered every sample (some empty)
    (run / "run.json").write_text(json.dumps({**record, "interrupted": {"loadgen_finished": True}}))
    assert main(["evaluate", "--log-dir", str(run), "--dataset", str(dataset)]) == EXIT_NOT_A_RESULT
    out = capsys.readouterr().out
    assert "NOT A RESULT: the accuracy log answers 2 of the 2 samples (the run was interrupted)" in out


# ------------------------------------------------------------------------ targets


def scores_at(target: str, gen_num: int = ev.FULL_DATASET_SIZE, **override) -> dict:
    s = dict(ev.target_thresholds(target, gen_num), gen_num=gen_num, rougeLsum=0.0)
    s.update(override)
    return s


def test_thresholds_are_the_mlperf_targets():
    t99 = ev.target_thresholds("gptj-99")
    assert t99["rouge1"] == pytest.approx(42.556635)
    assert t99["rouge2"] == pytest.approx(19.922265)
    assert t99["rougeL"] == pytest.approx(29.688219)
    assert t99["gen_len"] == pytest.approx(3615190.2)
    t999 = ev.target_thresholds("gptj-99.9")
    assert t999["rouge1"] == pytest.approx(42.9865 * 0.999)
    assert t999["rouge2"] == pytest.approx(20.1235 * 0.999)
    assert t999["rougeL"] == pytest.approx(29.9881 * 0.999)
    assert t999["gen_len"] == t99["gen_len"]
    with pytest.raises(GptjError, match="unknown target"):
        ev.target_thresholds("gptj-98")


def test_exactly_at_threshold_passes_just_below_fails():
    for target in ev.TARGETS:
        at = scores_at(target, gen_len=3615191)  # gen_len is an integer: 3615190.2 -> 3615191
        assert ev.check_targets(at)[target].passed
        for metric in ("rouge1", "rouge2", "rougeL"):
            below = scores_at(target, gen_len=3615191, **{metric: at[metric] - 1e-4})
            check = ev.check_targets(below)[target]
            assert not check.passed
            assert check.met == {k: k != metric for k in check.met}
        assert not ev.check_targets(scores_at(target, gen_len=3615190))[target].passed
    # Just below the 99.9 threshold still passes 99.
    s = scores_at("gptj-99.9", gen_len=3615191, rouge2=20.1235 * 0.999 - 1e-4)
    checks = ev.check_targets(s)
    assert checks["gptj-99"].passed and not checks["gptj-99.9"].passed


def test_gen_len_target_scaled_for_a_subset():
    per_sample = 0.9 * 4016878 / 13368
    assert ev.gen_len_threshold(100) == pytest.approx(per_sample * 100)
    assert ev.gen_len_threshold(13368) == pytest.approx(0.9 * 4016878)
    scores = {"rouge1": 50.0, "rouge2": 25.0, "rougeL": 35.0, "rougeLsum": 45.0,
              "gen_len": int(per_sample * 100) + 1, "gen_num": 100}
    result = ev.make_result(scores, num_references=100)
    assert result.subset and result.passed("gptj-99") and result.passed("gptj-99.9")
    assert result.targets["gptj-99"].thresholds["gen_len"] == pytest.approx(per_sample * 100)
    assert any("scaled per sample" in n for n in result.notes)
    scores["gen_len"] = int(per_sample * 100)
    assert not ev.make_result(scores, num_references=100).passed("gptj-99")

    full = dict(scores, gen_len=3615191, gen_num=13368)
    result = ev.make_result(full, num_references=13368)
    assert not result.subset and result.notes == []
    assert result.passed("gptj-99")


def test_format_report(tmp_path):
    scores = {"rouge1": 43.0, "rouge2": 20.05, "rougeL": 30.0, "rougeLsum": 40.0,
              "gen_len": 3615191, "gen_num": 13368}
    text = ev.format_report(ev.make_result(scores, 13368))
    assert "ROUGE-1 43.0000" in text and "ROUGE-Lsum 40.0000" in text
    assert "gptj-99:   PASS" in text
    assert "gptj-99.9: FAIL" in text and "ROUGE-2 20.05 < 20.103376" in text
    assert "gen_len 3,615,191 >= 3,615,190.2" in text
    assert "subset" not in text
    subset = ev.format_report(ev.make_result(dict(scores, gen_num=10), 13368))
    assert "note: subset: 10 samples" in subset
    # The checker's regex: ".*'rouge1':\s([\d.]+).*" etc.
    line = ev.accuracy_line(ev.make_result(scores, 13368))
    assert line == ("{'rouge1': 43.0, 'rouge2': 20.05, 'rougeL': 30.0, 'rougeLsum': 40.0, "
                    "'gen_len': 3615191, 'gen_num': 13368}")


def test_format_report_states_the_rouge_unit_and_lists_only_the_failed_criteria():
    # gptj-99.9 thresholds: ROUGE-2 20.103376 (20.05 misses it), the others met with these scores.
    scores = {"rouge1": 43.0, "rouge2": 20.05, "rougeL": 30.0, "rougeLsum": 40.0,
              "gen_len": 3615191, "gen_num": 13368}
    result = ev.make_result(scores, 13368)
    text = ev.format_report(result)
    assert "% (0-100)" in text.splitlines()[0]  # ROUGE in percent, said on the line that prints it
    fail = next(line for line in text.splitlines() if line.startswith("gptj-99.9:"))
    failed = [m for m, ok in result.targets["gptj-99.9"].met.items() if not ok]
    assert failed == ["rouge2"]
    assert "ROUGE-2 20.05 < 20.103376" in fail and "1 of 4 criteria failed" in fail
    assert "ROUGE-1" not in fail and "ROUGE-L" not in fail and "gen_len" not in fail and ">=" not in fail
    passed = next(line for line in text.splitlines() if line.startswith("gptj-99:"))
    assert passed.count(">=") == 4  # a PASS still lists every criterion it met


def test_main_prints_results(tmp_path, tok, capsys):
    dataset = tmp_path / "cnn_eval.json"
    dataset.write_text(json.dumps([{"instruction": "Summarize", "input": "x", "output": "the dog ran"}]))
    write_log(tmp_path / ev.ACCURACY_LOG_NAME, [(0, tok.encode("the dog ran"))])
    assert ev.main(["--mlperf-accuracy-file", str(tmp_path), "--dataset-file", str(dataset),
                    "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "'rouge1': 100.0" in out and "FAIL" in out  # 11 characters is far below gen_len
    assert json.loads((tmp_path / "out.json").read_text())["gen_num"] == 1
    assert ev.main(["--mlperf-accuracy-file", str(tmp_path / "nope"), "--dataset-file", str(dataset)]) == 1
    assert "accuracy log not found" in capsys.readouterr().err


# ------------------------------------------------------------------------- errors


def test_read_references(tmp_path):
    good = tmp_path / "cnn_eval.json"
    good.write_text(json.dumps([{"instruction": "i", "input": "a", "output": "x"},
                                {"instruction": "i", "input": "b", "output": "y"}]))
    assert ev.read_references(good) == ["x", "y"]
    with pytest.raises(GptjError, match="dataset file not found"):
        ev.read_references(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(GptjError, match="not valid JSON"):
        ev.read_references(bad)
    bad.write_text(json.dumps([{"instruction": "i", "input": "a"}]))
    with pytest.raises(GptjError, match="record 0: no string 'output'"):
        ev.read_references(bad)
    bad.write_text(json.dumps({"output": "x"}))
    with pytest.raises(GptjError, match="not a JSON list"):
        ev.read_references(bad)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("[{\"qsl_idx\": 0, ", "not valid JSON"),
        (json.dumps({"qsl_idx": 0, "data": ""}), "not a JSON list"),
        (json.dumps([{"seq_id": 0, "data": "00"}]), "entry 0: expected an object with 'qsl_idx' and 'data'"),
        (json.dumps([{"qsl_idx": -1, "data": ""}]), "qsl_idx -1 is not a non-negative integer"),
        (json.dumps([{"qsl_idx": "3", "data": ""}]), "qsl_idx '3' is not a non-negative integer"),
        (json.dumps([{"qsl_idx": 0, "data": hexdata([1])}, {"qsl_idx": 1, "data": "0G" * 8}]),
         "entry 1 \\(qsl_idx 1\\): 'data' is not valid hex"),
        (json.dumps([{"qsl_idx": 4, "data": "00" * 12}]),
         "qsl_idx 4\\): 12 bytes is not a whole number of int64 token ids"),
        (json.dumps([{"qsl_idx": 4, "data": 12}]), "'data' is not a hex string"),
    ],
)
def test_read_accuracy_log_errors(tmp_path, content, match):
    log = tmp_path / "log.json"
    log.write_text(content)
    with pytest.raises(GptjError, match=match):
        ev.read_accuracy_log(log)


def test_missing_log_errors(tmp_path, tok):
    with pytest.raises(GptjError, match="accuracy log not found: .*missing.json"):
        ev.read_accuracy_log(tmp_path / "missing.json")
    with pytest.raises(GptjError, match=f"accuracy log not found: .*{ev.ACCURACY_LOG_NAME}"):
        ev.evaluate_log(tmp_path, ["x"], tokenizer=tok)  # a directory without the log
    with pytest.raises(GptjError, match="unknown dtype"):
        ev.read_accuracy_log(tmp_path / "missing.json", dtype="float16")


def test_evaluate_log_errors(tmp_path, tok):
    log = write_log(tmp_path / "log.json", [(0, tok.encode("a")), (7, tok.encode("b"))])
    with pytest.raises(GptjError, match=r"qsl_idx 7 has no reference \(outside the 3 references\)"):
        ev.evaluate_log(log, ["x", "y", "z"], tokenizer=tok)
    write_log(log, [(1, [15496, 50400])])
    with pytest.raises(GptjError, match="qsl_idx 1: token id 50400 is outside the vocabulary"):
        ev.evaluate_log(log, ["x", "y"], tokenizer=tok)
    log.write_text("[]")
    with pytest.raises(GptjError, match="has no entries"):
        ev.evaluate_log(log, ["x"], tokenizer=tok)
    with pytest.raises(GptjError, match="2 predictions but 1 references"):
        ev.score(["a", "b"], ["a"])
    with pytest.raises(GptjError, match="no predictions"):
        ev.score([], [])


def test_a_run_scored_against_another_runs_outputs(tmp_path, tok, capsys):
    """--against: a baseline run's summaries as the references (a quantized model's run against
    bfloat16's): the same outputs score 100, others less; no gptj-99 target is checked; a sample the
    baseline lacks is a one-line error."""
    texts = ["The cat sat on the mat. It was happy.", "Stocks fell sharply on Monday.", "Rain is due."]
    base, same, other = (tmp_path / n for n in ("base", "same", "other"))
    for d in (base, same, other):
        d.mkdir()
    write_log(base / ev.ACCURACY_LOG_NAME, [(i, tok.encode(t) + [EOS]) for i, t in enumerate(texts)])
    write_log(same / ev.ACCURACY_LOG_NAME, [(2, tok.encode(texts[2])), (0, tok.encode(texts[0]))])
    write_log(other / ev.ACCURACY_LOG_NAME, [(0, tok.encode("The dog sat on the mat.")), (1, tok.encode(texts[1]))])
    refs = ev.references_from_log(base, tok)
    assert refs == [ev.clean_up_tokenization(t) for t in texts]
    result = ev.evaluate_log(same, refs, tokenizer=tok, against=str(base))
    assert (result.rouge1, result.rougeL) == (100.0, 100.0) and result.targets == {}
    assert "targets do not apply" in ev.format_report(result)
    assert 50 < ev.evaluate_log(other, refs, tokenizer=tok, against=str(base)).rouge1 < 100
    write_log(base / ev.ACCURACY_LOG_NAME, [(0, tok.encode(texts[0]))])  # the baseline ran sample 0 only
    with pytest.raises(GptjError, match=r"qsl_idx 1 has no reference in .*base's outputs"):
        ev.evaluate_log(other, ev.references_from_log(base, tok), tokenizer=tok, against=str(base))
    from gptj.cli import main

    assert main(["evaluate", "--log-dir", str(same), "--against", str(base), "--json"]) == 1  # sample 2: none
    assert "no reference" in capsys.readouterr().err
