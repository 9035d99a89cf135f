"""Routing: longest live prefix among idle workers; wait for a busy one only for a clear win."""

from __future__ import annotations

import pytest

from policies.router import WorkerView, choose_worker


def idle(worker_id: int, live_prefix: int) -> WorkerView:
    return WorkerView(worker_id, live_prefix, busy=False)


def busy(worker_id: int, live_prefix: int) -> WorkerView:
    return WorkerView(worker_id, live_prefix, busy=True)


def down(worker_id: int, live_prefix: int, is_busy: bool = False) -> WorkerView:
    return WorkerView(worker_id, live_prefix, busy=is_busy, ready=False)


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
def test_choose_worker(workers: list[WorkerView], disk_hit: int, expected: int | None) -> None:
    assert choose_worker(workers, disk_hit) == expected


def test_margin_is_a_parameter() -> None:
    # With a 100-token margin, 500 tokens ahead of the disk hit is worth the wait.
    workers = [idle(0, 0), busy(1, 20000)]
    assert choose_worker(workers, 19500, margin_tokens=100) == 1
