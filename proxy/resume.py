"""Renders of a chat template that resume from an earlier render of the same conversation.

Agents re-send the whole history every turn, so the template's main loop over the messages
would redo, every turn, the work of the turn before. A render here is *recorded*: the messages
reach the template as a list and dicts equal to them (``TracedList``, ``TracedMessage``) that
record what the template observed of them, and at each boundary of a loop over the messages
written at the template's top level the record keeps how much text was out, the template's
namespaces (``namespace()`` objects, the only state a Jinja loop carries from one iteration to
the next) and what had been observed since the loop began. A later render of the same
template, tools, variables and generation flag whose messages start with the same ``m``
messages resumes each such loop at a boundary ``k`` of the earlier render when that is proven
to change nothing:

- it is the same loop of the template (the same ``for`` statement, and as many top-level
  loops ran before it: a template that chose one of two loops by what it read of the messages
  before them runs another loop), the template's top-level state where the loop began is the
  same (every top-level variable, namespaces by their attributes, the messages by which ones
  they are) and so is the text written before it;
- everything the loop observed of the messages before boundary ``k`` is within the first
  ``m`` (an item pulled, peeked or indexed, a message read), and it did not observe the list's
  length (``loop.length``, ``|length``, an index from the end, the end of the iteration, a
  reversed list: ``|last``, ``|reverse``; a slice with a bound from the end or a negative step,
  ``messages[-2:]``: which messages these are depends on the length) unless both lists have the
  same length;
- the namespaces at ``k`` hold plain values (strings, numbers, lists and dicts of them).

Then the earlier render's text up to ``k`` is the text this one would write, its namespaces
are what this one's would be, and the loop goes on from item ``k``. A Jinja template is
deterministic code whose only inputs are its variables; those are equal or observed, so
this is a proof, not a guess. What a template cannot be followed through makes it render in
full: ``loop.changed`` (state the record does not keep), a loop inside a ``{% set %}`` or
``{% filter %}`` block (its text is buffered, not yet written), a value the comparison does
not know. ``strftime_now`` is noted: a render resumes from another only while the clock reads
the same. Messages are compared strictly (``same``): ``1``, ``1.0``
and ``true`` render differently, and so do the same keys in another order.

A render may also be told which render to resume from (``render``'s `source`): the one of the
same messages without the generation prompt, for the one with it, when the template reads
``add_generation_prompt`` nowhere inside a loop or a macro (``reads_after_loops``; checks at the
loop's start as above). The proxy then keeps one render per conversation, not two.

Each render also records the offsets the template had written when it pulled and first read
each message after pulling it (``Run.pulled``, ``Run.read``); proxy/template.py reads the
messages' starts off them. A resumed render replays the earlier one's records up to ``k``, so
both are what a render from the start would record.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from datetime import datetime
from itertools import compress, repeat
from operator import is_
from types import FrameType
from typing import Any

from jinja2 import nodes
from jinja2.runtime import LoopContext, Macro, Namespace, missing

from proxy.traced import LOOP_NEXT, Signed, TracedIter, TracedList, TracedMessage, current, wrapped

__all__ = ["Run", "Runs", "reads_after_loops", "render", "resumable", "same"]

log = logging.getLogger(__name__)


def strftime_now(fmt: str) -> str:
    """HF's ``strftime_now`` global; a recorded render notes what it read of the clock, and a
    later one resumes from it only while the clock still reads the same."""
    now = datetime.now().strftime(fmt)
    run = current.run
    if run is not None:
        run.clock.append((fmt, now))
    return now


def same(a: Any, b: Any) -> bool:
    """Equal and rendered alike: the same types (``1``, ``1.0`` and ``True`` differ) and dict
    keys in the same order."""
    if a is b:
        return True
    t = type(a)
    if t is not type(b):
        return False
    if t is str:
        return bool(a == b)
    if t is dict:
        if len(a) != len(b):
            return False
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            if ka != kb or not (va is vb or same(va, vb)):
                return False
        return True
    if t is list or t is tuple:
        return len(a) == len(b) and all(map(same, a, b))
    if t is int or t is float or t is bool or a is None:
        return bool(a == b)
    return False


def _plain(v: Any) -> bool:
    t = type(v)
    if t is str or t is int or t is float or t is bool or v is None:
        return True
    if t is list or t is tuple:
        return all(map(_plain, v))
    if t is dict:
        return all(type(k) is str and _plain(x) for k, x in v.items())
    return False


def _attrs(ns: Namespace) -> dict[str, Any]:
    attrs: dict[str, Any] = object.__getattribute__(ns, "_Namespace__attrs")
    return attrs


class _Loop:
    """One top-level loop over the messages in a render; per boundary recorded (before the
    loop's item ``pos``, fetched from the list: an item peeked by ``loop.last`` has none): text
    out, namespaces' attributes, the highest message index observed since the loop began,
    whether the length was, and how much the run's log had grown since the loop began
    (`log0`: its length then)."""

    __slots__ = ("site", "first", "state", "out", "names", "pos", "at", "spaces", "seen",
                 "length", "log", "log0")

    def __init__(self, site: int, first: int, state: dict[str, Any], out: int,
                 names: tuple[str, ...]) -> None:
        self.site = site  # the line of the template's compiled code that runs it: which loop
        self.first = first
        self.state = state
        self.out = out
        self.names = names
        self.pos: list[int] = []
        self.at: list[int] = []
        self.spaces: list[tuple[dict[str, Any], ...]] = []
        self.seen: list[int] = []
        self.length: list[bool] = []
        self.log: list[int] = []
        self.log0 = 0


class Run:
    """One render: its text, its loops and what it recorded of each message."""

    __slots__ = ("key", "messages", "context", "text", "loops", "log", "pulled", "read", "at",
                 "pieces", "seen", "length", "loop", "source", "common", "resumed", "shared",
                 "memo", "prior", "clock", "sigs", "chain", "positions", "kept")

    def __init__(self, key: tuple[Any, ...], messages: list[dict[str, Any]],
                 context: dict[str, Any], source: Run | None, common: int) -> None:
        self.key = key
        self.messages = messages
        self.context = context
        self.text = ""
        self.loops: list[_Loop] = []
        self.log: list[tuple[int, int, int]] = []  # (message, 0 pulled | 1 read, offset)
        self.pulled: list[int | None] = [None] * len(messages)
        self.read: list[int | None] = [None] * len(messages)
        self.at = 0
        self.pieces: list[str] = []
        self.seen = -1  # observed since the active loop began
        self.length = False
        self.loop: _Loop | None = None  # the top-level loop under way
        self.source = source
        self.common = common  # messages equal to the source's
        self.resumed = 0  # loop items not rendered again
        self.shared = 0  # leading characters of the text known equal to the source's
        self.clock: list[tuple[str, str]] = []  # (format, what strftime_now gave)
        self.sigs: list[Any] = []
        self.chain: list[int] = []
        # whether `pulled` and `read` are wanted (a render without the generation prompt whose
        # starts are read): only then does a resumed render replay its source's records
        self.positions = True
        # whether it is kept for later renders to resume from: only then are its loops'
        # boundaries recorded (a render that is not kept only reads its source's)
        self.kept = True
        # what proxy.template derived from this render (verified starts, segments), and what it
        # had derived from the source's
        self.memo: dict[str, Any] = {}
        self.prior: dict[str, Any] = source.memo if source is not None else {}

    def see(self, i: int) -> None:
        if i > self.seen:
            self.seen = i

    def pull(self, i: int) -> None:
        self.pulled[i], self.read[i] = self.at, None
        self.log.append((i, 0, self.at))

    def first_read(self, i: int) -> None:
        if self.read[i] is None:
            self.read[i] = self.at
            self.log.append((i, 1, self.at))

    # -- loop boundaries ---------------------------------------------------------------------

    def boundary(self, it: TracedIter, caller: FrameType) -> None:
        """Before `it` hands out its next item, called from a top-level loop."""
        loop = self.loop
        if it.pos == 0:
            if loop is not None:
                return  # a loop inside the loop under way: its pulls are observations only
            root = caller.f_back if caller.f_code is LOOP_NEXT else caller
            assert root is not None
            names = root.f_locals
            state = {k: _snapshot(v) for k, v in names.items() if k.startswith("l_0_")}
            spaces = tuple(k for k, v in names.items()
                           if k.startswith("l_0_") and isinstance(v, Namespace))
            loop = _Loop(root.f_lineno, it.indices.start, state, self.at, spaces)
            loop.log0 = len(self.log)
            self.loop = it.loop = loop
            self.seen, self.length = -1, False
            self.loops.append(loop)
            it.namespaces = {n: names[n] for n in loop.names}
            try:
                b = self._holds(it)
            except Exception:  # a fault of this module must cost a full render, not a request
                log.exception("resuming a render failed; rendering it in full")
                b = 0
            if b:
                self._resume(it, caller, b)
        elif it.loop is not loop:
            return
        assert loop is not None
        if not self.kept:
            return
        loop.pos.append(it.pos)
        loop.at.append(self.at)
        loop.spaces.append(tuple(dict(_attrs(it.namespaces[n])) for n in loop.names))
        loop.seen.append(self.seen)
        loop.length.append(self.length)
        loop.log.append(len(self.log) - loop.log0)

    def _holds(self, it: TracedIter) -> int:
        """The latest boundary of the source's same loop at which this render may resume (see
        the module rules); 0: none."""
        src = self.source
        loop = self.loop
        assert loop is not None
        ordinal = len(self.loops) - 1
        if src is None or ordinal >= len(src.loops) or (self.positions and not src.positions):
            return 0
        old = src.loops[ordinal]
        if (old.site != loop.site or old.first != loop.first or old.names != loop.names
                or old.out != self.at
                or (src.clock and any(datetime.now().strftime(f) != t for f, t in src.clock))
                or not _same_state(old.state, loop.state, self.common, src.context,
                                   self.context)
                or "".join(self.pieces) != src.text[: self.at]):
            return 0
        m, equal_length = self.common, len(src.messages) == len(self.messages)
        b = len(old.pos) - 1  # the latest boundary that holds
        while b > 0 and not (old.pos[b] < len(it.items) and old.seen[b] < m
                             and (equal_length or not old.length[b])
                             and all(map(_plain_space, old.spaces[b]))):
            b -= 1
        return b if b > 0 and old.pos[b] > 0 else 0

    def _resume(self, it: TracedIter, caller: FrameType, b: int) -> None:
        """Go on from the source's boundary `b` of this loop: its text, namespaces, records
        and the loop's counters."""
        src = self.source
        loop = self.loop
        assert src is not None and loop is not None
        old = src.loops[len(self.loops) - 1]
        k = old.pos[b]
        self.pieces.append(src.text[old.out : old.at[b]])
        for name, attrs in zip(old.names, old.spaces[b], strict=True):
            mine = _attrs(it.namespaces[name])
            mine.clear()
            mine.update(attrs)
        if self.positions:  # the records, for proxy/template.py to read off the starts
            entries = src.log[old.log0 : old.log0 + old.log[b]]
            pulled, read = self.pulled, self.read
            for i, kind, at in entries:
                if kind == 0:
                    pulled[i], read[i] = at, None
                else:
                    read[i] = at
            self.log += entries
        if self.kept:
            loop.pos += old.pos[:b]
            loop.at += old.at[:b]
            loop.spaces += old.spaces[:b]
            loop.seen += old.seen[:b]
            loop.length += old.length[:b]
            loop.log += old.log[:b]
        self.at = self.shared = old.at[b]
        self.seen, self.length = old.seen[b], old.length[b]
        if caller.f_code is LOOP_NEXT:
            ctx: LoopContext = caller.f_locals["self"]
            ctx.index0 = k - 1
            ctx.current = it.items[k - 1]
        it.pos = k
        self.resumed += k


def _plain_space(attrs: dict[str, Any]) -> bool:
    return all(map(_plain, attrs.values()))


class _Snapshot:
    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any) -> None:
        self.kind = kind
        self.value = value


def _snapshot(v: Any) -> Any:
    if isinstance(v, Namespace):
        return _Snapshot("namespace", dict(_attrs(v)))
    if type(v) is TracedList:
        return _Snapshot("messages", (v._indices.start, v._indices.step))
    if type(v) is TracedMessage:
        return _Snapshot("message", v._i)
    if isinstance(v, Macro):
        return _Snapshot("macro", v.name)
    return v


def _same_state(old: dict[str, Any], new: dict[str, Any], common: int,
                old_context: dict[str, Any], new_context: dict[str, Any]) -> bool:
    """The top-level variables alike; one still holding the value the render was given is
    alike by the runs' equal keys (tools and variables compared once, not per loop)."""
    if old.keys() != new.keys():
        return False
    for k, a in old.items():
        b = new[k]
        if a is b or (a is old_context.get(k[4:], missing)
                      and b is new_context.get(k[4:], missing)):
            continue
        if type(a) is _Snapshot:
            if type(b) is not _Snapshot or a.kind != b.kind:
                return False
            if a.kind == "namespace":
                if not same(a.value, b.value):
                    return False
            elif a.kind == "message":
                if a.value != b.value or a.value >= common:
                    return False
            elif a.value != b.value:
                return False
        elif a is missing or b is missing or not same(a, b):
            return False
    return True


def reads_after_loops(ast: nodes.Template, name: str) -> bool:
    """Whether the template reads the variable `name` nowhere inside a loop or a macro: then a
    top-level loop over the messages runs alike whatever its value, as far as the rules'
    checks at the loop's start (the text before it, every top-level variable, namespaces) have
    found the state alike, and a render may resume from one given another value (``render``'s
    `source`)."""
    for scope in ast.find_all((nodes.For, nodes.Macro, nodes.CallBlock)):
        if any(n.name == name for n in scope.find_all(nodes.Name)):
            return False
    return True


def resumable(source: str, ast: nodes.Template) -> bool:
    """Whether renders of this template may resume (see the module rules)."""
    if "changed(" in source:
        return False
    for block in ast.find_all((nodes.AssignBlock, nodes.FilterBlock, nodes.CallBlock)):
        if any(True for _ in block.find_all(nodes.For)):
            return False
    return True




class Runs:
    """Recent renders of one template, by (generation flag, tools, variables), found by the
    hash chain of their messages' signatures; bounded LRU; thread-safe."""

    def __init__(self, max_runs: int) -> None:
        self.max_runs = max_runs
        self._runs: OrderedDict[int, Run] = OrderedDict()
        # key -> chain hash of messages[:i] -> the latest run of those messages
        self._index: dict[tuple[Any, ...], dict[int, Run]] = {}
        self._lock = threading.Lock()

    def find(self, key: tuple[Any, ...], chain: list[int], sigs: list[Any]
             ) -> tuple[Run | None, int]:
        """The recent render sharing the most leading messages with these, and how many: the
        longest prefix whose chain hash is indexed (bisected: a render indexes every prefix of
        its messages), confirmed by comparing the signatures."""
        with self._lock:
            index = self._index.get(key)
            if index is None or chain[0] not in index:
                return None, 0
            lo, hi = 0, len(chain) - 1  # chain[lo] is indexed
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if chain[mid] in index:
                    lo = mid
                else:
                    hi = mid - 1
            run = index[chain[lo]]
        if run.sigs[:lo] != sigs[:lo]:  # a hash collision
            return None, 0
        return run, lo

    def add(self, run: Run, superseded: Run | None = None, common: int = 0) -> None:
        """`run` remembered. `superseded`: the render it resumed from, whose first `common`
        messages are `run`'s, when that is all of them or all but the last (the same
        conversation a turn later, or its last turn sent again otherwise, as proxy/memo.py's
        PrefixMemo lets go): it goes at once, not another conversation's render at the end of
        the LRU, so the renders kept are conversations, not turns. Its prefixes up to
        `common` are `run`'s now; its last, where `run` does not share it, is dropped."""
        with self._lock:
            index = self._index.setdefault(run.key, {})
            index.update(dict.fromkeys(run.chain, run))
            if superseded is not None and self._runs.pop(id(superseded), None) is not None:
                for h in superseded.chain[common + 1 :]:
                    if index.get(h) is superseded:
                        del index[h]
            self._runs[id(run)] = run
            while len(self._runs) > self.max_runs:
                _, old = self._runs.popitem(last=False)
                index = self._index[old.key]
                # its prefixes no later run holds (found in C: most are a later turn's now)
                for h in list(compress(old.chain, map(is_, map(index.get, old.chain),
                                                      repeat(old)))):
                    index.pop(h, None)
                if not index:
                    del self._index[old.key]


def render(template: Any, runs: Runs | None, key: tuple[Any, ...],
           messages: list[dict[str, Any]], context: dict[str, Any], keep: bool = True,
           positions: bool = True, source: Run | None = None) -> Run:
    """Render `template` (a compiled jinja2 Template) with `context` and the recorded
    `messages`, resuming from the best of `runs` (None: from the start); raises what the
    template raises. `keep`: remember this render for later ones. `messages` may be
    ``Signed`` already (computed once for all renders of one request). `positions`: whether
    ``Run.pulled`` and ``Run.read`` will be read (a render that resumes from one without them
    must not want them: it renders in full). `source`: resume from this render of the same
    messages instead, whose context differs at most in variables the template reads only
    after its loops over the messages (``reads_after_loops``: the caller's proof)."""
    common = 0 if source is None else len(messages)
    if source is None and runs is not None:
        if not isinstance(messages, Signed):
            messages = Signed(messages)
        source, common = runs.find(key, messages.chain, messages.sigs)
    run = Run(key, messages, context, source, common)
    run.positions = positions
    run.kept = keep and runs is not None
    if isinstance(messages, Signed):
        run.sigs, run.chain = messages.sigs, messages.chain
        items = messages.traced()
    else:
        items = wrapped(messages)
    traced = TracedList(items, run, range(len(messages)))
    outer, current.run = current.run, run
    try:
        for piece in template.generate({**context, "messages": traced}):
            run.pieces.append(piece)
            run.at += len(piece)
    finally:
        current.run = outer
    run.text = "".join(run.pieces)
    run.pieces = []
    run.loop = None
    source, run.source = run.source, None  # a chain of sources would keep every render alive
    if run.kept:
        assert runs is not None
        runs.add(run, source if source is not None and source.key == run.key
                 and 0 < common >= len(source.messages) - 1 else None, common)
    return run
