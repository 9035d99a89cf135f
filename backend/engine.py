"""One llama.cpp context and the exact-prefix execution of a plan. Blocking: call from one thread.

Rules this module keeps:
- The live KV of sequence 0 always holds exactly `llm.input_ids[:llm.n_tokens]`. Every change of
  `n_tokens` is paired with a `seq_rm` of the positions past it, so a snapshot taken at any moment
  holds KV for exactly `n_tokens` tokens (the exactness invariant of the cache).
- Prefill runs in segments that stop exactly at each save point; the state is copied there with
  the per-sequence API (`llama_state_seq_get_data`), never `Llama.save_state` (whole context plus
  logits).
- At least the last prompt token is always evaluated, because logits are not part of a snapshot.
- Batch invariance: llama.cpp's CPU kernels give bit-identical KV for a token whatever the size
  of the batch it was evaluated in, *except* a batch of one token (a different kernel path; its
  KV differs in the last bits and a greedy continuation can diverge). So no prefill batch is ever
  one token long (a lone token is evaluated together with the one before it), and tokens that
  were generated (evaluated one at a time) are not *exact*: live reuse stops at `exact_n`, the
  end of the KV that a cold prefill would have computed identically. This is what makes the
  output of a cache hit equal to the output of a cold run.
- Batch invariance needs the plain CPU kernels: llama.cpp's CPU "extra buffer types" (weights
  repacked for AMX or AVX tile kernels, on by default) compute a token's KV differently depending
  on the batch around it (measured on a Sapphire Rapids Xeon: logits after the same 400 tokens
  prefilled as 400 or as 100 + 300 differed by up to 3.0, and a cache hit's greedy output
  differed from a cold run's). The engine loads the model without them (`use_extra_bufts`).
- Cancellation is checked between prefill batches and between generated tokens.
- A grammar llama.cpp cannot parse is a ValueError before the first sample (its sampler comes
  back NULL), never a crash of the worker.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import llama_cpp.llama as llama_cpp_llama
import numpy as np

log = logging.getLogger("prefixgate.engine")


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


@dataclass(slots=True)
class Cancel:
    """Set from another thread; the engine stops at the next batch or token."""

    event: threading.Event = field(default_factory=threading.Event)

    def set(self) -> None:
        self.event.set()

    @property
    def is_set(self) -> bool:
        return self.event.is_set()


class Cancelled(Exception):
    pass


class StopMatcher:
    """Holds back text that could still become a stop string; never splits a UTF-8 character."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string that matched or None). Of several
        matches the earliest wins, the longest among those starting there."""
        buf = self.pending + self.decoder.decode(piece)
        found = [(i, -len(s), s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            cut, _, matched = min(found)
            self.pending = ""
            return buf[:cut], matched
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        out = self.pending + self.decoder.decode(b"", final=True)
        self.pending = ""
        return out


@contextlib.contextmanager
def _without_extra_buffer_types() -> Iterator[None]:
    """`Llama()` takes no `use_extra_bufts` argument: hand it default model params with the
    extra buffer types off while it loads (see the module rules: batch invariance)."""
    low = llama_cpp_llama.llama_cpp
    default = low.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


class Engine:
    """Owns one `llama_cpp.Llama`. Not thread-safe: the worker runs it on one thread."""

    def __init__(
        self,
        model_path: str,
        n_ctx: int,
        n_threads: int | None,
        n_gpu_layers: int,
        n_batch: int = 512,
        flash_attn: bool = False,
    ) -> None:
        with _without_extra_buffer_types():
            self.llm = llama_cpp.Llama(
                model_path=model_path,
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_threads=n_threads,
                n_gpu_layers=n_gpu_layers,
                flash_attn=flash_attn,
                verbose=False,
            )
        self.n_ctx = self.llm.n_ctx()
        self.n_batch = n_batch
        self._eog = {t for t in range(self.llm.n_vocab()) if self._is_eog(t)}
        self.exact_n = 0  # leading live tokens whose KV a cold prefill computes identically

    def _is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_token_is_eog(self.llm._model.vocab, token))

    def piece(self, token: int) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character)."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.llm._model.vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.llm._model.vocab, token, buf, -n, 0, False)
        return buf.raw[:n]

    # --- live state ------------------------------------------------------------------------

    @property
    def n_live(self) -> int:
        return int(self.llm.n_tokens)

    def live_ids(self) -> list[int]:
        return [int(t) for t in self.llm.input_ids[: self.llm.n_tokens]]

    def live_prefix(self, ids: Sequence[int]) -> int:
        """Tokens of `ids` the live KV already holds exactly."""
        n = min(self.exact_n, len(ids))
        if n == 0:
            return 0
        diff = np.nonzero(self.llm.input_ids[:n] != np.asarray(ids[:n], dtype=np.intc))[0]
        return int(diff[0]) if len(diff) else n

    def truncate(self, n: int) -> None:
        """Keep exactly the first n live tokens."""
        self.llm.n_tokens = n
        self.llm._ctx.kv_cache_seq_rm(0, n, -1)
        self.exact_n = min(self.exact_n, n)

    # --- snapshots -------------------------------------------------------------------------

    def snapshot(self) -> memoryview:
        """A copy of sequence 0's state: KV for exactly `n_live` tokens. One copy into a fresh
        buffer that is not zeroed first (this runs on the hot path, between prefill segments)."""
        ctx = self.llm._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        out = np.empty(size, dtype=np.uint8)
        dst = out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = llama_cpp.llama_state_seq_get_data(ctx, dst, size, 0)
        return memoryview(out)[:n]

    def snapshot_behind(self, p: int) -> memoryview:
        """A snapshot of exactly the first p < n_live tokens, taken from the live KV: cut back
        to p, copied, then the whole live state put back (plain attention can be cut back to
        any position; the state put back is the one copied, so nothing changes). Costs two
        copies and a restore, no prefill."""
        assert 0 < p < self.n_live <= self.exact_n, (p, self.n_live, self.exact_n)
        live_ids = self.live_ids()
        whole = self.snapshot()
        self.truncate(p)
        part = self.snapshot()
        self.restore(live_ids, whole)
        return part

    def restore(self, ids: Sequence[int], state: bytes | memoryview) -> None:
        """Load a snapshot of exactly len(ids) tokens into sequence 0 (read in place)."""
        self.truncate(0)
        if isinstance(state, bytes):
            src = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
        else:  # a snapshot of ours: point at its buffer, no copy
            src = np.frombuffer(state, dtype=np.uint8).ctypes.data_as(
                ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self.llm._ctx.ctx, src, len(state), 0) == 0:
            self.truncate(0)
            raise ValueError("llama_state_seq_set_data refused the state")
        n = len(ids)
        self.llm.input_ids[:n] = ids
        self.llm.n_tokens = n
        self.exact_n = n

    # --- prefill and generation ------------------------------------------------------------

    def prefill(
        self,
        ids: Sequence[int],
        stops_at: Sequence[int],
        on_stop: Callable[[int], None],
        cancel: Cancel,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        """Evaluate ids[n_live:], stopping exactly at each position of `stops_at` to call
        on_stop(position) (a snapshot point), then evaluate the rest. Every batch is exact, so
        a cancelled prefill keeps what it evaluated for the next request; on_batch(n_live)
        follows each one."""
        points = sorted(p for p in set(stops_at) if self.n_live <= p <= len(ids))
        for p in sorted({*points, len(ids)}):  # a save point at the prompt end: one snapshot
            if p - self.n_live == 1 and self.n_live > 0:
                self.truncate(self.n_live - 1)  # never a one-token batch (see module doc)
            while self.n_live < p:
                if cancel.is_set:
                    raise Cancelled()
                end = min(p, self.n_live + self.n_batch)
                if p - end == 1:
                    end -= 1  # leave two tokens for the last batch, not one
                self.llm.eval(ids[self.n_live : end])
                self.exact_n = self.n_live
                if on_batch is not None:
                    on_batch(self.n_live)
            if p in points:
                on_stop(p)

    def generate(
        self,
        sampling: Sampling,
        max_tokens: int,
        cancel: Cancel,
        grammar: llama_cpp.LlamaGrammar | None = None,
    ) -> Iterator[tuple[int, bytes, bool]]:
        """Yield (token, piece bytes, is_end_of_generation) after a prefill. The caller stops
        iterating on a stop string; the last sampled token is never evaluated."""
        llm = self.llm
        if sampling.seed is not None:
            llm.set_seed(sampling.seed)
        sampler = llm._init_sampler(
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
            temp=sampling.temperature,
            repeat_penalty=sampling.repeat_penalty,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            grammar=grammar,
        )
        if grammar is not None and not _chain_complete(sampler):
            sampler.close()
            raise ValueError("llama.cpp could not build a sampler from the grammar (it does not "
                             "parse); nothing was generated")
        for i in range(max_tokens):
            if cancel.is_set:
                raise Cancelled()
            token = sampler.sample(llm._ctx, -1)
            if token in self._eog:
                yield token, b"", True
                return
            yield token, self.piece(token), False
            if i + 1 < max_tokens and llm.n_tokens < self.n_ctx:
                llm.eval([token])
            elif llm.n_tokens >= self.n_ctx:
                return


def _chain_complete(sampler: Any) -> bool:
    """Whether every sampler in the chain exists: llama.cpp's grammar sampler comes back NULL
    for a grammar it cannot parse, llama-cpp-python adds it to the chain all the same, and the
    first sample would dereference it (a SIGSEGV that kills the worker)."""
    chain = sampler.sampler
    return all(llama_cpp.llama_sampler_chain_get(chain, i)
               for i in range(llama_cpp.llama_sampler_chain_n(chain)))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
