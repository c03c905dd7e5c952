"""The gptj-99 data set: MLPerf's `cnn_eval.json`, its prompts and their token ids.

`cnn_eval.json` (made by MLCommons' `download_cnndm.py` from CNN-DailyMail 3.0.0,
validation split) is a JSON list of objects::

    [{"instruction": "Summarize the following news article:",
      "input": "<article>", "output": "<reference highlights, one per line>"}, ...]

Each prompt is the reference's Alpaca-style template filled with the entry, as
`PROMPT_DICT["prompt_input"].format_map(example)` does in MLCommons'
`language/gpt-j/dataset.py`, then tokenized and truncated like the reference's
`tokenizer(prompt, truncation=True, max_length=1919)`: right-side truncation, so
the FIRST 1919 token ids are kept. Everything is tokenized once, into RAM.

Entries are numbered from 0, as in the JSON list (and as loadgen sample indices).

llama3.1-8b and llama3.1-8b-edge (MLCommons' language/llama3.1-8b) read another format: a JSON list
of ``{"input": "<prompt>", "tok_input": [token ids], "output": "<reference>"}`` (other keys, such
as the reference's "instruction", are ignored). The prompt is `LLAMA_PROMPT_TEMPLATE` filled with
the article; MLCommons' `dataset.py` hands `tok_input` to the SUT as it is (no truncation), so gptj
does too. `tok_input` may be null in gptj's bundled stand-in (`DEFAULT_LLAMA_DATASET`): Llama 3's
real ids need its tokenizer, which is not packaged, so those prompts are tokenized at load with the
model's tokenizer (`tokenizer.encode(prompt)`, BOS as its post-processor adds it, as the reference's
`download_cnndm.py` does with `tokenizer.encode`). The stand-in is made from gptj-99's bundled
articles by `llama_records_from_examples` / `write_llama_sample` (never edited by hand). (That
script's own record keeps the bare article under "input" and the prompt only in tok_input: where a
file has tok_input, "input" is never tokenized, so either reading gives the same run.)

This module does not import torch.
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptj.errors import GptjError
from gptj.files import read_text
from gptj.tokenizer import Tokenizer, load_tokenizer

# MLCommons inference, language/gpt-j/dataset.py, PROMPT_DICT["prompt_input"]. Benchmark
# fact: any change to this string changes every prompt and the accuracy results.
PROMPT_TEMPLATE = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)

# Same value as gptj.decode.MAX_INPUT_TOKENS (kept here so loading data needs no torch;
# a test checks they agree): the reference truncates every prompt to 1919 tokens.
MAX_INPUT_TOKENS = 1919

KEYS = ("instruction", "input", "output")

# The bundled sample: 30 original news-style articles in the cnn_eval.json format, so
# the harness runs end to end without downloading the real data set. On disk inside the
# package (package data "mlperf/data/*.json").
DEFAULT_DATASET: Path = Path(
    str(importlib.resources.files(__package__).joinpath("data", "cnn_sample.json"))
)


# MLCommons inference, language/llama3.1-8b/download_cnndm.py, instruction_template["llama"].
# Benchmark fact, like PROMPT_TEMPLATE.
LLAMA_PROMPT_TEMPLATE = (
    "Summarize the following news article in 128 tokens. Please output the summary only, without any "
    "other text.\n\nArticle:\n{input}\n\nSummary:"
)
LLAMA_BENCHMARKS = ("llama3.1-8b", "llama3.1-8b-edge")
LLAMA_KEYS = ("input", "tok_input", "output")

# The llama3.1-8b stand-in: gptj-99's 30 bundled articles in the llama format, tok_input null.
DEFAULT_LLAMA_DATASET: Path = DEFAULT_DATASET.with_name("cnn_llama_sample.json")


@dataclass(frozen=True)
class Example:
    """One cnn_eval.json entry: `output` is the reference summary (highlights)."""

    instruction: str
    input: str
    output: str


def build_prompt(example: Example) -> str:
    """The reference's prompt for `example` (its `output` is not part of it)."""
    # format_map substitutes values verbatim: braces inside an article are not re-parsed.
    return PROMPT_TEMPLATE.format_map({"instruction": example.instruction, "input": example.input})


def _entry_with(path: Path, i: int, entry: Any, keys: tuple[str, ...]) -> str:
    """Entry i of a data set file checked to be an object holding `keys` (GptjError, one line, else);
    -> its place for later messages ("FILE: entry i")."""
    where = f"{path}: entry {i}"
    if not isinstance(entry, dict):
        raise GptjError(f"{where}: must be an object with keys {', '.join(keys)}, got {_type_name(entry)}")
    for key in keys:
        if key not in entry:
            raise GptjError(f"{where}: missing key {key!r}")
    return where


def _type_name(value: object) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    return "number" if isinstance(value, int | float) else type(value).__name__


def load_examples(path: str | Path) -> list[Example]:
    """Read and check a cnn_eval.json-format file.

    Raises GptjError (one line, naming the file and, for a bad entry, its 0-based index)
    when the file is missing or unreadable, is not valid JSON or UTF-8, its top level is
    not a list, the list is empty, an entry is not an object, lacks one of
    instruction/input/output, has a non-string value for one, or has an empty input.
    Extra keys in an entry are ignored.
    """
    path = Path(path)
    data = _read_list(path)
    examples = []
    for i, entry in enumerate(data):
        where = _entry_with(path, i, entry, KEYS)
        for key in KEYS:
            if not isinstance(entry[key], str):
                raise GptjError(f"{where}: {key!r} must be a string, got {_type_name(entry[key])}")
        if not entry["input"].strip():
            raise GptjError(f"{where}: 'input' is empty")
        examples.append(Example(entry["instruction"], entry["input"], entry["output"]))
    return examples


@dataclass(frozen=True)
class LlamaRecord:
    """One llama3.1-8b cnn_eval.json entry: `input` is the whole prompt, `tok_input` its token ids
    (None: tokenize `input` at load), `output` the reference summary."""

    input: str
    tok_input: tuple[int, ...] | None
    output: str


def llama_prompt(article: str) -> str:
    """The llama3.1-8b prompt for a news article."""
    return LLAMA_PROMPT_TEMPLATE.format_map({"input": article})


def llama_records_from_examples(examples: Sequence[Example]) -> list[LlamaRecord]:
    """gptj-99 examples as llama3.1-8b records: same article and reference, the llama prompt, no ids."""
    return [LlamaRecord(llama_prompt(e.input), None, e.output) for e in examples]


def write_llama_sample(dst: str | Path = DEFAULT_LLAMA_DATASET, src: str | Path = DEFAULT_DATASET) -> Path:
    """(Re)make the bundled llama3.1-8b stand-in from gptj-99's bundled sample."""
    records = llama_records_from_examples(load_examples(src))
    data = [{"input": r.input, "tok_input": None, "output": r.output} for r in records]
    dst = Path(dst)
    dst.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return dst


def _read_list(path: Path) -> list:
    text = read_text(path, "data set file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise GptjError(
            f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(data, list):
        raise GptjError(
            f"{path}: top level must be a JSON list of examples, got {_type_name(data)}"
        )
    if not data:
        raise GptjError(f"{path}: contains no examples (empty list)")
    return data


def _token_ids(value: object, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise GptjError(f"{where}: 'tok_input' must be a list of token ids or null, got {_type_name(value)}")
    if not value:
        raise GptjError(f"{where}: 'tok_input' is empty")
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise GptjError(f"{where}: 'tok_input' holds {i!r}, not a non-negative integer token id")
    return tuple(value)


def load_llama_records(path: str | Path) -> list[LlamaRecord]:
    """Read and check a llama3.1-8b cnn_eval.json-format file (GptjError, one line, naming the file and
    the 0-based entry, for anything malformed: input/output not strings, an empty input, tok_input
    missing or not a non-empty list of non-negative integers or null)."""
    path = Path(path)
    records = []
    for i, entry in enumerate(_read_list(path)):
        where = _entry_with(path, i, entry, LLAMA_KEYS)
        for key in ("input", "output"):
            if not isinstance(entry[key], str):
                raise GptjError(f"{where}: {key!r} must be a string, got {_type_name(entry[key])}")
        if not entry["input"].strip():
            raise GptjError(f"{where}: 'input' is empty")
        records.append(LlamaRecord(entry["input"], _token_ids(entry["tok_input"], where), entry["output"]))
    return records


class Dataset:
    """A cnn_eval.json-format data set, prompts built and tokenized into RAM.

    Attributes (lists indexed by sample index, all of length `len(self)`):
      path        the file read (None when built from in-memory examples)
      examples    the `Example`s
      prompts     the prompt strings (`build_prompt`)
      input_ids   the prompts' token ids, truncated to the first `max_input_tokens`
      references  the reference summaries (each example's `output`)
      max_input_tokens  the truncation length (1919 for the benchmark)
      num_truncated     how many prompts were longer and got truncated
      num_available     how many examples the file holds (before `max_examples`)
      note        None, or one line saying `max_examples` was clamped to what the file holds
      benchmark   "gptj-99" (the cnn_eval.json format above), or the llama3.1-8b benchmark whose
                  format it was read in (`from_llama_records`: `examples` are `LlamaRecord`s,
                  `prompts` their `input`s, nothing truncated)
    """

    def __init__(
        self,
        examples: Sequence[Example],
        tokenizer: Tokenizer | None = None,
        *,
        path: str | Path | None = None,
        max_input_tokens: int = MAX_INPUT_TOKENS,
    ) -> None:
        if not examples:
            raise GptjError("a data set needs at least one example")
        if max_input_tokens < 1:
            raise GptjError(f"max_input_tokens must be >= 1, got {max_input_tokens}")
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
        self.path: Path | None = Path(path) if path is not None else None
        self.examples: list[Example] = list(examples)
        self.prompts: list[str] = [build_prompt(e) for e in self.examples]
        self.references: list[str] = [e.output for e in self.examples]
        self.max_input_tokens = max_input_tokens
        full = tokenizer.encode_batch(self.prompts)
        self.num_truncated = sum(len(ids) > max_input_tokens for ids in full)
        self.input_ids: list[list[int]] = [ids[:max_input_tokens] for ids in full]
        self.num_available = len(self.examples)
        self.note: str | None = None
        self.benchmark = "gptj-99"

    @classmethod
    def from_llama_records(
        cls,
        records: Sequence[LlamaRecord],
        tokenizer: Tokenizer | None = None,
        *,
        path: str | Path | None = None,
        benchmark: str = LLAMA_BENCHMARKS[0],
    ) -> Dataset:
        """A llama3.1-8b data set: each record's `tok_input` as it is, else its `input` tokenized with
        `tokenizer` (the model's: needed only where a record has no tok_input)."""
        if benchmark not in LLAMA_BENCHMARKS:
            raise GptjError(f"unknown llama benchmark {benchmark!r} (one of {', '.join(LLAMA_BENCHMARKS)})")
        if not records:
            raise GptjError("a data set needs at least one example")
        missing = [i for i, r in enumerate(records) if r.tok_input is None]
        if missing and tokenizer is None:
            where = f" {path}" if path is not None else ""
            raise GptjError(f"the {benchmark} data set{where} has {len(missing)} entries without tok_input "
                            f"(entry {missing[0]} first): give the model's tokenizer to tokenize their prompts")
        encoded = iter(tokenizer.encode_batch([records[i].input for i in missing]) if missing else [])
        self = cls.__new__(cls)
        self.path = Path(path) if path is not None else None
        self.examples = list(records)
        self.prompts = [r.input for r in records]
        self.references = [r.output for r in records]
        self.input_ids = [list(r.tok_input) if r.tok_input is not None else next(encoded) for r in records]
        self.max_input_tokens = max(len(ids) for ids in self.input_ids)  # the reference truncates nothing
        self.num_truncated = 0
        self.num_available = len(records)
        self.note = None
        self.benchmark = benchmark
        return self

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        tokenizer: Tokenizer | None = None,
        max_examples: int | None = None,
        benchmark: str = "gptj-99",
    ) -> Dataset:
        """Read `path` (None: the bundled `DEFAULT_DATASET`, or `DEFAULT_LLAMA_DATASET` for a llama
        benchmark) and tokenize its prompts.

        `tokenizer`: None loads the packaged GPT-J tokenizer (gptj-99; a llama data set needs the
        model's tokenizer only for entries without tok_input). `max_examples`: keep only the
        first N examples (N >= 1, else GptjError); an N above what the file holds is not an
        error: all examples are kept and `note` says so. The whole file is checked either way.
        `benchmark`: "gptj-99" (also for gptj-99.9) or one of `LLAMA_BENCHMARKS`: the file's format.
        """
        llama = benchmark in LLAMA_BENCHMARKS
        if not llama and benchmark not in ("gptj-99", "gptj-99.9"):
            raise GptjError(f"no data set format for benchmark {benchmark!r} "
                            f"(gptj-99, gptj-99.9, {', '.join(LLAMA_BENCHMARKS)})")
        if max_examples is not None and (
            isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1
        ):
            raise GptjError(f"max_examples must be an integer >= 1, got {max_examples!r}")
        path = Path(path) if path is not None else DEFAULT_LLAMA_DATASET if llama else DEFAULT_DATASET
        examples = load_llama_records(path) if llama else load_examples(path)
        available = len(examples)
        note = None
        if max_examples is not None:
            if max_examples > available:
                note = (
                    f"max_examples={max_examples} is more than the {available} examples "
                    f"in {path}; using all {available}"
                )
            examples = examples[:max_examples]
        if llama:
            dataset = cls.from_llama_records(examples, tokenizer, path=path, benchmark=benchmark)
        else:
            dataset = cls(examples, tokenizer, path=path)
        dataset.num_available = available
        dataset.note = note
        return dataset

    def __len__(self) -> int:
        return len(self.examples)

    def __repr__(self) -> str:
        where = self.path.name if self.path is not None else "<memory>"
        return f"Dataset({where!r}, {len(self)} examples, {self.num_truncated} truncated)"
