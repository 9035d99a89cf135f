"""Prompt-lookup drafts: llama.cpp's n-gram drafters (`common/ngram-map.cpp`,
`common/ngram-mod.cpp`, `common/speculative.cpp` of the llama.cpp llama-cpp-python vendors), the
same drafts from the same tokens, so `--spec-type ngram-...` proposes what llama-server proposes.

    drafter = make(name, params)          one per request, fed its prompt (`begin`)
    drafter.draft(context, last) -> ids   `context`: every token evaluated so far (prompt and
                                          generated), `last`: the sampled token not yet evaluated
    drafter.accept(n)                     how many of its last draft the target accepted

- ``ngram-simple``: the last ``size_n`` tokens (ending with `last`) looked up backwards in the
  context; the ``size_m`` tokens after the latest earlier occurrence are the draft (none shorter
  than ``size_n``).
- ``ngram-map-k``: the same lookup through a hash map of the context's n-grams (first writer
  wins, as llama.cpp's 2^18-entry `key_map`), the draft as long as the last one accepted there.
- ``ngram-map-k4v``: beside each key n-gram up to four m-grams that followed it, counted; the
  most frequent is the draft when it came at least twice as often as the others together and
  the key ``min_hits`` times.
- ``ngram-mod``: a hashed table of n-gram -> next token (``n_match`` tokens, 4M entries, the
  latest writer wins), chained up to ``n_max`` tokens, none shorter than ``n_min``; five drafts
  in a row of which under a quarter was accepted empty the table.

One deliberate difference: llama.cpp keeps ngram-mod's table for every slot and request, and
ngram-map's maps for a slot across its requests, so its drafts depend on what was served
before. Here every request starts from its own prompt, so a request's drafts depend on its
tokens alone, and a cache hit drafts what its cold run drafted (policies.speculate). On a fresh
server, one request, the drafts are llama-server's.

Pure: no I/O, clock or logging; the state is the request's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

Tokens = npt.NDArray[np.intc]

MOD_SIZE = 4 * 1024 * 1024  # ngram-mod's table entries (common_speculative_impl_ngram_mod)
MOD_RESET_OCCUPANCY = 0.25  # begin() empties a table fuller than this
MOD_CHUNK = 32  # new n-grams are added once this many tokens came
MOD_LOW = 0.25  # an accepted fraction under this is a low round ...
MOD_LOW_ROUNDS = 5  # ... and this many in a row empty the table
MOD_MUL = 6364136223846793005  # its hash: res = res * MOD_MUL + token, mod 2^64
MAP_HASH_SIZE = 262144  # ngram-map's key_map (COMMON_NGRAM_HASH_MAP_SIZE)
MAP_MUL = 2654435761  # its LCG hash, mod 2^32
MAP_VALUES = 4  # m-grams counted per key (COMMON_NGRAM_MAX_VALUES)
MAP_COUNT_MAX = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT


@dataclass(frozen=True, slots=True)
class NgramParams:
    """llama.cpp's defaults (common_params_speculative_*)."""

    simple_size_n: int = 12
    simple_size_m: int = 48
    simple_min_hits: int = 1  # llama.cpp's ngram-simple does not read it
    map_k_size_n: int = 12
    map_k_size_m: int = 48
    map_k_min_hits: int = 1
    map_k4v_size_n: int = 12
    map_k4v_size_m: int = 48
    map_k4v_min_hits: int = 1
    mod_n_match: int = 24
    mod_n_min: int = 48
    mod_n_max: int = 64


class Drafter(Protocol):
    name: str

    def begin(self, prompt: Tokens) -> None: ...

    def draft(self, context: Tokens, last: int) -> list[int]: ...

    def accept(self, n_accepted: int) -> None: ...


def _matches(a: Tokens, key: Sequence[int], lo: int, hi: int) -> npt.NDArray[np.intp]:
    """The positions j in [lo, hi] (ascending) where a[j:j+len(key)] == key."""
    if hi < lo:
        return np.empty(0, dtype=np.intp)
    js = np.flatnonzero(a[lo:hi + 1] == key[0]) + lo
    for k in range(1, len(key)):
        if not len(js):  # no candidate left (the usual case: each test is a numpy call)
            break
        js = js[a[js + k] == key[k]]
    return js


def _last_match(a: Tokens, key: Sequence[int], lo: int, hi: int) -> int:
    """The largest j in [lo, hi] where the key starts, else 0 (llama.cpp's "no match"): the
    tokens' bytes searched from the end in C (a hit between two tokens' bytes is skipped)."""
    if hi < lo:
        return 0
    w = a.itemsize
    raw, sub = a.tobytes(), np.asarray(key, dtype=a.dtype).tobytes()
    end = (hi + len(key)) * w
    while True:
        at = raw.rfind(sub, lo * w, end)
        if at < 0:
            return 0
        if at % w == 0:
            return at // w
        end = at + len(sub) - 1


@dataclass(slots=True)
class NgramSimple:
    """common_ngram_simple_draft: stateless."""

    size_n: int
    size_m: int
    name: str = "ngram-simple"

    def begin(self, prompt: Tokens) -> None:
        pass

    def draft(self, context: Tokens, last: int) -> list[int]:
        n, m, cur = self.size_n, self.size_m, len(context)
        if cur <= n + m + 1:
            return []
        key = [*context[cur - n + 1:].tolist(), last]
        pos = _last_match(context, key, 1, cur - n - 1)
        if pos == 0:
            return []
        copy = min(m, cur - (pos + n))
        if copy < n:
            return []
        return [int(t) for t in context[pos + n: pos + n + copy]]

    def accept(self, n_accepted: int) -> None:
        pass


def _map_slot(ngram: Sequence[int]) -> int:
    """common_ngram_map_hash of one n-gram, mod the key_map's size."""
    h = 0
    for t in ngram:
        h = (h * MAP_MUL + t) & 0xFFFFFFFF
    return h % MAP_HASH_SIZE


def _map_hash(a: Tokens, js: npt.NDArray[np.intp], n: int) -> npt.NDArray[np.uint32]:
    """common_ngram_map_hash of the n-gram at each j, mod the key_map's size."""
    h = np.zeros(len(js), dtype=np.uint32)
    for i in range(n):
        h = h * np.uint32(MAP_MUL) + a[js + i].astype(np.uint32)
    return h % np.uint32(MAP_HASH_SIZE)


@dataclass(slots=True)
class _Value:
    idx: int = 0  # where the m-gram starts (0: unused)
    num: int = 0
    n_accepted: int = -1


@dataclass(slots=True)
class _Key:
    idx: int
    stat_idx: int = 0
    num: int = 0
    values: list[_Value] = field(default_factory=lambda: [_Value() for _ in range(MAP_VALUES)])


@dataclass(slots=True)
class NgramMap:
    """common_ngram_map (key_only: ngram-map-k; else ngram-map-k4v), one request's."""

    size_n: int
    size_m: int
    key_only: bool
    min_hits: int
    name: str = ""
    key_map: npt.NDArray[np.uint32] = field(
        default_factory=lambda: np.zeros(MAP_HASH_SIZE, dtype=np.uint32))
    key_map_last: int = 0
    begin_n: int = 0  # size_last_begin
    keys: list[_Key] = field(default_factory=list)
    found: dict[tuple[int, ...], int] = field(default_factory=dict)  # a key's n-gram -> its index
    last: tuple[int, int] | None = None  # (key, value) of the last draft

    def __post_init__(self) -> None:
        self.name = self.name or ("ngram-map-k" if self.key_only else "ngram-map-k4v")

    def begin(self, prompt: Tokens) -> None:
        self.begin_n = len(prompt)

    def _add(self, a: Tokens, hi: int, lo: int) -> None:
        """Hashes of the n-grams at hi, hi-1, ..., lo+1 into empty key_map entries (the first
        written, in that order, wins)."""
        if hi <= lo:
            return
        if hi - lo <= 4:  # a step's one new n-gram: no numpy call
            for j in range(hi, lo, -1):
                slot = _map_slot(a[j:j + self.size_n].tolist())
                if self.key_map[slot] == 0:
                    self.key_map[slot] = j
            return
        js = np.arange(hi, lo, -1, dtype=np.intp)
        h = _map_hash(a, js, self.size_n)
        first_h, first_i = np.unique(h, return_index=True)
        empty = self.key_map[first_h] == 0
        self.key_map[first_h[empty]] = js[first_i[empty]].astype(np.uint32)

    def draft(self, context: Tokens, last: int) -> list[int]:
        self.last = None
        a, cur, n, m = context, len(context), self.size_n, self.size_m
        if cur < 2 * n + m:
            return []
        key = [*a[cur - n + 1:].tolist(), last]
        pos = 0
        at = int(self.key_map[_map_slot(key)])
        if at != 0 and at < cur - n - m - 1 and a[at:at + n].tolist() == key:
            pos = at
        if pos == 0 and self.begin_n > n + m + 1:
            pos = _last_match(a, key, self.key_map_last + 1, self.begin_n - n - m - 1)
        if pos == 0:
            pos = _last_match(a, key, max(self.begin_n, self.key_map_last) + 1, cur - n - m - 1)
        if self.begin_n > n + m + 1:
            self._add(a, self.begin_n - n - m - 1, self.key_map_last)
        self._add(a, cur - n - m - 1, max(self.begin_n, self.key_map_last))
        self.key_map_last = max(cur - n - m - 1, self.key_map_last)
        if pos == 0:
            return []
        i_key = self.found.get(tuple(key))
        if i_key is None:
            i_key = self.found[tuple(key)] = len(self.keys)
            self.keys.append(_Key(pos, values=[_Value(0, 0, m) for _ in range(MAP_VALUES)]))
        e = self.keys[i_key]
        e.num = min(e.num + 1, MAP_COUNT_MAX)
        if self.key_only:
            self.last = (i_key, 0)
            return [int(t) for t in a[pos + n: pos + n + min(m, e.values[0].n_accepted)]]
        if e.num < self.min_hits:
            return []
        for i in _matches(a, key, e.stat_idx, pos).tolist():
            start = i + n
            for v in e.values:
                if v.idx == 0:
                    v.idx, v.num, v.n_accepted = start, 0, m
                elif not np.array_equal(a[start:start + m], a[v.idx:v.idx + m]):
                    continue
                v.num = min(v.num + 1, MAP_COUNT_MAX)
                break
        e.stat_idx = pos
        best = max(range(MAP_VALUES), key=lambda v: (e.values[v].num, -v))
        top = e.values[best].num
        others = sum(v.num for i, v in enumerate(e.values) if i != best)
        if others > 0 and top < 2 * others:
            return []
        self.last = (i_key, best)
        return [int(t) for t in a[pos + n: pos + n + min(m, e.values[best].n_accepted)]]

    def accept(self, n_accepted: int) -> None:
        if self.last is not None:
            i_key, i_value = self.last
            self.keys[i_key].values[i_value].n_accepted = n_accepted


def _mod_index(a: Tokens, n: int) -> npt.NDArray[np.uint64]:
    """common_ngram_mod::idx of the n-gram at every start 0..len(a)-n."""
    starts = len(a) - n + 1
    h = np.zeros(max(starts, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            h = h * np.uint64(MOD_MUL) + a[i:i + starts].astype(np.uint64)
    return h % np.uint64(MOD_SIZE)


def _mod_hash(ngram: Sequence[int]) -> int:
    """common_ngram_mod's hash of one n-gram, before its slot (`% MOD_SIZE`)."""
    h = 0
    for t in ngram:
        h = (h * MOD_MUL + t) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclass(slots=True)
class NgramMod:
    """common_speculative_impl_ngram_mod, its table this request's own (module docstring)."""

    n_match: int
    n_min: int
    n_max: int
    name: str = "ngram-mod"
    table: dict[int, int] = field(default_factory=dict)
    i_last: int = 0
    n_draft_last: int = 0
    n_low: int = 0

    def _add(self, a: Tokens, lo: int, hi: int) -> None:
        """The n-grams starting at lo..hi-1, each -> the token after it."""
        if hi <= lo:
            return
        idx = _mod_index(a[lo:hi + self.n_match], self.n_match)[: hi - lo]
        nxt = a[lo + self.n_match: hi + self.n_match].tolist()
        self.table.update(zip(idx.tolist(), nxt, strict=True))

    def begin(self, prompt: Tokens) -> None:
        self.i_last = self.n_draft_last = 0
        n = self.n_match
        if len(prompt) < n:
            return
        self._add(prompt, 0, len(prompt) - n)
        self.i_last = len(prompt) - n
        if len(self.table) / MOD_SIZE > MOD_RESET_OCCUPANCY:
            self.table.clear()

    def draft(self, context: Tokens, last: int) -> list[int]:
        self.n_draft_last = 0
        cur, n = len(context), self.n_match
        if cur < n:
            return []
        if self.i_last + MOD_CHUNK < cur:
            self._add(context, self.i_last, cur - n)
            self.i_last = cur - n
        window = [*context[cur - n + 1:].tolist(), last]
        # the window's hash, rolled one token on per drafted token (the same hash: it is a
        # polynomial mod 2^64)
        h, top, mask = _mod_hash(window), pow(MOD_MUL, n - 1, 1 << 64), 0xFFFFFFFFFFFFFFFF
        out: list[int] = []
        for i in range(self.n_max):
            token = self.table.get(h % MOD_SIZE)
            if token is None:
                if i < self.n_min:
                    return []
                break
            out.append(token)
            window.append(token)
            h = ((h - window[i] * top) * MOD_MUL + token) & mask
        self.n_draft_last = len(out)
        return out

    def accept(self, n_accepted: int) -> None:
        if self.n_draft_last > 0:
            if n_accepted / self.n_draft_last < MOD_LOW:
                self.n_low += 1
                if self.n_low >= MOD_LOW_ROUNDS:
                    self.table.clear()
                    self.n_low = self.i_last = 0
            else:
                self.n_low = 0


# llama.cpp's names, in the order its chain tries them (common_speculative_init)
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")


def make(name: str, p: NgramParams) -> Drafter:
    if name == "ngram-simple":
        return NgramSimple(p.simple_size_n, p.simple_size_m)
    if name == "ngram-map-k":
        return NgramMap(p.map_k_size_n, p.map_k_size_m, True, p.map_k_min_hits)
    if name == "ngram-map-k4v":
        return NgramMap(p.map_k4v_size_n, p.map_k4v_size_m, False, p.map_k4v_min_hits)
    if name == "ngram-mod":
        return NgramMod(p.mod_n_match, p.mod_n_min, p.mod_n_max)
    raise ValueError(f"no n-gram drafter {name!r}")


def n_max(name: str, p: NgramParams) -> int:
    """The longest draft of a type (common_speculative_n_max)."""
    return {"ngram-simple": p.simple_size_m, "ngram-map-k": p.map_k_size_m,
            "ngram-map-k4v": p.map_k4v_size_m, "ngram-mod": max(p.mod_n_max, 0)}[name]
