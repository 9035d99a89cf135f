"""Speculative decoding's rules: which drafts a slot proposes, which of them the target accepts,
and whether a slot drafts at all (the stop rule).

    SpecConfig                              what --spec-type and its flags ask
    Chain(config).begin(prompt)             one per request, fed its prompt
    Chain.draft(context, last, room)        -> (source, tokens): the first type that drafts
    Chain.accept(n_accepted)
    accepted(draft, sampled) -> n           the target's acceptance
    VerifyCost                              a verify of r rows over one step, measured
    draft_len(stats, n, cost, always, n_gen, run=r)    -> (k, stats): the stop rule
    after(stats, k, m, n_gen, run=r) -> Stats   a slot's record after a verify of k, m accepted
    shadowed(stats, j, hit, first) -> Stats     ... after a plain step checked a draft turned down

**Drafts** depend only on the tokens: the slot's context (prompt and generated so far) and the
sampled token that waits for its step (policies.ngram: llama.cpp's n-gram drafters, each
request's own; ``draft-simple``: a draft model's greedy tokens, up to `draft_n_max`, made by the
worker when the step runs). Types chain in llama.cpp's order (the n-gram types, then
draft-simple); the first that drafts wins. A draft is cut to
the room left (`room`: the tokens the answer may still generate less one, the slot's context
less two, the batch less one, as llama-server's `get_n_draft_max`).

**Acceptance** is llama.cpp's (common_sampler_sample_and_accept_n): the waiting token and the
draft are evaluated in one batch with logits for every row; row i is sampled with the slot's own
sampler chain (penalties, grammar, temperature and its seeded draw) and the draft's token i is
accepted while it equals the sample; the first sample that differs, or the sample after the
whole draft, is the step's last token. Greedy: the longest prefix the target's argmax agrees
with. Temperature > 0: each emitted token is a draw from the target's distribution given the
tokens before it, so the answer's distribution is unchanged; for a draft that is one token per
position (an n-gram's), accepting it with probability p(d) and drawing from the rest otherwise
is exactly the standard speculative-sampling rule (min(1, p/q) with q a point mass), and the
seeded draws are the ones a run without drafts makes.

**The stop rule** (`draft_len`): a verify of k drafts costs `VerifyCost.ratio(1 + k)` steps (a
draft model's k tokens cost k of its own steps more) and yields on average 1 + S(1) + ... +
S(k) tokens, S(i) the chance that the draft's first i tokens are all accepted. A slot verifies
the k that yields the most tokens per step, and none where that is not `1 + MARGIN` tokens a
step. Where even a draft that is always accepted cannot pay (a tiny model on a CPU, where a
verify of k costs about k steps), nothing is drafted.

S is read off the slot's own record as a run: drafts are right in stretches (a copied line, a
quoted block) and wrong between them, so the chance that the next token is rejected is kept per
position in the current run of tokens the drafts had right (BUCKETS: the 1st, the 2nd, the
3rd-4th, ... the 33rd-64th, the rest), not as one acceptance for every token. A draft made 20
tokens into such a run is priced at the run's 21st position onwards. Each bucket's rate is its
decayed counts (DECAY per draft recorded) over a prior carried from the bucket before it
(PRIOR_DEEP positions' worth; the first bucket's is PRIOR_A over PRIOR_TRIALS), so a position
the slot has not reached yet is priced as the deepest it has, and more data moves it at once.

**Every n-gram draft is measured, verified or not.** A draft the rule turns down is a shadow:
the tokens the plain steps make next are compared with it (`shadowed`), as a verify would have
compared them (for temperature > 0, a plain step's draw equals the draft's token with the
probability a verify accepts it). So a slot's record follows its answer without spending a
verify on a probe, and drafting restarts as soon as the answer starts to copy. A draft
model's tokens exist only where a verify runs, so a draft model's slot that is turned down, or
whose REJECT_RUN verifies in a row accepted nothing, pauses for PAUSE_TOKENS generated tokens
(doubled each time up to PAUSE_MAX) and then probes: its next draft is verified as if PROBE_A
of its tokens were accepted. A probe costs at most one verify per pause.

Everything the rule reads but the cost depends on the request's tokens; the cost is the
worker's start-up measurement, fixed for its life (backend.worker.speculation), so a cache hit
verifies the batches its cold run verified and answers as it did. `always` verifies every
draft, as llama-server does.

Pure: no I/O, clock or logging.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from policies.ngram import NGRAM_TYPES, Drafter, NgramParams, Tokens, make, n_max

# llama.cpp's types (common_speculative_type_to_str): what each is here
DRAFT_MODEL_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash",
                     "draft-dspark")
ALL_TYPES = ("none", *DRAFT_MODEL_TYPES, *NGRAM_TYPES, "ngram-cache")
NOT_BUILT = {
    "draft-eagle3": "EAGLE-3 draft heads are not supported (the n-gram types are)",
    "draft-mtp": "multi-token prediction heads are not supported (the n-gram types are)",
    "draft-dflash": "DFlash draft models are not supported (the n-gram types are)",
    "draft-dspark": "DSpark draft models are not supported (the n-gram types are)",
    "ngram-cache": "the n-gram cache type, with its lookup files, is not supported (ngram-simple, "
                   "ngram-map-k, ngram-map-k4v and ngram-mod are)",
}

MARGIN = 0.05  # a verify must promise this much more than one token a step
DECAY = 0.9  # weight of a slot's older drafts in its record after each new one
PRIOR_A, PRIOR_TRIALS = 0.5, 2.0  # a run's first draft token's acceptance before any draft
PRIOR_DEEP = 1.5  # positions' worth of the bucket before's rate each bucket starts from
REJECT_RUN = 3  # a draft model's verifies in a row that accepted nothing pause the slot
PAUSE_TOKENS, PAUSE_MAX = 16, 256  # generated tokens a pause lasts, doubling
PROBE_A = 0.8  # the acceptance a probe's length is chosen for


def parse_types(value: str) -> tuple[str, ...]:
    """`--spec-type a,b`: llama.cpp's names, in the order its chain tries them; "none" alone is
    off. A ValueError names what is unknown or not built here."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in ALL_TYPES]
    if unknown:
        raise ValueError(f"unknown type {', '.join(unknown)} (llama.cpp's: "
                         f"{', '.join(ALL_TYPES)})")
    refused = [n for n in names if n in NOT_BUILT]
    if refused:
        raise ValueError(f"{refused[0]}: {NOT_BUILT[refused[0]]}")
    return tuple(t for t in (*NGRAM_TYPES, "draft-simple") if t in names)


@dataclass(frozen=True, slots=True)
class SpecConfig:
    types: tuple[str, ...] = ()  # in chain order: n-gram types, then draft-simple; () = off
    ngram: NgramParams = field(default_factory=NgramParams)
    always: bool = False  # verify every draft (llama-server's way) instead of the stop rule
    # a draft model (draft-simple, llama.cpp's defaults): the most and least tokens of a draft,
    # and the least probability of a drafted token
    draft_n_max: int = 3
    draft_n_min: int = 0
    draft_p_min: float = 0.0

    @property
    def on(self) -> bool:
        return bool(self.types)

    @property
    def n_max(self) -> int:
        return max((self.draft_n_max if t == MODEL else n_max(t, self.ngram)
                    for t in self.types), default=0)

    def name(self) -> str:
        return ",".join(self.types) or "none"


MODEL = "draft-simple"
MODEL_TOKEN = -1  # a place held in a draft for a token the draft model drafts


@dataclass(slots=True)
class ModelDraft:
    """A draft model's turn in the chain: the places of up to n_max tokens, which the worker's
    draft model fills when the slot's step runs (backend.worker.draft_model)."""

    n_max: int
    name: str = MODEL

    def begin(self, prompt: Tokens) -> None:
        pass

    def draft(self, context: Tokens, last: int) -> list[int]:
        return [MODEL_TOKEN] * self.n_max

    def accept(self, n_accepted: int) -> None:
        pass


class Chain:
    """One request's drafters, tried in order (common_speculative_draft)."""

    def __init__(self, config: SpecConfig) -> None:
        self.drafters: list[Drafter] = [ModelDraft(config.draft_n_max) if t == MODEL
                                        else make(t, config.ngram) for t in config.types]
        self.last: Drafter | None = None  # the one whose draft was verified last

    def begin(self, prompt: Tokens) -> None:
        for d in self.drafters:
            d.begin(prompt)

    def draft(self, context: Tokens, last: int, room: int) -> tuple[str, list[int]]:
        if room <= 0:
            return "", []
        for d in self.drafters:
            out = d.draft(context, last)
            if out:
                self.last = d
                return d.name, out[:room]
        return "", []

    def accept(self, n_accepted: int) -> None:
        """The others are told nothing (llama.cpp's `is_other`: they ignore it)."""
        if self.last is not None:
            self.last.accept(n_accepted)


def room(n_live: int, n_ctx: int, left: int, n_batch: int) -> int:
    """Drafts a slot may verify now: `left` tokens the answer may still generate (the waiting
    one among them), the context's room less two, the batch less one."""
    return max(min(left - 1, n_ctx - n_live - 2, n_batch - 1), 0)


def accepted(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """Draft tokens accepted: the longest prefix the samples of its rows agree with."""
    n = 0
    while n < len(draft) and n < len(sampled) and draft[n] == sampled[n]:
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class VerifyCost:
    """Seconds of a verify of `rows[i]` rows over one step of one row: `ratios[i]`, measured.
    Between two measured sizes linear, past the last one extrapolated from the last two."""

    rows: tuple[int, ...] = (1,)
    ratios: tuple[float, ...] = (1.0,)
    draft_step: float = 0.0  # a draft model's step over one of the model's (0: none)

    def ratio(self, r: int) -> float:
        pts = list(zip(self.rows, self.ratios, strict=True))
        if r <= pts[0][0]:
            return pts[0][1]
        for (r0, t0), (r1, t1) in zip(pts, pts[1:], strict=False):
            if r <= r1:
                return t0 + (t1 - t0) * (r - r0) / (r1 - r0)
        if len(pts) == 1:
            return pts[0][1] * r
        (r0, t0), (r1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (r - r1) / (r1 - r0)

    def can_pay(self, n_max: int, per_draft: float = 0.0) -> bool:
        """Whether some verify of at most n_max drafts, every one accepted, beats single
        steps by MARGIN (`per_draft`: each drafted token's own cost, in steps)."""
        return any((1 + k) / (self.ratio(1 + k) + k * per_draft) > 1 + MARGIN
                   for k in range(1, n_max + 1))

    def pays_for(self, config: SpecConfig, n_max: int) -> bool:
        """`can_pay` for these types: a draft model's steps count where it alone drafts (an
        n-gram's draft is free, so a chain with one can pay where a verify can)."""
        return self.can_pay(n_max, self.draft_step if config.types == (MODEL,) else 0.0)

    def to_wire(self) -> dict[str, Any]:
        return {"rows": list(self.rows), "ratios": [round(x, 4) for x in self.ratios],
                "draft_step": round(self.draft_step, 4)}

    @classmethod
    def from_wire(cls, d: object) -> VerifyCost:
        if not isinstance(d, dict) or not isinstance(d.get("rows"), list) \
                or not isinstance(d.get("ratios"), list) or len(d["rows"]) != len(d["ratios"]) \
                or not d["rows"]:
            raise ValueError(f"malformed verify cost {d!r}")
        rows = tuple(int(r) for r in d["rows"])
        if list(rows) != sorted(set(rows)) or rows[0] < 1:
            raise ValueError(f"malformed verify cost {d!r}")
        return cls(rows, tuple(float(x) for x in d["ratios"]), float(d.get("draft_step", 0.0)))


# a draft's tokens, by their position in the run of tokens the drafts had right (1-based),
# fall in these buckets, each with its own rejection rate: the 1st, the 2nd, the 3rd-4th, ...,
# the 33rd-64th, then the rest
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # verify lengths the rule weighs
_ZEROS = (0.0,) * (len(BUCKETS) + 1)


@dataclass(frozen=True, slots=True)
class Stats:
    """One request's record of its drafts, verified or shadowed (the stop rule's inputs)."""

    reached: tuple[float, ...] = _ZEROS  # per bucket, decayed: draft tokens examined there
    rejected: tuple[float, ...] = _ZEROS  # ... and of them rejected
    rejects: int = 0  # verifies in a row that accepted nothing (a draft model's)
    pause_until: int = 0  # no drafting before this many generated tokens
    pause: int = PAUSE_TOKENS  # the next pause's length
    probe: bool = False  # a draft was turned down: the next, after the pause, is verified

    def rates(self) -> list[float]:
        """Per bucket, the chance that a draft token there is rejected (module rules)."""
        out, rate, weight = [], 1 - PRIOR_A, PRIOR_TRIALS
        for reached, rejected in zip(self.reached, self.rejected, strict=True):
            rate = (rejected + weight * rate) / (reached + weight)
            weight = PRIOR_DEEP
            out.append(rate)
        return out

    def yields(self, lengths: Sequence[int], run: int = 0) -> list[float]:
        """For each k of `lengths` (ascending), the tokens a verify of k drafts yields on
        average, `run` tokens into a run the drafts had right: 1 + S(1) + ... + S(k)."""
        rates = self.rates()
        out, y, s, at = [], 1.0, 1.0, run  # at: the run positions summed so far
        for k in lengths:
            for b, c in _spans(at, run + k):
                keep = 1 - rates[b]
                y += s * c if keep >= 1 else s * keep * (1 - keep ** c) / (1 - keep)
                s *= keep ** c
            at = run + k
            out.append(y)
        return out


def _spans(at: int, last: int) -> list[tuple[int, int]]:
    """Run positions at+1..last by bucket: (the bucket, how many of them fall in it)."""
    out = []
    while at < last:
        b = bisect_left(BUCKETS, at + 1)
        end = min(last, BUCKETS[b]) if b < len(BUCKETS) else last
        out.append((b, end - at))
        at = end
    return out


def expected(a: float, k: int) -> float:
    """Tokens a verify of k drafts yields at per-token acceptance a: 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def draft_len(stats: Stats, n: int, cost: VerifyCost | None, always: bool, n_gen: int,
              per_draft: float = 0.0, shadows: bool = True, run: int = 0
              ) -> tuple[int, Stats]:
    """How many of a draft of n tokens to verify (module rules; 0: one plain step), and the
    slot's record after the choice. `per_draft`: what making each drafted token costs, in
    steps (a draft model's step; 0 for an n-gram's). `shadows`: a draft turned down is
    compared with the tokens that come instead, as an n-gram's is; one that is not (a draft
    model's) pauses the slot. `run`: tokens in a row the slot's drafts had right."""
    if always or n <= 0:
        return max(n, 0), stats
    if n_gen < stats.pause_until:
        return 0, stats
    if cost is None:
        return n, stats
    lengths = [k for k in _LENGTHS if k < n] + [n]

    def per_step(k: int) -> float:
        return _ratio(cost, 1 + k) + k * per_draft
    if stats.probe:
        return max((expected(PROBE_A, k) / per_step(k), k) for k in lengths)[1], \
            replace(stats, probe=False)
    pays, k = max((y / per_step(k), k) for y, k in zip(stats.yields(lengths, run), lengths,
                                                       strict=True))
    if pays > 1 + MARGIN:
        return k, stats
    if shadows or not cost.can_pay(n, per_draft):
        return 0, stats
    return 0, replace(paused(stats, n_gen), probe=True)


@lru_cache(maxsize=1024)
def _ratio(cost: VerifyCost, r: int) -> float:
    return cost.ratio(r)


def paused(stats: Stats, n_gen: int) -> Stats:
    """Drafting stops for PAUSE tokens from now, the next pause doubled."""
    return replace(stats, pause_until=n_gen + stats.pause, pause=min(stats.pause * 2, PAUSE_MAX))


def _recorded(stats: Stats, run: int, examined: int, rejected_at: int | None, decay: bool
              ) -> Stats:
    """`stats` with run positions run+1..run+examined examined, the one at `rejected_at`
    rejected; `decay`: a new draft's record begins (the older ones weigh DECAY less)."""
    reached = [DECAY * r for r in stats.reached] if decay else list(stats.reached)
    rejected = [DECAY * r for r in stats.rejected] if decay else list(stats.rejected)
    for b, c in _spans(run, run + examined):
        reached[b] += c
    if rejected_at is not None:
        rejected[bisect_left(BUCKETS, rejected_at)] += 1
    return replace(stats, reached=tuple(reached), rejected=tuple(rejected))


def shadowed(stats: Stats, j: int, hit: bool, first: bool) -> Stats:
    """The record after a plain step compared the token it made with a draft turned down: the
    draft's token at run position j (1-based) was right (`hit`) or not; `first`: the draft's
    first token (its record begins)."""
    return _recorded(stats, j - 1, 1, None if hit else j, first)


def after(stats: Stats, k: int, m: int, n_gen: int, run: int = 0, shadows: bool = True
          ) -> Stats:
    """The record after a verify of k drafts of which m were accepted, `run` tokens into a run
    the drafts had right (`n_gen`: tokens generated after it; `shadows`: an n-gram's draft,
    which never pauses the slot)."""
    s = _recorded(stats, run, min(m + 1, k), run + m + 1 if m < k else None, True)
    if m > 0:
        return replace(s, rejects=0, pause=PAUSE_TOKENS)
    s = replace(s, rejects=s.rejects + 1)
    if shadows or s.rejects < REJECT_RUN:
        return s
    return paused(replace(s, rejects=0), n_gen)
