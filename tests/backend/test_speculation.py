"""Speculative decoding through the worker's own compute loop (issue 47): n-gram drafts verified
in one batch with every row's logits, the rejected drafts cut back so the KV holds exactly the
tokens the answer kept, and every cache hit (live, restored from a state file) answering as its
cold run, speculation on, on every memory kind: plain attention and a full-size sliding window
draft, and a recurrent state (qwen35) through llama.cpp's rollback states
(backend.worker.verify). The rules are exact tables in tests/policies/test_speculate.py and
test_ngram.py."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import llama_cpp
import pytest

from backend import keys, store
from backend.engine import Engine
from backend.protocol import Done, Event, Job, Saved, Start, Token
from backend.ramtier import RamTier
from backend.worker.core import Core
from backend.worker.draft_model import DraftModel
from backend.worker.drafts import Speculation
from backend.worker.loop import Loop
from backend.worker.tiers import Tiers
from backend.worker.verify import resolve
from policies.decide import Plan, Restore, Save
from policies.ngram import NgramParams
from policies.prefix import default_batch, outputs_max
from policies.schedule import Shapes
from policies.speculate import SpecConfig, VerifyCost
from tests.models import FLASH_ATTN, GPU_LAYERS, MEMORY, MODELS, draft_file, model_file

pytestmark = pytest.mark.model

BATCH = default_batch(GPU_LAYERS)
N_CTX = 8 * BATCH
GEN = 24
COLD = Plan((), (), 0, False, "off", None, None)
APART = Shapes("apart", True, "")
# ngram-mod with a short match so that a short answer drafts often, every draft verified
SPEC = SpecConfig(("ngram-simple", "ngram-mod"),
                  NgramParams(simple_size_n=4, simple_size_m=8, mod_n_match=3, mod_n_min=1,
                              mod_n_max=6), always=True)
# the verify cost bench.spec measured for ngram-simple with the default model on a 2-core EPYC:
# under the stop rule, drafts pay only inside a run of tokens the drafts had right
EPYC = VerifyCost((1, 2, 4, 8, 16, 32, 49), (1.0, 2.0, 3.1, 4.4, 7.5, 14.2, 21.6))
FILE = "\n".join(f"def step_{i}(state, value):\n    total = state.count + value * {i}\n"
                 f"    return total if total > {i * 3} else state.count" for i in range(14))


def _stored(eng: Engine, ids: list[int], cache: Path) -> tuple[keys.CacheKey, Path, int]:
    """ids prefilled cold in slot 0 and written to `cache` as a state file, the slot emptied
    again: (its key, its path, its size)."""
    eng.prefill(0, ids)
    key = keys.CacheKey(b"k" * 16)
    path, size, _ = store.write_state_file(cache, key, b"f" * 16, ids, eng.snapshot(0))
    eng.truncate(0, 0)
    return key, path, size


def edit_ids(name: str) -> list[int]:
    """An edit-shaped prompt: a file, then the start of the same file again to continue (its
    first tokens, so that the prompt's last tokens are found before, and the n-gram drafters
    draft from the first step: a random-weight model's answer never repeats anything)."""
    vocab = llama_cpp.Llama(model_file(name), vocab_only=True, verbose=False)

    def tok(text: str) -> list[int]:
        return list(vocab.tokenize(text.encode(), add_bos=False))

    body = tok(FILE)
    return tok("File app.py:\n") + body + tok("\n\nThe same file, copied exactly:\n") + \
        body[:16]


def _engine(name: str, spec: SpecConfig, n_seq: int = 1) -> Engine:
    """The engine as the worker makes it for `spec`: its rows with logits a llama_decode may
    ask for bounded as the worker's are (`policies.prefix.outputs_max`), so every verify the
    tests run fits them."""
    return Engine(model_file(name), n_seq * N_CTX, 2, GPU_LAYERS, n_batch=BATCH, n_seq=n_seq,
                  outputs=outputs_max(n_seq, spec.n_max),
                  flash_attn=FLASH_ATTN, rollback=spec.n_max if spec.on else 0)


class Worker:
    """The worker's compute loop over `eng` in this process, speculation as `spec` says."""

    def __init__(self, eng: Engine, spec: SpecConfig, cache: Path | None = None,
                 shapes: Shapes = APART, model: DraftModel | None = None,
                 rule: VerifyCost | None = None, gen: int = GEN, ram: int = 0,
                 twins: bool = False) -> None:
        """`rule`: the stop rule on, at this verify cost (else `spec` as it says); `gen`: the
        tokens an answer may have; `ram`: the RAM tier's budget in bytes (-1 no limit);
        `twins`: state files take the draft model's state along, as the worker's do."""
        self.gen = gen
        self.eng, self.events = eng, []  # type: list[tuple[str, Event]]
        self.ended, self.finished = threading.Condition(), set()  # type: ignore[var-annotated]
        self.ram = RamTier(ram)
        tiers = Tiers(cache or Path("/nonexistent"), b"f" * 16, self.ram, eng.prepare,
                      self._emit)
        if twins and model is not None:
            tiers.draft_fingerprint, tiers.draft_spare = DRAFT_FP, model.engine.spare_bytes
        self.tiers = tiers
        self.spec = resolve(spec, eng, "", 0, model) if spec.on else None
        if rule is not None and self.spec is not None:
            self.spec = replace(self.spec, config=replace(spec, always=False), cost=rule)
        core = Core(len(eng.seqs), eng.batching, eng.memory.kind == "plain", ram, True,
                    eng.n_ctx, spec=self.spec)
        eng.decode_shape = shapes.decode
        # the rows of each llama_decode: (slot, tokens) per row, and the slots of every row's logits
        self.decodes: list[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = []
        evaluate = eng.evaluate

        def recorded(rows, pads=(), every=(), fill=0):  # type: ignore[no-untyped-def]
            self.decodes.append((tuple((s, len(t)) for s, t in rows), tuple(every)))
            return evaluate(rows, pads, every, fill)

        eng.evaluate = recorded  # type: ignore[method-assign]
        self.loop = Loop(eng, core, tiers, shapes,
                         lambda run, event, wake: self._emit(run, event))
        self.loop.start()

    def _emit(self, run: str, event: Event) -> None:
        self.events.append((run, event))
        if type(event).__name__ in ("Done", "Cancelled", "Error"):
            with self.ended:
                self.finished.add(run)
                self.ended.notify_all()

    def submit(self, run: str, ids: list[int], plan: Plan = COLD,
               sampling: dict[str, object] | None = None, slot: int = 0,
               gen: int | None = None) -> None:
        self.loop.arrive(Job(run, tuple(ids), b"", "", plan, sampling or {"temperature": 0.0},
                             self.gen if gen is None else gen, (), None, slot))

    def run(self, run: str, ids: list[int], plan: Plan = COLD,
            sampling: dict[str, object] | None = None, slot: int = 0,
            submit: bool = True) -> tuple[list[int], Done, Start]:
        if submit:
            self.submit(run, ids, plan, sampling, slot)
        with self.ended:
            assert self.ended.wait_for(lambda: run in self.finished, 600), run
        of = [e for r, e in self.events if r == run]
        done = next((e for e in of if isinstance(e, Done)), None)
        assert done is not None, of[-1]
        start = next(e for e in of if isinstance(e, Start))
        return [e.id for e in of if isinstance(e, Token) and e.id is not None], done, start

    def stop(self) -> None:
        self.loop.stop()
        del self.eng.evaluate  # the engine's own method again


@pytest.fixture(scope="module", params=MODELS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("rule", [None, EPYC], ids=["every draft", "the stop rule"])
def test_every_hit_answers_as_its_cold_run_with_speculation_on(
        name: str, rule: VerifyCost | None, tmp_path: Path) -> None:
    """A cold run in a fresh context, then in another: the same prompt cold, again as a live
    hit, and restored from a state file at a batch edge; greedy and seeded at temperature 0.8
    with every draft verified, greedy under the stop rule (its shadows and runs: a function of
    the tokens). Each answers token for token as the cold run and drafts and accepts as many
    tokens."""
    ids = edit_ids(name)
    edge = (len(ids) - 1) // BATCH * BATCH
    samplings = [{"temperature": 0.0}] + ([{"temperature": 0.8, "seed": 7}] if rule is None
                                          else [])
    for sampling in samplings:
        ref = _engine(name, SPEC)
        try:
            w = Worker(ref, SPEC, rule=rule, gen=GEN if rule is None else 64)
            want, cold, _ = w.run("cold", ids, sampling=sampling)
            w.stop()
        finally:
            ref.close()
        eng = _engine(name, SPEC)
        try:
            key, path, size = _stored(eng, ids[:edge], tmp_path)
            w = Worker(eng, SPEC, cache=tmp_path, rule=rule, gen=GEN if rule is None else 64)
            again, first, _ = w.run("again", ids, sampling=sampling)
            live, hit, start = w.run("live", ids, replace(COLD, keep_max=edge, live_ok=True),
                                     sampling)
            assert start.keep == (edge if eng.memory.kind != "recurrent" else 0)
            eng.truncate(0, 0)
            restore = Restore(edge, bytes(key), str(path.relative_to(tmp_path)), size)
            restored, disk, start = w.run(
                "disk", ids, Plan((restore,), (), edge, False, "hit", None, None), sampling)
            assert (start.keep, start.restored) == (edge, edge)
            w.stop()
        finally:
            eng.close()
        for run, got, done in (("cold again", again, first), ("live hit", live, hit),
                               ("restored hit", restored, disk)):
            assert got == want, f"{name} {sampling}: the {run} differs from the cold run"
            assert done.draft == cold.draft, f"{name}: the {run} drafted otherwise"
        if name == "qwen35":  # a recurrent state drafts (its rollback states cut the drafts
            # off), but a random-weight answer repeats nothing for an n-gram to find: the draft
            # model's test below drafts on it
            assert eng.memory.rollback == SPEC.n_max and w.spec is not None and w.spec.drafts
            assert "rollback states" in w.spec.note and "(0.0 MiB" not in w.spec.note
            continue
        assert sum(s["drafted"] for s in cold.draft.values()) > 0, cold.draft
        if sampling["temperature"] == 0.0:
            assert sum(s["accepted"] for s in cold.draft.values()) > 0, cold.draft


def test_the_kv_holds_exactly_the_answers_tokens_after_verifies() -> None:
    """After an answer whose drafts were partly rejected, the slot's live tokens are the prompt
    and the answer but its last token (sampled, never evaluated), and its state is a cold
    prefill's of the same prompt... for the prompt: generated tokens are never exact."""
    name = "smollm2"
    ids = edit_ids(name)
    eng = _engine(name, SPEC)
    try:
        w = Worker(eng, SPEC)
        got, done, _ = w.run("r", ids)
        w.stop()
        assert eng.live_ids(0) == ids + got[:-1]
        assert eng.seqs[0].exact_n == len(ids)
        drafted = sum(s["drafted"] for s in done.draft.values())
        accepted = sum(s["accepted"] for s in done.draft.values())
        assert 0 < accepted < drafted, done.draft  # some rejected: cut back
    finally:
        eng.close()


def test_an_engine_made_for_fewer_rows_with_logits_computes_the_same_bits_and_refuses_more(
        ) -> None:
    """The worker's engine sizes llama.cpp's logits for the rows a llama_decode of its may ask
    (`outputs_max`), not the whole batch (297 MiB at 512 rows of a 152K vocabulary). A verify
    within them computes what an engine made for the whole batch computes, bit for bit; one
    past them is a RuntimeError before anything is evaluated (llama.cpp would abort the
    process), and the engine goes on."""
    name, rows = "smollm2", 12
    got = []
    for outputs in (0, rows):
        eng = Engine(model_file(name), N_CTX, 2, GPU_LAYERS, n_batch=BATCH,
                     flash_attn=FLASH_ATTN, outputs=outputs)
        try:
            ids = edit_ids(name)
            eng.prefill(0, ids[:-rows - 1])
            n = eng.seqs[0].n_live
            if outputs:
                with pytest.raises(RuntimeError, match="more rows with logits"):
                    eng.evaluate([(0, ids[n:n + rows + 1])], every=[0])
                assert eng.seqs[0].n_live == n
            eng.evaluate([(0, ids[n:n + rows])], every=[0])
            got.append(([eng.last_logits(0, i).tobytes() for i in range(rows)],
                        bytes(eng.snapshot(0))))
        finally:
            eng.close()
    assert got[0] == got[1]


def test_the_stop_rule_drafts_nothing_where_a_verify_cannot_pay() -> None:
    """A verify cost where k drafts cost k + 1 steps (a tiny model on a CPU): no slot drafts,
    and the answer is the one without speculation, bit for bit (the same one-token steps)."""
    name = "smollm2"
    ids = edit_ids(name)
    eng = _engine(name, SPEC)
    try:
        w = Worker(eng, SpecConfig())
        want, _, _ = w.run("plain", ids)
        w.stop()
        eng.truncate(0, 0)
        w = Worker(eng, SpecConfig())
        w.loop.core.spec = Speculation(replace(SPEC, always=False),
                                       VerifyCost((1, 2, 8), (1.0, 2.0, 8.0)), BATCH, True, "")
        got, done, _ = w.run("auto", ids)
        w.stop()
    finally:
        eng.close()
    assert got == want and done.draft == {}


def test_slots_batched_as_they_come_share_their_verify_rows() -> None:
    """`--deterministic off` (decode steps batched as they come): a slot's verify and the other
    slot's step share one llama_decode, each slot's rows sampled as its own, and each slot's KV
    holds exactly its prompt and answer after."""
    name = "smollm2"
    ids = edit_ids(name)
    eng = _engine(name, SPEC, 2)
    try:
        w = Worker(eng, SPEC, shapes=Shapes("batched", False, ""))
        # the prompts live in their slots first, so that both answers start together: a cold
        # prefill beside the other slot's answer can outlast it on a slow or loaded machine,
        # and then no step holds both slots' rows
        w.submit("a0", ids, slot=0, gen=1)
        w.submit("b0", ids[:-3], slot=1, gen=1)
        w.run("a0", ids, submit=False)
        w.run("b0", ids[:-3], submit=False)
        w.submit("a", ids, replace(COLD, keep_max=len(ids), live_ok=True), slot=0, gen=160)
        w.submit("b", ids[:-3], replace(COLD, keep_max=len(ids) - 3, live_ok=True), slot=1,
                 gen=160)
        a, done_a, _ = w.run("a", ids, submit=False)
        b, done_b, _ = w.run("b", ids, submit=False)
        w.stop()
        assert eng.live_ids(0) == ids + a[:-1] and eng.live_ids(1) == ids[:-3] + b[:-1]
    finally:
        eng.close()
    assert any({s for s, _ in rows} == {0, 1} and every for rows, every in w.decodes), \
        "no verify held both slots' rows"
    assert done_a.draft and done_b.draft


# --- a draft model (draft-simple) -------------------------------------------------------------

MODEL_SPEC = SpecConfig(("draft-simple",), always=True, draft_n_max=4)
DRAFT_FP = b"d" * 16


def _fresh_run(name: str, ids: list[int], gen: int = GEN, plan: Plan = COLD,
               cache: Path | None = None
               ) -> tuple[list[int], Done, Start, Worker, DraftModel]:
    """`ids` run alone with the model drafting for itself, on a fresh engine and draft model
    (a new worker: with `cache`, its state files and their twins are all it finds):
    (the answer, its Done and Start, the stopped worker, the closed draft model)."""
    eng = _engine(name, MODEL_SPEC)
    model = DraftModel.load(draft_file(name), eng, GPU_LAYERS, 2)
    try:
        w = Worker(eng, MODEL_SPEC, cache=cache, model=model, gen=gen, twins=cache is not None)
        got, done, start = w.run("alone", ids, plan)
        w.stop()
    finally:
        model.close()
        eng.close()
    return got, done, start, w, model


def _drafted_alone(name: str, ids: list[int], gen: int = GEN) -> tuple[list[int], Done]:
    """The cold run of `ids` with the model drafting for itself, alone: (the answer, its
    Done)."""
    return _fresh_run(name, ids, gen)[:2]


@pytest.mark.parametrize("name", MODELS)
def test_a_draft_model_drafts_and_every_hit_answers_as_its_cold_run(name: str, tmp_path: Path
                                                                    ) -> None:
    """A model drafting for itself (plain attention, a sliding window; the recurrent qwen35, a
    random llama of its vocabulary, whose drafts its rollback states cut off): its own KV per
    slot, prefilled with the prompt as a cold run does (again after the target's hit), its
    greedy tokens verified; the answers and the drafts of a cold run, a live hit and a restored
    hit are the same."""
    ids = edit_ids(name)
    edge = (len(ids) - 1) // BATCH * BATCH
    want, cold = _drafted_alone(name, ids)
    eng = _engine(name, MODEL_SPEC)
    model = DraftModel.load(draft_file(name), eng, GPU_LAYERS, 2)
    try:
        key, path, size = _stored(eng, ids[:edge], tmp_path)
        w = Worker(eng, MODEL_SPEC, cache=tmp_path, model=model)
        again, first, _ = w.run("again", ids)
        live, hit, _ = w.run("live", ids, replace(COLD, keep_max=edge, live_ok=True))
        eng.truncate(0, 0)
        restore = Restore(edge, bytes(key), str(path.relative_to(tmp_path)), size)
        restored, disk, start = w.run("disk", ids,
                                      Plan((restore,), (), edge, False, "hit", None, None))
        assert start.restored == edge
        w.stop()
        assert eng.live_ids(0) == ids + restored[:-1]
    finally:
        model.close()
        eng.close()
    for run, got, done in (("cold again", again, first), ("live hit", live, hit),
                           ("restored hit", restored, disk)):
        assert (got, done.draft) == (want, cold.draft), f"the {run} differs from the cold run"
    drafted = cold.draft["draft-simple"]
    if name == "qwen35":  # random weights on both sides: drafted, and (most) cut off again
        assert drafted["drafted"] > drafted["accepted"], drafted
    else:
        assert drafted["accepted"] > drafted["drafted"] // 2, drafted


def test_a_draft_model_takes_the_prompt_from_another_slots_sequence() -> None:
    """Two slots: the same prompt answered in slot 0, then in slot 1 (cold for the target).
    The draft model's sequence of slot 1 takes the prompt from slot 0's, up to its last batch
    edge, and prefills only the rest; the drafts and the answer are slot 0's, as a cold run's."""
    name = "smollm2"
    ids = edit_ids(name)
    eng = _engine(name, MODEL_SPEC, 2)
    model = DraftModel.load(model_file(name), eng, GPU_LAYERS, 2)
    try:
        w = Worker(eng, MODEL_SPEC, model=model)
        first, done0, _ = w.run("a", ids, slot=0)
        assert model.prompt["copied"] == 0
        second, done1, _ = w.run("b", ids, slot=1)
        w.stop()
    finally:
        model.close()
        eng.close()
    edge = eng.batching.edges(ids).floor(len(ids))
    assert 0 < edge and model.prompt["copied"] == edge, (model.prompt, edge)
    assert (second, done1.draft) == (first, done0.draft)
    assert done0.draft["draft-simple"]["accepted"] > 0


GEN_LONG = 640  # slot 0's answer: long enough to go on through slot 1's prefills


def test_a_draft_model_prefills_a_prompt_a_batch_a_step_beside_another_slot() -> None:
    """Two slots, each answer its own (apart): slot 0 generates while slot 1's job begins with
    a prompt of several batches. The draft model prefills slot 1's prompt one batch a step
    (before, all of it in one step, every other slot stopped meanwhile), and slot 0's steps go
    on between those batches; both answers and their drafts are their runs' alone."""
    name = "smollm2"
    ids = edit_ids(name)
    vocab = llama_cpp.Llama(model_file(name), vocab_only=True, verbose=False)
    count = list(vocab.tokenize(b"Count from 1 to 500, one number a line:\n1\n2\n3\n",
                                add_bos=False))
    alone = {}
    for slot, prompt in ((0, count), (1, ids)):
        got, done = _drafted_alone(name, prompt, GEN_LONG)
        alone[slot] = (got, done.draft)
    eng = _engine(name, MODEL_SPEC, 2)
    model = DraftModel.load(model_file(name), eng, GPU_LAYERS, 2)
    timeline: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    evaluate = model.engine.evaluate

    def drafted(rows, pads=(), every=(), fill=0):  # type: ignore[no-untyped-def]
        timeline.append(("draft", tuple((s, len(t)) for s, t in rows)))
        return evaluate(rows, pads, every, fill)

    model.engine.evaluate = drafted  # type: ignore[method-assign]
    try:
        w = Worker(eng, MODEL_SPEC, model=model, gen=GEN_LONG)
        target = w.eng.evaluate

        def stepped(rows, pads=(), every=(), fill=0):  # type: ignore[no-untyped-def]
            timeline.append(("target", tuple((s, len(t)) for s, t in rows)))
            return target(rows, pads, every, fill)

        w.eng.evaluate = stepped  # type: ignore[method-assign]
        w.submit("a", count, slot=0)
        deadline = time.monotonic() + 600  # slot 0 generates before slot 1's job comes
        while sum(1 for r, e in w.events if r == "a" and isinstance(e, Token)) < 4:
            assert time.monotonic() < deadline and "a" not in w.finished
            time.sleep(0.01)
        w.submit("b", ids, slot=1)
        a = w.run("a", count, submit=False)
        b = w.run("b", ids, submit=False)
        w.stop()
    finally:
        model.close()
        eng.close()
    assert (a[0], a[1].draft) == alone[0] and (b[0], b[1].draft) == alone[1]
    # slot 1's prompt in the draft model: its batches, and slot 0's steps between them
    ones = [i for i, (who, rows) in enumerate(timeline) if who == "draft" and rows[0][0] == 1]
    first = next(i for i in ones if timeline[i][1][0][1] == 1)  # its first draft's step
    fills = [i for i in ones if i < first]
    assert sum(timeline[i][1][0][1] for i in fills) == len(ids) and len(fills) >= 3, \
        (len(fills), len(ids))
    for i, j in zip(fills, fills[1:], strict=False):
        between = [rows for who, rows in timeline[i + 1:j] if who == "target"]
        assert any(s == 0 for rows in between for s, _ in rows), \
            f"slot 0 made no step between two of slot 1's draft batches ({i}, {j})"


@pytest.mark.parametrize("name", [m for m in MODELS if MEMORY[m] != "recurrent"])
def test_a_draft_models_state_goes_with_the_targets_into_the_ram_tier(name: str) -> None:
    """One slot and a RAM tier: a prompt answered, then another takes the slot (the first
    gives way into RAM with its draft model's sequence), then the first again, restored from
    RAM: the draft model restores its prompt with it and prefills only what lies past the
    entry, and the drafts and the answer are the first run's (a cold run's). A job of another
    tenant never keeps, restores or copies a draft model's sequence. Plain attention and a
    full-size sliding window (whose restore pads the window's masked cells back)."""
    ids = edit_ids(name)
    vocab = llama_cpp.Llama(model_file(name), vocab_only=True, verbose=False)
    other = list(vocab.tokenize(("Another file, unrelated:\n" + FILE[::-1]).encode(),
                                add_bos=False))
    eng = _engine(name, MODEL_SPEC)
    model = DraftModel.load(model_file(name), eng, GPU_LAYERS, 2)
    try:
        w = Worker(eng, MODEL_SPEC, model=model, ram=-1)
        first, done1, _ = w.run("a", ids)
        assert model.prompt["prefilled"] == len(ids) and not w.ram.entries
        w.run("b", other)
        (entry,) = w.ram.entries.values()  # the first prompt's state gave way, with its draft's
        edge = eng.batching.edges(ids).floor(len(ids))
        assert len(entry.ids) == entry.draft_n == edge, (len(entry.ids), entry.draft_n, edge)
        assert entry.size == len(entry.state) + len(entry.draft) and len(entry.draft) > 0
        before = dict(model.prompt)
        again, done2, start = w.run("a again", ids, replace(COLD, keep_max=len(ids),
                                                            live_ok=True))
        assert start.ram == edge and start.tier == "ram", start
        got = {k: model.prompt[k] - before[k] for k in before}
        assert got == {"kept": 0, "restored": edge, "copied": 0,
                       "prefilled": len(ids) - edge}, got
        # another tenant's job of the same prompt: the target and its draft model start cold
        w.loop.arrive(Job("c", tuple(ids), b"", "carol", replace(COLD, keep_max=len(ids),
                                                                 live_ok=True),
                          {"temperature": 0.0}, GEN, (), None, 0))
        before = dict(model.prompt)
        other_tenant, done3, _ = w.run("c", ids, submit=False)
        got = {k: model.prompt[k] - before[k] for k in before}
        assert got == {"kept": 0, "restored": 0, "copied": 0, "prefilled": len(ids)}, got
        w.stop()
    finally:
        model.close()
        eng.close()
    assert (again, done2.draft) == (first, done1.draft)
    assert (other_tenant, done3.draft) == (first, done1.draft)
    assert done1.draft["draft-simple"]["accepted"] > 0


def test_a_draft_model_of_another_vocabulary_is_refused_in_one_line() -> None:
    eng = _engine("smollm2", SPEC)
    try:
        with pytest.raises(ValueError) as e:
            DraftModel.load(model_file("gemma3"), eng, GPU_LAYERS, 2)
    finally:
        eng.close()
    assert "cannot draft for this model: its vocabulary" in str(e.value) \
        and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("rest", [False, True], ids=["written at once", "written at rest"])
@pytest.mark.parametrize("name", [m for m in MODELS if MEMORY[m] != "recurrent"])
def test_a_draft_models_state_goes_to_disk_with_the_targets_and_back_after_a_restart(
        tmp_path: Path, rest: bool, name: str) -> None:
    """One slot, state files with twins: a session's first turn, then its second (a live hit).
    Where files are written at once (a GPU), a file's twin is what the draft model held when
    the model's snapshot was taken: none for the first turn's (it held nothing yet), the first
    turn's prompt for the second's (plain attention; a window's snapshot holds the state at
    its sequence's end only, and the sequence then holds the answer too: none). Where they
    wait for the compute thread to rest (a CPU), the twin is each turn's own: cut from the
    sequence once it holds the job's prompt (plain attention), or taken as its prefill passed
    the snapshot's tokens (a window). A new worker (a restart) restores the second turn's file
    for the third: the draft model restores the twin with it and prefills only what lies past
    it, and the answer and its drafts are a cold run's."""
    window = MEMORY[name] == "window"
    ids = edit_ids(name)
    vocab = llama_cpp.Llama(model_file(name), vocab_only=True, verbose=False)
    ids2 = ids + list(vocab.tokenize(  # past the first turn's last batch edge
        f"\n\nNow rename step_3 to advance and copy it again:\n{FILE[:400]}".encode(),
        add_bos=False))
    ids3 = ids2 + list(vocab.tokenize(b" Keep every comment.\n", add_bos=False))
    want, cold = _drafted_alone(name, ids3)
    eng = _engine(name, MODEL_SPEC)
    model = DraftModel.load(model_file(name), eng, GPU_LAYERS, 2)
    e1, e2 = (eng.batching.edges(x).floor(len(x)) for x in (ids, ids2))
    assert e1 < e2 and len(ids3) + GEN < N_CTX, (e1, e2, len(ids3))
    try:
        w = Worker(eng, MODEL_SPEC, cache=tmp_path, model=model, twins=True)
        if rest:
            w.tiers.at_rest = w.loop.resting
        w.run("a", ids, replace(COLD, saves=(Save(e1, "full"),)))
        w.run("b", ids2, replace(COLD, saves=(Save(e2, "full"),), keep_max=e1, live_ok=True))
        w.stop()
    finally:
        model.close()
        eng.close()
    saved = {e.n_tokens: e for _, e in w.events if isinstance(e, Saved)}
    first = store.read_twin_into(tmp_path / saved[e1].file, DRAFT_FP, ids)
    n, _ = store.read_twin_into(tmp_path / saved[e2].file, DRAFT_FP, ids2) or (0, None)
    p = e2 if rest else 0 if window else eng.batching.edges(ids2[:e2]).floor(len(ids))
    assert n == p, (n, p)
    assert (first[0] if first else 0) == (e1 if rest else 0)
    assert w.tiers.writes["twins_written"] == (2 if rest else 0 if window else 1)
    assert not model.kept and not model.wanted  # each twin taken went with its file
    s2 = saved[e2]  # a restart: the files alone are left
    hit = Plan((Restore(e2, bytes.fromhex(s2.key), s2.file, s2.size_bytes),), (), e2, False,
               "hit", None, None)
    got, done, start, w, model = _fresh_run(name, ids3, plan=hit, cache=tmp_path)
    assert start.restored == e2 and w.tiers.writes["twins_read"] == (1 if p else 0)
    kept = eng.batching.edges(ids3).floor(p)
    assert model.prompt == {"kept": 0, "restored": kept, "copied": 0,
                            "prefilled": len(ids3) - kept}, model.prompt
    assert (got, done.draft) == (want, cold.draft)
    if not rest:
        return
    path = tmp_path / saved[e2].file  # a flipped bit in the twin: the draft model's miss alone
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    got, done, start, w, model = _fresh_run(name, ids3, plan=hit, cache=tmp_path)
    assert start.restored == e2 and w.tiers.writes["twin_faults"] == 1
    assert model.prompt == {"kept": 0, "restored": 0, "copied": 0, "prefilled": len(ids3)}
    assert (got, done.draft) == (want, cold.draft)
