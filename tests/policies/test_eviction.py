"""Eviction: exact priorities, exact deletion orders per strategy, the protected key."""

from __future__ import annotations

import pytest

from policies.eviction import STRATEGIES, EntryView, evict_until, priority

NOW = 100_000.0
HOUR = 3600.0
UNIT = 1000 * 16384  # a 1000-token entry at 16 KiB per token: 64 tokens per MiB


def entry(
    key: str,
    reason: str,
    hits: int,
    idle_s: float,
    contained: bool = False,
    size_bytes: int = UNIT,
) -> EntryView:
    return EntryView(
        key=key.encode(),
        n_tokens=1000,
        size_bytes=size_bytes,
        reason=reason,
        created_s=NOW - 10 * HOUR,
        last_used_s=NOW - idle_s,
        hits=hits,
        contained_in_newer=contained,
    )


# priority = (1 + hits) * 0.5 ** (idle / 1h) * tokens_per_MiB * weights
A = entry("A", "scoped", hits=0, idle_s=0)  # 1 * 1 * 64 = 64
B = entry("B", "scoped", hits=5, idle_s=2 * HOUR)  # 6 * 1/4 * 64 = 96: old hits, decayed
C = entry("C", "cold", hits=0, idle_s=HOUR)  # 1 * 1/2 * 64 * 4 (anchor) = 128
D = entry("D", "continued", hits=1, idle_s=0, contained=True)  # 2 * 64 * 1/4 (superseded) = 32
E = entry("E", "continued", hits=0, idle_s=HOUR)  # 1 * 1/2 * 64 = 32, ties with D
F = entry("F", "scoped", hits=0, idle_s=0, size_bytes=4 * UNIT)  # 16 tokens per MiB: 16
G = entry("G", "full", hits=10, idle_s=0)  # 11 * 64 = 704
ENTRIES = [A, B, C, D, E, F, G]  # 10 UNITs in total (F is 4)


@pytest.mark.parametrize(
    ("e", "expected"),
    [(A, 64.0), (B, 96.0), (C, 128.0), (D, 32.0), (E, 32.0), (F, 16.0), (G, 704.0)],
)
def test_priority(e: EntryView, expected: float) -> None:
    assert priority(e, NOW) == pytest.approx(expected)


def test_priority_of_a_contained_entry_that_is_not_continued_is_not_lowered() -> None:
    # Only waypoints and earlier turn ends are superseded by a newer entry; an anchor stays an
    # anchor, a scope boundary stays a scope boundary.
    contained_anchor = entry("X", "anchor-refresh", hits=0, idle_s=0, contained=True)
    assert priority(contained_anchor, NOW) == pytest.approx(256.0)
    assert priority(entry("S", "scoped", hits=0, idle_s=0, contained=True), NOW) == \
        pytest.approx(64.0)


def test_an_earlier_turn_end_that_a_newer_entry_contains_is_superseded() -> None:
    assert priority(entry("T", "growing", hits=0, idle_s=0, contained=True), NOW) == \
        pytest.approx(16.0)  # 1 * 64 * 1/4
    assert priority(entry("T", "growing", hits=0, idle_s=0), NOW) == pytest.approx(64.0)


@pytest.mark.parametrize(
    ("budget_bytes", "protect", "expected"),
    [
        # Within budget: nothing goes.
        (10 * UNIT, (), []),
        # One unit over: the lowest priority entry (F, bulky per token) frees enough.
        (9 * UNIT, (), [b"F"]),
        # F frees 4; then E before D (same priority, E idle longer).
        (5 * UNIT, (), [b"F", b"E"]),
        (3 * UNIT, (), [b"F", b"E", b"D", b"A"]),
        # Budget 0: everything, lowest priority first.
        (0, (), [b"F", b"E", b"D", b"A", b"B", b"C", b"G"]),
        # F was just written: protected, so the others go instead.
        (9 * UNIT, (b"F",), [b"E"]),
        (5 * UNIT, (b"F",), [b"E", b"D", b"A", b"B", b"C"]),
        # The budget cannot be met without the protected key: all others, never it.
        (0, (b"G",), [b"F", b"E", b"D", b"A", b"B", b"C"]),
    ],
)
def test_evict_until(budget_bytes: int, protect: tuple[bytes, ...], expected: list[bytes]) -> None:
    assert evict_until(ENTRIES, budget_bytes, NOW, protect) == expected


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        # Priority, as above.
        ("priority", [b"F", b"E", b"D", b"A", b"B", b"C", b"G"]),
        # LRU: idlest first (B 2h; C and E 1h, key order; then the rest, key order).
        ("lru", [b"B", b"C", b"E", b"A", b"D", b"F", b"G"]),
        # LFU: fewest hits first (C, E, A, F have 0: idlest first, then key order), then D (1),
        # B (5), G (10).
        ("lfu", [b"C", b"E", b"A", b"F", b"D", b"B", b"G"]),
    ],
)
def test_strategies_order(strategy: str, expected: list[bytes]) -> None:
    assert evict_until(ENTRIES, 0, NOW, strategy=strategy) == expected


def test_strategy_names() -> None:
    assert sorted(STRATEGIES) == ["lfu", "lru", "priority"]


def test_unknown_strategy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown eviction strategy 'fifo': use one of priority"):
        evict_until(ENTRIES, 0, NOW, strategy="fifo")
