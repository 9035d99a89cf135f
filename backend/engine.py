"""One llama.cpp context and the exact-prefix execution of a plan. Blocking: call from one thread.

Rules this module keeps:
- The live state of sequence 0 always holds exactly `ids[:n_live]`. Every change of `n_live` is
  paired with a `seq_rm` of the positions past it whose result is checked, so a snapshot taken
  at any moment holds KV (and recurrent state) for exactly `n_live` tokens (the exactness
  invariant of the cache).
- The memory decides how far back the live state can be cut (`Memory`): plain attention to any
  position; a real sliding window only while the window's cells are still there; a recurrent or
  hybrid model not at all (its state exists at its last position only). `live_prefix` offers
  only what can be kept, and a cut the memory refuses empties the state, never leaves it wrong:
  the request then restores a snapshot or prefills cold.
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
  A recurrent state is one more reason never to cut back by a token: where the memory cannot,
  a save point one token past the previous stop is skipped instead.
- Batch invariance does not hold for llama.cpp's CUDA kernels: on an H100, a prefill split at
  300 tokens changed the last logits by up to 2.3, one split at 512 (a batch edge) by 0.0. Where
  layers are offloaded to a GPU, reuse and snapshots happen only at multiples of the batch size
  (`align`; the plan's positions are multiples already, `policies.decide` rule 7), so a hit runs
  the same batches, of the same shapes at the same positions, as a cold run. The CPU rules
  about one-token batches do not apply there: both runs make the same ones.
- Cancellation is checked between prefill batches and between generated tokens.
- A grammar llama.cpp cannot parse is a ValueError before the first sample (its sampler comes
  back NULL), never a crash of the worker.
- Only llama.cpp's C API (the `llama_cpp` bindings) is used: model and context parameters set
  directly (the KV cache types, flash attention on/off/auto, `swa_full`, no extra buffer types),
  our own batch, memory calls and sampler chain.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import llama_cpp
import numpy as np

from policies.prefix import live_reuse

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


CACHE_TYPES: dict[str, int] = {  # llama.cpp's -ctk/-ctv names -> ggml types
    "f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20,
    "q5_0": 6, "q5_1": 7,
}
FLASH_ATTN = ("on", "off", "auto")

MemoryKind = Literal["plain", "window", "recurrent"]


@dataclass(frozen=True, slots=True)
class Memory:
    """What the model's memory lets the live state do.

    - ``plain``: attention KV for every position; cut back to any position.
    - ``window``: sliding-window attention (``n_swa`` tokens): the window layers may hold only
      the cells of the last window, so the state can be cut back only while the cells of the new
      position's window are still there (``llama_memory_seq_pos_min``). With a real window
      (``full`` false) they drop what falls behind it as the prompt grows; with a full-size
      cache they keep everything they computed, but a restored snapshot holds only its last
      window (llama.cpp does not write cells the window masks).
    - ``recurrent``: a recurrent or hybrid model (Mamba, gated delta net, short conv beside
      attention): the recurrent state exists only at its last position; never cut back.
    """

    kind: MemoryKind
    n_swa: int = 0
    full: bool = False  # window: a full-size cache for the window layers (--swa-full)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "n_swa": self.n_swa, "swa_full": self.full}


class Engine:
    """One llama.cpp model and context, driven through llama.cpp's C API (the `llama_cpp`
    bindings; no `Llama` object). Not thread-safe: the worker runs it on one thread."""

    def __init__(
        self,
        model_path: str,
        n_ctx: int,
        n_threads: int | None,
        n_gpu_layers: int,
        n_batch: int = 512,
        flash_attn: str = "off",
        type_k: str = "f16",
        type_v: str = "f16",
        swa_full: bool = True,
        align: int | None = None,
    ) -> None:
        if flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash attention is one of {', '.join(FLASH_ATTN)}")
        for t in (type_k, type_v):
            if t not in CACHE_TYPES:
                raise ValueError(f"unknown KV cache type {t!r} (one of {', '.join(CACHE_TYPES)})")
        _backend_init()
        mp = llama_cpp.llama_model_default_params()
        # -1: every layer (llama.cpp takes a count; -1 itself is not "all" there)
        mp.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers < 0 else n_gpu_layers
        mp.use_extra_bufts = False  # batch invariance (module rules)
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
        if not self.model:
            raise ValueError(f"llama.cpp could not load the model {model_path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, 1
        cores = os.cpu_count() or 1
        cp.n_threads = n_threads or max(cores // 2, 1)
        cp.n_threads_batch = n_threads or cores
        cp.flash_attn_type = {"on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                              "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                              "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO}[flash_attn]
        cp.type_k, cp.type_v = CACHE_TYPES[type_k], CACHE_TYPES[type_v]
        cp.swa_full = swa_full
        cp.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise ValueError(
                f"llama.cpp could not create a context (n_ctx {n_ctx}, K {type_k}, V {type_v}, "
                f"flash attention {flash_attn}; a quantized V cache needs flash attention)")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        self.n_batch = n_batch
        self.memory = _memory_of(self.model, swa_full)
        # reuse only at batch edges where the kernels are not batch-invariant (module rules)
        offloaded = n_gpu_layers != 0 and llama_cpp.llama_supports_gpu_offload()
        self.align = align if align is not None else n_batch if offloaded else 1
        self.ids = np.zeros(self.n_ctx, dtype=np.intc)  # ids[:n_live] is what the KV holds
        self.n_live = 0
        self.exact_n = 0  # leading live tokens whose KV a cold prefill computes identically
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self._eog = {t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)}

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self.ctx)
            llama_cpp.llama_model_free(self.model)
            self.ctx = None

    def piece(self, token: int) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character). Control tokens are
        written out (`<|channel|>`, `<｜tool▁calls▁begin｜>`): the tool dialects parse them;
        end-of-generation tokens never get here."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 64, 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, True)
        return buf.raw[:n]

    # --- live state ------------------------------------------------------------------------

    def live_ids(self) -> list[int]:
        return [int(t) for t in self.ids[: self.n_live]]

    def floor(self) -> int:
        """The shortest live prefix (other than none) the memory can be cut back to: 0 for
        plain attention, the whole live sequence for a recurrent state, and for a real sliding
        window the first position whose window cells are all still there."""
        if self.memory.kind == "plain" or self.n_live == 0:
            return 0
        if self.memory.kind == "recurrent":
            return self.n_live
        pos_min = int(llama_cpp.llama_memory_seq_pos_min(self.mem, 0))
        if pos_min <= 0:
            return 0
        return min(pos_min + self.memory.n_swa + 1, self.n_live)

    def live_prefix(self, ids: Sequence[int]) -> int:
        """Tokens of `ids` the live KV holds exactly and can be cut back to."""
        n = min(self.exact_n, len(ids))
        if n == 0:
            return 0
        diff = np.nonzero(self.ids[:n] != np.asarray(ids[:n], dtype=np.intc))[0]
        n = int(diff[0]) if len(diff) else n
        return live_reuse(n // self.align * self.align, self.n_live, self.floor())

    def reusable(self) -> tuple[int, int]:
        """(live tokens a next request may keep, the shortest of them the memory can be cut
        back to). Generated tokens are not exact (module rules), so where the memory cannot be
        cut back to the exact part (a recurrent state after generating), none."""
        n, floor = self.exact_n, self.floor()
        if n < self.n_live and n < floor:
            return 0, 0
        return n, min(floor, n)

    def truncate(self, n: int) -> int:
        """Keep exactly the first n live tokens, or, where the memory refuses to cut back
        there, none. Returns what is kept: never a state that holds anything but ids[:kept]."""
        n = min(n, self.n_live)
        if n == self.n_live:
            self.exact_n = min(self.exact_n, n)
            return n
        n = live_reuse(n, self.n_live, self.floor())  # none where the memory cannot cut back
        if not llama_cpp.llama_memory_seq_rm(self.mem, 0, n, -1):
            log.warning("llama.cpp refused to cut the live state back to %d of %d tokens; "
                        "starting from none", n, self.n_live)
            n = 0
            llama_cpp.llama_memory_clear(self.mem, True)
        self.n_live = n
        self.exact_n = min(self.exact_n, n)
        return n

    # --- snapshots -------------------------------------------------------------------------

    def snapshot(self) -> memoryview:
        """A copy of sequence 0's state: KV (and recurrent state) for exactly `n_live` tokens.
        One copy into a fresh buffer that is not zeroed first (this runs on the hot path,
        between prefill segments)."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, 0)
        out = np.empty(size, dtype=np.uint8)
        dst = out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = llama_cpp.llama_state_seq_get_data(self.ctx, dst, size, 0)
        return memoryview(out)[:n]

    def can_snapshot_behind(self, p: int) -> bool:
        return 0 < p < self.n_live <= self.exact_n and p >= self.floor()

    def snapshot_behind(self, p: int) -> memoryview:
        """A snapshot of exactly the first p < n_live tokens, taken from the live KV: cut back
        to p, copied, then the whole live state put back (the state put back is the one copied,
        so nothing changes). Costs two copies and a restore, no prefill. Only where the memory
        can be cut back to p (`can_snapshot_behind`)."""
        assert self.can_snapshot_behind(p), (p, self.n_live, self.exact_n, self.floor())
        live_ids = self.live_ids()
        whole = self.snapshot()
        if self.truncate(p) != p:
            self.restore(live_ids, whole)
            raise ValueError(f"the live state could not be cut back to {p}")
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
        if llama_cpp.llama_state_seq_set_data(self.ctx, src, len(state), 0) == 0:
            llama_cpp.llama_memory_clear(self.mem, True)
            raise ValueError("llama_state_seq_set_data refused the state")
        n = len(ids)
        pos_max = int(llama_cpp.llama_memory_seq_pos_max(self.mem, 0))
        if pos_max != n - 1:  # a state of another length than its header said
            llama_cpp.llama_memory_clear(self.mem, True)
            raise ValueError(f"the state holds positions up to {pos_max}, not {n - 1}")
        self.ids[:n] = ids
        self.n_live = self.exact_n = n

    # --- prefill and generation ------------------------------------------------------------

    def _decode(self, tokens: Sequence[int]) -> None:
        """Evaluate tokens at the next positions; logits for the last one only."""
        b, n, start = self._batch, len(tokens), self.n_live
        assert 0 < n <= self.n_batch and start + n <= self.n_ctx
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 0
        b.logits[n - 1] = 1
        b.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            # the positions past n_live may hold part of this batch: cut them off (or, where
            # the memory cannot, start from none) so the invariant holds
            self.n_live = start + n
            self.truncate(start)
            raise RuntimeError(f"llama_decode failed ({rc})")
        self.ids[start : start + n] = tokens
        self.n_live = start + n

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
        follows each one. A stop one token after the last one is skipped where the memory
        cannot be cut back by a token (it would need a one-token batch)."""
        points = sorted(p for p in set(stops_at) if self.n_live <= p <= len(ids))
        for p in sorted({*points, len(ids)}):  # a save point at the prompt end: one snapshot
            if p - self.n_live == 1 and self.n_live > 0 and self.align == 1:
                if p < len(ids) and self.floor() > self.n_live - 1:
                    continue  # never a one-token batch (see module doc): no stop here
                self.truncate(self.n_live - 1)
            while self.n_live < p:
                if cancel.is_set:
                    raise Cancelled()
                end = min(p, self.n_live + self.n_batch)
                if p - end == 1 and self.align == 1:
                    end -= 1  # leave two tokens for the last batch, not one
                self._decode(ids[self.n_live : end])
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
        grammar: str | None = None,
    ) -> Iterator[tuple[int, bytes, bool]]:
        """Yield (token, piece bytes, is_end_of_generation) after a prefill. The caller stops
        iterating on a stop string; the last sampled token is never evaluated."""
        chain = self._sampler(sampling, grammar)
        try:
            for i in range(max_tokens):
                if cancel.is_set:
                    raise Cancelled()
                token = int(llama_cpp.llama_sampler_sample(chain, self.ctx, -1))
                if token in self._eog:
                    yield token, b"", True
                    return
                yield token, self.piece(token), False
                if i + 1 < max_tokens and self.n_live < self.n_ctx:
                    self._decode([token])
                elif self.n_live >= self.n_ctx:
                    return
        finally:
            llama_cpp.llama_sampler_free(chain)

    def _sampler(self, s: Sampling, grammar: str | None) -> Any:
        """llama-cpp-python's sampler chain, built with llama.cpp's C API: penalties, the
        grammar, then greedy (temperature 0) or top-k, typical, top-p, min-p, temperature and
        a seeded draw. A grammar llama.cpp cannot parse gives a NULL sampler: a ValueError
        here, never a sample through it (a SIGSEGV that kills the worker)."""
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = partial(llama_cpp.llama_sampler_chain_add, chain)
        n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        add(llama_cpp.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, s.repeat_penalty,
                                                   s.frequency_penalty, s.presence_penalty))
        if grammar:
            g = llama_cpp.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
            if not g:
                llama_cpp.llama_sampler_free(chain)
                raise ValueError("llama.cpp could not build a sampler from the grammar (it does "
                                 "not parse); nothing was generated")
            add(g)
        if s.temperature <= 0:
            add(llama_cpp.llama_sampler_init_greedy())
        else:
            add(llama_cpp.llama_sampler_init_top_k(s.top_k))
            add(llama_cpp.llama_sampler_init_typical(1.0, 1))
            add(llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
            add(llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
            add(llama_cpp.llama_sampler_init_temp(s.temperature))
            seed = llama_cpp.LLAMA_DEFAULT_SEED if s.seed is None else s.seed & 0xFFFFFFFF
            add(llama_cpp.llama_sampler_init_dist(seed))
        return chain


PENALTY_LAST_N = 64  # tokens the repetition penalties look back (llama-cpp-python's default)

_backend_ready = False


def _backend_init() -> None:
    global _backend_ready
    if not _backend_ready:
        # llama-cpp-python routes llama.cpp's log through this logger: errors only, as
        # `Llama(verbose=False)` does, unless prefixgate itself logs at DEBUG
        if not log.isEnabledFor(logging.DEBUG):
            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        llama_cpp.llama_backend_init()
        _backend_ready = True


def _memory_of(model: Any, swa_full: bool) -> Memory:
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return Memory("recurrent")
    n_swa = int(llama_cpp.llama_model_n_swa(model))
    if n_swa > 0:
        return Memory("window", n_swa, swa_full)
    return Memory("plain")


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
