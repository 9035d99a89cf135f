"""Where each message starts in a rendered prompt, and where its role header ends: the
character offsets `proxy.template.render_prompt` turns into the prompt's safe boundaries (the
rules are in proxy/template.py's docstring).

    message_char_starts(template, messages, tools, text, key, run, shapes) -> {index: offset}
    header_char_ends(messages, starts, text, prior, equal, common) -> (offsets, record)
    shape_of(message)                  what a message's start depends on (its role, its kind)
    StartCache                         located starts remembered across requests
"""

from __future__ import annotations

import json
import logging
import threading
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from itertools import compress, repeat
from operator import is_not
from typing import Any, Protocol

from proxy import traced
from proxy.resume import Run

log = logging.getLogger("proxy.template")  # the template's own log, as before the split

# how much of a message's content is searched for to find where its role header ends
_CONTENT_NEEDLE_CHARS = 64
# at most this many pairs of neighbouring message shapes get a sampled check of their start
_SHAPE_SAMPLES = 16


class StartCache:
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


class Renders(Protocol):
    """What the starts need of a chat template (proxy.template.ChatTemplate)."""

    prefixes: StartCache
    extra: dict[str, Any]  # the request's template variables

    def key_of(self, tools: list[dict[str, Any]] | None) -> tuple[Any, ...]: ...

    def record(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, key: tuple[Any, ...], keep: bool = True) -> Run: ...


def message_char_starts(
    template: Renders,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    key: tuple[Any, ...] | None = None,
    run: Run | None = None,
    shapes: list[Any] | None = None,
    equal: tuple[str, int] = ("", 0),
) -> dict[int, int]:
    """Message index (len(messages): the generation prompt) -> char offset where it starts:
    the traced starts when a sample checks out, else every prefix rendered (module docstring).
    `run`: the recorded render of ``messages`` without a generation prompt, when there is one;
    `shapes`: the messages' ``_shape``s, when known; `equal`: a text and how many leading
    characters this one shares with it, when known."""
    key = template.key_of(tools) if key is None else key
    run = run or recorded(template, messages, tools, key)
    if run is not None:
        known = _known_starts(run, text, equal)
        late = text.startswith(run.text)  # the definition of the generation prompt's start
        if late:
            known[len(messages)] = len(run.text)
        # how far the text begins as this render does (all of a continued message's, which ends
        # inside it), for the next turn's render_prompt
        run.memo["late"] = len(run.text) if late else \
            len(text) if run.text.startswith(text) else 0
        shapes = [shape_of(m) for m in messages] if shapes is None else shapes
        firsts = run.memo["firsts"] = _shape_firsts(shapes, run.prior.get("firsts"), run.common)
        for candidate in _traced_starts(template, messages, tools, text, key, run, known):
            verified: dict[int, int] = {}
            starts = _checked(template, messages, tools, text, key, candidate, known, verified,
                              shapes, firsts)
            if starts is not None:
                run.memo["starts"] = (verified, text)
                return starts
    starts = _rendered_starts(template, messages, tools, text,
                              _chain_keys(messages, tools, template.extra), key)
    if run is not None:
        run.memo["starts"] = (starts, text)
    return starts


def recorded(template: Renders, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None, key: tuple[Any, ...]) -> Run | None:
    """The recorded render of `messages` without the generation prompt; None when the
    template fails on them."""
    try:
        return template.record(messages, tools, False, key)
    except Exception as exc:
        log.debug("template failed on the traced messages: %s", exc)
        return None


def _known_starts(run: Run, text: str, equal: tuple[str, int] = ("", 0)) -> dict[int, int]:
    """The starts the render this one resumed from had verified, of the messages the two
    share, when ``text`` still begins with what they cover (`equal`: a text and how many
    leading characters this one shares with it, when known)."""
    if "starts" not in run.prior or run.common == 0:
        return {}
    starts, old_text = run.prior["starts"]
    known = dict(starts) if max(starts, default=0) <= run.common else \
        {i: s for i, s in starts.items() if i <= run.common}
    end = max(known.values(), default=0)
    if old_text is equal[0] and end <= equal[1]:
        return known
    return known if text.startswith(old_text[:end]) else {}


def _rendered_starts(
    template: Renders,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    keys: Sequence[int],
    key: tuple[Any, ...] | None = None,
) -> dict[int, int]:
    """The definition: every prefix rendered, but one located in an earlier request (same
    tools, same messages[:i]) is taken from the template's prefix cache when the text between
    it and the previous start hashes as it did then."""
    key = template.key_of(tools) if key is None else key
    starts: dict[int, int] = {}
    last = 0
    for i in range(len(messages) + 1):
        hit = template.prefixes.get(keys[i])
        if hit is not None and hit[0] >= last and hash(text[last : hit[0]]) == hit[1]:
            starts[i] = last = hit[0]
            continue
        start = _render_start(template, messages, tools, text, i, key)
        if start is not None and start >= last:
            template.prefixes.put(keys[i], (start, hash(text[last:start])))
            starts[i] = last = start
    return starts


def _render_start(
    template: Renders,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    i: int,
    key: tuple[Any, ...] | None = None,
) -> int | None:
    """The length of ``messages[:i]`` rendered, when that rendering is a prefix of ``text``
    (a recorded render, resumed from the one of all the messages)."""
    key = template.key_of(tools) if key is None else key
    try:
        prefix = template.record(messages[:i], tools, False, key, keep=False).text
    except Exception as exc:  # a template may refuse a partial conversation
        log.debug("template refused the first %d messages: %s", i, exc)
        return None
    return len(prefix) if text.startswith(prefix) else None


def _chain_keys(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                extra: dict[str, Any] | None = None) -> list[int]:
    """The prefix cache's key of (tools, variables, messages[:i]) for every i in
    0..len(messages)."""
    base = hash(("tools", _fingerprint(tools), _fingerprint(extra or {})))
    return [hash((base, h)) for h in traced.chain_of(traced.signatures(messages))]


def _traced_starts(
    template: Renders,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    key: tuple[Any, ...] | None = None,
    run: Run | None = None,
    known: dict[int, int] | None = None,
) -> list[list[int | None]]:
    """Candidate starts (index len(messages): the generation prompt) from one recorded
    rendering without a generation prompt (`run`, rendered here when not given).

    Two readings of the record, the likelier first: where the template first read a message
    after pulling it (a loop that asks ``loop.last`` pulls the next message early), and where
    it pulled it (a template that writes text before reading the message). A message never
    pulled has no start. Message 0's start needs no record: rendering no messages costs
    nothing (and some templates refuse it), and it is in `known` (starts verified before)
    after the first turn. No candidates when the template fails on the recorded messages.
    """
    key = template.key_of(tools) if key is None else key
    run = run or recorded(template, messages, tools, key)
    if run is None:
        return []
    whole = run.text
    end = [len(whole) if text.startswith(whole) else None]
    read = [r if r is not None and p is not None else p
            for r, p in zip(run.read, run.pulled, strict=True)]
    candidates = [read + end] + ([run.pulled + end] if run.pulled != read else [])
    if messages:
        first = known[0] if known and 0 in known else \
            _render_start(template, messages, tools, text, 0, key)
        for candidate in candidates:
            candidate[0] = first
    return candidates


def _checked(
    template: Renders,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    key: tuple[Any, ...] | None,
    candidate: Sequence[int | None],
    known: dict[int, int] | None = None,
    verified: dict[int, int] | None = None,
    shapes: list[Any] | None = None,
    firsts: tuple[list[int], int] | None = None,
) -> dict[int, int] | None:
    """``candidate``'s starts when they are in order and every sampled one (:func:`_samples`)
    equals the definition's answer (a rendering, or a start verified for the same messages in
    the render this one resumed from: `known`); else None. `verified` gets the starts checked
    (rendered or known), for the next request to know."""
    key = template.key_of(tools) if key is None else key
    known = known or {}
    verified = {} if verified is None else verified
    starts = dict(compress(enumerate(candidate), map(is_not, candidate, repeat(None))))
    offsets = list(starts.values())
    if offsets != sorted(offsets):
        return None
    for i in _samples(messages, shapes, firsts):
        start = candidate[i]
        if start is not None and known.get(i) == start:
            verified[i] = start
            continue
        if _render_start(template, messages, tools, text, i, key) != start:
            return None
        if start is not None:
            verified[i] = start
    # the known starts the candidate has (all of them, as a rule: compared in C first)
    if list(map(starts.get, known)) == list(known.values()):
        verified.update(known)
    else:
        verified.update(known.items() & starts.items())
    return starts


def _samples(messages: Sequence[dict[str, Any]], shapes: list[Any] | None = None,
             firsts: tuple[list[int], int] | None = None) -> list[int]:
    """The positions whose traced start is checked by rendering: 0, the powers of two (the same
    as the conversation grows, so the next turn finds them in the prefix cache), the last two,
    and the first position of each pair of neighbouring message shapes (role, content type,
    keys), up to ``_SHAPE_SAMPLES`` pairs (`firsts`: those positions, when known)."""
    n = len(messages)
    picks = {0, max(n - 1, 0), n}
    power = 1
    while power < n:
        picks.add(power)
        power *= 2
    if firsts is None:
        firsts = _shape_firsts([shape_of(m) for m in messages] if shapes is None else shapes)
    picks.update(firsts[0])  # position n (where the last pair ends) is picked already
    return sorted(picks)


def _shape_firsts(shapes: list[Any], prior: tuple[list[int], int] | None = None,
                  common: int = 0) -> tuple[list[int], int]:
    """(the first position i of each pair of neighbouring shapes ``(shapes[i - 1] or None,
    shapes[i])``, i < len(shapes), up to ``_SHAPE_SAMPLES`` pairs; how many were scanned).
    `prior`: the same of a list whose first `common` shapes are these: only the rest is
    scanned."""
    firsts, upto = ([], 0) if prior is None else prior
    upto = min(upto, common)
    firsts = [i for i in firsts if i < upto]
    seen = {(shapes[i - 1] if i else None, shapes[i]) for i in firsts}
    for i in range(upto, len(shapes)) if len(seen) < _SHAPE_SAMPLES else ():
        pair = (shapes[i - 1] if i else None, shapes[i])
        if pair not in seen:
            if len(seen) == _SHAPE_SAMPLES:
                break
            seen.add(pair)
            firsts.append(i)
    return firsts, len(shapes)


def shape_of(message: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    return (str(message.get("role")), type(message.get("content")).__name__,
            tuple(sorted(map(str, message))))


def _fingerprint(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


Headers = tuple[list[int], list[int], list[int | None]]  # header_char_ends' record


def header_char_ends(
    messages: Sequence[dict[str, Any]], starts: dict[int, int], text: str,
    before: Headers | None = None, equal: int = 0, common: int = 0,
) -> tuple[list[int], Headers]:
    """(char offsets where a located message's content begins after its role header, the
    record of this search: the located messages, their spans' edges, what was found in each
    or None). `before` is that record of the previous text, equal to this one in its first
    `equal` characters, whose first `common` messages are these: a message among them
    searched for in the same span of the shared text is not searched again."""
    located = sorted(starts)
    offsets = list(map(starts.__getitem__, located))  # ascending, as the starts are
    if located and located[-1] == len(messages):
        located.pop()  # the generation prompt: only where the last message ends
    else:
        offsets.append(len(text))
    old_located, old_offsets, old_ats = before or ([], [], [])
    # the leading messages searched in the same span of the shared text before: taken as found
    # then (compared as lists in C; else each is looked at below)
    m = min(bisect_left(located, common), bisect_right(offsets, equal, 1) - 1,
            len(old_located))
    if located[:m] != old_located[:m] or offsets[: m + 1] != old_offsets[: m + 1]:
        m = 0
    ats = old_ats[:m]
    olds: dict[int, tuple[int, int, int | None]] | None = None
    for k in range(m, len(located)):
        i, begin, end = located[k], offsets[k], offsets[k + 1]
        if i < common and end <= equal:
            if olds is None:  # spans searched before, by message
                olds = dict(zip(old_located, zip(old_offsets, old_offsets[1:], old_ats,
                                                 strict=True), strict=True))
            old = olds.get(i)
            if old is not None and old[0] == begin and old[1] == end:
                ats.append(old[2])
                continue
        ats.append(_header_end(messages[i], text, begin, end))
    return list(compress(ats, map(is_not, ats, repeat(None)))), (located, offsets, ats)


def _header_end(message: dict[str, Any], text: str, begin: int, end: int) -> int | None:
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        return None
    for needle in (content[:_CONTENT_NEEDLE_CHARS], content.lstrip()[:_CONTENT_NEEDLE_CHARS]):
        at = text.find(needle, begin, end)
        if at > begin:
            return at
    return None
