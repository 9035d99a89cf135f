"""Routing: the idle slot that saves the most and drops the least; wait for a busy one only for
a clear win."""

from __future__ import annotations

import pytest

from policies.router import SlotView, choose_slot


def idle(worker_id: int, live_prefix: int) -> SlotView:
    return SlotView(worker_id, live_prefix, busy=False)


def busy(worker_id: int, live_prefix: int) -> SlotView:
    return SlotView(worker_id, live_prefix, busy=True)


def held(slot_id: int, live_prefix: int, live_tokens: int, used_s: float = 0.0,
         borrow: int = 0) -> SlotView:
    """An idle slot whose live KV holds live_tokens, of which live_prefix are this prompt's;
    its worker can copy `borrow` tokens of this prompt in from another slot."""
    return SlotView(slot_id, live_prefix, busy=False, live_tokens=live_tokens, used_s=used_s,
                    borrow=borrow)


def down(worker_id: int, live_prefix: int, is_busy: bool = False) -> SlotView:
    return SlotView(worker_id, live_prefix, busy=is_busy, ready=False)


@pytest.mark.parametrize(
    ("workers", "disk_hit", "expected"),
    [
        # No workers, or none ready (starting, restarting): nowhere to go.
        ([], 0, None),
        ([down(0, 5000), down(1, 0, is_busy=True)], 0, None),
        # One idle worker: it.
        ([idle(0, 0)], 0, 0),
        # Idle workers: the one whose live KV shares the most with the prompt.
        ([idle(0, 100), idle(1, 5000), idle(2, 300)], 0, 1),
        # Idle ties: lowest id.
        ([idle(2, 500), idle(1, 500), idle(3, 100)], 0, 1),
        # A worker that is not ready is skipped, however long its prefix.
        ([down(0, 30000), idle(1, 0)], 0, 1),
        # A busy worker 20000 tokens ahead of everything: worth the wait.
        ([idle(0, 0), busy(1, 20000)], 0, 1),
        # The disk hit nearly matches it (500 short): restore on the idle worker instead.
        ([idle(0, 0), busy(1, 20000)], 19500, 0),
        # Margin edges: ahead by exactly 1024 is not enough, 1025 is.
        ([idle(0, 0), busy(1, 20000)], 18976, 0),
        ([idle(0, 0), busy(1, 20000)], 18975, 1),
        # An idle worker's own live prefix counts as much as the disk hit.
        ([idle(0, 19500), busy(1, 20000)], 0, 0),
        ([idle(0, 18000), busy(1, 20000)], 0, 1),
        # Several busy: the longest one is the one worth waiting for.
        ([idle(0, 0), busy(1, 5000), busy(2, 9000)], 0, 2),
        # All busy: queue on the longest live prefix...
        ([busy(0, 100), busy(1, 3000), busy(2, 200)], 0, 1),
        # ...ties to the lowest id, whatever the disk hit.
        ([busy(3, 700), busy(1, 700)], 50000, 1),
        # All ready ones busy, a not-ready one idle: queue on a ready one.
        ([down(0, 9000), busy(1, 10)], 0, 1),
    ],
)
def test_choose_worker(workers: list[SlotView], disk_hit: int, expected: int | None) -> None:
    assert choose_slot(workers, disk_hit) == expected


MAIN, SUB = 20000, 8000  # live tokens of a main session and of a subagent


@pytest.mark.parametrize(
    ("slots", "disk_hit", "expected"),
    [
        # The main session's next turn: the slot whose live KV it extends.
        ([held(0, 0, 0), held(1, MAIN, MAIN), held(2, 0, SUB)], 0, 1),
        # A title request (shares its first block): the empty slot, never a session's.
        ([held(0, 64, MAIN), held(1, 0, 0), held(2, 0, SUB)], 0, 1),
        # No empty slot: the one holding the least (the subagent's), not the main session's.
        ([held(0, 0, MAIN), held(1, 0, SUB)], 0, 1),
        ([held(0, 64, MAIN), held(1, 0, SUB)], 0, 1),
        # A new subagent sharing 10K tokens of tools with the main session: the disk holds
        # them, so an empty slot restores them instead of dropping the main session's rest.
        ([held(0, 10000, MAIN), held(1, 0, 0)], 10000, 1),
        # Without that disk hit the main slot saves as much as it drops (0 = 0): the longer
        # live prefix wins the tie.
        ([held(0, 10000, MAIN), held(1, 0, 0)], 0, 0),
        # Equal slots: the least recently used, then the lowest id.
        ([held(0, 0, SUB, used_s=20.0), held(1, 0, SUB, used_s=10.0)], 0, 1),
        ([held(2, 0, 0), held(1, 0, 0)], 0, 1),
        # A busy slot far ahead is still worth the wait, as for workers.
        ([held(0, 0, 0), busy(1, MAIN)], 0, 1),
        # ... unless its worker copies it into the idle slot: no wait, no queue behind it.
        ([held(0, 0, 0, borrow=MAIN), busy(1, MAIN)], 0, 0),
        # A new subagent sharing 10K tokens with the idle main session's slot, nothing on disk:
        # where the worker copies between slots, the empty slot takes a copy (10000 - 0)
        # rather than the main slot dropping its other 10K (10000 - 10000).
        ([held(0, 10000, MAIN, borrow=0), held(1, 0, 0, borrow=10000)], 0, 1),
        # A title request shares nothing: the copy is worth nothing, the empty slot as before.
        ([held(0, 0, MAIN), held(1, 0, 0)], 0, 1),
    ],
)
def test_choose_slot(slots: list[SlotView], disk_hit: int, expected: int) -> None:
    assert choose_slot(slots, disk_hit) == expected


def test_margin_is_a_parameter() -> None:
    # With a 100-token margin, 500 tokens ahead of the disk hit is worth the wait.
    workers = [idle(0, 0), busy(1, 20000)]
    assert choose_slot(workers, 19500, margin_tokens=100) == 1

