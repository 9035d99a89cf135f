"""The tokenizer's fragment cache is bounded by bytes, not entries: a stream of large prompts
(rejected ones included: every prompt is tokenized before its length is checked) leaves at most
the bound behind, measured with tracemalloc, and what it keeps is what a fresh tokenizer
computes. The real default model's tokenizer; no mocks."""

from __future__ import annotations

import gc
import random
import tracemalloc
from typing import Any

import pytest

from proxy.config import default_model
from proxy.fragments import FragmentCache, entry_bytes
from proxy.gguf import read_metadata
from proxy.tokenizer import Tokenizer, load_tokenizer

MODEL = default_model()
WORDS = ["cache", "prefix", "token", "def", "return", "日本語", "🙂", "x = 1", "\n", "    "]


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    return read_metadata(MODEL)


def tokenizer(metadata: dict[str, Any], cache_bytes: int) -> Tokenizer:
    return load_tokenizer(MODEL, metadata, verify=False, cache_bytes=cache_bytes)


def prompt(seed: int, n_messages: int, message_chars: int) -> str:
    """A ChatML conversation of distinct messages: specials split it into fragments."""
    rng = random.Random(seed)
    parts = []
    for i in range(n_messages):
        words: list[str] = []
        n_chars = 0
        while n_chars < message_chars:
            words.append(rng.choice(WORDS))
            n_chars += len(words[-1]) + 1
        parts.append(f"<|im_start|>user\n{seed}:{i} {' '.join(words)}<|im_end|>\n")
    return "".join(parts)


def test_lru_keeps_the_most_recently_used_within_the_bytes() -> None:
    ids = tuple(range(1000, 1100))
    key = {name: name * 500 for name in "abcde"}  # the same size each
    one = entry_bytes(key["a"], ids)
    lru = FragmentCache(max_bytes=4 * one + one // 2)  # room for four
    for name in "abcd":
        lru.put(key[name], ids)
    assert (len(lru), lru.size_bytes) == (4, 4 * one)
    assert lru.get(key["a"]) == ids  # used: now the most recent
    lru.put(key["e"], ids)  # b is the least recently used: out
    assert lru.get(key["b"]) is None
    assert [lru.get(key[n]) is not None for n in "acde"] == [True] * 4
    assert lru.size_bytes == 4 * one

    lru.put(key["c"], ids[:10])  # replaced: its bytes are recounted
    assert lru.size_bytes == 3 * one + entry_bytes(key["c"], ids[:10])
    huge = "h" * (lru.max_bytes // 4)  # bigger than a quarter of the bound: not kept
    lru.put(huge, ids)
    assert lru.get(huge) is None and len(lru) == 4


def test_the_default_bound_is_64_mib(metadata: dict[str, Any]) -> None:
    assert load_tokenizer(MODEL, metadata, verify=False)._cache.max_bytes == 64 << 20


def test_large_prompts_leave_at_most_the_bound_behind(metadata: dict[str, Any]) -> None:
    bound = 2 << 20
    tok = tokenizer(metadata, cache_bytes=bound)
    texts = [prompt(seed, n_messages=100, message_chars=2000) for seed in range(12)]  # 200 KB
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for text in texts:
            tok.encode(text)
            assert tok.cached_bytes <= bound
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # the accounting is honest and errs high: what stays allocated is at most about what the
    # cache counts (each id counted as its own int object: ids of a repeated word share theirs
    # with the pre-token memo, so the count is an upper bound) plus that memo
    assert 0.25 * tok.cached_bytes <= retained <= 1.25 * bound, (retained, tok.cached_bytes)
    assert tok.cached_bytes > 0.9 * bound  # full: older fragments were evicted
    # evicted or kept, the ids are those of a tokenizer that never saw the other prompts
    for text in (texts[0], texts[-1]):
        assert tok.encode(text) == tokenizer(metadata, cache_bytes=bound).encode(text)


def test_a_fragment_over_a_quarter_of_the_bound_is_not_kept(metadata: dict[str, Any]) -> None:
    tok = tokenizer(metadata, cache_bytes=1 << 20)
    small = prompt(1, n_messages=20, message_chars=200)
    tok.encode(small)
    kept = tok.cached_fragments
    one_big_message = prompt(2, n_messages=1, message_chars=100_000)  # ~2.5 MiB as ids
    assert tok.encode(one_big_message) == tokenizer(metadata, 1 << 20).encode(one_big_message)
    assert tok.cached_fragments == kept  # "\n" after <|im_end|> was cached; the body is not kept
    assert tok.cached_bytes <= 1 << 20
