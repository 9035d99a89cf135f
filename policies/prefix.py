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
- ``TokenIds``: a tuple of token ids that also carries ``packed``, the same ids as 4-byte native
  integers. Where both sides have it, ``common_prefix_len`` compares them with ``bytes.startswith``
  (memcmp, no copy; bisected only when they differ): about 5 us for two 32K-token prompts
  instead of about 170 us. Whoever builds ids a turn at a time (``proxy.template``) makes them;
  anything else is compared as before. Equal ids always have equal packed forms, so the answer
  is the same either way.
- ``live_reuse(shared, live_n, floor)``: what a worker's live state can keep of a prompt that
  shares ``shared`` tokens with its ``live_n`` live ones, when its memory can be cut back no
  further than ``floor`` (0 for plain attention, ``live_n`` for a recurrent state: only the whole
  live sequence): ``shared`` if it is all of them or at least ``floor``, else nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

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


class TokenIds(tuple[int, ...]):
    """Token ids, with ``packed``: the same ids packed (``pack``), built alongside them."""

    packed: bytes

    def __new__(cls, ids: Iterable[int], packed: bytes | None = None) -> TokenIds:
        self = super().__new__(cls, ids)
        self.packed = pack(self) if packed is None else packed
        assert len(self.packed) == len(self) * ID_BYTES
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenIds, (tuple(self), self.packed))


def _common_packed(a: bytes, b: bytes, start: int) -> int:
    """``common_prefix_len`` of two packed id sequences, in ids."""
    n = min(len(a), len(b)) // ID_BYTES
    lo = min(start, n)  # invariant: the first lo ids are equal
    view = memoryview(b)
    if a.startswith(view[lo * ID_BYTES : n * ID_BYTES], lo * ID_BYTES):
        return n
    hi = n  # invariant: the first hi ids are not all equal
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.startswith(view[lo * ID_BYTES : mid * ID_BYTES], lo * ID_BYTES):
            lo = mid
        else:
            hi = mid
    return lo


def _as_tuple(ids: Sequence[Any]) -> Sequence[Any]:
    # A list never equals a tuple, so both sides are compared as tuples; a tuple (or a text)
    # is not copied.
    return ids if isinstance(ids, tuple | str) else tuple(ids)


def common_prefix_len(a: Sequence[Any], b: Sequence[Any], start: int = 0) -> int:
    """Number of leading items ``a`` and ``b`` share: token ids, or characters of two texts;
    ``start``: a number of them known to be shared already."""
    if isinstance(a, TokenIds) and isinstance(b, TokenIds):
        return _common_packed(a.packed, b.packed, start)
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


GPU_BATCH, CPU_BATCH = 512, 64  # the batch size when none is set (backend.engine's rules)


def default_batch(n_gpu_layers: int) -> int:
    """512 where layers are offloaded (llama.cpp's usual batch); 64 on a CPU, where a hit
    re-evaluates at most 63 tokens and cold prefill costs little against 512 (2 AMD EPYC cores,
    `python -m bench.batches`: SmolLM2 1.04x, Gemma 3 270M 0.91x the tokens/s)."""
    return GPU_BATCH if n_gpu_layers != 0 else CPU_BATCH
