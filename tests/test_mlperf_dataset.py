"""Tests for gptj.mlperf.dataset: the reference prompt, truncation to 1919 tokens, the
bundled sample set, max_examples, and one-line errors for malformed cnn_eval.json files."""

import json
import re

import pytest

from gptj.errors import GptjError
from gptj.mlperf.dataset import (
    DEFAULT_DATASET,
    MAX_INPUT_TOKENS,
    PROMPT_TEMPLATE,
    Dataset,
    Example,
    build_prompt,
    load_examples,
)
from gptj.tokenizer import load_tokenizer

# MLCommons inference language/gpt-j/dataset.py, PROMPT_DICT["prompt_input"], written out.
REFERENCE_TEMPLATE = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
    "{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
INSTRUCTION = "Summarize the following news article:"
PREFIX = REFERENCE_TEMPLATE.split("{instruction}")[0]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def bundled(tok):
    return Dataset.load(tokenizer=tok)


def write_json(tmp_path, data, name="cnn_eval.json"):
    path = tmp_path / name
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    path.write_text(text, encoding="utf-8")
    return path


def entry(article="Some article text.", output="A summary."):
    return {"instruction": INSTRUCTION, "input": article, "output": output}


def test_template_is_the_references():
    assert PROMPT_TEMPLATE == REFERENCE_TEMPLATE


def test_max_input_tokens_matches_decoder():
    from gptj.decode import MAX_INPUT_TOKENS as DECODE_MAX

    assert MAX_INPUT_TOKENS == DECODE_MAX == 1919


def test_build_prompt_is_format_map():
    ex = Example("Do {this}.", "An article about {input} and {0} braces.", "ignored")
    expected = REFERENCE_TEMPLATE.format_map(
        {"instruction": ex.instruction, "input": ex.input, "output": ex.output}
    )
    assert build_prompt(ex) == expected
    assert "An article about {input} and {0} braces." in build_prompt(ex)
    assert "ignored" not in build_prompt(ex)


def test_bundled_set(bundled, tok):
    assert DEFAULT_DATASET.is_file()
    assert DEFAULT_DATASET.parent.name == "data" and DEFAULT_DATASET.name == "cnn_sample.json"
    assert bundled.path == DEFAULT_DATASET
    assert len(bundled) == 30 == bundled.num_available
    assert bundled.note is None and bundled.num_truncated == 0
    assert len(bundled.prompts) == len(bundled.input_ids) == len(bundled.references) == 30
    for ex, prompt, ids, ref in zip(
        bundled.examples, bundled.prompts, bundled.input_ids, bundled.references, strict=True
    ):
        assert ex.instruction == INSTRUCTION
        assert prompt.startswith(PREFIX + INSTRUCTION + "\n\n### Input:\n" + ex.input)
        assert prompt.endswith("\n\n### Response:")
        assert ids == tok.encode(prompt)  # short prompts: untouched
        assert tok.decode(ids) == prompt
        assert ref == ex.output
        lines = ref.split("\n")
        assert 2 <= len(lines) <= 4 and all(line.endswith(".") for line in lines)
    assert any(not ex.input.isascii() for ex in bundled.examples)


def test_bundled_file_is_cnn_eval_format():
    data = json.loads(DEFAULT_DATASET.read_text(encoding="utf-8"))
    assert isinstance(data, list) and len(data) == 30
    assert all(set(item) == {"instruction", "input", "output"} for item in data)
    assert load_examples(DEFAULT_DATASET) == [Example(**item) for item in data]


def test_truncation_keeps_the_first_1919_tokens(tmp_path, tok):
    long_article = " ".join(f"Paragraph {i}: the council met again to discuss the budget." for i in range(400))
    path = write_json(tmp_path, [entry("Short article."), entry(long_article), entry("Another one.")])
    ds = Dataset.load(path, tokenizer=tok)
    full = tok.encode(ds.prompts[1])
    assert len(full) > 3000
    assert ds.input_ids[1] == full[:MAX_INPUT_TOKENS]
    assert len(ds.input_ids[1]) == 1919
    assert ds.input_ids[0] == tok.encode(ds.prompts[0])
    assert ds.input_ids[2] == tok.encode(ds.prompts[2])
    assert ds.num_truncated == 1
    assert ds.prompts[1].endswith("### Response:")  # the string itself is kept whole


def test_truncation_matches_hf_tokenizer(tmp_path, tok):
    """The reference calls tokenizer(prompt, truncation=True, max_length=1919)."""
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok", model_max_length=2048)
    article = "Stock markets fell sharply on Tuesday. " * 600
    ds = Dataset.load(write_json(tmp_path, [entry(article), entry()]), tokenizer=tok)
    for prompt, ids in zip(ds.prompts, ds.input_ids, strict=True):
        assert hf(prompt, truncation=True, max_length=1919)["input_ids"] == ids


def test_prompt_at_the_limit_is_untouched(tok):
    ex = Example(INSTRUCTION, "A short article.", "A summary.")
    full = tok.encode(build_prompt(ex))
    at_limit = Dataset([ex], tok, max_input_tokens=len(full))
    assert at_limit.input_ids == [full] and at_limit.num_truncated == 0
    one_over = Dataset([ex], tok, max_input_tokens=len(full) - 1)
    assert one_over.input_ids == [full[:-1]] and one_over.num_truncated == 1


def test_max_examples(tmp_path, tok, bundled):
    five = Dataset.load(tokenizer=tok, max_examples=5)
    assert len(five) == 5 and five.num_available == 30 and five.note is None
    assert five.examples == bundled.examples[:5]
    assert five.input_ids == bundled.input_ids[:5]
    many = Dataset.load(tokenizer=tok, max_examples=100)
    assert len(many) == 30
    assert "100" in many.note and "30" in many.note
    assert Dataset.load(tokenizer=tok, max_examples=30).note is None


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "3"])
def test_max_examples_must_be_positive_int(bad, tok):
    with pytest.raises(GptjError, match="max_examples must be an integer >= 1"):
        Dataset.load(tokenizer=tok, max_examples=bad)


def test_max_examples_still_checks_the_whole_file(tmp_path, tok):
    path = write_json(tmp_path, [entry(), entry(), {"instruction": INSTRUCTION, "output": "x"}])
    with pytest.raises(GptjError, match=r"cnn_eval\.json: entry 2: missing key 'input'"):
        Dataset.load(path, tokenizer=tok, max_examples=1)


def test_extra_keys_are_ignored(tmp_path):
    path = write_json(tmp_path, [{**entry(), "id": 7}])
    assert load_examples(path) == [Example(INSTRUCTION, "Some article text.", "A summary.")]


def test_missing_file(tmp_path, tok):
    path = tmp_path / "cnn_eval.json"
    with pytest.raises(GptjError, match=r"cnn_eval\.json: data set file not found"):
        Dataset.load(path, tokenizer=tok)


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(GptjError, match="is a directory"):
        load_examples(tmp_path)


def test_invalid_json_names_line_and_column(tmp_path):
    path = write_json(tmp_path, '[\n {"instruction": "a", "input": "b" "output": "c"}\n]')
    with pytest.raises(GptjError) as e:
        load_examples(path)
    msg = str(e.value)
    assert "cnn_eval.json: not valid JSON" in msg and "line 2 column" in msg
    assert "\n" not in msg


def test_invalid_utf8(tmp_path):
    path = tmp_path / "cnn_eval.json"
    path.write_bytes(b'[{"instruction": "a", "input": "\xff", "output": "c"}]')
    with pytest.raises(GptjError, match=r"cnn_eval\.json: not valid UTF-8"):
        load_examples(path)


GOOD = entry()


@pytest.mark.parametrize(
    "data, message",
    [
        ({"data": [GOOD]}, "cnn_eval.json: top level must be a JSON list of examples, got object"),
        ("\"text\"", "cnn_eval.json: top level must be a JSON list of examples, got string"),
        ([], "cnn_eval.json: contains no examples (empty list)"),
        ([GOOD, ["a", "b", "c"]], "cnn_eval.json: entry 1: must be an object"),
        ([GOOD, GOOD, GOOD, "text"], "cnn_eval.json: entry 3: must be an object"),
        ([GOOD, GOOD, GOOD, {"instruction": "a", "output": "c"}], "cnn_eval.json: entry 3: missing key 'input'"),
        ([{"input": "b", "output": "c"}], "cnn_eval.json: entry 0: missing key 'instruction'"),
        ([GOOD, {"instruction": "a", "input": "b"}], "cnn_eval.json: entry 1: missing key 'output'"),
        ([GOOD, {**GOOD, "output": 3}], "cnn_eval.json: entry 1: 'output' must be a string, got number"),
        ([{**GOOD, "input": None}], "cnn_eval.json: entry 0: 'input' must be a string, got null"),
        ([{**GOOD, "instruction": ["x"]}], "cnn_eval.json: entry 0: 'instruction' must be a string, got list"),
        ([GOOD, GOOD, {**GOOD, "input": ""}], "cnn_eval.json: entry 2: 'input' is empty"),
        ([{**GOOD, "input": " \n\t "}], "cnn_eval.json: entry 0: 'input' is empty"),
    ],
)
def test_malformed_entries(tmp_path, tok, data, message):
    path = write_json(tmp_path, data)
    with pytest.raises(GptjError) as e:
        Dataset.load(path, tokenizer=tok)
    msg = str(e.value)
    assert msg.startswith(str(path) + ":")
    assert message in msg
    assert "\n" not in msg
    with pytest.raises(GptjError, match=re.escape(message)):
        load_examples(path)


def test_in_memory_dataset(tok):
    ds = Dataset([Example(INSTRUCTION, "An article.", "A summary.")], tok)
    assert ds.path is None and len(ds) == 1 and ds.references == ["A summary."]
    assert "1 examples" in repr(ds)
    with pytest.raises(GptjError):
        Dataset([], tok)
