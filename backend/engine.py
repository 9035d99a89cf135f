"""One llama.cpp context holding one sequence per slot, driven by explicit batches. Blocking:
call from one thread.

Rules this module keeps:
- Slots (`n_seq`, llama-server's `--parallel`): one model, one context, one sequence per slot,
  each in its own KV stream (llama.cpp's non-unified cache, `n_ctx / n_seq` cells each), so a
  slot's position p lies in cell p of its own stream, as in a context of its own. Every call
  names the slot it acts on; there is no selected slot.
- `evaluate(rows)` is the one way tokens enter the KV: one llama_decode of rows of several
  sequences, each row a slot's tokens at its next positions, in the order of their sequence ids
  (llama.cpp runs a run of consecutive ids as one batch), logits for each row's last token (or
  for every token of the rows that ask: a verify). The worker's core composes the rows
  (`backend.worker`); `prefill` and `generate` here run one slot alone, for the self-check,
  the tests and the benchmarks.
- The live state of a sequence always holds exactly `ids[:n_live]`. Every change of `n_live` is
  paired with a `seq_rm` of the positions past it whose result is checked, so a snapshot taken
  at any moment holds KV (and recurrent state) for exactly `n_live` tokens (the exactness
  invariant of the cache).
- The memory decides how far back the live state can be cut (`Memory`): plain attention to any
  position; a real sliding window only while the window's cells are still there; a recurrent or
  hybrid model not at all (its state exists at its last position only). `live_prefix` offers
  only what can be kept, and a cut the memory refuses empties the state, never leaves it wrong:
  the request then restores a snapshot or prefills cold.
- A state is copied with the per-sequence API (never `Llama.save_state`); at least the last
  prompt token is always evaluated, because logits are not part of a snapshot.
- Exact by construction (issue 19): a hit runs the cold run's computation, so it never rests on a
  kernel giving the same bits for different batch shapes (llama.cpp's CPU kernels do not on
  every CPU: an AMD EPYC answered differently where an Intel Xeon did not; CUDA's do not at
  all, nor do the repacked CPU weights of the "extra buffer types"). Three rules:
  1. The same batches: a prompt's batches are a function of its ids alone
     (`policies.prefix.Batching`, the rule's one home): from each edge at most `n_batch`
     tokens, ending early right after an end-of-turn token once a batch holds an eighth of
     that. Whether a batch ends at p depends only on ids[:p], so a prompt that shares p tokens
     with an earlier one has the same edges up to p. Reuse, restores and snapshots happen only
     at edges, so a hit evaluates exactly the cold run's remaining batches. A prefill batch
     holds one sequence's tokens only.
  2. The same cells: a cold run puts position p in cell p. A restore does too, because a
     snapshot of a sliding-window cache (which llama.cpp writes without the cells its window
     masks) gets those cells back, zero-filled and still masked, before it is loaded
     (`backend.layout.pad_window`): attention then sums over the same cells in the same order.
  3. Only prompt tokens are exact: generated tokens were evaluated one at a time, unlike a cold
     prefill of the same text, so live reuse stops at `exact_n`, the end of the prompt.
  The start-up self-check (`backend.selfcheck`) proves the three on the user's model, KV
  types and backend, bit for bit, before the worker reuses anything.
- Decode steps of several slots (`decode`) run in the shape `decode_shape` says (the worker
  sets it from `--deterministic` and its start-up check: policies.schedule.choose_decode):
  ``batched``, one llama_decode as they come; ``fixed``, every step one row per slot, the slots
  that do not generate given a padding row (at their next position, with logits, since
  llama.cpp computes the output layer for those rows only; removed after; only where a cell
  can be dropped again: `pads`); ``apart``, each slot's step alone. A generated token's KV is
  never reused (rule 3): the shape is about the answer, never the cache.
- Logits: llama.cpp keeps the last llama_decode's only, whichever sequences it held, so a slot
  samples right after the decode that held it, before any other; a sample of a slot the last
  decode did not hold is refused (RuntimeError), never drawn from another's logits.
- Only llama.cpp's C API (the `llama_cpp` bindings) is used (backend.context makes the
  context): our own batch, memory calls and sampler chain (backend.sampling: a grammar that
  does not parse is a ValueError before the first sample, never a crash).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np

from backend.context import DecodeShape, load
from backend.sampling import Sampler, Sampling
from backend.states import States
from policies.prefix import FA_TILE, Batching, Edges, Padding, live_reuse

log = logging.getLogger("prefixgate.engine")


@dataclass(slots=True)
class Cancel:
    """Set from another thread: a prefill or generation here stops at its next batch or token."""

    event: threading.Event = field(default_factory=threading.Event)

    def set(self) -> None:
        self.event.set()

    @property
    def is_set(self) -> bool:
        return self.event.is_set()


class Cancelled(Exception):
    pass


@dataclass(slots=True)
class Seq:
    """One slot's sequence: what its KV stream holds."""

    id: int
    ids: np.ndarray  # ids[:n_live] is what the KV holds
    n_live: int = 0
    exact_n: int = 0  # leading live tokens whose KV a cold prefill computes identically
    padded: int = 0  # window cells before this position are a restore's zero padding
    rollback: int = 0  # recurrent: tokens it may be cut back by, once (its last verify's)


Row = tuple[int, Sequence[int]]  # (slot, its tokens at its next positions)


class Engine(States):
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
        n_threads_batch: int | None = None,
        placement: Mapping[str, Any] | None = None,
        n_seq: int = 1,
        progress: Callable[[float], None] | None = None,
        deterministic: str = "auto",
        outputs: int = 0,
        rollback: int = 0,
        rope: Mapping[str, Any] | None = None,
        numa: str = "",
    ) -> None:
        outputs = max(outputs, n_seq) if outputs else 0  # llama.cpp asks a row per sequence
        got = load(model_path, n_ctx, n_threads, n_gpu_layers, n_batch=n_batch,
                   flash_attn=flash_attn, type_k=type_k, type_v=type_v, swa_full=swa_full,
                   n_threads_batch=n_threads_batch, placement=placement, n_seq=n_seq,
                   progress=progress, deterministic=deterministic, outputs=outputs,
                   rollback=rollback, rope=rope, numa=numa)
        self.rope = dict(rope or {})  # llama-server's RoPE settings given (a draft model's too)
        self.model, self.ctx, self.memory, self.flash_attn = (got.model, got.ctx, got.memory,
                                                              got.flash_attn)
        self.n_threads, self.n_threads_batch = got.n_threads, got.n_threads_batch
        self.placement, self.compute, n_batch = got.placement, got.compute, got.n_batch
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self._pieces: dict[int, bytes] = {}  # `piece`: each token's bytes, once asked
        self.n_ctx = int(llama_cpp.llama_n_ctx_seq(self.ctx))  # one slot's context
        self.n_batch = n_batch
        # the most rows with logits a llama_decode may ask for: llama.cpp aborts the process on
        # more (`output_reserve`), so `evaluate` refuses them first
        self.outputs = outputs or n_batch
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
        # the last llama_decode's logits: the rows of each sequence it holds them for
        self._logits_rows: dict[int, list[int]] = {}
        # how decode steps of several slots run (module rules); the worker sets it from
        # --deterministic and its start-up check
        self.decode_shape: DecodeShape = "apart"
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
        # which prefill batches are padded to a flash attention tile (the worker measures it
        # where it pays: backend.worker.batch); none unless set
        self.padding = Padding()

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
        piece = self._pieces.get(token)
        if piece is None:  # a vocabulary's pieces never change: each asked of llama.cpp once
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 64, 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, True)
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def _clear(self, q: Seq) -> None:
        """Empty this slot's sequence (the other slots keep theirs)."""
        llama_cpp.llama_memory_seq_rm(self.mem, q.id, -1, -1)
        q.n_live = q.exact_n = q.padded = q.rollback = 0

    # --- live state ------------------------------------------------------------------------

    def live_ids(self, slot: int) -> list[int]:
        q = self.seqs[slot]
        return [int(t) for t in q.ids[: q.n_live]]

    def floor(self, slot: int) -> int:
        """The shortest live prefix (other than none) the memory can cut this slot back to: 0
        for plain attention, the whole live sequence for a recurrent state, and for a sliding
        window the first position p whose window cells are all still there (real ones: the
        cells a restore padded in front of a window snapshot are zeros, never attended to):
        from ``p - n_swa``, the cells a cold run's state at p holds (llama.cpp writes a
        sequence's cells from its last position's window on), which the next token's window
        (from ``p - n_swa + 1``) is within. A state restored at n holds them from
        ``n - n_swa``: it cuts back to n, as a verify's rejected drafts need."""
        q = self.seqs[slot]
        if self.memory.kind == "plain" or q.n_live == 0:
            return 0
        if self.memory.kind == "recurrent":  # its last verify's drafts may go, once
            return q.n_live - q.rollback
        pos_min = max(int(llama_cpp.llama_memory_seq_pos_min(self.mem, q.id)), q.padded)
        if pos_min <= 0:
            return 0
        return min(pos_min + self.memory.n_swa, q.n_live)

    def truncate(self, slot: int, n: int) -> int:
        """Keep exactly the slot's first n live tokens, or, where the memory refuses to cut
        back there, none. Returns what is kept: never a state that holds anything but
        ids[:kept]."""
        q = self.seqs[slot]
        n = min(n, q.n_live)
        if n == q.n_live:
            q.exact_n = min(q.exact_n, n)
            return n
        n = live_reuse(n, q.n_live, self.floor(slot))  # none where the memory cannot cut back
        q.rollback = 0  # a recurrent state's is used once
        if not llama_cpp.llama_memory_seq_rm(self.mem, q.id, n, -1):
            log.warning("llama.cpp refused to cut slot %d back to %d of %d tokens; starting "
                        "from none", slot, n, q.n_live)
            n = 0
            self._clear(q)
        q.n_live = n
        q.exact_n = min(q.exact_n, n)
        if n == 0:
            q.padded = 0
        return n

    # --- logits (snapshots and restores: backend.states) -----------------------------------

    def last_logits(self, slot: int, i: int = -1) -> np.ndarray:
        """A copy of the logits after the slot's last evaluated token (`i`: the i-th of the
        rows the last decode computed logits for in this slot, a verify's)."""
        rows = self._rows(slot)
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, rows[i])
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    # --- evaluation ------------------------------------------------------------------------

    def evaluate(self, rows: Sequence[Row], pads: Sequence[int] = (),
                 every: Sequence[int] = (), fill: int = 0) -> None:
        """Evaluate each row's tokens at its slot's next positions in one llama_decode, in the
        order of their sequence ids (llama.cpp runs a run of consecutive ids as one batch);
        logits for the last token of each row, and for every token of the slots in `every` (a
        verify). `pads`: slots given a padding row at their next position, removed after (a
        `fixed` decode). `fill`: rows repeating the one row's last token after it, dropped
        after (`policies.prefix.Padding`). `exact_n` is the caller's (`prefill_batch`):
        generated tokens are never exact. A failed decode cuts each row's slot back to what it
        held (or, where the memory cannot, none) and raises; more rows with logits than the
        context was made for (`outputs`) raise before anything is evaluated."""
        b, i, rows_of = self._batch, 0, {}
        entries = [*((self.seqs[s], t) for s, t in rows),
                   *((self.seqs[s], [rows[0][1][-1]]) for s in pads)]
        # checked before a row is written: llama.cpp's batch holds n_batch rows, no more
        assert sum(len(t) for _, t in entries) + fill <= self.n_batch, "more rows than a batch"
        if len(entries) > self.outputs or every and sum(
                len(t) if q.id in every else 1 for q, t in entries) > self.outputs:
            raise RuntimeError(f"a llama_decode of more rows with logits than the context "
                               f"was made for ({self.outputs})")
        for q, tokens in sorted(entries, key=lambda e: e[0].id):
            assert tokens and q.n_live + len(tokens) <= self.n_ctx
            want = q.id in every
            for j, t in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, q.n_live + j, 1, want
                b.seq_id[i][0] = q.id
                i += 1
            # a padding row's logits too: llama.cpp's output rows are part of the shape
            b.logits[i - 1] = 1
            rows_of[q.id] = list(range(i - len(tokens), i)) if want else [i - 1]
        if fill:
            assert len(rows) == 1 and not pads and not every
            q, tokens = self.seqs[rows[0][0]], rows[0][1]
            for j in range(len(tokens), len(tokens) + fill):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tokens[-1], q.n_live + j, 1, 0
                b.seq_id[i][0] = q.id
                i += 1
        b.n_tokens = i
        rc = llama_cpp.llama_decode(self.ctx, b)
        self._logits_rows = {}
        try:
            if self.memory.rollback:  # a recurrent state's rollback is its last verify's alone
                for q in self.seqs:
                    q.rollback = 0
            for s, tokens in rows:
                q = self.seqs[s]
                start, n = q.n_live, len(tokens)
                q.n_live = start + n
                if rc == 0:
                    self._logits_rows[q.id] = rows_of[q.id]
                    q.ids[start : start + n] = tokens
                    if q.id in every:
                        q.rollback = min(n - 1, self.memory.rollback)
                else:
                    # the positions past n_live may hold part of this batch: cut them off (or,
                    # where the memory cannot, start from none) so the invariant holds
                    self.truncate(s, start)
        finally:
            dropped = [*pads, *([rows[0][0]] if fill and rc == 0 else [])]
            kept = [s for s in dropped  # their cells alone go (`pads`, `fill`)
                    if not llama_cpp.llama_memory_seq_rm(self.mem, s, self.seqs[s].n_live, -1)]
        if kept:
            raise RuntimeError(f"llama.cpp kept the padding rows of slots {kept}")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")

    def prefill_batch(self, slot: int, ids: Sequence[int], end: int) -> None:
        """Evaluate ids[n_live:end] of this slot, one batch of the cold run's (the caller
        gives its edge), and count it exact."""
        q = self.seqs[slot]
        assert q.n_live < end <= len(ids) and q.n_live == q.exact_n, (q.n_live, end, q.exact_n)
        fill = self.padding.rows(end - q.n_live, q.n_live) if self.n_batch >= FA_TILE else 0
        self.evaluate([(slot, ids[q.n_live : end])], fill=fill)
        q.exact_n = q.n_live

    def decode(self, tokens: Mapping[int, int]) -> None:
        """Evaluate one generated token for each of these slots (slot -> token) in one
        llama_decode, in the shape `decode_shape` says: several slots only where it is not
        ``apart``; with ``fixed``, a padding row in every other slot; logits for each."""
        slots = sorted(tokens)
        assert slots, "no token waits for its decode"
        assert len(slots) == 1 or self.decode_shape != "apart", "apart: one slot a step"
        pads = [q.id for q in self.seqs if q.id not in tokens] \
            if self.decode_shape == "fixed" else []
        assert not pads or self.pads, "padding rows in a memory that cannot drop them"
        for s in pads:
            if self.seqs[s].n_live >= self.n_ctx:  # a full slot has no cell for its padding row
                self.truncate(s, self.seqs[s].n_live - 1)
        self.evaluate([(s, [tokens[s]]) for s in slots], pads)

    def _rows(self, slot: int) -> list[int]:
        """This slot's rows of the last llama_decode's logits; refused if it holds none."""
        rows = self._logits_rows.get(self.seqs[slot].id)
        if rows is None:
            raise RuntimeError(f"slot {slot}: the context's logits are not this slot's "
                               f"(last decode: {sorted(self._logits_rows)}); a scheduling bug")
        return rows

    def sample(self, slot: int, sampler: Sampler, i: int = -1) -> int:
        """A token drawn by `sampler` from this slot's logits of the last decode (row `i`)."""
        return sampler.sample(self.ctx, self._rows(slot)[i])

    def sampler(self, sampling: Sampling, grammar: str | None = None,
                slot: int | None = None) -> Sampler:
        """A sampler for the answer to `slot`'s live tokens (its prompt: the penalties' and
        DRY's history, as llama-server's)."""
        q = None if slot is None else self.seqs[slot]
        return Sampler(self.vocab, sampling, grammar, frozenset(self.eog),
                       () if q is None else
                       [int(t) for t in q.ids[max(0, q.n_live - sampling.history):q.n_live]],
                       self.piece)

    # --- one slot alone: the self-check, tests and benchmarks -------------------------------

    def prefill(self, slot: int, ids: Sequence[int], stops_at: Sequence[int] = (),
                on_stop: Callable[[int], None] | None = None,
                on_batch: Callable[[int], None] | None = None, cancel: Cancel | None = None,
                edges: Edges | None = None) -> float:
        """Evaluate ids[n_live:] in the cold run's batches (`edges`, computed when not given),
        calling on_stop(p) at each batch edge p of `stops_at` and on_batch(n_live) after each
        batch; a live state off an edge is cut back to one first (or to none where the memory
        refuses). Returns the seconds spent in llama_decode."""
        edges = edges or self.batching.edges(ids)
        q = self.seqs[slot]
        if q.n_live != edges.floor(q.n_live) or q.exact_n < q.n_live:
            self.truncate(slot, edges.floor(min(q.n_live, q.exact_n)))
        points = sorted(p for p in set(stops_at) if q.n_live <= p <= len(ids) and p in edges)
        busy = 0.0
        for p in sorted({*points, len(ids)}):  # a save point at the prompt end: one snapshot
            while q.n_live < p:
                if cancel is not None and cancel.is_set:
                    raise Cancelled()
                t = time.perf_counter()
                self.prefill_batch(slot, ids, min(p, edges.next(q.n_live)))
                busy += time.perf_counter() - t
                if on_batch is not None:
                    on_batch(q.n_live)
            if p in points and on_stop is not None:
                on_stop(p)
        return busy

    def generate(self, slot: int, sampling: Sampling, max_tokens: int,
                 cancel: Cancel | None = None, grammar: str | None = None
                 ) -> Iterator[tuple[int, bytes, bool]]:
        """After a prefill: (token, piece bytes, is_end_of_generation) for each token sampled
        from this slot's logits, each evaluated alone before the next is drawn. The caller may
        stop iterating; the last sampled token is never evaluated."""
        sampler = self.sampler(sampling, grammar, slot)
        try:
            for i in range(max_tokens):
                if cancel is not None and cancel.is_set:
                    raise Cancelled()
                token = self.sample(slot, sampler)
                if token in self.eog:
                    yield token, b"", True
                    return
                yield token, self.piece(token), False
                if i + 1 >= max_tokens or self.seqs[slot].n_live >= self.n_ctx:
                    return
                self.evaluate([(slot, [token])])
        finally:
            sampler.close()
