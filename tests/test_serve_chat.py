"""POST /v1/chat/completions (issue 59): chat templates rendered as HF transformers' apply_chat_template
renders them (gptj.chat_template, in a sandbox), the reply generated greedily from the rendered prompt's
ids and ended at any of the model's end-of-turn tokens, chat.completion objects and chunk streams, the
official openai client, and the 400s. A tiny Llama (gptj init --preset llama-tiny) with a small
Llama-3-shaped tokenizer (tests/test_tokenizer_hf.py's) and a Llama-3-style template of this file's own."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.parse
import urllib.request

import openai
import pytest
from tokenizers import AddedToken

from gptj.chat_template import ChatTemplateError, compiled, render_chat
from gptj.cli import main
from gptj.decode import GenerationConfig, generate
from gptj.tokenizer import load_tokenizer
from gptj.weights.io import load_model
from serve_util import server_thread
from test_serve import call, metric
from test_tokenizer_hf import SPECIALS, _backend

transformers = pytest.importorskip("transformers")

BOS, END_OF_TEXT, EOM, EOT = SPECIALS
HEADERS = ["<|start_header_id|>", "<|end_header_id|>"]
VOCAB = 512  # llama-tiny's: the tokenizer is filled up to it with reserved tokens, as Llama 3's is

# Llama 3.1's shape: BOS, a header per message (a tool's is ipython), the content trimmed, <|eot_id|>
# after each; the assistant's header to answer; a refusal the template raises itself. Its block tags
# stand on lines of their own, indented: trim_blocks and lstrip_blocks take those lines out.
LLAMA_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{% if messages[0]['role'] == 'assistant' %}\n"
    "    {{- raise_exception('a conversation cannot start with the assistant') }}\n"
    "{% endif %}\n"
    "{% for message in messages %}\n"
    "    {% if message['role'] == 'tool' %}\n"
    "        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' -}}\n"
    "    {% else %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}\n"
    "    {% endif %}\n"
    "    {{- message['content'] | trim + '<|eot_id|>' -}}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "{% endif %}\n")
# One that takes OpenAI's content parts as they are (it loops over them).
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ '[' + m.role + ']' }}\n"
    "  {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for part in m.content %}{% if part.type == 'text' %}<{{ part.text }}>{% endif %}{% endfor %}{% endif %}\n"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
# What else a template may use: a namespace, loop controls, tojson (with its options), generation
# blocks, strftime_now, the tools / documents variables, other special tokens.
FEATURES_TEMPLATE = (
    "{%- set ns = namespace(system='', n=0) -%}\n"
    "{%- for m in messages -%}\n"
    "  {%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}{%- endif -%}\n"
    "  {%- if ns.n >= 3 %}{% break %}{% endif -%}\n"
    "  {%- set ns.n = ns.n + 1 -%}\n"
    "  {{ m | tojson }}\n"
    "  {% generation %}{{ m.role | upper }}{% if m.name is defined %} ({{ m.name }}){% endif %}{% endgeneration %}\n"
    "{% endfor -%}\n"
    "{{ {'system': ns.system, 'tools': tools, 'docs': documents, 'y': strftime_now('%Y') | length} "
    "| tojson(indent=2, sort_keys=True) }}\n"
    "{% if add_generation_prompt %}{{ bos_token }}|{{ eos_token }}|{{ pad_token }}{% endif %}")

MESSAGES = {
    "one": [{"role": "user", "content": "Hello there"}],
    "turns": [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? Café 日本 🙂"}],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Two."}]}],
    "tool": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "calling"},
             {"role": "tool", "content": '{"t": 20}', "tool_call_id": "call_1", "name": "weather"},
             {"role": "user", "content": "and <|eot_id|> tomorrow?"}],
}


def tokenizer_folder(path, template, jinja_file=False):
    """tests/test_tokenizer_hf.py's Llama-3-shaped tokenizer with the header tokens and reserved tokens
    up to VOCAB, the chat template in tokenizer_config.json (or chat_template.jinja), and Llama 3.1
    Instruct's three EOS ids in generation_config.json."""
    backend = _backend(True)
    have = backend.get_vocab_size(with_added_tokens=True) + len(HEADERS)
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(VOCAB - have)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HEADERS + reserved])
    assert backend.get_vocab_size(with_added_tokens=True) == VOCAB
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT,
           "pad_token": {"__type": "AddedToken", "content": END_OF_TEXT, "special": True}}
    cfg["chat_template"] = LLAMA_TEMPLATE if jinja_file else template  # the file, where there is one, wins
    if jinja_file:
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ids = [backend.token_to_id(t) for t in (END_OF_TEXT, EOM, EOT)]
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": backend.token_to_id(BOS),
                                                             "eos_token_id": ids}))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-models")
    assert main(["init", "--preset", "llama-tiny", "--out", str(root / "llama")]) == 0
    tokenizer_folder(root / "llama", LLAMA_TEMPLATE)
    assert main(["init", "--preset", "tiny", "--out", str(root / "gptj")]) == 0
    return root


@pytest.fixture(scope="module")
def server(models):
    with server_thread({"llama": models / "llama", "gptj": models / "gptj"}, max_batch_size=4, max_queue=4) as t:
        yield t


@pytest.fixture(scope="module")
def tok(models):
    return load_tokenizer(models / "llama")


@pytest.fixture(scope="module")
def reference(models, tok):
    """The eager model's greedy tokens for a rendered prompt (gptj.decode, not the engine), up to and
    including the first of the EOS ids."""
    model = load_model(models / "llama")

    def greedy(messages, max_tokens):
        ids = tok.encode(render_chat(tok, messages), add_special_tokens=False)
        gen = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=tok.eos_token_id, pad_token_id=0)
        out = generate(model, [ids], gen)[0]
        end = next((i for i, t in enumerate(out) if t in tok.eos_token_ids), None)
        return ids, out if end is None else out[:end + 1]
    return greedy


def chat(url, **body):
    return call(url, path="/v1/chat/completions", body={"model": "llama", **body})


def text_of(tok, ids):
    return tok.decode([t for t in ids if t not in tok.eos_token_ids], skip_special_tokens=True)


# --- rendering ---

def _hf_view(messages, takes_parts):
    """What HF is given for the same chat: content parts as they are where the template loops over
    them, else their text joined by newlines (as gptj gives a template that reads a string)."""
    if takes_parts:
        return messages
    return [m | {"content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m
            for m in messages]


@pytest.mark.parametrize("template,form", [
    (LLAMA_TEMPLATE, "config"), (PARTS_TEMPLATE, "config"), (FEATURES_TEMPLATE, "config"),
    (PARTS_TEMPLATE, "jinja"), ([{"name": "tool_use", "template": PARTS_TEMPLATE},
                                 {"name": "default", "template": FEATURES_TEMPLATE}], "named")],
    ids=["llama", "parts", "features", "jinja-file", "named"])
def test_rendering_equals_transformers_apply_chat_template(tmp_path, template, form):
    folder = tokenizer_folder(tmp_path / "t", template, jinja_file=form == "jinja")
    ours, hf = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    source = template if isinstance(template, str) else template[1]["template"]
    for name, messages in MESSAGES.items():
        view = _hf_view(messages, compiled(source).takes_parts)
        want = hf.apply_chat_template(view, tokenize=False, add_generation_prompt=True)
        got = render_chat(ours, messages)
        assert got == want, name
        assert ours.encode(got, add_special_tokens=False) == hf.apply_chat_template(
            view, tokenize=True, add_generation_prompt=True, return_dict=False), name
    assert compiled(PARTS_TEMPLATE).takes_parts and not compiled(LLAMA_TEMPLATE).takes_parts


def test_the_llama_prompt_has_one_bos_and_the_assistants_header(tok):
    text = render_chat(tok, MESSAGES["turns"])
    assert text.startswith(BOS) and text.count(BOS) == 1
    assert text.endswith("4<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd 3+3? Café 日本 🙂<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>" in text  # trimmed
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.encode(text)[:2] == [tok.bos_token_id] * 2  # what encoding it with special tokens would do


@pytest.mark.parametrize("source,match", [
    ("{{ ''.__class__.__mro__ }}", "sandbox forbids"),
    ("{% set x = messages.append(1) %}", "sandbox forbids"),
    ("{% set ns = namespace() %}{% set ns._secret = 1 %}", "sandbox forbids"),
    ("{{ raise_exception('roles must alternate') }}", "refused the messages: roles must alternate"),
    ("{{ messages[5]['content'] }}", "failed on the messages"),
])
def test_templates_run_sandboxed_and_their_refusals_are_one_line(source, match):
    with pytest.raises(ChatTemplateError, match=match) as e:
        compiled(source).render(MESSAGES["one"])
    assert "\n" not in str(e.value)


def test_a_template_that_is_not_jinja_is_refused():
    with pytest.raises(ChatTemplateError, match=r"not valid Jinja \(line 1"):
        compiled("{% for m in messages %}")


# --- the endpoint ---

def test_reply_equals_the_engines_greedy_tokens_plain_and_streamed(server, tok, reference):
    messages = MESSAGES["turns"]
    ids, want = reference(messages, 8)
    status, body, headers = chat(server.url, messages=messages, max_tokens=8, temperature=0)
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": text_of(tok, want)}
    assert choice["finish_reason"] == ("stop" if want[-1] in tok.eos_token_ids else "length")
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want),
                             "total_tokens": len(ids) + len(want)}

    events = _sse(server.url, messages=messages, max_completion_tokens=8, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    first, *middle, last, usage = chunks
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert all(c["choices"][0]["finish_reason"] is None and set(c["choices"][0]["delta"]) == {"content"}
               for c in middle) and len(middle) > 1  # streamed as it came
    assert last["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == choice["message"]["content"]
    assert usage["choices"] == [] and usage["usage"] == body["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


def _sse(url, **body):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({"model": "llama", **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = r.read().decode().split("\n\n")
    return [line.removeprefix("data: ") for line in lines if line]


@pytest.mark.parametrize("end", [EOT, END_OF_TEXT, EOM])
def test_the_reply_ends_at_any_end_of_turn_token_which_it_leaves_out(server, tok, end):
    """A bias makes `end` the likeliest token; min_tokens holds the tokenizer's EOS (<|eot_id|>) back for
    3 tokens: <|eot_id|> then ends the 4th; generation_config.json's other EOS ids end the reply at once."""
    end_id = tok.encode(end, add_special_tokens=False)[0]
    status, body, _ = chat(server.url, messages=MESSAGES["one"], max_tokens=10, temperature=0,
                           logit_bias={str(end_id): 100}, min_tokens=3 if end == EOT else 0)
    assert status == 200, body
    (choice,) = body["choices"]
    n = 4 if end == EOT else 1
    assert choice["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == n
    assert end not in choice["message"]["content"] and (choice["message"]["content"] == "") == (n == 1)
    events = _sse(server.url, messages=MESSAGES["one"], max_tokens=10, temperature=0, logit_bias={str(end_id): 100},
                  min_tokens=3 if end == EOT else 0, stream=True)
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_openai_client_plain_streamed_and_with_logprobs(server, tok, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = MESSAGES["parts"]
    ids, want = reference(messages, 6)
    plain = client.chat.completions.create(model="llama", messages=messages, max_completion_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == text_of(tok, want)
    content = plain.choices[0].logprobs.content
    assert len(content) == len([t for t in want if t not in tok.eos_token_ids])
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert [c.token for c in content] == [tok.decode([t]) for t in want if t not in tok.eos_token_ids]
    assert plain.usage.prompt_tokens == len(ids) and plain.usage.completion_tokens == len(want)

    stream = client.chat.completions.create(model="llama", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(want)

    two = client.chat.completions.create(model="llama", messages=messages, max_tokens=4, n=2, temperature=0.9,
                                         seed=5)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens <= 8


def test_metrics_count_chat_requests(server):
    before = [metric(server.url, name, absent=0.0, model="llama")
              for name in ("gptj_prompt_tokens_total", "gptj_generation_tokens_total")]
    ok = metric(server.url, "gptj_requests_total", absent=0.0, model="llama", status="200")
    status, body, _ = chat(server.url, messages=MESSAGES["one"], max_tokens=3, temperature=0)
    assert status == 200
    after = [metric(server.url, name, model="llama")
             for name in ("gptj_prompt_tokens_total", "gptj_generation_tokens_total")]
    assert [a - b for a, b in zip(after, before)] == [body["usage"]["prompt_tokens"],
                                                      body["usage"]["completion_tokens"]]
    assert metric(server.url, "gptj_requests_total", model="llama", status="200") == ok + 1


def test_a_full_model_answers_429_and_a_dropped_stream_is_cancelled(server, tok):
    served = server.state.models["llama"]
    while metric(server.url, "gptj_outstanding_requests", model="llama") != 0:  # the last test's, released
        time.sleep(0.01)
    assert served.admit(served.capacity)  # every place taken (no request runs now)
    try:
        status, body, headers = chat(server.url, messages=MESSAGES["one"], max_tokens=2)
    finally:
        served.release(served.capacity)
    assert status == 429 and body["error"]["code"] == "queue_full" and int(headers["Retry-After"]) >= 1

    steps_before, max_tokens = served.engine.steps, 1500
    never_end = {str(t): -100 for t in tok.eos_token_ids}
    parsed = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "llama", "messages": MESSAGES["one"], "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "logit_bias": never_end}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    for _ in range(3):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    conn.sock.shutdown(2)
    conn.close()
    while metric(server.url, "gptj_outstanding_requests", model="llama") != 0:
        time.sleep(0.01)
    assert served.engine.steps - steps_before < max_tokens // 3  # cancelled, not run out
    while metric(server.url, "gptj_requests_total", model="llama", status="499", absent=0.0) < 1:
        time.sleep(0.01)


BAD = [
    (dict(model="gptj"), "no_chat_template", r"^model 'gptj' has no chat template"),
    (dict(messages=[]), None, "messages must not be empty"),
    (dict(messages=[{"role": "robot", "content": "x"}]), None, r"messages\[0\]\.role: Input should be"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), None,
     r"messages\[0\]\.content\[0\]: content parts of type 'image_url' are not supported"),
    (dict(messages=[{"role": "user", "content": [{"type": "text"}]}]), None, r"content\[0\]\.text: field required"),
    (dict(messages=[{"role": "user", "content": 5}]), None,
     r'^messages\[0\]\.content: expected a string or a list of \{"type": "text"'),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]), None, "unknown field"),
    (dict(messages=[{"role": "assistant", "content": "x"}]), None, "cannot start with the assistant"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), None, "tools .function calling. is not supported"),
    (dict(tool_choice="auto"), None, "tool_choice is not supported"),
    (dict(response_format={"type": "json_object"}), None, "response_format 'json_object' is not supported"),
    (dict(top_logprobs=2), None, "top_logprobs needs logprobs"),
    (dict(max_completion_tokens=4096), "context_length_exceeded", "max_completion_tokens 4096 leaves no room"),
    (dict(messages=[{"role": "user", "content": "word " * 1000}], max_tokens=1500), "context_length_exceeded",
     r"the messages make \d+ tokens and max_tokens is 1500; shorten the messages or lower max_tokens"),
    (dict(n=9), None, "needs 9 engine requests"),
    (dict(temperature="hot"), None, "temperature: expected a number"),
    (dict(presence_penalty=3.0), None, "presence_penalty must be from -2 to 2"),
]


@pytest.mark.parametrize("change,code,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_are_400_with_one_line(server, change, code, match):
    body = {"model": "llama", "messages": MESSAGES["one"], "max_tokens": 2} | change
    status, out, _ = call(server.url, path="/v1/chat/completions", body=body)
    assert status == 400, out
    message = out["error"]["message"]
    assert re.search(match, message) and "\n" not in message, message
    assert out["error"]["code"] == code


CONTENT_EXPECTED = 'messages[1].content: expected a string or a list of {"type": "text", "text": ...} parts'


@pytest.mark.parametrize("content,message", [
    (5, CONTENT_EXPECTED), (None, CONTENT_EXPECTED), ([5], CONTENT_EXPECTED), ([{"type": 5}], CONTENT_EXPECTED),
    ({"text": "x"}, CONTENT_EXPECTED),
    ("x" * 1_000_001, "messages[1].content: String should have at most 1000000 characters"),
    ([{"type": "text", "text": 7}], CONTENT_EXPECTED),
])
def test_a_bad_content_is_named_as_written_before_any_model_is_looked_up(content, message):
    from fastapi.testclient import TestClient

    from gptj.serve import ServerConfig
    from gptj.serve.app import create_app

    r = TestClient(create_app(ServerConfig())).post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": content}]})
    err = r.json()["error"]
    assert (r.status_code, err["message"], err["param"]) == (400, message, "messages[1].content")


def test_unknown_fields_are_ignored_and_named(server):
    status, body, headers = chat(server.url, messages=MESSAGES["one"], max_tokens=2, store=False, metadata={"a": "b"},
                                 response_format={"type": "text"}, tool_choice="none")
    assert status == 200, body
    assert headers["X-Gptj-Ignored-Fields"] == "store,metadata"
