"""What a recorded render shows the template (proxy/resume.py's rules): the messages as a list
and dicts equal to them (``TracedList``, ``TracedMessage``) that report what the template
observed of them to the run under way on this thread (``current``), and an iteration over them
(``TracedIter``) that records a top-level loop's boundaries; the messages' signatures and the
hash chain of their prefixes (``Signed``), by which a render finds an earlier one of the same
messages."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, Protocol

from jinja2.runtime import LoopContext, Namespace

from proxy.memo import IdMemo, PrefixMemo

LOOP_NEXT = LoopContext.__next__.__code__
_JSON_CODES = frozenset({json.JSONEncoder.encode.__code__, json.JSONEncoder.iterencode.__code__})
_ROOT = ("root", "<template>")


class Run(Protocol):
    """What the messages report to the record of the render under way (proxy.resume.Run)."""

    length: bool  # the template observed how many messages there are
    loop: Any  # the top-level loop under way

    def see(self, i: int) -> None: ...
    def pull(self, i: int) -> None: ...
    def first_read(self, i: int) -> None: ...
    def boundary(self, it: TracedIter, caller: FrameType) -> None: ...


class Current(threading.local):
    run: Run | None = None  # the run under way on this thread


current = Current()


class TracedIter:
    """An iteration over a TracedList: each item handed out is observed; a top-level loop's
    boundaries are recorded (and may resume)."""

    __slots__ = ("items", "indices", "run", "pos", "loop", "top", "namespaces")

    def __init__(self, items: list[Any], indices: range, run: Run, top: bool) -> None:
        self.items = items
        self.indices = indices
        self.run = run
        self.pos = 0
        self.loop: Any = None  # the loop it runs as, once a boundary was recorded
        self.top = top  # forward, step 1: may be a resumable loop
        self.namespaces: dict[str, Namespace] = {}

    def __iter__(self) -> TracedIter:
        return self

    def __next__(self) -> Any:
        run = self.run
        if self.top:
            caller = sys._getframe(1)
            code = caller.f_code
            if code is LOOP_NEXT:
                root = caller.f_back
                if root is not None and (root.f_code.co_name, root.f_code.co_filename) == _ROOT:
                    run.boundary(self, caller)
            elif (code.co_name, code.co_filename) == _ROOT:
                run.boundary(self, caller)
        pos = self.pos
        if pos >= len(self.items):
            run.length = True
            if run.loop is self.loop:
                run.loop = None
            raise StopIteration
        i = self.indices[pos]
        self.pos = pos + 1
        run.see(i)
        run.pull(i)
        return self.items[pos]


class TracedList(list):  # type: ignore[type-arg]
    """The messages as a recorded render sees them. The template cannot reach the record (the
    sandbox refuses names starting with ``_``)."""

    def __init__(self, items: list[Any], run: Run, indices: range) -> None:
        super().__init__(items)
        self._run = run
        self._indices = indices

    def __iter__(self) -> Iterator[Any]:
        return TracedIter(list(list.__iter__(self)), self._indices, self._run,
                     self._indices.step == 1)

    def __reversed__(self) -> Iterator[Any]:
        self._run.length = True  # its first item is the last
        return TracedIter(list(reversed(list(list.__iter__(self)))), self._indices[::-1], self._run,
                     False)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            if any(isinstance(v, int) and v < 0 for v in (index.start, index.stop, index.step)):
                self._run.length = True  # counted from the end: which items depends on it
            return TracedList(list.__getitem__(self, index), self._run, self._indices[index])
        if isinstance(index, int) and index < 0:
            self._run.length = True
        try:
            item = list.__getitem__(self, index)
        except IndexError:
            self._run.length = True
            raise
        self._run.see(self._indices[index])
        return item

    def __len__(self) -> int:
        self._run.length = True
        return list.__len__(self)

    def __bool__(self) -> bool:
        if list.__len__(self):
            self._run.see(self._indices[0])
            return True
        self._run.length = True
        return False

    def _all(self) -> None:
        self._run.length = True
        if list.__len__(self):
            self._run.see(max(self._indices[0], self._indices[-1]))

    def __contains__(self, item: object) -> bool:
        self._all()
        return list.__contains__(self, item)

    def __eq__(self, other: object) -> bool:
        self._all()
        return list.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        self._all()
        return list.__ne__(self, other)

    def __add__(self, other: Any) -> Any:
        self._all()
        return list.__add__(self, other)

    def __radd__(self, other: Any) -> Any:
        self._all()
        return list(other) + list(list.__iter__(self))

    def __mul__(self, n: Any) -> Any:
        self._all()
        return list.__mul__(self, n)

    __rmul__ = __mul__
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._all()
        return list.__repr__(self)

    __str__ = __repr__

    def index(self, *args: Any) -> int:
        self._all()
        return list.index(self, *args)

    def count(self, item: Any) -> int:
        self._all()
        return list.count(self, item)

    def copy(self) -> list[Any]:
        self._all()
        return list(list.__iter__(self))


class TracedMessage(dict):  # type: ignore[type-arg]
    """One message, equal to it; reading it is observed (and the first read after a pull is
    recorded)."""

    __slots__ = ("_i",)

    def __init__(self, message: dict[str, Any], i: int) -> None:
        super().__init__(message)
        self._i = i  # the message's index; the run observed is the one under way on the thread

    def _seen(self) -> None:
        run = current.run
        if run is not None:
            run.see(self._i)
            run.first_read(self._i)

    def __getitem__(self, key: Any) -> Any:
        self._seen()
        return dict.__getitem__(self, key)

    def __contains__(self, key: object) -> bool:
        self._seen()
        return dict.__contains__(self, key)

    def __iter__(self) -> Iterator[Any]:
        self._seen()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._seen()
        return dict.__len__(self)

    def __eq__(self, other: object) -> bool:
        self._seen()
        return dict.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        self._seen()
        return dict.__ne__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._seen()
        return dict.__repr__(self)

    __str__ = __repr__

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
        if sys._getframe(1).f_code in _JSON_CODES:
            if current.run is not None:
                current.run.length = True  # serialized inside a list: its end is read too
        return dict.items(self)

    def copy(self) -> dict[str, Any]:
        self._seen()
        return dict(dict.items(self))


def signatures(messages: list[dict[str, Any]]) -> list[Any]:
    """Per message, a value equal for two messages exactly when they are ``same`` (messages
    hold JSON values: strings, numbers, booleans, null, lists and dicts)."""
    out: list[Any] = []
    memo = _SIGNATURES
    for m, sig in zip(messages, memo.get_many(messages), strict=True):
        if sig is None:
            if all(type(v) is str for v in m.values()):
                sig = tuple(m.items())
            else:
                sig = json.dumps(m, ensure_ascii=False, default=repr)
            memo.put(m, sig)
        out.append(sig)
    return out


_SIGNATURES = IdMemo()  # a message (not changed in place: proxy/memo.py) -> its signature


class Signed(list):  # type: ignore[type-arg]
    """Messages with their ``signatures`` and ``chain_of`` computed once; a leading slice
    (``messages[:i]``) keeps its share of both."""

    def __init__(self, messages: list[dict[str, Any]], sigs: list[Any] | None = None,
                 chain: list[int] | None = None, root: Signed | None = None) -> None:
        super().__init__(messages)
        if sigs is None or chain is None:
            sigs, chain = signed(messages)
        self.sigs, self.chain = sigs, chain
        self.root = self if root is None else root
        self.wrappers: list[TracedMessage] | None = None  # the root's, made once

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1):
            stop = len(self) if index.stop is None else min(max(index.stop, 0), len(self))
            if index.stop is None or index.stop >= 0:
                return Signed(list.__getitem__(self, index), self.sigs[:stop],
                              self.chain[: stop + 1], self.root)
        return list.__getitem__(self, index)

    def traced(self) -> list[TracedMessage]:
        """The messages as a render shows them to the template (``wrapped``), found once for
        the request."""
        root = self.root
        if root.wrappers is None:
            root.wrappers = wrapped(root)
        return root.wrappers[: len(self)]


def wrapped(messages: list[dict[str, Any]]) -> list[TracedMessage]:
    """A ``TracedMessage`` per message. A wrapper holds no render's state (it reports to the
    run under way on its thread), so the wrapper of a message object at the same index is
    made once and serves every later request that re-sends that object."""
    hit = _WRAPPED.found(messages)
    k, out = (0, list[TracedMessage]()) if hit is None else (hit[0], list(hit[1][: hit[0]]))
    memo, rest = _WRAPPERS, messages[k:]
    for i, (m, w) in enumerate(zip(rest, memo.get_many(rest), strict=True), k):
        if w is None or w._i != i:
            w = memo.put(m, TracedMessage(m, i))
        out.append(w)
    _WRAPPED.keep(messages, tuple(out))
    return out


_WRAPPERS = IdMemo()  # a message (not changed in place: proxy/memo.py) -> its wrapper
_WRAPPED = PrefixMemo()  # messages -> their wrappers


def chain_of(sigs: list[Any], chain: list[int] | None = None) -> list[int]:
    """Hashes of every prefix of the signatures (index i: the first i); `chain`: those of the
    signatures before these, carried on."""
    chain = [0] if chain is None else chain
    for sig in sigs:
        chain.append(hash((chain[-1], sig)))
    return chain


def signed(messages: list[dict[str, Any]]) -> tuple[list[Any], list[int]]:
    """(``signatures``, ``chain_of`` them) of the messages: a history sent again carries on
    from what was found for it."""
    hit = _SIGNED.found(messages)
    n, sigs, chain = 0, list[Any](), None
    if hit is not None:
        n, (old_sigs, old_chain) = hit
        sigs, chain = list(old_sigs[:n]), list(old_chain[: n + 1])
    rest = signatures(messages[n:])
    sigs += rest
    chain = chain_of(rest, chain)
    _SIGNED.keep(messages, (tuple(sigs), tuple(chain)))
    return sigs, chain


_SIGNED = PrefixMemo()  # messages -> (their signatures, the chain)
