"""Tokenize prompt text into the exact token ids llama.cpp would produce.

The contract: ``Tokenizer.encode(text)`` equals llama.cpp's
``llama_tokenize(text, add_special=False, parse_special=True)`` for the same model file. Token ids
are the cache's currency, so a single differing id is a cache miss at best.

How llama.cpp tokenizes, and how this module mirrors it:

1. **Specials first.** Every token whose attribute is control, user-defined or unknown is matched
   literally in the text, longest token text first, and carved out as a single id. The raw text
   between them is tokenized fragment by fragment, each on its own. ``SpecialSplitter`` (in
   proxy/fragments.py, as the other parts named here) does the same split: one regex pass when
   no two special texts can partially overlap, else llama.cpp's token-by-token carving.
2. **Fragments.** For BPE ("gpt2") vocabularies with a known ``tokenizer.ggml.pre``, a HF
   ``tokenizers`` BPE model is built from the GGUF's own tokens and merges, with llama.cpp's
   pre-tokenizer regexes for that pre type (``PRE_REGEXES``) as isolated splits followed by the
   GPT-2 byte mapping. Fragments are not handed to HF whole: the same regexes run here
   (``Words``, the ``regex`` module) and each distinct pre-token goes to HF's BPE once and is
   remembered, which costs a third to a half of HF's own splitting on new text; this path is
   used only where it gives HF's ids on the probe. Anything else (SPM "llama", WPM, UGM,
   unknown pre types, models whose specials strip whitespace) uses llama.cpp's own tokenizer
   through ``llama_cpp.Llama(..., vocab_only=True)``, with one warning line.
3. **Per-fragment cache.** Because the split on specials comes first, tokenizing fragment by
   fragment and concatenating equals tokenizing the whole text. Fragment ids are kept in an LRU
   keyed on the fragment text, bounded by bytes (``FragmentCache``: its bound and why).

Verify before trust: ``load_tokenizer`` compares the built tokenizer with llama.cpp (special set,
end-of-generation ids, BOS/EOS, ids of a probe text) when ``llama_cpp`` is importable; any
difference logs one warning naming it and falls back to llama.cpp's tokenizer.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from proxy.fragments import (
    PRE_REGEXES,
    FragmentCache,
    SpecialSplitter,
    Words,
    bytes_to_unicode,
)

log = logging.getLogger(__name__)

__all__ = ["Segment", "Tokenizer", "load_tokenizer"]

# GGUF token types (gguf.TokenType) and llama.cpp token attributes (llama_token_attr).
_TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED = 2, 3, 4
_ATTR_UNKNOWN, _ATTR_CONTROL, _ATTR_USER_DEFINED = 1 << 0, 1 << 3, 1 << 4
_ATTR_LSTRIP, _ATTR_RSTRIP = 1 << 7, 1 << 8
_ATTR_SPECIAL = _ATTR_UNKNOWN | _ATTR_CONTROL | _ATTR_USER_DEFINED

_DEFAULT_CACHE_BYTES = 64 << 20
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
        self._splitter = SpecialSplitter(self.special_tokens)
        self._cache = FragmentCache(cache_bytes)

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
    overrides: dict[str, Any] | None = None,
) -> Tokenizer:
    """The tokenizer of the GGUF at ``model_path`` (``metadata`` from ``gguf.read_metadata``,
    with ``overrides``, --override-kv's values by key, applied: llama.cpp's reads them too).
    ``verify`` compares a HF-built tokenizer with llama.cpp once at load (about 0.3 s) and falls
    back to llama.cpp's tokenizer on any difference."""
    reason = _why_not_hf(metadata)
    if reason is None:
        tok = _build_hf_tokenizer(metadata, cache_bytes)
        if not verify:
            return tok
        try:
            reference = _build_llama_tokenizer(model_path, cache_bytes, overrides)
        except ImportError:
            log.info("llama_cpp is not importable; tokenizer not verified against llama.cpp")
            return tok
        reason = _first_difference(tok, reference)
        if reason is None:
            return tok
        log.warning("tokenizer: using llama.cpp's own tokenizer: built tokenizer %s", reason)
        return reference
    log.warning("tokenizer: using llama.cpp's own tokenizer: %s", reason)
    return _build_llama_tokenizer(model_path, cache_bytes, overrides)


def _why_not_hf(md: dict[str, Any]) -> str | None:
    model = md.get("tokenizer.ggml.model")
    pre = md.get("tokenizer.ggml.pre")
    if model != "gpt2":
        return f"tokenizer model {model!r} is not built here"
    if pre not in PRE_REGEXES:
        return f"pre-tokenizer {pre!r} is not built here"
    if "tokenizer.ggml.tokens" not in md or "tokenizer.ggml.merges" not in md:
        return "the GGUF has no tokens or merges"
    name = str(md.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:  # llama.cpp strips whitespace after Phi-3 specials
        return "Phi-3 specials strip whitespace"
    return None


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
    pre = PRE_REGEXES[md["tokenizer.ggml.pre"]]
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
    unmapped = [ch for ch in bytes_to_unicode().values() if ch not in vocab]
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

    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
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
    words = Words.build(pre.regexes, batch_of(hf_words))
    probe = [_PROBE[a:b] for a, b, sid in SpecialSplitter(specials).split(_PROBE) if sid is None]
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


def _build_llama_tokenizer(model_path: str, cache_bytes: int, overrides: Any = None) -> Tokenizer:
    import ctypes

    import llama_cpp

    llama = llama_cpp.Llama(model_path, vocab_only=True, verbose=False, kv_overrides=overrides)
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
