"""The engine on each kind of memory (issue 11): plain attention, a real sliding window, a hybrid
recurrent state. Real models in this process: exactness of every reuse path (live, a snapshot
restored after a restart), a cut the memory refuses, and snapshots taken between prefill
segments."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp
import pytest

from backend.engine import Cancel, Engine, Sampling
from tests.models import FLASH_ATTN, GPU_LAYERS, MEMORY, MODELS, model_file

pytestmark = pytest.mark.model

N_CTX = 2048
GEN = 12  # greedy tokens compared


def _ids(name: str, n: int, seed: int) -> list[int]:
    """n token ids of real text in this model's vocabulary (tokenized by llama.cpp)."""
    vocab = llama_cpp.Llama(model_file(name), vocab_only=True, verbose=False)
    words = [f"{w}{(i * 7919 + seed) % 97}" for i, w in enumerate(
        "the cache keeps every prefix exact so a restored state answers like a cold one".split()
        * 200)]
    ids = vocab.tokenize(" ".join(words).encode(), add_bos=False)
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module", params=MODELS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _engine(name: str, **kw: object) -> Engine:
    return Engine(model_file(name), N_CTX, 2, GPU_LAYERS, flash_attn=FLASH_ATTN,
                  **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engines(name: str) -> Iterator[tuple[Engine, Engine]]:
    """Two engines of one model: the one that serves, and a fresh one for cold references."""
    a, b = _engine(name), _engine(name)
    yield a, b
    a.close()
    b.close()


def _answer(eng: Engine, ids: list[int], stops: list[int] = (), on_stop=None) -> list[int]:
    eng.prefill(ids, list(stops), on_stop or (lambda p: None), Cancel())
    return [t for t, _, _ in eng.generate(Sampling(temperature=0), GEN, Cancel())]


def _cold(eng: Engine, ids: list[int]) -> list[int]:
    eng.truncate(0)
    return _answer(eng, ids)


def test_the_engine_knows_its_memory(name: str, engines: tuple[Engine, Engine]) -> None:
    eng = engines[0]
    assert eng.memory.kind == MEMORY[name]
    if name == "gemma3":  # a full-size window cache by default
        assert (eng.memory.n_swa, eng.memory.full) == (512, True)
        window = _engine(name, swa_full=False)
        assert (window.memory.kind, window.memory.n_swa, window.memory.full) == \
            ("window", 512, False)
        window.close()


def test_live_and_restored_hits_equal_cold_runs(name: str, engines: tuple[Engine, Engine]
                                                ) -> None:
    """A conversation's second turn extends its first: live reuse, then the same from a snapshot
    at the first turn's end restored into a fresh state, then a third prompt that diverges far
    inside the live sequence (past any window) restored from a snapshot at the divergence."""
    eng, ref = engines
    first = _ids(name, 900, seed=1)
    second = first + _ids(name, 200, seed=2)
    snaps: dict[int, memoryview] = {}
    eng.truncate(0)
    assert _answer(eng, first, [300, 900], lambda p: snaps.__setitem__(p, eng.snapshot())) \
        == _cold(ref, first)
    cold_second = _cold(ref, second)

    kept = eng.live_prefix(second)
    if MEMORY[name] == "recurrent":
        assert kept == 0, "generated tokens moved the recurrent state past the prompt"
    else:
        assert kept == len(first)
    assert eng.truncate(kept) == kept
    assert _answer(eng, second) == cold_second, "live hit"

    eng.restore(second[:900], snaps[900])
    assert eng.n_live == 900
    assert _answer(eng, second) == cold_second, "restored hit"

    # diverges at 300, far behind the live end; the window's cache restored at 900 holds only
    # positions 388-899 of the window layers: it cannot be cut back to 300 either
    third = first[:300] + _ids(name, 500, seed=3)
    kept = eng.live_prefix(third)
    assert kept == (300 if MEMORY[name] == "plain" else 0)
    eng.truncate(kept)
    if kept == 0:
        eng.restore(third[:300], snaps[300])
    assert _answer(eng, third) == _cold(ref, third), "diverging far inside the live sequence"


def test_a_cut_the_memory_refuses_never_leaves_a_wrong_state(name: str,
                                                             engines: tuple[Engine, Engine]
                                                             ) -> None:
    eng, ref = engines
    prompt = _ids(name, 1800, seed=4)  # a window's cache (window + batch) holds 1024 of them
    eng.truncate(0)
    eng.prefill(prompt, [], lambda p: None, Cancel())
    floor = eng.floor()
    kept = eng.truncate(100)
    mem = llama_cpp.llama_get_memory(eng.ctx)
    if MEMORY[name] == "recurrent":
        assert (floor, kept) == (1800, 0), "cutting back inside a recurrent state is refused"
    else:  # plain, or a full-size window cache that computed every position itself
        assert (floor, kept) == (0, 100)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == kept - 1
    other = prompt[:100] + _ids(name, 300, seed=5)
    assert _answer(eng, other) == _cold(ref, other)


def test_snapshots_between_segments_hold_exactly_their_position(
        name: str, engines: tuple[Engine, Engine]) -> None:
    """A snapshot at p restores to a state at exactly p (KV and recurrent state): the answer
    from there equals a cold run, at a segment edge, a batch edge and one past it."""
    eng, ref = engines
    prompt = _ids(name, 1100, seed=6)
    points = [257, 512, 513, 1000]
    snaps: dict[int, memoryview] = {}
    eng.truncate(0)
    _answer(eng, prompt, points, lambda p: snaps.__setitem__(p, eng.snapshot()))
    cold = _cold(ref, prompt)
    for p, state in snaps.items():
        eng.restore(prompt[:p], state)
        mem = llama_cpp.llama_get_memory(eng.ctx)
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == p - 1
        assert _answer(eng, prompt) == cold, f"restored at {p}"


def test_a_real_window_cuts_back_only_inside_it() -> None:
    """Gemma 3 with a real window (--no-swa-full): its cache holds the window and a batch (1024
    cells); behind that the state cannot be cut back, and a refused cut leaves it empty, never
    wrong. Within the window it cuts back like plain attention."""
    eng, ref = _engine("gemma3", swa_full=False), _engine("gemma3", swa_full=False)
    prompt = _ids("gemma3", 1800, seed=7)
    eng.prefill(prompt, [], lambda p: None, Cancel())
    assert eng.floor() > 1800 - 1024
    assert eng.live_prefix(prompt[:100] + [0] * 10) == 0
    assert eng.live_prefix(prompt[:1790] + [0] * 10) == 1790  # inside the window
    mem = llama_cpp.llama_get_memory(eng.ctx)
    assert eng.truncate(1790) == 1790
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == 1789
    assert eng.truncate(100) == 0, "behind the window: refused"
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == -1
    other = prompt[:100] + _ids("gemma3", 300, seed=8)
    assert _answer(eng, other) == _cold(ref, other)
    eng.close()
    ref.close()


def test_a_gpu_engine_reuses_only_at_batch_edges() -> None:
    """Where the kernels are not batch-invariant (a GPU: `align` = the batch size) the live reuse
    is rounded down to a batch edge and no batch is shortened to dodge a one-token one, so a hit
    runs the cold run's batches. Forced here on the CPU with 64-token batches."""
    eng = Engine(model_file("smollm2"), N_CTX, 2, 0, n_batch=64, align=64)
    ref = Engine(model_file("smollm2"), N_CTX, 2, 0, n_batch=64, align=64)
    assert Engine(model_file("smollm2"), 256, 2, 0).align == 1  # no GPU layers: anywhere
    prompt = _ids("smollm2", 300, seed=9)
    eng.prefill(prompt, [], lambda p: None, Cancel())
    other = prompt[:250] + _ids("smollm2", 60, seed=10)
    assert eng.live_prefix(other) == 192
    assert eng.truncate(192) == 192
    assert _answer(eng, other) == _cold(ref, other)
    snaps: dict[int, memoryview] = {}
    eng.truncate(0)
    batches: list[int] = []
    eng.prefill(prompt, [128, 256], lambda p: snaps.__setitem__(p, eng.snapshot()), Cancel(),
                batches.append)
    assert batches == [64, 128, 192, 256, 300]
    eng.restore(prompt[:256], snaps[256])
    assert _answer(eng, prompt) == _cold(ref, prompt)
    eng.close()
    ref.close()
