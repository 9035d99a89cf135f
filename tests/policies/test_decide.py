"""decide(): the whole cache decision for one request as one Plan value; the Plan's wire form."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, get_args

import pytest

from policies.decide import (
    RESTORE_CANDIDATES,
    Facts,
    Hit,
    Lookup,
    Plan,
    Restore,
    Save,
    Stored,
    WorkerFacts,
    decide,
)
from policies.plan import CacheKnobs, MessageStart, Reason
from policies.prefix import Batching
from policies.scope import Scope, parse_scope

S, U, A = "system", "user", "assistant"

# A 40-token prompt: the system prompt at 0, a first user message at 5, a second one at 10 (the
# anchor: the last user message before the first reply), the reply at 20, the next user turn at 30
# (the last message start: the lookup target when there is no scope boundary), and the prompt end
# at 40. Every id is >= 1000, so the filler 9 of diverge() never matches one. keep_max is always
# n - 1 = 39 (never capped: a save point behind the reuse is snapshotted from the KV held).
N = 40
STARTS = (MessageStart(0, S), MessageStart(5, U), MessageStart(10, U), MessageStart(20, A),
          MessageStart(30, U))
ANCHOR, LAST_START = 10, 30
# Small knobs: boundaries from 4 tokens, a cold anchor up to 1000, no continued checkpoints.
K = CacheKnobs(min_tokens=4, cold_max_tokens=1000, continued_interval_tokens=0)
K15 = CacheKnobs(min_tokens=4, cold_max_tokens=1000, continued_interval_tokens=15)
K10 = CacheKnobs(min_tokens=4, cold_max_tokens=1000, continued_interval_tokens=10)


RECURRENT = WorkerFacts(0, True, cut_back=False)  # a recurrent state or a sliding window
# reuses only at multiples of 8 (its batch; no end-of-turn ids, so no early edges)
ALIGNED = WorkerFacts(0, True, batching=Batching(8))


def prompt(n: int = N) -> tuple[int, ...]:
    return tuple(range(1000, 1000 + n))


IDS = prompt()


def diverge(at: int, n: int = N) -> tuple[int, ...]:
    """A prompt as long as this one that shares exactly its first ``at`` ids."""
    return prompt(n)[:at] + (9,) * (n - at)


def facts(spec: str | Scope, n: int = N) -> Facts:
    scope = parse_scope(spec) if isinstance(spec, str) else spec
    return Facts(prompt(n), tuple(s for s in STARTS if s.pos < n), scope)


def key(p: int) -> bytes:
    return b"k%d" % p


def file(p: int) -> str:
    return f"{p}.state"


def stored(*positions: int) -> Stored:
    """The cache holds entries at ``positions`` (all prefixes of the prompt); as in proxy.cache,
    ``hits`` are the longest ``RESTORE_CANDIDATES`` of them and ``positions`` all of them."""
    longest = sorted(positions, reverse=True)[:RESTORE_CANDIDATES]
    return Stored(tuple(Hit(p, key(p), file(p)) for p in longest), frozenset(positions))


def restores(*positions: int) -> tuple[Restore, ...]:
    return tuple(Restore(p, key(p), file(p)) for p in positions)


def saves(*points: tuple[int, Reason]) -> tuple[Save, ...]:
    return tuple(Save(p, reason) for p, reason in points)


COLD = WorkerFacts(live_n=0, live_ok=True)

# A prompt long enough that live reuse can pass its scope boundary 30 by thousands of tokens.
N_LONG = 3000

DECIDE_CASES: list[tuple[Facts, Sequence[Sequence[int]], Stored, WorkerFacts, CacheKnobs, Plan]] = [
    # --- off: no disk cache for this request --------------------------------------------------
    # Nothing restored or saved, whatever the ring and the live KV hold; the worker may keep its
    # live KV up to the last two tokens; live_ok is passed through.
    (
        facts("off"), [IDS[:30]], stored(), WorkerFacts(25, True), K,
        Plan(restore=(), saves=(), keep_max=39, live_ok=True, lookup="off", boundary=None,
             anchor_skipped=None),
    ),
    # ...and another tenant's live KV stays unusable.
    (
        facts("off"), [], stored(), WorkerFacts(25, False), K,
        Plan(restore=(), saves=(), keep_max=39, live_ok=False, lookup="off", boundary=None,
             anchor_skipped=None),
    ),
    # off ignores stored entries too (the proxy does not read the cache then anyway).
    (
        facts("off"), [], stored(10, 30), COLD, K,
        Plan(restore=(), saves=(), keep_max=39, live_ok=True, lookup="off", boundary=None,
             anchor_skipped=None),
    ),
    # A one-token prompt: keep_max is 0, never negative.
    (
        facts("off", n=1), [], stored(), WorkerFacts(1, True), K,
        Plan(restore=(), saves=(), keep_max=0, live_ok=True, lookup="off", boundary=None,
             anchor_skipped=None),
    ),
    # --- cold prompts ------------------------------------------------------------------------
    # full, nothing reusable: the cold anchor and the prompt end; keep_max is still n - 1.
    (
        facts("full"), [], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold"), (40, "full")), keep_max=39, live_ok=True,
             lookup="miss", boundary=40, anchor_skipped=None),
    ),
    # full does not read the ring: a recent prompt that is a whole prefix adds no growing save.
    (
        facts("full"), [IDS[:30]], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold"), (40, "full")), keep_max=39, live_ok=True,
             lookup="miss", boundary=40, anchor_skipped=None),
    ),
    # A cold prompt over cold max: no anchor, and the plan says why.
    (
        facts("full"), [], stored(), COLD, CacheKnobs(4, 39, 0),
        Plan(restore=(), saves=saves((40, "full")), keep_max=39, live_ok=True, lookup="miss",
             boundary=40, anchor_skipped="prompt of 40 tokens exceeds cold max 39"),
    ),
    # Exactly at cold max: the anchor is still saved.
    (
        facts("full"), [], stored(), COLD, CacheKnobs(4, 40, 0),
        Plan(restore=(), saves=saves((10, "cold"), (40, "full")), keep_max=39, live_ok=True,
             lookup="miss", boundary=40, anchor_skipped=None),
    ),
    # Over cold max but not cold (an entry at 5, short of the anchor): the anchor is refreshed.
    (
        facts("full"), [], stored(5), COLD, CacheKnobs(4, 39, 0),
        Plan(restore=restores(5), saves=saves((10, "anchor-refresh"), (40, "full")), keep_max=39,
             live_ok=True, lookup="partial", boundary=40, anchor_skipped=None),
    ),
    # fixed 25: exactly 25 (inside the reply), scoped, plus the cold anchor.
    (
        facts("25"), [], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold"), (25, "scoped")), keep_max=39, live_ok=True,
             lookup="miss", boundary=25, anchor_skipped=None),
    ),
    # fixed 50, past the prompt end: no boundary, the anchor only.
    (
        facts("50"), [], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold")), keep_max=39, live_ok=True, lookup="miss",
             boundary=None, anchor_skipped=None),
    ),
    # --- auto: the boundary comes from the ring ----------------------------------------------
    # The prompt is a chat turn (its messages located), so auto also saves its end (growing) in
    # every case: the client's next turn extends it, whatever the ring holds (issue 46).
    # First prompt of a tenant, empty ring: no boundary, the anchor and the end.
    (
        facts("auto"), [], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold"), (40, "growing")), keep_max=39, live_ok=True,
             lookup="miss", boundary=None, anchor_skipped=None),
    ),
    # 25 tokens shared with a recent prompt: the boundary is exactly 25, inside the reply (not
    # aligned down to its start, 20): scoped save.
    (
        facts("auto"), [diverge(25)], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold"), (25, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="miss", boundary=25, anchor_skipped=None),
    ),
    # 10 shared: the boundary is the anchor too: one save there, scoped outranks cold.
    (
        facts("auto"), [diverge(10)], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "scoped"), (40, "growing")), keep_max=39, live_ok=True,
             lookup="miss", boundary=10, anchor_skipped=None),
    ),
    # 7 shared, which clears min tokens 4: a boundary before the anchor (inside the first user
    # message)...
    (
        facts("auto"), [diverge(7)], stored(), COLD, K,
        Plan(restore=(), saves=saves((7, "scoped"), (10, "cold"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="miss", boundary=7, anchor_skipped=None),
    ),
    # ...but not min tokens 8: no boundary.
    (
        facts("auto"), [diverge(7)], stored(), COLD, CacheKnobs(8, 1000, 0),
        Plan(restore=(), saves=saves((10, "cold"), (40, "growing")), keep_max=39, live_ok=True,
             lookup="miss", boundary=None, anchor_skipped=None),
    ),
    # NEW (a): a shared prefix that ends inside the system message (a system prompt up to its
    # per-session block), exactly at min tokens 4: the boundary is exactly 4, not a message start.
    (
        facts("auto"), [diverge(4)], stored(), COLD, K,
        Plan(restore=(), saves=saves((4, "scoped"), (10, "cold"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="miss", boundary=4, anchor_skipped=None),
    ),
    # NEW (a): 33 shared, inside the last user turn (which starts at 30): boundary 33; the entry
    # stored at the message start 30 falls short of it: partial, restore 30 (10 as the fallback),
    # and save 33.
    (
        facts("auto"), [diverge(33)], stored(10, 30), COLD, K,
        Plan(restore=restores(30, 10), saves=saves((33, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="partial", boundary=33, anchor_skipped=None),
    ),
    # The previous turn (a whole prefix, 30 tokens): scoped at 30, and growing at the prompt end,
    # which the next turn will share.
    (
        facts("auto"), [IDS[:30]], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold"), (30, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="miss", boundary=30, anchor_skipped=None),
    ),
    # auto:1 sees only the most recent prompt (3 shared: below min tokens, not a prefix), so the
    # scope boundary does not come from the previous turn behind it (the end is saved anyway)...
    (
        facts("auto:1"), [diverge(3), IDS[:30]], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold"), (40, "growing")), keep_max=39, live_ok=True,
             lookup="miss", boundary=None, anchor_skipped=None),
    ),
    # ...auto:2 reaches it.
    (
        facts("auto:2"), [diverge(3), IDS[:30]], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold"), (30, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="miss", boundary=30, anchor_skipped=None),
    ),
    # The same prompt again (a retry) with its KV live: boundary 40, the end (scoped, as growing);
    # reuse is capped at n - 2 and the end is snapshotted from there; the anchor lies behind the
    # reuse (a hit past the anchor saves nothing).
    (
        facts("auto"), [IDS], stored(), WorkerFacts(40, True), K,
        Plan(restore=(), saves=saves((40, "scoped")), keep_max=39, live_ok=True, lookup="miss",
             boundary=40, anchor_skipped=None),
    ),
    # The usual agent loop after a restart: the previous turn's end (30) and anchor are stored;
    # restore 30 (10 as the fallback), hit, and save the growing end.
    (
        facts("auto"), [IDS[:30]], stored(10, 30), COLD, K,
        Plan(restore=restores(30, 10), saves=saves((40, "growing")), keep_max=39, live_ok=True,
             lookup="hit", boundary=30, anchor_skipped=None),
    ),
    # The same loop with the live KV holding 32 tokens: nothing to restore, the growing end only.
    (
        facts("auto"), [IDS[:30]], stored(10, 30), WorkerFacts(32, True), K,
        Plan(restore=(), saves=saves((40, "growing")), keep_max=39, live_ok=True, lookup="hit",
             boundary=30, anchor_skipped=None),
    ),
    # ...and when the previous turn's save was lost: 30 lies behind the live reuse (32) and is
    # snapshotted from the live KV; reuse is not cut back (keep_max stays n - 1).
    (
        facts("auto"), [IDS[:30]], stored(10), WorkerFacts(32, True), K,
        Plan(restore=(), saves=saves((30, "scoped"), (40, "growing")), keep_max=39, live_ok=True,
             lookup="partial", boundary=30, anchor_skipped=None),
    ),
    # --- disk hits ---------------------------------------------------------------------------
    # full, the whole prompt stored: a hit; the restore lists the hit and its two fallbacks,
    # longest first (10 is stored too, but only RESTORE_CANDIDATES entries are read); nothing to
    # save.
    (
        facts("full"), [], stored(10, 20, 30, 40), COLD, K,
        Plan(restore=restores(40, 30, 20), saves=(), keep_max=39, live_ok=True, lookup="hit",
             boundary=40, anchor_skipped=None),
    ),
    # full, stored up to the last turn only: partial, the new end is saved.
    (
        facts("full"), [], stored(5, 10, 20, 30), COLD, K,
        Plan(restore=restores(30, 20, 10), saves=saves((40, "full")), keep_max=39, live_ok=True,
             lookup="partial", boundary=40, anchor_skipped=None),
    ),
    # auto, an entry exactly at the scope boundary 30: a hit, nothing to save.
    (
        facts("auto"), [diverge(30)], stored(10, 30), COLD, K,
        Plan(restore=restores(30, 10), saves=saves((40, "growing")), keep_max=39, live_ok=True,
             lookup="hit", boundary=30, anchor_skipped=None),
    ),
    # auto, the longest entry (20) short of the boundary 30: partial, restore it with its
    # fallbacks, save the boundary.
    (
        facts("auto"), [diverge(30)], stored(5, 10, 20), COLD, K,
        Plan(restore=restores(20, 10, 5), saves=saves((30, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="partial", boundary=30, anchor_skipped=None),
    ),
    # Only an entry shorter than the anchor: partial, and the stale anchor is refreshed in the
    # same prefill as the scope boundary (25).
    (
        facts("auto"), [diverge(25)], stored(5), COLD, K,
        Plan(restore=restores(5),
             saves=saves((10, "anchor-refresh"), (25, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="partial", boundary=25, anchor_skipped=None),
    ),
    # Only the anchor: partial, the anchor is fresh, the boundary is saved.
    (
        facts("auto"), [diverge(25)], stored(10), COLD, K,
        Plan(restore=restores(10), saves=saves((25, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="partial", boundary=25, anchor_skipped=None),
    ),
    # No scope boundary: the lookup target is the last message start, 30: an entry there is a
    # hit...
    (
        facts("auto"), [], stored(10, 30), COLD, K,
        Plan(restore=restores(30, 10), saves=saves((40, "growing")), keep_max=39, live_ok=True,
             lookup="hit", boundary=None, anchor_skipped=None),
    ),
    # ...the anchor alone is partial.
    (
        facts("auto"), [], stored(10), COLD, K,
        Plan(restore=restores(10), saves=saves((40, "growing")), keep_max=39, live_ok=True,
             lookup="partial", boundary=None, anchor_skipped=None),
    ),
    # A disk entry (30) past the unstored scope boundary 25: the boundary is saved behind the
    # restore, keep_max stays n - 1; still a hit (the entry reaches the boundary).
    (
        facts("auto"), [diverge(25)], stored(10, 30), COLD, K,
        Plan(restore=restores(30, 10), saves=saves((25, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="hit", boundary=25, anchor_skipped=None),
    ),
    # NEW (c): the only entry (30) lies past the unstored boundary 20: restore it and save 20
    # behind it (reason scoped), keep_max n - 2. The anchor (10) is not stored either but is not
    # saved: a hit past the anchor saves nothing.
    (
        facts("auto"), [diverge(20)], stored(30), COLD, K,
        Plan(restore=restores(30), saves=saves((20, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="hit", boundary=20, anchor_skipped=None),
    ),
    # NEW (d): the boundary 20 is stored and lies behind the restored entry 30: not saved again.
    (
        facts("auto"), [diverge(20)], stored(10, 20, 30), COLD, K,
        Plan(restore=restores(30, 20, 10), saves=saves((40, "growing")), keep_max=39, live_ok=True,
             lookup="hit", boundary=20, anchor_skipped=None),
    ),
    # --- live reuse --------------------------------------------------------------------------
    # Live reuse of 25 between the stored entries: restore only lists the one longer than it.
    (
        facts("auto"), [diverge(30)], stored(10, 20, 30), WorkerFacts(25, True), K,
        Plan(restore=restores(30), saves=saves((40, "growing")), keep_max=39, live_ok=True,
             lookup="hit", boundary=30, anchor_skipped=None),
    ),
    # Live reuse exactly as long as the longest entry (30): an entry must be longer to be listed.
    (
        facts("auto"), [diverge(30)], stored(10, 20, 30), WorkerFacts(30, True), K,
        Plan(restore=(), saves=saves((40, "growing")), keep_max=39, live_ok=True, lookup="hit",
             boundary=30, anchor_skipped=None),
    ),
    # Live reuse of 36, longer than every entry: nothing to restore, but the lookup (which is
    # about the disk) is still a hit; the boundary behind it is stored, so nothing to save.
    (
        facts("auto"), [diverge(30)], stored(10, 20, 30), WorkerFacts(36, True), K,
        Plan(restore=(), saves=saves((40, "growing")), keep_max=39, live_ok=True, lookup="hit",
             boundary=30, anchor_skipped=None),
    ),
    # Live reuse of 34 past the unstored boundary 30: not cut back; 30 is saved behind it.
    (
        facts("auto"), [diverge(30)], stored(10, 20), WorkerFacts(34, True), K,
        Plan(restore=(), saves=saves((30, "scoped"), (40, "growing")), keep_max=39, live_ok=True,
             lookup="partial", boundary=30, anchor_skipped=None),
    ),
    # Live reuse ending exactly on the unstored boundary: snapshot it at once.
    (
        facts("auto"), [diverge(30)], stored(10, 20), WorkerFacts(30, True), K,
        Plan(restore=(), saves=saves((30, "scoped"), (40, "growing")), keep_max=39, live_ok=True,
             lookup="partial", boundary=30, anchor_skipped=None),
    ),
    # Live 25 past the unstored boundary 20, and a disk entry at 30 longer than both: restore 30
    # (the live KV does not reach it) and save 20 behind it.
    (
        facts("auto"), [diverge(20)], stored(10, 30), WorkerFacts(25, True), K,
        Plan(restore=restores(30), saves=saves((20, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="hit", boundary=20, anchor_skipped=None),
    ),
    # NEW (b): live reuse 2870 tokens past the unstored boundary 30 (far more than any refill):
    # 30 is still saved, from the live KV, and keep_max stays n - 1.
    (
        facts("auto", n=N_LONG), [diverge(30, n=N_LONG)], stored(10, 20),
        WorkerFacts(2900, True), K,
        Plan(restore=(), saves=saves((30, "scoped"), (3000, "growing")), keep_max=N_LONG - 1,
             live_ok=True, lookup="partial", boundary=30, anchor_skipped=None),
    ),
    # NEW (d): live reuse 34 past the stored boundary 20: nothing saved, nothing restored.
    (
        facts("auto"), [diverge(20)], stored(10, 20, 30), WorkerFacts(34, True), K,
        Plan(restore=(), saves=saves((40, "growing")), keep_max=39, live_ok=True, lookup="hit",
             boundary=20, anchor_skipped=None),
    ),
    # --- fixed N behind the reuse ------------------------------------------------------------
    # NEW (e): fixed 25 behind the live reuse 36: saved from the live KV; the disk has only the
    # anchor (10 < 25): partial, and 10 is not longer than the live reuse: nothing to restore.
    (
        facts("25"), [], stored(10), WorkerFacts(36, True), K,
        Plan(restore=(), saves=saves((25, "scoped")), keep_max=39, live_ok=True,
             lookup="partial", boundary=25, anchor_skipped=None),
    ),
    # NEW (e): fixed 25 behind a restored entry 30: saved; a hit.
    (
        facts("25"), [], stored(10, 30), COLD, K,
        Plan(restore=restores(30, 10), saves=saves((25, "scoped")), keep_max=39, live_ok=True,
             lookup="hit", boundary=25, anchor_skipped=None),
    ),
    # --- live_ok false: the live KV is another tenant's --------------------------------------
    # The 34 live tokens count as 0: restore every hit, plan saves from the disk reuse (20);
    # live_ok false goes to the worker.
    (
        facts("auto"), [diverge(30)], stored(10, 20), WorkerFacts(34, False), K,
        Plan(restore=restores(20, 10), saves=saves((30, "scoped"), (40, "growing")), keep_max=39,
             live_ok=False, lookup="partial", boundary=30, anchor_skipped=None),
    ),
    # The same as the live-25 case above, but not this tenant's: all three hits are listed.
    (
        facts("auto"), [diverge(30)], stored(10, 20, 30), WorkerFacts(25, False), K,
        Plan(restore=restores(30, 20, 10), saves=saves((40, "growing")), keep_max=39, live_ok=False,
             lookup="hit", boundary=30, anchor_skipped=None),
    ),
    # Nothing stored: the prefill is cold, so the cold anchor is saved.
    (
        facts("full"), [], stored(), WorkerFacts(38, False), K,
        Plan(restore=(), saves=saves((10, "cold"), (40, "full")), keep_max=39, live_ok=False,
             lookup="miss", boundary=40, anchor_skipped=None),
    ),
    # --- a conversation's opening turn ---------------------------------------------------------
    # An 18-token prompt with no assistant message yet (a session's first request): auto finds
    # nothing shared, but the next turn will extend this one, so its end is saved (growing)
    # beside the cold anchor.
    (
        facts("auto", 18), [], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold"), (18, "growing")), keep_max=17, live_ok=True,
             lookup="miss", boundary=None, anchor_skipped=None),
    ),
    # The same under fixed 25 (not auto): no growing save, only the cold anchor.
    (
        facts("25", 18), [], stored(), COLD, K,
        Plan(restore=(), saves=saves((10, "cold")), keep_max=17, live_ok=True,
             lookup="miss", boundary=None, anchor_skipped=None),
    ),
    # --- continued checkpoints -----------------------------------------------------------------
    # Every 15: 15 and 30 on a cold full prompt, between the anchor and the end.
    (
        facts("full"), [], stored(), COLD, K15,
        Plan(restore=(), saves=saves((10, "cold"), (15, "continued"), (30, "continued"),
                                     (40, "full")),
             keep_max=39, live_ok=True, lookup="miss", boundary=40, anchor_skipped=None),
    ),
    # Every 10: the anchor and the end keep their stronger reasons (cold, full).
    (
        facts("full"), [], stored(), COLD, K10,
        Plan(restore=(), saves=saves((10, "cold"), (20, "continued"), (30, "continued"),
                                     (40, "full")),
             keep_max=39, live_ok=True, lookup="miss", boundary=40, anchor_skipped=None),
    ),
    # Restored from the checkpoint at 15: only the checkpoints past it (30), plus the boundary.
    (
        facts("auto"), [diverge(25)], stored(15), COLD, K15,
        Plan(restore=restores(15), saves=saves((25, "scoped"), (30, "continued"), (40, "growing")),
             keep_max=39, live_ok=True, lookup="partial", boundary=25, anchor_skipped=None),
    ),
    # Restored from the checkpoint 30, past the unstored boundary 25: the boundary is saved
    # behind the restore; no checkpoint lies ahead (the next would be 45 > 40).
    (
        facts("auto"), [diverge(25)], stored(30), COLD, K15,
        Plan(restore=restores(30), saves=saves((25, "scoped"), (40, "growing")), keep_max=39,
             live_ok=True, lookup="hit", boundary=25, anchor_skipped=None),
    ),
    # --- a recurrent state (rule 6): nothing is cut back ---------------------------------------
    # The opening turn: the growing save at the prompt end 18 is taken at keep_max 17, so the
    # same prompt sent again can restore it (and the next turn too, prefilling one more token).
    (
        facts("auto", 18), [], stored(), RECURRENT, K,
        Plan(restore=(), saves=saves((10, "cold"), (17, "growing")), keep_max=17, live_ok=True,
             lookup="miss", boundary=None, anchor_skipped=None),
    ),
    # full: the prompt end 40 is taken at 39; the stored whole prompt (40) is never offered
    # (it could not be cut back to 39): the anchor is restored instead.
    (
        facts("full"), [], stored(10, 40), RECURRENT, K,
        Plan(restore=restores(10), saves=saves((39, "full")), keep_max=39, live_ok=True,
             lookup="partial", boundary=40, anchor_skipped=None),
    ),
    # The same prompt again after that: the entry at 39 is the hit, nothing more to save.
    (
        facts("full"), [], stored(10, 39), RECURRENT, K,
        Plan(restore=restores(39, 10), saves=(), keep_max=39, live_ok=True, lookup="hit",
             boundary=40, anchor_skipped=None),
    ),
    # fixed 25 behind the restored 30: plain attention snapshots it from the live KV (above); a
    # recurrent state cannot be cut back there, so no save is planned.
    (
        facts("25"), [], stored(10, 30), RECURRENT, K,
        Plan(restore=restores(30, 10), saves=(), keep_max=39, live_ok=True, lookup="hit",
             boundary=25, anchor_skipped=None),
    ),
    # A live state the worker can keep whole (the prompt extends it: live_n 34) is used as is;
    # the boundary 36 ahead of it is saved.
    (
        facts("auto"), [diverge(36)], stored(10), WorkerFacts(34, True, cut_back=False), K,
        Plan(restore=(), saves=saves((36, "scoped"), (39, "growing")), keep_max=39, live_ok=True,
             lookup="partial", boundary=36, anchor_skipped=None),
    ),
    # --- a worker that reuses only at batch edges (rule 7: align 8 here, its batch on a GPU) ---
    # Cold, full: keep_max is the last multiple of 8 below 40 (32); the anchor 10 is saved at 8,
    # the prompt end 40 is a multiple already.
    (
        facts("full"), [], stored(), ALIGNED, K,
        Plan(restore=(), saves=saves((8, "cold"), (40, "full")), keep_max=32, live_ok=True,
             lookup="miss", boundary=40, anchor_skipped=None),
    ),
    # Only the aligned entry (24) is offered, not 10; the boundary 30 rounds down to 24, which
    # is stored: nothing to save.
    (
        facts("auto"), [diverge(30)], stored(10, 24), ALIGNED, K,
        Plan(restore=restores(24), saves=saves((40, "growing")), keep_max=32, live_ok=True,
             lookup="partial", boundary=30, anchor_skipped=None),
    ),
    # The live reuse 37 counts as 32; the boundary 36 is saved at 32.
    (
        facts("auto"), [diverge(36)], stored(), WorkerFacts(37, True, batching=Batching(8)), K,
        Plan(restore=(), saves=saves((32, "scoped"), (40, "growing")), keep_max=32, live_ok=True,
             lookup="miss", boundary=36, anchor_skipped=None),
    ),
    # A prompt of 4 x 8 + 1 tokens: keep_max is 32 = n - 1 (the last token alone is the cold
    # run's last batch too); the worker's wire check takes it (tests/backend/test_protocol.py).
    (
        facts("full", 33), [], stored(32), ALIGNED, K,
        Plan(restore=restores(32), saves=(), keep_max=32, live_ok=True, lookup="hit",
             boundary=33, anchor_skipped=None),
    ),
    # --- a worker whose start-up self-check failed: it reuses nothing, whatever is stored ---
    (
        facts("full"), [IDS], stored(10, 30), WorkerFacts(30, True, exact=False), K,
        Plan(restore=(), saves=(), keep_max=0, live_ok=False, lookup="off", boundary=None,
             anchor_skipped=None),
    ),
]


@pytest.mark.parametrize(("facts_", "recent", "stored_", "worker", "knobs", "expected"),
                         DECIDE_CASES)
def test_decide(facts_: Facts, recent: Sequence[Sequence[int]], stored_: Stored,
                worker: WorkerFacts, knobs: CacheKnobs, expected: Plan) -> None:
    assert decide(facts_, stored_, worker, recent, knobs) == expected


# --- the wire form ----------------------------------------------------------------------------

WIRE_PLAN = Plan(
    restore=restores(30, 20),
    saves=(Save(10, "anchor-refresh"), Save(40, "full")),
    keep_max=39,
    live_ok=False,
    lookup="partial",
    boundary=40,
    anchor_skipped="prompt of 41000 tokens exceeds cold max 30000",
)
EXTRA_PLANS = [
    WIRE_PLAN,
    Plan((), (), 0, True, "off", None, None),
    Plan((), saves((10, "cold"), (15, "continued"), (20, "scoped"), (40, "growing")), 0, True,
         "miss", None, None),
    Plan(restores(40), (), 39, True, "hit", 40, None),
]
WIRE_PLANS = [case[-1] for case in DECIDE_CASES] + EXTRA_PLANS


def test_wire_plans_cover_every_lookup_and_reason() -> None:
    assert {p.lookup for p in WIRE_PLANS} == set(get_args(Lookup))
    assert {s.reason for p in WIRE_PLANS for s in p.saves} == set(get_args(Reason))


def test_to_wire_shape() -> None:
    # Keys as hex, tuples as lists, None as null: plain JSON; a save has no key (the worker
    # keys the file).
    assert WIRE_PLAN.to_wire() == {
        "restore": [{"n_tokens": 30, "key": "6b3330", "file": "30.state", "size_bytes": 0,
                     "tier": "disk"},
                    {"n_tokens": 20, "key": "6b3230", "file": "20.state", "size_bytes": 0,
                     "tier": "disk"}],
        "saves": [{"n_tokens": 10, "reason": "anchor-refresh"},
                  {"n_tokens": 40, "reason": "full"}],
        "keep_max": 39,
        "live_ok": False,
        "lookup": "partial",
        "boundary": 40,
        "anchor_skipped": "prompt of 41000 tokens exceeds cold max 30000",
        "restore_skipped": None,
    }


@pytest.mark.parametrize("plan", WIRE_PLANS)
def test_plan_round_trip(plan: Plan) -> None:
    assert Plan.from_wire(json.loads(json.dumps(plan.to_wire()))) == plan


def wire() -> dict[str, Any]:
    """A fresh JSON copy of WIRE_PLAN's wire form, to break."""
    d: dict[str, Any] = json.loads(json.dumps(WIRE_PLAN.to_wire()))
    return d


@pytest.mark.parametrize("field", list(WIRE_PLAN.to_wire()))
def test_from_wire_missing_field(field: str) -> None:
    d = wire()
    del d[field]
    with pytest.raises(ValueError):
        Plan.from_wire(d)


@pytest.mark.parametrize(
    ("part", "field"),
    [("restore", "n_tokens"), ("restore", "key"), ("restore", "file"),
     ("restore", "size_bytes"), ("restore", "tier"), ("saves", "n_tokens"), ("saves", "reason")],
)
def test_from_wire_missing_nested_field(part: str, field: str) -> None:
    d = wire()
    del d[part][0][field]
    with pytest.raises(ValueError):
        Plan.from_wire(d)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        # lookups and reasons outside their literals
        ("lookup", "maybe"),
        ("lookup", None),
        ("lookup", "HIT"),
        # live_ok must be a JSON boolean, not something truthy or falsy
        ("live_ok", "true"),
        ("live_ok", 1),
        ("live_ok", 0),
        ("live_ok", None),
        # restore and saves must be lists of objects
        ("restore", None),
        ("saves", [None]),
        ("saves", [7]),
        ("keep_max", None),
    ],
)
def test_from_wire_bad_value(field: str, value: Any) -> None:
    d = wire()
    d[field] = value
    with pytest.raises(ValueError):
        Plan.from_wire(d)


@pytest.mark.parametrize("reason", ["warm", "", None, "Full"])
def test_from_wire_unknown_save_reason(reason: Any) -> None:
    d = wire()
    d["saves"][1]["reason"] = reason
    with pytest.raises(ValueError):
        Plan.from_wire(d)


@pytest.mark.parametrize("tier", ["ram", "", None, "Disk", "shared:"])
def test_from_wire_unknown_restore_tier(tier: Any) -> None:
    # a plan restores from the disk or the shared tier only; a tier is a field, never a prefix
    d = wire()
    d["restore"][0]["tier"] = tier
    with pytest.raises(ValueError):
        Plan.from_wire(d)


@pytest.mark.parametrize("key_hex", ["zz", "abc", None])
def test_from_wire_bad_key(key_hex: Any) -> None:
    d = wire()
    d["restore"][0]["key"] = key_hex
    with pytest.raises(ValueError):
        Plan.from_wire(d)


@pytest.mark.parametrize("d", [None, [], "plan", 5])
def test_from_wire_not_an_object(d: Any) -> None:
    with pytest.raises(ValueError):
        Plan.from_wire(d)
