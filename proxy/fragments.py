"""The pieces of the tokenizer that work on fragments (proxy/tokenizer.py's rules 1-3): the
split on special tokens, llama.cpp's pre-tokenizer regexes per pre type, the pre-token path to
HF's BPE, and the per-fragment cache of ids, bounded by bytes.

    SpecialSplitter(specials).split(text) -> [(start, end, special id or None)]
    PRE_REGEXES[pre type] -> PreType       Words.build(regexes, encode) -> Words | None
    FragmentCache(max_bytes)               an LRU of fragment text -> ids, by bytes
    bytes_to_unicode()                     GPT-2's byte -> character map (HF's byte level)

The fragment cache: a 30K-token conversation re-sent with one new turn only tokenizes the new
fragments. It is bounded by bytes (the key strings and the ids as Python holds them; 64 MiB by
default), not by count: every request is tokenized before its length is checked, so a stream
of rejected 1 MB prompts must not grow the proxy. A fragment larger than a quarter of the bound
is not kept, so one huge prompt cannot flush the rest.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

log = logging.getLogger("proxy.tokenizer")  # the tokenizer's own log, as before the split

# what a cached id costs beyond the tuple's pointer to it: an int object (ids above 256 are not
# shared), and what the ordered dict's entry costs beyond its key and value
_INT_BYTES = 32
_ENTRY_OVERHEAD_BYTES = 104

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), applied in order,
# each splitting the pieces of the previous one and keeping matches and gaps alike. llama.cpp's
# hand-written GPT-2 splitter also takes a trailing whitespace run, hence the final "|\s+".
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class PreType:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole pre-token found in the vocab is emitted as is
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_DIGITS_THEN_GPT2 = PreType((r"\p{N}", _GPT2))
PRE_REGEXES: dict[str, PreType] = {
    "gpt-2": PreType((_GPT2,)),
    "phi-2": PreType((_GPT2,)),
    "mpt": PreType((_GPT2,)),
    "olmo": PreType((_GPT2,)),
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "minerva-7b": _DIGITS_THEN_GPT2,
    "llama3": PreType((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama-v3": PreType((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama-bpe": PreType((_LLAMA3,), ignore_merges=True, add_bos=True),
    "falcon3": PreType((_LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": PreType((_LLAMA3,)),
    "smaug-bpe": PreType((_LLAMA3,)),
    "qwen2": PreType((_QWEN2,)),
    "deepseek-r1-qwen": PreType((_QWEN2,)),
    "stablelm2": PreType((_QWEN2,)),
}

class SpecialSplitter:
    """Split text on special-token texts exactly as llama.cpp's tokenizer_st_partition does."""

    def __init__(self, specials: dict[str, int]) -> None:
        self.specials = specials
        # llama.cpp tries longer texts first; among equal lengths the order does not matter
        # unless texts overlap, and then the exact path below is taken.
        self._by_length = sorted(specials, key=len, reverse=True)
        self._pattern: re.Pattern[str] | None = None
        if self._by_length and not can_partially_overlap(self._by_length):
            self._pattern = re.compile("|".join(re.escape(t) for t in self._by_length))

    def split(self, text: str, start: int = 0) -> list[tuple[int, int, int | None]]:
        """Return (start, end, special id or None) pieces covering ``text[start:]`` in order
        (`start` > 0 only where `resumable`)."""
        if not self._by_length:
            return [(start, len(text), None)] if len(text) > start else []
        if self._pattern is not None:
            return self._split_regex(text, start)
        assert start == 0
        return self._split_exact(text)

    @property
    def resumable(self) -> bool:
        """Whether the pieces after a special token are those of the text after it: the regex
        scans left to right (llama.cpp's longest-first carving is the same when no special's
        text can overlap another's)."""
        return self._pattern is not None or not self._by_length

    @property
    def longest(self) -> int:
        return len(self._by_length[0]) if self._by_length else 0

    def _split_regex(self, text: str, start: int = 0) -> list[tuple[int, int, int | None]]:
        assert self._pattern is not None
        pieces: list[tuple[int, int, int | None]] = []
        pos = start
        for m in self._pattern.finditer(text, start):
            start, end = m.span()
            if start > pos:
                pieces.append((pos, start, None))
            pieces.append((start, end, self.specials[m.group()]))
            pos = end
        if pos < len(text):
            pieces.append((pos, len(text), None))
        return pieces

    def _split_exact(self, text: str) -> list[tuple[int, int, int | None]]:
        # llama.cpp: for each special (longest first), carve every occurrence out of the
        # remaining raw fragments, left to right.
        pieces: list[tuple[int, int, int | None]] = [(0, len(text), None)] if text else []
        for special in self._by_length:
            if special not in text:
                continue
            token_id = self.specials[special]
            carved: list[tuple[int, int, int | None]] = []
            for start, end, sid in pieces:
                if sid is not None:
                    carved.append((start, end, sid))
                    continue
                pos = start
                while (hit := text.find(special, pos, end)) != -1:
                    if hit > pos:
                        carved.append((pos, hit, None))
                    carved.append((hit, hit + len(special), token_id))
                    pos = hit + len(special)
                if pos < end:
                    carved.append((pos, end, None))
            pieces = carved
        return pieces


def can_partially_overlap(texts: Sequence[str]) -> bool:
    """True when a proper suffix of one text is a proper prefix of another (or the same) text."""
    prefixes = {t[:k] for t in texts for k in range(1, len(t))}
    return any(t[-k:] in prefixes for t in texts for k in range(1, len(t)))


def entry_bytes(key: str, value: tuple[int, ...]) -> int:
    """What keeping ``key -> value`` costs in memory, about."""
    return (sys.getsizeof(key) + sys.getsizeof(value) + _INT_BYTES * len(value)
            + _ENTRY_OVERHEAD_BYTES)


class FragmentCache:
    """A fragment-text -> ids map bounded by bytes (:func:`entry_bytes`), least recently used
    out first; safe to share between threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self._data: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[int, ...] | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: str, value: tuple[int, ...]) -> None:
        size_bytes = entry_bytes(key, value)
        if size_bytes > self.max_bytes // 4:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.size_bytes -= entry_bytes(key, old)
            self._data[key] = value
            self.size_bytes += size_bytes
            while self.size_bytes > self.max_bytes:
                evicted, ids = self._data.popitem(last=False)
                self.size_bytes -= entry_bytes(evicted, ids)

    def __len__(self) -> int:
        return len(self._data)


class Words:
    """Fragments -> ids through pre-tokens: llama.cpp's pre-tokenizer regexes run here (the
    ``regex`` module, as HF's isolated ``Split`` would run them), and each distinct pre-token is
    BPE-encoded by HF once and remembered. A prompt repeats its words (a 32K-token prompt has a
    few thousand distinct ones), and HF spends most of its time splitting and mapping the text,
    so this costs a third to a half of HF's whole-fragment path on a new conversation. BPE acts
    on each pre-token alone, so the ids are the same; ``_build_hf_tokenizer`` uses this path only
    when it agrees with HF's on the probe, and ``load_tokenizer`` then checks it against
    llama.cpp as before.

    The memory is two generations of at most ``capacity`` pre-tokens each (a lookup in the old
    one moves the entry to the young one; a full young generation becomes the old one), so it is
    bounded and keeps what recent prompts use; pre-tokens longer than ``_LONGEST`` characters are
    not kept."""

    _LONGEST = 64

    def __init__(self, patterns: list[Any], encode: Callable[[list[str]], list[list[int]]],
                 capacity: int = 1 << 15) -> None:
        self._patterns = patterns
        self._encode = encode
        self._capacity = capacity
        self._young: dict[str, tuple[int, ...]] = {}
        self._old: dict[str, tuple[int, ...]] = {}

    @classmethod
    def build(cls, regexes: Sequence[str], encode: Callable[[list[str]], list[list[int]]]
              ) -> Words | None:
        """None when the ``regex`` module is missing or does not take a pattern."""
        try:
            import regex
        except ImportError:
            return None
        try:
            patterns = [regex.compile(r) for r in regexes]
        except regex.error as exc:
            log.info("tokenizer: a pre-tokenizer regex does not compile here (%s)", exc)
            return None
        return cls(patterns, encode)

    def split(self, fragment: str) -> list[str]:
        """The pre-tokens of `fragment`: each pattern in turn splits the pieces of the one
        before it, keeping matches and the gaps between them."""
        pieces = [fragment]
        *firsts, last = self._patterns
        for pattern in firsts:
            pieces = [w for p in pieces for w in isolated(pattern, p)]
        out: list[str] = []
        for p in pieces:
            found = last.findall(p)
            # the patterns llama.cpp uses match every character; a gap takes the slow path
            out.extend(found if sum(map(len, found)) == len(p) else isolated(last, p))
        return out

    def __call__(self, fragments: list[str]) -> list[list[int]]:
        young, old = self._young, self._old
        split = [self.split(f) for f in fragments]
        found: dict[str, Any] = dict.fromkeys(chain.from_iterable(split))  # the distinct ones
        missing: list[str] = []
        for w in found:
            ids = young.get(w)
            if ids is None:
                ids = old.get(w)
                if ids is None:
                    missing.append(w)
                    continue
                young[w] = ids
            found[w] = ids
        if missing:
            for w, ids in zip(missing, self._encode(missing), strict=True):
                found[w] = tuple(ids)
                if len(w) <= self._LONGEST:
                    young[w] = found[w]
        if len(young) > self._capacity:  # another thread may do the same: harmless
            self._old, self._young = young, {}
        get = found.__getitem__
        return [list(chain.from_iterable(map(get, words))) for words in split]


def isolated(pattern: Any, text: str) -> list[str]:
    """`text` split at `pattern`'s matches, each match and each gap a piece (HF's "isolated")."""
    pieces = []
    pos = 0
    for m in pattern.finditer(text):
        start, end = m.span()
        if start > pos:
            pieces.append(text[pos:start])
        if end > start:
            pieces.append(text[start:end])
        pos = end
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
