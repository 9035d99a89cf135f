"""The rules of one run, pure: `RunState.apply(event) -> effects` (the driver is proxy/run.py).

`RunState` is a pure state machine: ``apply(event) -> effects``. It is fed the worker's events
(backend/protocol.py) and three of the proxy's own: `StreamLost` (the worker's stream failed or
ended early), `Abandon` (the client went away) and `Shutdown` (the proxy is stopping). It
returns what must happen, as values; `Run` performs them. No I/O, clock or logging in the state
machine; tests drive it with tables of events and compare the effects exactly.

Rules of the state machine:
- `Start` comes first: broken entries the worker skipped are dropped (`Drop`), a restored entry
  counts a hit (`Touch`); `cached_tokens` is what the worker kept or restored, its source disk
  or live; `created_tokens` the prefilled tokens a planned save will cover.
- `Token` text goes to the consumer (`Emit`) unless the client left.
- The run *ends* once: at `Done` (outcome ok, or cancelled when the client left in the
  meantime), `Cancelled`, a worker `Error` or `StreamLost` (outcome error, or cancelled), a
  `Shutdown`. Ending counts the outcome (`Record` for ok: metrics and the request's log line;
  `Count` otherwise, unless the cancel was counted when it was asked for), ends the consumer's
  stream (`Finish`, or `Fail` on an error) and releases the worker (`Release`) with what its KV
  holds exactly: prompt and generated tokens up to `Done.n_live`, the prompt up to the last
  `Prefill` otherwise, nothing after a shutdown; after a lost stream the worker is *suspect*
  (it may have died: the pool takes it out until it answers again).
- Snapshots are committed as their `Saved` arrive (`Commit`), also after the end: the run is
  *closed* once the saves announced by `Done`/`Cancelled` are all in. After a failure, saves
  still missing are lost (`LostSaves`).
- `Abandon` before the end: count it cancelled once, ask the worker to stop (`SendCancel`).
- `Yield` (a short request takes the slot: policies/preempt.py), once per request and only
  before any token: ask the worker to stop if it has not sampled (`SendCancel(prefilling)`).
  Its `Cancelled` ends the run *preempted*: no outcome is counted and the consumer's stream
  goes on; the worker is released with the prefix it holds and the driver runs the request
  again (`Requeue`). A `Token` first means the worker had sampled, and `Kept` that it would not
  stop (its state would not fit the RAM tier): the yield lapses (`Lapse`: the slot's
  reservation is lifted) and the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.protocol import (
    Cancelled,
    Done,
    Error,
    Event,
    Fault,
    Kept,
    Prefill,
    Saved,
    SaveFailed,
    Start,
    Token,
)
from policies.decide import Plan
from policies.prefix import TokenIds

# --- the proxy's own events ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamLost:
    message: str  # the worker's stream failed or ended early (the worker died, or went down)


@dataclass(frozen=True, slots=True)
class Abandon:
    pass  # the client went away


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass  # the proxy is stopping: the worker is going away too


@dataclass(frozen=True, slots=True)
class Yield:
    pass  # a short request takes this slot: stop if still prefilling (policies/preempt.py)


RunEvent = Event | StreamLost | Abandon | Shutdown | Yield


# --- effects ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Emit:
    text: str


@dataclass(frozen=True, slots=True)
class Finish:
    pass  # the consumer's text ends


@dataclass(frozen=True, slots=True)
class Fail:
    message: str  # the consumer gets a WorkerFailed


@dataclass(frozen=True, slots=True)
class Commit:
    saved: Saved


@dataclass(frozen=True, slots=True)
class SaveFailure:
    failed: SaveFailed


@dataclass(frozen=True, slots=True)
class Drop:
    fault: Fault
    key: bytes | None  # the plan's entry for that file (None: not one of the plan's)


@dataclass(frozen=True, slots=True)
class Touch:
    key: bytes
    restore_s: float


@dataclass(frozen=True, slots=True)
class Progress:
    n_live: int


@dataclass(frozen=True, slots=True)
class Record:
    pass  # a served request: its metrics and its log line


@dataclass(frozen=True, slots=True)
class Count:
    outcome: str  # requests_total{outcome}, and a short log line


@dataclass(frozen=True, slots=True)
class Release:
    live_ids: Sequence[int]
    suspect: bool = False  # its stream was lost: it may have died (see Pool.release)
    floor: int = 0  # the shortest prefix of live_ids the worker's memory can be cut back to
    costs: dict[str, Any] | None = None  # the worker's measured costs, from its `Done`


@dataclass(frozen=True, slots=True)
class SendCancel:
    prefilling: bool = False  # only if the worker has not sampled (a preemption)


@dataclass(frozen=True, slots=True)
class Requeue:
    pass  # preempted: run the request again from what it left (the consumer's stream goes on)


@dataclass(frozen=True, slots=True)
class Lapse:
    reason: str = ""  # the yield came too late ("": it had sampled) or was not taken: the slot
    # stays this run's


@dataclass(frozen=True, slots=True)
class LostSaves:
    message: str


Effect = (Emit | Finish | Fail | Commit | SaveFailure | Drop | Touch | Progress | Record | Count
          | Release | SendCancel | LostSaves | Requeue | Lapse)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # not prefilled: live KV kept or restored from disk
    source: str = "none"  # "live" | "ram" | "disk" | "shared" | "none"
    created_tokens: int = 0  # prefilled tokens covered by a new snapshot
    completion_tokens: int = 0

    @property
    def input_tokens(self) -> int:  # Anthropic: prefilled and not newly snapshotted
        return self.prompt_tokens - self.cached_tokens - self.created_tokens


# --- the state machine -------------------------------------------------------------------


@dataclass(slots=True)
class RunState:
    ids: Sequence[int]  # policies.prefix.TokenIds from a render
    plan: Plan
    usage: Usage = field(init=False)
    finish_reason: str = "length"  # "stop" | "length" (the API edge adds tool_calls)
    stop: str | None = None  # the stop string that ended the text
    gen_ids: list[int] = field(default_factory=list)
    live_n: int = 0  # prompt tokens the worker's KV holds so far
    timings: dict[str, float] = field(default_factory=dict)
    draft: dict[str, Any] = field(default_factory=dict)  # per source (proxy/speculation.py)
    started: bool = False
    ended: bool = False  # the worker was released
    abandoned: bool = False
    yielding: bool = False  # a Yield was sent and neither its Cancelled nor a Token came
    yielded: bool = False  # it gave way once (or is the request's second run): never again
    tokens: bool = False  # a token came
    outcome: str = ""
    saves_seen: int = 0
    saves_expected: int | None = None  # announced by Done/Cancelled
    _finished: bool = False

    def __post_init__(self) -> None:
        self.usage = Usage(prompt_tokens=len(self.ids))

    @property
    def closed(self) -> bool:
        """Nothing more will come: ended, and every announced save reported (or given up)."""
        return self.ended and self.saves_expected is not None \
            and self.saves_seen >= self.saves_expected

    def apply(self, ev: RunEvent) -> list[Effect]:
        return _HANDLERS[type(ev)](self, ev)

    # --- handlers --------------------------------------------------------------------------

    def _start(self, ev: Start) -> list[Effect]:
        self.started = True
        by_file = {r.file: r for r in self.plan.restore if r.tier == "disk"}
        fx: list[Effect] = [Drop(f, by_file[f.file].key if f.file in by_file else None)
                            for f in ev.faults]
        u = self.usage
        u.cached_tokens = self.live_n = ev.keep
        if ev.ram:
            u.source = "ram"
        elif ev.restored:
            u.source = "shared" if ev.tier == "shared" else "disk"
            fx += [Touch(r.key, ev.restore_s) for r in self.plan.restore
                   if r.n_tokens == ev.restored]
        elif ev.keep:
            u.source = "live"
        saves = [s.n_tokens for s in self.plan.saves if s.n_tokens >= u.cached_tokens]
        u.created_tokens = max(saves, default=u.cached_tokens) - u.cached_tokens
        self.timings["restore_s"] = ev.restore_s
        return fx

    def _prefill(self, ev: Prefill) -> list[Effect]:
        self.live_n = ev.n_live
        return [Progress(ev.n_live)]

    def _token(self, ev: Token) -> list[Effect]:
        if ev.id is not None:
            self.gen_ids.append(ev.id)
        fx: list[Effect] = [Emit(ev.text)] if ev.text and not self.abandoned else []
        self.tokens = True
        if self.yielding:
            self.yielding = False
            fx.insert(0, Lapse())
        return fx

    def _done(self, ev: Done) -> list[Effect]:
        self.finish_reason = "stop" if ev.finish_reason == "stop_sequence" else ev.finish_reason
        self.stop = ev.stop
        self.usage.completion_tokens = ev.n_gen
        self.timings.update(prefill_s=ev.prefill_s, decode_s=ev.decode_s)
        self.draft = ev.draft
        self.saves_expected = ev.pending_saves
        live = (TokenIds(self.ids) + self.gen_ids)[: ev.n_live]  # bytes, not ints, copied
        # abandoned: the cancel came too late, the run finished anyway
        return self._end("cancelled" if self.abandoned else "ok", live, floor=ev.floor,
                         costs=ev.costs or None)

    def _kept(self, ev: Kept) -> list[Effect]:
        if not self.yielding:
            return []
        self.yielding = False
        return [Lapse(ev.reason)]

    def _cancelled(self, ev: Cancelled) -> list[Effect]:
        self.live_n = ev.n_live
        self.saves_expected = ev.pending_saves
        if self.yielding and not self.abandoned and not self.ended:
            self.yielding, self.ended, self.outcome = False, True, "preempted"
            return [Release(self.ids[: self.live_n], floor=ev.floor), Requeue()]
        return self._end("cancelled", self.ids[: self.live_n], floor=ev.floor)

    def _saved(self, ev: Saved) -> list[Effect]:
        self.saves_seen += 1
        return [Commit(ev)]

    def _save_failed(self, ev: SaveFailed) -> list[Effect]:
        self.saves_seen += 1
        return [SaveFailure(ev)]

    def _failed(self, ev: Error | StreamLost) -> list[Effect]:
        pending = self.saves_expected is not None and self.saves_seen < self.saves_expected
        self.saves_expected = self.saves_seen  # saves still missing are not awaited
        if not self.started:  # the worker refused the job: the caller fails and releases
            self.ended = True
            return [Fail(ev.message)]
        if self.ended:
            return [LostSaves(ev.message)] if pending else []
        return self._end("cancelled" if self.abandoned else "error", self.ids[: self.live_n],
                         failure=ev.message, suspect=isinstance(ev, StreamLost))

    def _shutdown(self, ev: Shutdown) -> list[Effect]:
        self.saves_expected = self.saves_seen
        return self._end("cancelled", ())

    @property
    def may_yield(self) -> bool:
        """It may still give its slot to a short request (policies/preempt.py)."""
        return self.started and not (self.yielded or self.tokens or self.abandoned
                                     or self.ended)

    def _yield(self, ev: Yield) -> list[Effect]:
        if not self.may_yield:
            return []
        self.yielding = self.yielded = True
        return [SendCancel(prefilling=True)]

    def _abandon(self, ev: Abandon) -> list[Effect]:
        if self.abandoned or self.ended:
            return []
        self.abandoned = True
        return [Count("cancelled"), SendCancel()]

    def _end(self, outcome: str, live: Sequence[int], failure: str | None = None,
             suspect: bool = False, floor: int = 0, costs: dict[str, Any] | None = None
             ) -> list[Effect]:
        if self.ended:
            return []
        self.ended = True
        self.outcome = outcome
        fx: list[Effect] = []
        if not self._finished:
            self._finished = True
            fx.append(Fail(failure) if failure is not None else Finish())
        if outcome == "ok":
            fx.append(Record())
        elif not self.abandoned:  # a cancel was counted when it was asked for
            fx.append(Count(outcome))
        fx.append(Release(tuple(live), suspect, floor, costs))
        return fx


_HANDLERS: dict[type, Callable[[RunState, Any], list[Effect]]] = {
    Start: RunState._start, Prefill: RunState._prefill, Token: RunState._token,
    Done: RunState._done, Cancelled: RunState._cancelled, Saved: RunState._saved,
    SaveFailed: RunState._save_failed, Error: RunState._failed, StreamLost: RunState._failed,
    Shutdown: RunState._shutdown, Abandon: RunState._abandon, Yield: RunState._yield,
    Kept: RunState._kept,
}
