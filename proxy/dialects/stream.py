"""The events a stream emits, and the stream that turns a dialect's scans into them (the scan
rules are proxy/dialects/base.py's).

Events (what the API edges render): `TextDelta`, `ReasoningDelta`, `CallOpen` (index, id,
name), `ArgsDelta` (a piece of the arguments' JSON text; the pieces of one call concatenate to
`json.dumps(arguments)`), `CallDone` (the whole call).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from proxy.dialects.base import Call, Item, Text, Tools, tidy

log = logging.getLogger("prefixgate")


@dataclass(frozen=True, slots=True)
class ToolCall:
    id_hex: str  # the API prefixes it: call_..., toolu_...
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallOpen:
    index: int
    id_hex: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgsDelta:
    index: int
    json: str


@dataclass(frozen=True, slots=True)
class CallDone:
    index: int
    call: ToolCall


Event = TextDelta | ReasoningDelta | CallOpen | ArgsDelta | CallDone


def _member_json(k: str, v: Any) -> str:
    return json.dumps(k, ensure_ascii=False) + ": " + json.dumps(v, ensure_ascii=False)


class Stream:
    """Generated text in, events out (see the module docstring): `feed(piece)` as pieces
    arrive, `finish()` once at the end."""

    def __init__(self, scan: Any, tools: Tools, inside_think: bool = False,
                 forced: tuple[str, ...] = ()) -> None:
        self._scan = scan
        self.tools = tools
        self.inside_think = inside_think
        # a forced call (tool_choice required or named): the names it may call. The grammar
        # lets the model write nothing but the call, so no text goes out: an answer that
        # max_tokens cut is still a call, never its raw markup as text (`finish`)
        self.forced = forced
        self.text = ""
        self.calls = 0
        self._sent: list[Any] = []  # per item: chars sent (text) or members sent (call)
        self._kinds: list[type] = []
        self._ids: list[str] = []  # per item: its call id ("" for text)
        self._broken = False

    def feed(self, piece: str) -> list[Event]:
        self.text += piece
        out = self._diff(False)
        if self.forced:  # the grammar allows only the call: text is a piece of its markup
            return [e for e in out if not isinstance(e, TextDelta)]
        return out

    def finish(self) -> list[Event]:
        out = self._diff(True)
        if not self.forced or self._broken:
            return out
        # the grammar allowed nothing but the call: text now is a call cut before its name
        # ended. It is the one tool that may be called, with no arguments, or the one whose
        # name that cut text is a start of; otherwise nothing
        cut = "".join(e.text for e in out if isinstance(e, TextDelta))
        out = [e for e in out if not isinstance(e, TextDelta)]
        if self.calls == 0 and not any(k is Call for k in self._kinds):
            fits = list(self.forced) if len(self.forced) == 1 else \
                [n for n in self.forced if _cut_name_fits(cut, n)]
            if len(fits) == 1:
                self._kinds.append(Call)
                self._sent.append(-2)
                k = len(self._kinds) - 1
                self._ids.append(uuid.uuid4().hex[:24])
                out += [CallOpen(self._index(k), self._ids[k], fits[0]),
                        ArgsDelta(self._index(k), "{}"),
                        CallDone(self._index(k), ToolCall(self._ids[k], fits[0], {}))]
                self.calls += 1
        return out

    def _diff(self, final: bool) -> list[Event]:
        if self._broken:
            return []
        items = tidy(self._scan(self.text, self.tools, final, self.inside_think), final)
        out: list[Event] = []
        for k, item in enumerate(items):
            if k == len(self._sent):
                self._sent.append(0 if not isinstance(item, Call) else -1)
                self._kinds.append(type(item))
                self._ids.append("")
            elif self._kinds[k] is not type(item):
                return self._break(out, k, item)
            if isinstance(item, Call):
                self._call(k, item, out, final)
            else:
                sent = self._sent[k]
                if len(item.text) < sent:
                    return self._break(out, k, item)
                if len(item.text) > sent:
                    self._sent[k] = len(item.text)
                    d = item.text[sent:]
                    out.append(TextDelta(d) if isinstance(item, Text) else ReasoningDelta(d))
        return out

    def _call(self, k: int, call: Call, out: list[Event], final: bool) -> None:
        sent = self._sent[k]
        if sent == -2:  # done already
            return
        if sent == -1:
            self._ids[k] = uuid.uuid4().hex[:24]
            out.append(CallOpen(self._index(k), self._ids[k], call.name))
            sent = 0
        new = call.members[sent:]
        if new:
            text = "".join(("{" if sent + n == 0 else ", ") + _member_json(key, v)
                           for n, (key, v) in enumerate(new))
            out.append(ArgsDelta(self._index(k), text))
            sent = len(call.members)
        self._sent[k] = sent
        if call.closed or final:
            out.append(ArgsDelta(self._index(k), "}" if call.members else "{}"))
            out.append(CallDone(self._index(k), ToolCall(self._ids[k], call.name,
                                                         dict(call.members))))
            self._sent[k] = -2
            self.calls += 1

    def _index(self, k: int) -> int:
        return sum(1 for kind in self._kinds[:k] if kind is Call)

    def _break(self, out: list[Event], k: int, item: Item) -> list[Event]:
        """A scan that did not extend what was sent: a dialect bug. Said once; the rest of
        this answer is not parsed further."""
        log.error("dialect scan went back at item %d (%s): the rest of this answer is dropped",
                  k, type(item).__name__)
        self._broken = True
        return out


def _cut_name_fits(cut: str, name: str) -> bool:
    """Whether `name` may be the one a call cut in `cut` was writing: the last run of name-like
    characters in it is a start of `name` (empty: only a single declared name fits)."""
    m = re.search(r"[A-Za-z0-9_.\-]*$", cut.rstrip('"'))
    return name.startswith(m.group(0) if m else "")
