"""Tests for gptj.train.data and `gptj prepare-data`: packing text into rows, JSON lines,
summarization pairs and their loss mask, article truncation, TokenData, atomic output,
one-line errors for bad input, and the shipped example data."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from gptj.errors import GptjError
from gptj.mlperf.dataset import PROMPT_TEMPLATE, Example, build_prompt, load_examples
from gptj.tokenizer import load_tokenizer
from gptj.train.data import (
    FORMAT,
    TokenData,
    is_prepared,
    prepare_summarization,
    prepare_text,
)
from gptj.train.data_cli import register

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
INSTRUCTION = "Summarize the following news article:"
EOS = 50256


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def write_json(path: Path, obj: object) -> Path:
    return write(path, json.dumps(obj))


def example(article: str = "Rain fell on the town of Oakham for three days. The river rose.",
            output: str = "  Oakham had three days of rain.\n") -> Example:
    return Example(INSTRUCTION, article, output)


def cnn_file(path: Path, examples: list[Example]) -> Path:
    return write_json(path, [{"instruction": e.instruction, "input": e.input, "output": e.output} for e in examples])


class CountingTokenizer:
    """Wraps the real tokenizer; raises on document `fail_at` (1-based), or reports a vocab size."""

    def __init__(self, tok, fail_at: int | None = None, vocab_size: int | None = None) -> None:
        self.tok, self.fail_at, self.count = tok, fail_at, 0
        self.vocab_size = vocab_size or tok.vocab_size
        self.eos_token_id = self.pad_token_id = tok.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.count += 1
        if self.fail_at is not None and self.count >= self.fail_at:
            raise RuntimeError("tokenizer failed")
        return self.tok.encode(text)

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    register(sub)
    return p.parse_args(argv)


# --- packing -------------------------------------------------------------------------


def test_packing_rows_masks_and_meta(tmp_path, tok):
    docs = ["The quick brown fox jumps over the lazy dog.", "Hello world!\nA second line here.",
            "Short one."]
    files = [write(tmp_path / f"doc{i}.txt", d) for i, d in enumerate(docs)]
    seq_len = 7
    meta = prepare_text(files, tmp_path / "out", seq_len, progress=False)
    expected = [i for d in docs for i in tok.encode(d) + [EOS]]
    assert len(expected) % seq_len != 0  # the last row really is padded
    n_rows = -(-len(expected) // seq_len)
    assert meta == {
        "format": FORMAT, "kind": "packed", "seq_len": seq_len, "n_sequences": n_rows,
        "n_tokens": len(expected), "vocab_size": 50400, "eos_token_id": EOS, "pad_token_id": EOS,
        "sources": [str(f) for f in files], "tokenizer": "gpt-j", "ids_dtype": "uint16",
    }
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta

    raw = np.fromfile(tmp_path / "out" / "input_ids.bin", dtype=np.uint16)
    assert raw.size == n_rows * seq_len  # two bytes per id on disk
    ids = raw.reshape(n_rows, seq_len)
    input_mask = np.fromfile(tmp_path / "out" / "input_mask.bin", dtype=np.uint8).reshape(n_rows, seq_len)
    loss_mask = np.fromfile(tmp_path / "out" / "loss_mask.bin", dtype=np.uint8).reshape(n_rows, seq_len)
    assert ids[input_mask == 1].tolist() == expected
    pad = n_rows * seq_len - len(expected)
    assert input_mask[-1, seq_len - pad:].tolist() == [0] * pad
    assert ids[-1, seq_len - pad:].tolist() == [EOS] * pad
    assert input_mask[:-1].all() and input_mask[-1, : seq_len - pad].all()
    want_loss = input_mask.copy()
    want_loss[:, 0] = 0
    assert np.array_equal(loss_mask, want_loss)


def test_whitespace_documents_are_skipped_and_empty_input_is_an_error(tmp_path, tok):
    files = [write(tmp_path / "a.txt", "Some text."), write(tmp_path / "b.txt", "  \n\n"),
             write(tmp_path / "c.txt", "More.")]
    prepare_text(files, tmp_path / "out", 4, progress=False)
    data = TokenData(tmp_path / "out")
    ids, mask, _ = data.get(range(len(data)))
    assert ids[mask].tolist() == tok.encode("Some text.") + [EOS] + tok.encode("More.") + [EOS]
    with pytest.raises(GptjError, match="no text in"):
        prepare_text([files[1]], tmp_path / "empty", 4, progress=False)
    assert not (tmp_path / "empty").exists()


def test_jsonl_with_custom_key_and_blank_lines(tmp_path, tok):
    lines = [json.dumps({"body": "First document.", "id": 1}), "", json.dumps({"body": "Second one"}), "   "]
    jsonl = write(tmp_path / "corpus.jsonl", "\n".join(lines) + "\n")
    plain = write(tmp_path / "plain.txt", "Plain text last.")
    meta = prepare_text([jsonl, plain], tmp_path / "out", 5, jsonl_key="body", progress=False)
    ids, mask, _ = TokenData(tmp_path / "out").get(range(meta["n_sequences"]))
    expected = [i for d in ("First document.", "Second one", "Plain text last.") for i in tok.encode(d) + [EOS]]
    assert ids[mask].tolist() == expected
    assert meta["n_tokens"] == len(expected)


@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"', "line 3: not valid JSON"),
    ('["a list"]', "line 3: must be a JSON object, got list"),
    ('{"body": "x"}', "line 3: missing key 'text'"),
    ('{"text": 5}', "line 3: 'text' must be a string, got number"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "bad.jsonl", '{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(GptjError) as e:
        prepare_text([path], tmp_path / "out", 8, progress=False)
    assert str(path) in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


class ShiftedTokenizer(CountingTokenizer):
    """GPT-J's ids moved above 65,535 (a vocabulary of 140,000, as Llama 3's 128,256 is): what uint16
    ids could not hold."""

    SHIFT = 70000

    def __init__(self, tok) -> None:
        super().__init__(tok, vocab_size=140000)
        self.eos_token_id = self.pad_token_id = tok.eos_token_id + self.SHIFT

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [i + self.SHIFT for i in super().encode(text, add_special_tokens)]


def test_a_vocabulary_past_65536_ids_is_stored_as_uint32(tmp_path, tok):
    docs = ["The quick brown fox jumps over the lazy dog.", "Short one."]
    files = [write(tmp_path / f"doc{i}.txt", d) for i, d in enumerate(docs)]
    shifted = ShiftedTokenizer(tok)
    meta = prepare_text(files, tmp_path / "out", 5, tokenizer=shifted, progress=False)
    assert meta["ids_dtype"] == "uint32" and meta["vocab_size"] == 140000
    expected = [i for d in docs for i in shifted.encode(d) + [shifted.eos_token_id]]
    n_rows = -(-len(expected) // 5)
    assert (tmp_path / "out" / "input_ids.bin").stat().st_size == n_rows * 5 * 4  # four bytes an id
    td = TokenData(tmp_path / "out")
    ids, input_mask, _ = td.get(range(n_rows))
    assert ids.reshape(-1)[:len(expected)].tolist() == expected  # uint16 would have wrapped every id
    assert input_mask.sum() == len(expected)
    meta_path = tmp_path / "out" / "meta.json"  # a folder that claims uint16 ids for such a vocabulary
    bad = json.loads(meta_path.read_text()) | {"ids_dtype": "uint16"}
    meta_path.write_text(json.dumps(bad))
    with pytest.raises(GptjError, match="ids_dtype must be uint16 .* or uint32"):
        TokenData(tmp_path / "out")


def test_a_folder_written_before_ids_dtype_reads_as_uint16(tmp_path, tok):
    files = [write(tmp_path / "doc.txt", "Hello world, again and again.")]
    prepare_text(files, tmp_path / "out", 4, progress=False)
    meta_path = tmp_path / "out" / "meta.json"
    old = json.loads(meta_path.read_text())
    del old["ids_dtype"]
    meta_path.write_text(json.dumps(old))
    ids, _, _ = TokenData(tmp_path / "out").get([0])
    assert ids[0].tolist() == (tok.encode("Hello world, again and again.") + [EOS] * 4)[:4]


def test_bad_arguments_are_user_errors(tmp_path, tok):
    src = write(tmp_path / "a.txt", "text")
    for seq_len in (1, 0, -3):
        with pytest.raises(GptjError, match="seq_len must be an integer >= 2"):
            prepare_text([src], tmp_path / "out", seq_len, progress=False)
    with pytest.raises(GptjError, match="is a directory"):
        prepare_text([tmp_path], tmp_path / "out", 8, progress=False)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    with pytest.raises(GptjError, match="not valid UTF-8"):
        prepare_text([bad], tmp_path / "out", 8, progress=False)
    with pytest.raises(GptjError, match="no input files"):
        prepare_text([], tmp_path / "out", 8, progress=False)
    assert not (tmp_path / "out").exists()


# --- summarization -------------------------------------------------------------------


def test_summarization_loss_mask_covers_response_and_eos(tmp_path, tok):
    ex = example()
    other = example("A second article about a parade in the city of Brill.", "Brill held a parade.")
    src = cnn_file(tmp_path / "cnn.json", [ex, other])
    meta = prepare_summarization(src, tmp_path / "out", 256, progress=False)
    assert meta["kind"] == "pairs" and meta["n_sequences"] == 2 and meta["sources"] == [str(src)]
    data = TokenData(tmp_path / "out")
    ids, input_mask, loss_mask = data.get([0, 1])
    for row, e in enumerate((ex, other)):
        prompt_ids = tok.encode(build_prompt(e))
        response_ids = tok.encode(" " + e.output.strip())
        assert tok.decode(ids[row][loss_mask[row]]) == " " + e.output.strip() + "<|endoftext|>"
        assert ids[row][loss_mask[row]].tolist() == response_ids + [EOS]
        assert ids[row][input_mask[row] & ~loss_mask[row]].tolist() == prompt_ids
        n = len(prompt_ids) + len(response_ids) + 1
        assert input_mask[row].tolist() == [True] * n + [False] * (256 - n)
        assert ids[row, n:].tolist() == [EOS] * (256 - n)
    assert meta["n_tokens"] == int(input_mask.sum())
    assert not (loss_mask & ~input_mask).any()


def test_long_article_is_cut_keeping_template_and_response(tmp_path, tok):
    article = " ".join(f"Sentence number {i} of a very long article about the harbor." for i in range(200))
    ex = example(article, "The harbor article was long.")
    src = cnn_file(tmp_path / "cnn.json", [ex])
    seq_len = 160
    prepare_summarization(src, tmp_path / "out", seq_len, progress=False)
    ids, input_mask, loss_mask = TokenData(tmp_path / "out").get([0])
    ids, input_mask, loss_mask = ids[0].tolist(), input_mask[0], loss_mask[0]
    header_text, footer_text = PROMPT_TEMPLATE.split("{input}")
    header = tok.encode(header_text.format(instruction=INSTRUCTION))
    footer = tok.encode(footer_text)
    response = tok.encode(" The harbor article was long.") + [EOS]
    assert input_mask.all()  # the row is filled exactly
    assert ids[: len(header)] == header
    assert ids[seq_len - len(response):] == response
    assert ids[seq_len - len(response) - len(footer): seq_len - len(response)] == footer
    kept = ids[len(header): seq_len - len(response) - len(footer)]
    assert 0 < len(kept) and kept == tok.encode(article)[: len(kept)]
    assert np.flatnonzero(loss_mask).tolist() == list(range(seq_len - len(response), seq_len))


def test_response_that_cannot_fit_is_a_one_line_error(tmp_path, tok):
    fits = example()
    too_long = example(output="A summary that is much too long to fit. " * 20)
    src = cnn_file(tmp_path / "cnn.json", [fits, too_long])
    with pytest.raises(GptjError) as e:
        prepare_summarization(src, tmp_path / "out", 64, progress=False)
    msg = str(e.value)
    assert "example 1" in msg and "seq_len 64" in msg and "\n" not in msg
    needed = int(msg.split(" need ")[1].split()[0])
    header_text, footer_text = PROMPT_TEMPLATE.split("{input}")
    assert needed == (len(tok.encode(header_text.format(instruction=INSTRUCTION))) + len(tok.encode(footer_text))
                      + len(tok.encode(" " + too_long.output.strip())) + 1)
    assert not (tmp_path / "out").exists()


def test_summarization_input_errors(tmp_path):
    with pytest.raises(GptjError, match="empy.json: input file not found"):
        prepare_summarization(tmp_path / "empy.json", tmp_path / "out", 64, progress=False)
    src = write_json(tmp_path / "bad.json", [{"instruction": "x", "input": "article", "output": 3}])
    with pytest.raises(GptjError, match="entry 0: 'output' must be a string"):
        prepare_summarization(src, tmp_path / "out", 64, progress=False)
    src = cnn_file(tmp_path / "empty_output.json", [example(), example(output="  ")])
    with pytest.raises(GptjError, match="entry 1: 'output' is empty"):
        prepare_summarization(src, tmp_path / "out", 512, progress=False)
    src = write(tmp_path / "broken.json", "[{")
    with pytest.raises(GptjError, match="not valid JSON"):
        prepare_summarization(src, tmp_path / "out", 64, progress=False)
    assert not (tmp_path / "out").exists()


# --- reading -------------------------------------------------------------------------


def test_token_data_get_and_validation(tmp_path):
    src = write(tmp_path / "a.txt", "one two three four five six seven eight nine ten eleven twelve")
    meta = prepare_text([src], tmp_path / "out", 4, progress=False)
    data = TokenData(tmp_path / "out")
    assert len(data) == meta["n_sequences"] >= 3 and data.kind == "packed" and data.seq_len == 4
    assert data.meta == meta and is_prepared(tmp_path / "out")
    ids, input_mask, loss_mask = data.get([2, 0])
    assert ids.dtype == np.int64 and input_mask.dtype == bool and loss_mask.dtype == bool
    assert ids.shape == input_mask.shape == loss_mask.shape == (2, 4)
    assert ids[1].tolist() == data.get([0])[0][0].tolist()
    ids[:] = 0  # a copy: the data is unchanged
    assert data.get([0])[0].any()
    with pytest.raises(IndexError):
        data.get([len(data)])

    for folder in (tmp_path, tmp_path / "missing"):
        assert not is_prepared(folder)
        with pytest.raises(GptjError, match="prepared data folder"):
            TokenData(folder)
    (tmp_path / "out" / "loss_mask.bin").write_bytes(b"\x00" * 3)
    with pytest.raises(GptjError, match=r"loss_mask.bin: 3 bytes, expected \d+"):
        TokenData(tmp_path / "out")
    write_json(tmp_path / "out" / "meta.json", meta | {"format": "other/1"})
    with pytest.raises(GptjError, match="format must be"):
        TokenData(tmp_path / "out")


# --- atomic output -------------------------------------------------------------------


def test_failure_midway_leaves_nothing(tmp_path, tok):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    files = [write(inputs / f"{i}.txt", f"Document number {i}.") for i in range(3)]
    outdir = tmp_path / "outs"
    outdir.mkdir()
    failing = CountingTokenizer(tok, fail_at=2)
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        prepare_text(files, outdir / "out", 4, tokenizer=failing, progress=False)
    assert failing.count == 2
    assert list(outdir.iterdir()) == []  # neither out nor a temporary folder

    src = cnn_file(inputs / "cnn.json", [example(), example()])
    failing = CountingTokenizer(tok, fail_at=3)
    with pytest.raises(RuntimeError):
        prepare_summarization(src, outdir / "out", 256, tokenizer=failing, progress=False)
    assert list(outdir.iterdir()) == []


def test_existing_out_needs_force(tmp_path):
    first = write(tmp_path / "first.txt", "The first corpus.")
    second = write(tmp_path / "second.txt", "The second corpus, a little longer than the first one.")
    out = tmp_path / "out"
    prepare_text([first], out, 4, progress=False)
    with pytest.raises(GptjError, match="already exists.*--force"):
        prepare_text([second], out, 4, progress=False)
    assert TokenData(out).meta["sources"] == [str(first)]
    meta = prepare_text([second], out, 4, force=True, progress=False)
    assert TokenData(out).meta == meta and meta["sources"] == [str(second)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.txt", "out", "second.txt"]

    other = tmp_path / "other"
    other.mkdir()
    write(other / "keep.txt", "not prepared data")
    with pytest.raises(GptjError, match="not a prepared data folder"):
        prepare_text([first], other, 4, force=True, progress=False)
    assert (other / "keep.txt").read_text() == "not prepared data"
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_text([first], empty, 4, progress=False)  # an empty folder is fine without --force
    assert is_prepared(empty)


# --- CLI -----------------------------------------------------------------------------


def test_cli_text_and_summarization(tmp_path, capsys):
    src = write(tmp_path / "a.txt", "Hello there, this is a small corpus for the command line.")
    args = parse(["prepare-data", "text", str(src), "--out", str(tmp_path / "t"), "--seq-len", "8", "--quiet"])
    assert args.func(args) == 0
    meta = TokenData(tmp_path / "t").meta
    pad = 100 * (meta["n_sequences"] * 8 - meta["n_tokens"]) / (meta["n_sequences"] * 8)
    assert capsys.readouterr().out == (f"prepared {meta['n_sequences']} sequences of 8 tokens "
                                       f"({meta['n_tokens']} tokens, {pad:.1f}% padding) in {tmp_path / 't'}\n")

    cnn = cnn_file(tmp_path / "cnn.json", [example()])
    args = parse(["prepare-data", "summarization", str(cnn), "--out", str(tmp_path / "s"), "--seq-len", "300",
                  "--quiet"])
    assert args.func(args) == 0
    assert TokenData(tmp_path / "s").kind == "pairs"
    assert capsys.readouterr().out.startswith("prepared 1 sequences of 300 tokens")

    args = parse(["prepare-data", "text", str(src), "--out", str(tmp_path / "t"), "--quiet"])
    assert args.seq_len == 2048 and args.jsonl_key == "text" and not args.force
    with pytest.raises(GptjError, match="already exists"):
        args.func(args)


def test_cli_missing_file_and_bad_tokenizer(tmp_path):
    missing = tmp_path / "nope.txt"
    args = parse(["prepare-data", "text", str(missing), "--out", str(tmp_path / "o")])
    with pytest.raises(GptjError) as e:
        args.func(args)
    assert str(missing) in str(e.value) and "not found" in str(e.value)
    src = write(tmp_path / "a.txt", "text")
    args = parse(["prepare-data", "text", str(src), "--out", str(tmp_path / "o"), "--tokenizer",
                  str(tmp_path / "no-tok")])
    with pytest.raises(GptjError, match="tokenizer path does not exist"):
        args.func(args)
    args = parse(["prepare-data", "summarization", str(src), "--out", str(tmp_path / "o"), "--seq-len", "1"])
    with pytest.raises(GptjError, match="seq_len"):
        args.func(args)
    assert not (tmp_path / "o").exists()


def test_gptj_main_reports_user_errors_in_one_line(tmp_path, capsys):
    from gptj.cli import build_parser, main

    try:
        build_parser().parse_args(["prepare-data", "text", "x", "--out", "y"])
    except SystemExit:
        pytest.skip("prepare-data is not wired into gptj.cli yet")
    missing = tmp_path / "nope.jsonl"
    assert main(["prepare-data", "text", str(missing), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err == f"gptj prepare-data: error: {missing}: input file not found\n"
    src = write(tmp_path / "a.txt", "Wired into the gptj command.")
    assert main(["prepare-data", "text", str(src), "--out", str(tmp_path / "o"), "--seq-len", "4", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("prepared 3 sequences of 4 tokens (10 tokens")


def test_cli_tokenizer_path_is_recorded(tmp_path, tok):
    tok.save(tmp_path / "tok")
    src = write(tmp_path / "a.txt", "Saved tokenizer test.")
    args = parse(["prepare-data", "text", str(src), "--out", str(tmp_path / "o"), "--seq-len", "4",
                  "--tokenizer", str(tmp_path / "tok"), "--quiet"])
    assert args.func(args) == 0
    meta = TokenData(tmp_path / "o").meta
    assert meta["tokenizer"] == str(tmp_path / "tok")
    assert meta["n_tokens"] == len(tok.encode("Saved tokenizer test.")) + 1


# --- shipped example data ------------------------------------------------------------


def test_shipped_text_examples_prepare(tmp_path):
    for name in ("pretrain.txt", "pretrain_eval.txt"):
        path = EXAMPLES / name
        assert path.stat().st_size > 2000
        meta = prepare_text([path], tmp_path / name, 64, progress=False)
        assert meta["n_sequences"] >= 10
    assert 20_000 <= (EXAMPLES / "pretrain.txt").stat().st_size <= 40_000
    assert TokenData(tmp_path / "pretrain.txt").meta["n_sequences"] > 100


def test_shipped_summarization_examples_prepare(tmp_path, tok):
    for name, low, high in (("summaries.json", 20, 30), ("summaries_eval.json", 4, 10)):
        path = EXAMPLES / name
        raw = json.loads(path.read_text(encoding="utf-8"))
        assert low <= len(raw) <= high
        for entry in raw:
            assert set(entry) == {"instruction", "input", "output"}
            assert all(isinstance(v, str) and v.strip() for v in entry.values())
            assert entry["instruction"] == INSTRUCTION
        meta = prepare_summarization(path, tmp_path / name, 512, progress=False)
        assert meta["n_sequences"] == len(raw)
        # At 512 tokens no article is cut: every row is the exact prompt + response + EOS.
        expected = sum(len(tok.encode(build_prompt(e))) + len(tok.encode(" " + e.output.strip())) + 1
                       for e in load_examples(path))
        assert meta["n_tokens"] == expected
