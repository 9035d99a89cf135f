"""The worker protocol: what the proxy sends a worker (a :class:`Job`) and the events it streams
back, each a frozen value, encoded and parsed here and nowhere else.

    POST /run     body: Job.encode()       -> NDJSON, one event per line (encode_event)
    POST /cancel  {"run_id", "prefilling"?} -> {"cancelled": bool} ("prefilling": only a run
                                              that has not sampled yet stops)
    GET  /health                           -> WorkerInfo.to_wire() (200), or while it loads
                                              503 {"status": "loading", "phase", "progress"}
    GET  /events                           -> NDJSON of TierEvent, from the tiers as they are

Events of one run, in order:

    Start        once, first: tokens kept live, tokens restored from disk, broken files skipped
    Prefill      after each prefill batch: how many prompt tokens the KV holds now
    Token        one per generated token (``id`` None for text held back and flushed at the end)
    Done         generation ended: why, which stop string matched, how many saves were started
    Cancelled    instead of Done, after a /cancel: what the KV holds (a run that had sampled
                 goes on past a "prefilling" cancel, and no Cancelled comes)
    Kept         a "prefilling" cancel not taken while it prefills (its state would not fit
                 the RAM tier): the run goes on
    Saved        a state file is durable (may come before or after Done)
    SaveFailed   a state file could not be written
    Error        the run failed; nothing more follows

The stream ends after ``Done`` or ``Cancelled`` once the ``pending_saves`` announced there have
all been reported as ``Saved`` or ``SaveFailed``, or after ``Error``.

A job's body is one JSON line (``Job.to_wire()``: every field but the prompt, whose length is
``n_ids``), then the prompt's ids as 4-byte little-endian signed integers: a 32K-token prompt
as a JSON list took 2.7 ms to write on the proxy's event loop and 4.9 ms to read and check on
the worker's, every request; as bytes it is a copy on the proxy and one conversion on the
worker (``ids_of``), and the worker gets ``TokenIds`` whose ``packed`` its keys hash as they
are.

Both sides parse strictly: a missing field is a ``ValueError`` (a bug), never a default.
`PROTOCOL` names this version of the whole: a proxy refuses a worker whose ``/health`` states
another (a remote worker of an older version would take a "prefilling" cancel as a plain one
and stop an answer under way).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from policies.decide import Plan
from policies.prefix import TokenIds, keep_max, packed_le
from policies.sources import TIERS

# bumped whenever a message above changes meaning (2: /cancel's "prefilling", Kept; 3: the
# job's ids as bytes after its JSON line; 4: a job nested on its slot's run, `Job.nest`)
PROTOCOL = 4

FinishReason = str  # "stop" (end of generation) | "length" | "stop_sequence"


@dataclass(frozen=True, slots=True)
class Job:
    run_id: str  # for /cancel
    ids: tuple[int, ...]  # the whole prompt
    salt: bytes  # the cache salt (identity and tenant) the worker keys its saves with
    tenant: str  # whose request this is (a hash; "" without tenant isolation)
    plan: Plan
    sampling: Mapping[str, Any]  # backend.engine.Sampling fields
    max_tokens: int
    stop: tuple[str, ...]
    grammar: str | None  # GBNF constraining the output (forced tool calls)
    slot: int = 0  # which of the worker's sequences runs it (--parallel)
    # seconds since the request came to the server (its parse, render and wait for a slot):
    # the scheduler counts a prefill's due time from then (policies.schedule rule 1)
    waited_s: float = 0.0
    # whether its client reads the answer as it comes; false: tokens go out with the end
    # (policies.schedule.wake_now)
    stream: bool = True
    # a short job nested on the slot's generating run: the worker parks that run (its state in
    # host RAM) until this one ends, then puts it back as it was (policies.preempt, rule 4)
    nest: bool = False

    def to_wire(self) -> dict[str, Any]:
        """Every field but the prompt's ids, which follow this line as bytes (``encode``)."""
        return {"run_id": self.run_id, "slot": self.slot, "n_ids": len(self.ids),
                "salt": self.salt.hex(),
                "tenant": self.tenant, "plan": self.plan.to_wire(),
                "sampling": dict(self.sampling), "max_tokens": self.max_tokens,
                "stop": list(self.stop), "grammar": self.grammar, "waited_s": self.waited_s,
                "stream": self.stream, "nest": self.nest}

    def encode(self) -> bytes:
        """POST /run's body: ``to_wire()`` as one JSON line, then the ids (``packed_le``:
        4-byte little-endian, ``TokenIds`` as they are)."""
        return json.dumps(self.to_wire()).encode() + b"\n" + packed_le(self.ids)

    @classmethod
    def decode(cls, body: bytes) -> Job:
        """The job ``encode`` wrote; ``ValueError`` for anything else."""
        head, newline, ids = body.partition(b"\n")
        if not newline:
            raise ValueError("malformed job: no line ends its fields")
        try:
            d = json.loads(head)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed job: {e}") from None
        return cls.from_wire(d, ids_of(ids))

    @classmethod
    def from_wire(cls, d: Any, ids: TokenIds) -> Job:
        """The job of fields `d` (``to_wire()``'s) and the prompt `ids` (``ids_of``)."""
        try:
            grammar = d["grammar"]
            if not isinstance(d["sampling"], dict) or not (grammar is None
                                                           or isinstance(grammar, str)):
                raise ValueError("sampling must be an object, grammar a string or null")
            if _check(d["n_ids"], "int") != len(ids):
                raise ValueError(f"{d['n_ids']} ids announced, {len(ids)} sent")
            job = cls(run_id=_check(d["run_id"], "str"), ids=ids,
                      salt=bytes.fromhex(_check(d["salt"], "str")),
                      tenant=_check(d["tenant"], "str"),
                      plan=Plan.from_wire(d["plan"]), sampling=dict(d["sampling"]),
                      max_tokens=_check(d["max_tokens"], "int"),
                      stop=tuple(_check(s, "str") for s in _check(d["stop"], "list")),
                      grammar=grammar, slot=_check(d["slot"], "int"),
                      waited_s=float(_check(d["waited_s"], "float")),
                      stream=_check(d["stream"], "bool"), nest=_check(d["nest"], "bool"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed job: {type(e).__name__} {e}") from None
        except ValueError as e:
            raise ValueError(f"malformed job: {e}") from None
        if job.slot < 0:
            raise ValueError(f"malformed job: slot {job.slot}")
        if not 0 <= job.waited_s < float("inf"):
            raise ValueError(f"malformed job: waited_s {job.waited_s}")
        if not 0 <= job.plan.keep_max <= keep_max(len(job.ids), 1):
            # the last prompt token is always evaluated: logits are not in a snapshot (the
            # worker rounds the rest down to its own batch edges)
            raise ValueError(f"malformed job: keep_max {job.plan.keep_max} for a prompt of "
                             f"{len(job.ids)} tokens")
        return job


_LITTLE = sys.byteorder == "little"


def ids_of(data: bytes) -> TokenIds:
    """The ids ``Job.encode`` wrote, none negative; ``ValueError`` otherwise."""
    if len(data) % 4:
        raise ValueError(f"malformed job: {len(data)} bytes of ids, not a multiple of 4")
    arr = np.frombuffer(data, "<i4")
    if len(arr) and int(arr.min()) < 0:
        raise ValueError(f"malformed job: a negative token id ({int(arr.min())})")
    return TokenIds.from_packed(bytes(data) if _LITTLE else arr.astype("=i4").tobytes())


@dataclass(frozen=True, slots=True)
class Fault:
    reason: str  # store.CacheFault reasons, or "corrupt"
    message: str
    file: str


@dataclass(frozen=True, slots=True)
class Start:
    keep: int  # prompt tokens reused (live or restored)
    restored: int  # n_tokens of the restored entry, 0 for none
    restore_s: float
    faults: tuple[Fault, ...]  # entries tried and found broken
    ram: int = 0  # tokens restored from the worker's memory instead (0: none)
    tier: str = "live"  # where they came from (policies.sources.Tier)


@dataclass(frozen=True, slots=True)
class Prefill:
    n_live: int


@dataclass(frozen=True, slots=True)
class Kept:
    reason: str  # a "prefilling" cancel the run did not take: it goes on (no Cancelled comes)


@dataclass(frozen=True, slots=True)
class Token:
    id: int | None
    text: str


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: FinishReason
    stop: str | None  # the stop string that matched (finish_reason "stop_sequence")
    n_gen: int
    n_live: int  # tokens the KV holds exactly that a next request may keep (prompt, generated)
    floor: int  # the shortest of them the memory can be cut back to (n_live: only them all)
    prefill_s: float
    decode_s: float
    pending_saves: int  # saves this run started, all reported before the stream ends
    # the worker's measured costs after this run (policies.costs.Costs.to_wire): {} for none
    costs: dict[str, Any] = field(default_factory=dict)
    # speculation (backend.worker.drafts): per source, {"drafted", "accepted", "verifies"}
    draft: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Cancelled:
    n_live: int
    floor: int
    pending_saves: int


@dataclass(frozen=True, slots=True)
class Saved:
    n_tokens: int
    key: str  # hex
    reason: str
    file: str
    size_bytes: int
    checksum: int
    save_s: float


@dataclass(frozen=True, slots=True)
class SaveFailed:
    n_tokens: int
    key: str
    reason: str
    fault: str
    message: str


@dataclass(frozen=True, slots=True)
class Error:
    message: str


@dataclass(frozen=True, slots=True)
class TierEvent:
    """A state entered (stored) or left (removed) one of the worker's tiers (`GET /events`): the
    proxy's view of the worker's memory, and what an external KV-aware router is fed."""

    kind: str  # stored | removed
    tier: str  # policies.sources.Tier: live, ram, queued, disk, shared
    ref: int  # the tier's own handle (the slot, for live; the RAM entry's key)
    salt: str  # hex: the cache salt (model identity and tenant) it is keyed with
    tenant: str
    n_tokens: int
    ids: tuple[int, ...] = ()  # stored: exactly the tokens it holds


Event = (Start | Prefill | Token | Done | Cancelled | Saved | SaveFailed | Error | TierEvent
         | Kept)

_NAMES: dict[type, str] = {Start: "start", Prefill: "prefill", Token: "token", Done: "done",
                           Cancelled: "cancelled", Saved: "saved", SaveFailed: "save_failed",
                           Error: "error", TierEvent: "tier", Kept: "kept"}
_TYPES: dict[str, type] = {name: t for t, name in _NAMES.items()}


# what each annotation of an event field admits (bool is not an int here)
_ADMITS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list),
    "dict[str, Any]": lambda v: isinstance(v, dict),
    "FinishReason": lambda v: v in ("stop", "length", "stop_sequence"),
}
_ADMITS["int | None"] = lambda v: v is None or _ADMITS["int"](v)
_ADMITS["str | None"] = lambda v: v is None or isinstance(v, str)
_ADMITS["tuple[Fault, ...]"] = _ADMITS["list"]
_ADMITS["bool"] = lambda v: isinstance(v, bool)
_ADMITS["tuple[int, ...]"] = lambda v: isinstance(v, list) and all(_ADMITS["int"](x) for x in v)
_ADMITS["tuple[bool, ...]"] = lambda v: isinstance(v, list) and all(isinstance(x, bool)
                                                                     for x in v)
_ADMITS["dict[str, float]"] = lambda v: isinstance(v, dict) and all(
    isinstance(k, str) and _ADMITS["float"](x) for k, x in v.items())
_ADMITS["dict[str, float] | None"] = lambda v: v is None or _ADMITS["dict[str, float]"](v)
_ADMITS["DecodeInfo"] = _ADMITS["Identity"] = _ADMITS["dict[str, Any]"]
_ADMITS["dict[str, float] | None"] = lambda v: v is None or _ADMITS["dict[str, float]"](v)


def _check(v: Any, annotation: str) -> Any:
    if not _ADMITS[annotation](v):
        raise ValueError(f"expected {annotation}, got {v!r}")
    return v


def _fields(t: type, d: Mapping[str, Any]) -> dict[str, Any]:
    return {f.name: _check(d[f.name], str(f.type)) for f in fields(t)}


def _tuples(t: type, ev: dict[str, Any]) -> dict[str, Any]:
    """JSON lists back into the tuples the annotations name."""
    return {k: tuple(v) if str(f.type).startswith("tuple[") and isinstance(v, list) else v
            for f in fields(t) for k, v in [(f.name, ev[f.name])]}


def _start(d: Mapping[str, Any]) -> Start:
    ev = _fields(Start, d)
    ev["faults"] = tuple(Fault(**_fields(Fault, f)) for f in ev["faults"])
    return Start(**ev)


def _tier_event(d: Mapping[str, Any]) -> TierEvent:
    ev = TierEvent(**_tuples(TierEvent, _fields(TierEvent, d)))
    if ev.kind not in ("stored", "removed") or ev.tier not in TIERS:
        raise ValueError(f"malformed tier event {ev.kind!r} {ev.tier!r}")
    return ev


_PARSERS: dict[type, Callable[[Mapping[str, Any]], Any]] = {Start: _start,
                                                            TierEvent: _tier_event}


def encode_event(ev: Event) -> bytes:
    # a token is the event sent most (one per generated token): its body without `asdict`
    body = {"event": "token", "id": ev.id, "text": ev.text} if type(ev) is Token else \
        {"event": _NAMES[type(ev)], **asdict(ev)}
    return json.dumps(body, ensure_ascii=False).encode() + b"\n"


def parse_event(line: bytes | str) -> Event:
    """One NDJSON line -> its event; ``ValueError`` for anything else."""
    try:
        d = json.loads(line)
        t = _TYPES[d["event"]]
        parse = _PARSERS.get(t)
        if parse is not None:
            ev: Event = parse(d)
        else:
            ev = t(**_fields(t, d))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed worker event {line[:200]!r}: {type(e).__name__} {e}"
                         ) from None
    return ev


@dataclass(frozen=True, slots=True)
class Identity:
    """A worker's cache identity as it reports it (backend.keys.CacheIdentity's fields)."""

    model_path: str
    n_ctx: int
    type_k: str
    type_v: str
    flash_attn: str
    lib_version: str
    swa_full: bool
    batch: int
    compute: str


@dataclass(frozen=True, slots=True)
class Loading:
    """A loading worker's `/health` (503): how far it got."""

    phase: str  # "loading the model", "measuring prefill batches ...", "self-check"
    progress: float  # 0..1, the model's load (llama.cpp's progress callback): only rises
    worker_id: int
    pid: int
    seconds: float  # since it started
    step: float  # 0..1, the phase's own progress (the load's, then the measure's, the check's)

    def to_wire(self) -> dict[str, Any]:
        return {"ready": False, "status": "loading", **asdict(self)}

    @classmethod
    def from_wire(cls, d: Any) -> Loading:
        try:
            if not isinstance(d, dict) or d["status"] != "loading":
                raise ValueError("not a loading worker's /health")
            return cls(**_fields(cls, d))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed worker /health: {type(e).__name__} {e}") from None


@dataclass(frozen=True, slots=True)
class DecodeInfo:
    """How a worker's decode steps of several slots run (`policies.schedule.Shapes`)."""

    shape: str  # batched | fixed | apart
    independent: bool  # a slot answers as it does alone, whatever else generates
    deterministic: str  # --deterministic as asked: auto | on | off
    note: str  # in one sentence, for the ready line, /props and doctor


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A ready worker's `/health`: what the proxy reads of it, typed, and parsed strictly on
    both sides (a missing or mistyped field is a ValueError, never a default)."""

    worker_id: int
    pid: int
    boot_id: str  # new each start: the proxy detects a restart
    model: str
    fingerprint: str  # hex: the cache identity (backend.keys)
    llama_cpp_version: str
    flash_attn: str  # as llama.cpp got it
    compute: str  # the devices that compute the KV (in the fingerprint)
    n_ctx: int  # as configured, all slots
    n_ctx_actual: int  # one slot's, padded by llama.cpp
    slots: int
    n_live: tuple[int, ...]  # per slot
    busy: tuple[bool, ...]  # per slot
    memory: str  # plain | window | recurrent (backend.engine.Memory)
    n_swa: int
    swa_full: bool
    align: int  # the batch size: reuse only at batch edges (policies.prefix.Batching)
    batch_ends: tuple[int, ...]  # end-of-turn ids where a batch may end early
    exact: bool  # the start-up self-check passed (false: it reuses nothing)
    exact_failure: str  # why not
    borrows: bool  # it copies part of one slot's live KV into another (policies.sources)
    decode: DecodeInfo
    threads: int  # as the engine resolved them
    threads_batch: int
    cache_volume: str  # the id in its --cache-dir (backend/volume.py)
    costs: dict[str, Any]  # policies.costs.Costs.to_wire()
    cache_ram: dict[str, float]  # the RAM tier's budget, use and counts
    shared: dict[str, float] | None  # the shared tier's counts (None: no shared tier)
    writes: dict[str, float]  # state files queued and written at rest
    borrowed: dict[str, float]  # states cut back from another slot, RAM or the queue
    placement: dict[str, Any]  # where weights and KV went (placement_note)
    checked: dict[str, Any]  # the self-check's verdict as it ran or was remembered
    identity: Identity  # its cache identity, the devices that compute included
    # speculative decoding (backend.worker.verify.report): {} where it is off
    speculation: dict[str, Any] = field(default_factory=dict)
    protocol: int = PROTOCOL  # the worker protocol it speaks (a proxy takes only its own)

    def to_wire(self) -> dict[str, Any]:
        return {"ready": True, **asdict(self)}

    @classmethod
    def from_wire(cls, d: Any) -> WorkerInfo:
        try:
            if not isinstance(d, dict) or d["ready"] is not True:
                raise ValueError("not a ready worker's /health")
            if d.get("protocol") != PROTOCOL:  # before 2, /health named none
                theirs = d.get("protocol", 1)
                raise ValueError(f"it speaks worker protocol {theirs!r}, this proxy "
                                 f"{PROTOCOL}")
            ev = _tuples(cls, _fields(cls, d))
            ev["decode"] = DecodeInfo(**_fields(DecodeInfo, ev["decode"]))
            ev["identity"] = Identity(**_fields(Identity, ev["identity"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed worker /health: {type(e).__name__} {e}") from None
        if ev["memory"] not in ("plain", "window", "recurrent") or ev["decode"].shape not in (
                "batched", "fixed", "apart") or len(ev["n_live"]) != ev["slots"] or len(
                ev["busy"]) != ev["slots"]:
            raise ValueError("malformed worker /health: memory, decode shape or slots")
        return cls(**ev)


def placement_note(p: Mapping[str, Any]) -> str:
    """A worker's /health "placement" in one phrase, for the ready line: "CUDA0 (NVIDIA H100
    80GB HBM3): 49/49 layers on the GPU, weights 17.31 GiB VRAM + 0.40 GiB RAM, KV and buffers
    3.10 GiB VRAM + 0.01 GiB RAM" ("" from a worker that does not report it)."""
    if not p:
        return ""

    def gib(key: str) -> str:
        return f"{int(p.get(key, 0)) / 2**30:.2f} GiB"
    more = "".join(f"; {p[k]}" for k in ("rope", "metadata", "numa", "kv_offload")
                   if p.get(k))  # backend/context.py
    if not p.get("gpu_layers"):
        batch = "".join(f"; {p[k]}" for k in ("batch", "padding") if p.get(k))  # worker/batch.py
        return (f"{p.get('backend', 'CPU')}: no layers on a GPU, weights {gib('weights_bytes')}"
                f", KV and buffers {gib('ram_kv_bytes')} RAM{batch}{more}")
    return (f"{p['backend']}: {p['gpu_layers']}/{p['layers']} layers on the GPU, weights "
            f"{gib('vram_weights_bytes')} VRAM + {gib('ram_weights_bytes')} RAM, KV and "
            f"buffers {gib('vram_kv_bytes')} VRAM + {gib('ram_kv_bytes')} RAM{more}")
