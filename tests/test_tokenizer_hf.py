"""gptj.tokenizer.HFTokenizer: any HF tokenizer.json (Llama 3 style here), built in the test with the
`tokenizers` library, with special tokens and EOS ids from tokenizer_config.json / generation_config.json."""

import json

import pytest
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from gptj.errors import GptjError
from gptj.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, tokenizer_for_model

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Summarize the following news article in 128 tokens.",
    "Café naïve façade — déjà vu, São Paulo, Zürich.",
    "日本語のテキストと한국어 문장, emoji 🙂👍🏽 and numbers 12345.",
    "Llama 3 uses a byte-level BPE with 128,256 tokens; GPT-J uses GPT-2's.",
] * 4
TEXTS = ["Hello world", "Café naïve — 日本語のテキスト, 한국어 🙂👍🏽\n\tend  ", " leading space",
         "12345 tokens!"]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
PYTHON_TAG = "<|python_tag|>"  # named only by tokenizer_config.json's added_tokens_decoder


def _backend(with_bos_template: bool) -> Backend:
    """A small Llama-3-shaped tokenizer: regex split + byte-level BPE, specials after the BPE vocabulary,
    the BOS added by a TemplateProcessing post-processor."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s?\p{L}+|\s?\p{N}{1,3}|\s?[^\s\p{L}\p{N}]+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    if with_bos_template:
        bos = tok.token_to_id(SPECIALS[0])
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{SPECIALS[0]} $A", pair=f"{SPECIALS[0]} $A {SPECIALS[0]} $B",
                                          special_tokens=[(SPECIALS[0], bos)])])
    else:
        tok.post_processor = None
    return tok


def _folder(path, with_bos_template=True, gen=True, **config):
    backend = _backend(with_bos_template)
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    n = backend.get_vocab_size(with_added_tokens=True)
    decoder = {str(backend.token_to_id(t)): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                             "rstrip": False, "single_word": False} for t in SPECIALS}
    decoder[str(n)] = {"content": PYTHON_TAG, "special": True, "normalized": False}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[3],
           "added_tokens_decoder": decoder, "model_max_length": 131072} | config
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if gen:
        eos = [backend.token_to_id(t) for t in (SPECIALS[1], SPECIALS[2], SPECIALS[3])]
        (path / "generation_config.json").write_text(json.dumps({"bos_token_id": backend.token_to_id(SPECIALS[0]),
                                                                 "eos_token_id": eos}))
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _folder(tmp_path_factory.mktemp("tok") / "llama")


@pytest.fixture(scope="module")
def tok(llama_dir) -> HFTokenizer:
    return tokenizer_for_model(llama_dir)


def test_a_non_gptj_tokenizer_json_gets_its_ids_from_the_configs(tok, llama_dir):
    b = Backend.from_file(str(llama_dir / "tokenizer.json"))
    ids = {t: b.token_to_id(t) for t in SPECIALS}
    assert type(tok) is HFTokenizer and isinstance(tok, Tokenizer)
    assert tok.vocab_size == b.get_vocab_size(with_added_tokens=True) + 1  # + PYTHON_TAG from the config
    assert tok.bos_token_id == ids["<|begin_of_text|>"]
    assert tok.eos_token_id == ids["<|eot_id|>"]  # tokenizer_config.json's eos_token
    assert tok.eos_token_ids == (ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"])  # generation_config
    assert tok.pad_token_id == tok.eos_token_id
    assert tok.encode(PYTHON_TAG, add_special_tokens=False) == [tok.vocab_size - 1]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_with_one_bos(tok, text):
    bos = tok.bos_token_id
    plain = tok.encode(text, add_special_tokens=False)
    assert bos not in plain and tok.decode(plain) == text
    full = tok.encode(text)
    assert full == [bos, *plain]  # the post-processor's BOS, once
    assert tok.decode(full, skip_special_tokens=True) == text
    assert tok.decode(full) == SPECIALS[0] + text
    assert tok.encode_batch([text, text]) == [full, full]
    assert tok.encode_batch([text], add_special_tokens=False) == [plain]


@pytest.mark.parametrize("with_template, config, bos_first", [
    (True, {"add_bos_token": True}, True),  # post-processor and flag both: one BOS
    (True, {"add_bos_token": False}, True),  # transformers 5 drops the flags where there is a tokenizer.json
    (False, {"add_bos_token": True, "add_eos_token": True}, False),  # no post-processor: nothing added
    (False, {}, False),
])
def test_bos_is_the_post_processors_and_never_twice(tmp_path, with_template, config, bos_first):
    tok = load_tokenizer(_folder(tmp_path / "t", with_template, **config))
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("Hello world") == ([tok.bos_token_id] if bos_first else []) + plain
    written = tok.encode(SPECIALS[0] + "Hello world")  # a BOS written in the text is the text's, as in HF
    assert written == ([tok.bos_token_id] if bos_first else []) + [tok.bos_token_id, *plain]


def test_special_tokens_in_text_are_matched_and_skipped(tok):
    ids = tok.encode("Hi<|eot_id|> there" + PYTHON_TAG, add_special_tokens=False)
    assert tok.eos_token_id in ids and tok.vocab_size - 1 in ids
    assert tok.decode(ids, skip_special_tokens=True) == "Hi there"
    assert tok.decode(ids) == "Hi<|eot_id|> there" + PYTHON_TAG
    hi = tok.encode("Hi", add_special_tokens=False)
    assert tok.decode_batch([ids, [*hi, tok.bos_token_id]], skip_special_tokens=True) == ["Hi there", "Hi"]
    with pytest.raises(GptjError, match=r"^token id \d+ is outside the vocabulary"):
        tok.decode([tok.vocab_size])


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoding_never_splits_a_character(tok, text):
    """What gptj generate --stream and the server's _Choice do, token by token, gives the whole decode."""
    from gptj.serve.completions import _Choice

    ids = [*tok.encode(text), tok.eos_token_id]
    whole = tok.decode(ids, skip_special_tokens=True)
    assert whole == text
    choice, pieces = _Choice(tok, [], set(), 0), []
    for i in ids:
        before = choice.text
        choice.add(i)
        pieces.append(choice.text[len(before):])
        assert "\ufffd" not in choice.text
    choice.finish("length")
    assert choice.text == whole and "".join(pieces) == whole
    assert any(len(p.encode()) > 1 for p in pieces) or text.isascii()  # multi-byte characters came through
    shown = ""  # gptj generate --stream's rule: decode all, show what extends the shown text without U+FFFD
    for n in range(1, len(ids) + 1):
        t = tok.decode(ids[:n], skip_special_tokens=True)
        if t.startswith(shown) and not t.endswith("\ufffd"):
            shown = t
    assert shown == whole


def test_a_byte_split_over_tokens_shows_as_ufffd_until_complete(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # 4 bytes, not one merge in this small vocabulary
    assert all(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))
    assert tok.decode(ids) == "🙂"


def test_matches_transformers(llama_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    for d in (llama_dir, _folder(tmp_path / "a", False, add_bos_token=True),
              _folder(tmp_path / "b", True, add_bos_token=False, add_eos_token=True)):
        ours, hf = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(str(d))
        assert ours.eos_token_id == hf.eos_token_id and ours.bos_token_id == hf.bos_token_id
        assert ours.vocab_size == len(hf)
        for text in [*TEXTS, "a<|eot_id|>b" + PYTHON_TAG]:
            ids = ours.encode(text)
            assert ids == hf(text)["input_ids"]
            assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_gptj_stays_gptj(tmp_path):
    gptj = load_tokenizer()
    gptj.save(tmp_path / "g")
    again = load_tokenizer(tmp_path / "g")
    assert type(again) is Tokenizer and type(tokenizer_for_model(tmp_path / "g")) is Tokenizer
    assert again.eos_token_ids == (50256,) and again.bos_token_id is None and again.pad_token_id == 50256
    text = "Hello world<|endoftext|> Café 🙂"
    assert again.encode(text) == again.encode(text, add_special_tokens=False) == gptj.encode(text)
    assert again.encode(text)[:2] == [15496, 995]
    # the same tokenizer.json with a config naming another EOS is not GPT-J's
    cfg = json.loads((tmp_path / "g" / "tokenizer_config.json").read_text()) | {"eos_token": "<|extratoken_1|>"}
    (tmp_path / "g" / "tokenizer_config.json").write_text(json.dumps(cfg))
    other = load_tokenizer(tmp_path / "g")
    assert type(other) is HFTokenizer and other.eos_token_id == 50257 and other.encode(text) == gptj.encode(text)


def _one_line_error(path, match):
    with pytest.raises(GptjError, match=match) as e:
        load_tokenizer(path)
    assert "\n" not in str(e.value)


def _edit(path, name, change):
    f = path / name
    f.write_text(json.dumps(change(json.loads(f.read_text()))))


@pytest.mark.parametrize("name, change, match", [
    ("tokenizer.json", None, r"^cannot load tokenizer from .*: "),
    ("tokenizer_config.json", None, r"tokenizer_config\.json: not readable JSON"),
    ("generation_config.json", None, r"generation_config\.json: not readable JSON"),
    ("tokenizer_config.json", lambda c: c | {"eos_token": "<|nope|>"}, r"eos_token '<\|nope\|>' is not in the"),
    ("tokenizer_config.json", lambda c: c | {"bos_token": 7}, r"bos_token must be a token string"),
    ("generation_config.json", lambda c: c | {"eos_token_id": [1, 10**6]}, r"eos_token_id must be a token id"),
    ("generation_config.json", lambda c: c | {"eos_token_id": "2"}, r"eos_token_id must be a token id"),
    ("tokenizer_config.json", lambda c: c | {"added_tokens_decoder": {"3": {"content": "<|eot_id|>"}}},
     r"added_tokens_decoder puts '<\|eot_id\|>' at id 3, the tokenizer at \d+"),
    ("tokenizer_config.json", lambda c: c | {"added_tokens_decoder": {"x": {}}}, r"entry 'x' is not id: token"),
    ("tokenizer_config.json", lambda c: {k: v for k, v in c.items() if k != "eos_token"}, None),  # gen's EOS used
])
def test_malformed_files_fail_in_one_line(tmp_path, name, change, match):
    d = _folder(tmp_path / "t")
    if change is None:
        (d / name).write_text((d / name).read_text()[:-5])  # cut short
    else:
        _edit(d, name, change)
    if match is None:
        assert load_tokenizer(d).eos_token_id == load_tokenizer(d).eos_token_ids[0]
        (d / "generation_config.json").unlink()
        match = r"no EOS token"
    _one_line_error(d, match)


def test_a_missing_tokenizer_fails_in_one_line(tmp_path):
    _one_line_error(tmp_path / "absent", r"^tokenizer path does not exist")
    (tmp_path / "empty").mkdir()
    _one_line_error(tmp_path / "empty", r"^no tokenizer\.json")
    assert type(tokenizer_for_model(tmp_path / "empty")) is Tokenizer  # no tokenizer.json: GPT-J's


def test_a_config_linked_out_of_the_folder_is_refused(tmp_path):
    d, other = _folder(tmp_path / "t"), _folder(tmp_path / "o")
    for name in ("tokenizer_config.json", "generation_config.json"):
        (d / name).unlink()
        (d / name).symlink_to(other / name)
        _one_line_error(d, rf"{name}: leaves the model folder")
        (d / name).unlink()
        (d / name).write_text((other / name).read_text())
    assert load_tokenizer(d).eos_token_ids == load_tokenizer(other).eos_token_ids
