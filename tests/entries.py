"""Reading one index entry in a test: the index itself has no point lookup (the proxy finds
entries by token ids in its radix forest), so a test reads the entries whole."""

from __future__ import annotations

from backend.index import Entry, Index


def entry_of(index: Index, key: bytes) -> Entry | None:
    return dict(index.entries()).get(key)  # type: ignore[call-overload]
