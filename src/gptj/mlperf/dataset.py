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

This module does not import torch.
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
    examples = []
    for i, entry in enumerate(data):
        where = f"{path}: entry {i}"
        if not isinstance(entry, dict):
            raise GptjError(
                f"{where}: must be an object with keys {', '.join(KEYS)}, got {_type_name(entry)}"
            )
        for key in KEYS:
            if key not in entry:
                raise GptjError(f"{where}: missing key {key!r}")
            if not isinstance(entry[key], str):
                raise GptjError(f"{where}: {key!r} must be a string, got {_type_name(entry[key])}")
        if not entry["input"].strip():
            raise GptjError(f"{where}: 'input' is empty")
        examples.append(Example(entry["instruction"], entry["input"], entry["output"]))
    return examples


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

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        tokenizer: Tokenizer | None = None,
        max_examples: int | None = None,
    ) -> Dataset:
        """Read `path` (None: the bundled `DEFAULT_DATASET`) and tokenize its prompts.

        `tokenizer`: None loads the packaged GPT-J tokenizer. `max_examples`: keep only the
        first N examples (N >= 1, else GptjError); an N above what the file holds is not an
        error: all examples are kept and `note` says so. The whole file is checked either way.
        """
        if max_examples is not None and (
            isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1
        ):
            raise GptjError(f"max_examples must be an integer >= 1, got {max_examples!r}")
        path = Path(path) if path is not None else DEFAULT_DATASET
        examples = load_examples(path)
        available = len(examples)
        note = None
        if max_examples is not None:
            if max_examples > available:
                note = (
                    f"max_examples={max_examples} is more than the {available} examples "
                    f"in {path}; using all {available}"
                )
            examples = examples[:max_examples]
        dataset = cls(examples, tokenizer, path=path)
        dataset.num_available = available
        dataset.note = note
        return dataset

    def __len__(self) -> int:
        return len(self.examples)

    def __repr__(self) -> str:
        where = self.path.name if self.path is not None else "<memory>"
        return f"Dataset({where!r}, {len(self)} examples, {self.num_truncated} truncated)"
