"""Work remembered across requests, for the history agents re-send every turn.

    TextMemo   results of a pure function of strings (regexes over a long system prompt),
               bounded by the characters of its keys
    IdMemo     results of a pure function of one object, by that object's identity: the
               messages a body shares with the previous one are the same objects
               (proxy/limits.py reuses them), so each later stage does its work once per message
    PrefixMemo what a stage that works through a list from its front kept of the last few
               lists: a history sent again with a new turn takes the work done on the history
               (found by the items' identity, in C) and does only the new turn's

Both forget the oldest first, a quarter at a time (a dict rebuilt once, not one entry popped
off the front per put: that scans the deleted entries again every time), and are
thread-safe. A value found is the value the function gave for this very key: an IdMemo keeps
its keys alive, so an id is never reused under it.
What they hold must not be changed by whoever gets it (nothing on the request path changes a
message in place).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from itertools import compress, count, islice
from typing import Any

_MISSING = object()


class TextMemo:
    def __init__(self, max_chars: int = 64 << 20) -> None:
        self.max_chars = max_chars
        self._data: dict[Any, tuple[Any, int]] = {}
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        hit = self._data.get(key)
        return default if hit is None else hit[0]

    def put(self, key: Any, value: Any, chars: int) -> None:
        with self._lock:
            if key in self._data or chars > self.max_chars:
                return
            self._data[key] = (value, chars)
            self._chars += chars
            if self._chars > self.max_chars:  # the oldest out, down to three quarters
                drop, n = self._chars - self.max_chars * 3 // 4, 0
                for _, gone in self._data.values():
                    drop -= gone
                    self._chars -= gone
                    n += 1
                    if drop <= 0:
                        break
                self._data = dict(islice(self._data.items(), n, None))


class IdMemo:
    def __init__(self, max_entries: int = 1 << 14) -> None:
        self.max_entries = max_entries
        self._data: dict[int, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        hit = self._data.get(id(key))
        return hit[1] if hit is not None and hit[0] is key else default

    def get_many(self, keys: Any, default: Any = None) -> list[Any]:
        """``[self.get(k, default) for k in keys]``, in one call (a history's messages)."""
        data = self._data
        out = []
        for key in keys:
            hit = data.get(id(key))
            out.append(hit[1] if hit is not None and hit[0] is key else default)
        return out

    def put(self, key: Any, value: Any) -> Any:
        with self._lock:
            self._data[id(key)] = (key, value)
            if len(self._data) > self.max_entries:  # the oldest quarter out
                self._data = dict(islice(self._data.items(), self.max_entries // 4, None))
        return value


class PrefixMemo:
    """What a stage kept, per item, of the last `entries` lists it worked on, found again for a
    list that begins with the same objects as one of them (the history a client re-sends, with
    another last turn or a new one): the stage takes its work on the shared items and does the
    rest.

        found(items) -> (k, kept) | None     the remembered list that shares the most leading
                                             items with `items` (k of them, by identity)
        keep(items, kept)
    """

    def __init__(self, entries: int = 8) -> None:
        self.entries = entries
        self._kept: list[tuple[list[Any], Any]] = []
        self._last: tuple[Sequence[Any], list[tuple[list[Any], Any]], list[int]] | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _shared(kept: list[tuple[list[Any], Any]], items: Sequence[Any]) -> list[int]:
        """Per remembered list, how many of its leading items are items' (the first that is not
        the same object, found in C); -1 for one that shares no more than a list before it and
        is longer than what it shares by more than one (neither found nor carried on: not
        scanned, as it parts from `items` where the best so far does)."""
        out, best, n = [], 0, len(items)
        for old, _ in kept:
            m = min(len(old), n)
            if best and len(old) - 1 > best and (m <= best or old[best] is not items[best]):
                out.append(-1)
                continue
            k = next(compress(count(), map(operator.is_not, old, items)), m)
            out.append(k)
            best = max(best, k)
        return out

    def found(self, items: Sequence[Any]) -> tuple[int, Any] | None:
        kept = self._kept
        shared = self._shared(kept, items)
        self._last = (items, kept, shared)  # for keep(items, ...) right after
        k = max(shared, default=0)
        return (k, kept[shared.index(k)][1]) if k else None

    def carried(self, items: Sequence[Any], memo: IdMemo, make: Callable[[int, Any], Any]
                ) -> list[Any]:
        """Per item, `memo`'s value for it, made by ``make(index, item)`` where it has none:
        the leading items a remembered list shares are taken from it, and only the rest are
        looked up (the history a client re-sends, then its new turn). `items` is kept."""
        hit = self.found(items)
        k, done = (0, []) if hit is None else (hit[0], list(hit[1][: hit[0]]))
        rest = items[k:]
        for i, (item, value) in enumerate(zip(rest, memo.get_many(rest, _MISSING),
                                              strict=True), k):
            done.append(memo.put(item, make(i, item)) if value is _MISSING else value)
        self.keep(items, tuple(done))
        return done

    def keep(self, items: Sequence[Any], kept: Any) -> None:
        """`items` remembered first; a remembered list it carries on (all its items, or all but
        its last: the same history with another last turn) is let go, so that a session's
        turns hold one entry, not one each, and `found` scans one long list a session."""
        if not items:
            return
        with self._lock:
            last, now = self._last, self._kept
            shared = last[2] if last is not None and last[0] is items and last[1] is now \
                else self._shared(now, items)
            old = [e for e, k in zip(now, shared, strict=True) if k < len(e[0]) - 1]
            self._kept = [(list(items), kept), *old[: self.entries - 1]]
            self._last = None
