"""Render the model's chat template and find the safe cut positions of the resulting tokens.

Step 3 of a request ("render and tokenize"): OpenAI-shaped messages go through the model's own
Jinja chat template (GGUF ``tokenizer.chat_template``; ChatML when the file has none), the text
is tokenized with ``proxy.tokenizer``, and the result carries the *boundaries* the cache may cut
at.

Rules:
- Templates are untrusted code from model files. They run in Jinja's
  ``ImmutableSandboxedEnvironment`` (no attribute escapes such as ``__class__``, no mutation of
  the messages; an unsafe access raises ``jinja2.sandbox.SecurityError``), with what Hugging
  Face templates expect: ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a
  no-op ``{% generation %}`` block, ``raise_exception``, ``strftime_now``,
  ``bos_token``/``eos_token`` and a ``tojson`` filter with HF's semantics (``ensure_ascii=False``,
  optional ``indent``, no HTML escaping). The template is compiled once.
- Where message i starts: render ``messages[:i]`` without a generation prompt; when that text is
  a prefix of the full rendering, its length is the start. Otherwise (templates that re-render
  history depending on later turns) the position is skipped. The same for ``messages[:n]``
  gives where the generation prompt starts: n + 2 renders for a new conversation. A start found
  once is remembered per template, keyed on (tools, messages[:i]) and re-checked against the new
  text by hashing the text since the previous start, so a conversation re-sent with one more
  turn renders only the new prefixes.
- A role header ends where the message's content begins in the rendered text, when found there.
- Character offsets become token positions through the per-segment tokenization: an offset at a
  special token's edge maps exactly, one inside text aligns down to the last token that ends at
  or before it. ``len(ids)`` is always a boundary.
- When the model adds a BOS token and the text does not already start with it, ``ids`` starts
  with BOS and every position counts it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import Undefined, meta, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["CHATML_TEMPLATE", "CannotContinue", "ChatTemplate", "Rendered", "load_template",
           "render_prompt"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# located message starts remembered across requests (two ints each)
_PREFIX_CACHE_ENTRIES = 65536
# how much of a message's content is searched for to find where its role header ends
_CONTENT_NEEDLE_CHARS = 64


@dataclass(frozen=True, slots=True)
class Rendered:
    text: str  # the template's output
    ids: tuple[int, ...]  # the prompt's token ids, BOS included when the model adds one
    # sorted token positions safe to cut at: message starts, role header ends where detectable,
    # the generation prompt's start, and len(ids)
    boundaries: tuple[int, ...]
    message_starts: tuple[tuple[int, str], ...]  # (token position, role) per located message


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's filter: plain json.dumps, not Jinja's HTML-escaping one
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, failing loudly: an unsafe attribute raises ``SecurityError``
    at once instead of rendering as an empty undefined value."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        body: list[nodes.Node] = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return body


class _PrefixCache:
    """Chain key of (tools, messages[:i]) -> (prefix length, hash of the text since the previous
    located start). In-process only (Python's salted ``hash``); bounded LRU; thread-safe."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: int) -> tuple[int, int] | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: int, value: tuple[int, int]) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)


class ChatTemplate:
    """A model's chat template, compiled once in a sandbox."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        if not source.strip():
            log.warning("the model file has no chat template; using ChatML")
            source = CHATML_TEMPLATE
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _Sandbox(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)
        self.supports_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
        self.prefixes = _PrefixCache(_PREFIX_CACHE_ENTRIES)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text for ``messages``; raises ``jinja2.TemplateError`` subclasses."""
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


def load_template(metadata: dict[str, Any]) -> ChatTemplate:
    """The GGUF's chat template (``tokenizer.chat_template``), or ChatML when it has none."""
    source = metadata.get("tokenizer.chat_template") or ""  # empty: ChatML, see ChatTemplate
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []

    def token_text(key: str) -> str:
        token_id = metadata.get(key)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else ""

    return ChatTemplate(
        source,
        token_text("tokenizer.ggml.bos_token_id"),
        token_text("tokenizer.ggml.eos_token_id"),
    )


def render_prompt(
    template: ChatTemplate,
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    continue_final: bool = False,
) -> Rendered:
    """Render ``messages`` (and ``tools``), tokenize, and locate the safe boundaries.
    With ``continue_final`` the prompt ends right after the final (assistant) message's
    content, so the model continues it; a template that does not render that content verbatim
    raises ``CannotContinue``."""
    if continue_final:
        text = _open_final_message(template.render(messages, tools, add_generation_prompt=False),
                                   str(messages[-1].get("content") or ""))
    else:
        text = template.render(messages, tools, add_generation_prompt=True)
    starts = _message_char_starts(template, messages, tools, text)  # index -> char offset
    header_ends = _header_char_ends(messages, starts, text)

    offsets = sorted({*starts.values(), *header_ends})
    segments = tok.encode_segments(text)
    ids = [i for segment in segments for i in segment.ids]
    token_at = dict(zip(offsets, tok.token_positions(text, segments, offsets), strict=True))

    shift = 0
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids.insert(0, tok.bos_id)
        shift = 1
    boundaries = sorted({token_at[o] + shift for o in offsets} | {len(ids)})
    message_starts = tuple(
        (token_at[starts[i]] + shift, str(messages[i].get("role", "")))
        for i in sorted(starts)
        if i < len(messages)
    )
    return Rendered(text, tuple(ids), tuple(boundaries), message_starts)


class CannotContinue(ValueError):
    """The template does not render the final message's content verbatim."""


def _open_final_message(text: str, content: str) -> str:
    """``text`` cut right after the final message's content (what follows it is the template's
    end of turn)."""
    body = content.strip()
    at = text.rfind(body) if body else -1
    if at < 0:
        raise CannotContinue("the chat template does not render the final assistant message "
                             "verbatim, so it cannot be continued")
    return text[: at + len(body)]


def _message_char_starts(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
) -> dict[int, int]:
    """Message index (len(messages): the generation prompt) -> char offset where it starts.

    A prefix already located in an earlier request (same tools, same messages[:i]) is taken
    from the template's prefix cache when the text between it and the previous start hashes
    as it did then; only the others are rendered.
    """
    starts: dict[int, int] = {}
    last = 0
    key = hash(("tools", _fingerprint(tools)))
    for i in range(len(messages) + 1):
        if i:
            key = hash((key, _fingerprint(messages[i - 1])))
        hit = template.prefixes.get(key)
        if hit is not None and hit[0] >= last and hash(text[last : hit[0]]) == hit[1]:
            starts[i] = last = hit[0]
            continue
        try:
            prefix = template.render(messages[:i], tools, add_generation_prompt=False)
        except Exception as exc:  # a template may refuse a partial conversation
            log.debug("template refused the first %d messages: %s", i, exc)
            continue
        if len(prefix) >= last and text.startswith(prefix):
            template.prefixes.put(key, (len(prefix), hash(text[last : len(prefix)])))
            starts[i] = last = len(prefix)
    return starts


def _fingerprint(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def _header_char_ends(
    messages: Sequence[dict[str, Any]], starts: dict[int, int], text: str
) -> list[int]:
    """Char offsets where a located message's content begins after its role header."""
    ends = []
    located = sorted(starts)
    for k, i in enumerate(located[:-1] if located and located[-1] == len(messages) else located):
        content = messages[i].get("content")
        if not isinstance(content, str) or not content.strip():
            continue
        begin = starts[i]
        end = starts[located[k + 1]] if k + 1 < len(located) else len(text)
        for needle in (content[:_CONTENT_NEEDLE_CHARS], content.lstrip()[:_CONTENT_NEEDLE_CHARS]):
            at = text.find(needle, begin, end)
            if at > begin:
                ends.append(at)
                break
    return ends
