"""backend.worker.core: the worker's decisions as tables of inputs and exact effects, no model.

Batches of 8 tokens (`Batching(8)`, no end-of-turn ids): a prompt's edges are multiples of 8.
The world is what the compute loop would read of each slot's KV and of the worker's memory."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from backend.protocol import (
    Cancelled,
    Done,
    Error,
    Fault,
    Job,
    Kept,
    Prefill,
    Saved,
    Start,
    Token,
)
from backend.worker.core import Core
from backend.worker.drafts import Speculation
from backend.worker.messages import (
    Again,
    Arrive,
    CancelRun,
    Cut,
    Emit,
    Failed,
    Filling,
    Finish,
    GiveWay,
    Held,
    Live,
    Load,
    Loaded,
    Park,
    Read,
    ReadDone,
    Sample,
    Sampled,
    Snapshot,
    Snapshotted,
    StartSampling,
    Stepped,
    Unpark,
    Verified,
    World,
)
from policies.decide import Plan, Restore, Save
from policies.ngram import NgramParams
from policies.prefix import Batching
from policies.schedule import Task
from policies.sources import Candidate
from policies.speculate import SpecConfig

SALT, OTHER = b"s" * 16, b"o" * 16
IDS = tuple(range(100, 140))  # 40 tokens: edges 8, 16, 24, 32; keep_max 32


def ids(n: int, start: int = 100) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.intc)


def live(n: int, start: int = 100, exact: int | None = None, nbytes: int = 0) -> Live:
    a = np.zeros(64, dtype=np.intc)
    a[:n] = ids(n, start)
    return Live(a, n, n if exact is None else exact, 0, nbytes)


EMPTY = live(0)


def plan(keep_max: int = 32, live_ok: bool = True, restore: tuple[Restore, ...] = (),
         saves: tuple[Save, ...] = ()) -> Plan:
    return Plan(restore, saves, keep_max, live_ok, "miss", None, None)


def job(p: Plan | None = None, slot: int = 0, run: str = "r", tenant: str = "a",
        salt: bytes = SALT, max_tokens: int = 3, stop: tuple[str, ...] = ()) -> Job:
    return Job(run, IDS, salt, tenant, p or plan(), {"temperature": 0}, max_tokens, stop,
               None, slot)


def core(slots: int = 2, exact: bool = True, ram: int = 1 << 30, cuts: bool = True) -> Core:
    c = Core(slots, Batching(8), cuts, ram, exact, n_ctx=64)
    return c


def world(*slots: Live, held: tuple[Held, ...] = (), now: float = 0.0) -> World:
    return World(list(slots), held, now)


def start(keep: int, restored: int = 0, faults: tuple[Fault, ...] = (), ram: int = 0,
          run: str = "r", restore_s: float = 0.0, tier: str = "live") -> Emit:
    return Emit(run, Start(keep, restored, restore_s, faults, ram, tier))


def test_nothing_is_reused_unless_the_self_check_passed() -> None:
    c = core(exact=False)
    c.owners[0] = ("a", SALT)
    fx = c.apply(Arrive(job(plan(restore=(Restore(32, b"k", "k.state", 10),),
                                 saves=(Save(16, "cold"),)))), world(live(40), EMPTY))
    assert fx == [Cut(0, 0), start(0)], "no live reuse, no restore, no save"
    assert [(t.slot, t.left, t.n) for t in c.tasks(world(EMPTY, EMPTY))] == [(0, 40, 8)]


def test_the_live_kv_is_kept_to_a_batch_edge_and_the_limit() -> None:
    c = core()
    c.owners[0] = ("a", SALT)
    # the live KV holds the first 37 tokens exactly: kept to the edge 32 (also the limit)
    assert c.apply(Arrive(job()), world(live(37), EMPTY)) == [Cut(0, 32), start(32)]
    c = core()
    c.owners[0] = ("a", SALT)
    # the plan says not to keep it (another proxy's view): nothing kept
    assert c.apply(Arrive(job(plan(live_ok=False))), world(live(37), EMPTY))[:2] == \
        [Cut(0, 0), start(0)]


def test_another_tenants_live_kv_is_never_kept_nor_borrowed() -> None:
    c = core()
    c.owners = [("b", SALT), ("b", SALT)]
    fx = c.apply(Arrive(job(tenant="a")), world(live(37), live(40, nbytes=100)))
    assert fx == [GiveWay(0, 32, SALT, "b"), Cut(0, 0), start(0)], \
        "b's state gives way to the RAM tier under b's keys; a starts from nothing"


def test_the_live_kv_gives_way_unless_the_prompt_extends_all_of_it() -> None:
    c = core()
    c.owners[0] = ("a", SALT)
    # it holds 24 tokens of this prompt and 13 of another's: the 37 cut to 32 give way first
    other = live(37)
    other.ids[24:37] = 7
    fx = c.apply(Arrive(job()), world(other, EMPTY))
    assert fx[0] == GiveWay(0, 32, SALT, "a") and fx[1:] == [Cut(0, 24), start(24)]
    c = core(ram=0)  # no RAM tier: nothing gives way
    c.owners[0] = ("a", SALT)
    assert c.apply(Arrive(job()), world(other, EMPTY)) == [Cut(0, 24), start(24)]


def test_a_disk_entry_is_read_on_the_reader_thread_then_loaded() -> None:
    r = Restore(32, b"k", "k.state", 1000)
    c = core()
    j = job(plan(restore=(r,)))
    assert c.apply(Arrive(j), world(EMPTY, EMPTY)) == [Read(0, "r", j, 0)]
    assert c.tasks(world(EMPTY, EMPTY)) == [], "reading: no compute to schedule"
    cand = Candidate("disk", 32, True, 1000, -1)
    assert c.apply(ReadDone(0, "r", 0, "payload", 0.2), world(EMPTY, EMPTY)) == \
        [Load(0, "r", cand, 32, payload="payload")]
    fx = c.apply(Loaded(0, "r", cand, 32, 0.05), world(live(32), EMPTY, now=0.5))
    assert fx == [Cut(0, 32), start(32, restored=32, restore_s=0.5, tier="disk")]
    assert c.costs.disk.n == 1, "the read and the load are one disk restore's cost"


def test_a_broken_entry_is_a_fault_and_the_next_one_is_tried() -> None:
    long, short = Restore(32, b"k2", "k2.state", 1000), Restore(16, b"k1", "k1.state", 500)
    c = core()
    j = job(plan(restore=(long, short)))
    assert c.apply(Arrive(j), world(EMPTY, EMPTY)) == [Read(0, "r", j, 0)]
    bad = Fault("checksum", "bad", "k2.state")
    assert c.apply(ReadDone(0, "r", 0, None, 0.1, bad), world(EMPTY, EMPTY)) == \
        [Read(0, "r", j, 1)]
    missing = Fault("missing", "gone", "k1.state")
    fx = c.apply(ReadDone(0, "r", 1, None, 0.1, missing), world(EMPTY, EMPTY))
    assert fx == [Cut(0, 0), start(0, faults=(bad, missing))]


def test_a_pulled_shared_entry_is_reported_as_a_local_one() -> None:
    r = Restore(32, b"k", "", 1000, "shared")
    pulled = Saved(32, "6b", "shared", "6b.state", 1000, 1, 0.1)
    c = core()
    j = job(plan(restore=(r,)))
    c.apply(Arrive(j), world(EMPTY, EMPTY))
    c.apply(ReadDone(0, "r", 0, "p", 0.2, pulled=pulled), world(EMPTY, EMPTY))
    fx = c.apply(Loaded(0, "r", Candidate("shared", 32, True, 1000, -1), 32, 0.05),
                 world(live(32), EMPTY))
    assert fx == [Cut(0, 32), start(32, restored=32, tier="shared"), Emit("r", pulled)]
    assert c.costs.shared.n == 1 and c.costs.disk.n == 0, "a pull is its own cost"


def test_memory_beats_an_equal_disk_entry_and_a_whole_ram_entry_beats_a_cut_one() -> None:
    held = (Held("queued", 4, SALT, "a", ids(40), 100),  # goes on past the prompt's limit
            Held("ram", 9, SALT, "a", ids(32), 100),  # exactly 32 tokens of the prompt
            Held("ram", 5, OTHER, "a", ids(32), 100))  # another salt: never
    c = core()
    j = job(plan(restore=(Restore(32, b"k", "k.state", 100),)))
    fx = c.apply(Arrive(j), world(EMPTY, EMPTY, held=held))
    assert fx == [Load(0, "r", Candidate("ram", 32, True, 100, 9), 32)]
    fx = c.apply(Loaded(0, "r", Candidate("ram", 32, True, 100, 9), 32, 0.01),
                 world(live(32), EMPTY))
    assert fx == [Cut(0, 32), start(32, ram=32, tier="ram")]


def test_a_prompt_borrows_the_part_it_shares_of_another_slots_live_kv() -> None:
    c = core()
    c.owners = [("a", SALT), ("a", SALT)]
    other = live(40, exact=36, nbytes=100)
    other.ids[20:40] = 7  # it shares 20 tokens: the edge 16
    fx = c.apply(Arrive(job(slot=0)), world(EMPTY, other))
    cand = Candidate("slot", 16, False, 100, 1)
    assert fx == [Load(0, "r", cand, 16, src=1)]
    fx = c.apply(Loaded(0, "r", cand, 16, 0.01), world(live(16), other))
    assert fx == [Cut(0, 16), start(16, ram=16, tier="slot")]
    assert c.borrowed == {"slot": 1, "ram": 0, "queued": 0, "tokens": 16}
    # no cut where the memory cannot be cut back (a window, a recurrent state)
    c = core(cuts=False)
    c.owners = [("a", SALT), ("a", SALT)]
    assert c.apply(Arrive(job(slot=0)), world(EMPTY, other)) == [Cut(0, 0), start(0)]


def test_a_prompt_another_slot_is_prefilling_follows_it_and_copies_its_part() -> None:
    """Two subagents started at once, with the same system prompt and tools: the second waits
    for the first's prefill to pass the 32 tokens they share (none of its own compute: no task)
    and copies them, instead of computing them again beside it."""
    c = core()
    c.owners = [("a", SALT), ("a", SALT)]
    assert c.apply(Arrive(job(slot=0, run="first")), world(EMPTY, EMPTY)) == \
        [Cut(0, 0), start(0, run="first")]
    second = replace(job(slot=1, run="second"), ids=IDS[:36] + (7, 7, 7, 7))  # shares 36: edge 32
    assert c.apply(Arrive(second), world(live(8), EMPTY)) == [], "it follows: nothing yet"
    assert [t.slot for t in c.tasks(world(live(8), EMPTY))] == [0], "the follower computes nothing"
    # the first's batches: at 24 it still waits; at 32 it copies the 32 from slot 0
    assert c.apply(Stepped(0, 0.1), world(live(24), EMPTY)) == [Emit("first", Prefill(24))]
    fx = c.apply(Stepped(0, 0.1), world(live(32, nbytes=100), EMPTY))
    cand = Candidate("slot", 32, True, 100, 0)  # its state ends there: whole
    assert fx == [Emit("first", Prefill(32)), Load(1, "second", cand, 32, src=0)]
    fx = c.apply(Loaded(1, "second", cand, 32, 0.01), world(live(32), live(32)))
    assert fx == [Cut(1, 32), start(32, ram=32, run="second", tier="slot")]
    assert [(t.slot, t.left) for t in c.tasks(world(live(32), live(32)))] == [(0, 8), (1, 8)]


def test_only_the_leaders_inputs_may_wake_a_follower() -> None:
    """The loop reads every slot's state size (the full world) for an input that may wake a
    follower: its leader's batch, sample or end; another slot's decode steps need not."""
    c = core(slots=3)
    c.owners = [("a", SALT)] * 3
    c.apply(Arrive(job(slot=0, run="first")), world(EMPTY, EMPTY, EMPTY))
    assert not c.wakes_on(Stepped(0, 0.1)), "nobody follows"
    c.apply(Arrive(job(slot=1, run="second")), world(live(8), EMPTY, EMPTY))
    assert c.following
    assert [c.wakes_on(i) for i in (Stepped(0, 0.1), Sampled(0, 5, b"x", False),
                                    Failed(0, "x"), CancelRun("first"))] == [True] * 4
    assert [c.wakes_on(i) for i in (Stepped(2, 0.1), Sampled(2, 5, b"x", False),
                                    CancelRun("other"), Snapshotted("first", True))] == [False] * 4
    # an input of another slot, with a world that holds no sizes, leaves the follower waiting
    assert c.apply(Stepped(2, 0.1), world(live(16), EMPTY, live(3))) == []
    assert c.jobs[1].phase == "follows"


def test_a_window_or_recurrent_state_is_followed_and_copied_whole_at_the_shared_edge() -> None:
    """A memory that cannot be cut back to a part (a sliding window, a recurrent state): the
    follower copies the first's whole state at the moment its batch ends at the edge they
    share, before its next batch; a state that went past it is no copy, and it prefills."""
    c = core(cuts=False)
    c.owners = [("a", SALT), ("a", SALT)]
    c.apply(Arrive(job(slot=0, run="first")), world(EMPTY, EMPTY))
    second = replace(job(slot=1, run="second"), ids=IDS[:36] + (7, 7, 7, 7))  # shares 36: edge 32
    assert c.apply(Arrive(second), world(live(8), EMPTY)) == [], "it follows"
    assert c.apply(Stepped(0, 0.1), world(live(24, nbytes=90), EMPTY)) == \
        [Emit("first", Prefill(24))], "24 is not the edge: no part of it is copied"
    fx = c.apply(Stepped(0, 0.1), world(live(32, nbytes=100), EMPTY))
    cand = Candidate("slot", 32, True, 100, 0)
    assert fx == [Emit("first", Prefill(32)), Load(1, "second", cand, 32, src=0)]
    # the first's state went on to 40: no copy of the 32 a third prompt shares with it
    c.apply(Loaded(1, "second", cand, 32, 0.01), world(live(32), live(32)))
    c.apply(Stepped(1, 0.1), world(live(32), live(40)))
    c.apply(Sampled(1, 5, b"x", True), world(live(32), live(40)))  # the second ends
    third = replace(job(slot=1, run="third"), ids=IDS[:36] + (8, 8, 8, 8))
    assert c.apply(Arrive(third), world(live(40, exact=40, nbytes=120), EMPTY)) == \
        [Cut(1, 0), start(0, run="third")]


def test_a_follower_starts_from_what_is_there_when_its_leader_ends_or_is_cancelled() -> None:
    c = core()
    c.owners = [("a", SALT), ("a", SALT)]
    c.apply(Arrive(job(slot=0, run="first")), world(EMPTY, EMPTY))
    assert c.apply(Arrive(job(slot=1, run="second")), world(EMPTY, EMPTY)) == []
    # a preemption of the follower itself ends it before it began: the slot's KV as it was
    assert c.apply(CancelRun("second", prefilling=True), world(EMPTY, EMPTY)) == \
        [Emit("second", Cancelled(0, 0, 0)), Finish(1)]
    c.apply(Arrive(job(slot=1, run="third")), world(live(8), EMPTY))
    # the leader cancelled at 16: the follower copies the 16 it left and prefills the rest
    fx = c.apply(CancelRun("first"), world(live(16, nbytes=50), EMPTY))
    cand = Candidate("slot", 16, True, 50, 0)
    assert fx[-2:] == [Finish(0), Load(1, "third", cand, 16, src=0)]
    # nothing to wait for: no follow where less than a batch would be saved, or no RAM tier
    c = core()
    c.owners = [("a", SALT), ("a", SALT)]
    c.apply(Arrive(job(slot=0, run="first")), world(EMPTY, EMPTY))
    # it shares 12 tokens with the first (the edge 8), and its own slot holds those 8 already
    near = replace(job(slot=1, run="near"), ids=IDS[:12] + (7,) * 28)
    assert c.apply(Arrive(near), world(live(0), live(8))) == [Cut(1, 8), start(8, run="near")]
    c = core(ram=0)
    c.owners = [("a", SALT), ("a", SALT)]
    c.apply(Arrive(job(slot=0, run="first")), world(EMPTY, EMPTY))
    assert c.apply(Arrive(job(slot=1, run="same")), world(EMPTY, EMPTY)) == \
        [Cut(1, 0), start(0, run="same")]


def test_prefill_snapshots_at_its_save_points_and_samples_after_its_last_batch() -> None:
    c = core()
    saves = (Save(8, "cold"), Save(24, "scoped"), Save(40, "full"), Save(36, "continued"))
    c.owners[0] = ("a", SALT)
    fx = c.apply(Arrive(job(plan(saves=saves))), world(live(16), EMPTY))
    assert fx == [Cut(0, 16), start(16), Snapshot(0, "r", 8, saves[0], behind=True)]
    assert c.apply(Snapshotted("r", True), world(live(16), EMPTY)) == []
    assert c.apply(Stepped(0, 0.1), world(live(24), EMPTY)) == \
        [Emit("r", Prefill(24)), Snapshot(0, "r", 24, saves[1])]
    assert c.apply(Snapshotted("r", False), world(live(24), EMPTY)) == [], \
        "the same state waits for its file already: no second write"
    assert c.apply(Stepped(0, 0.1), world(live(32), EMPTY)) == [Emit("r", Prefill(32))]
    # the prompt's end is a save point (36 is no edge: never a snapshot there)
    assert c.apply(Stepped(0, 0.1), world(live(40), EMPTY, now=1.0)) == [
        Emit("r", Prefill(40)), Snapshot(0, "r", 40, saves[2]),
        StartSampling(0, {"temperature": 0}, None), Sample(0)]
    c.apply(Snapshotted("r", True), world(live(40), EMPTY))
    assert c.costs.prefill.n == 1
    assert c.apply(Sampled(0, 5, b"hi", False), world(live(40), EMPTY)) == \
        [Emit("r", Token(5, "hi"))]
    assert [(t.slot, t.waits) for t in c.tasks(world(live(40), EMPTY))] == [(0, True)]
    assert c.waiting(0) == 5
    assert c.apply(Stepped(0, 0.01), world(live(41, exact=40), EMPTY)) == [Sample(0)]
    fx = c.apply(Sampled(0, 0, b"", True), world(live(41, exact=40), EMPTY, now=2.0))
    assert fx == [Emit("r", Done("stop", None, 1, 40, 0, 1.0, 1.0, 2, c.costs.to_wire())),
                  Finish(0)]
    assert c.jobs == {}, "the slot takes a new job"


@pytest.mark.parametrize(("pieces", "stop", "max_tokens", "want"), [
    # a stop string across two tokens: what came before it is emitted, the answer ends
    ([b"ab", b"c<e", b"nd>"], ("<end>",), 9, ["ab", "c", "", ("stop_sequence", "<end>")]),
    # max_tokens
    ([b"a", b"b"], (), 2, ["a", "b", ("length", None)]),
    # text held back for a stop string that did not come is flushed at the end
    ([b"x<"], ("<end>",), 1, ["x", "<", ("length", None)]),
])
def test_an_answer_ends_on_a_stop_string_or_max_tokens(pieces: list[bytes],
                                                        stop: tuple[str, ...], max_tokens: int,
                                                        want: list[Any]) -> None:
    c = core()
    c.apply(Arrive(job(max_tokens=max_tokens, stop=stop)), world(EMPTY, EMPTY))
    got: list[Any] = []
    fx = c.apply(Stepped(0, 0.1), world(live(40), EMPTY))
    for i, piece in enumerate(pieces):
        fx = c.apply(Sampled(0, i + 1, piece, False), world(live(40 + i), EMPTY))
        for e in fx:
            if isinstance(e, Emit) and isinstance(e.event, Token):
                got.append(e.event.text)
            if isinstance(e, Emit) and isinstance(e.event, Done):
                got.append((e.event.finish_reason, e.event.stop))
    assert got == want


def test_a_cancelled_prefill_keeps_what_it_evaluated() -> None:
    c = core()
    c.apply(Arrive(job(plan(saves=(Save(8, "cold"),)))), world(EMPTY, EMPTY))
    c.apply(Stepped(0, 0.1), world(live(8), EMPTY))
    c.apply(Snapshotted("r", True), world(live(8), EMPTY))
    c.apply(Stepped(0, 0.1), world(live(16), EMPTY))
    assert c.apply(CancelRun("r"), world(live(16), EMPTY)) == \
        [Emit("r", Cancelled(16, 0, 1)), Finish(0)]
    assert c.apply(CancelRun("r"), world(live(16), EMPTY)) == [], "once"


def test_a_preemption_stops_a_prefill_but_not_a_run_that_sampled() -> None:
    """A "prefilling" cancel (a short request takes the slot: proxy.run) stops a run before
    its first sample, keeping what it evaluated; once the last batch sampled it is ignored
    and the run goes on."""
    c = core()
    c.apply(Arrive(job()), world(EMPTY, EMPTY))
    c.apply(Stepped(0, 0.1), world(live(8), EMPTY))
    assert c.apply(CancelRun("r", prefilling=True), world(live(8), EMPTY)) == \
        [Emit("r", Cancelled(8, 0, 0)), Finish(0)]
    c.apply(Arrive(job(run="r2")), world(EMPTY, EMPTY))
    for n in (8, 16, 24, 32):
        c.apply(Stepped(0, 0.1), world(live(n), EMPTY))
    effects = c.apply(Stepped(0, 0.1), world(live(40), EMPTY))
    assert isinstance(effects[-1], Sample), "the last batch samples at once"
    assert c.apply(CancelRun("r2", prefilling=True), world(live(40), EMPTY)) == []
    assert c.apply(CancelRun("r2"), world(live(40), EMPTY))[0] == Emit("r2", Cancelled(
        40, 0, 0)), "a client's cancel still stops it"


def _generating(c: Core, run: str = "r") -> None:
    """Slot 0's run has prefilled IDS and sampled a token that waits for its decode."""
    c.apply(Arrive(job(run=run, max_tokens=9)), world(EMPTY, EMPTY))
    for n in (8, 16, 24, 32, 40):
        c.apply(Stepped(0, 0.1), world(live(n), EMPTY))
    c.apply(Sampled(0, 7, b"x", False), world(live(40), EMPTY))


def test_a_nested_job_parks_the_generating_run_and_puts_it_back_at_its_end() -> None:
    """A short job nested on slot 0 (policies.preempt rule 4): its run is parked between its
    steps, the nested job sees the slot empty (nothing kept, nothing given way), and at its end
    the run is back as it was, its token waiting for its decode."""
    c = core()
    _generating(c)
    nested = replace(job(run="n", max_tokens=1), nest=True)
    assert c.apply(Arrive(nested), world(live(41, exact=40), EMPTY)) == \
        [Park(0), Cut(0, 0), start(0, run="n")]
    assert [(t.slot, t.left) for t in c.tasks(world(EMPTY, EMPTY))] == [(0, 40)]
    for n in (8, 16, 24, 32, 40):
        fx = c.apply(Stepped(0, 0.1), world(live(n), EMPTY))
    assert fx[-1] == Sample(0)
    fx = c.apply(Sampled(0, 5, b"y", False), world(live(40), EMPTY))
    assert fx[-2:] == [Finish(0), Unpark(0)] and isinstance(fx[-3].event, Done)
    assert (c.jobs[0].job.run_id, c.jobs[0].phase, c.waiting(0)) == ("r", "waits", 7)
    assert c.owners[0] == ("a", SALT) and c.parked == {}



def test_a_nested_job_waits_for_a_run_it_cannot_park() -> None:
    """A run not between its decode steps (still prefilling: the run ended and the slot was
    taken again before the job came, say), or whose state would not fit the RAM tier's budget
    in host RAM, or a worker without a RAM tier: the nested job waits for the run's end, then
    arrives as any job; one whose client leaves meanwhile ends there."""
    nested = replace(job(run="n", max_tokens=1), nest=True)
    for c, w in ((core(), world(live(8), EMPTY)),
                 (core(ram=1000), world(live(41, exact=40, nbytes=5000), EMPTY)),
                 (core(ram=0), world(live(41, exact=40, nbytes=5000), EMPTY))):
        if c.ram_budget in (0, 1000):
            _generating(c)
        else:
            c.apply(Arrive(job()), world(EMPTY, EMPTY))
        assert c.apply(Arrive(nested), w) == [] and c.jobs[0].job.run_id == "r"
        assert c.apply(CancelRun("r"), w)[-2:] == [Finish(0), Again(nested)]
    c = core(ram=1000)
    _generating(c)
    assert c.apply(Arrive(nested), world(live(41, exact=40, nbytes=5000), EMPTY)) == []
    assert c.apply(CancelRun("n"), world(live(41), EMPTY)) == [Emit("n", Cancelled(0, 0, 0))]
    assert c.deferred == {} and c.jobs[0].job.run_id == "r"


def test_a_parked_run_whose_client_leaves_ends_where_it_is_kept() -> None:
    c = core()
    _generating(c)
    c.apply(Arrive(replace(job(run="n"), nest=True)), world(live(41, exact=40), EMPTY))
    assert c.apply(CancelRun("r", prefilling=True), world(EMPTY, EMPTY)) == [], \
        "a preemption never stops a run that sampled"
    assert c.apply(CancelRun("r"), world(EMPTY, EMPTY)) == \
        [Emit("r", Cancelled(0, 0, 0)), Unpark(0, drop=True)]
    assert c.jobs[0].job.run_id == "n" and c.parked == {}
    fx = c.apply(CancelRun("n"), world(live(8), EMPTY))
    assert fx == [Emit("n", Cancelled(8, 0, 0)), Finish(0)], "nothing to put back"


def test_a_prefill_whose_state_would_not_fit_the_ram_tier_does_not_give_way() -> None:
    """Its prefix would be lost (a state larger than the whole RAM tier is not kept): the run
    goes on and says so (`Kept`); a client's cancel still stops it."""
    c = core(ram=1000)
    c.apply(Arrive(job()), world(EMPTY, EMPTY))
    c.apply(Stepped(0, 0.1), world(live(8), EMPTY))
    assert c.apply(CancelRun("r", prefilling=True), world(live(8, nbytes=5000), EMPTY)) == \
        [Emit("r", Kept("its state would not fit the RAM tier"))]
    assert c.apply(CancelRun("r", prefilling=True), world(live(8, nbytes=900), EMPTY)) == \
        [Emit("r", Cancelled(8, 0, 0)), Finish(0)]


def test_a_run_cancelled_while_it_reads_ignores_the_read() -> None:
    c = core()
    j = job(plan(restore=(Restore(32, b"k", "k.state", 10),)))
    c.apply(Arrive(j), world(live(40, start=900), EMPTY))
    assert c.apply(CancelRun("r"), world(live(40, start=900), EMPTY)) == \
        [Emit("r", Cancelled(0, 0, 0)), Finish(0)], "nothing of this prompt is in the slot"
    c.apply(Arrive(replace(j, run_id="r2")), world(live(40, start=900), EMPTY))
    assert c.apply(ReadDone(0, "r", 0, "p", 0.1), world(EMPTY, EMPTY)) == [], \
        "the first run's read: not the slot's job any more"


def test_a_failure_ends_the_job_with_an_error() -> None:
    c = core()
    c.apply(Arrive(job()), world(EMPTY, EMPTY))
    assert c.apply(Failed(0, "llama_decode failed (1)"), world(EMPTY, EMPTY)) == \
        [Emit("r", Error("llama_decode failed (1)")), Finish(0)]


# --- speculation (issue 47) ---------------------------------------------------------------------

REPEATS = tuple(range(100, 120)) * 2  # a prompt that repeats itself: n-grams to draft from
SPEC = Speculation(SpecConfig(("ngram-simple",), NgramParams(simple_size_n=2, simple_size_m=3),
                              always=True), None, 8, True, "")


def holding(tokens: tuple[int, ...]) -> Live:
    a = np.zeros(64, dtype=np.intc)
    a[:len(tokens)] = tokens
    return Live(a, len(tokens), len(REPEATS), 0)


def drafting(stop: tuple[str, ...] = ()) -> Core:
    """A core whose job has evaluated its prompt and sampled 100: "119 100" came before, so
    ngram-simple drafts the three tokens after it."""
    c = Core(2, Batching(8), True, 1 << 30, True, n_ctx=64, spec=SPEC)
    c.apply(Arrive(replace(job(max_tokens=9, stop=stop), ids=REPEATS)), world(EMPTY, EMPTY))
    assert c.apply(Stepped(0, 0.1), world(holding(REPEATS), EMPTY))[-1] == Sample(0)
    assert c.apply(Sampled(0, 100, b"a", False), world(holding(REPEATS), EMPTY)) == \
        [Emit("r", Token(100, "a"))]
    return c


def test_a_draft_is_verified_and_its_samples_taken_in_order() -> None:
    c = drafting()
    assert c.tasks(world(holding(REPEATS), EMPTY)) == [Task(0, waits=True, draft=3)]
    assert (c.waiting(0), c.draft(0)) == (100, [101, 102, 103])
    # 101 and 102 accepted, 7 sampled where 103 was drafted: the KV holds 100 101 102
    samples = (Sampled(0, 101, b"b", False), Sampled(0, 102, b"c", False),
               Sampled(0, 7, b"d", False))
    fx = c.apply(Verified(0, 0.2, samples, (101, 102, 103)),
                 world(holding(REPEATS + (100, 101, 102)), EMPTY))
    assert fx == [Emit("r", Token(101, "b")), Emit("r", Token(102, "c")),
                  Emit("r", Token(7, "d"))]
    # "102 7" came nowhere before: 7 waits for a plain step
    assert c.tasks(world(holding(REPEATS + (100, 101, 102)), EMPTY)) == [Task(0, waits=True)]
    fx = c.apply(Stepped(0, 0.01), world(holding(REPEATS + (100, 101, 102, 7)), EMPTY))
    assert fx == [Sample(0)]
    fx = c.apply(Sampled(0, 0, b"", True), world(holding(REPEATS + (100, 101, 102, 7)), EMPTY))
    done = next(e.event for e in fx if isinstance(e, Emit) and isinstance(e.event, Done))
    assert done.n_gen == 4 and done.draft == {
        "ngram-simple": {"drafted": 3, "accepted": 2, "verifies": 1}}
    assert c.drafted == {"ngram-simple": [3, 2, 1]}, "the worker's totals"


def test_a_batch_of_a_draft_models_prompt_leaves_the_token_and_its_draft_waiting() -> None:
    c = drafting()
    assert c.apply(Filling(0, 0.3), world(holding(REPEATS), EMPTY)) == []
    assert c.tasks(world(holding(REPEATS), EMPTY)) == [Task(0, waits=True, draft=3, fills=True)]
    assert (c.waiting(0), c.draft(0)) == (100, [101, 102, 103])
    samples = (Sampled(0, 101, b"b", False), Sampled(0, 7, b"d", False))
    c.apply(Verified(0, 0.2, samples, (101, 102, 103)), world(holding(REPEATS + (100, 101)),
                                                              EMPTY))
    assert not any(t.fills for t in c.tasks(world(holding(REPEATS + (100, 101)), EMPTY)))


def test_a_verify_ends_the_answer_where_a_stop_string_matches() -> None:
    c = drafting(stop=("bc",))
    samples = (Sampled(0, 101, b"b", False), Sampled(0, 102, b"c", False),
               Sampled(0, 103, b"x", False), Sampled(0, 104, b"y", False))
    fx = c.apply(Verified(0, 0.2, samples, (101, 102, 103)),
                 world(holding(REPEATS + (100, 101, 102, 103)), EMPTY))
    assert [e.event.text for e in fx if isinstance(e, Emit) and isinstance(e.event, Token)] \
        == ["", ""]
    done = next(e.event for e in fx if isinstance(e, Emit) and isinstance(e.event, Done))
    assert (done.finish_reason, done.stop, done.n_gen) == ("stop_sequence", "bc", 3)
    assert c.jobs == {}
