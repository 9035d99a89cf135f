"""The RAM tier: live states that had to give way, kept in host RAM (llama-server's --cache-ram).

When a slot's live KV is about to be replaced by another prompt's, the worker copies the part
a next request could reuse (its exact prompt tokens, cut back to a batch edge) here first. A
later request restores from here before it looks at the disk; the disk snapshots are written
as before, so nothing depends on this tier: it is a faster copy that may be gone.

Rules:
- An entry is a sequence state for exactly its `ids` (the exactness invariant holds: it was
  taken at a batch edge, as any snapshot), under the cache salt and tenant of the request that
  left it. A request gets only an entry of its own salt and tenant whose ids are a prefix of its
  prompt, the longest, at most `limit` tokens.
- The budget is in bytes (`--cache-ram MiB`: -1 no limit, 0 off). A new entry evicts the least
  valuable ones by the disk's value score (`policies.eviction.priority`) until it fits; one
  larger than the whole budget is not kept.
- An entry whose ids another entry's ids extend is superseded: putting the longer one drops the
  shorter; putting a shorter one beside a longer one keeps only the longer.
- An entry may hold a draft model's state of the same tokens beside the target's (llama-server's
  prompt cache keeps both): its size, budget and eviction count both; where the two together
  are larger than the whole budget, the target's is kept alone.
- A restored entry leaves the tier (the slot holds it live now; it comes back when it gives way
  again). An entry a prompt shares only part of stays: the worker restores it and cuts its copy
  back (`backend.worker.core`).

Thread-safety: used from the worker's compute thread only (`backend.worker.tiers`); `stats` is
read from the event loop (one dict build, no iteration over entries there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from policies.eviction import EntryView, priority


@dataclass(slots=True)
class RamEntry:
    salt: bytes
    tenant: str
    ids: np.ndarray
    state: memoryview
    created_s: float
    last_used_s: float
    hits: int = 0
    # a draft model's state of the same slot (backend.worker.draft_model), for exactly the
    # first `draft_n` of `ids`; none: 0 and empty
    draft_n: int = 0
    draft: memoryview = memoryview(b"")

    @property
    def size(self) -> int:
        return len(self.state) + len(self.draft)

    def view(self, key: int) -> EntryView:
        return EntryView(key.to_bytes(8, "big"), len(self.ids), self.size, "live",
                         self.created_s, self.last_used_s, self.hits, False)


@dataclass(slots=True)
class RamTier:
    budget: int  # bytes; < 0 no limit, 0 off
    entries: dict[int, RamEntry] = field(default_factory=dict)
    used: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("put", "hit", "evicted", "superseded", "too_big"), 0))
    _next: int = 0

    @classmethod
    def from_mib(cls, mib: int) -> RamTier:
        return cls(-1 if mib < 0 else mib << 20)

    @property
    def on(self) -> bool:
        return self.budget != 0

    def fits(self, nbytes: int) -> bool:
        """Whether a state of `nbytes` may be held in host RAM at all (the whole budget)."""
        return self.budget < 0 or 0 < nbytes <= self.budget

    def put(self, salt: bytes, tenant: str, ids: np.ndarray, state: memoryview,
            now_s: float | None = None, draft: tuple[int, memoryview] | None = None
            ) -> tuple[int | None, list[tuple[int, RamEntry]]]:
        """(the new entry's key, None where it is not kept; the entries it dropped).
        `draft`: (n, a draft model's state of the first n ids), kept with it."""
        if not self.on or len(ids) == 0:
            return None, []
        now = time.time() if now_s is None else now_s
        draft_n, draft_state = draft if draft is not None else (0, memoryview(b""))
        if 0 < self.budget < len(state) + len(draft_state):  # the draft model's state goes
            draft_n, draft_state = 0, memoryview(b"")  # first: it is the cheaper to prefill
        if 0 < self.budget < len(state):
            self.counts["too_big"] += 1
            return None, []
        dropped: list[tuple[int, RamEntry]] = []
        for k, e in list(self.entries.items()):
            if e.salt != salt or e.tenant != tenant:
                continue
            n = min(len(e.ids), len(ids))
            if not np.array_equal(e.ids[:n], ids[:n]):
                continue
            if len(e.ids) >= len(ids):  # a longer (or the same) one is here already
                self.counts["superseded"] += 1
                return None, dropped
            dropped.append((k, self._drop(k)))
            self.counts["superseded"] += 1
        key, self._next = self._next, self._next + 1
        entry = RamEntry(salt, tenant, np.array(ids, dtype=np.intc), state, now, now,
                         draft_n=draft_n, draft=draft_state)
        self.entries[key] = entry
        self.used += entry.size
        self.counts["put"] += 1
        if self.budget > 0:
            for k in sorted((k for k in self.entries if k != key),
                            key=lambda k: (priority(self.entries[k].view(k), now), k)):
                if self.used <= self.budget:
                    break
                dropped.append((k, self._drop(k)))
                self.counts["evicted"] += 1
        return key, dropped

    def longest(self, salt: bytes, tenant: str, ids: np.ndarray, limit: int) -> int:
        """Tokens of `ids` the longest usable entry holds (0 for none)."""
        k = self._find(salt, tenant, ids, limit)
        return 0 if k is None else len(self.entries[k].ids)

    def take(self, salt: bytes, tenant: str, ids: np.ndarray, limit: int, at_least: int = 1
             ) -> tuple[int, memoryview] | None:
        """The longest usable entry's (tokens, state), removed from the tier; None where the
        longest holds fewer than `at_least` tokens (it then stays)."""
        k = self._find(salt, tenant, ids, limit)
        if k is None or len(self.entries[k].ids) < at_least:
            return None
        e = self.entries[k]
        self.take_entry(k)
        return len(e.ids), e.state

    def of(self, salt: bytes, tenant: str) -> list[tuple[int, np.ndarray, memoryview]]:
        """Every entry's (key, ids, state) of this salt and tenant, left in the tier: the
        worker chooses among them (`policies.sources`), then takes the one it restores
        whole (`take_entry`); one a prompt shares only part of stays, its copy cut back."""
        return [(k, e.ids, e.state) for k, e in self.entries.items()
                if e.salt == salt and e.tenant == tenant]

    def take_entry(self, key: int) -> None:
        """The entry leaves the tier: a slot holds it live now (counted as a hit)."""
        self._drop(key)
        self.counts["hit"] += 1

    def stats(self) -> dict[str, int]:
        return {"budget_bytes": self.budget, "used_bytes": self.used,
                "entries": len(self.entries), **self.counts}

    def _find(self, salt: bytes, tenant: str, ids: np.ndarray, limit: int) -> int | None:
        best, best_n = None, 0
        for k, e in self.entries.items():
            n = len(e.ids)
            if (best_n < n <= min(limit, len(ids)) and e.salt == salt and e.tenant == tenant
                    and np.array_equal(e.ids, ids[:n])):
                best, best_n = k, n
        return best

    def _drop(self, key: int) -> RamEntry:
        e = self.entries.pop(key)
        self.used -= e.size
        return e
