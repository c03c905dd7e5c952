"""A model's chat template: the Jinja2 text in its tokenizer config that turns chat messages into
the prompt the model was trained on, rendered as HF transformers' `apply_chat_template(messages,
tokenize=False, add_generation_prompt=True)` renders it.

    template_source(tok)     the tokenizer's template (tokenizer_config.json's `chat_template`: a
                             string, or a list of {name, template} where "default" is the one used;
                             or the folder's chat_template.jinja), None where it has none
    ChatTemplate(source)     compiled once, in a sandbox; `render(messages, **special_tokens)`
    render_chat(tok, msgs)   the prompt text for `msgs` with the tokenizer's template and its named
                             special tokens (bos_token, eos_token, ...); tokenize it with
                             add_special_tokens=False: the template writes the BOS itself

The environment is the one a template is written for: Jinja2's ImmutableSandboxedEnvironment (a
template cannot reach Python's internals, nor change the data it is given), trim_blocks and
lstrip_blocks, the loop controls (break, continue), `{% generation %}` blocks (rendered as their
body), `raise_exception(message)`, `strftime_now(format)`, a `tojson` filter that writes JSON as
json.dumps does (no HTML escaping; indent, separators, sort_keys), and `namespace` / `dict` that refuse
underscore names. The template sees `messages` (each a dict, keys whose value is null left out),
`tools` and `documents` (None), `add_generation_prompt` and the special tokens.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from gptj.errors import GptjError

# The named special tokens a template may read (HF's SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DEFAULT_NAME = "default"  # of a list of named templates, the one used


class ChatTemplateError(GptjError):
    """A template that does not compile, or that refused the messages (`raise_exception`)."""


class _Refusal(jinja2.exceptions.TemplateError):
    """What `raise_exception(message)` raises in a template."""


def _raise_exception(message: object) -> None:
    raise _Refusal(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template may not use the name {name!r} (it starts with '_')")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _DictMaker:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without handing it the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


class _Generation(jinja2.ext.Extension):
    """`{% generation %} ... {% endgeneration %}` (HF's marker of the assistant's tokens): its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=_DictMaker())
    return env


def _reads_content_parts(ast: jinja2.nodes.Template) -> bool:
    """Whether the template loops over a message's content (`for part in message['content']`): it
    takes OpenAI's list of parts as it is; a template that does not is given their text as one string."""
    for loop in ast.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
            node = node.node
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
            return True
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
                and node.arg.value == "content":
            return True
    return False


class ChatTemplate:
    """One compiled template (ChatTemplateError where its source is not valid Jinja)."""

    def __init__(self, source: str) -> None:
        env = _environment()
        try:
            ast = env.parse(source)
            self._template = env.from_string(ast)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
        self.takes_parts = _reads_content_parts(ast)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt for `messages` (dicts of role, content, ...; content a string or a list of
        {"type": "text", "text": ...} parts). ChatTemplateError with the template's own message where it
        refuses them (raise_exception) or fails on them."""
        chat = [self._message(m) for m in messages]
        try:
            return self._template.render(**variables, messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"the chat template did something its sandbox forbids: {e}") from None
        except _Refusal as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError, AttributeError,
                ArithmeticError) as e:
            raise ChatTemplateError(f"the chat template failed on the messages: {type(e).__name__}: {e}") from None

    def _message(self, message: dict) -> dict:
        out = {k: v for k, v in message.items() if v is not None}
        content = out.get("content")
        if isinstance(content, list) and not self.takes_parts:
            out["content"] = "\n".join(part["text"] for part in content if part.get("type") == "text")
        return out


@functools.lru_cache(maxsize=16)
def compiled(source: str) -> ChatTemplate:
    """`ChatTemplate(source)`, compiled once per distinct source."""
    return ChatTemplate(source)


def template_source(tok: object) -> str | None:
    """The tokenizer's chat template (its `chat_template`: a string, a list of {"name", "template"}
    objects or a name -> template mapping, whose "default" is used); None where it has none.
    ChatTemplateError where named templates have no "default"."""
    value = getattr(tok, "chat_template", None)
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        try:
            value = {entry["name"]: entry["template"] for entry in value}
        except (TypeError, KeyError):
            raise ChatTemplateError('the tokenizer config\'s chat_template list must hold {"name", "template"} '
                                    'objects') from None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ChatTemplateError("the tokenizer config's chat_template must be a string or named templates")
    if DEFAULT_NAME not in value:
        raise ChatTemplateError(f"the tokenizer config has named chat templates ({', '.join(sorted(value))}) "
                                f"but none named {DEFAULT_NAME!r}")
    return value[DEFAULT_NAME]


def special_tokens(tok: object) -> dict[str, str]:
    """The named special tokens of the tokenizer's config (a string, or an AddedToken object's content)."""
    config = getattr(tok, "config", None) or {}
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def render_chat(tok: object, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` with the tokenizer's chat template (ChatTemplateError where it
    has none, or where the template refuses them)."""
    source = template_source(tok)
    if source is None:
        raise ChatTemplateError("the model has no chat template")
    return compiled(source).render(messages, add_generation_prompt, **special_tokens(tok))
