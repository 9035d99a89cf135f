"""The oracle: the fewest fresh prefill tokens any prefix cache could achieve on a trace.

For each turn, the fresh tokens are those beyond its longest common token prefix with any
earlier turn of the trace: an ideal cache that kept the KV of every earlier prompt, at every
position, forever, still has to prefill the rest. (A real server also re-evaluates the last
prompt token or two for their logits; the oracle does not count them.)

Token ids come from the proxy's own tokenizer and template (`bench.prompts`), so the
oracle and the proxy count the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.prefix import Batching, common_prefix_len


@dataclass(frozen=True, slots=True)
class Oracle:
    prompt_tokens: tuple[int, ...]  # per turn
    fresh_tokens: tuple[int, ...]  # per turn: beyond the longest prefix shared with an earlier turn

    @property
    def total_prompt(self) -> int:
        return sum(self.prompt_tokens)

    @property
    def total_fresh(self) -> int:
        return sum(self.fresh_tokens)

    @property
    def mean_hit_ratio(self) -> float:
        """Mean over turns of the share of the prompt an ideal cache serves."""
        ratios = [(n - f) / n if n else 0.0 for n, f in zip(self.prompt_tokens,
                                                              self.fresh_tokens, strict=True)]
        return sum(ratios) / len(ratios) if ratios else 0.0

    @property
    def token_hit_ratio(self) -> float:
        total = self.total_prompt
        return (total - self.total_fresh) / total if total else 0.0


def longest_earlier_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Per turn, its longest common token prefix with any earlier turn (0 for the first)."""
    seen: list[tuple[int, ...]] = []
    out = []
    for ids in prompts:
        t = tuple(ids)
        best = 0
        for other in seen:
            best = max(best, common_prefix_len(t, other))
            if best == len(t):
                break
        out.append(best)
        if t not in seen:
            seen.append(t)
    return out


def compute_oracle(prompts: Sequence[Sequence[int]], batching: Batching | None = None
                   ) -> Oracle:
    """`batching`: the oracle of a cache that, like prefixgate's (issue 19: a hit replays the
    cold run's batches), reuses only up to a batch edge (`policies.prefix.Batching`) and
    evaluates at least the last prompt token: a shared prefix counts down to an edge, and at
    most up to the last edge before the prompt's end."""
    shared = longest_earlier_prefix(prompts)
    if batching is not None:
        edges = [batching.edges(p) for p in prompts]
        shared = [min(e.floor(s), e.keep_max) for e, s in zip(edges, shared, strict=True)]
    return Oracle(tuple(len(p) for p in prompts),
                  tuple(len(p) - s for p, s in zip(prompts, shared, strict=True)))
