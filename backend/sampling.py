"""What a generated token is drawn with: the request's sampling values and llama.cpp's sampler
chain built from them, as llama-server builds it (the stop-string matcher is backend.stops).

- `Sampling` is the wire form's fields (`backend.protocol.Job.sampling`): llama-server's request
  names, defaults as llama.cpp's `common_params_sampling` (proxy/samplers.py checks them).
- `Sampler` owns one llama.cpp sampler chain in `common_sampler_init`'s order: the logit
  biases (the request's, the model's suppressed tokens, every end-of-generation token under
  `ignore_eos`), then the samplers in `samplers` order (penalties, dry, top_n_sigma, top_k,
  typ_p, top_p, min_p, xtc, temperature by default; the temperature stage of a temperature of 0
  or less keeps only the greatest logit) and a seeded draw (adaptive_p's where
  it is named); or, with mirostat 1 or 2, the temperature and mirostat. The penalties and DRY
  start with the prompt's last tokens in their windows, as llama-server's chain has every prompt
  token accepted before its first draw (the others keep no state of them). Free it with
  `close()`.
- A grammar is a sampler apart, used as `common_sampler_sample` uses it: the chain draws alone;
  a pick the grammar allows is taken (one token checked, not the vocabulary: the grammar's cost
  is paid only where the chain strays); otherwise the chain draws again on the candidates the
  grammar leaves. Those candidates are this process's, and a pick the grammar masked (logits
  that are not numbers) is a ValueError, never an accept that throws inside llama.cpp (an abort
  of the worker). A grammar llama.cpp cannot parse gives a NULL sampler: a ValueError when the
  Sampler is made, never a sample through it (a SIGSEGV).
- A reasoning budget (`policies.reasoning_budget`), as llama.cpp's sampler applies it before
  the chain: while it forces the block's end, the forced token is drawn through the chain with
  every other logit at -inf (so the penalties and the seeded draw move as llama-server's do);
  every token drawn is then fed to it. Left out where a grammar applies.
- Greedy with nothing else that can change the pick (no grammar, no bias, penalties, DRY, XTC
  or mirostat that change nothing, the temperature stage in the chain), a sample is the first
  greatest logit, which is what the chain picks: read off the logits in place, without the
  chain's copy of the whole vocabulary into its candidates (about 50 us of a token's 7 ms on the
  135M model on 2 cores).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from policies.reasoning_budget import Budget, utf8_complete

# llama.cpp's default order (common_params_sampling::samplers)
ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
         "temperature")


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
    repeat_last_n: int = 64  # tokens the repetition penalties look back
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    min_keep: int = 0
    samplers: tuple[str, ...] = ORDER
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); -inf bans it
    ignore_eos: bool = False
    # a reasoning budget (policies.reasoning_budget): the most tokens (-1: none), the block's
    # opening tokens, the sequences that end it, what is forced at its end, and the generation
    # prompt's tokens, fed to it first
    reasoning_budget_tokens: int = -1
    reasoning_budget_start: tuple[int, ...] = ()
    reasoning_budget_end: tuple[tuple[int, ...], ...] = ()
    reasoning_budget_forced: tuple[int, ...] = ()
    reasoning_budget_prefill: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Sampling:
        names = cls.__dataclass_fields__
        out = {k: v for k, v in d.items() if k in names and v is not None}
        for k in ("dry_sequence_breakers", "samplers", "reasoning_budget_start",
                  "reasoning_budget_forced", "reasoning_budget_prefill"):
            if k in out:
                out[k] = tuple(out[k])
        if "reasoning_budget_end" in out:
            out["reasoning_budget_end"] = tuple(tuple(e) for e in out["reasoning_budget_end"])
        if "logit_bias" in out:
            out["logit_bias"] = tuple((int(t), float(b)) for t, b in out["logit_bias"])
        return cls(**out)

    @property
    def history(self) -> int:
        """How many of the last prompt tokens the chain's state holds (the penalties' and DRY's
        windows): llama-server accepts every prompt token into the chain before it samples."""
        return max(self.repeat_last_n, self.dry_penalty_last_n)

    @property
    def picks_greatest(self) -> bool:
        """Whether every draw is the greatest logit of the row as the model gave it, where no
        logit bias applies (the Sampler checks that, the model's suppressed tokens among them)."""
        return (self.temperature <= 0 and self.mirostat == 0 and "temperature" in self.samplers
                and "adaptive_p" not in self.samplers
                and (self.repeat_last_n == 0 or "penalties" not in self.samplers
                     or (self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0
                         and self.presence_penalty == 0.0))
                and (self.dry_multiplier == 0 or "dry" not in self.samplers)
                and (self.xtc_probability <= 0 or self.xtc_threshold > 0.5
                     or "xtc" not in self.samplers)
                and "infill" not in self.samplers)


def _bias(vocab: Any, s: Sampling, eog: frozenset[int]) -> list[tuple[int, float]]:
    """The request's biases, then the model's suppressed tokens and, under ignore_eos, every
    end-of-generation token, each at -inf (common_sampler_init's merged list)."""
    out = list(s.logit_bias)
    n = ctypes.c_int32(0)
    suppress = llama_cpp.llama_vocab_get_suppress_tokens(vocab, ctypes.byref(n))
    out += [(int(suppress[i]), -math.inf) for i in range(n.value)] if suppress else []
    if s.ignore_eos:
        out += [(t, -math.inf) for t in sorted(eog)]
    return out


class Sampler:
    """One llama.cpp sampler chain (module docstring). Not thread-safe: used on the thread that
    decodes."""

    def __init__(self, vocab: Any, s: Sampling, grammar: str | None = None,
                 eog: frozenset[int] = frozenset(), history: Sequence[int] = (),
                 piece: Callable[[int], bytes] = lambda _: b"") -> None:
        self.chain: Any = llama_cpp.llama_sampler_chain_init(
            llama_cpp.llama_sampler_chain_default_params())
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        bias = _bias(vocab, s, eog)
        try:
            self._build(vocab, n_vocab, s, grammar, bias, history)
        except BaseException:
            self.close()
            raise
        self.argmax = n_vocab if s.picks_greatest and not (grammar or bias) else 0
        self.piece = piece  # a token's bytes (the engine's), for the budget's UTF-8 rule
        # a reasoning budget, where the block's tags are known; a grammar (a forced call, which
        # does not reason, or the answer's format) leaves it out
        self.budget = Budget.of(s.reasoning_budget_tokens, s.reasoning_budget_start,
                                s.reasoning_budget_end, s.reasoning_budget_forced) \
            if s.reasoning_budget_tokens >= 0 and s.reasoning_budget_start and \
            s.reasoning_budget_end and not grammar else None
        for token in s.reasoning_budget_prefill if self.budget is not None else ():
            self.budget.prefill(token, utf8_complete(self.piece(token)))
        self.cur: Any = None  # with a grammar or a budget: the candidates (the module docstring)
        if grammar or self.budget is not None:
            self.cur = np.zeros(n_vocab, dtype=[("id", np.int32), ("logit", np.float32),
                                                ("p", np.float32)])
            self.ids = np.arange(n_vocab, dtype=np.int32)

    argmax = 0  # greedy alone: the vocabulary's size (the module docstring); else 0
    grammar: Any = None  # llama.cpp's grammar sampler, apart from the chain
    budget: Budget | None = None

    def _build(self, vocab: Any, n_vocab: int, s: Sampling, grammar: str | None,
               bias: list[tuple[int, float]], history: Sequence[int]) -> None:
        # common_sampler_init's refusals (such penalties make logits that are not numbers)
        if not (math.isfinite(s.repeat_penalty) and s.repeat_penalty > 0
                and math.isfinite(1 / s.repeat_penalty) and math.isfinite(s.frequency_penalty)
                and math.isfinite(s.presence_penalty)):
            raise ValueError("the repetition penalty must be a number above 0, and the "
                             "frequency and presence penalties numbers")
        seed = llama_cpp.LLAMA_DEFAULT_SEED if s.seed is None else s.seed & 0xFFFFFFFF
        if grammar:
            self.grammar = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(),
                                                                b"root") or None
            if self.grammar is None:
                raise ValueError("llama.cpp could not build a sampler from the grammar (it does "
                                 "not parse); nothing was generated")
        if bias:
            arr = (llama_cpp.llama_logit_bias * len(bias))(
                *(llama_cpp.llama_logit_bias(t, b) for t, b in bias))
            self._add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
        if s.mirostat:
            self._add(llama_cpp.llama_sampler_init_temp(s.temperature))
            self._add(llama_cpp.llama_sampler_init_mirostat(n_vocab, seed, s.mirostat_tau,
                                                            s.mirostat_eta, 100)
                      if s.mirostat == 1 else
                      llama_cpp.llama_sampler_init_mirostat_v2(seed, s.mirostat_tau,
                                                               s.mirostat_eta))
        else:
            for name in s.samplers:
                if name != "adaptive_p":
                    stage = self._stage(name, vocab, n_vocab, s, seed)
                    if name in ("penalties", "dry"):  # the prompt (not the grammar's)
                        for token in history:
                            llama_cpp.llama_sampler_accept(stage, token)
                    self._add(stage)
            self._add(llama_cpp.llama_sampler_init_adaptive_p(s.adaptive_target,
                                                              s.adaptive_decay, seed)
                      if "adaptive_p" in s.samplers else llama_cpp.llama_sampler_init_dist(seed))

    def _add(self, sampler: Any) -> None:
        llama_cpp.llama_sampler_chain_add(self.chain, sampler)

    @staticmethod
    def _stage(name: str, vocab: Any, n_vocab: int, s: Sampling, seed: int) -> Any:
        if name == "penalties":
            return llama_cpp.llama_sampler_init_penalties(
                n_vocab, s.repeat_last_n, s.repeat_penalty, s.frequency_penalty,
                s.presence_penalty)
        if name == "dry":
            breakers = [b.encode() for b in s.dry_sequence_breakers]
            arr = (ctypes.c_char_p * max(1, len(breakers)))(*breakers)
            return llama_cpp.llama_sampler_init_dry(vocab, s.dry_multiplier, s.dry_base,
                                                    s.dry_allowed_length, s.dry_penalty_last_n,
                                                    arr, len(breakers))
        if name == "top_n_sigma":
            return llama_cpp.llama_sampler_init_top_n_sigma(s.top_n_sigma)
        if name == "top_k":
            return llama_cpp.llama_sampler_init_top_k(s.top_k)
        if name == "typ_p":
            return llama_cpp.llama_sampler_init_typical(s.typical_p, s.min_keep)
        if name == "top_p":
            return llama_cpp.llama_sampler_init_top_p(s.top_p, s.min_keep)
        if name == "min_p":
            return llama_cpp.llama_sampler_init_min_p(s.min_p, s.min_keep)
        if name == "xtc":
            return llama_cpp.llama_sampler_init_xtc(s.xtc_probability, s.xtc_threshold,
                                                    s.min_keep, seed)
        if name == "temperature":
            return llama_cpp.llama_sampler_init_temp_ext(s.temperature, s.dynatemp_range,
                                                         s.dynatemp_exponent)
        if name == "infill":
            return llama_cpp.llama_sampler_init_infill(vocab)
        raise ValueError(f"no sampler named {name!r}")

    def sample(self, ctx: Any, row: int) -> int:
        """A token drawn from row `row` of the context's last logits (and accepted into the
        chain's state: penalties, grammar, the reasoning budget)."""
        if self.budget is None:
            return self._sample(ctx, row)
        forced = self.budget.forced_token
        token = self._sample(ctx, row) if forced is None else self._force(forced)
        self.budget.accept(token, utf8_complete(self.piece(token)))
        return token

    def _force(self, token: int) -> int:
        """`token`, drawn as llama.cpp's budget forces it: every other logit -inf before the
        chain, whose state (penalties, the seeded draw) moves as it would."""
        if self.argmax:
            return token
        logits = np.full(len(self.cur), -math.inf, dtype=np.float32)
        logits[token] = 0.0
        self._draw(logits, with_grammar=False)
        llama_cpp.llama_sampler_accept(self.chain, token)
        return token

    def _sample(self, ctx: Any, row: int) -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, row) if self.argmax else None
        if ptr:  # (NULL: llama.cpp refused the row; the chain says so as it does)
            logits = np.ctypeslib.as_array(ptr, shape=(self.argmax,))
            token = int(logits.argmax())
            if logits[token] == logits[token]:  # not NaN
                return token
        if self.grammar is None:
            return int(llama_cpp.llama_sampler_sample(self.chain, ctx, row))
        ptr = llama_cpp.llama_get_logits_ith(ctx, row)
        if not ptr:
            raise ValueError(f"llama.cpp has no logits for row {row}")
        logits = np.ctypeslib.as_array(ptr, shape=(len(self.cur),))
        token = self._draw(logits, with_grammar=False)
        if token < 0 or not self._allows(token):  # the grammar forbids it: the grammar first
            token = self._draw(logits, with_grammar=True)
            if token < 0:
                raise ValueError("the sampler chain drew no token the grammar allows (the "
                                 "model's logits, or the sampling values, gave no numbers)")
        llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain, token)
        return token

    def _allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next (it is given that one token to mask)."""
        one = llama_cpp.llama_token_data(token, 1.0, 0.0)
        llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(
            llama_cpp.llama_token_data_array(ctypes.pointer(one), 1, -1, False)))
        return bool(one.logit > -math.inf)

    def _draw(self, logits: Any, with_grammar: bool) -> int:
        """The chain's pick from `logits` (the grammar applied first, `with_grammar`); -1 for
        none, or one that is masked or no number."""
        cur = self.cur  # the samplers sort and cut it in place: filled afresh each draw
        cur["id"] = self.ids
        cur["logit"] = logits
        cur["p"] = 0.0
        arr = llama_cpp.llama_token_data_array(
            cur.ctypes.data_as(llama_cpp.llama_token_data_p), len(cur), -1, False)
        if with_grammar:
            llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(arr))
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(arr))
        picked = arr.data[arr.selected] if 0 <= arr.selected < arr.size else None
        return -1 if picked is None or not picked.logit > -math.inf else int(picked.id)

    def close(self) -> None:
        if self.chain is not None:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar is not None:
            llama_cpp.llama_sampler_free(self.grammar)
            self.grammar = None
