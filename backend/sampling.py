"""What a generated token is drawn with: the request's sampling values and llama.cpp's sampler
chain built from them (the stop-string matcher is backend.stops).

- `Sampling` is the wire form's fields (`backend.protocol.Job.sampling`), defaults as
  llama-cpp-python's.
- `Sampler` owns one llama.cpp sampler chain: penalties, the grammar, then greedy (temperature
  0) or top-k, typical, top-p, min-p, temperature and a seeded draw. A grammar llama.cpp cannot
  parse gives a NULL sampler: a ValueError when the chain is built, never a sample through it
  (a SIGSEGV that kills the worker). Free it with `close()`.
- Greedy with nothing before it (no grammar, penalties that change nothing), a sample is the
  first greatest logit, which is what llama.cpp's greedy sampler picks: read off the logits in
  place, without the chain's copy of the whole vocabulary into its candidates (about 50 us of a
  token's 7 ms on the 135M model on 2 cores; a penalty sampler with neutral values neither
  changes a logit nor keeps a state that matters). A row whose greatest logit is not a number
  goes through the chain, which ignores such logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import llama_cpp
import numpy as np

PENALTY_LAST_N = 64  # tokens the repetition penalties look back (llama-cpp-python's default)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.8  # 0 = greedy
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Sampling:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})


class Sampler:
    """One llama.cpp sampler chain (module docstring). Not thread-safe: used on the thread that
    decodes."""

    def __init__(self, vocab: Any, s: Sampling, grammar: str | None = None) -> None:
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = partial(llama_cpp.llama_sampler_chain_add, chain)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        add(llama_cpp.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, s.repeat_penalty,
                                                   s.frequency_penalty, s.presence_penalty))
        if grammar:
            g = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not g:
                llama_cpp.llama_sampler_free(chain)
                raise ValueError("llama.cpp could not build a sampler from the grammar (it does "
                                 "not parse); nothing was generated")
            add(g)
        if s.temperature <= 0:
            add(llama_cpp.llama_sampler_init_greedy())
            neutral = (s.repeat_penalty == 1.0 and s.frequency_penalty == 0.0
                       and s.presence_penalty == 0.0)
            self.argmax = n_vocab if neutral and not grammar else 0
        else:
            add(llama_cpp.llama_sampler_init_top_k(s.top_k))
            add(llama_cpp.llama_sampler_init_typical(1.0, 1))
            add(llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
            add(llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
            add(llama_cpp.llama_sampler_init_temp(s.temperature))
            seed = llama_cpp.LLAMA_DEFAULT_SEED if s.seed is None else s.seed & 0xFFFFFFFF
            add(llama_cpp.llama_sampler_init_dist(seed))
        self.chain: Any = chain

    argmax = 0  # greedy alone: the vocabulary's size (the module docstring); else 0

    def sample(self, ctx: Any, row: int) -> int:
        """A token drawn from row `row` of the context's last logits (and accepted into the
        chain's state: penalties, grammar)."""
        ptr = llama_cpp.llama_get_logits_ith(ctx, row) if self.argmax else None
        if ptr:  # (NULL: llama.cpp refused the row; the chain says so as it does)
            logits = np.ctypeslib.as_array(ptr, shape=(self.argmax,))
            token = int(logits.argmax())
            if logits[token] == logits[token]:  # not NaN
                return token
        return int(llama_cpp.llama_sampler_sample(self.chain, ctx, row))

    def close(self) -> None:
        if self.chain is not None:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None
