"""Ring: most recent first, per tenant, bounded in total, stores copies."""

from __future__ import annotations

import pytest

from policies.ring import Ring


def test_recent_is_most_recent_first_and_bounded_by_n() -> None:
    ring = Ring()
    for i in range(5):
        ring.push("t", [i, i])
    # The three newest, newest first.
    assert ring.recent("t", 3) == [(4, 4), (3, 3), (2, 2)]
    # Asking for more than there is gives all of them.
    assert ring.recent("t", 10) == [(4, 4), (3, 3), (2, 2), (1, 1), (0, 0)]
    # Asking for none gives none.
    assert ring.recent("t", 0) == []
    assert len(ring) == 5


def test_tenants_are_isolated() -> None:
    ring = Ring()
    ring.push("a", [1])
    ring.push("b", [2])
    ring.push("a", [3])
    # Each tenant sees only its own prompts, in its own recency order.
    assert ring.recent("a", 5) == [(3,), (1,)]
    assert ring.recent("b", 5) == [(2,)]
    # A tenant never seen has nothing.
    assert ring.recent("c", 5) == []


def test_capacity_is_shared_and_drops_the_oldest() -> None:
    ring = Ring(capacity=3)
    ring.push("a", [1])  # oldest: dropped by the fourth push
    ring.push("b", [2])
    ring.push("a", [3])
    ring.push("a", [4])
    assert len(ring) == 3
    assert ring.recent("a", 5) == [(4,), (3,)]
    assert ring.recent("b", 5) == [(2,)]
    ring.push("a", [5])  # now b's only prompt is the oldest and goes
    assert ring.recent("b", 5) == []
    assert len(ring) == 3


def test_push_stores_a_copy() -> None:
    ring = Ring()
    ids = [1, 2, 3]
    ring.push("t", ids)
    ids.append(4)
    # Later changes to the caller's list do not reach the ring, which holds a tuple.
    assert ring.recent("t", 1) == [(1, 2, 3)]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Ring(capacity=0)
