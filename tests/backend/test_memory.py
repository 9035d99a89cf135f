"""The engine on each kind of memory (issues 11 and 19): plain attention, a sliding window, a
hybrid recurrent state. Real models in this process: exactness of every reuse path (live, a
snapshot restored after a restart), state for state against a cold prefill at window, batch and
segment edges, a cut the memory refuses, and the batch-edge rule."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp
import numpy as np
import pytest

from backend import layout
from backend.engine import Engine
from backend.sampling import Sampling
from backend.worker.messages import Live, live_prefix
from tests.models import BATCH, FLASH_ATTN, GPU_LAYERS, MEMORY, MODELS, model_file

pytestmark = pytest.mark.model

# Lengths are in batches (A: 128 on a CPU, 512 with GPU layers; bench/gpu_check.sh): a snapshot
# sits at a batch edge, so a test's save points are too
A = BATCH
N_CTX = 32 * A
GEN = 12  # greedy tokens compared


def _ids(name: str, n: int, seed: int) -> list[int]:
    """n token ids of real text in this model's vocabulary (tokenized by llama.cpp)."""
    vocab = llama_cpp.Llama(model_file(name), vocab_only=True, verbose=False)
    words = [f"{w}{(i * 7919 + seed) % 97}" for i, w in enumerate(
        "the cache keeps every prefix exact so a restored state answers like a cold one".split()
        * 1600)]
    ids = vocab.tokenize(" ".join(words).encode(), add_bos=False)
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module", params=MODELS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _engine(name: str, **kw: object) -> Engine:
    return Engine(model_file(name), N_CTX, 2, GPU_LAYERS, flash_attn=FLASH_ATTN,
                  **{"n_batch": A, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engines(name: str) -> Iterator[tuple[Engine, Engine]]:
    """Two engines of one model: the one that serves, and a fresh one for cold references."""
    a, b = _engine(name), _engine(name)
    yield a, b
    a.close()
    b.close()


def _answer(eng: Engine, ids: list[int], stops: list[int] = (), on_stop=None) -> list[int]:
    eng.prefill(0, ids, list(stops), on_stop or (lambda p: None))
    return [t for t, _, _ in eng.generate(0, Sampling(temperature=0), GEN)]


def kept_live(eng: Engine, ids: list[int]) -> int:
    """What slot 0's live KV keeps of `ids`, as the worker's core computes it."""
    q = eng.seqs[0]
    return live_prefix(Live(q.ids, q.n_live, q.exact_n, eng.floor(0)),
                       np.asarray(ids, dtype=np.intc), eng.batching.edges(ids))


def _cold(eng: Engine, ids: list[int]) -> list[int]:
    eng.truncate(0, 0)
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


def _same_state(eng: Engine, ref: Engine) -> str | None:
    """None when `eng` holds exactly `ref`'s state (every KV cell and recurrent state, byte for
    byte) and the same last logits (bit for bit); else where they first differ."""
    sections = 2 if eng.memory.kind == "window" else 1
    where = layout.first_difference(ref.snapshot(0), eng.snapshot(0), sections)
    if where is None and eng.last_logits(0).tobytes() != ref.last_logits(0).tobytes():
        return "the KV is equal but the last logits differ"
    return where


def _prefill_cold(ref: Engine, ids: list[int]) -> None:
    ref.truncate(0, 0)
    ref.prefill(0, ids, [], lambda p: None)


def test_live_and_restored_hits_equal_cold_runs(name: str, engines: tuple[Engine, Engine]
                                                ) -> None:
    """A conversation's second turn extends its first: live reuse, then the same from a snapshot
    at the first turn's last batch edge restored into a fresh state, then a third prompt that
    diverges far inside the live sequence (past any window) restored from a snapshot there.
    Each compared with a cold prefill state for state, then by its greedy answer."""
    eng, ref = engines
    assert eng.batching.size == A
    near, far = 5 * A, 14 * A  # save points: 320 and 896 at 64
    first = _ids(name, far + 4, seed=1)
    second = first + _ids(name, 3 * A + 8, seed=2)
    snaps: dict[int, memoryview] = {}
    eng.truncate(0, 0)
    assert _answer(eng, first, [near, far], lambda p: snaps.__setitem__(p, eng.snapshot(0))) \
        == _cold(ref, first)
    assert sorted(snaps) == [near, far]
    cold_second = _cold(ref, second)

    kept = kept_live(eng, second)
    if MEMORY[name] == "recurrent":
        assert kept == 0, "generated tokens moved the recurrent state past the prompt"
    else:
        assert kept == far, "the live reuse ends at a batch edge"
    assert eng.truncate(0, kept) == kept
    assert _answer(eng, second) == cold_second, "live hit"

    eng.restore(0, second[:far], snaps[far])
    assert eng.seqs[0].n_live == far
    eng.prefill(0, second, [], lambda p: None)
    _prefill_cold(ref, second)
    assert _same_state(eng, ref) is None, "restored hit"

    # diverges at `near`, far behind the live end; the window's cache restored at `far` holds
    # only the window's last positions (384-895 at 64): it cannot be cut back to `near` either
    third = first[:near] + _ids(name, 8 * A - 12, seed=3)
    kept = kept_live(eng, third)
    assert kept == (near if MEMORY[name] == "plain" else 0)
    eng.truncate(0, kept)
    if kept == 0:
        eng.restore(0, third[:near], snaps[near])
    assert _answer(eng, third) == _cold(ref, third), "diverging far inside the live sequence"


def test_a_cut_the_memory_refuses_never_leaves_a_wrong_state(name: str,
                                                             engines: tuple[Engine, Engine]
                                                             ) -> None:
    eng, ref = engines
    n, cut = 28 * A + 8, 2 * A  # 1800 and 128 at 64
    prompt = _ids(name, n, seed=4)
    eng.truncate(0, 0)
    eng.prefill(0, prompt, [], lambda p: None)
    floor = eng.floor(0)
    kept = eng.truncate(0, cut)
    mem = llama_cpp.llama_get_memory(eng.ctx)
    if MEMORY[name] == "recurrent":
        assert (floor, kept) == (n, 0), "cutting back inside a recurrent state is refused"
    else:  # plain, or a full-size window cache that computed every position itself
        assert (floor, kept) == (0, cut)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == kept - 1
    other = prompt[:cut] + _ids(name, 5 * A - 20, seed=5)
    assert _answer(eng, other) == _cold(ref, other)


# Restore points: batch edges around the window's edge (Gemma 3: 512, at a batch of 64), the
# first batch edges, and others; prompt ends: a batch edge (from every point), one before and one
# past (the last batch partial, or of one token: from the window's edge and the last point), and
# one inside the window's reach (from the points around it). A restored state does not depend on
# the end it is extended to, so every point against every end (27 extensions, 184 s of the suite
# for two families on an AMD EPYC) proved no more than these 14. At 64: 64, 128, 448, 512, 576,
# 640, 1024; 1088, 1087, 1089, 700.
POINTS = tuple(k * A for k in (1, 2, 7, 8, 9, 10, 16))
ENDS = {17 * A: POINTS, 17 * A - 1: (8 * A, 16 * A), 17 * A + 1: (8 * A, 16 * A),
        11 * A - 4: (7 * A, 9 * A, 10 * A)}


def test_a_restored_snapshot_extended_holds_the_cold_runs_state(
        name: str, engines: tuple[Engine, Engine]) -> None:
    """The strong witness (issue 19): a snapshot at a batch edge p, restored into an emptied
    state and extended to n tokens, holds byte for byte the state of a cold prefill of the n
    tokens (every KV cell, the recurrent state) and bit for bit its last logits, at window edges,
    batch edges and segment edges; a failure names the cache, layer, cell and position."""
    eng, ref = engines
    prompt = _ids(name, max(ENDS), seed=6)
    snaps: dict[int, bytes] = {}
    eng.truncate(0, 0)
    eng.prefill(0, prompt, [*POINTS, 2 * A - 28, 8 * A + 1],  # the last two: not at an edge
                lambda p: snaps.__setitem__(p, bytes(eng.snapshot(0))))
    assert sorted(snaps) == sorted(POINTS), "a stop only at a batch edge"
    failures = []
    for n, points in ENDS.items():
        _prefill_cold(ref, prompt[:n])
        for p in points:
            eng.restore(0, prompt[:p], snaps[p])
            assert llama_cpp.llama_memory_seq_pos_max(eng.mem, 0) == p - 1
            eng.prefill(0, prompt[:n], [], lambda q: None)
            where = _same_state(eng, ref)
            if where is not None:
                failures.append(f"restored at {p}, extended to {n}: {where}")
    assert not failures, "\n".join(failures)


def test_a_window_restore_lays_each_position_in_the_cold_runs_cell() -> None:
    """Gemma 3's window snapshot holds only the window's cells (llama.cpp does not write the
    masked ones); padded, it holds every position from 0 in order, the masked ones zero-filled,
    so the restore puts position p in cell p as a cold run does. Without the padding the same
    restore packs the window's cells from cell 0, which computes other bits (a shift of one
    cell changed the logits by up to 1.0 on an AMD EPYC)."""
    eng = _engine("gemma3")
    prompt = _ids("gemma3", 700, seed=11)
    eng.prefill(0, prompt, [], lambda p: None)
    state = eng.snapshot(0)
    base, window = layout.parse(state, 2).sections
    assert base.positions == tuple(range(700))
    assert window.positions == tuple(range(700 - 512, 700)), "only the window's cells"
    whole, first = layout.pad_window(state)
    assert first == 700 - 512
    padded = layout.parse(whole, 2).sections[1]
    assert padded.positions == tuple(range(700))
    zero = bytes(padded.k[0].row_bytes)
    assert padded.k[0].cell_bytes(whole, 700, 0) == zero
    # restored, it holds what the cold state at 700 holds from 700 - 512 on: the rows a verify
    # adds after it cut back to 700 (behind it, its window would reach a zero-filled cell)
    eng.truncate(0, 0)
    eng.restore(0, prompt, state)
    eng.evaluate([(0, prompt[:3])], every=[0])
    assert eng.floor(0) == 700 and eng.truncate(0, 700) == 700
    assert bytes(eng.snapshot(0)) == bytes(state)
    assert eng.truncate(0, 699) == 0, "behind the window's first real cell: refused"
    eng.close()


def test_a_real_window_cuts_back_only_inside_it() -> None:
    """Gemma 3 with a real window (--no-swa-full): its cache holds the window and a batch
    (padded to 768 cells); behind that the state cannot be cut back, and a refused cut leaves it
    empty, never wrong. Within the window it cuts back like plain attention (the mechanics; a
    worker with a real window reuses nothing, as `inexact` says)."""
    # its numbers are a batch of 64's (the window's ring holds the window and a batch)
    eng, ref = (_engine("gemma3", swa_full=False, n_batch=64) for _ in range(2))
    prompt = _ids("gemma3", 1800, seed=7)
    assert "ring" in eng.inexact, "a real window: no reuse is exact, the worker reuses nothing"
    eng.prefill(0, prompt, [], lambda p: None)
    assert eng.floor(0) > 1800 - 1024
    assert kept_live(eng, prompt[:100] + [0] * 10) == 0
    assert kept_live(eng, prompt[:1790] + [0] * 10) == 1728  # inside the window, a batch edge
    mem = llama_cpp.llama_get_memory(eng.ctx)
    assert eng.truncate(0, 1728) == 1728
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == 1727
    assert eng.truncate(0, 100) == 0, "behind the window: refused"
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == -1
    other = prompt[:100] + _ids("gemma3", 300, seed=8)
    assert _answer(eng, other) == _cold(ref, other)
    eng.close()
    ref.close()


def test_a_hit_at_a_message_end_equals_the_cold_run(name: str, engines: tuple[Engine, Engine]
                                                   ) -> None:
    """Batches end early right after an end-of-turn token (policies.prefix.Batching), so a next
    turn reuses up to the end of the last message both prompts share, off the multiples of the
    batch size, and the hit still runs the cold run's batches: live and restored, the state
    equals a cold prefill's byte for byte and the greedy answer is the cold one."""
    eng, ref = engines
    end, size = min(eng.batching.ends), eng.batching.size
    text = _ids(name, 2000, seed=4)
    # messages of 70-150 tokens, each closed by the model's end-of-turn token
    msgs, at = [], 0
    for k in (90, 150, 70, 110, 130, 80):
        msgs.append([*text[at : at + k - 1], end])
        at += k
    first = [t for m in msgs[:4] for t in m] + text[at : at + 3]  # + a generation prompt
    second = [t for m in msgs for t in m]
    e1, e2 = eng.batching.edges(first), eng.batching.edges(second)
    ends_first = sum(len(m) for m in msgs[:4])
    assert e1.keep_max == ends_first and ends_first % size, "an edge at the message end"
    assert ends_first in e2, "the next turn has the same edge"
    snaps: dict[int, memoryview] = {}
    eng.truncate(0, 0)
    assert _answer(eng, first, [ends_first], lambda p: snaps.__setitem__(p, eng.snapshot(0))) \
        == _cold(ref, first)
    assert sorted(snaps) == [ends_first]
    cold_second = _cold(ref, second)
    kept = kept_live(eng, second)
    if MEMORY[name] != "recurrent":
        assert kept == ends_first, "the live reuse ends at the message end"
        assert eng.truncate(0, kept) == kept
        assert _answer(eng, second) == cold_second, "live hit at a message end"
    eng.restore(0, second[:ends_first], snaps[ends_first])
    eng.prefill(0, second, [], lambda p: None)
    _prefill_cold(ref, second)
    assert _same_state(eng, ref) is None, "restored hit at a message end"


def test_an_engine_reuses_only_at_batch_edges() -> None:
    """The live reuse is rounded down to a batch edge and every batch lies within one block
    of the batch size, so a hit runs the cold run's batches (the last one may be one token, in
    both). 128 on a CPU by default, 512 where layers are offloaded; 64 here."""
    eng = Engine(model_file("smollm2"), N_CTX, 2, 0)
    assert eng.batching.size == 128
    eng.close()
    eng = Engine(model_file("smollm2"), N_CTX, 2, 0, n_batch=64)
    ref = Engine(model_file("smollm2"), N_CTX, 2, 0, n_batch=64)
    prompt = _ids("smollm2", 300, seed=9)
    eng.prefill(0, prompt, [], lambda p: None)
    other = prompt[:250] + _ids("smollm2", 60, seed=10)
    assert kept_live(eng, other) == 192
    assert eng.truncate(0, 192) == 192
    assert _answer(eng, other) == _cold(ref, other)
    snaps: dict[int, memoryview] = {}
    eng.truncate(0, 0)
    batches: list[int] = []
    eng.prefill(0, prompt, [128, 256], lambda p: snaps.__setitem__(p, eng.snapshot(0)),
                batches.append)
    assert batches == [64, 128, 192, 256, 300]
    eng.restore(0, prompt[:256], snaps[256])
    assert _answer(eng, prompt) == _cold(ref, prompt)
    eng.truncate(0, 0)
    batches.clear()
    eng.prefill(0, prompt[:257], [100], lambda p: None, batches.append)
    assert batches == [64, 128, 192, 256, 257], "no stop off a batch edge; a last batch of one"
    eng.close()
    ref.close()


def test_metadata_overrides_compute_other_bits_keyed_apart_and_a_hit_is_still_exact(
        name: str, engines: tuple[Engine, Engine]) -> None:
    """llama-server's --override-kv (backend/kv_override.py) reaches llama.cpp's loader: a
    norm's epsilon changed computes other logits, the compute identity says so, and a snapshot
    restored under it is the cold run's under it."""
    from proxy.gguf import read_metadata

    arch = read_metadata(model_file(name))["general.architecture"]
    override = f"{arch}.attention.layer_norm_rms_epsilon=float:0.25"
    plain = engines[1]
    ids = _ids(name, 2 * A + 5, seed=6)
    _prefill_cold(plain, ids)
    eng, ref = (_engine(name, placement={"override_kv": override}) for _ in range(2))
    try:
        assert eng.placement["metadata"] == f"metadata {override}"
        assert eng.compute == plain.compute + f"; metadata {override}"
        snaps: dict[int, memoryview] = {}
        eng.prefill(0, ids, [A], lambda p: snaps.__setitem__(p, eng.snapshot(0)))
        assert eng.last_logits(0).tobytes() != plain.last_logits(0).tobytes(), \
            "the override changed nothing"
        _prefill_cold(ref, ids)
        assert _same_state(eng, ref) is None, "a cold run under it is one state"
        eng.truncate(0, 0)
        eng.restore(0, ids[:A], snaps[A])
        eng.prefill(0, ids, [], lambda p: None)
        assert _same_state(eng, ref) is None, "restored hit"
    finally:
        eng.close()
        ref.close()


YARN = {"rope_scaling": "yarn", "rope_freq_scale": 0.5, "yarn_orig_ctx": 4 * A}


def test_rope_settings_compute_other_bits_keyed_apart_and_a_hit_is_still_exact(
        name: str, engines: tuple[Engine, Engine]) -> None:
    """llama-server's RoPE options (proxy/rope.py) reach the context: the same prompt computes
    other logits, the engine's compute identity (in every cache key) says so, and a snapshot
    restored under them is, state for state, the cold run's under them."""
    plain = engines[1]
    ids = _ids(name, 3 * A + 9, seed=4)
    _prefill_cold(plain, ids)
    eng, ref = _engine(name, rope=YARN), _engine(name, rope=YARN)
    try:
        assert eng.compute == plain.compute + \
            f"; RoPE rope_freq_scale 0.5, rope_scaling yarn, yarn_orig_ctx {4 * A}"
        assert eng.placement["rope"] in eng.compute
        snaps: dict[int, memoryview] = {}
        eng.prefill(0, ids, [2 * A], lambda p: snaps.__setitem__(p, eng.snapshot(0)))
        assert eng.last_logits(0).tobytes() != plain.last_logits(0).tobytes(), \
            "the RoPE settings changed nothing"
        _prefill_cold(ref, ids)
        assert _same_state(eng, ref) is None, "a cold run under them is one state"
        eng.truncate(0, 0)
        eng.restore(0, ids[:2 * A], snaps[2 * A])
        eng.prefill(0, ids, [], lambda p: None)
        assert _same_state(eng, ref) is None, "restored hit"
    finally:
        eng.close()
        ref.close()
