"""Worker routing: which worker runs a prompt, given each worker's live prefix and the disk hit.

Rules, among ready workers only (``None`` when none is ready):

1. If some ready worker is idle, the best idle one is the longest ``live_prefix`` (ties: lowest
   ``worker_id``). It runs the prompt now, restoring from disk if the disk hit is longer than
   what it holds live.
2. A busy worker is worth waiting for only when its live prefix beats both ``disk_hit`` and the
   best idle live prefix by more than ``margin_tokens`` (default ``WAIT_MARGIN_TOKENS`` = 1024):
   that many tokens of prefill saved is worth a queue wait; anything less is not, and waiting
   would pile sessions onto one worker (the load-imbalance guard). Then the busy worker with the
   longest live prefix is chosen (ties: lowest id) and the caller queues on it.
3. If no ready worker is idle, the ready worker with the longest live prefix (ties: lowest id);
   the caller queues on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WAIT_MARGIN_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: int
    live_prefix: int  # tokens of this prompt its live KV already holds (caller computes)
    busy: bool
    ready: bool = True


def _best(workers: Sequence[WorkerView]) -> WorkerView | None:
    """Longest live prefix, lowest id on ties; None for no workers."""
    return max(workers, key=lambda w: (w.live_prefix, -w.worker_id), default=None)


def choose_worker(
    workers: Sequence[WorkerView], disk_hit: int, margin_tokens: int = WAIT_MARGIN_TOKENS
) -> int | None:
    """Id of the worker to run (or queue) the prompt on, or ``None`` if no worker is ready."""
    ready = [w for w in workers if w.ready]
    idle = _best([w for w in ready if not w.busy])
    busy = _best([w for w in ready if w.busy])
    if idle is None:
        return busy.worker_id if busy is not None else None
    if busy is not None and busy.live_prefix > max(disk_hit, idle.live_prefix) + margin_tokens:
        return busy.worker_id
    return idle.worker_id
