"""Which state a prompt starts from: one rule for the proxy's `decide()` (which stored entries a
plan offers) and for the worker (among its own memory and the plan's entries).

    choose_start(keep, candidates, limit, cuts, costs) -> Start

A state can be in one of these tiers, nearest first (`Tier`; a tier is a field, never a prefix
of a file name):

- ``live``: the slot's own live KV. Never a candidate: what it holds of the prompt is `keep`,
  the tokens reused anyway.
- ``slot``: another slot's live KV in the same worker (its exact prompt part), copied over.
- ``queued``: a snapshot taken but not yet written to its file (the proxy's index lacks it).
- ``ram``: the worker's RAM tier (`--cache-ram`): states that had to give way.
- ``disk``: a state file on the local disk, indexed in LMDB.
- ``shared``: a state in the shared tier across hosts (`--shared-tier`), pulled to the disk.

A `Candidate` holds the first `n_tokens` of the prompt, at a batch edge of the prompt (the
caller checks the edge: a hit must replay the cold run's batches); it is `whole` when the state
ends there (loaded as it is), otherwise it goes on past them and is cut back after loading.

Rules:

1. A candidate is worth loading only where it gives more than `keep`: ``min(n_tokens, limit) >
   keep`` (`limit`: the most a prompt may reuse, its last batch edge before its last token).
2. One that must be cut back after loading (not whole, or longer than `limit`) only where the
   memory can be cut back (`cuts`: plain attention; a recurrent state exists at its last
   position only, a window snapshot holds only the window behind it).
3. Only where it pays (`policies.costs.pays`): loading its bytes, at its tier's measured cost,
   beats prefilling the tokens it saves. A slot's state moves twice (out of that slot, into
   this one); every nearer tier loads from memory (the ``ram`` cost), ``disk`` and ``shared``
   at their own. The longest usable candidate that does not pay is named (`Start.skipped`).
4. Order: the most tokens first; on a tie, a state in memory before one read from the disk or
   pulled from the shared tier, then a whole state before one cut back, then the one whose
   bytes move fewer times (a held state before another slot's copy), then the nearer tier,
   then the caller's order. The first is loaded; the others are fallbacks, tried in
   turn when one fails (a broken file, a shared entry gone).
5. A prompt whose first tokens another slot is prefilling right now (subagents of one kind
   started at once, with the same system prompt and tools) waits for that slot to pass them
   and copies them, where that saves at least one batch over the best start it has now
   (`follows`): computed twice side by side, they would take the device from each other and
   end no sooner. The copy is a ``slot`` candidate then, under rules 1-4: whole where that
   slot's state ends at the edge (a window or a recurrent state, which cannot be cut back to a
   part, is copied at the moment its batch ends there).

Pure: plain data in, a value out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from policies.costs import Costs, Source, pays

Tier = Literal["live", "slot", "queued", "ram", "disk", "shared"]
TIERS: tuple[Tier, ...] = ("live", "slot", "queued", "ram", "disk", "shared")
# what loading from each tier costs (policies.costs sources), and how many times its bytes move
COST_SOURCE: dict[Tier, Source] = {"live": "ram", "slot": "ram", "queued": "ram", "ram": "ram",
                                   "disk": "disk", "shared": "shared"}
MOVES: dict[Tier, int] = {"slot": 2}
READ: tuple[Tier, ...] = ("disk", "shared")  # tiers read from outside the worker's memory


@dataclass(frozen=True, slots=True)
class Candidate:
    tier: Tier
    n_tokens: int  # tokens of the prompt it holds, at a batch edge of the prompt
    whole: bool = True  # the state ends there (false: cut back to n_tokens after loading)
    nbytes: int = 0  # its state's bytes (0: not known)
    ref: int = 0  # the caller's own handle on it

    @property
    def moved_bytes(self) -> int:
        return self.nbytes * MOVES.get(self.tier, 1)


@dataclass(frozen=True, slots=True)
class Start:
    order: tuple[Candidate, ...]  # to try, best first (empty: start from `keep`)
    skipped: Candidate | None = None  # the longest usable candidate that does not pay (rule 3)

    @property
    def best(self) -> Candidate | None:
        return self.order[0] if self.order else None


def choose_start(keep: int, candidates: Sequence[Candidate], limit: int, cuts: bool,
                 costs: Costs | None) -> Start:
    """The candidates to try, best first (module rules)."""
    usable = [c for c in candidates
              if min(c.n_tokens, limit) > keep
              and (cuts or (c.whole and c.n_tokens <= limit))]
    paying = [c for c in usable if pays(costs, keep, min(c.n_tokens, limit), c.moved_bytes,
                                        COST_SOURCE[c.tier])]
    rank = {t: i for i, t in enumerate(TIERS)}
    order = sorted(paying, key=lambda c: (-min(c.n_tokens, limit), c.tier in READ,
                                          not c.whole, MOVES.get(c.tier, 1), rank[c.tier]))
    longest = max(usable, key=lambda c: min(c.n_tokens, limit), default=None)
    skipped = longest if longest is not None and longest not in paying and (
        not order or min(longest.n_tokens, limit) > min(order[0].n_tokens, limit)) else None
    return Start(tuple(order), skipped)


def follows(now: int, shared: int, batch: int) -> bool:
    """Rule 5: wait for another slot's prefill to hold `shared` tokens of the prompt, where the
    best start now holds `now` of them."""
    return shared - now >= batch
