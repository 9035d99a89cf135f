"""decide(): the whole cache decision for one request, from one read of the index, as one value.

    decide(facts, stored, worker, recent, knobs) -> Plan

Inputs, all plain data:

- ``facts`` (:class:`Facts`): the prompt's token ids and message starts, and the effective scope
  (``off`` when the proxy runs without a disk cache).
- ``stored`` (:class:`Stored`): one read of the cache for this prompt: every stored entry that is
  a prefix of it (the radix tree, ``policies.radix``): the longest few as hits (at most
  ``RESTORE_CANDIDATES``: the hit and its fallbacks), and the set of their positions.
- ``worker`` (:class:`WorkerFacts`): what the chosen worker's live KV holds of this prompt (what
  its memory can keep of it), whether it may be reused at all (the live KV is this tenant's),
  and whether its memory can cut a restored snapshot back (not a recurrent state, not a
  sliding window: a snapshot holds only the window behind its last position).
- ``recent``: this tenant's recent prompts, most recent first (the ring; only ``auto`` reads
  it, its first ``scope.window`` entries).
- ``knobs``: :class:`policies.plan.CacheKnobs`.
- ``worker.costs``: the worker's measured prefill and restore costs (``policies.costs``), or
  None before it reported any.

Rules (the positions themselves are ``policies.plan``'s):

1. A hit replays the cold run's batches (``backend.engine``'s rules): every reuse, restore and
   save point is an edge of this prompt's batches (``worker.batching``,
   ``policies.prefix.Batching``: at most the batch size apart, and at message ends), and at
   least the prompt's last token is evaluated. ``keep_max`` is the last batch edge before the
   last token; the live reuse is rounded down to a batch edge, only entries at edges are
   offered, and save points are rounded down (7). A worker whose start-up
   self-check failed (``worker.exact`` false) reuses nothing: ``keep_max`` 0, no live reuse,
   no restore, no save, ``lookup = "off"``.
2. ``off``: nothing is restored or saved; ``lookup = "off"``.
3. Otherwise the scope boundary is ``choose_scope_boundary`` over the window (exactly the
   longest shared token prefix, for ``auto``); the reused prefix is the longer of the live reuse
   and the longest stored entry; ``plan_saves`` picks the save points (``growing``: the end of a
   chat turn, which the client's next turn extends, or of a raw prompt that extends a recent
   one), including any behind the
   reuse, which the worker snapshots from the KV it holds.
4. ``restore``: the stored entries a prompt may start from, as ``policies.sources.choose_start``
   orders them (the rule the worker follows too): longer than the live reuse, longest first,
   only where restoring pays (its estimated restore time from its size, at its tier's cost,
   below the estimated prefill from the live reuse to its end); the longest one that does not
   pay is named in ``restore_skipped``, for the log line and a metric. The worker tries them in
   order, so a broken file falls back to the next one. Each names its tier (``disk``, or
   ``shared``: pulled from the shared tier first).
5. ``lookup``: ``hit`` when the longest entry reaches the scope boundary (with no boundary: the
   last message start) or ``keep_max``, ``partial`` for a shorter one (e.g. only the anchor),
   ``miss`` for none.
6. A memory that cannot cut a restored snapshot back (``worker.cut_back`` false: a recurrent
   state exists only at its last position, a window snapshot holds only the window behind it)
   could never use an entry past ``keep_max``: it is not offered for restore (the next shorter
   one is), and a save point past ``keep_max`` (the prompt end of a growing conversation,
   ``full``) is taken at ``keep_max`` instead: the next turn, which extends the prompt,
   restores it and prefills two more tokens, and the same prompt sent again can use it too.
   No save behind the reuse is planned (it would need the live state cut back).
7. Each save point is rounded down to a batch edge (none at 0, none already stored), the
   strongest reason kept per position.

A save names its position and reason; the worker keys the file (``backend.keys``, salted with the
job's salt), and its ``Saved`` event tells the proxy the key.

The :class:`Plan` has one wire form (``to_wire`` / ``from_wire``), shared by proxy and worker;
``from_wire`` takes every field or raises ``ValueError``: the worker has no defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from policies.costs import Costs
from policies.plan import (
    CacheKnobs,
    MessageStart,
    Reason,
    anchor_position,
    awaits_reply,
    choose_scope_boundary,
    extends_recent,
    plan_saves,
    strongest,
)
from policies.prefix import Batching
from policies.scope import Scope
from policies.sources import COST_SOURCE, Candidate, Tier, choose_start

Lookup = Literal["hit", "partial", "miss", "off"]

RESTORE_FALLBACKS = 2  # shorter entries the worker may try after a broken one
RESTORE_CANDIDATES = 1 + RESTORE_FALLBACKS  # stored entries read per request, longest first


@dataclass(frozen=True, slots=True)
class Facts:
    ids: Sequence[int]  # policies.prefix.TokenIds from a render
    message_starts: tuple[MessageStart, ...]
    scope: Scope  # effective: "off" when there is no disk cache


@dataclass(frozen=True, slots=True)
class Hit:
    n_tokens: int  # the entry holds KV for exactly this many tokens
    key: bytes
    file: str  # relative to the cache directory ("" for a shared entry not pulled yet)
    size_bytes: int = 0  # its state file's size (0: not known)
    tier: Tier = "disk"  # disk, or shared (the worker pulls it first)


@dataclass(frozen=True, slots=True)
class Stored:
    hits: tuple[Hit, ...] = ()  # stored prefixes of the prompt, longest first (a few)
    positions: frozenset[int] = frozenset()  # every stored prefix's position

    @property
    def longest(self) -> int:
        return self.hits[0].n_tokens if self.hits else 0


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    live_n: int  # tokens of this prompt the worker's live KV holds (and its memory can keep)
    live_ok: bool  # the live KV is this tenant's: it may be reused
    cut_back: bool = True  # its memory can cut a restored snapshot back (plain attention)
    batching: Batching = Batching()  # its prefill batches: reuse only at their edges
    exact: bool = True  # its start-up self-check passed (false: it reuses nothing)
    costs: Costs | None = None  # its measured costs (None: none reported yet)


@dataclass(frozen=True, slots=True)
class Restore:
    n_tokens: int
    key: bytes
    file: str  # relative to the cache directory ("" for a shared entry: pulled to its own)
    size_bytes: int = 0  # its state's size (0: not known)
    tier: Tier = "disk"  # disk or shared


@dataclass(frozen=True, slots=True)
class Save:
    n_tokens: int
    reason: Reason


@dataclass(frozen=True, slots=True)
class Plan:
    restore: tuple[Restore, ...]  # longest first, each longer than the live reuse
    saves: tuple[Save, ...]  # ascending n_tokens
    keep_max: int  # reuse (live or restored) at most this many tokens
    live_ok: bool  # the worker may keep its live KV
    lookup: Lookup
    boundary: int | None  # the scope boundary, for the log line
    anchor_skipped: str | None  # why a cold anchor was not saved, for the log line
    restore_skipped: str | None = None  # an entry not restored because prefill is faster

    def to_wire(self) -> dict[str, Any]:
        return {
            "restore": [{"n_tokens": r.n_tokens, "key": r.key.hex(), "file": r.file,
                         "size_bytes": r.size_bytes, "tier": r.tier} for r in self.restore],
            "saves": [{"n_tokens": s.n_tokens, "reason": s.reason} for s in self.saves],
            "keep_max": self.keep_max,
            "live_ok": self.live_ok,
            "lookup": self.lookup,
            "boundary": self.boundary,
            "anchor_skipped": self.anchor_skipped,
            "restore_skipped": self.restore_skipped,
        }

    @classmethod
    def from_wire(cls, d: Any) -> Plan:
        """The plan a proxy sent; every field is required and typed (``ValueError`` otherwise)."""
        try:
            lookup = d["lookup"]
            if lookup not in get_args(Lookup):
                raise ValueError(f"unknown lookup {lookup!r}")
            saves = tuple(Save(_int(s["n_tokens"]), s["reason"]) for s in _list(d["saves"]))
            if any(s.reason not in get_args(Reason) for s in saves):
                raise ValueError("unknown save reason")
            restore = tuple(Restore(_int(r["n_tokens"]), bytes.fromhex(_str(r["key"])),
                                    _str(r["file"]), _int(r["size_bytes"]), r["tier"])
                            for r in _list(d["restore"]))
            if any(r.tier not in ("disk", "shared") for r in restore):
                raise ValueError("unknown restore tier")
            return cls(
                restore=restore,
                saves=saves,
                keep_max=_int(d["keep_max"]),
                live_ok=_bool(d["live_ok"]),
                lookup=lookup,
                boundary=None if d["boundary"] is None else _int(d["boundary"]),
                anchor_skipped=None if d["anchor_skipped"] is None else _str(d["anchor_skipped"]),
                restore_skipped=None if d["restore_skipped"] is None
                else _str(d["restore_skipped"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed plan: {type(e).__name__} {e}") from None


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected an integer, got {v!r}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError(f"expected a list, got {v!r}")
    return v


def decide(
    facts: Facts,
    stored: Stored,
    worker: WorkerFacts,
    recent: Sequence[Sequence[int]],
    knobs: CacheKnobs,
) -> Plan:
    """The plan for one request; the rules are in the module docstring."""
    ids, scope = facts.ids, facts.scope
    n = len(ids)
    if not worker.exact:
        return Plan((), (), 0, False, "off", None, None)
    edges = worker.batching.edges(ids)
    keep_max = edges.keep_max
    live_n = edges.floor(worker.live_n if worker.live_ok else 0)
    if scope.kind == "off":
        return Plan((), (), keep_max, worker.live_ok, "off", None, None)
    window = recent[: scope.window] if scope.kind == "auto" else ()
    boundary = choose_scope_boundary(ids, scope, window, knobs)
    hits = [h for h in stored.hits
            if (worker.cut_back or h.n_tokens <= keep_max) and h.n_tokens in edges]
    every = worker.batching.size <= 1
    positions = stored.positions if worker.cut_back and every else edges.among(
        stored.positions, edges.n if worker.cut_back else keep_max)  # entries it can use
    disk_n = hits[0].n_tokens if hits else 0
    cached_n = min(max(live_n, disk_n), keep_max)
    planned = plan_saves(n, cached_n, scope, boundary, anchor_position(facts.message_starts),
                         positions, knobs,
                         growing=awaits_reply(facts.message_starts)
                         or extends_recent(ids, window))
    saves, anchor_skipped = planned.saves, planned.anchor_skipped
    if not worker.cut_back:  # rule 6: past keep_max taken at keep_max, none behind the reuse
        saves = strongest((p, s.reason) for s in saves
                          if (p := min(s.n_tokens, keep_max)) > cached_n and p not in positions)
    if not every:  # rule 7: rounded down to batch edges
        saves = strongest((p, s.reason) for s in saves
                          if (p := edges.floor(s.n_tokens)) > 0 and p not in positions)
    target = boundary or max((s.pos for s in facts.message_starts), default=n)
    lookup: Lookup = ("miss" if disk_n == 0 else "hit" if disk_n >= min(target, keep_max)
                      else "partial")
    start = choose_start(live_n, [Candidate(h.tier, h.n_tokens, True, h.size_bytes, i)
                                  for i, h in enumerate(hits)], keep_max, worker.cut_back,
                         worker.costs)
    skipped = None
    if start.skipped is not None:
        h, c = hits[start.skipped.ref], worker.costs
        assert c is not None  # without costs every restore pays
        restore_s = c.restore_s(h.size_bytes, COST_SOURCE[h.tier])
        skipped = (f"{h.n_tokens} tokens: restore ~{restore_s:.3f} s >= prefill "
                   f"~{c.prefill_s(live_n, min(h.n_tokens, keep_max)):.3f} s")
    return Plan(
        restore=tuple(Restore(h.n_tokens, h.key, h.file, h.size_bytes, h.tier)
                      for h in (hits[c.ref] for c in start.order)),
        saves=tuple(Save(s.n_tokens, s.reason) for s in saves),
        keep_max=keep_max,
        live_ok=worker.live_ok,
        lookup=lookup,
        boundary=boundary,
        anchor_skipped=anchor_skipped,
        restore_skipped=skipped,
    )

