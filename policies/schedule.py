"""The worker's scheduler: which llama_decode runs next on its one compute thread, and how decode
steps of several slots are shaped.

    next_step(tasks, clock, shapes, rows_max) -> Prefill(slot, n) | Decode(slots) | Verify(slots)
                                              | None
    track(clock, active, tasks, now_s) -> Clock       the accounts in line with the slots' jobs
    charge(clock, step, seconds) -> Clock
    choose_decode(deterministic, proof, slots, on_instead) -> Shapes
    wake_now(token, first, step_s) -> bool     whether an event wakes the HTTP thread

Pure: the times are passed in (the worker measures each step), nothing here reads a clock.

**Tasks.** A slot with a job is a task while it has compute to do: a prefill with `left` prompt
tokens to go (its next batch `n` tokens, ending at one of the cold run's batch edges, which the
worker's core computes), or a generated token that waits for its decode (`waits`). A slot that
reads a state from disk or the shared tier, or has nothing to compute, is no task.

**Rules of `next_step`** (the ordering llama-server gets from filling each batch with every
slot's tokens in turn, kept exact: a prefill batch holds one sequence's tokens, in the cold
run's batches):

1. The prefills are served as one: of them, the one *due* first runs its batch. A prefill is due
   when it would end had it run alone from when its request came: ``began_s + total *
   per_token_s`` (its tokens at the seconds a prefilled token has taken lately, the same for
   all; `NOMINAL_TOKEN_S` until one was measured; `began_s` when the request came to the server,
   so its parse, its render and its wait for a slot count, and a later prefill of the same job
   from when that began). Beside a long prompt a short one is due first and
   ends almost as soon as alone (a title's 200 tokens do not wait behind a subagent's 2,000);
   a prompt's due time moves only with that measure, so short prompts arriving one after
   another hold a long one back only until it is due (no prompt waits without end), and two
   prompts never take turns batch by batch. Once the one due first is *late* (its due time has
   passed: its prefill cannot end by it any more), serving it first gains it nothing, and a
   prompt with less work left goes first (the modified due date: each prefill's key is
   ``max(due, now + its work left)``), but only while what the late one has waited for such
   passes stays under `PASS_SHARE` of its own prefill's time (`Account.passed_s`): a
   summary's last 5 tokens no longer wait for a late subagent's 1,689, and a stream of short
   prompts still holds a long one back a bounded time.
2. The least served runs: each job's time counts from nothing when it came (its prefill batches
   and its decode steps), and the prefill due first (rule 1) and each generating slot compete
   by it; whichever has used the least time runs its step. Nobody knows how long an answer
   will be, and this (least attained service, the textbook rule for jobs of unknown length)
   serves short jobs at once without knowing them: a title call or a subagent's turn that
   comes while an answer streams runs its prompt first, as llama-server's prefill-first
   batches do, until it has had as much of the thread as that answer; from there they share
   the thread's *time*, not its turns (on a CPU a prefill batch costs ten or more generated
   tokens, so turns would let an answer crawl at one token per batch). Ties go to the
   generating slot that came first; a prefill wins only with strictly less time used.
3. A decode step takes the generating slot that has used the least, and with it every other
   slot whose token waits, where decode steps may share a llama_decode (`Shapes.decode` is not
   ``apart``); each of them is charged the step's time.
4. A slot whose waiting token comes with a draft (`Task.draft`, policies.speculate) takes its
   step as a `Verify`: its token and the draft in one llama_decode, logits for every row. Where
   each slot's answer is its own (`Shapes.independent`), a verify runs alone, and the other
   waiting slots' tokens take a `Decode` of their own when theirs is the turn; otherwise every
   waiting slot's rows share one `Verify` (a slot without a draft has one row in it), as many as
   fit `rows_max` (the batch), in the order they came. A slot whose draft model prefills its
   prompt (`Task.fills`: a batch a verify step, its token waiting) takes its verify steps
   alone, so the others' tokens do not wait for its batches nor are charged their time.
5. A job is over when its slot's job changes (`track`): its time leaves with it, and the slot's
   next job starts from nothing.

**Decode shapes** (`choose_decode`). A cache hit is bit for bit a cold prefill's in every mode;
what `--deterministic` chooses is whether a slot's *answer* may depend on what other slots
generate at the same moment (llama-server's, SGLang's and vLLM's default: it may):

- ``auto`` (default): the cheapest way the start-up check proved independent (decode steps
  batched as they come, where each slot's logits equal its own alone; else the fixed shape of
  a row per slot, where a slot generating alone pays at most `FIXED_MAX_COST` for it);
  otherwise decode steps batched as they come, answers then depending on the other sessions.
- ``on``: independent at whatever cost: batched where proven, else the fixed shape where
  proven, else each slot's step apart.
- ``off``: decode steps always batched as they come.

Without a check (one slot, or `--no-exact-check`) nothing is proven: ``on`` runs apart, the
others batch as they come.

**Streams** (`wake_now`). Each wake of the worker's HTTP thread costs a wake-up, a write and
the proxy's read and write, on the cores llama.cpp computes on, and the GIL the compute thread
needs back when its step ends: on 2 cores a lone slot streamed 256 tokens at 0.89-0.92x
llama-server's rate woken for each token (bench/results/issue47/stream.md). So a generated
token other than an answer's first goes out at the HTTP thread's next beat (every `STREAM_S`
while a run streams) instead; the first one (its time to first token), every other event, and
every token after a step of `STREAM_S` or more (a large model on a CPU: a wake costs it little)
wake it at once. A run whose client does not stream (`Job.stream` false: the answer goes out
whole) wakes it for no token at all, and starts no beat: its tokens go with its end, and a
lone non-streamed answer decodes with the cores left to llama.cpp alone (on 2 cores the beat's
wakes cost a lone slot about 2.5% of its decode rate: bench/results/issue47/quiet.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

DecodeShape = Literal["batched", "fixed", "apart"]
Deterministic = Literal["auto", "on", "off"]
DETERMINISTIC: tuple[Deterministic, ...] = ("auto", "on", "off")

NOMINAL_TOKEN_S = 0.001  # a prefilled token's seconds until one was measured
PER_TOKEN_WEIGHT = 0.3  # of the newest batch in the per-token estimate (a decaying mean)
PASS_SHARE = 0.25  # of a late prefill's own time, the most it waits for shorter ones (rule 1)
# `auto` takes the fixed shape only where a slot generating alone pays at most this for it: on
# a GPU, which reads the weights once for all the rows, a row costs almost nothing; on 2 CPU
# cores a step of 3 rows cost 1.45x one row on a 1.1B f16 model and about 2x on its Q4_K_M
# (bench/results/issue20, the twelfth round)
FIXED_MAX_COST = 1.25
STREAM_S = 0.025  # the HTTP thread's beat while a run streams: a token waits at most this


# --- decode shapes ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Proof:
    """What the start-up check measured of decode steps of several slots
    (`backend.selfcheck.check_decode`); the default: nothing was checked."""

    checked: bool = False
    batched: str = ""  # why steps batched as they come change a slot's logits ("": they do not)
    fixed: str | None = None  # why the fixed shape does ("": it does not; None: not possible)
    fixed_cost: float = 0.0  # a lone slot's step in the fixed shape over alone (0: unmeasured)
    apart_cost: float = 0.0  # all slots' steps apart over one batched step of them (0: same)


@dataclass(frozen=True, slots=True)
class Shapes:
    """How decode steps run, and what that means for an answer, in one sentence."""

    decode: DecodeShape
    independent: bool  # a slot answers as it does alone, whatever else generates
    note: str  # for the ready line, /props and doctor


def _cost(x: float) -> str:
    return f"{x:.2f}x" if x > 0 else "an unmeasured cost"


def choose_decode(deterministic: Deterministic, proof: Proof, slots: int,
                  on_instead: str = "") -> Shapes:
    """The decode shape for this worker (module docstring). `on_instead`: what ``on`` would do
    instead of this proof's shapes, where it runs otherwise (on a CPU with several slots and
    flash attention ``auto``, ``on`` turns flash attention off: backend.context)."""
    if slots < 2:
        return Shapes("apart", True, "one slot: each answer is its own")
    batched_ok = proof.checked and not proof.batched
    fixed_ok = proof.checked and proof.fixed == ""
    if batched_ok:
        return Shapes("batched", True, "decode steps batched; the start-up check proved each "
                                       "slot's answer the same as alone")
    depends = ("decode steps batched as they come: answers may depend on other sessions "
               "generating at the same time, as in llama-server")
    on_costs = on_instead or (
        f"the fixed shape, a lone slot's step at {_cost(proof.fixed_cost)}" if fixed_ok else
        f"steps apart, at {_cost(proof.apart_cost)} the step time of batching")
    if deterministic == "off":
        return Shapes("batched", False, f"{depends} (--deterministic off; --deterministic on "
                                        f"keeps each answer its own: {on_costs})")
    if fixed_ok and (deterministic == "on" or 0 < proof.fixed_cost <= FIXED_MAX_COST):
        return Shapes("fixed", True, "decode steps batched in a fixed shape, a row per slot; "
                                     "each slot's answer proven the same as alone (a lone "
                                     f"slot's step at {_cost(proof.fixed_cost)})")
    if deterministic == "on":
        return Shapes("apart", True, "decode steps apart (--deterministic on): each slot's "
                                     f"answer its own, at {_cost(proof.apart_cost)} the step "
                                     "time of batching")
    return Shapes("batched", False, f"{depends}; --deterministic on keeps each answer its own: "
                                    f"{on_costs}")


# --- the scheduler ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Task:
    slot: int
    left: int = 0  # prompt tokens its prefill has left (0: it does not prefill)
    n: int = 0  # tokens of its next prefill batch
    waits: bool = False  # its generated token waits for its decode
    draft: int = 0  # tokens drafted to verify beside it (policies.speculate)
    fills: bool = False  # its draft model prefills its prompt, a batch a verify step


@dataclass(frozen=True, slots=True)
class Prefill:
    slot: int
    n: int  # tokens of the batch


@dataclass(frozen=True, slots=True)
class Decode:
    slots: tuple[int, ...]  # ascending


@dataclass(frozen=True, slots=True)
class Verify:
    slots: tuple[int, ...]  # ascending: each slot's waiting token and its draft, every row's
    # logits


Step = Prefill | Decode | Verify


@dataclass(frozen=True, slots=True)
class Account:
    used_s: float = 0.0  # the time its job's steps took (rule 2)
    began_s: float = 0.0  # when its prefill began (its first: when its request came)
    total: int = 0  # the tokens its prefill had then
    prefilling: bool = False
    run: str = ""  # the job it accounts for (a slot's next job starts a new account)
    passed_s: float = 0.0  # the time prefills due after it ran while it prefilled (rule 1)


_UNUSED = Account()  # a slot's account before its first step


@dataclass(frozen=True, slots=True)
class Clock:
    """The scheduler's accounts: each slot's job's, in the order they came."""

    accounts: Mapping[int, Account] = field(default_factory=dict)
    per_token_s: float = 0.0  # seconds a prefilled token has taken lately (0: not measured)


def track(clock: Clock, active: Sequence[tuple[int, str, float]], tasks: Sequence[Task],
          now_s: float) -> Clock:
    """The accounts brought in line with the slots' jobs (`active`: (slot, run id, when its
    request came), in the order they came) and their tasks: a new job admitted from nothing (a
    slot's next job too), a prefill begun (the job's first due from when its request came,
    a later one from now) or ended, a job gone (rules 1, 2 and 5)."""
    runs = {slot: run for slot, run, _ in active}
    came = {slot: came_s for slot, _, came_s in active}
    accounts = {s: a for s, a in clock.accounts.items() if runs.get(s) == a.run}
    changed = len(accounts) != len(clock.accounts)
    for slot, run, _ in active:
        if slot not in accounts:
            accounts[slot], changed = Account(run=run), True
    prefilling = {t.slot: t.left for t in tasks if t.left > 0}
    for slot, a in accounts.items():
        if a.prefilling != (slot in prefilling):
            began = min(came.get(slot, now_s), now_s) if a.total == 0 else now_s
            accounts[slot] = replace(a, prefilling=False) if a.prefilling else \
                replace(a, began_s=began, total=prefilling[slot], prefilling=True)
            changed = True
    # jobs that go on as they were (every generated token's step): the same clock
    return Clock(accounts, clock.per_token_s) if changed else clock


def charge(clock: Clock, step: Step, seconds: float) -> Clock:
    """The step took `seconds`: each of its slots' time, and of a prefill the per-token
    estimate."""
    if isinstance(step, Prefill):
        per = seconds / step.n if step.n > 0 else 0.0
        clock = replace(clock, per_token_s=per if not clock.per_token_s else
                        (1 - PER_TOKEN_WEIGHT) * clock.per_token_s + PER_TOKEN_WEIGHT * per)
    accounts = dict(clock.accounts)
    if isinstance(step, Prefill) and step.slot in accounts:  # the prefills it passed
        due = due_s(clock, step.slot)
        accounts.update({s: replace(a, passed_s=a.passed_s + seconds)
                         for s, a in accounts.items()
                         if a.prefilling and s != step.slot and due_s(clock, s) < due})
    for s in (step.slot,) if isinstance(step, Prefill) else step.slots:
        a = accounts.get(s, _UNUSED)
        accounts[s] = replace(a, used_s=a.used_s + seconds)
    return Clock(accounts, clock.per_token_s)


def due_s(clock: Clock, slot: int) -> float:
    """When the slot's prefill would end had it run alone from its start (rule 1)."""
    a = clock.accounts.get(slot, Account())
    return a.began_s + a.total * (clock.per_token_s or NOMINAL_TOKEN_S)


def next_step(tasks: Sequence[Task], clock: Clock, shapes: Shapes, rows_max: int = 0,
              now_s: float = 0.0) -> Step | None:
    """The step to run now (module rules); None when no task has compute to do. `tasks` in the
    order the slots' jobs came; `rows_max`: the rows a llama_decode holds (0: no bound);
    `now_s`: the clock's time now (0: none is late)."""
    order = {s: i for i, s in enumerate(clock.accounts)}

    def came(t: Task) -> int:
        return order.get(t.slot, len(order) + t.slot)

    def used(t: Task) -> float:
        return clock.accounts.get(t.slot, Account()).used_s

    prefills = [t for t in tasks if t.left > 0 and t.n > 0]
    waiting = sorted((t for t in tasks if t.waits), key=came)
    first = min(waiting, key=used, default=None)  # the first of the least used (rule 2)
    due = min(prefills, key=lambda t: (due_s(clock, t.slot), came(t)), default=None)
    if due is not None and now_s > due_s(clock, due.slot):  # late: a shorter one may pass
        per = clock.per_token_s or NOMINAL_TOKEN_S
        short = min(prefills, key=lambda t: (max(due_s(clock, t.slot), now_s + t.left * per),
                                             came(t)))
        late = clock.accounts.get(due.slot, _UNUSED)
        if short is not due and late.passed_s + short.n * per <= PASS_SHARE * late.total * per:
            due = short
    if due is not None and (first is None or used(due) < used(first)):
        return Prefill(due.slot, due.n)
    if first is None:
        return None
    group = [first] if shapes.decode == "apart" or first.fills else \
        [t for t in waiting if not t.fills]
    if not any(t.draft for t in group):
        return Decode(tuple(sorted(t.slot for t in group)))
    if shapes.independent:  # rule 4: a verify alone
        if first.draft:
            return Verify((first.slot,))
        return Decode(tuple(sorted(t.slot for t in group if not t.draft)))
    rows, taken = 0, list[int]()
    for t in [first, *(t for t in group if t is not first)]:
        if rows_max and taken and rows + 1 + t.draft > rows_max:
            continue
        rows += 1 + t.draft
        taken.append(t.slot)
    return Verify(tuple(sorted(taken)))


def wake_now(token: bool, first: bool, step_s: float, streamed: bool = True) -> bool:
    """Whether a run's event wakes the HTTP thread now (`first`: the answer's first token;
    `step_s`: the last decode or verify step's seconds; `streamed`: its client reads the answer
    as it comes) rather than waiting for its beat, or for its end where it is not streamed."""
    return not token or (streamed and (first or step_s >= STREAM_S))
