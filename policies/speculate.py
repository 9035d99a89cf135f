"""Speculative decoding's rules: which drafts a slot proposes, which of them the target accepts,
and whether a slot drafts at all (the stop rule).

    SpecConfig                              what --spec-type and its flags ask
    Chain(config).begin(prompt)             one per request, fed its prompt
    Chain.draft(context, last, room)        -> (source, tokens): the first type that drafts
    Chain.accept(n_accepted)
    accepted(draft, sampled) -> n           the target's acceptance
    VerifyCost                              a verify of r rows over one step, measured
    draft_len(stats, n, cost, always, n_gen)    -> (k, stats): the stop rule
    after(stats, k, m, n_gen) -> Stats      a slot's record after a verify of k, m accepted

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

**The stop rule** (`draft_len`): a verify of k drafts costs `VerifyCost.ratio(1 + k)` steps and
yields on average `E(a, k) = 1 + a + ... + a^k` tokens at per-token acceptance `a` (a draft
model's k tokens cost k of its own steps more). A slot
verifies the k that yields the most tokens per step, and none where that is not
`1 + MARGIN` tokens a step. `a` is the slot's own, decayed by DECAY per verify from a prior of
PRIOR_A worth PRIOR_TRIALS trials. Where even a draft that is always accepted cannot pay (a tiny
model on a CPU, where a verify of k costs about k steps), nothing is drafted. After
REJECT_RUN verifies in a row that accepted nothing, or a draft the rule turned down, the slot
pauses for PAUSE_TOKENS generated tokens, doubled each time up to PAUSE_MAX, and tries again.
After a turned-down draft, trying again is a probe: the next draft is verified as if the slot
accepted PROBE_A of its tokens, so its acceptance is measured, not left at the prior that
turned it down (at the prior alone, a type whose drafts would pay 2x was never verified once).
A probe costs at most one verify per pause.

Everything the rule reads but the cost depends on the request's tokens; the cost is the
worker's start-up measurement, fixed for its life (backend.worker.speculation), so a cache hit
verifies the batches its cold run verified and answers as it did. `always` verifies every
draft, as llama-server does.

Pure: no I/O, clock or logging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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
DECAY = 0.8  # weight of a slot's older verifies in its acceptance after each new one
PRIOR_A, PRIOR_TRIALS = 0.5, 2.0  # its acceptance before any verify
REJECT_RUN = 3  # verifies in a row that accepted nothing pause the slot
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


@dataclass(frozen=True, slots=True)
class Stats:
    """One request's record of its verifies (the stop rule's inputs)."""

    hits: float = PRIOR_A * PRIOR_TRIALS  # decayed accepted drafts
    trials: float = PRIOR_TRIALS  # decayed drafts examined (accepted + the first rejected)
    rejects: int = 0  # verifies in a row that accepted nothing
    pause_until: int = 0  # no drafting before this many generated tokens
    pause: int = PAUSE_TOKENS  # the next pause's length
    probe: bool = False  # a draft was turned down: the next, after the pause, is verified

    @property
    def acceptance(self) -> float:
        return self.hits / self.trials


def expected(a: float, k: int) -> float:
    """Tokens a verify of k drafts yields at per-token acceptance a: 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def draft_len(stats: Stats, n: int, cost: VerifyCost | None, always: bool, n_gen: int,
              per_draft: float = 0.0) -> tuple[int, Stats]:
    """How many of a draft of n tokens to verify (module rules; 0: one plain step), and the
    slot's record after the choice (a draft turned down pauses it). `per_draft`: what making
    each drafted token costs, in steps (a draft model's step; 0 for an n-gram's)."""
    if always or n <= 0:
        return max(n, 0), stats
    if n_gen < stats.pause_until:
        return 0, stats
    if cost is None:
        return n, stats

    def best(a: float) -> tuple[float, int]:
        return max((expected(a, k) / (cost.ratio(1 + k) + k * per_draft), k)
                   for k in range(1, n + 1))
    if stats.probe:
        return best(PROBE_A)[1], replace(stats, probe=False)
    pays, k = best(stats.acceptance)
    if pays > 1 + MARGIN:
        return k, stats
    if not cost.can_pay(n, per_draft):
        return 0, stats
    return 0, replace(paused(stats, n_gen), probe=True)


def paused(stats: Stats, n_gen: int) -> Stats:
    """Drafting stops for PAUSE tokens from now, the next pause doubled."""
    return replace(stats, pause_until=n_gen + stats.pause, pause=min(stats.pause * 2, PAUSE_MAX))


def after(stats: Stats, k: int, m: int, n_gen: int) -> Stats:
    """The record after a verify of k drafts of which m were accepted (`n_gen`: tokens
    generated after it)."""
    examined = min(m + 1, k)
    s = replace(stats, hits=DECAY * stats.hits + m, trials=DECAY * stats.trials + examined)
    if m > 0:
        return replace(s, rejects=0, pause=PAUSE_TOKENS)
    s = replace(s, rejects=s.rejects + 1)
    return paused(replace(s, rejects=0), n_gen) if s.rejects >= REJECT_RUN else s
