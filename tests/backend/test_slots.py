"""Slots (issues 20 and 41): several sequences in one context, run by the worker's own compute
loop (backend.worker: the core, the scheduler, the runner, the reader thread), on the real
models of every memory kind. Each slot computes bit for bit what the same prompt computes
alone in a context of its own, every logit of every sample and the KV state; a snapshot taken
in one slot restores into another. The scheduler's rules are exact tables in
tests/policies/test_schedule.py; here one real-model test per rule: a short prompt beside a
long prefill is served first, a generating slot shares the thread's time with a prefill, decode
steps of several slots share a llama_decode as `--deterministic` and the start-up check say,
and a restore read from disk never stops another slot generating."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from backend import layout, selfcheck
from backend.engine import Engine
from backend.protocol import Cancelled, Done, Event, Job, Prefill, Start, Token
from backend.ramtier import RamTier
from backend.sampling import Sampling
from backend.worker.core import Core
from backend.worker.loop import Loop
from backend.worker.tiers import Tiers
from policies.decide import Plan, Restore
from policies.prefix import default_batch
from policies.schedule import Deterministic, Shapes, choose_decode
from tests.backend.test_memory import _ids
from tests.models import FLASH_ATTN, GPU_LAYERS, MODELS, model_file

pytestmark = pytest.mark.model

# These engines prefill in the product's batches (128 on a CPU, 512 on a GPU), not the suite's
# 64, and the lengths are in them: each test cuts, cancels and interleaves at the same batches
# on both
SLOT_BATCH = default_batch(GPU_LAYERS)
SLOT_CTX = 16 * SLOT_BATCH
GEN = 6
COLD = Plan((), (), 0, False, "off", None, None)  # nothing reused, nothing saved


@pytest.fixture(scope="module", params=MODELS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _engine(name: str, n_seq: int, flash_attn: str = FLASH_ATTN) -> Engine:
    return Engine(model_file(name), SLOT_CTX * n_seq, 2, GPU_LAYERS, n_batch=SLOT_BATCH,
                  flash_attn=flash_attn, n_seq=n_seq)


class Worker:
    """A worker's compute loop over `eng`, in this process: jobs in, every event out in the
    order it came (with the time), the logits of every sample per run, the slots of every
    decode step."""

    def __init__(self, eng: Engine, shapes: Shapes | None = None, cache: Path | None = None,
                 fault: str = "", ram: int = 0) -> None:
        self.eng, self.events = eng, []  # type: list[tuple[float, str, Event]]
        self.wakes: list[tuple[str, Event, bool]] = []  # what woke the HTTP thread at once
        self.logits: dict[int, list[bytes]] = {s: [] for s in range(len(eng.seqs))}
        self.steps: list[int] = []  # the slots of each decode step
        self.lock, self.ended = threading.Lock(), threading.Condition()
        self.finished: set[str] = set()
        self.tiers = tiers = Tiers(cache or Path("/nonexistent"), b"f" * 16, RamTier(ram),
                                   eng.prepare, self._emit, fault=fault, spare=eng.spare_bytes)
        core = Core(len(eng.seqs), eng.batching, eng.memory.kind == "plain", ram, True,
                    eng.n_ctx)
        shapes = shapes or Shapes(eng.decode_shape, True, "")
        eng.decode_shape = shapes.decode
        sample, decode = eng.sample, eng.decode

        def sampled(slot: int, sampler: object, i: int = -1) -> int:
            self.logits[slot].append(eng.last_logits(slot).tobytes())
            return sample(slot, sampler, i)  # type: ignore[arg-type]

        def decoded(tokens: dict[int, int]) -> None:
            self.steps.append(len(tokens))
            decode(tokens)

        eng.sample, eng.decode = sampled, decoded  # type: ignore[method-assign]
        self.loop = Loop(eng, core, tiers, shapes,
                         lambda run, event, wake: self._emit(run, event, wake))
        self.loop.start()

    def _emit(self, run: str, event: Event, wake: bool = True) -> None:
        with self.lock:
            self.events.append((time.perf_counter(), run, event))
            self.wakes.append((run, event, wake))
        if isinstance(event, Done) or type(event).__name__ in ("Cancelled", "Error"):
            with self.ended:
                self.finished.add(run)
                self.ended.notify_all()

    def submit(self, run: str, ids: list[int], slot: int, gen: int = GEN,
               plan: Plan = COLD, stream: bool = True, nest: bool = False) -> None:
        self.loop.arrive(Job(run, tuple(ids), b"", "", plan, {"temperature": 0.0}, gen, (),
                             None, slot, stream=stream, nest=nest))

    def wait(self, *runs: str, timeout_s: float = 600) -> None:
        with self.ended:
            assert self.ended.wait_for(lambda: set(runs) <= self.finished, timeout_s), runs

    def of(self, run: str) -> list[Event]:
        return [e for _, r, e in self.events if r == run]

    def tokens(self, run: str) -> list[int]:
        return [e.id for e in self.of(run) if isinstance(e, Token) and e.id is not None]

    def stop(self) -> None:
        self.loop.stop()
        del self.eng.sample, self.eng.decode  # the engine's own methods again


def _alone(name: str, prompts: list[list[int]], gen: int = GEN) -> list[tuple[list[bytes],
                                                                           list[int], bytes]]:
    """Each prompt alone in a context of one slot: (the logits of every sample, the tokens, the
    KV state after)."""
    eng = _engine(name, 1)
    out = []
    try:
        for k, ids in enumerate(prompts):
            w = Worker(eng)
            w.submit(f"a{k}", ids, 0, gen)
            w.wait(f"a{k}")
            w.stop()
            out.append((w.logits[0], w.tokens(f"a{k}"), bytes(eng.snapshot(0))))
            eng.truncate(0, 0)
    finally:
        eng.close()
    return out


def test_interleaved_slots_compute_what_each_computes_alone(name: str) -> None:
    p, q = _ids(name, 5 * SLOT_BATCH + 60, 1), _ids(name, 7 * SLOT_BATCH + 4, 2)
    cut = 5 * SLOT_BATCH
    want = _alone(name, [p, q])
    eng = _engine(name, 2)
    try:
        w = Worker(eng)
        w.submit("p", p, 0)
        w.submit("q", q, 1)
        w.wait("p", "q")
        w.stop()
        for slot, run, ref in ((0, "p", want[0]), (1, "q", want[1])):
            assert (w.logits[slot], w.tokens(run)) == ref[:2], \
                f"slot {slot}: logits or tokens differ from its run alone"
        # the sequence id in a state is its slot's: slot 0's is the cold one's
        assert bytes(eng.snapshot(0)) == want[0][2], "slot 0: its KV differs from alone"
        # a snapshot taken in slot 1 restores into slot 0 and answers as the run alone
        eng.truncate(1, 0)
        eng.prefill(1, q[:cut])
        snap = bytes(eng.snapshot(1))
        eng.restore(0, q[:cut], snap)
        w = Worker(eng)
        w.submit("q0", q, 0, plan=Plan((), (), 7 * SLOT_BATCH, True, "off", None, None))
        w.wait("q0")
        w.stop()
        start = next(e for e in w.of("q0") if isinstance(e, Start))
        assert start.keep == cut and (w.logits[0], w.tokens("q0")) == want[1][:2]
    finally:
        eng.close()
    # and into a context of one slot (a state file outlives a change of --parallel)
    solo = _engine(name, 1)
    try:
        solo.restore(0, q[:cut], snap)
        solo.prefill(0, q)
        tokens = [t for t, _, _ in solo.generate(0, Sampling(temperature=0), GEN)]
        assert tokens == want[1][1]
    finally:
        solo.close()


def test_a_slot_cancelled_mid_prefill_leaves_the_other_exact(name: str) -> None:
    p, q = _ids(name, 5 * SLOT_BATCH + 60, 3), _ids(name, 7 * SLOT_BATCH + 4, 4)  # q: 8 batches
    want = _alone(name, [p])[0]
    eng = _engine(name, 2)
    try:
        w = Worker(eng)
        w.submit("q", q, 1)
        w.submit("p", p, 0)
        while sum(isinstance(e, Prefill) for e in w.of("q")) < 3:
            time.sleep(0.001)
        w.loop.cancel("q")
        w.wait("p", "q")
        w.stop()
        assert (w.logits[0], w.tokens("p")) == want[:2]
        n = eng.seqs[1].n_live
        assert 0 < n < len(q) and n % SLOT_BATCH == 0, \
            "what it prefilled stays live, at a batch edge"
    finally:
        eng.close()


def test_a_slots_snapshot_is_rewritten_in_place_as_the_join_writes_it(name: str) -> None:
    """With several slots a snapshot is given the one-stream form within its own buffer
    (`layout.one_stream_in_place`, one copy fewer on the hot path): byte for byte what
    `layout.one_stream` builds from the state llama.cpp wrote, for every slot (the sequence's
    stream sits at a different place in each); and a state read from disk is given the form
    of several streams within its own buffer (`layout.many_streams_in_place`, no copy of it on
    the reader thread) byte for byte as `layout.many_streams` builds it."""
    import ctypes

    import llama_cpp

    eng = _engine(name, 3)
    try:
        for slot in range(3):
            eng.prefill(slot, _ids(name, 100 + 30 * slot, seed=slot))
            size = llama_cpp.llama_state_seq_get_size(eng.ctx, slot)
            raw = np.empty(size, dtype=np.uint8)
            n = llama_cpp.llama_state_seq_get_data(
                eng.ctx, raw.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, slot)
            want = bytes(layout.one_stream(memoryview(raw)[:n], eng.caches))
            assert len(want) < n, "the other slots' empty streams are dropped"
            assert bytes(eng.snapshot(slot)) == want
            # and back: a state read with room after it (store.read_state_into) is given the
            # form of 3 streams in place, byte for byte as `many_streams` builds it
            room = np.zeros(len(want) + eng.spare_bytes, dtype=np.uint8)
            room[:len(want)] = np.frombuffer(want, dtype=np.uint8)
            made = layout.many_streams_in_place(room, len(want), eng.caches, 3)
            assert bytes(room[:made]) == bytes(layout.many_streams(want, eng.caches, 3))
    finally:
        eng.close()


def _as_seq0(state: memoryview, n_caches: int) -> bytes:
    """A slot's snapshot as sequence 0 would have written it (the header and each cell name the
    sequence)."""
    out = bytearray(state)
    struct.pack_into("<i", out, 4, 0)
    for sec in layout.parse(state, n_caches).sections:
        size = 16 if sec.ext else 4  # pos, n_seq, [ext], then the sequence id
        for i in range(sec.cell_count):
            struct.pack_into("<i", out, sec.meta_offset + i * (size + 8) + size + 4, 0)
    return bytes(out)


@pytest.mark.parametrize("flash_attn", ["on", "off"])  # V rows as they are, and transposed
def test_a_snapshot_behind_the_live_end_is_cut_within_its_buffer(name: str,
                                                                 flash_attn: str) -> None:
    """A snapshot of the first p live tokens (a save at a message end behind the live end, or a
    slot copied from another) is, byte for byte, what the slot's state cut back to p writes;
    with plain attention it is cut within the whole snapshot's buffer
    (`layout.first_cells_in_place`: one state in memory, no restore), and the live state is
    left as it was. A slot copied from another holds that same part."""
    eng = _engine(name, 3, flash_attn)
    try:
        ids = _ids(name, 2 * SLOT_BATCH + 40, seed=7)
        eng.prefill(0, ids)
        p = SLOT_BATCH + 7
        if not eng.can_snapshot_behind(0, p):
            assert eng.memory.kind == "recurrent", "only a recurrent state cannot be cut back"
            return
        whole = bytes(eng.snapshot(0))
        got = eng.snapshot_behind(0, p)
        assert bytes(eng.snapshot(0)) == whole, "the live state is left as it was"
        assert eng.live_ids(0) == ids
        # the reference: the live state cut back to p, written by llama.cpp, then put back
        eng.truncate(0, p)
        want = bytes(eng.snapshot(0))
        eng.restore(0, ids, whole)
        assert bytes(got) == want, layout.first_difference(got, want, eng.caches)
        assert got.nbytes == len(want), "the buffer is shrunk to the part"
        assert eng.copy(0, 2, p) == p
        assert _as_seq0(eng.snapshot(2), eng.caches) == want and eng.live_ids(2) == ids[:p]
    finally:
        eng.close()


def test_a_ram_entry_is_restored_within_its_buffer(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A RAM-tier entry (read by the compute thread only) is given the form of several streams
    within its own buffer for the load, not copied, and its own form back after: the slot then
    holds the state it was taken from, and the entry is byte for byte as it was."""
    eng = _engine(name, 3)
    try:
        ids = _ids(name, SLOT_BATCH + 40, seed=8)
        eng.prefill(0, ids)
        held = eng.snapshot(0)  # as a slot that gives way leaves it in the RAM tier
        before = bytes(held)

        def copied(*a: object, **kw: object) -> None:
            raise AssertionError("the entry was copied")
        if not (eng.memory.kind == "window" and eng.memory.full):
            monkeypatch.setattr(layout, "many_streams", copied)
        eng.restore_held(1, ids, held)
        monkeypatch.undo()
        assert bytes(held) == before, "the entry has its own form back"
        assert _as_seq0(eng.snapshot(1), eng.caches) == before and eng.live_ids(1) == ids
    finally:
        eng.close()


def test_a_prompt_another_slot_is_prefilling_is_copied_from_it_not_computed_again(
        name: str) -> None:
    """Rule 5 of policies.sources: two subagents started at once share their system prompt and
    tools; the second waits for the first's prefill to pass what they share and copies it
    (plain attention: that part of the slot's KV; a window or a recurrent state: the slot's
    whole state as its batch ends at the edge), computing only its own tail. Both answer bit
    for bit as alone."""
    shared = 3 * SLOT_BATCH + 20
    p = _ids(name, shared + 50, 11)
    q = p[:shared] + _ids(name, 70, 12)
    want = _alone(name, [p, q])
    reuse = Plan((), (), 8 * SLOT_BATCH, True, "off", None, None)
    eng = _engine(name, 2)
    try:
        w = Worker(eng, ram=1 << 30)
        w.submit("first", p, 0, plan=reuse)
        w.submit("second", q, 1, plan=reuse)
        w.wait("first", "second")
        w.stop()
        edge = eng.batching.edges(q).floor(shared)
    finally:
        eng.close()
    for slot, run, ref in ((0, "first", want[0]), (1, "second", want[1])):
        assert (w.logits[slot], w.tokens(run)) == ref[:2], f"{run} differs from it alone"
    start = next(e for e in w.of("second") if isinstance(e, Start))
    assert (start.keep, start.tier) == (edge, "slot")
    order = [(run, e.n_live) for _, run, e in w.events if isinstance(e, Prefill)]
    first_own = order.index(next(o for o in order if o[0] == "second"))
    assert max(n for run, n in order[:first_own] if run == "first") >= edge, \
        "the second computed a batch before the first passed what they share"
    assert all(n > edge for run, n in order if run == "second"), "it computed only its tail"


def test_a_generating_run_parked_for_a_nested_job_goes_on_as_it_would_have(name: str) -> None:
    """Rule 4 of policies.preempt: a short job comes nested on a slot whose run generates. The
    run is parked between two of its decode steps (its state byte for byte in host RAM), the
    short job runs on the slot, and the run is put back and goes on. Both answer bit for bit
    as alone (every sample's logits), and the run's tokens stop while the short job runs.
    Then a run whose client leaves while it is parked ends there, and the slot is the nested
    job's."""
    long, short = _ids(name, 2 * SLOT_BATCH + 30, 21), _ids(name, SLOT_BATCH + 10, 22)
    gen = 16
    want = _alone(name, [long, short], gen=gen)
    eng = _engine(name, 1)
    try:
        w = Worker(eng, ram=-1)  # a RAM tier without a limit
        w.submit("long", long, 0, gen=gen)
        while len(w.tokens("long")) < 3:
            time.sleep(0.001)
        w.submit("short", short, 0, nest=True)
        w.wait("long", "short")
        order = [run for _, run, e in w.events if isinstance(e, Token) and e.id is not None]
        k, n = order.index("short"), len(want[0][1])
        assert order == ["long"] * k + ["short"] * GEN + ["long"] * (n - k), order
        assert w.tokens("long") == want[0][1] and w.tokens("short") == want[1][1][:GEN]
        assert w.logits[0] == want[0][0][:k] + want[1][0][:GEN] + want[0][0][k:], \
            "a sample's logits differ from its run alone"
        assert eng.seqs[0].n_live == len(long) + n - 1 and not w.loop.runner.parked
        # the client of a parked run leaves: it ends, and the nested job goes on alone
        w.submit("again", long, 0, gen=gen)
        while len(w.tokens("again")) < 2:
            time.sleep(0.001)
        w.submit("nested", short, 0, nest=True)
        while not w.of("nested"):
            time.sleep(0.001)
        w.loop.cancel("again")
        w.wait("again", "nested")
        w.stop()
        held = eng.seqs[0].n_live
    finally:
        eng.close()
    assert isinstance(w.of("again")[-1], Cancelled) and w.tokens("nested") == want[1][1][:GEN]
    assert held == len(short) + GEN - 1 and not w.loop.runner.parked
    # a state larger than the RAM tier's budget is not parked: the job waits for the run's end
    eng = _engine(name, 1)
    try:
        w = Worker(eng, ram=1000)
        w.submit("long", long, 0, gen=gen)
        while len(w.tokens("long")) < 3:
            time.sleep(0.001)
        w.submit("short", short, 0, nest=True)
        w.wait("long", "short")
        w.stop()
    finally:
        eng.close()
    order = [run for _, run, e in w.events if isinstance(e, Token) and e.id is not None]
    assert order == ["long"] * n + ["short"] * GEN and w.tokens("short") == want[1][1][:GEN]


def test_a_short_prompt_beside_a_long_prefill_is_served_first(name: str) -> None:
    """Rule 1 (policies.schedule): of the prefills, the one due first runs. A short prompt
    that arrives while a long one prefills is due first and ends within a few of the long one's
    batches, and both compute what they compute alone."""
    p, q = _ids(name, 5 * SLOT_BATCH + 60, 7), _ids(name, 14 * SLOT_BATCH + 8, 8)
    want = _alone(name, [p, q], gen=1)
    eng = _engine(name, 2)
    try:
        w = Worker(eng)
        w.submit("long", q, 1, gen=1)
        while not w.of("long")[1:]:  # its first batch is done
            time.sleep(0.001)
        w.submit("short", p, 0, gen=1)
        w.wait("short", "long")
        w.stop()
    finally:
        eng.close()
    assert (w.logits[0][0], w.logits[1][0]) == (want[0][0][0], want[1][0][0]), \
        "a prefill differs from it alone"
    order = [run for _, run, e in w.events if isinstance(e, Prefill)]
    last = max(i for i, run in enumerate(order) if run == "short")
    arrived = order.index("short")
    beside = sum(run == "long" for run in order[arrived:last])
    assert beside <= 3, f"the long prefill ran {beside} batches before the short one ended"


def test_a_slot_given_away_waits_for_the_short_request_before_another_step(name: str) -> None:
    """A preemption (policies.preempt): the run prefilling on slot 0 is cancelled to give its
    slot to a short request, whose job comes once its client has seen the run end (as the proxy
    sends it). The worker holds its next step for that job rather than start another of slot
    1's prefill batches, which the short request would wait for (seconds each on a CPU deep in
    a context); the short prompt then runs first (due first) and computes what it does alone."""
    long, other = _ids(name, 12 * SLOT_BATCH, 11), _ids(name, 14 * SLOT_BATCH + 8, 12)
    short = _ids(name, SLOT_BATCH + 20, 13)
    want = _alone(name, [short], gen=1)[0]
    eng = _engine(name, 2)
    try:
        w = Worker(eng, ram=-1)
        w.submit("other", other, 1, gen=1)
        w.submit("long", long, 0, gen=1)
        while sum(isinstance(e, Prefill) for e in w.of("long")) < 2:
            time.sleep(0.001)
        w.loop.cancel("long", prefilling=True)
        w.wait("long")
        time.sleep(0.02)  # the proxy's round trip: the run's end read, the slot handed on
        w.submit("short", short, 0, gen=1)
        w.wait("short", "other")
        w.stop()
    finally:
        eng.close()
    assert w.logits[0][-1] == want[0][0], "the short prompt differs from it alone"
    steps = [(run, e) for _, run, e in w.events if isinstance(e, Prefill | Cancelled)]
    names = [run for run, _ in steps]
    given = next(i for i, (_, e) in enumerate(steps) if isinstance(e, Cancelled))
    between = names[given + 1:names.index("short")]
    assert between == [], f"slot 1 ran {len(between)} batches while its job was on its way"


def test_a_generating_slot_is_not_slowed_to_a_token_per_prefill_batch(name: str) -> None:
    """Rule 2: once a prompt that came has had as much of the compute thread as an answer in
    flight, the two share the thread's time, not its turns: a slot generating beside one that
    prefills a long prompt ends its answer well before the prefill ends (taking turns, 24
    tokens took 27 of 28 batches)."""
    gen = 24
    p, q = _ids(name, SLOT_BATCH + 72, 5), _ids(name, 14 * SLOT_BATCH + 8, 6)
    eng = _engine(name, 2)
    try:
        w = Worker(eng)
        w.submit("long", q, 1, gen=1)
        w.submit("answer", p, 0, gen=gen)
        w.wait("answer", "long")
        w.stop()
    finally:
        eng.close()
    assert len(w.tokens("answer")) == gen
    # where a prefill batch costs several tokens (SmolLM2, Gemma 3; not the random Qwen3.5,
    # whose batches cost little beside the loop's own overhead) the answer ends first
    times = {run: [t for t, r, e in w.events if r == run and isinstance(e, Prefill | Token)]
             for run in ("long", "answer")}
    gap = {run: (ts[-1] - ts[0]) / max(len(ts) - 1, 1) for run, ts in times.items()}
    if gap["long"] > 3 * gap["answer"]:
        done = {run: next(t for t, r, e in w.events if r == run and isinstance(e, Done))
                for run in ("long", "answer")}
        assert done["answer"] < done["long"], "the answer waited for the prefill"


def _together(name: str, eng: Engine, prompts: list[list[int]], gen: int, shapes: Shapes,
              alone: dict[str, list[tuple[list[bytes], list[int]]]] | None = None
              ) -> tuple[list[tuple[list[bytes], list[int]]], Worker]:
    """Each prompt generated alone in slot 0 of this engine, in the shape given (or as `alone`
    holds them for that shape), then all at once (slot s the s-th). Returns (the logits and
    tokens of each alone, the worker)."""
    alone = {} if alone is None else alone
    if shapes.decode not in alone:
        alone[shapes.decode] = []
        for k, ids in enumerate(prompts):
            w = Worker(eng, shapes)
            w.submit(f"a{k}", ids, 0, gen)
            w.wait(f"a{k}")
            w.stop()
            alone[shapes.decode].append((w.logits[0], w.tokens(f"a{k}")))
            eng.truncate(0, 0)
    want = alone[shapes.decode]
    w = Worker(eng, shapes)
    for s, ids in enumerate(prompts):
        w.submit(f"s{s}", ids, s, gen)
    w.wait(*(f"s{s}" for s in range(len(prompts))))
    w.stop()
    return want, w


@pytest.fixture(scope="module")
def checked(name: str) -> Iterator[tuple[Engine, selfcheck.Report, dict[str, list]]]:
    """An engine of three slots, its start-up check, and what its prompts answer alone in each
    decode shape (`_together`): one of each for both `--deterministic` modes."""
    eng = Engine(model_file(name), SLOT_CTX * 3, 2, GPU_LAYERS, flash_attn="off", n_seq=3)
    try:
        report = selfcheck.run(eng)
        assert report.ok and report.decode is not None, report.failure
        yield eng, report, {}
    finally:
        eng.close()


@pytest.mark.parametrize("deterministic", ["on", "off"])
def test_decode_steps_of_several_slots_as_deterministic_says(
        name: str, deterministic: Deterministic,
        checked: tuple[Engine, selfcheck.Report, dict[str, list]]) -> None:
    """Rule 3, and `--deterministic` (policies.schedule.choose_decode). `on`: three slots
    generating at once get every logit and token each gets alone, their steps sharing a
    llama_decode where the start-up check proved it and apart where it did not. `off`: their
    decode steps are batched as they come whatever the check found (answers may then depend on
    the others, as in llama-server); a prefill is still the cold run's, so the first sample of
    each equals its first alone."""
    prompts = [_ids(name, 600, 11), _ids(name, 150, 12), _ids(name, 250, 13)]
    eng, report, alone = checked
    assert report.decode is not None
    shapes = choose_decode(deterministic, report.decode, 3)
    want, w = _together(name, eng, prompts, 48, shapes, alone)
    for s in range(3):
        eng.truncate(s, 0)
    for s, ref in enumerate(want):
        if shapes.independent:
            assert (w.logits[s], w.tokens(f"s{s}")) == ref, \
                f"slot {s}: logits or tokens differ from its run alone"
        else:
            assert w.logits[s][0] == ref[0][0], f"slot {s}: its prefill differs from alone"
    if shapes.decode == "apart":
        assert max(w.steps) == 1, "not proven, yet decode steps were batched"
    else:
        assert max(w.steps) >= 2, "decode steps that may share a llama_decode never did"


@pytest.mark.skipif(GPU_LAYERS != 0, reason="about ggml's CPU flash attention kernel")
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_with_flash_attention_on_a_cpu_decode_steps_batch_in_a_fixed_shape(model: str) -> None:
    """With flash attention on a CPU a slot's decode alone is a single query row, whose
    attention ggml splits among the threads once its KV view reaches 512 cells; beside another
    slot's row it is not split, and the logits differ. In one fixed shape, a row per slot (the
    idle slots' padding rows), no row is ever alone: the check proves that a slot's logits then
    do not depend on the other rows, `--deterministic on` takes the shape whatever it costs,
    and two slots generating at once answer as each does alone, beside a third that holds a
    prompt and keeps it exactly. On plain attention and a (full-size) sliding window; a
    hybrid's recurrent state could not drop a padding row, and its steps run apart."""
    eng = Engine(model_file(model), SLOT_CTX * 3, 2, GPU_LAYERS, flash_attn="on", n_seq=3)
    try:
        report = selfcheck.run(eng)
        assert report.ok and report.decode is not None, report.failure
        proof = report.decode
        assert "slot 0 decoded with slots 0-1" in proof.batched, proof
        assert proof.fixed == "" and proof.fixed_cost > 0, proof
        shapes = choose_decode("on", proof, 3)
        assert shapes.decode == "fixed" and shapes.independent
        idle = _ids(model, 300, 14)
        eng.prefill(2, idle)
        before = bytes(eng.snapshot(2))
        # 64 tokens: the short prompt's answer must outlast the long one's prefill, which it
        # shares the thread's time with (an AMD EPYC made 32 of them meanwhile)
        want, w = _together(model, eng, [_ids(model, 300, 11), _ids(model, 150, 12)], 64,
                            shapes)
        assert eng.live_ids(2) == idle and bytes(eng.snapshot(2)) == before, \
            "the padding rows changed an idle slot's state"
    finally:
        eng.close()
    for s, ref in enumerate(want):
        assert (w.logits[s], w.tokens(f"s{s}")) == ref, \
            f"slot {s}: logits or tokens differ from its run alone"
    assert max(w.steps) == 2, "two slots generated at once, yet no decode step held both"


def test_a_restore_read_from_disk_never_stops_another_slot_generating(
        tmp_path: Path) -> None:
    """The reader thread (issue 41): a job that starts from a state file waits for the file on
    the reader thread, here a slow one (PREFIXGATE_FAULT=slow-disk: 3 s a read); meanwhile the
    other slot generates its whole answer. The restored job then answers as a cold run."""
    from backend import keys, store

    name = "smollm2"
    p, q = _ids(name, 2 * SLOT_BATCH + 10, 21), _ids(name, 3 * SLOT_BATCH + 20, 22)
    want = _alone(name, [q], gen=4)[0]
    eng = _engine(name, 2)
    try:
        eng.prefill(1, q[: 3 * SLOT_BATCH])
        key = keys.CacheKey(b"k" * 16)
        path, size, _ = store.write_state_file(tmp_path, key, b"f" * 16, q[: 3 * SLOT_BATCH],
                                               eng.snapshot(1))
        eng.truncate(1, 0)
        w = Worker(eng, cache=tmp_path, fault="slow-disk")
        restore = Restore(3 * SLOT_BATCH, bytes(key), str(path.relative_to(tmp_path)), size)
        w.submit("restored", q, 1, gen=4,
                 plan=Plan((restore,), (), 3 * SLOT_BATCH, False, "hit", None, None))
        w.submit("answer", p, 0, gen=16)
        w.wait("answer", "restored")
        w.stop()
        # the read state was counted as on its way (`moving_bytes`) until the slot loaded it
        assert w.tiers.moving_bytes() == 0, "a loaded state is still counted as moving"
    finally:
        eng.close()
    runs = [(run, type(e).__name__) for _, run, e in w.events]
    assert runs.index(("answer", "Done")) < runs.index(("restored", "Start")), \
        "the other slot waited for the read"
    start = next(e for e in w.of("restored") if isinstance(e, Start))
    assert (start.keep, start.restored) == (3 * SLOT_BATCH, 3 * SLOT_BATCH)
    assert (w.logits[1], w.tokens("restored")) == want[:2], "the restored hit differs from cold"


@pytest.mark.skipif(GPU_LAYERS != 0, reason="about a worker that computes on the CPU")
def test_auto_flash_attention_is_off_with_several_slots_on_a_cpu_under_deterministic_on(
        ) -> None:
    """`--flash-attn auto` (the default) with `--deterministic on` is off in a CPU worker with
    several slots, where it lets decode steps batch exactly, and llama.cpp's own choice
    otherwise: one slot, a quantized V cache (which needs flash attention), a recurrent memory
    (`--deterministic auto` and `off` keep it everywhere: tests/backend/test_flash_attn.py).
    What it resolved to is in the compute identity, so states of the other setting are a clean
    miss."""
    shapes = {  # (model, slots, V cache) -> flash attention as llama.cpp gets it
        ("smollm2", 2, "f16"): "off",
        ("gemma3", 2, "f16"): "off",
        ("smollm2", 1, "f16"): "auto",
        ("smollm2", 2, "q8_0"): "auto",
        ("qwen35", 2, "f16"): "auto",
    }
    computes = {}
    for (name, slots, type_v), want in shapes.items():
        eng = Engine(model_file(name), SLOT_CTX * slots, 2, GPU_LAYERS, flash_attn="auto",
                     type_k=type_v, type_v=type_v, n_seq=slots, deterministic="on")
        try:
            assert eng.flash_attn == want, (name, slots, type_v)
            computes[name, slots, type_v] = eng.compute
        finally:
            eng.close()
    assert computes["smollm2", 2, "f16"].endswith("; flash attention off")
    assert computes["smollm2", 2, "f16"] != computes["smollm2", 1, "f16"]
    assert "flash attention" not in computes["smollm2", 2, "q8_0"]


def test_a_step_that_raises_fails_its_job_and_the_worker_serves_the_next() -> None:
    """A bug in a step (here: a decode that raises what no engine call raises) fails that
    step's job with an error; the loop lives on and the next job is served, as alone."""
    name = MODELS[0]
    p = _ids(name, SLOT_BATCH + 20, 5)
    want = _alone(name, [p])[0]
    eng = _engine(name, 1)
    try:
        w = Worker(eng)
        decode, calls = eng.decode, []

        def broken(tokens: dict[int, int]) -> None:
            calls.append(1)
            if len(calls) == 1:
                raise KeyError("a bug")
            decode(tokens)

        eng.decode = broken  # type: ignore[method-assign]
        w.submit("bad", p, 0)
        w.wait("bad", timeout_s=120)
        assert type(w.of("bad")[-1]).__name__ == "Error"
        eng.truncate(0, 0)
        w.submit("good", p, 0)
        w.wait("good", timeout_s=120)
        w.stop()
        assert isinstance(w.of("good")[-1], Done)
        assert w.tokens("good") == want[1]
    finally:
        eng.close()


def test_an_answer_that_is_not_streamed_wakes_the_http_thread_only_at_its_end() -> None:
    """A job whose client takes the answer whole (`Job.stream` false) computes what a streamed
    one does, and none of its tokens wakes the worker's HTTP thread (each wake takes a core
    from llama.cpp on a small machine): they go with its end, which wakes it; a streamed
    answer's first token wakes it at once (its time to first token)."""
    name = MODELS[0]
    p = _ids(name, SLOT_BATCH + 20, 6)
    eng = _engine(name, 1)
    try:
        w = Worker(eng)
        w.submit("whole", p, 0, gen=8, stream=False)
        w.wait("whole", timeout_s=120)
        eng.truncate(0, 0)
        w.submit("streamed", p, 0, gen=8)
        w.wait("streamed", timeout_s=120)
        w.stop()
    finally:
        eng.close()
    assert w.tokens("whole") == w.tokens("streamed") and len(w.tokens("whole")) >= 2
    whole = [(e, wake) for r, e, wake in w.wakes if r == "whole"]
    assert [wake for e, wake in whole if isinstance(e, Token)] == [False] * len(w.tokens("whole"))
    assert isinstance(whole[-1][0], Done) and whole[-1][1]
    streamed = [wake for r, e, wake in w.wakes if r == "streamed" and isinstance(e, Token)]
    assert streamed[0] is True
