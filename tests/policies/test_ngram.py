"""policies.ngram: llama.cpp's n-gram drafters, the same drafts from the same tokens. Exact tables
(their answers are llama.cpp's own, from tests/policies/ngram_harness.cpp), and llama.cpp's C++
itself driven over generated token streams beside ours, step for step, where a C++ compiler and
llama.cpp's sources are at hand (`make fixtures` unpacks them)."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from policies import ngram
from policies.ngram import Drafter, NgramMap, NgramMod, NgramSimple
from tests.conftest import ROOT
from tests.proxy.test_llama_options import llama_cpp_source

A = [1, 2, 3, 4, 5, 1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 9, 7, 1, 2, 3]


def steps(d: Drafter, tokens: list[int], prompt: int) -> list[list[int]]:
    """The drafts at each step after the prompt: the context t[:cur], the sampled t[cur]; after
    a draft, (cur * 7) % (len + 1) of it accepted (as the harness does)."""
    a = np.asarray(tokens, dtype=np.intc)
    d.begin(a[:prompt])
    out = []
    for cur in range(prompt, len(tokens)):
        draft = d.draft(a[:cur], tokens[cur])
        out.append(draft)
        if draft:
            d.accept((cur * 7) % (len(draft) + 1))
    return out


CASES: list[tuple[str, Drafter, list[list[int]]]] = [
    # the last 2 tokens' latest earlier occurrence, and the 3 after it; none where fewer than
    # size_n follow it
    ("ngram-simple n=2 m=3", NgramSimple(2, 3), [
        [5, 1, 2], [], [], [3, 4, 9], [4, 9, 1], [9, 1, 2], [1, 2, 3], [], [], [3, 4, 5],
        [4, 5, 6], [5, 6, 1], [1, 2, 3], [], [], [3, 4, 9], [4, 9, 7]]),
    # the key map holds each n-gram's first position; a draft as long as the last accepted
    ("ngram-map-k n=2 m=3", NgramMap(2, 3, True, 1), [
        [5, 1, 2], [], [], [], [4, 5, 1], [], [], [], [], [3, 4, 5], [], [], [], [], [],
        [3, 4, 5], []]),
    ("ngram-map-k4v n=2 m=3", NgramMap(2, 3, False, 1), [
        [5, 1, 2], [], [], [], [4, 5, 1], [], [], [], [], [3, 4, 5], [], [], [], [], [],
        [3, 4, 5], []]),
    # two hits of a key before its m-grams count
    ("ngram-map-k4v n=2 m=2 min_hits=2", NgramMap(2, 2, False, 2), [
        [], [], [], [], [], [5, 1], [], [], [], [], [4, 5], [5], [], [], [], [3, 4], []]),
    # next-token chains through the hashed table, at least n_min long
    ("ngram-mod n=2 min=1 max=4", NgramMod(2, 1, 4), [
        [5, 1, 2, 3], [], [], [3, 4, 5, 1], [4, 5, 1, 2], [5, 1, 2, 3], [1, 2, 3, 4], [], [],
        [3, 4, 5, 1], [4, 5, 1, 2], [5, 1, 2, 3], [], [], [], [3, 4, 5, 1], [4, 5, 1, 2]]),
    ("ngram-mod n=3 min=3 max=5", NgramMod(3, 3, 5), [
        [5, 1, 2, 3, 4], [], [], [], [4, 5, 1, 2, 3], [5, 1, 2, 3, 4], [1, 2, 3, 4, 5], [], [],
        [], [4, 5, 1, 2, 3], [5, 1, 2, 3, 4], [], [], [], [], [4, 5, 1, 2, 3]]),
]


@pytest.mark.parametrize(("why", "drafter", "want"), CASES, ids=[c[0] for c in CASES])
def test_drafts(why: str, drafter: Drafter, want: list[list[int]]) -> None:
    assert steps(drafter, A, 8) == want


def test_the_last_match_is_the_last_whole_token_match() -> None:
    # tokens whose bytes also match across two tokens' edge (256 = bytes 00 01 00 00): such a
    # hit is skipped, as every test of whole tokens would
    rng = np.random.default_rng(3)
    for _ in range(300):
        a = rng.choice(np.asarray([0, 1, 256, 65536, 1 << 24], dtype=np.intc), 40)
        key = [int(t) for t in a[rng.integers(0, 37):][:rng.integers(1, 4)]]
        lo, hi = int(rng.integers(0, 20)), int(rng.integers(0, 40 - len(key)))
        want = max((j for j in range(lo, hi + 1) if a[j:j + len(key)].tolist() == key),
                   default=0)
        assert ngram._last_match(a, key, lo, hi) == want, (a.tolist(), key, lo, hi)


def test_ngram_mod_empties_its_table_after_five_low_rounds() -> None:
    d = NgramMod(2, 1, 4)
    d.begin(np.asarray(A, dtype=np.intc))
    context = np.asarray(A, dtype=np.intc)
    first = d.draft(context, 4)
    assert len(first) == 4
    d.accept(1)  # a quarter: not low
    for _ in range(4):
        assert d.draft(context, 4) == first
        d.accept(0)
    assert d.table
    assert d.draft(context, 4) == first
    d.accept(0)  # the fifth in a row under a quarter
    assert not d.table and d.i_last == 0


def test_defaults_are_llama_cpps() -> None:
    p = ngram.NgramParams()
    assert (p.simple_size_n, p.simple_size_m, p.map_k_size_n, p.map_k4v_size_m) == (12, 48, 12, 48)
    assert (p.mod_n_match, p.mod_n_min, p.mod_n_max) == (24, 48, 64)
    assert [ngram.n_max(t, p) for t in ngram.NGRAM_TYPES] == [48, 48, 48, 64]


# --- llama.cpp's own code, side by side ---------------------------------------------------------

STUBS = {  # what ngram-map.cpp and ngram-mod.cpp include of llama.cpp's common library
    "common.h": "#pragma once\n#include <vector>\n#include <cstdint>\n#include <cstdio>\n"
                "#include <cstdlib>\n#include <string>\ntypedef std::vector<int32_t> llama_tokens;"
                "\ntypedef int32_t llama_token;\n#define GGML_ABORT(...) do { fprintf(stderr, "
                "__VA_ARGS__); abort(); } while (0)\n",
    "llama.h": "#pragma once\n",
    "log.h": "#pragma once\n#define LOG_DBG(...) do {} while (0)\n#define LOG_INF(...) do {} "
             "while (0)\n",
}
SOURCES = ("ngram-map.cpp", "ngram-map.h", "ngram-mod.cpp", "ngram-mod.h")


def _harness(tmp: Path) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++")
    src = llama_cpp_source("common/ngram-map.cpp")
    if compiler is None or src is None:
        pytest.skip("needs a C++ compiler and llama.cpp's common/ngram-*.cpp (`make fixtures` "
                    "unpacks them into build/fixtures/llama.cpp/common)")
    for f in SOURCES:
        shutil.copy(src.parent / f, tmp / f)
    for f, text in STUBS.items():
        (tmp / f).write_text(text)
    shutil.copy(ROOT / "tests/policies/ngram_harness.cpp", tmp / "main.cpp")
    subprocess.run([compiler, "-O1", "-std=c++17", "-I.", "main.cpp", "ngram-map.cpp",
                    "ngram-mod.cpp", "-o", "ng"], cwd=tmp, check=True, capture_output=True)
    return tmp / "ng"


def _stream(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Tokens that repeat themselves as answers do: copied runs, some with one token changed."""
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.6:
            s = rng.randrange(len(out))
            chunk = list(out[s:s + rng.randrange(3, 60)])
            if chunk and rng.random() < 0.3:
                chunk[rng.randrange(len(chunk))] = rng.randrange(vocab)
            out += chunk
        else:
            out += [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
    return out[:n]


def test_the_drafts_are_llama_cpps_own(tmp_path: Path) -> None:
    binary = _harness(tmp_path)
    rng = random.Random(47)
    compared = drafted = 0
    for _ in range(40):
        tokens = _stream(rng, rng.randrange(50, 600), rng.choice([3, 5, 20, 200]))
        prompt = rng.randrange(1, len(tokens))
        n, m = rng.randrange(1, 6), rng.randrange(1, 20)
        for kind, a, b, c, ours in (
                ("simple", n, m, 1, NgramSimple(n, m)),
                ("k", n, m, 1, NgramMap(n, m, True, 1)),
                ("k4v", n, m, 2, NgramMap(n, m, False, 2)),
                ("mod", n + 1, min(m, 5), 5 + m, NgramMod(n + 1, min(m, 5), 5 + m))):
            lines = [f"{kind} {a} {b} {c}", f"{len(tokens)} {' '.join(map(str, tokens))}",
                     str(prompt), str(len(tokens) - prompt),
                     *(f"{cur} {tokens[cur]}" for cur in range(prompt, len(tokens)))]
            out = subprocess.run([binary], input="\n".join(lines) + "\n", capture_output=True,
                                 text=True, check=True).stdout.split("\n")
            want = [[int(t) for t in line.split()[1:]] for line in out if line.strip()]
            got = steps(ours, tokens, prompt)
            assert got == want, f"{kind} n={a} m={b}: first differs at step " \
                f"{next(i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)}"
            compared += len(want)
            drafted += sum(1 for d in want if d)
    assert drafted > compared // 4, "too few drafts to compare"
