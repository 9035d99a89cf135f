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
- Where message i starts, by definition: render ``messages[:i]`` without a generation prompt;
  when that text is a prefix of the full rendering (and not shorter than the previous start),
  its length is the start. Otherwise (templates that re-render history depending on later
  turns) the position is skipped. The same for ``messages[:n]`` gives where the generation
  prompt starts. Rendering every prefix is quadratic in the messages (3,000 took 13-19 s), so
  the starts are read off one *traced* rendering instead: the messages are given to the
  template as a list and dicts equal to them that record how much text was out when the
  template reached each message. Those starts are trusted only when they are ordered and a
  sample of them (message 0, every power of two, the last two, and the first position of each
  pair of neighbouring message shapes) renders exactly as predicted; otherwise, or when tracing
  fails, every prefix is rendered as the definition says. A sample is not a proof: a template
  whose history changes with later turns at positions the sample misses could keep a start the
  definition skips. That costs at most a useless save point, never a wrong answer: a key names
  exactly the tokens before its position. A start checked by rendering is remembered
  per template, keyed on (tools, messages[:i]) and re-checked against the new text by hashing
  the text since the previous start, so a conversation re-sent with one more turn renders only
  the new prefixes.
- A role header ends where the message's content begins in the rendered text, when found there.
- Character offsets become token positions through the per-segment tokenization: an offset at a
  special token's edge maps exactly, one inside text aligns down to the last token that ends at
  or before it. ``len(ids)`` is always a boundary.
- When the model adds a BOS token and the text does not already start with it, ``ids`` starts
  with BOS and every position counts it.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
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
# at most this many pairs of neighbouring message shapes get a sampled check of their start
_SHAPE_SAMPLES = 16


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
        self.extra: dict[str, Any] = {}  # the request's template variables (bound())

    def bound(self, extra: dict[str, Any]) -> ChatTemplate:
        """This template with the request's own variables (`enable_thinking`,
        `reasoning_effort`, any `chat_template_kwargs`); the prefix cache is shared, keyed on
        them too."""
        if not extra:
            return self
        view = copy.copy(self)
        view.extra = dict(extra)
        return view

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text for ``messages``; raises ``jinja2.TemplateError`` subclasses."""
        return self._template.render(self._context(messages, tools, add_generation_prompt))

    def generate(
        self, messages: list[Any], tools: list[dict[str, Any]] | None = None
    ) -> Iterator[str]:
        """The text of ``render(messages, tools, add_generation_prompt=False)`` in the pieces the
        template writes it in, each produced when the consumer asks for it."""
        return self._template.generate(self._context(messages, tools, False))

    def _context(
        self, messages: list[Any], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> dict[str, Any]:
        return {
            **self.extra,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }


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
    """Message index (len(messages): the generation prompt) -> char offset where it starts:
    the traced starts when a sample checks out, else every prefix rendered (module docstring).
    """
    keys = _chain_keys(messages, tools, template.extra)
    for candidate in _traced_starts(template, messages, tools, text):
        starts = _checked(template, messages, tools, text, keys, candidate)
        if starts is not None:
            return starts
    return _rendered_starts(template, messages, tools, text, keys)


def _rendered_starts(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    keys: Sequence[int],
) -> dict[int, int]:
    """The definition: every prefix rendered, but one located in an earlier request (same
    tools, same messages[:i]) is taken from the template's prefix cache when the text between
    it and the previous start hashes as it did then."""
    starts: dict[int, int] = {}
    last = 0
    for i in range(len(messages) + 1):
        hit = template.prefixes.get(keys[i])
        if hit is not None and hit[0] >= last and hash(text[last : hit[0]]) == hit[1]:
            starts[i] = last = hit[0]
            continue
        start = _render_start(template, messages, tools, text, i)
        if start is not None and start >= last:
            template.prefixes.put(keys[i], (start, hash(text[last:start])))
            starts[i] = last = start
    return starts


def _render_start(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    i: int,
) -> int | None:
    """The length of ``messages[:i]`` rendered, when that rendering is a prefix of ``text``."""
    try:
        prefix = template.render(messages[:i], tools, add_generation_prompt=False)
    except Exception as exc:  # a template may refuse a partial conversation
        log.debug("template refused the first %d messages: %s", i, exc)
        return None
    return len(prefix) if text.startswith(prefix) else None


def _chain_keys(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                extra: dict[str, Any] | None = None) -> list[int]:
    """The prefix cache's key of (tools, variables, messages[:i]) for every i in
    0..len(messages)."""
    keys = [hash(("tools", _fingerprint(tools), _fingerprint(extra or {})))]
    for message in messages:
        keys.append(hash((keys[-1], _fingerprint(message))))
    return keys


class _Trace:
    """How much text a traced rendering had written when it pulled each message from a loop
    over the messages (the last pull counts), and when it first read the message after that."""

    __slots__ = ("at", "pulled", "read")

    def __init__(self, n_messages: int) -> None:
        self.at = 0  # characters written so far
        self.pulled: list[int | None] = [None] * n_messages
        self.read: list[int | None] = [None] * n_messages


class _TracedList(list):  # type: ignore[type-arg]
    """The messages as a traced rendering sees them: iterating records a pull of each message;
    a slice (``messages[1:]``) is traced too. The template cannot reach the trace (the sandbox
    refuses names starting with ``_``)."""

    def __init__(self, items: list[Any], trace: _Trace, indices: range) -> None:
        super().__init__(items)
        self._trace = trace
        self._indices = indices

    def __iter__(self) -> Iterator[Any]:
        trace = self._trace
        for i, item in zip(self._indices, list.__iter__(self), strict=True):
            trace.pulled[i], trace.read[i] = trace.at, None
            yield item

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return _TracedList(list.__getitem__(self, index), self._trace, self._indices[index])
        return list.__getitem__(self, index)


class _TracedMessage(dict):  # type: ignore[type-arg]
    """One message, equal to it; the first read of it after a pull is recorded."""

    __slots__ = ("_trace", "_i")

    def __init__(self, message: dict[str, Any], trace: _Trace, i: int) -> None:
        super().__init__(message)
        self._trace = trace
        self._i = i

    def _seen(self) -> None:
        if self._trace.read[self._i] is None:
            self._trace.read[self._i] = self._trace.at

    def __getitem__(self, key: Any) -> Any:
        self._seen()
        return dict.__getitem__(self, key)

    def __contains__(self, key: object) -> bool:
        self._seen()
        return dict.__contains__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._seen()
        return dict.get(self, key, default)

    def keys(self) -> Any:
        self._seen()
        return dict.keys(self)

    def values(self) -> Any:
        self._seen()
        return dict.values(self)

    def items(self) -> Any:
        self._seen()
        return dict.items(self)


def _traced_starts(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
) -> list[list[int | None]]:
    """Candidate starts (index len(messages): the generation prompt) from one traced rendering.

    Two readings of the trace, the likelier first: where the template first read a message
    after pulling it (a loop that asks ``loop.last`` pulls the next message early), and where
    it pulled it (a template that writes text before reading the message). A message never
    pulled has no start. Message 0's start needs no trace: rendering no messages costs nothing
    (and some templates refuse it). No candidates when the template fails on the traced
    messages.
    """
    if not all(isinstance(m, dict) for m in messages):
        return []
    trace = _Trace(len(messages))
    traced = [_TracedMessage(m, trace, i) for i, m in enumerate(messages)]
    pieces = []
    try:
        for piece in template.generate(_TracedList(traced, trace, range(len(messages))), tools):
            pieces.append(piece)
            trace.at += len(piece)
    except Exception as exc:
        log.debug("template failed on the traced messages: %s", exc)
        return []
    whole = "".join(pieces)
    end = [len(whole) if text.startswith(whole) else None]
    read = [r if r is not None and p is not None else p
            for r, p in zip(trace.read, trace.pulled, strict=True)]
    candidates = [read + end] + ([trace.pulled + end] if trace.pulled != read else [])
    if messages:
        first = _render_start(template, messages, tools, text, 0)
        for candidate in candidates:
            candidate[0] = first
    return candidates


def _checked(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    keys: Sequence[int],
    candidate: Sequence[int | None],
) -> dict[int, int] | None:
    """``candidate``'s starts when they are in order and every sampled one (:func:`_samples`)
    equals the definition's answer (a rendering, or a start the prefix cache holds); else None.
    """
    starts = {i: c for i, c in enumerate(candidate) if c is not None}
    offsets = list(starts.values())
    if offsets != sorted(offsets):
        return None
    previous = dict(zip(starts, [0, *offsets], strict=False))  # i -> the start before i's
    for i in _samples(messages):
        start = candidate[i]
        if start is not None:
            hit = template.prefixes.get(keys[i])
            if hit == (start, hash(text[previous[i] : start])):
                continue
        if _render_start(template, messages, tools, text, i) != start:
            return None
        if start is not None:
            template.prefixes.put(keys[i], (start, hash(text[previous[i] : start])))
    return starts


def _samples(messages: Sequence[dict[str, Any]]) -> list[int]:
    """The positions whose traced start is checked by rendering: 0, the powers of two (the same
    as the conversation grows, so the next turn finds them in the prefix cache), the last two,
    and the first position of each pair of neighbouring message shapes (role, content type,
    keys), up to ``_SHAPE_SAMPLES`` pairs."""
    n = len(messages)
    picks = {0, max(n - 1, 0), n}
    power = 1
    while power < n:
        picks.add(power)
        power *= 2
    shapes = [_shape(m) for m in messages]
    seen: set[tuple[Any, Any]] = set()
    for i in range(n + 1):
        pair = (shapes[i - 1] if i else None, shapes[i] if i < n else None)
        if pair not in seen and len(seen) < _SHAPE_SAMPLES:
            seen.add(pair)
            picks.add(i)
    return sorted(picks)


def _shape(message: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    return (str(message.get("role")), type(message.get("content")).__name__,
            tuple(sorted(map(str, message))))


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
