"""Token ids are the cache's keys, so prefixgate's must be llama.cpp's, for every vocabulary
llama.cpp ships (issue 11). Fixtures: llama.cpp's vocabulary-only GGUFs and their test corpora
(``models/ggml-vocab-*.gguf`` with ``.inp``/``.out``, from llama.cpp's test-tokenizer-0), taken from
the llama-cpp-python sdist by ``make fixtures``.

For each vocabulary: the tokenizer prefixgate loads (a HF ``tokenizers`` build where it mirrors
llama.cpp, else llama.cpp's own) gives llama.cpp's ids on every corpus text, with special tokens
parsed; and so does the HF build alone wherever prefixgate builds one, so that the load-time
check is not what keeps a wrong id out.
"""

from __future__ import annotations

import logging
from pathlib import Path

import llama_cpp
import pytest

from proxy.gguf import read_metadata
from proxy.tokenizer import _PROBE, Tokenizer, load_tokenizer
from tests.models import LLAMA_CPP_MODELS

pytestmark = pytest.mark.model

VOCABS = sorted(LLAMA_CPP_MODELS.glob("ggml-vocab-*.gguf"))
SEP = "\n__ggml_vocab_test__\n"

# what agents send: chat specials glued to text, code, JSON tool schemas, paths, long runs
AGENT_TEXTS = (
    "<|im_start|>system\nYou are Claude Code.<|im_end|>\n<|im_start|>user\nfix it<|im_end|>\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|start_header_id|>user<|end_header_id|>\n\nls -la<|eot_id|>",
    '{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object", '
    '"properties": {"command": {"type": "string"}}, "required": ["command"]}}}',
    "def f(x):\n\treturn x ** 2  # square\n\n\n    if x >= 10_000:\n        raise ValueError\n",
    "/home/user/project/src/main.rs:42:17: error[E0308]: mismatched types",
    "   leading spaces, trailing spaces   \n\n\n\r\n" + "=" * 80 + " " * 33 + "\u00a0\u3000x",
    "Straße 日本語のテキスト 한국어 Ελληνικά עברית مرحبا 🙂🚀 e\u0301 1234567890 3.14159",
)


def corpus(vocab: Path) -> list[str]:
    inp = vocab.with_name(vocab.name + ".inp")
    texts = inp.read_text().split(SEP) if inp.exists() else []
    return [*texts, _PROBE, *AGENT_TEXTS]


def llama_ids(ref: llama_cpp.Llama, text: str) -> list[int]:
    return list(ref.tokenize(text.encode(), add_bos=False, special=True))


def first_difference(tok: Tokenizer, ref: llama_cpp.Llama, texts: list[str]) -> str | None:
    for text in texts:
        ours, theirs = tok.encode(text), llama_ids(ref, text)
        if ours != theirs:
            i = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                     min(len(ours), len(theirs)))
            return f"{text[:60]!r}: first difference at {i}: {ours[i:i + 4]} != {theirs[i:i + 4]}"
    return None


def test_every_vocabulary_llama_cpp_ships_is_here() -> None:
    assert len(VOCABS) >= 19, "make fixtures extracts llama.cpp's models/ggml-vocab-*.gguf"
    assert {"ggml-vocab-qwen35.gguf", "ggml-vocab-gemma-4.gguf"} <= {v.name for v in VOCABS}


@pytest.mark.parametrize("vocab", VOCABS, ids=lambda p: p.name[len("ggml-vocab-"):-5])
def test_token_ids_equal_llama_cpps(vocab: Path) -> None:
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    ref = llama_cpp.Llama(str(vocab), vocab_only=True, verbose=False)
    texts = corpus(vocab)
    out = vocab.with_name(vocab.name + ".out")
    if out.exists():  # the reference itself: llama.cpp's recorded ids (specials not parsed)
        recorded = [[int(t) for t in line.split()] for line in out.read_text().splitlines()]
        inputs = texts[: len(recorded)]
        assert [list(ref.tokenize(t.encode(), add_bos=False, special=False))
                for t in inputs] == recorded
    md = read_metadata(str(vocab))
    loaded = load_tokenizer(str(vocab), md)
    assert first_difference(loaded, ref, texts) is None
    built = load_tokenizer(str(vocab), md, verify=False)  # the HF build, where there is one
    assert first_difference(built, ref, texts) is None
