"""A slot's speculative drafts, for the worker's core (sans-I/O, as the core is): the request's
drafters, the stop rule's record, and what it drafted and had accepted, per source. The rules are
policies.speculate's and policies.ngram's; the verify itself is backend.worker.verify's.

- A job drafts once its prompt is evaluated (`SlotDrafts.start`, fed the prompt), after each
  token that waits for its step (`propose`: from the slot's live tokens and the waiting one), and
  learns from each verify (`verified`).
- `Speculation` is the worker's, as its start resolved it: the types asked, the verify cost it
  measured (fixed for its life, so a hit verifies what its cold run verified), whether this
  memory can draft at all, and the sentence the ready line and /props say.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.worker.messages import Ids
from policies.speculate import (
    MODEL,
    Chain,
    SpecConfig,
    Stats,
    VerifyCost,
    after,
    draft_len,
    room,
    shadowed,
)


@dataclass(frozen=True, slots=True)
class Speculation:
    config: SpecConfig
    cost: VerifyCost | None  # a verify of r rows over a step, measured at start (None: not)
    n_batch: int  # rows a llama_decode holds
    drafts: bool  # this memory drafts (a recurrent state without rollback states does not)
    note: str  # in one sentence, for the ready line and /props
    model: Any = None  # the draft model of draft-simple (backend.worker.draft_model)
    bound: int = 0  # the longest draft the memory can cut back (a recurrent one's; 0: none)

    @property
    def n_max(self) -> int:
        """The longest draft a verify takes."""
        return min(self.config.n_max, self.n_batch - 1, self.bound or self.n_batch)

    @property
    def on(self) -> bool:
        """Whether a slot drafts at all: not where even drafts that are always accepted
        cannot pay for their verify (policies.speculate)."""
        n_max = self.n_max
        return self.config.on and self.drafts and (
            self.config.always or self.cost is None or self.cost.pays_for(self.config, n_max))


@dataclass(slots=True)
class SlotDrafts:
    spec: Speculation
    chain: Chain
    stats: Stats = field(default_factory=Stats)
    source: str = ""  # the waiting draft's drafter
    draft: list[int] = field(default_factory=list)  # the waiting draft, verified next step
    # an n-gram draft turned down, compared with the tokens plain steps make instead, and how
    # many of them it was compared with so far (policies.speculate: shadows)
    shadow: list[int] = field(default_factory=list)
    shadowed: int = 0
    run: int = 0  # tokens in a row the drafts had right, up to the waiting one
    verified_last: bool = False  # the waiting token came out of a verify
    totals: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafted, accepted,
    # verifies]

    @classmethod
    def start(cls, spec: Speculation, prompt: Ids) -> SlotDrafts:
        chain = Chain(spec.config)
        chain.begin(prompt)
        return cls(spec, chain)

    def propose(self, live: Ids, last: int, n_gen: int, left: int, n_ctx: int) -> list[int]:
        """The draft to verify beside `last` (the sampled token waiting for its step): `live`
        is every token the slot evaluated, `left` the tokens the answer may still generate."""
        self.source, self.draft = "", []
        if self.shadow:  # one plain step since it was made: `last` is that step's token
            hit = last == self.shadow[self.shadowed]
            self.shadowed += 1
            self.stats = shadowed(self.stats, self.run + 1, hit, self.shadowed == 1)
            self.run = self.run + 1 if hit else 0
            if not hit or self.shadowed == len(self.shadow):
                self.shadow, self.shadowed = [], 0
        elif not self.verified_last:
            self.run = 0  # a plain step no draft foretold
        self.verified_last = False
        if not self.spec.config.always and n_gen < self.stats.pause_until:
            return self.draft  # paused: the drafters are not asked
        n_room = min(room(len(live), n_ctx or len(live) + self.spec.n_batch + 2, left,
                          self.spec.n_batch), self.spec.n_max)
        source, draft = self.chain.draft(live, last, n_room)
        cost = self.spec.cost
        k, self.stats = draft_len(self.stats, len(draft), cost, self.spec.config.always, n_gen,
                                  cost.draft_step if cost is not None and source == MODEL
                                  else 0.0, source != MODEL, self.run)
        if k > 0:
            self.source, self.draft = source, draft[:k]
            self.shadow, self.shadowed = [], 0
        elif draft and not self.shadow and source != MODEL:
            self.shadow = draft
        return self.draft

    def verified(self, k: int, m: int, n_gen: int) -> None:
        """The waiting draft was verified, k tokens of it (a draft model's: as many as it
        made), and m accepted."""
        self.chain.accept(m)
        self.stats = after(self.stats, k, m, n_gen, self.run, self.source != MODEL)
        self.run = self.run + m if m == k else 0
        self.verified_last = True
        t = self.totals.setdefault(self.source, [0, 0, 0])
        t[0], t[1], t[2] = t[0] + k, t[1] + m, t[2] + 1
        self.source, self.draft = "", []

    def summary(self) -> dict[str, Any]:
        """What `Done` reports: per source, drafted and accepted tokens and verify steps."""
        return {s: {"drafted": d, "accepted": a, "verifies": v}
                for s, (d, a, v) in sorted(self.totals.items())}
