"""One llama.cpp context and the exact-prefix execution of a plan. Blocking: call from one thread.

Rules this module keeps:
- Slots (`n_seq`, llama-server's `--parallel`): one model, one context, one sequence per slot,
  each in its own KV stream (llama.cpp's non-unified cache, `n_ctx / n_seq` cells each), so a
  slot's position p lies in cell p of its own stream, as in a context of its own. `use(slot)`
  selects the sequence every call below acts on; the worker's scheduler selects before each
  step. Everything said here of "the live state" is per slot.
- The live state of a sequence always holds exactly `ids[:n_live]`. Every change of `n_live` is
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
- Exact by construction (issue 19): a hit runs the cold run's computation, so it never rests on a
  kernel giving the same bits for different batch shapes (llama.cpp's CPU kernels do not on
  every CPU: an AMD EPYC answered differently where an Intel Xeon did not; CUDA's do not at
  all, nor do the repacked CPU weights of the "extra buffer types"). Three rules:
  1. The same batches: a prompt's batches are a function of its ids alone
     (`policies.prefix.Batching`, the rule's one home): from each edge at most `n_batch`
     tokens, ending early right after an end-of-turn token once a batch holds an eighth of
     that. Whether a batch ends at p depends only on ids[:p], so a prompt that shares p tokens
     with an earlier one has the same edges up to p. Reuse, restores and snapshots happen only
     at edges (the plan's positions are edges already), so a hit evaluates exactly the cold
     run's remaining batches, and a next turn reuses up to the end of the last message the
     prompts share rather than up to `n_batch - 1` tokens before it.
  2. The same cells: a cold run puts position p in cell p. A restore does too, because a
     snapshot of a sliding-window cache (which llama.cpp writes without the cells its window
     masks) gets those cells back, zero-filled and still masked, before it is loaded
     (`backend.layout.pad_window`): attention then sums over the same cells in the same order.
  3. Only prompt tokens are exact: generated tokens were evaluated one at a time, unlike a cold
     prefill of the same text, so live reuse stops at `exact_n`, the end of the prompt.
  The start-up self-check (`backend.selfcheck`) proves the three on the user's model, KV
  types and backend, bit for bit, before the worker reuses anything.
- A slot answers what it answers alone, whatever else generates (`decode`, set by the
  worker from its start-up check, backend.selfcheck.check_decode). (A generated token's KV is
  never reused, rule 3: this is about the answer.) Three ways, the first the check proves:
  ``batched``: decode steps of several slots share one llama_decode, where each slot's logits
  come out with the bits they have alone. ``fixed``: every decode step has the same shape, one
  row per slot, the slots that do not generate given a padding row (at their next position,
  with logits, since llama.cpp computes the output layer for those rows only; removed after;
  plain attention or a full-size window, whose cells can be dropped: `pads`), where a
  slot's logits in that shape do not depend on what the other rows hold or how long the other
  slots are. ``apart``: each slot's step alone. Batched does not hold everywhere: with flash
  attention on a CPU, ggml splits the attention of a single query row among the threads once
  its KV view reaches 512 cells (ggml-cpu/ops.cpp, `use_split_kv_path`), a row beside another
  sequence's is not split, and the sums come out in another order; f16 weights on a CPU
  multiply one row in another order than several (bench/results/issue20/decode_batch.md).
  Fixed costs a slot generating alone the padding rows: the check takes it only where that is
  little (`selfcheck.FIXED_MAX_COST`; on a CPU it is not: 1.45x on a 1.1B f16, about 2x on its
  Q4_K_M, on 2 cores).
- Cancellation is checked between prefill batches and between generated tokens.
- Steps: `prefill_steps` and `generate_steps` yield between llama_decode calls so that a
  scheduler can run another slot's step there; never between a decode and the sample that reads
  its logits (llama.cpp keeps the logits of the last decode only, whichever sequences it held).
  A sample of a slot the last decode did not hold is refused (RuntimeError), never drawn from
  another's logits.
- A grammar llama.cpp cannot parse is a ValueError before the first sample (its sampler comes
  back NULL), never a crash of the worker.
- Only llama.cpp's C API (the `llama_cpp` bindings) is used: model and context parameters set
  directly (the KV cache types, flash attention on/off/auto, `swa_full`, the batch size),
  our own batch, memory calls and sampler chain.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Literal, TypeVar, cast

import llama_cpp
import numpy as np

from backend import layout
from backend.placement import apply as placement_params
from backend.placement import check_gpu_layers, compute_identity, offload_devices
from policies.prefix import Batching, Edges, default_batch, live_reuse

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
# how decode steps of several slots run (module rules): the worker's start-up check decides
DecodeMode = Literal["apart", "batched", "fixed"]


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


@dataclass(slots=True)
class Seq:
    """One slot's sequence: what its KV stream holds."""

    id: int
    ids: np.ndarray  # ids[:n_live] is what the KV holds
    n_live: int = 0
    exact_n: int = 0  # leading live tokens whose KV a cold prefill computes identically
    padded: int = 0  # window cells before this position are a restore's zero padding
    next: int = -1  # a generated token waiting for its decode (`Engine.decode_next`), or -1


T = TypeVar("T")


class _OfSeq(Generic[T]):
    """An engine attribute that is a field of the selected slot's sequence (`Engine.seq`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, eng: Engine, owner: type | None = None) -> T:
        return cast(T, getattr(eng.seq, self.name))

    def __set__(self, eng: Engine, value: T) -> None:
        setattr(eng.seq, self.name, value)


class Engine:
    """One llama.cpp model and context, driven through llama.cpp's C API (the `llama_cpp`
    bindings; no `Llama` object). Not thread-safe: the worker runs it on one thread."""

    def __init__(
        self,
        model_path: str,
        n_ctx: int,
        n_threads: int | None,
        n_gpu_layers: int,
        n_batch: int = 0,
        flash_attn: str = "off",
        type_k: str = "f16",
        type_v: str = "f16",
        swa_full: bool = True,
        extra_bufts: bool = True,
        n_threads_batch: int | None = None,
        placement: Mapping[str, Any] | None = None,
        n_seq: int = 1,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        if flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash attention is one of {', '.join(FLASH_ATTN)}")
        for t in (type_k, type_v):
            if t not in CACHE_TYPES:
                raise ValueError(f"unknown KV cache type {t!r} (one of {', '.join(CACHE_TYPES)})")
        _backend_init()
        gpus = check_gpu_layers(n_gpu_layers)
        mp = llama_cpp.llama_model_default_params()
        # -1: every layer (llama.cpp takes a count; -1 itself is not "all" there)
        mp.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers < 0 else n_gpu_layers
        mp.use_extra_bufts = extra_bufts  # repacked CPU weights (llama.cpp's default: on)
        keep: list[Any] = placement_params(mp, **(placement or {}))  # held while loading
        if progress is not None:  # llama.cpp's loading progress, 0..1
            def report(p: float, _: Any) -> bool:
                progress(p)
                return True
            keep.append(llama_cpp.llama_progress_callback(report))
            mp.progress_callback = keep[-1]
        free0 = [d["free"] for d in gpus]
        rss0 = _rss()
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
        del keep
        # what to do when the GPU is full (llama-server's --fit finds the layers that fit
        # by itself; here they are given)
        full = ("; if the GPU ran out of memory (llama.cpp's log above says so), offload fewer "
                "layers (-ngl N), keep MoE experts on the CPU (--n-cpu-moe N) or give a smaller "
                "-c") if gpus and n_gpu_layers else ""
        if not self.model:
            raise ValueError(f"llama.cpp could not load the model {model_path}{full}")
        free1 = [d["free"] for d in offload_devices()]
        rss1 = _rss()
        self.memory = _memory_of(self.model, swa_full)
        # what flash attention is, as llama.cpp gets it (`resolve_flash_attn`)
        self.flash_attn = resolve_flash_attn(flash_attn, cpu_only=not gpus or n_gpu_layers == 0,
                                             n_seq=n_seq, type_v=type_v, memory=self.memory)
        cp = llama_cpp.llama_context_default_params()
        n_batch = n_batch or default_batch(n_gpu_layers)
        # n_ctx is shared among the slots, as llama-server's -c with -np; one KV stream each
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cp.kv_unified = False
        cores = os.cpu_count() or 1
        cp.n_threads = n_threads or max(cores // 2, 1)
        cp.n_threads_batch = n_threads_batch or n_threads or cores
        cp.flash_attn_type = {"on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                              "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                              "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO}[self.flash_attn]
        cp.type_k, cp.type_v = CACHE_TYPES[type_k], CACHE_TYPES[type_v]
        cp.swa_full = swa_full
        cp.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise ValueError(
                f"llama.cpp could not create a context (n_ctx {n_ctx}, K {type_k}, V {type_v}, "
                f"flash attention {self.flash_attn}; a quantized V cache needs flash attention)"
                f"{full}")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        # where it all went, for the ready line: weights and KV (with compute buffers), on the
        # GPUs (their free memory before and after) and in RAM (this process's resident set)
        free2 = [d["free"] for d in offload_devices()]
        n_layer = int(llama_cpp.llama_model_n_layer(self.model))
        self.placement = {
            "backend": ", ".join(f"{d['name']} ({d['description']})" for d in gpus) or "CPU",
            "gpu_layers": min(n_gpu_layers if n_gpu_layers >= 0 else n_layer + 1, n_layer + 1)
            if gpus else 0,
            "layers": n_layer + 1,  # llama.cpp counts the output layer as one, as its log does
            "weights_bytes": int(llama_cpp.llama_model_size(self.model)),
            "vram_weights_bytes": sum(a - b for a, b in zip(free0, free1, strict=True)),
            "vram_kv_bytes": sum(a - b for a, b in zip(free1, free2, strict=True)),
            "ram_weights_bytes": max(rss1 - rss0, 0), "ram_kv_bytes": max(_rss() - rss1, 0),
        }
        pl = placement or {}
        # what computes the KV, for the cache identity: the CPU too where it computes layers
        self.compute = compute_identity(gpus, self.placement["gpu_layers"] < n_layer + 1 or bool(
            str(pl.get("override_tensor", "")).strip() or int(pl.get("n_cpu_moe", 0) or 0)))
        if self.flash_attn != flash_attn:  # `auto` decided here, not by llama.cpp: other bits
            self.compute += f"; flash attention {self.flash_attn}"
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_ctx = int(llama_cpp.llama_n_ctx_seq(self.ctx))  # one slot's context
        self.n_batch = n_batch
        # KV caches in a sequence state (backend.layout): a window's base and window caches, a
        # hybrid's attention cache, none for a pure recurrent model
        self.caches = {"plain": 1, "window": 2}.get(
            self.memory.kind, 1 if llama_cpp.llama_model_is_hybrid(self.model) else 0)
        # why no reuse can be exact here ("" where the module rules hold by construction): a
        # real window keeps its cells in a ring whose layout a restore cannot rebuild
        self.inexact = "" if self.memory.kind != "window" or self.memory.full else (
            "a real sliding window (--no-swa-full) keeps its cells in a ring that a restore "
            "cannot lay out as the cold run did; --swa-full makes reuse exact")
        # a test's injected fault (PREFIXGATE_FAULT=restore-bit): every restore flips one bit of
        # the state it loads, an inexact configuration the self-check must catch
        self.fault = os.environ.get("PREFIXGATE_FAULT", "")
        self.seqs = [Seq(i, np.zeros(self.n_ctx, dtype=np.intc)) for i in range(n_seq)]
        self.seq = self.seqs[0]  # the slot the calls below act on (`use`)
        # the last llama_decode's logits: the row of each sequence it holds them for
        self._logits_rows: dict[int, int] = {}
        # how decode steps of several slots run (module rules); the worker sets it from its
        # start-up check
        self.decode: DecodeMode = "apart"
        # a padding row's cell can be dropped again, leaving the slot as it was (a `fixed`
        # decode): any cell of plain attention; a full-size window's too, where llama.cpp
        # takes the empty cell at the slot's next position (a real window may take a masked one)
        self.pads = self.memory.kind == "plain" or (self.memory.kind == "window"
                                                    and self.memory.full)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.eog = {t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)}
        # reuse, restores and snapshots at batch edges only (module rules): every n_batch
        # tokens, and early at the ends of turns
        self.batching = Batching(n_batch, frozenset(self.eog))

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

    # --- slots -----------------------------------------------------------------------------

    def use(self, slot: int) -> None:
        """Act on this slot's sequence from now on."""
        self.seq = self.seqs[slot]

    # the selected slot's sequence fields (Seq), read and written as the engine's own
    ids: _OfSeq[np.ndarray] = _OfSeq()
    n_live: _OfSeq[int] = _OfSeq()
    exact_n: _OfSeq[int] = _OfSeq()
    padded: _OfSeq[int] = _OfSeq()

    def _clear(self) -> None:
        """Empty this slot's sequence (the other slots keep theirs)."""
        llama_cpp.llama_memory_seq_rm(self.mem, self.seq.id, -1, -1)
        self.n_live = self.exact_n = self.padded = 0

    # --- live state ------------------------------------------------------------------------

    def live_ids(self) -> list[int]:
        return [int(t) for t in self.ids[: self.n_live]]

    def floor(self) -> int:
        """The shortest live prefix (other than none) the memory can be cut back to: 0 for
        plain attention, the whole live sequence for a recurrent state, and for a real sliding
        window the first position whose window cells are all still there (real ones: the cells
        a restore padded in front of a window snapshot are zeros, never attended to)."""
        if self.memory.kind == "plain" or self.n_live == 0:
            return 0
        if self.memory.kind == "recurrent":
            return self.n_live
        pos_min = max(int(llama_cpp.llama_memory_seq_pos_min(self.mem, self.seq.id)), self.padded)
        if pos_min <= 0:
            return 0
        return min(pos_min + self.memory.n_swa + 1, self.n_live)

    def live_prefix(self, ids: Sequence[int], edges: Edges | None = None) -> int:
        """Tokens of `ids` the live KV holds exactly and can be cut back to (at a batch edge
        of `ids`: `edges`, computed here when not given)."""
        n = min(self.exact_n, len(ids))
        if n == 0:
            return 0
        diff = np.nonzero(self.ids[:n] != np.asarray(ids[:n], dtype=np.intc))[0]
        n = int(diff[0]) if len(diff) else n
        edges = edges or self.batching.edges(ids)
        return live_reuse(edges.floor(n), self.n_live, self.floor())

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
        if not llama_cpp.llama_memory_seq_rm(self.mem, self.seq.id, n, -1):
            log.warning("llama.cpp refused to cut the live state back to %d of %d tokens; "
                        "starting from none", n, self.n_live)
            n = 0
            self._clear()
        self.n_live = n
        self.exact_n = min(self.exact_n, n)
        if n == 0:
            self.padded = 0
        return n

    # --- snapshots -------------------------------------------------------------------------

    def snapshot(self) -> memoryview:
        """A copy of this slot's state: KV (and recurrent state) for exactly `n_live` tokens,
        in the form a context of one slot writes. One copy into a fresh buffer that is not
        zeroed first (this runs on the hot path, between prefill segments; with several slots,
        the form is rewritten within that buffer)."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, self.seq.id)
        out = np.empty(size, dtype=np.uint8)
        dst = out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = llama_cpp.llama_state_seq_get_data(self.ctx, dst, size, self.seq.id)
        if len(self.seqs) > 1:  # kept in a one-slot context's form (backend.layout), in place
            n = layout.one_stream_in_place(out, n, self.caches)
        return memoryview(out)[:n]

    def last_logits(self) -> np.ndarray:
        """A copy of the logits after this slot's last evaluated token."""
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, self._logits_row())
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

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

    def state_bytes(self, slot: int) -> int:
        """The size of a slot's state, without copying it."""
        return int(llama_cpp.llama_state_seq_get_size(self.ctx, self.seqs[slot].id))

    def copy_from(self, slot: int, n: int) -> int:
        """This slot gets the first n tokens of another slot's live state (n <= its `exact_n`):
        that state's snapshot restored here, then cut back to n. Not `llama_memory_seq_cp`:
        across KV streams it copies a whole stream at the next decode, which a restore before
        it could race. Returns what is kept: n, or none where the memory refuses the cut."""
        me, src = self.seq, self.seqs[slot]
        assert src is not me and 0 < n <= src.exact_n, (slot, n, src.exact_n)
        self.seq = src
        try:
            ids, state = self.ids[: self.n_live].copy(), self.snapshot()
        finally:
            self.seq = me
        self.restore(ids, state)
        return self.truncate(n)

    def restore(self, ids: Sequence[int], state: bytes | memoryview) -> None:
        """Load a snapshot of exactly len(ids) tokens (taken in any slot) into this slot, each
        position into the cell a cold run used (module rules; read in place where nothing is
        padded)."""
        self.truncate(0)
        padded = 0
        if self.memory.kind == "window" and self.memory.full:
            state, padded = layout.pad_window(state)
        if self.fault == "restore-bit":
            state = layout.flip_bit(state)
        if len(self.seqs) > 1:
            state = layout.many_streams(state, self.caches, len(self.seqs))
        if isinstance(state, bytes):
            src = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
        else:  # a snapshot of ours: point at its buffer, no copy
            src = np.frombuffer(state, dtype=np.uint8).ctypes.data_as(
                ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self.ctx, src, len(state), self.seq.id) == 0:
            self._clear()
            raise ValueError("llama_state_seq_set_data refused the state")
        n = len(ids)
        pos_max = int(llama_cpp.llama_memory_seq_pos_max(self.mem, self.seq.id))
        if pos_max != n - 1:  # a state of another length than its header said
            self._clear()
            raise ValueError(f"the state holds positions up to {pos_max}, not {n - 1}")
        self.ids[:n] = ids
        self.n_live = self.exact_n = n
        self.padded = padded

    # --- prefill and generation ------------------------------------------------------------

    def _evaluate(self, rows: Sequence[tuple[Seq, Sequence[int]]],
                  pads: Sequence[Seq] = ()) -> None:
        """Evaluate each slot's tokens at its next positions in one llama_decode, in the order
        of their sequence ids (llama.cpp runs a run of consecutive ids as one batch); logits
        for the last token of each. `pads`: slots given a padding row at their
        next position, removed after (a `fixed` decode; `pads`)."""
        b, i, last = self._batch, 0, {}
        entries = [*rows, *((q, [rows[0][1][-1]]) for q in pads)]
        for q, tokens in sorted(entries, key=lambda e: e[0].id):
            assert tokens and q.n_live + len(tokens) <= self.n_ctx
            for j, t in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, q.n_live + j, 1, 0
                b.seq_id[i][0] = q.id
                i += 1
            last[q.id] = i - 1
            b.logits[i - 1] = 1  # a padding row's too: llama.cpp's output rows are the shape
        assert i <= self.n_batch
        b.n_tokens = i
        rc = llama_cpp.llama_decode(self.ctx, b)
        self._logits_rows = {}
        me = self.seq
        try:
            for q, tokens in rows:
                self.seq, start, n = q, q.n_live, len(tokens)
                q.n_live = start + n
                if rc == 0:
                    self._logits_rows[q.id] = last[q.id]
                    q.ids[start : start + n] = tokens
                else:
                    # the positions past n_live may hold part of this batch: cut them off (or,
                    # where the memory cannot, start from none) so the invariant holds
                    self.truncate(start)
        finally:
            self.seq = me
            kept = [q.id for q in pads  # their cell alone goes (`pads`)
                    if not llama_cpp.llama_memory_seq_rm(self.mem, q.id, q.n_live, -1)]
        if kept:
            raise RuntimeError(f"llama.cpp kept the padding rows of slots {kept}")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")

    def prefill(self, ids: Sequence[int], stops_at: Sequence[int],
                on_stop: Callable[[int], None], cancel: Cancel,
                on_batch: Callable[[int], None] | None = None) -> None:
        """`prefill_steps`, all at once."""
        for _ in self.prefill_steps(ids, stops_at, on_stop, cancel, on_batch):
            pass

    def prefill_steps(
        self,
        ids: Sequence[int],
        stops_at: Sequence[int],
        on_stop: Callable[[int], None],
        cancel: Cancel,
        on_batch: Callable[[int], None] | None = None,
        edges: Edges | None = None,
    ) -> Generator[int, None, float]:
        """Evaluate ids[n_live:] in the cold run's batches (module rules: `edges`, the ids'
        batch edges, computed here when not given), stopping at each batch edge of `stops_at`
        to call on_stop(position) (a snapshot point).
        Every batch is exact, so a cancelled prefill keeps what it evaluated for the next
        request; on_batch(n_live) follows each one. A live state that does not end at a batch
        edge is first cut back to one (where the memory refuses, to none). Yields before each
        batch but the first the tokens it has left (another slot may run there: a scheduler
        serves the prefill due first; never after the last batch, whose logits the first sample
        reads). Returns the seconds spent in llama_decode (not in
        other slots' steps between): what the prefill itself cost (policies.costs)."""
        edges = edges or self.batching.edges(ids)
        busy = 0.0
        if self.n_live != edges.floor(self.n_live):
            self.truncate(edges.floor(self.n_live))
        points = sorted(p for p in set(stops_at) if self.n_live <= p <= len(ids) and p in edges)
        first = True
        for p in sorted({*points, len(ids)}):  # a save point at the prompt end: one snapshot
            while self.n_live < p:
                if not first:
                    yield len(ids) - self.n_live
                first = False
                if cancel.is_set:
                    raise Cancelled()
                t = time.perf_counter()
                self._evaluate([(self.seq, ids[self.n_live : min(p, edges.next(self.n_live))])])
                busy += time.perf_counter() - t
                self.exact_n = self.n_live
                if on_batch is not None:
                    on_batch(self.n_live)
            if p in points:
                on_stop(p)
        return busy

    def generate_steps(
        self,
        sampling: Sampling,
        max_tokens: int,
        cancel: Cancel,
        grammar: str | None = None,
    ) -> Iterator[tuple[int, bytes, bool] | None]:
        """Yield (token, piece bytes, is_end_of_generation) after a prefill, each token sampled
        from this slot's logits; after a token that is to be evaluated, None: the caller then
        evaluates it (`decode_next`, this slot alone or beside others) before it asks for the
        next one. The caller stops iterating on a stop string; the last sampled token is never
        evaluated."""
        chain = self._sampler(sampling, grammar)
        seq = self.seq
        try:
            for i in range(max_tokens):
                if cancel.is_set:
                    raise Cancelled()
                assert self.seq is seq, "a step of another slot's generation"
                if seq.next >= 0:
                    raise RuntimeError(f"slot {seq.id}: resumed before its token was "
                                       "evaluated; a scheduling bug")
                row = self._logits_row()
                token = int(llama_cpp.llama_sampler_sample(chain, self.ctx, row))
                if token in self.eog:
                    yield token, b"", True
                    return
                yield token, self.piece(token), False
                if i + 1 >= max_tokens or seq.n_live >= self.n_ctx:
                    return
                seq.next = token
                yield None
        finally:
            seq.next = -1
            llama_cpp.llama_sampler_free(chain)

    def generate(
        self,
        sampling: Sampling,
        max_tokens: int,
        cancel: Cancel,
        grammar: str | None = None,
    ) -> Iterator[tuple[int, bytes, bool]]:
        """`generate_steps` on its own: each token evaluated alone, in the same step."""
        for step in self.generate_steps(sampling, max_tokens, cancel, grammar):
            if step is None:
                self.decode_next([self.seq.id])
            else:
                yield step

    def decode_next(self, slots: Sequence[int]) -> None:
        """Evaluate the token each of these slots' generation waits with (`Seq.next`), in one
        llama_decode (several slots only where `decode` is not ``apart``; with ``fixed``, a
        padding row in every other slot), logits for each. (llama.cpp runs each run of
        consecutive sequence ids as one batch of its own: the shapes
        `selfcheck.check_decode` compares.)"""
        seqs = [self.seqs[s] for s in slots]
        assert seqs and all(q.next >= 0 for q in seqs), "no token waits for its decode"
        assert len(seqs) == 1 or self.decode != "apart", "batched decode steps were not proven"
        pads = [q for q in self.seqs if q.id not in slots] if self.decode == "fixed" else []
        assert not pads or self.pads, "padding rows in a memory that cannot drop them"
        me = self.seq
        try:
            for q in pads:
                if q.n_live >= self.n_ctx:  # a full slot has no cell for its padding row
                    self.seq = q
                    self.truncate(q.n_live - 1)
            self.seq = me
            self._evaluate([(q, [q.next]) for q in seqs], pads)
        finally:
            self.seq = me
            for q in seqs:
                q.next = -1

    def _logits_row(self) -> int:
        """This slot's row of the last llama_decode's logits; refused if it holds none."""
        row = self._logits_rows.get(self.seq.id)
        if row is None:
            raise RuntimeError(f"slot {self.seq.id}: the context's logits are not this slot's "
                               f"(last decode: {sorted(self._logits_rows)}); a scheduling bug")
        return row

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


def resolve_flash_attn(flash_attn: str, *, cpu_only: bool, n_seq: int, type_v: str,
                       memory: Memory) -> str:
    """Flash attention as llama.cpp gets it: as given, except ``auto`` on a CPU with several
    slots, which is ``off`` (llama.cpp's auto would turn it on) unless the V cache is quantized
    (only flash attention reads one) or the memory is recurrent.

    Why: with flash attention on, a CPU decodes a slot alone with other bits than beside other
    slots (module rules), so decode steps of several slots never share a llama_decode; off, they
    do on the quantized models measured, and a prefill or a lone decode step is as fast
    (bench/results/issue20: the 1.1B Q4_K_M team at 0.95x llama-server's wall against 1.13x).
    The decode check still decides (backend.selfcheck.check_decode). A recurrent or hybrid
    model's decode steps differ batched either way (measured), so it keeps llama.cpp's choice;
    on a GPU nobody has measured it yet."""
    if flash_attn == "auto" and cpu_only and n_seq > 1 and memory.kind != "recurrent" \
            and type_v in ("f32", "f16", "bf16"):
        return "off"
    return flash_attn


def _memory_of(model: Any, swa_full: bool) -> Memory:
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return Memory("recurrent")
    n_swa = int(llama_cpp.llama_model_n_swa(model))
    if n_swa > 0:
        return Memory("window", n_swa, swa_full)
    return Memory("plain")


def _rss() -> int:
    """This process's resident bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
