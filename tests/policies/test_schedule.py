"""policies.schedule: which step the worker's compute thread runs next, its accounts, and the
decode shape each `--deterministic` takes. Exact tables; the real-model tests of each rule are
in tests/backend/test_slots.py."""

from __future__ import annotations

import dataclasses

import pytest

from policies.schedule import (
    NOMINAL_TOKEN_S,
    PASS_SHARE,
    STREAM_S,
    Account,
    Clock,
    Decode,
    Deterministic,
    Prefill,
    Proof,
    Shapes,
    Step,
    Task,
    Verify,
    charge,
    choose_decode,
    due_s,
    next_step,
    track,
    wake_now,
)

BATCHED = Shapes("batched", True, "")
FIXED = Shapes("fixed", True, "")
APART = Shapes("apart", True, "")
AS_THEY_COME = Shapes("batched", False, "")  # --deterministic off


def clock(per_token_s: float = 0.001, **accounts: Account) -> Clock:
    """Accounts by slot ("s0", "s2", ...), in the order given: the order the jobs came."""
    return Clock({int(k[1:]): a for k, a in accounts.items()}, per_token_s)


def prefilling(began_s: float, total: int, used_s: float = 0.0) -> Account:
    return Account(used_s, began_s, total, True)


NEXT_CASES: list[tuple[str, list[Task], Clock, Shapes, Step | None]] = [
    ("nothing to compute: the thread rests", [], clock(), BATCHED, None),
    ("a lone prefill runs its next batch",
     [Task(0, left=900, n=128)], clock(s0=prefilling(0, 900)), BATCHED, Prefill(0, 128)),
    # rule 1: of the prefills the one due first runs. A title's 200 tokens arriving at 0.5 s
    # beside a subagent's 2,000 from 0 s are due at 0.7 s, the subagent's at 2.0 s.
    ("a short prompt beside a long prefill is due first",
     [Task(0, left=1500, n=128), Task(1, left=200, n=128)],
     clock(s0=prefilling(0.0, 2000), s1=prefilling(0.5, 200)), BATCHED, Prefill(1, 128)),
    # ...but not without end: a short prompt arriving once the long one is almost due waits
    ("a long prefill that is due goes before a short one that came late",
     [Task(0, left=100, n=100), Task(1, left=200, n=128)],
     clock(s0=prefilling(0.0, 2000), s1=prefilling(1.95, 200)), BATCHED, Prefill(0, 100)),
    ("before any batch was measured a token is NOMINAL_TOKEN_S",
     [Task(0, left=1000, n=128), Task(1, left=10, n=10)],
     clock(0.0, s0=prefilling(0.0, 1000), s1=prefilling(1000 * NOMINAL_TOKEN_S - 0.001, 10)),
     BATCHED, Prefill(0, 128)),
    ("two prefills due at once: the one that came first",
     [Task(1, left=100, n=100), Task(0, left=100, n=100)],
     clock(s1=prefilling(0.0, 100), s0=prefilling(0.0, 100)), BATCHED, Prefill(1, 100)),
    # rule 2: the least served runs, the prefill due first against each generating slot
    ("the generating slot has used less: its decode runs",
     [Task(0, left=900, n=128), Task(1, waits=True)],
     clock(s0=prefilling(0, 900, 0.5), s1=Account(0.4)), BATCHED, Decode((1,))),
    ("the prefill has used less: a batch runs",
     [Task(0, left=900, n=128), Task(1, waits=True)],
     clock(s0=prefilling(0, 900, 0.3), s1=Account(0.4)), BATCHED, Prefill(0, 128)),
    ("a tie goes to the generating slot",
     [Task(0, left=900, n=128), Task(1, waits=True)],
     clock(s0=prefilling(0, 900, 0.4), s1=Account(0.4)), BATCHED, Decode((1,))),
    ("a title call that came while an answer streams runs first",
     [Task(0, waits=True), Task(1, left=200, n=128)],
     clock(s0=Account(30.0), s1=prefilling(40.0, 200)), BATCHED, Prefill(1, 128)),
    ("the prefill due first competes, not the least served of the prefills",
     [Task(0, left=100, n=100), Task(1, waits=True), Task(2, left=900, n=128)],
     clock(s0=prefilling(0.0, 2000, 3.0), s1=Account(2.0), s2=prefilling(1.9, 900)), BATCHED,
     Decode((1,))),
    # rule 3: a decode step takes every waiting slot where steps may share a llama_decode
    ("batched: every waiting slot in one step",
     [Task(2, waits=True), Task(0, waits=True), Task(1, left=50, n=50)],
     clock(s2=Account(0.2), s0=Account(0.1), s1=prefilling(0, 50, 9.0)),
     BATCHED, Decode((0, 2))),
    ("the fixed shape: every waiting slot too (the engine pads the others)",
     [Task(2, waits=True), Task(0, waits=True)], clock(s2=Account(0.2), s0=Account(0.1)),
     FIXED, Decode((0, 2))),
    ("apart: the least used alone",
     [Task(2, waits=True), Task(0, waits=True)], clock(s2=Account(0.2), s0=Account(0.1)),
     APART, Decode((0,))),
    ("apart, a tie: the slot whose job came first",
     [Task(0, waits=True), Task(2, waits=True)], clock(s2=Account(0.1), s0=Account(0.1)),
     APART, Decode((2,))),
    # rule 4: a waiting token with a draft takes a verify step
    ("a lone slot with a draft verifies it",
     [Task(0, waits=True, draft=5)], clock(s0=Account(0.1)), APART, Verify((0,))),
    ("independent: the least used verifies alone",
     [Task(2, waits=True), Task(0, waits=True, draft=3)],
     clock(s2=Account(0.2), s0=Account(0.1)), BATCHED, Verify((0,))),
    ("independent: the others decode together when theirs is the turn, without the drafting",
     [Task(2, waits=True), Task(0, waits=True, draft=3), Task(1, waits=True)],
     clock(s2=Account(0.1), s0=Account(0.2), s1=Account(0.3)), FIXED, Decode((1, 2))),
    ("batched as they come: every waiting slot's rows in one verify",
     [Task(2, waits=True), Task(0, waits=True, draft=3), Task(1, waits=True, draft=4)],
     clock(s2=Account(0.1), s0=Account(0.2), s1=Account(0.3)), AS_THEY_COME, Verify((0, 1, 2))),
    ("a slot whose draft model fills its prompt verifies alone, when it has used the least",
     [Task(2, waits=True), Task(0, waits=True, draft=3, fills=True), Task(1, waits=True,
                                                                           draft=4)],
     clock(s2=Account(0.2), s0=Account(0.1), s1=Account(0.3)), AS_THEY_COME, Verify((0,))),
    ("... and the others share their steps without it",
     [Task(2, waits=True), Task(0, waits=True, draft=3, fills=True), Task(1, waits=True,
                                                                           draft=4)],
     clock(s2=Account(0.1), s0=Account(0.2), s1=Account(0.3)), AS_THEY_COME, Verify((1, 2))),
    ("... a decode, where none of them has a draft",
     [Task(2, waits=True), Task(0, waits=True, draft=3, fills=True), Task(1, waits=True)],
     clock(s2=Account(0.1), s0=Account(0.2), s1=Account(0.3)), AS_THEY_COME, Decode((1, 2))),
]


@pytest.mark.parametrize(("why", "tasks", "clk", "shapes", "want"), NEXT_CASES,
                         ids=[c[0] for c in NEXT_CASES])
def test_next_step(why: str, tasks: list[Task], clk: Clock, shapes: Shapes,
                   want: Step | None) -> None:
    assert next_step(tasks, clk, shapes) == want


def test_a_shared_verify_holds_what_the_batch_holds() -> None:
    """The least used first, then the others in the order they came while their rows fit."""
    tasks = [Task(2, waits=True, draft=60), Task(0, waits=True, draft=100),
             Task(1, waits=True, draft=20)]
    clk = clock(s2=Account(0.1), s0=Account(0.2), s1=Account(0.3))
    assert next_step(tasks, clk, AS_THEY_COME, rows_max=128) == Verify((1, 2))
    assert next_step(tasks, clk, AS_THEY_COME, rows_max=0) == Verify((0, 1, 2))


@pytest.mark.parametrize("with_clock", [False, True])
def test_a_stream_of_short_prompts_holds_a_long_one_back_only_until_it_is_due(
        with_clock: bool) -> None:
    """A long prompt beside short prompts that arrive one after another (an agent's quick
    turns): the short ones run first only until the long one is due (its 1,000 tokens at 1 ms
    from 0 s: 1.0 s), then it runs every batch until it ends. Serving the shortest first
    instead, the long one never ran here. With the clock's time (the worker's), the late long
    one lets short ones pass for at most PASS_SHARE of its own prefill's time more."""
    per_token, batch = 0.001, 100
    clk = Clock({0: Account(0.0, 0.0, 1000, True, "long")}, per_token)
    left, now, order, short = 1000, 0.0, [], 0
    while left > 0 and now < 5.0:
        # a short prompt of 120 tokens always waits, arrived just now
        clk = track(clk, [(0, "long", 0.0), (1, "short", now)],
                    [Task(0, left, batch), Task(1, 120, 120)], now)
        if clk.accounts[1].began_s != now:  # a new short prompt each round
            clk = Clock({**clk.accounts, 1: Account(0.0, now, 120, True, "short")}, per_token)
        step = next_step([Task(0, left, min(batch, left)), Task(1, 120, 120)], clk, BATCHED,
                         now_s=now if with_clock else 0.0)
        assert isinstance(step, Prefill)
        now += step.n * per_token
        clk = charge(clk, step, step.n * per_token)
        order.append(step.slot)
        if step.slot == 0:
            left -= step.n
        else:
            short += 120
    assert left == 0, "the long prompt never ended"
    passes = PASS_SHARE * 1000 + 120 if with_clock else 0
    assert short <= 1000 + 120 + passes, f"{short} tokens of short prompts ran first"


def test_a_late_prefill_lets_a_shorter_one_pass_a_bounded_time() -> None:
    """Rule 1 once the prefill due first is late. Seen in the team bench's step log: a
    summary's last 5 tokens (232 from 938.9 s) waited 8.7 s for a subagent's 1,689 (from
    922.6 s, due at 931.0 s), which gained nothing by going first at 945 s."""
    per = 0.005
    clk = clock(per, s1=prefilling(922.6, 1689), s0=prefilling(938.9, 232, used_s=0.7))
    tasks = [Task(1, left=1689, n=512), Task(0, left=5, n=5)]
    assert next_step(tasks, clk, BATCHED, now_s=930.0) == Prefill(1, 512), "not late yet"
    assert next_step(tasks, clk, BATCHED) == Prefill(1, 512), "no clock: none is late"
    assert next_step(tasks, clk, BATCHED, now_s=945.0) == Prefill(0, 5), "late: it passes"
    # a pass is charged to each prefill due before the one that ran
    after = charge(clk, Prefill(0, 5), 0.05)
    assert after.accounts[1].passed_s == pytest.approx(0.05)
    assert after.accounts[0].passed_s == 0.0 and after.accounts[0].used_s == pytest.approx(0.75)
    # the late one has waited its share for passes: it runs
    spent = dataclasses.replace(clk.accounts[1], passed_s=PASS_SHARE * 1689 * per)
    assert next_step(tasks, Clock({**clk.accounts, 1: spent}, per), BATCHED,
                     now_s=945.0) == Prefill(1, 512)
    # a generating slot that has used less still goes first (rule 2), as before
    gen = clock(per, s1=prefilling(922.6, 1689), s0=prefilling(938.9, 232, used_s=0.7),
                s2=Account(0.1))
    assert next_step([*tasks, Task(2, waits=True)], gen, BATCHED, now_s=945.0) == Decode((2,))


def test_track_admits_from_nothing_begins_and_ends_prefills_and_lets_jobs_go() -> None:
    # rule 2: a new job's time counts from nothing, whatever the others used
    clk = Clock({0: Account(5.0, run="a")}, 0.001)
    clk = track(clk, [(0, "a", 0.0), (1, "b", 10.0)], [Task(0, waits=True)], now_s=10.0)
    assert clk.accounts[1] == Account(0.0, run="b")
    # its prefill begins: due from when its request came
    clk = track(clk, [(0, "a", 0.0), (1, "b", 10.0)],
                [Task(0, waits=True), Task(1, left=300, n=128)], now_s=11.0)
    assert clk.accounts[1] == Account(0.0, 10.0, 300, True, "b")
    clk = charge(clk, Prefill(1, 128), 0.25)
    # its prefill ends: its time carries on into its answer
    clk = track(clk, [(0, "a", 0.0), (1, "b", 10.0)],
                [Task(0, waits=True), Task(1, waits=True)], now_s=12.0)
    assert clk.accounts[1] == Account(0.25, 10.0, 300, False, "b")
    # a job that ended leaves the accounts; the order of the others stays
    clk = track(clk, [(1, "b", 10.0)], [Task(1, waits=True)], now_s=13.0)
    assert list(clk.accounts) == [1]
    # the slot's next job, come before the accounts were looked at: a new account, due from
    # its own start, not the ended job's (seen: a short prompt waited for a long one's end)
    clk = track(clk, [(1, "c", 14.0)], [Task(1, left=900, n=128)], now_s=14.0)
    assert clk.accounts[1] == Account(0.0, 14.0, 900, True, "c")


def test_track_keeps_the_clock_while_jobs_go_on_and_starts_a_lone_slots_next_job_anew(
        ) -> None:
    clk = Clock({0: Account(2.0, run="a"), 1: Account(1.0, run="b")}, 0.001)
    same = track(clk, [(0, "a", 0.0), (1, "b", 1.0)],
                 [Task(0, waits=True), Task(1, waits=True)], now_s=5.0)
    assert same is clk  # every generated token's step: nothing to make again
    # one slot, its next job come (still starting: no task yet): its own account, not the
    # ended job's time
    clk = Clock({0: Account(2.0, run="a")}, 0.001)
    clk = track(clk, [(0, "b", 6.0)], [], now_s=6.0)
    assert clk.accounts == {0: Account(run="b")}


def test_a_prompt_that_waited_for_a_slot_is_due_from_when_it_came() -> None:
    """Two subagents' first turns come at once for the last free slot: one waits 8 s for a slot
    while the other prefills, then a main turn of 400 tokens comes 2 s after it got one. Due
    from when it came, the waiting subagent's 1,700 tokens run to their end first; due from
    when its slot freed (as before), the later main turn went ahead of it (seen in
    bench.team: the subagents' TTFT p95 1.49x llama-server's)."""
    per_token = 0.005
    clk = Clock({}, per_token)
    active = [(0, "sub2", 0.0)]
    clk = track(clk, active, [Task(0, left=1700, n=512)], now_s=8.0)
    assert clk.accounts[0].began_s == 0.0, "its 8 s waiting for a slot count"
    active.append((1, "main", 10.0))
    tasks = [Task(0, left=1700 - 512, n=512), Task(1, left=400, n=400)]
    clk = track(clk, active, tasks, now_s=10.0)
    assert due_s(clk, 0) == 8.5 < due_s(clk, 1) == 12.0
    assert next_step(tasks, clk, BATCHED) == Prefill(0, 512)


def test_a_job_that_comes_runs_until_it_has_had_as_much_as_an_answer_in_flight() -> None:
    """Rule 2 over a run: an answer has streamed for 2 s when a subagent's prompt of 3,000
    tokens comes (1 ms a token, batches of 500, decode steps of 40 ms). The prompt runs alone
    until it has used the answer's 2 s, then they share the time: the answer's steps take about
    as long as the prompt's last 1 s."""
    clk = Clock({0: Account(2.0, run="answer")}, 0.001)
    left, now, steps = 3000, 0.0, list[str]()
    active = [(0, "answer", -2.0), (1, "subagent", 0.0)]
    while left > 0:
        tasks = [Task(0, waits=True), Task(1, left, min(500, left))]
        clk = track(clk, active, tasks, now)
        step = next_step(tasks, clk, BATCHED)
        seconds = step.n * 0.001 if isinstance(step, Prefill) else 0.04
        clk, now = charge(clk, step, seconds), now + seconds
        left -= step.n if isinstance(step, Prefill) else 0
        steps.append("p" if isinstance(step, Prefill) else "d")
    assert "".join(steps).startswith("pppp"), steps  # the first 2 s: its prompt alone
    assert steps.count("d") == pytest.approx(0.5 / 0.04, abs=1), steps  # then the time shared
    assert clk.accounts[1].used_s == pytest.approx(3.0)


def test_charge() -> None:
    clk = charge(Clock({0: Account(1.0), 1: Account(2.0)}), Decode((0, 1)), 0.5)
    assert [a.used_s for a in clk.accounts.values()] == [1.5, 2.5], "each slot the step's time"
    clk = charge(clk, Prefill(0, 100), 0.2)
    assert clk.accounts[0].used_s == 1.7 and clk.per_token_s == pytest.approx(0.002)
    clk = charge(clk, Prefill(0, 100), 0.1)  # a decaying mean of the batches' per-token time
    assert clk.per_token_s == pytest.approx(0.7 * 0.002 + 0.3 * 0.001)


CHECKED_BATCHED = Proof(True, "", None, 0.0, 2.6)
DIFFERS_NO_PAD = Proof(True, "slot 1 decoded with slots 0-1 (...) differ by 0.4", None, 0.0, 2.9)
FIXED_CHEAP = Proof(True, "differ by 0.4", "", 1.05, 2.9)
FIXED_DEAR = Proof(True, "differ by 0.4", "", 1.45, 2.2)
FIXED_INEXACT = Proof(True, "differ by 0.4", "slot 0 with the others idle differs", 1.02, 2.9)

SHAPE_CASES: list[tuple[Deterministic, Proof, int, str, bool]] = [
    # (asked, proof, slots) -> shape, independent
    ("auto", CHECKED_BATCHED, 3, "batched", True),  # proven: free
    ("on", CHECKED_BATCHED, 3, "batched", True),
    ("off", CHECKED_BATCHED, 3, "batched", True),
    ("auto", FIXED_CHEAP, 3, "fixed", True),  # a GPU: the fixed shape costs a lone slot little
    ("auto", FIXED_DEAR, 3, "batched", False),  # 2 CPU cores: as they come, as llama-server
    ("on", FIXED_DEAR, 3, "fixed", True),  # whatever it costs
    ("off", FIXED_CHEAP, 3, "batched", False),
    ("auto", FIXED_INEXACT, 3, "batched", False),
    ("on", FIXED_INEXACT, 3, "apart", True),  # the last resort
    ("auto", DIFFERS_NO_PAD, 3, "batched", False),  # a recurrent state cannot pad
    ("on", DIFFERS_NO_PAD, 3, "apart", True),
    ("auto", Proof(), 3, "batched", False),  # --no-exact-check: nothing proven
    ("on", Proof(), 3, "apart", True),
    ("on", FIXED_DEAR, 1, "apart", True),  # one slot: every answer is its own
]


@pytest.mark.parametrize(("asked", "proof", "slots", "shape", "independent"), SHAPE_CASES)
def test_choose_decode(asked: Deterministic, proof: Proof, slots: int, shape: str,
                       independent: bool) -> None:
    got = choose_decode(asked, proof, slots)
    assert (got.decode, got.independent) == (shape, independent)
    if not independent:  # never silent: what it means, and what on would cost
        assert "as in llama-server" in got.note and "--deterministic on" in got.note
        assert ("x" in got.note.split("--deterministic on")[1]) == (proof.checked or False)
    if shape == "apart" and slots > 1:
        assert "step time of batching" in got.note


def test_what_on_would_do_instead_is_said_in_its_place() -> None:
    """On a CPU with several slots and flash attention auto, `on` turns flash attention off
    (backend.context.resolve_flash_attn): the note of `auto` and `off` says that, not the fixed
    shape measured with flash attention on."""
    instead = "flash attention off on this CPU, ..."
    for asked in ("auto", "off"):
        got = choose_decode(asked, FIXED_DEAR, 3, instead)  # type: ignore[arg-type]
        assert got.note.endswith(instead + (")" if asked == "off" else ""))
        assert "fixed shape" not in got.note
    assert choose_decode("on", FIXED_DEAR, 3, instead).decode == "fixed"  # `on` runs as proven


@pytest.mark.parametrize(("why", "token", "first", "step_s", "wake"), [
    ("an answer's first token goes out at once (its time to first token)", True, True, 0.006,
     True),
    ("a later token waits for the HTTP thread's beat", True, False, 0.006, False),
    ("done, a save, an error, a prefill: at once", False, False, 0.006, True),
    ("after a step as long as the beat, each token at once", True, False, STREAM_S, True),
    ("before any step was timed, a later token waits for the beat", True, False, 0.0, False),
])
def test_wake_now(why: str, token: bool, first: bool, step_s: float, wake: bool) -> None:
    assert wake_now(token, first, step_s) is wake, why


@pytest.mark.parametrize(("why", "token", "first", "step_s", "wake"), [
    ("its first token waits for its end", True, True, 0.006, False),
    ("a later token too", True, False, 0.006, False),
    ("after a long step too: nobody reads it before the end", True, False, STREAM_S * 4, False),
    ("its end, a save, an error, a prefill: at once", False, False, 0.006, True),
])
def test_a_run_that_does_not_stream_wakes_only_for_what_is_not_a_token(
        why: str, token: bool, first: bool, step_s: float, wake: bool) -> None:
    assert wake_now(token, first, step_s, streamed=False) is wake, why
