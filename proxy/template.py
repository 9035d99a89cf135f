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

import bisect
import copy
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import jinja2
from jinja2 import Undefined, meta, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from policies.plan import MessageStart
from policies.prefix import ID_BYTES, TokenIds, common_prefix_len, pack
from proxy import resume, traced
from proxy.resume import Run
from proxy.starts import (
    StartCache,
    header_char_ends,
    message_char_starts,
    recorded,
    shape_of,
)
from proxy.tokenizer import Segment, Tokenizer

log = logging.getLogger(__name__)

__all__ = ["CHATML_TEMPLATE", "CannotContinue", "ChatTemplate", "Rendered", "load_template",
           "render_prompt"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# recorded renders kept for later ones to resume, each holding its text: one per conversation
# (without the generation prompt; the render with it resumes from that one, `late_prompt`), or
# two for a template that reads the flag inside a loop
_RECENT_RENDERS = 64
# located message starts remembered across requests (two ints each)
_PREFIX_CACHE_ENTRIES = 65536


@dataclass(frozen=True, slots=True)
class Rendered:
    text: str  # the template's output
    ids: TokenIds  # the prompt's token ids, BOS included when the model adds one
    # sorted token positions safe to cut at: message starts, role header ends where detectable,
    # the generation prompt's start, and len(ids)
    boundaries: tuple[int, ...]
    message_starts: tuple[MessageStart, ...]  # (token position, role) per located message


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


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
        env.globals["strftime_now"] = resume.strftime_now
        self._template = env.from_string(source)
        ast = env.parse(source)
        self.variables = frozenset(meta.find_undeclared_variables(ast))  # what it reads
        self.supports_tools = "tools" in self.variables
        self.prefixes = StartCache(_PREFIX_CACHE_ENTRIES)
        # recent recorded renders, for later ones to resume (proxy/resume.py)
        self.runs = resume.Runs(_RECENT_RENDERS) if resume.resumable(source, ast) else None
        # the render with the generation prompt may resume from the one without (made first
        # for the message starts) at its last message: one render kept per request
        self.late_prompt = self.runs is not None and resume.reads_after_loops(
            ast, "add_generation_prompt")
        self.extra: dict[str, Any] = {}  # the request's template variables (bound())
        # tools by their objects' identity -> (the objects, kept alive; their JSON): a request
        # that re-sends the same tools (proxy/limits.py reuses them) serializes them once
        self._keys: dict[tuple[int, ...], tuple[list[Any], str]] = {}

    def bound(self, extra: dict[str, Any]) -> ChatTemplate:
        """This template with the request's own variables (`enable_thinking`,
        `reasoning_effort`, any `chat_template_kwargs`), those it reads: a variable it never
        reads changes nothing (an Anthropic request's `enable_thinking: false` on a template
        without the switch renders and resumes as any other). The prefix cache is shared,
        keyed on them too."""
        extra = {k: v for k, v in extra.items() if k in self.variables}
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

    def key_of(self, tools: list[dict[str, Any]] | None) -> tuple[Any, ...]:
        """What renders must share, besides their messages, for one to resume another: the
        tools and the variables, serialized (strictly: 1 and 1.0 differ, and key order
        counts)."""
        ids = tuple(map(id, tools or ()))
        hit = self._keys.get(ids)
        if hit is None or not all(a is b for a, b in zip(hit[0], tools or (), strict=True)):
            hit = (list(tools or ()), json.dumps(tools, ensure_ascii=False, default=repr))
            if len(self._keys) > 256:
                self._keys.clear()
            self._keys[ids] = hit
        return (hit[1], json.dumps(self.extra, ensure_ascii=False, default=repr))

    def record(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, key: tuple[Any, ...], keep: bool = True,
               source: Run | None = None) -> Run:
        """``render(messages, tools, add_generation_prompt)`` as a recorded render, resumed
        from a recent one of the same conversation where that is proven to change nothing
        (proxy/resume.py); `key`: ``key_of(tools)``. `keep`: remember it for later renders.
        The message starts are read off kept renders without the generation prompt only, so
        only those keep the offsets where each message was pulled and read. `source`: the
        render of the same messages without the generation prompt, to resume from (only
        where ``late_prompt``)."""
        assert source is None or (self.late_prompt and add_generation_prompt and not keep)
        return resume.render(self._template, self.runs, (add_generation_prompt, *key), messages,
                             self._context([], tools, add_generation_prompt), keep,
                             positions=keep and not add_generation_prompt, source=source)

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
    key = template.key_of(tools)
    plain = messages  # indexed below without the Signed wrapper's own __getitem__
    if template.runs is not None:
        messages = traced.Signed(messages)  # one signature per message for all its renders
    bare = None  # the render without the generation prompt, when it is made first
    if continue_final:
        run = bare = template.record(messages, tools, False, key)  # raises as the template does
        text = _open_final_message(run.text, str(messages[-1].get("content") or ""))
        # known to be the previous text's as far as this render resumed from the previous
        # one, which began the previous text (prompted or continued) as far as "late"
        shared = min(run.shared, run.prior.get("late", 0))
    else:
        if template.late_prompt:
            bare = recorded(template, messages, tools, key)
        full = template.record(messages, tools, True, key, keep=bare is None, source=bare)
        run, text = bare or full, full.text
        # characters known to be the previous text's: through the render without the prompt
        # (equal to this text as far as `full` resumed from it, and to the previous one's as
        # far as it resumed from that one, which began the previous text as far as "late")
        shared = full.shared if bare is None else min(
            full.shared, bare.shared, bare.prior.get("late", 0))
    prior = run.prior
    shapes = prior.get("shapes", [])[: run.common]
    shapes += [shape_of(m) for m in messages[len(shapes):]]
    run.memo["shapes"] = shapes
    old_text = prior.get("tokens", ("",))[0]
    equal = common_prefix_len(text, old_text, shared) if prior else 0  # chars as before
    starts = message_char_starts(template, messages, tools, text, key, bare,
                                  shapes, (old_text, equal))  # index -> offset
    header_ends, run.memo["headers"] = header_char_ends(
        plain, starts, text, prior.get("headers"), min(equal, len(text)), run.common)

    offsets = sorted({*starts.values(), *header_ends})
    segments, ids, reused, tokens = _tokenized(tok, run, text, equal)
    positions = _positions(tok, text, segments, offsets, reused, tokens,
                           prior.get("positions", ([], [])))
    run.memo["positions"] = (offsets, positions)
    shift = 0
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids = TokenIds.from_packed(pack((tok.bos_id,)) + ids.packed)
        shift = 1
    if shift:
        positions = list(map(shift.__add__, positions))
    at = dict(zip(offsets, positions, strict=True)).__getitem__
    # ascending, as the offsets are (a token position never falls as its offset grows)
    boundaries = sorted(dict.fromkeys([*positions, len(ids)]))
    located = sorted(starts)
    del located[bisect.bisect_left(located, len(plain)):]
    roles = prior.get("roles", [])[: run.common]
    roles += [str(m.get("role", "")) for m in plain[len(roles):]]
    run.memo["roles"] = roles
    message_starts = _message_starts(run, list(map(at, map(starts.__getitem__, located))),
                                     list(map(roles.__getitem__, located)))
    return Rendered(text, ids, tuple(boundaries), message_starts)


def _positions(tok: Tokenizer, text: str, segments: list[Segment], offsets: list[int],
               reused: int, tokens: int, prior: tuple[list[int], list[int]]) -> list[int]:
    """The token position of each of the ascending character `offsets` of `text` (split into
    `segments`, the first `tokens` tokens of which, up to character `reused`, are the previous
    text's). `prior`: the previous text's offsets and positions: the leading offsets below
    `reused` they share map as they did (compared as lists in C; else each found by offset)."""
    old_offsets, old_positions = prior
    j = bisect.bisect_left(offsets, reused)
    if offsets[:j] == old_offsets[:j]:
        known, rest = old_positions[:j], offsets[j:]
    else:  # the offsets below `reused` known before, by offset; the rest found below
        old_at = dict(zip(old_offsets, old_positions, strict=True))
        token_at = {o: old_at[o] for o in offsets[:j] if o in old_at}
        rest = [o for o in offsets if o not in token_at]
        found = dict(zip(rest, tok.token_positions(text, segments, rest), strict=True))
        return [token_at[o] if o in token_at else found[o] for o in offsets]
    if rest and reused:
        k = bisect.bisect_left(segments, reused, key=lambda s: s.start)
        return known + [tokens + p for p in tok.token_positions(text, segments[k:], rest)]
    return known + tok.token_positions(text, segments, rest)


def _message_starts(run: Run, positions: list[int], roles: list[str]
                    ) -> tuple[MessageStart, ...]:
    """The `MessageStart`s of these positions and roles; the leading ones the render `run`
    resumed from made alike are its own objects (a long history's are the same every turn)."""
    old_positions, old_roles, old = run.prior.get("message_starts", ([], [], ()))
    k = len(old)
    if positions[:k] != old_positions or roles[:k] != old_roles:
        k = 0
    out = (*old[:k], *map(MessageStart, positions[k:], roles[k:]))
    run.memo["message_starts"] = (positions, roles, out)
    return out


def _tokenized(tok: Tokenizer, run: Run, text: str, equal: int
               ) -> tuple[list[Segment], TokenIds, int, int]:
    """(segments, ids, the character offset and the token count up to which they are the
    previous text's) of `text`: the segments of the text the render `run` resumed from, equal
    to this one in its first `equal` characters, are reused up to a special token both share
    (``Tokenizer.reusable_segments``); the rest is split and tokenized."""
    prior = run.prior.get("tokens")
    if prior is not None:
        _, old_segments, old_ids, old_counts = prior
        k = tok.reusable_segments(old_segments, equal)
        if k:
            reused = old_counts[k - 1]
            end = old_segments[k - 1].end
            more = tok.encode_segments(text, end)
            segments = [*old_segments[:k], *more]
            ids = TokenIds.from_packed(old_ids.packed[: reused * ID_BYTES] + pack(_joined(more)))
            counts = [*old_counts[:k], *_counts(more, reused)]
            run.memo["tokens"] = (text, segments, ids, counts)
            return segments, ids, end, reused
    segments = tok.encode_segments(text)
    ids = TokenIds(_joined(segments))
    run.memo["tokens"] = (text, segments, ids, _counts(segments, 0))
    return segments, ids, 0, 0


def _counts(segments: Sequence[Segment], before: int) -> list[int]:
    """Per segment, the tokens up to its end (`before` tokens precede the first)."""
    return list(accumulate((len(s.ids) for s in segments), initial=before))[1:]


def _joined(segments: Sequence[Segment]) -> tuple[int, ...]:
    out: list[int] = []
    for s in segments:
        out.extend(s.ids)
    return tuple(out)


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
