"""A slot's state as bytes (the `Engine`'s part that copies it out and loads it back), kept to
the engine's rules (backend.engine): a snapshot holds exactly `n_live` tokens, in the form a
context of one slot writes (backend.layout), and a restore lays each position in the cell a cold
run used. Copies are few and in place where they can be: a state can be most of the memory the
worker holds beside the model and its KV (issue 41)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp
import numpy as np

from backend import buffers, layout


class States:
    """Snapshots and restores of the engine's slots (a part of `Engine`; what it reads of it
    is declared here)."""

    ctx: Any
    mem: Any
    seqs: list[Any]  # backend.engine.Seq
    caches: int
    memory: Any  # backend.context.Memory
    fault: str

    if TYPE_CHECKING:  # the engine's own
        def live_ids(self, slot: int) -> list[int]: ...
        def floor(self, slot: int) -> int: ...
        def truncate(self, slot: int, n: int) -> int: ...
        def _clear(self, q: Any) -> None: ...

    def snapshot(self, slot: int) -> memoryview:
        """A copy of this slot's state: KV (and recurrent state) for exactly `n_live` tokens,
        in the form a context of one slot writes. One copy into a fresh buffer that is not
        zeroed first (this runs on the llama thread; with several slots, the form is rewritten
        within that buffer)."""
        out, n = self._snapshot_into(slot)
        return memoryview(out)[:n]

    def _snapshot_into(self, slot: int) -> tuple[np.ndarray, int]:
        q = self.seqs[slot]
        size = llama_cpp.llama_state_seq_get_size(self.ctx, q.id)
        out = buffers.empty(size)  # its pages in at once: this is the llama thread
        dst = out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = llama_cpp.llama_state_seq_get_data(self.ctx, dst, size, q.id)
        if len(self.seqs) > 1:  # kept in a one-slot context's form (backend.layout), in place
            n = layout.one_stream_in_place(out, n, self.caches)
        return out, n

    def can_snapshot_behind(self, slot: int, p: int) -> bool:
        q = self.seqs[slot]
        return 0 < p < q.n_live <= q.exact_n and p >= self.floor(slot)

    def snapshot_behind(self, slot: int, p: int) -> memoryview:
        """A snapshot of exactly the first p < n_live tokens from the live KV, no prefill. Plain
        attention: the whole snapshot cut to its first p cells within its own buffer, which is
        then shrunk (one state in memory at a time; the live state untouched). Otherwise (a
        window, whose snapshot at p holds cells a later one no longer writes): cut back to p,
        copied, the copied whole put back. Only where the memory can be cut back to p
        (`can_snapshot_behind`)."""
        q = self.seqs[slot]
        assert self.can_snapshot_behind(slot, p), (p, q.n_live, q.exact_n, self.floor(slot))
        if self.memory.kind == "plain":
            out, n = self._snapshot_into(slot)
            n = layout.first_cells_in_place(out, n, p)
            out = buffers.release_after(out, n + self.spare_bytes)  # the cut cells' pages go
            return memoryview(out)[:n]  # back; the room `prepare` needs stays
        live_ids = self.live_ids(slot)
        whole = self.snapshot(slot)
        if self.truncate(slot, p) != p:
            self.restore(slot, live_ids, whole)
            raise ValueError(f"the live state could not be cut back to {p}")
        part = self.snapshot(slot)
        self.restore(slot, live_ids, whole)
        return part

    def snapshot_first(self, slot: int, p: int) -> memoryview | None:
        """A snapshot of exactly the first p tokens of this slot's live state, which holds them
        as a cold prefill computes them (``p <= exact_n``), past which it may hold others (a
        draft model's sequence holds the answer after its prompt); the live state untouched.
        Plain attention: the snapshot cut to its first p cells, as `snapshot_behind` does.
        Otherwise None, unless p is all it holds (a window's later cells change what a snapshot
        at p holds, and cutting it back would lose them)."""
        q = self.seqs[slot]
        assert 0 < p <= q.exact_n, (p, q.exact_n)
        if p == q.n_live:
            return self.snapshot(slot)
        if self.memory.kind != "plain" or p < self.floor(slot):
            return None
        out, n = self._snapshot_into(slot)
        n = layout.first_cells_in_place(out, n, p)
        out = buffers.release_after(out, n + self.spare_bytes)
        return memoryview(out)[:n]

    def state_bytes(self, slot: int) -> int:
        """The size of a slot's state, without copying it."""
        return int(llama_cpp.llama_state_seq_get_size(self.ctx, self.seqs[slot].id))

    def copy(self, src: int, dst: int, n: int) -> int:
        """Slot `dst` gets the first n <= exact_n tokens of slot `src`'s live state, restored
        and cut back (not `llama_memory_seq_cp`, which copies a whole stream at the next
        decode); what it keeps: n, or none where the memory refuses the cut."""
        q = self.seqs[src]
        assert src != dst and 0 < n <= q.exact_n, (src, dst, n, q.exact_n)
        if self.memory.kind != "plain" or self.fault:
            self.restore(dst, self.live_ids(src), self.snapshot(src))
            return self.truncate(dst, n)
        out, size = self._snapshot_into(src)  # plain: only the first n cells, in one buffer
        if n < q.n_live:
            size = layout.first_cells_in_place(out, size, n)
        state, _ = self.prepare(out, size)  # room enough: the buffer held the whole state
        self.restore(dst, self.live_ids(src)[:n], state, prepared=0)
        return n

    def prepare(self, state: bytes | memoryview | np.ndarray, n: int = 0
                ) -> tuple[bytes | memoryview, int]:
        """(A snapshot in the form this context loads: a full-size window's masked cells padded
        back, several streams' form with several slots; the cells padded.) Bytes only, any
        thread (the reader's); a uint8 array of `n` bytes and `spare_bytes` of room
        (store.read_state_into) is made so in place where no window is padded."""
        padded = 0
        if isinstance(state, np.ndarray):
            if not self.memory.full and self.fault != "restore-bit":
                n = layout.many_streams_in_place(state, n, self.caches, len(self.seqs))
                return memoryview(state)[:n], 0
            state = memoryview(state)[:n]
        if self.memory.kind == "window" and self.memory.full:
            state, padded = layout.pad_window(state)
        if self.fault == "restore-bit":
            state = layout.flip_bit(state)
        if len(self.seqs) > 1:
            state = layout.many_streams(state, self.caches, len(self.seqs))
        return state, padded

    @property
    def spare_bytes(self) -> int:
        """The room `prepare` needs after a state to make it in place."""
        return 4 * (len(self.seqs) - 1) * self.caches

    def restore(self, slot: int, ids: Sequence[int], state: bytes | memoryview,
                prepared: int | None = None) -> None:
        """Load a snapshot of exactly len(ids) tokens (taken in any slot) into this slot, each
        position into the cell a cold run used (module rules; read in place where nothing is
        padded). `prepared`: the state is `prepare`'s already, with this many padded cells."""
        q = self.seqs[slot]
        self.truncate(slot, 0)
        if prepared is None:
            state, padded = self.prepare(state)
        else:
            padded = prepared
        if isinstance(state, bytes):
            src = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
        else:  # a snapshot of ours: point at its buffer, no copy
            src = np.frombuffer(state, dtype=np.uint8).ctypes.data_as(
                ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self.ctx, src, len(state), q.id) == 0:
            self._clear(q)
            raise ValueError("llama_state_seq_set_data refused the state")
        n = len(ids)
        pos_max = int(llama_cpp.llama_memory_seq_pos_max(self.mem, q.id))
        if pos_max != n - 1:  # a state of another length than its header said
            self._clear(q)
            raise ValueError(f"the state holds positions up to {pos_max}, not {n - 1}")
        q.ids[:n] = ids
        q.n_live = q.exact_n = n
        q.padded = padded

    def restore_held(self, slot: int, ids: Sequence[int], state: memoryview) -> None:
        """`restore` of a state that only this thread reads (a RAM-tier entry) and that has
        `spare_bytes` of room in its buffer (a snapshot's has): `prepare` makes the context's
        form within that buffer, as it does for a file read, and the entry gets its own form
        back after the load, instead of being copied (a restore of a 150 MiB state held two of
        it at once). A state without the room is copied as `restore` does."""
        arr = state.obj
        if (len(self.seqs) == 1 or not isinstance(arr, np.ndarray)
                or arr.size < len(state) + self.spare_bytes
                or arr.ctypes.data != np.frombuffer(state, np.uint8).ctypes.data):
            self.restore(slot, ids, state)
            return
        made, padded = self.prepare(arr, len(state))
        try:
            self.restore(slot, ids, made, prepared=padded)
        finally:  # where `prepare` copied instead (a padded window), the entry is as it was
            layout.one_stream_in_place(arr, len(made), self.caches)
