"""Token-prefix arithmetic: how long two prompts agree.

Rules:

- ``common_prefix_len(a, b)`` is the number of leading token ids (or characters of two texts:
  the proxy compares a request's text with the previous one's) that ``a`` and ``b`` share: the
  greatest ``L`` with ``a[:L] == b[:L]``. It is on the hot path (a 30K-token prompt against up to
  30 ring entries per request), so it never walks the tokens in a Python loop. It walks
  fixed-size chunks with C-level slice comparisons until one differs (or the shorter side ends),
  bisects that chunk with slice comparisons, and finishes the last few ids one by one: about
  ``L / CHUNK_TOKENS + log2(CHUNK_TOKENS)`` Python steps; each shared id is compared once in C.
  (Comparing the whole span first does not pay: on a mismatch it compares the shared part twice.)
- Two texts are compared in place: ``str.startswith`` of the whole span, then bisected (about
  30 us for two 180K-character bodies that part at their end, against about 100 us in chunks).
- ``TokenIds``: token ids held as ``packed``, the same ids as 4-byte native integers, read in
  place (a sequence equal to the tuple of the same ids). Where either side is one,
  ``common_prefix_len`` compares packed forms with ``bytes.startswith`` (memcmp, no copy;
  bisected only when they differ): about 5 us for two 32K-token prompts instead of about
  170 us. The proxy's renders and the worker protocol make them; anything else is compared as
  before. Equal ids always have equal packed forms, so the answer is the same either way.
- ``live_reuse(shared, live_n, floor)``: what a worker's live state can keep of a prompt that
  shares ``shared`` tokens with its ``live_n`` live ones, when its memory can be cut back no
  further than ``floor`` (0 for plain attention, ``live_n`` for a recurrent state: only the whole
  live sequence): ``shared`` if it is all of them or at least ``floor``, else nothing.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

# Ids compared per slice while walking forward: big enough that the Python loop runs ~30 times
# for a 30K-token prompt, small enough that the bisect inside the mismatching chunk is short.
CHUNK_TOKENS = 1024
# Below this span the bisect stops and the last ids are compared one by one.
LINEAR_TOKENS = 16


_PACK = "i"  # array typecode of a packed id
ID_BYTES = array(_PACK).itemsize
assert ID_BYTES == 4, "token ids are packed as 4-byte integers"


def pack(ids: Iterable[int]) -> bytes:
    """Token ids as 4-byte native integers."""
    return array(_PACK, ids).tobytes()


class TokenIds(Sequence[int]):
    """Token ids held packed: ``packed`` is the ids as 4-byte native integers (``pack``), and
    the sequence reads them in place. A prompt's ids are copied, sliced, joined, compared,
    sent to a worker and hashed for keys every request; as bytes each of those is a copy of
    memory, where a tuple of 32K Python ints took 50-200 us a pass (a reference taken on every
    int). Equal to a tuple (or another ``TokenIds``) of the same ids, and hashed alike; a slice
    or a sum is a ``TokenIds``; numpy reads it without a copy (``__array__``)."""

    __slots__ = ("packed", "_view", "_hash")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._set(ids.packed if isinstance(ids, TokenIds) else pack(ids))

    @classmethod
    def from_packed(cls, packed: bytes) -> TokenIds:
        """The ids `packed` holds (4-byte native integers), not copied."""
        self = cls.__new__(cls)
        self._set(packed)
        return self

    def _set(self, packed: bytes) -> None:
        assert len(packed) % ID_BYTES == 0, "packed token ids are whole 4-byte integers"
        self.packed = packed
        self._view = memoryview(packed).cast("i")  # _PACK
        self._hash: int | None = None

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...

    def __getitem__(self, index: int | slice) -> int | TokenIds:
        if isinstance(index, slice):
            return TokenIds.from_packed(self._view[index].tobytes())
        value: int = self._view[index]
        return value

    def __iter__(self) -> Iterator[int]:
        return iter(self._view)

    def tolist(self) -> list[int]:
        out: list[int] = self._view.tolist()
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self.packed == other.packed
        if isinstance(other, tuple):
            return len(other) == len(self) and tuple(self._view.tolist()) == other
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._view.tolist()))
        return self._hash

    def __add__(self, other: Sequence[int]) -> TokenIds:
        if not isinstance(other, TokenIds | tuple | list):
            return NotImplemented
        return TokenIds.from_packed(self.packed + (other.packed if isinstance(other, TokenIds)
                                                   else pack(other)))

    def __radd__(self, other: Sequence[int]) -> TokenIds:
        if not isinstance(other, tuple | list):
            return NotImplemented
        return TokenIds.from_packed(pack(other) + self.packed)

    def __repr__(self) -> str:
        return f"TokenIds({self._view.tolist()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenIds.from_packed, (self.packed,))

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        import numpy as np  # only where numpy asks: the policies import no numpy

        arr = np.frombuffer(self.packed, dtype=np.intc)  # read-only: the bytes are shared
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            return arr.astype(dtype)  # a new array
        return arr.copy() if copy else arr  # np.array() asks for a copy it may write to


def _common_packed(a: bytes, b: bytes, start: int) -> int:
    """``common_prefix_len`` of two packed id sequences, in ids."""
    return _common_in_place(a, memoryview(b), start, ID_BYTES)


def _common_in_place(a: Any, b: Any, start: int, unit: int) -> int:
    """The leading units (of `unit` items) that `a` and `b` share, two bytes (`b` a view of
    them: sliced without a copy) or two texts: ``startswith`` of the whole span first, then
    bisected, each step one slice of `b` compared in place in `a`."""
    n = min(len(a), len(b)) // unit
    lo = min(start, n)  # invariant: the first lo units are equal
    if a.startswith(b[lo * unit : n * unit], lo * unit):
        return n
    hi = n  # invariant: the first hi units are not all equal
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.startswith(b[lo * unit : mid * unit], lo * unit):
            lo = mid
        else:
            hi = mid
    return lo


def _as_tuple(ids: Sequence[Any]) -> Sequence[Any]:
    # A list never equals a tuple, so both sides are compared as tuples; a tuple (or a text)
    # is not copied.
    return ids if isinstance(ids, tuple | str) else tuple(ids)


def frozen(ids: Sequence[int]) -> Sequence[int]:
    """`ids` as a tuple: not copied where they are one or ``TokenIds`` (a list is copied, so
    later changes to it do not leak in)."""
    return ids if isinstance(ids, tuple | TokenIds) else tuple(ids)


def packed_of(ids: Sequence[int]) -> bytes:
    """``pack(ids)``, read off ``TokenIds`` as they are."""
    return ids.packed if isinstance(ids, TokenIds) else pack(ids)


def packed_le(ids: Sequence[int]) -> bytes:
    """The ids as 4-byte little-endian integers: the bytes the worker protocol sends and the
    cache keys hash, the same on every host (``TokenIds`` on a little-endian one: as they are)."""
    packed = packed_of(ids)
    if sys.byteorder == "big":
        swapped = array(_PACK, packed)
        swapped.byteswap()
        packed = swapped.tobytes()
    return packed


def common_prefix_len(a: Sequence[Any], b: Sequence[Any], start: int = 0) -> int:
    """Number of leading items ``a`` and ``b`` share: token ids, or characters of two texts;
    ``start``: a number of them known to be shared already."""
    if isinstance(a, TokenIds) or isinstance(b, TokenIds):  # the other packed once, if need be
        return _common_packed(packed_of(a), packed_of(b), start)
    if isinstance(a, str) and isinstance(b, str):
        return _common_in_place(a, b, start, 1)
    ta, tb = _as_tuple(a), _as_tuple(b)
    n = min(len(ta), len(tb))
    lo = min(start, n)  # invariant: ta[:lo] == tb[:lo]
    while lo < n:
        hi = min(lo + CHUNK_TOKENS, n)
        if ta[lo:hi] != tb[lo:hi]:
            break
        lo = hi
    else:
        return n
    while hi - lo > LINEAR_TOKENS:  # invariant: ta[:hi] != tb[:hi]
        mid = (lo + hi) // 2
        if ta[lo:mid] == tb[lo:mid]:
            lo = mid
        else:
            hi = mid
    while ta[lo] == tb[lo]:
        lo += 1
    return lo


def live_reuse(shared: int, live_n: int, floor: int) -> int:
    """Tokens a live state of ``live_n`` tokens, cut back no further than ``floor``, can keep
    of a prompt sharing ``shared`` of them."""
    return shared if shared == live_n or shared >= floor else 0


def aligned(n: int, align: int) -> int:
    """``n`` rounded down to a multiple of ``align`` (a batch edge)."""
    a = max(align, 1)
    return n // a * a


def keep_max(n: int, align: int) -> int:
    """The most tokens of an ``n``-token prompt a hit may reuse: the last batch edge before its
    last token (never negative)."""
    return aligned(max(n - 1, 0), align)


LEAST_PART = 8  # a batch ends early at an end of turn once it holds size / LEAST_PART tokens
BATCHING_RULE = "ends/8"  # names the rule in the cache keys (backend.keys): a new rule, new keys


class Edges:
    """The batch edges of one prompt under a :class:`Batching`: 0 and every position up to the
    prompt's end where a cold run's batch ends (the prompt's last batch ends at its end, which is
    an edge only where the rule cuts there). ``points`` None: every multiple of ``size``."""

    __slots__ = ("n", "size", "points")

    def __init__(self, n: int, size: int, points: list[int] | None = None) -> None:
        self.n, self.size, self.points = n, max(size, 1), points

    def floor(self, p: int) -> int:
        """The last edge at or before ``p`` (0 for none)."""
        p = min(p, self.n)
        if p <= 0:
            return 0
        if self.points is None:
            return aligned(p, self.size)
        return self.points[bisect_right(self.points, p) - 1]

    def next(self, p: int) -> int:
        """The end of the batch that evaluates position ``p`` (``p`` < n): the first edge past
        ``p``, or the prompt's end."""
        if self.points is None:
            return min((p // self.size + 1) * self.size, self.n)
        i = bisect_right(self.points, p)
        return self.points[i] if i < len(self.points) else self.n

    def __contains__(self, p: object) -> bool:
        if not isinstance(p, int) or not 0 <= p <= self.n:
            return False
        return p % self.size == 0 if self.points is None else self.floor(p) == p

    def among(self, positions: frozenset[int], most: int) -> frozenset[int]:
        """The ``positions`` that are edges, ``most`` at most (a set operation: a request's
        stored positions number in the hundreds)."""
        if self.points is None:
            return frozenset(p for p in positions if 0 <= p <= min(most, self.n)
                             and p % self.size == 0)
        return positions.intersection(self.points[: bisect_right(self.points,
                                                                 min(most, self.n))])

    def down(self, hi: int, lo: int) -> list[int]:
        """The edges ``p`` with ``lo < p <= hi``, longest first."""
        top = self.floor(hi)
        if self.points is None:
            return list(range(top, lo, -self.size)) if top > lo else []
        i, j = bisect_right(self.points, lo), bisect_right(self.points, top)
        return self.points[i:j][::-1]

    @property
    def keep_max(self) -> int:
        """The most tokens a hit may reuse: the last edge before the prompt's last token."""
        return self.floor(self.n - 1)


@dataclass(frozen=True, slots=True)
class Batching:
    """How a cold run cuts a prompt into prefill batches (``backend.engine``'s rule 1), a
    function of the ids alone. From each edge a batch takes at most ``size`` tokens (the batch
    size), and it ends early right after an end-of-turn id (``ends``: the model's end-of-
    generation tokens, which close every message in the chat templates served) once it holds at
    least ``least`` tokens. So a conversation's edges fall at its message ends, where the next
    turn parts from it, instead of up to ``size - 1`` tokens before them.

    Whether a batch ends at ``p`` depends only on ``ids[:p]``: two prompts that share ``p``
    tokens have the same edges up to ``p``, and a snapshot taken at an edge of one is the state
    the other's cold run has there. ``ends`` empty: every multiple of ``size``."""

    size: int = 1
    ends: frozenset[int] = frozenset()

    @property
    def least(self) -> int:
        return max(self.size // LEAST_PART, 1)

    def edges(self, ids: Sequence[int]) -> Edges:
        n, size = len(ids), max(self.size, 1)
        if not self.ends or size == 1:
            return Edges(n, size)
        packed = packed_of(ids)
        # a recent prompt's edges up to where it parts from this one are this one's (the rule
        # looks back only): the walk resumes there, and only the new ids are searched
        recent = _RECENT_EDGES.setdefault(self, [])
        shared, points, best = 0, [0], -1
        for i in range(len(recent) - 1, -1, -1):  # the newest first: likely this conversation
            old, old_points = recent[i]
            at = shared * ID_BYTES
            if shared and old[at : at + ID_BYTES] != packed[at : at + ID_BYTES]:
                continue  # it parts from this prompt where the best does: it cannot share more
            if (k := _common_packed(old, packed, 0)) > shared:
                shared, points, best = k, old_points[: bisect_right(old_points, k)], i
        if best >= 0 and shared * ID_BYTES == len(recent[best][0]):
            del recent[best]  # this prompt extends (or repeats) it: one entry per conversation
        start, j, least = points[-1], 0, self.least
        ends = _end_positions(packed, self.ends, start)
        while True:
            j = bisect_left(ends, start + least, j)
            cut = min(ends[j] if j < len(ends) else n + 1, start + size)
            if cut > n:
                break
            points.append(cut)
            start = cut
        recent.append((packed, points))
        del recent[:-RECENT_EDGES]
        return Edges(n, size, points)


RECENT_EDGES = 8  # prompts whose edges are remembered per batching (a few sessions' last turns)
_RECENT_EDGES: dict[Batching, list[tuple[bytes, list[int]]]] = {}


def _end_positions(packed: bytes, ends: frozenset[int], start: int) -> list[int]:
    """The positions right after each id of ``ends`` in the packed ids past ``start``,
    ascending (found with ``bytes.find``: a C scan per id)."""
    out: list[int] = []
    for t in ends:
        b = pack((t,))
        i = packed.find(b, start * ID_BYTES)
        while i >= 0:
            if i % ID_BYTES == 0:
                out.append(i // ID_BYTES + 1)
                i = packed.find(b, i + ID_BYTES)
            else:
                i = packed.find(b, i + 1)
    out.sort()
    return out


GPU_BATCH, CPU_BATCH = 512, 128  # the batch size when none is set (backend.engine's rules)
# a CPU worker with no -ub takes 512 only where a token prefills at least this much faster in
# batches of 512 than of 128 (`choose_batch`)
BATCH_GAIN = 1.08


def default_batch(n_gpu_layers: int) -> int:
    """512 where layers are offloaded (llama.cpp's usual batch); 128 on a CPU until measured
    (`choose_batch`; an engine made in a test, or with `-ub` given, keeps what it gets)."""
    return GPU_BATCH if n_gpu_layers != 0 else CPU_BATCH


def measured_at_start(n_gpu_layers: int, batch: int, flash_attn: str) -> bool:
    """Whether a worker measures before it serves (`backend.worker.batch`): on a CPU, its batch
    where none is given, and the flash attention padding where flash attention may be on. The
    proxy starts the first such worker alone, and the others recall what it measured."""
    return n_gpu_layers == 0 and (not batch or flash_attn != "off")


def choose_batch(token_s: Mapping[int, float]) -> int:
    """A CPU worker's batch from the seconds a token took to prefill in batches of each size
    (`backend.worker.batch` measures 128 and 512 once, on the user's model and cores). 128
    puts batch edges 4x closer, so a hit re-prefills fewer tokens and the start-up check's
    probe is 4x shorter; 512 is taken where it prefills at least `BATCH_GAIN` x as fast, 4K
    tokens into a prompt (`backend.worker.batch.BATCH_DEPTH`: shallower, the two are close).
    With flash attention on, 512 won on both CPUs measured: on 2 Intel Xeon cores with AMX 128
    was 1.13-1.27x slower, and the agent team took 1.41x llama-server's wall at 128 against
    1.10x at 512; on 2 AMD EPYC cores (Zen) 1.05x slower 1-2K tokens in, 1.25x 4K in, and the
    team took 1.22x llama-server's wall at 128 against 1.00-1.02x at 512 (bench/results/
    issue41). With flash attention off 128 was as fast or faster."""
    small, large = token_s.get(CPU_BATCH, 0.0), token_s.get(GPU_BATCH, 0.0)
    if small > 0 and large > 0 and small >= BATCH_GAIN * large:
        return GPU_BATCH
    return CPU_BATCH


FA_TILE = 64  # ggml's CPU flash attention takes query rows 64 at a time (GGML_FA_TILE_Q) in
# a batch of 64 rows or more; fewer go one by one over every KV cell, each as slow as a
# decode step


def outputs_max(n_seq: int, n_draft: int) -> int:
    """The most rows with logits one llama_decode of the worker asks for, what llama.cpp sizes
    its compute buffer's logits for (`n_outputs_max`; its default, the whole batch, took
    297 MiB at 512 rows of a 152K vocabulary, on a GPU every byte of it): each slot's waiting
    token and a draft of up to `n_draft` in one verify, and the self-check's longest verify
    (`FA_TILE` + 1 rows of one slot). llama-server asks its slots' rows the same way
    (`common_speculative_get_output_limits`)."""
    return max(n_seq * (1 + n_draft), FA_TILE + 1)


@dataclass(frozen=True, slots=True)
class Padding:
    """Which prefill batches a CPU worker with flash attention pads to `FA_TILE` rows: those of
    `least` to 63 rows that start at or past position `past` (``least`` 0: none). The padding
    rows repeat the batch's last id at the positions after it and are dropped after the step,
    so the state holds the batch's own cells; padded or not is a function of the batch alone,
    so a hit replays its cold run's batches, padding included (the shape decides which kernel
    computes a row: other bits than unpadded, the same bits every time). On 2 Intel Xeon cores
    at 5K tokens into a prompt, SmolLM2 took 3.7 s for a 61-row batch and 0.62 s for 64 rows
    (a prompt's last batch, after its last message end, is often that short); at the start of
    a prompt 16 rows took 54 ms and 64 rows 177 ms. `choose_padding` takes the rule from what
    the worker measured on its model (`backend.worker.batch`)."""

    least: int = 0
    past: int = 0

    def rows(self, n: int, start: int) -> int:
        """The padding rows of a batch of `n` rows from position `start`."""
        if self.least and self.least <= n < FA_TILE and start >= self.past:
            return FA_TILE - n
        return 0

    def __str__(self) -> str:
        return (f"flash attention batches of {self.least}-{FA_TILE - 1} rows from position "
                f"{self.past} padded to {FA_TILE}") if self.least else ""


def choose_padding(seconds: Mapping[int, float], depth: int) -> Padding:
    """The padding from the seconds a batch of n rows took `depth` tokens into a prompt (n in
    16, 32, 48 and `FA_TILE`): batches from the least n that took at least as long as
    `FA_TILE` rows, at that depth and past it (the farther into a prompt, the more a short
    batch costs). None where no short batch was slower, or nothing was measured."""
    tile = seconds.get(FA_TILE, 0.0)
    for n in sorted(k for k in seconds if 0 < k < FA_TILE):
        if tile > 0 and seconds[n] >= tile:
            return Padding(n, depth)
    return Padding()
