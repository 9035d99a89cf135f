"""Tokenize prompt text into the exact token ids llama.cpp would produce.

The contract: ``Tokenizer.encode(text)`` equals llama.cpp's
``llama_tokenize(text, add_special=False, parse_special=True)`` for the same model file. Token ids
are the cache's currency, so a single differing id is a cache miss at best.

How llama.cpp tokenizes, and how this module mirrors it:

1. **Specials first.** Every token whose attribute is control, user-defined or unknown is matched
   literally in the text, longest token text first, and carved out as a single id. The raw text
   between them is tokenized fragment by fragment, each fragment on its own. ``_SpecialSplitter``
   does the same split; it uses one regex pass when no two special texts can partially overlap
   (then leftmost-longest matching gives the identical split) and llama.cpp's token-by-token
   carving otherwise.
2. **Fragments.** For BPE ("gpt2") vocabularies with a known ``tokenizer.ggml.pre``, a HF
   ``tokenizers`` BPE model is built from the GGUF's own tokens and merges, with llama.cpp's
   pre-tokenizer regexes for that pre type (``_PRE_REGEXES``) as isolated splits followed by the
   GPT-2 byte mapping. Fragments are not handed to HF whole: the same regexes run here
   (``_Words``, the ``regex`` module) and each distinct pre-token goes to HF's BPE once and is
   remembered, which costs a third to a half of HF's own splitting on new text; this path is
   used only where it gives HF's ids on the probe. Anything else (SPM "llama", WPM, UGM,
   unknown pre types, models whose specials strip whitespace) uses llama.cpp's own tokenizer
   through ``llama_cpp.Llama(..., vocab_only=True)``, with one warning line.
3. **Per-fragment cache.** Because the split on specials comes first, tokenizing fragment by
   fragment and concatenating equals tokenizing the whole text. Fragment ids are kept in an LRU
   keyed on the fragment text, so a 30K-token conversation re-sent with one new turn only
   tokenizes the new fragments. The LRU is bounded by bytes (the key strings and the ids as
   Python holds them; 64 MiB by default), not by count: every request is tokenized before its
   length is checked, so a stream of rejected 1 MB prompts must not grow the proxy. A fragment
   larger than a quarter of the bound is not kept, so one huge prompt cannot flush the rest.

Verify before trust: ``load_tokenizer`` compares the built tokenizer with llama.cpp (special set,
end-of-generation ids, BOS/EOS, ids of a probe text) when ``llama_cpp`` is importable; any
difference logs one warning naming it and falls back to llama.cpp's tokenizer.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["Segment", "Tokenizer", "load_tokenizer"]

# GGUF token types (gguf.TokenType) and llama.cpp token attributes (llama_token_attr).
_TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED = 2, 3, 4
_ATTR_UNKNOWN, _ATTR_CONTROL, _ATTR_USER_DEFINED = 1 << 0, 1 << 3, 1 << 4
_ATTR_LSTRIP, _ATTR_RSTRIP = 1 << 7, 1 << 8
_ATTR_SPECIAL = _ATTR_UNKNOWN | _ATTR_CONTROL | _ATTR_USER_DEFINED

_DEFAULT_CACHE_BYTES = 64 << 20
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
class _PreType:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole pre-token found in the vocab is emitted as is
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_DIGITS_THEN_GPT2 = _PreType((r"\p{N}", _GPT2))
_PRE_REGEXES: dict[str, _PreType] = {
    "gpt-2": _PreType((_GPT2,)),
    "phi-2": _PreType((_GPT2,)),
    "mpt": _PreType((_GPT2,)),
    "olmo": _PreType((_GPT2,)),
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "minerva-7b": _DIGITS_THEN_GPT2,
    "llama3": _PreType((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama-v3": _PreType((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama-bpe": _PreType((_LLAMA3,), ignore_merges=True, add_bos=True),
    "falcon3": _PreType((_LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": _PreType((_LLAMA3,)),
    "smaug-bpe": _PreType((_LLAMA3,)),
    "qwen2": _PreType((_QWEN2,)),
    "deepseek-r1-qwen": _PreType((_QWEN2,)),
    "stablelm2": _PreType((_QWEN2,)),
}

# Token texts llama.cpp promotes to control tokens and end-of-generation ids by name
# (llama_vocab::impl::load, "auto-detect special tokens by text").
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
        "<end_of_utterance>",
    }
)  # fmt: skip
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# A probe for the load-time comparison with llama.cpp: specials glued to text, digits, code,
# contractions, whitespace runs and several scripts.
_PROBE = (
    "<|im_start|>system\nYou're   a helpful\tassistant.<|im_end|>\n<|im_start|>user\n"
    "Isn't 12345678 + 3.14159 = x?  \r\n\n\ndef f(a, b):\n    return a**2  # café 日本語 🙂 "
    "مرحبا e\u0301 \u00a0\u3000x<|im_end|><|im_start|>assistant\n<|endoftext|>ok   "
)


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of the text between special tokens, or one special token, with its ids."""

    start: int  # character offset in the text
    end: int  # character offset, exclusive
    ids: tuple[int, ...]
    special: bool


class _SpecialSplitter:
    """Split text on special-token texts exactly as llama.cpp's tokenizer_st_partition does."""

    def __init__(self, specials: dict[str, int]) -> None:
        self.specials = specials
        # llama.cpp tries longer texts first; among equal lengths the order does not matter
        # unless texts overlap, and then the exact path below is taken.
        self._by_length = sorted(specials, key=len, reverse=True)
        self._pattern: re.Pattern[str] | None = None
        if self._by_length and not _can_partially_overlap(self._by_length):
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


def _can_partially_overlap(texts: Sequence[str]) -> bool:
    """True when a proper suffix of one text is a proper prefix of another (or the same) text."""
    prefixes = {t[:k] for t in texts for k in range(1, len(t))}
    return any(t[-k:] in prefixes for t in texts for k in range(1, len(t)))


def _entry_bytes(key: str, value: tuple[int, ...]) -> int:
    """What keeping ``key -> value`` costs in memory, about."""
    return (sys.getsizeof(key) + sys.getsizeof(value) + _INT_BYTES * len(value)
            + _ENTRY_OVERHEAD_BYTES)


class _LRU:
    """A fragment-text -> ids map bounded by bytes (:func:`_entry_bytes`), least recently used
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
        size_bytes = _entry_bytes(key, value)
        if size_bytes > self.max_bytes // 4:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.size_bytes -= _entry_bytes(key, old)
            self._data[key] = value
            self.size_bytes += size_bytes
            while self.size_bytes > self.max_bytes:
                evicted, ids = self._data.popitem(last=False)
                self.size_bytes -= _entry_bytes(evicted, ids)

    def __len__(self) -> int:
        return len(self._data)


class _Words:
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
              ) -> _Words | None:
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
            pieces = [w for p in pieces for w in _isolated(pattern, p)]
        out: list[str] = []
        for p in pieces:
            found = last.findall(p)
            # the patterns llama.cpp uses match every character; a gap takes the slow path
            out.extend(found if sum(map(len, found)) == len(p) else _isolated(last, p))
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


def _isolated(pattern: Any, text: str) -> list[str]:
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


class Tokenizer:
    """Text <-> token ids for one model, equal to llama.cpp's tokenizer (see module docstring)."""

    def __init__(
        self,
        *,
        kind: str,
        encode_fragments: Callable[[list[str]], list[list[int]]],
        piece: Callable[[int], bytes],
        special_tokens: dict[str, int],
        bos_id: int | None,
        eos_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        whole_text: bool = False,
        cache_bytes: int = _DEFAULT_CACHE_BYTES,
    ) -> None:
        self.kind = kind
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.special_tokens = dict(special_tokens)
        self._encode_fragments = encode_fragments
        self._piece = piece
        # whole_text: specials that strip neighbouring whitespace (llama.cpp's lstrip/rstrip
        # attributes) make fragments depend on each other, so such models are not split here.
        self._whole_text = whole_text
        self._splitter = _SpecialSplitter(self.special_tokens)
        self._cache = _LRU(cache_bytes)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, specials parsed, no BOS added."""
        ids: list[int] = []
        for segment in self.encode_segments(text):
            ids.extend(segment.ids)
        return ids

    def encode_segments(self, text: str, start: int = 0) -> list[Segment]:
        """``text`` as consecutive segments: special tokens and the fragments between them;
        from `start` on, which must be a special token's end in a text split before
        (`reusable_segments`)."""
        if self._whole_text:
            assert start == 0
            if not text:
                return []
            return [Segment(0, len(text), tuple(self._encode_fragments([text])[0]), False)]
        pieces = self._splitter.split(text, start)
        found: dict[str, tuple[int, ...]] = {}
        missing: list[str] = []
        for start, end, sid in pieces:
            if sid is None:
                fragment = text[start:end]
                if fragment in found:
                    continue
                cached = self._cache.get(fragment)
                if cached is None:
                    missing.append(fragment)
                    found[fragment] = ()
                else:
                    found[fragment] = cached
        if missing:
            for fragment, ids in zip(missing, self._encode_fragments(missing), strict=True):
                found[fragment] = tuple(ids)
                self._cache.put(fragment, found[fragment])
        return [
            Segment(start, end, (sid,), True)
            if sid is not None
            else Segment(start, end, found[text[start:end]], False)
            for start, end, sid in pieces
        ]

    def reusable_segments(self, segments: Sequence[Segment], equal: int) -> int:
        """How many leading `segments` of a text are the segments of any text equal to it in
        its first `equal` characters: up to a special token that ends far enough before them
        that no match the splitter tries there reads past them (0: none)."""
        if self._whole_text or not self._splitter.resumable:
            return 0
        limit = equal - self._splitter.longest
        k = bisect_right(segments, limit, key=lambda s: s.end)  # those ending by the limit
        while k > 0 and not segments[k - 1].special:
            k -= 1
        return k

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens rendered as their text; invalid UTF-8 is replaced."""
        piece = self._piece
        return b"".join(piece(i) for i in ids).decode("utf-8", "replace")

    def token_positions(
        self, text: str, segments: Sequence[Segment], offsets: Sequence[int]
    ) -> list[int]:
        """Map character offsets of ``text`` to token positions in ``segments``' ids.

        An offset at a segment edge maps exactly; inside a fragment it maps to the number of
        tokens that end at or before it (aligned down, never into a token that spans it).
        """
        starts = [s.start for s in segments]
        first_token: list[int] = []
        n = 0
        for s in segments:
            first_token.append(n)
            n += len(s.ids)
        positions = []
        for offset in offsets:
            k = bisect_right(starts, offset) - 1
            if k < 0:
                positions.append(0)
                continue
            seg = segments[k]
            if offset >= seg.end:  # past the last segment
                positions.append(first_token[k] + len(seg.ids))
            elif offset == seg.start or seg.special:
                positions.append(first_token[k])
            else:
                positions.append(first_token[k] + self._tokens_before(text, seg, offset))
        return positions

    def _tokens_before(self, text: str, seg: Segment, offset: int) -> int:
        target = len(text[seg.start : offset].encode("utf-8"))
        n_bytes = 0
        for count, token_id in enumerate(seg.ids):
            n_bytes += len(self._piece(token_id))
            if n_bytes > target:
                return count
        return len(seg.ids)

    @property
    def cached_fragments(self) -> int:
        return len(self._cache)

    @property
    def cached_bytes(self) -> int:
        """What the fragment cache holds, about (bounded by ``cache_bytes``)."""
        return self._cache.size_bytes


# -- building ------------------------------------------------------------------------------------


def load_tokenizer(
    model_path: str,
    metadata: dict[str, Any],
    *,
    verify: bool = True,
    cache_bytes: int = _DEFAULT_CACHE_BYTES,
) -> Tokenizer:
    """The tokenizer of the GGUF at ``model_path`` (``metadata`` from ``gguf.read_metadata``).

    ``verify`` compares a HF-built tokenizer with llama.cpp once at load (about 0.3 s) and falls
    back to llama.cpp's tokenizer on any difference.
    """
    reason = _why_not_hf(metadata)
    if reason is None:
        tok = _build_hf_tokenizer(metadata, cache_bytes)
        if not verify:
            return tok
        try:
            reference = _build_llama_tokenizer(model_path, cache_bytes)
        except ImportError:
            log.info("llama_cpp is not importable; tokenizer not verified against llama.cpp")
            return tok
        reason = _first_difference(tok, reference)
        if reason is None:
            return tok
        log.warning("tokenizer: using llama.cpp's own tokenizer: built tokenizer %s", reason)
        return reference
    log.warning("tokenizer: using llama.cpp's own tokenizer: %s", reason)
    return _build_llama_tokenizer(model_path, cache_bytes)


def _why_not_hf(md: dict[str, Any]) -> str | None:
    model = md.get("tokenizer.ggml.model")
    pre = md.get("tokenizer.ggml.pre")
    if model != "gpt2":
        return f"tokenizer model {model!r} is not built here"
    if pre not in _PRE_REGEXES:
        return f"pre-tokenizer {pre!r} is not built here"
    if "tokenizer.ggml.tokens" not in md or "tokenizer.ggml.merges" not in md:
        return "the GGUF has no tokens or merges"
    name = str(md.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:  # llama.cpp strips whitespace after Phi-3 specials
        return "Phi-3 specials strip whitespace"
    return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _special_ids(md: dict[str, Any]) -> tuple[dict[str, int], frozenset[int], int | None]:
    """(special text -> id, end-of-generation ids, eos id), following llama.cpp's load()."""
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    token_to_id = {t: i for i, t in enumerate(tokens)}
    special_types = (_TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED)
    special = {i for i, t in enumerate(types) if t in special_types}

    def by_key_or_text(key: str, texts: Sequence[str]) -> int | None:
        value = md.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            return int(value)
        for text in texts:
            if text in token_to_id:
                special.add(token_to_id[text])  # llama.cpp forces these to control
                return token_to_id[text]
        return None

    eos = md.get("tokenizer.ggml.eos_token_id")
    eot = by_key_or_text("eot", _EOT_TEXTS)
    eom = by_key_or_text("eom", _EOM_TEXTS)
    fim = {name: by_key_or_text(f"fim_{name}", texts) for name, texts in _FIM_TEXTS.items()}
    eog = {fim["pad"], fim["rep"], fim["sep"]}
    for text in _EOG_TEXTS:
        if text in token_to_id:
            eog.add(token_to_id[text])
            special.add(token_to_id[text])
    eog |= {eos, eot, eom}
    eog.discard(None)
    ids_by_text = {tokens[i]: i for i in eog if i is not None and 0 <= i < len(tokens)}
    if {"<|return|>", "<|call|>", "<|end|>"} <= ids_by_text.keys():
        eog.discard(ids_by_text["<|end|>"])  # llama.cpp's o200k_harmony workaround
    for text in _ALWAYS_USER_DEFINED:
        if text in token_to_id:
            special.add(token_to_id[text])
    specials = {tokens[i]: i for i in sorted(special) if tokens[i]}
    # duplicated texts: llama.cpp's token_to_id keeps the last id
    specials = {t: token_to_id[t] for t in specials}
    return specials, frozenset(int(i) for i in eog if i is not None), eos


def _build_hf_tokenizer(md: dict[str, Any], cache_bytes: int) -> Tokenizer:
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens: list[str] = md["tokenizer.ggml.tokens"]
    pre = _PRE_REGEXES[md["tokenizer.ggml.pre"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for merge in md["tokenizer.ggml.merges"]:
        cut = merge.find(" ", 1)  # llama.cpp splits at the first space after position 0
        if cut < 0:
            continue
        left, right = merge[:cut], merge[cut + 1 :]
        # HF refuses merges whose parts or result are not tokens; llama.cpp could not emit
        # such a result either (it would fall back to the parts' bytes).
        if left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
    # Bytes without a token of their own: llama.cpp keeps them as symbols while merging (so they
    # separate their neighbours) and drops them from the output; HF would drop them before
    # merging. Placeholder ids past the vocabulary make HF keep them; they are filtered out.
    n_vocab = len(tokens)
    unmapped = [ch for ch in _bytes_to_unicode().values() if ch not in vocab]
    vocab.update({ch: n_vocab + k for k, ch in enumerate(unmapped)})
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    specials, eog, eos = _special_ids(md)
    # Specials are split out before fragments reach HF; they are registered anyway so that HF
    # alone would split the same way.
    from tokenizers import AddedToken

    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
    special_ids = set(specials.values())
    pieces = [
        t.encode("utf-8")
        if i in special_ids
        else b"".join(bytes((byte_of[c],)) if c in byte_of else c.encode("utf-8") for c in t)
        for i, t in enumerate(tokens)
    ]

    def batch_of(tokenizer: HFTokenizer) -> Callable[[list[str]], list[list[int]]]:
        # without character offsets, which nothing here reads: a third less work
        batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

        def encode(texts: list[str]) -> list[list[int]]:
            out = [e.ids for e in batch(texts, add_special_tokens=False)]
            if unmapped:
                out = [
                    [i for i in ids if i < n_vocab] if max(ids, default=0) >= n_vocab else ids
                    for ids in out
                ]
            return out

        return encode

    encode_fragments = batch_of(hf)
    # the same BPE fed pre-tokens split here: only the byte mapping left to HF
    hf_words = HFTokenizer(model)
    hf_words.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False)
    words = _Words.build(pre.regexes, batch_of(hf_words))
    probe = [_PROBE[a:b] for a, b, sid in _SpecialSplitter(specials).split(_PROBE) if sid is None]
    if words is not None and words(probe) == encode_fragments(probe):
        encode_fragments = words
    elif words is not None:
        log.info("tokenizer: the pre-token path differs from HF's on the probe; not used")

    bos = md.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(
        kind="hf",
        encode_fragments=encode_fragments,
        piece=partial(_checked_piece, pieces),
        special_tokens=specials,
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        eog_ids=eog,
        add_bos=bool(md.get("tokenizer.ggml.add_bos_token", pre.add_bos)),
        cache_bytes=cache_bytes,
    )


def _checked_piece(pieces: list[bytes], token_id: int) -> bytes:
    if not 0 <= token_id < len(pieces):
        raise ValueError(f"token id {token_id} is outside the vocabulary (0..{len(pieces) - 1})")
    return pieces[token_id]


def _build_llama_tokenizer(model_path: str, cache_bytes: int) -> Tokenizer:
    import ctypes

    import llama_cpp

    llama = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    specials: dict[str, int] = {}
    strips = False
    eog: set[int] = set()
    for i in range(n_vocab):
        attr = llama_cpp.llama_vocab_get_attr(vocab, i)
        if attr & _ATTR_SPECIAL:
            text = llama_cpp.llama_vocab_get_text(vocab, i).decode("utf-8", "replace")
            if text:
                specials[text] = i
            strips |= bool(attr & (_ATTR_LSTRIP | _ATTR_RSTRIP))
        if llama_cpp.llama_vocab_is_eog(vocab, i):
            eog.add(i)
    pieces: dict[int, bytes] = {}
    buf = ctypes.create_string_buffer(256)
    lock = threading.Lock()

    def piece(token_id: int) -> bytes:
        cached = pieces.get(token_id)
        if cached is None:
            if not 0 <= token_id < n_vocab:  # llama.cpp would abort the process
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary (0..{n_vocab - 1})"
                )
            with lock:
                n = llama_cpp.llama_token_to_piece(vocab, token_id, buf, len(buf), 0, True)
                cached = buf.raw[: max(n, 0)]
            pieces[token_id] = cached
        return cached

    def encode_fragments(fragments: list[str]) -> list[list[int]]:
        return [llama.tokenize(f.encode("utf-8"), add_bos=False, special=True) for f in fragments]

    def positive(token_id: int) -> int | None:
        return token_id if token_id >= 0 else None

    return Tokenizer(
        kind="llama",
        encode_fragments=encode_fragments,
        piece=piece,
        special_tokens=specials,
        bos_id=positive(llama_cpp.llama_vocab_bos(vocab)),
        eos_id=positive(llama_cpp.llama_vocab_eos(vocab)),
        eog_ids=frozenset(eog),
        add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        whole_text=strips,
        cache_bytes=cache_bytes,
    )


def _first_difference(tok: Tokenizer, ref: Tokenizer) -> str | None:
    """Describe the first way ``tok`` differs from llama.cpp's ``ref``, or None."""
    if tok.special_tokens != ref.special_tokens:
        extra = sorted(tok.special_tokens.keys() - ref.special_tokens.keys())[:5]
        missing = sorted(ref.special_tokens.keys() - tok.special_tokens.keys())[:5]
        return f"differs in special tokens (extra {extra}, missing {missing})"
    for name in ("bos_id", "eos_id", "eog_ids", "add_bos"):
        mine, theirs = getattr(tok, name), getattr(ref, name)
        if mine != theirs:
            return f"differs in {name}: {mine!r} vs llama.cpp {theirs!r}"
    mine_ids, ref_ids = tok.encode(_PROBE), ref._encode_fragments([_PROBE])[0]  # whole text
    if mine_ids != ref_ids:
        at = next(
            (i for i, (a, b) in enumerate(zip(mine_ids, ref_ids, strict=False)) if a != b),
            min(len(mine_ids), len(ref_ids)),
        )
        return (
            f"tokenizes the probe text differently from token {at}: "
            f"{mine_ids[at : at + 4]} vs llama.cpp {ref_ids[at : at + 4]}"
        )
    return None
