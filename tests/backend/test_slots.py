"""Slots (issue 20): two sequences in one context, their steps interleaved as the worker's
scheduler runs them (a prefill batch or a token of one, then of the other), each compute
bit for bit what the same prompt computes alone in a context of its own: every logit of the
prefill's end and of each greedy token, and the KV state. A snapshot taken in one slot restores
into the other exactly. On plain attention, a sliding window and a hybrid recurrent state.
Decode steps of several slots in one llama_decode (where the self-check proves it: as they
come, or in a fixed shape of a row per slot) give each slot the logits it gets alone, and the
check catches a decode that does not."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from backend import selfcheck
from backend.engine import Cancel, Engine, Sampling
from backend.worker import DECODE, Scheduler
from policies.prefix import default_batch
from tests.backend.test_memory import _ids
from tests.models import FLASH_ATTN, GPU_LAYERS, MODELS, model_file

pytestmark = pytest.mark.model

# These engines prefill in the product's batches (128 on a CPU, 512 on a GPU), not the suite's
# 64, and the lengths are in them: each test cuts, cancels and interleaves at the same batches
# on both
SLOT_BATCH = default_batch(GPU_LAYERS)
SLOT_CTX = 16 * SLOT_BATCH
GEN = 6


@pytest.fixture(scope="module", params=MODELS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _engine(name: str, n_seq: int) -> Engine:
    return Engine(model_file(name), SLOT_CTX * n_seq, 2, GPU_LAYERS, n_batch=SLOT_BATCH,
                  flash_attn=FLASH_ATTN, n_seq=n_seq)


def _run(eng: Engine, ids: list[int], trace: list[bytes], stops: tuple[int, ...] = (),
         snaps: dict[int, bytes] | None = None) -> Iterator[None]:
    """A job as the worker runs it: steps of prefill batches, then steps of one greedy token;
    the logits of the prefill's end and of every token go to `trace`. It does not say what its
    prefill has left, so the scheduler interleaves two prefills' batches too (by their time)."""
    kept = {} if snaps is None else snaps
    for _ in eng.prefill_steps(ids, list(stops),
                               lambda p: kept.__setitem__(p, bytes(eng.snapshot())), Cancel()):
        yield
    for token, _, _ in eng.generate(Sampling(temperature=0), GEN, Cancel()):
        trace.append(eng.last_logits().tobytes())
        trace.append(np.int32(token).tobytes())
        yield


def _alone(name: str, prompts: list[list[int]]) -> list[list[bytes]]:
    eng = _engine(name, 1)
    try:
        out = []
        for ids in prompts:
            eng.truncate(0)
            trace: list[bytes] = []
            for _ in _run(eng, ids, trace):
                pass
            trace.append(bytes(eng.snapshot()))
            out.append(trace)
        return out
    finally:
        eng.close()


def test_interleaved_slots_compute_what_each_computes_alone(name: str) -> None:
    p, q = _ids(name, 5 * SLOT_BATCH + 60, 1), _ids(name, 7 * SLOT_BATCH + 4, 2)
    cut = 5 * SLOT_BATCH
    want = _alone(name, [p, q])
    eng = _engine(name, 2)
    sched = Scheduler(eng)
    try:
        traces: list[list[bytes]] = [[], []]
        snaps: dict[int, bytes] = {}
        done = [sched.submit(0, _run(eng, p, traces[0])),
                sched.submit(1, _run(eng, q, traces[1], (cut,), snaps))]
        for d in done:
            d.result(timeout=600)
        for slot, (trace, ref) in enumerate(zip(traces, want, strict=True)):
            eng.use(slot)
            state = bytes(eng.snapshot())
            assert trace == ref[:-1], f"slot {slot}: logits or tokens differ from its run alone"
            if slot == 0:  # the sequence id in a state is its slot's: slot 0's is the cold one's
                assert state == ref[-1], "slot 0: its KV differs from the run alone"
        # a snapshot taken in slot 1 restores into slot 0 and answers as the run alone
        eng.use(0)
        eng.restore(q[:cut], snaps[cut])
        trace = []
        for _ in _run(eng, q, trace):
            pass
        assert trace == want[1][:-1]
        assert bytes(eng.snapshot()) == want[1][-1]
    finally:
        sched.stop()
        eng.close()
    # and into a context of one slot (a state file outlives a change of --parallel)
    solo = _engine(name, 1)
    try:
        solo.restore(q[:cut], snaps[cut])
        trace = []
        for _ in _run(solo, q, trace):
            pass
        assert trace == want[1][:-1]
    finally:
        solo.close()


def test_a_slot_cancelled_mid_prefill_leaves_the_other_exact(name: str) -> None:
    p, q = _ids(name, 5 * SLOT_BATCH + 60, 3), _ids(name, 7 * SLOT_BATCH + 4, 4)  # q: 8 batches
    want = _alone(name, [p])[0]
    eng = _engine(name, 2)
    sched = Scheduler(eng)
    try:
        cancel = Cancel()
        trace: list[bytes] = []

        def cancelled() -> Iterator[None]:
            for i, _ in enumerate(eng.prefill_steps(q, [], lambda _: None, cancel)):
                if i == 3:
                    cancel.set()
                yield

        a, b = sched.submit(0, _run(eng, p, trace)), sched.submit(1, cancelled())
        a.result(timeout=600)
        with pytest.raises(Exception, match="Cancelled|^$"):
            b.result(timeout=600)
        assert trace == want[:-1]
        eng.use(1)
        assert 0 < eng.n_live < len(q) and eng.n_live % eng.batching.size == 0, \
            "what it prefilled stays live, at a batch edge"
    finally:
        sched.stop()
        eng.close()


def test_a_slots_snapshot_is_rewritten_in_place_as_the_join_writes_it(name: str) -> None:
    """With several slots a snapshot is given the one-stream form within its own buffer
    (`layout.one_stream_in_place`, one copy fewer on the hot path): byte for byte what
    `layout.one_stream` builds from the state llama.cpp wrote, for every slot (the sequence's
    stream sits at a different place in each)."""
    import ctypes

    import llama_cpp

    from backend import layout

    eng = _engine(name, 3)
    try:
        for slot in range(3):
            eng.use(slot)
            eng.prefill(_ids(name, 100 + 30 * slot, seed=slot), [], lambda p: None, Cancel())
            size = llama_cpp.llama_state_seq_get_size(eng.ctx, slot)
            raw = np.empty(size, dtype=np.uint8)
            n = llama_cpp.llama_state_seq_get_data(
                eng.ctx, raw.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, slot)
            want = bytes(layout.one_stream(memoryview(raw)[:n], eng.caches))
            assert len(want) < n, "the other slots' empty streams are dropped"
            assert bytes(eng.snapshot()) == want
    finally:
        eng.close()


def _timed(steps: list[tuple[int, float]], slot: int,
           job: Iterator[int | None]) -> Iterator[int | None]:
    """The job, each step's (slot, seconds) appended to `steps` in the order they ran."""
    while True:
        t = time.perf_counter()
        try:
            left = next(job)
        except StopIteration:
            return
        steps.append((slot, time.perf_counter() - t))
        yield left


def test_a_short_prompt_beside_a_long_prefill_is_served_first(name: str) -> None:
    """Of the prefills, the one due first runs: a short prompt that arrives while a long one
    prefills is due first and ends within a few of the long one's batches, and both compute
    what they compute alone. (Sharing the time, the long one ran 6 batches beside the short
    one's 5.)"""
    p, q = _ids(name, 5 * SLOT_BATCH + 60, 7), _ids(name, 14 * SLOT_BATCH + 8, 8)
    want = _alone(name, [p, q])
    steps: list[tuple[int, float]] = []
    ends: dict[int, bytes] = {}  # each prefill's last logits
    eng = _engine(name, 2)

    def prefill(slot: int, ids: list[int]) -> Iterator[int | None]:
        yield from eng.prefill_steps(ids, [], lambda _: None, Cancel())
        ends[slot] = eng.last_logits().tobytes()  # in the step of its last batch

    sched = Scheduler(eng)
    try:
        long = sched.submit(1, _timed(steps, 1, prefill(1, q)))
        while not steps:  # the long prefill is under way
            time.sleep(0.001)
        short = sched.submit(0, _timed(steps, 0, prefill(0, p)))
        short.result(timeout=600)
        long.result(timeout=600)
    finally:
        sched.stop()
        eng.close()
    assert [ends[0], ends[1]] == [want[0][0], want[1][0]], "a prefill differs from it alone"
    last = max(i for i, (slot, _) in enumerate(steps) if slot == 0)
    beside = sum(slot == 1 for slot, _ in steps[:last])
    own = sum(slot == 0 for slot, _ in steps)
    assert beside <= 3, (f"the long prefill ran {beside} batches before the short one's "
                         f"{own} ended")


def test_a_stream_of_short_prompts_does_not_hold_a_long_one_back(name: str) -> None:
    """Short first, but not without end: a prefill is due when it would end alone from its
    start, and the one due first runs, so short prompts arriving one after another beside a
    long one (an agent's quick turns) run only until the long one is due. (Serving the
    shortest instead, on SmolLM2 all 7200 tokens of short prompts ran first. Where a batch
    costs little beside the test's own overhead, as on the random Qwen3.5, the long one ends
    before the stream gets going.)"""
    long_n, short_n, shorts = 1200, 120, 60
    q = _ids(name, long_n, 9)
    order: list[str] = []  # "s" as each short prompt's prefill ends, "L" as the long one's
    eng = _engine(name, 3)

    def prefill(ids: list[int], mark: str) -> Iterator[int | None]:
        eng.truncate(0)
        yield len(ids)  # as the worker's job says what it has to prefill, before it begins
        yield from eng.prefill_steps(ids, [], lambda _: None, Cancel())
        order.append(mark)

    sched = Scheduler(eng)
    try:
        long = sched.submit(1, prefill(q, "L"))
        waiting = {}  # slots 0 and 2 take turns, so that one short prompt always waits
        for k in range(shorts):
            slot = 2 * (k % 2)
            if slot in waiting:
                waiting.pop(slot).result(timeout=600)
            if long.done():
                break
            waiting[slot] = sched.submit(slot, prefill(_ids(name, short_n, 100 + k), "s"))
        long.result(timeout=600)
        for w in waiting.values():
            w.result(timeout=600)
    finally:
        sched.stop()
        eng.close()
    before = order.index("L") * short_n
    assert before <= 2 * long_n, (
        f"{before} tokens of short prompts ran before the long one's {long_n} ended")


def test_a_generating_slot_is_not_slowed_to_a_token_per_prefill_batch(name: str) -> None:
    """The scheduler shares the llama thread's time, not its turns: a slot generating beside
    one that prefills a long prompt gets as much of the thread's time as the prefill until its
    answer ends (within a step or two), so where a prefill batch costs ten tokens it gets ten
    tokens a batch, not one (taking turns it got one: 24 tokens took 27 of 28 batches)."""
    gen = 24
    p, q = _ids(name, SLOT_BATCH + 72, 5), _ids(name, 14 * SLOT_BATCH + 8, 6)
    steps: list[tuple[int, float]] = []  # (slot, seconds) of each step, in the order they ran
    eng = _engine(name, 2)

    def answer() -> Iterator[int | None]:
        yield from eng.prefill_steps(p, [], lambda _: None, Cancel())
        yield from (None for _ in eng.generate(Sampling(temperature=0), gen, Cancel()))

    sched = Scheduler(eng)
    try:
        done = [sched.submit(1, _timed(steps, 1, eng.prefill_steps(q, [], lambda _: None,
                                                                   Cancel()))),
                sched.submit(0, _timed(steps, 0, answer()))]
        for d in done:
            d.result(timeout=600)
    finally:
        sched.stop()
        eng.close()
    last = max(i for i, (slot, _) in enumerate(steps) if slot == 0)
    answering = sum(dt for slot, dt in steps if slot == 0)
    prefill = [dt for slot, dt in steps[:last] if slot == 1]
    assert len(prefill) < sum(slot == 1 for slot, _ in steps), (
        "the answer ended only after the prefill: held to one token per prefill batch")
    assert sum(prefill) <= answering + 2 * max(prefill), (
        f"beside the answer ({answering:.2f} s of steps) the prefill ran {sum(prefill):.2f} s "
        f"({len(prefill)} batches)")


def _answer(eng: Engine, ids: list[int], gen: int,
            trace: list[bytes]) -> Iterator[int | str | None]:
    """A job as the worker's: it prefills, then generates greedily, yielding DECODE while its
    token waits to be evaluated; the logits of each sample and its token go to `trace`."""
    yield from eng.prefill_steps(ids, [], lambda _: None, Cancel())
    for step in eng.generate_steps(Sampling(temperature=0), gen, Cancel()):
        if step is None:
            yield DECODE
        else:
            trace += [eng.last_logits().tobytes(), np.int32(step[0]).tobytes()]


def _together(eng: Engine, prompts: list[list[int]], gen: int,
              idle: list[int] | None = None) -> tuple[list[list[bytes]], list[list[bytes]],
                                                      list[int]]:
    """Each prompt generated alone in slot 0, then all at once through the scheduler (slot s
    the s-th), as the engine's `decode` has it; with `idle`, the last slot holds that prompt,
    prefilled, while they generate, and its state is checked unchanged after. Returns the
    traces alone, together, and how many slots each decode step held."""
    want = []
    for ids in prompts:
        eng.truncate(0)
        trace: list[bytes] = []
        for v in _answer(eng, ids, gen, trace):
            if v == DECODE:
                eng.decode_next([0])
        want.append(trace)
    eng.truncate(0)
    if idle is not None:
        eng.use(len(eng.seqs) - 1)
        eng.prefill(idle, [], lambda _: None, Cancel())
        before = bytes(eng.snapshot())
        eng.use(0)
    sizes: list[int] = []  # the slots of each decode step
    decode_next = eng.decode_next

    def counted(slots: list[int]) -> None:
        sizes.append(len(slots))
        decode_next(slots)

    eng.decode_next = counted  # type: ignore[method-assign]
    traces: list[list[bytes]] = [[] for _ in prompts]
    sched = Scheduler(eng)
    try:
        done = [sched.submit(s, _answer(eng, ids, gen, traces[s]))
                for s, ids in enumerate(prompts)]
        for d in done:
            d.result(timeout=600)
    finally:
        sched.stop()
    if idle is not None:
        eng.use(len(eng.seqs) - 1)
        assert eng.live_ids() == idle and bytes(eng.snapshot()) == before, \
            "the padding rows changed an idle slot's state"
    return want, traces, sizes


def test_decode_steps_of_several_slots_answer_as_each_alone(name: str) -> None:
    """Three slots generating at once through the scheduler get every logit and token each
    gets alone in the same engine: their decode steps share a llama_decode where the
    self-check proved it (without flash attention on a CPU, plain attention and the window
    so far: bench/results/issue20/decode_batch.md), and run apart where it did not."""
    prompts = [_ids(name, 600, 11), _ids(name, 150, 12), _ids(name, 250, 13)]
    eng = Engine(model_file(name), SLOT_CTX * 3, 2, GPU_LAYERS, flash_attn="off", n_seq=3)
    try:
        report = selfcheck.run(eng)
        assert report.ok, report.failure
        assert report.decode is not None and report.decode.check == "decode 2-3 slots"
        eng.decode = report.decode_mode  # as the worker sets it
        want, traces, sizes = _together(eng, prompts, 48)
    finally:
        eng.close()
    for slot, (trace, ref) in enumerate(zip(traces, want, strict=True)):
        assert trace == ref, f"slot {slot}: logits or tokens differ from its run alone"
    assert report.decode.ok == (report.decode_mode != "apart")
    if report.decode.ok:
        assert max(sizes) >= 2, "proven, yet no decode step held two slots"
    else:
        assert max(sizes) == 1, "not proven, yet decode steps were batched"


@pytest.mark.skipif(GPU_LAYERS != 0, reason="about ggml's CPU flash attention kernel")
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_with_flash_attention_on_a_cpu_decode_steps_batch_in_a_fixed_shape(model: str) -> None:
    """With flash attention on a CPU a slot's decode alone is a single query row, whose
    attention ggml splits among the threads once its KV view reaches 512 cells; beside another
    slot's row it is not split, and the logits differ. In one fixed shape, a row per slot (the
    idle slots' padding rows), no row is ever alone: the check proves that a slot's logits then
    do not depend on the other rows (and takes the shape only where a lone step costs little
    more in it, as on a GPU, not on 2 CPU cores), and two slots generating at once answer as
    each does alone, beside a third that holds a prompt and keeps it exactly. On plain
    attention and a (full-size) sliding window; a hybrid's recurrent state could not drop a
    padding row, and its steps run apart
    (`test_decode_steps_of_several_slots_answer_as_each_alone`)."""
    eng = Engine(model_file(model), SLOT_CTX * 3, 2, GPU_LAYERS, flash_attn="on", n_seq=3)
    try:
        report = selfcheck.run(eng)
        assert report.ok, report.failure
        assert report.decode is not None
        detail = report.decode.detail
        assert "slot 0 decoded with slots 0-1" in detail, detail
        assert "differ from its decode alone" in detail
        assert report.decode_mode == "fixed" or "a fixed shape, a row per slot, is exact, " \
            "but a slot's step alone costs" in detail, detail
        eng.decode = "fixed"  # proven exact, taken or not for its cost
        want, traces, sizes = _together(
            eng, [_ids(model, 300, 11), _ids(model, 150, 12)], 32,
            idle=_ids(model, 300, 14))
    finally:
        eng.close()
    for slot, (trace, ref) in enumerate(zip(traces, want, strict=True)):
        assert trace == ref, f"slot {slot}: logits or tokens differ from its run alone"
    assert max(sizes) == 2, "two slots generated at once, yet no decode step held both"


@pytest.mark.skipif(GPU_LAYERS != 0, reason="about a worker that computes on the CPU")
def test_auto_flash_attention_is_off_with_several_slots_on_a_cpu() -> None:
    """`--flash-attn auto` (the default) is off in a CPU worker with several slots, where it
    lets decode steps batch exactly, and llama.cpp's own choice otherwise: one slot, a quantized
    V cache (which needs flash attention), a recurrent memory. What it resolved to is in the
    compute identity, so states of the other setting are a clean miss."""
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
                     type_k=type_v, type_v=type_v, n_seq=slots)
        try:
            assert eng.flash_attn == want, (name, slots, type_v)
            computes[name, slots, type_v] = eng.compute
        finally:
            eng.close()
    assert computes["smollm2", 2, "f16"].endswith("; flash attention off")
    assert computes["smollm2", 2, "f16"] != computes["smollm2", 1, "f16"]
    assert "flash attention" not in computes["smollm2", 2, "q8_0"]
