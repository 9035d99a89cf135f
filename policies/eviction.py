"""Eviction order under a byte budget: which cache entries to delete, least valuable first.

An eviction strategy is one key function ``(entry, now_s) -> float``; higher means keep. The
``STRATEGIES`` dict maps its name to it:

- ``priority`` (default)::

      priority = (1 + hits) * 0.5 ** (age_s / HALF_LIFE_S)   # use, decayed by idleness
                 * tokens_per_mib                            # prefill saved per MiB of disk
                 * REASON_WEIGHT[reason]                      # anchors x4, others x1
                 * (CONTAINED_WEIGHT if superseded else 1)                   # x0.25

  with ``age_s = max(0, now_s - last_used_s)`` and ``tokens_per_mib = n_tokens * 2**20 /
  size_bytes``. The ``1 +`` keeps a fresh, never-hit entry above zero so that recency still
  orders such entries. Anchors (``cold``, ``anchor-refresh``) are the stable preambles that every
  new session of an agent hits first, so they are weighted up. A ``continued`` checkpoint or a
  ``growing`` turn end whose tokens a newer entry's prefix contains is *superseded*: a waypoint,
  or an earlier turn of a conversation that went on; it is weighted down.
- ``lru``: ``last_used_s`` (least recently used goes first).
- ``lfu``: ``(hits, last_used_s)`` flattened to ``hits * 1e10 + last_used_s`` (fewest hits first,
  the least recently used among equals; exact while ``last_used_s < 1e10``, i.e. until 2286).

``evict_until`` deletes in ascending key order (ties: older ``last_used_s``, then key bytes, so
the order is deterministic) until the total size fits the budget. A protected key (the entry
just written) is never chosen, even if the budget cannot be met without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

HALF_LIFE_S = 3600.0  # an idle hour halves an entry's accumulated hits
REASON_WEIGHT: dict[str, float] = {"cold": 4.0, "anchor-refresh": 4.0}
CONTAINED_WEIGHT = 0.25  # a superseded entry: see the module docstring
SUPERSEDABLE = frozenset({"continued", "growing"})
_LFU_HITS_SCALE = 1e10  # seconds; above any last_used_s, so hits dominate


@dataclass(frozen=True, slots=True)
class EntryView:
    key: bytes
    n_tokens: int
    size_bytes: int
    reason: str
    created_s: float
    last_used_s: float
    hits: int
    contained_in_newer: bool  # a newer entry's token prefix contains this one (caller computes)


def priority(e: EntryView, now_s: float) -> float:
    """Keep-value of an entry (higher = keep); the formula is in the module docstring."""
    age_s = max(0.0, now_s - e.last_used_s)
    use = (1 + e.hits) * math.pow(0.5, age_s / HALF_LIFE_S)
    tokens_per_mib = e.n_tokens * 2**20 / max(e.size_bytes, 1)
    superseded = e.reason in SUPERSEDABLE and e.contained_in_newer
    return (
        use
        * tokens_per_mib
        * REASON_WEIGHT.get(e.reason, 1.0)
        * (CONTAINED_WEIGHT if superseded else 1.0)
    )


STRATEGIES: dict[str, Callable[[EntryView, float], float]] = {
    "priority": priority,
    "lru": lambda e, now_s: e.last_used_s,
    "lfu": lambda e, now_s: e.hits * _LFU_HITS_SCALE + e.last_used_s,
}


def evict_until(
    entries: Sequence[EntryView],
    budget_bytes: int,
    now_s: float,
    protect: Collection[bytes] = (),
    strategy: str = "priority",
) -> list[bytes]:
    """Keys to delete, lowest keep-value first, until the total size is within the budget."""
    key_fn = STRATEGIES.get(strategy)
    if key_fn is None:
        raise ValueError(
            f"unknown eviction strategy {strategy!r}: use one of {', '.join(STRATEGIES)}"
        )
    total = sum(e.size_bytes for e in entries)
    victims = sorted(
        (e for e in entries if e.key not in protect),
        key=lambda e: (key_fn(e, now_s), e.last_used_s, e.key),
    )
    doomed: list[bytes] = []
    for e in victims:
        if total <= budget_bytes:
            break
        doomed.append(e.key)
        total -= e.size_bytes
    return doomed
