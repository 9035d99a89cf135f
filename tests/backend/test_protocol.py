"""The worker protocol: a Job and every event survive their wire form, and a malformed one is a
ValueError, never a default."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, get_args

import pytest

from backend.protocol import (
    PROTOCOL,
    Cancelled,
    Done,
    Error,
    Event,
    Fault,
    Job,
    Kept,
    Prefill,
    Saved,
    SaveFailed,
    Start,
    TierEvent,
    Token,
    WorkerInfo,
    encode_event,
    ids_of,
    parse_event,
)
from policies.decide import Plan, Restore, Save
from policies.prefix import TokenIds, keep_max, packed_le

PLAN = Plan(
    restore=(Restore(30, b"\x01\x02", "ab/0102.state"), Restore(10, b"\x03", "03.state")),
    saves=(Save(20, "scoped"), Save(40, "growing")),
    keep_max=30,
    live_ok=True,
    lookup="partial",
    boundary=20,
    anchor_skipped=None,
)
IDS = tuple(range(1000, 1040))

JOBS = [
    # A forced tool call: a grammar, stop strings, nested sampling values.
    Job(run_id="r1", ids=IDS, salt=b"\x5a" * 16, tenant="t" * 32, plan=PLAN,
        sampling={"temperature": 0.7, "top_k": 40, "seed": None, "logit_bias": {"5": -1.5}},
        max_tokens=256, stop=("</tool>", "\n\nUser:"), grammar='root ::= "{" [^}]* "}"',
        waited_s=8.25),
    # The off plan keeping all it may (n - 1 on a worker of batch 1).
    Job(run_id="r2", ids=IDS, salt=b"", tenant="", plan=Plan((), (), 38, False, "off", None,
                                                             None),
        sampling={"temperature": 0.0}, max_tokens=1, stop=(), grammar=None, stream=False),
    # No grammar, no stop strings, an empty prompt: nothing to keep.
    Job(run_id="", ids=(), salt=b"", tenant="", plan=Plan((), (), 0, True, "off", None, None),
        sampling={},
        max_tokens=0, stop=(), grammar=None),
]


def job_wire() -> dict[str, Any]:
    d: dict[str, Any] = json.loads(json.dumps(JOBS[0].to_wire()))
    return d


def job_of(d: Any, ids: tuple[int, ...] = IDS) -> Job:
    return Job.from_wire(d, ids_of(packed_le(ids)))


@pytest.mark.parametrize("job", JOBS)
def test_job_round_trip(job: Job) -> None:
    body = job.encode()
    back = Job.decode(body)
    assert back == job
    # the ids arrive with their packed form, as the proxy's renders make them
    assert isinstance(back.ids, TokenIds) and back.ids.packed == TokenIds(job.ids).packed
    # after the fields' line, 4 little-endian bytes per id
    assert body.endswith(b"".join(i.to_bytes(4, "little") for i in job.ids) or b"\n")


def test_job_ids_are_bytes_not_json() -> None:
    """A 32K-token prompt: its ids travel as 128 KiB of bytes, not as a JSON list."""
    ids = TokenIds(range(40_000, 72_000))
    job = Job("r", ids, b"", "", Plan((), (), 0, True, "off", None, None), {}, 1, (), None)
    body = job.encode()
    head, _, raw = body.partition(b"\n")
    assert len(raw) == 4 * len(ids) and len(head) < 1000
    assert json.loads(head)["n_ids"] == len(ids) and Job.decode(body).ids == ids


@pytest.mark.parametrize("field", [k for k in JOBS[0].to_wire()])
def test_job_missing_field(field: str) -> None:
    d = job_wire()
    del d[field]
    with pytest.raises(ValueError):
        job_of(d)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        # the plan is parsed strictly too
        ("plan", {}),
        ("plan", None),
        # a grammar is a string or null
        ("grammar", 5),
        ("grammar", ["root"]),
        # lists of the wrong things
        ("stop", None),
        ("sampling", None),
        ("max_tokens", None),
        # the ids announced are the ids sent
        ("n_ids", None),
        ("n_ids", len(IDS) + 1),
        ("n_ids", len(IDS) - 1),
        ("n_ids", str(len(IDS))),
        # seconds the request waited: a finite count, from 0
        ("waited_s", -1.0),
        ("waited_s", 1e309),
        ("waited_s", "8"),
        ("waited_s", None),
    ],
)
def test_job_bad_value(field: str, value: Any) -> None:
    d = job_wire()
    d[field] = value
    with pytest.raises(ValueError):
        job_of(d)


@pytest.mark.parametrize(
    "body",
    [
        b"",  # nothing
        b'{"run_id": "r"}',  # no line ends the fields
        b"{not json}\n",
        b"\xff\xfe\n",
        b"[1, 2]\n",
        b"null\n",
    ],
)
def test_job_malformed_body(body: bytes) -> None:
    with pytest.raises(ValueError):
        Job.decode(body)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x01\x00\x00",  # not whole ids
        (-1).to_bytes(4, "little", signed=True),  # a negative id
        (5).to_bytes(4, "little") + (2**31).to_bytes(4, "little"),  # past int32: negative
    ],
)
def test_job_bad_ids(raw: bytes) -> None:
    head = json.dumps({**job_wire(), "n_ids": len(raw) // 4}).encode()
    with pytest.raises(ValueError):
        Job.decode(head + b"\n" + raw)


@pytest.mark.parametrize(
    ("n_ids", "keep_max", "ok"),
    [
        # the last prompt token is always evaluated: keep_max is at most n - 1...
        (40, 38, True),
        (40, 39, True),
        (40, 40, False),
        # ...which is what decide gives a GPU worker (batch 512) for 512 k + 1 tokens: the
        # proxy's rule and the worker's check are one function (policies.prefix.keep_max)
        (1025, keep_max(1025, 512), True),
        (1025, 1024, True),
        (40, 0, True),
        # ...and never negative
        (40, -1, False),
        # one-token prompts keep nothing
        (1, 0, True),
        (1, 1, False),
        (0, 0, True),
        (0, 1, False),
    ],
)
def test_job_keep_max_leaves_the_last_token(n_ids: int, keep_max: int, ok: bool) -> None:
    d = job_wire()
    d["n_ids"] = n_ids
    d["plan"]["keep_max"] = keep_max
    if ok:
        assert job_of(d, tuple(range(n_ids))).plan.keep_max == keep_max
    else:
        with pytest.raises(ValueError):
            job_of(d, tuple(range(n_ids)))


def test_job_plan_missing_field() -> None:
    d = job_wire()
    del d["plan"]["live_ok"]
    with pytest.raises(ValueError):
        job_of(d)


@pytest.mark.parametrize("d", [None, [], "job", 5])
def test_job_not_an_object(d: Any) -> None:
    with pytest.raises(ValueError):
        job_of(d)


EVENTS: list[Event] = [
    Start(keep=30, restored=30, restore_s=0.25, faults=()),
    # Entries tried and found broken, in order.
    Start(keep=0, restored=0, restore_s=0.5,
          faults=(Fault("checksum", "bad checksum", "ab/01.state"),
                  Fault("corrupt", "truncated", "cd/02.state"))),
    Prefill(n_live=512),
    Token(id=42, text="héllo ✓"),
    # Text held back and flushed at the end; a newline stays inside one NDJSON line.
    Token(id=None, text="a\nb"),
    Done(finish_reason="stop", stop=None, n_gen=17, n_live=57, floor=0, prefill_s=0.125,
         decode_s=1.5, pending_saves=2),
    Done(finish_reason="stop_sequence", stop="</tool>", n_gen=3, n_live=43, floor=43,
         prefill_s=0.0,
         decode_s=0.75, pending_saves=0),
    Done(finish_reason="length", stop=None, n_gen=64, n_live=43, floor=43, prefill_s=0.0,
         decode_s=0.75, pending_saves=0,
         draft={"ngram-mod": {"drafted": 40, "accepted": 31, "verifies": 5}}),
    Cancelled(n_live=100, floor=90, pending_saves=1),
    Saved(n_tokens=40, key="6b3430", reason="growing", file="6b/6b3430.state", size_bytes=12345,
          checksum=987654321, save_s=0.0625),
    SaveFailed(n_tokens=20, key="6b3230", reason="scoped", fault="disk_full",
               message="No space left on device"),
    Error(message="llama_decode failed: -1"),
    # A preemption's cancel the run did not take: it goes on.
    Kept(reason="its state would not fit the RAM tier"),
    # Where the start came from is a typed field, never a prefix of a file name.
    Start(keep=256, restored=256, restore_s=0.5, faults=(), ram=0, tier="shared"),
    # A state entered the RAM tier, and one left it.
    TierEvent("stored", "ram", 3, "5a" * 16, "t", 4, (1, 2, 3, 4)),
    TierEvent("removed", "ram", 3, "5a" * 16, "t", 4),
]


def test_events_cover_every_event_type() -> None:
    assert {type(ev) for ev in EVENTS} == set(get_args(Event))


@pytest.mark.parametrize("ev", EVENTS)
def test_event_round_trip(ev: Event) -> None:
    line = encode_event(ev)
    # One NDJSON line: a single newline, at the end.
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert parse_event(line) == ev
    assert parse_event(line.decode()) == ev


def event_field_cases() -> list[tuple[Event, str]]:
    return [(ev, f.name) for ev in EVENTS for f in fields(ev)] + [(ev, "event") for ev in EVENTS]


@pytest.mark.parametrize(("ev", "field"), event_field_cases())
def test_event_missing_field(ev: Event, field: str) -> None:
    d = json.loads(encode_event(ev))
    del d[field]
    with pytest.raises(ValueError):
        parse_event(json.dumps(d))


@pytest.mark.parametrize("field", ["reason", "message", "file"])
def test_start_fault_missing_field(field: str) -> None:
    d = json.loads(encode_event(EVENTS[1]))
    del d["faults"][0][field]
    with pytest.raises(ValueError):
        parse_event(json.dumps(d))


@pytest.mark.parametrize("name", ["bogus", "Start", "", None, 3])
def test_unknown_event(name: Any) -> None:
    d = json.loads(encode_event(Prefill(5)))
    d["event"] = name
    with pytest.raises(ValueError):
        parse_event(json.dumps(d))


@pytest.mark.parametrize(
    "line",
    [b"", b"\n", b"{", b"{not json}", b'{"event": "prefill", "n_live": 5',
     b"[1, 2]", b"null", b"5", b'"prefill"', b"\xff\xfe"],
)
def test_invalid_line(line: bytes) -> None:
    with pytest.raises(ValueError):
        parse_event(line)


# Typed, not coerced: a value of the wrong JSON type is a malformed message, never converted
# (int("7"), a string taken as a list of characters, a bool taken as an int).
@pytest.mark.parametrize("field,value", [
    ("max_tokens", "7"), ("max_tokens", True), ("n_ids", True), ("stop", "</s>"),
    ("run_id", None), ("sampling", [["temperature", 0]]), ("salt", 5), ("salt", "not hex"),
    ("tenant", None), ("stream", 0), ("stream", "false"), ("stream", None),
])
def test_job_values_are_not_coerced(field: str, value: Any) -> None:
    with pytest.raises(ValueError):
        job_of({**job_wire(), field: value})


@pytest.mark.parametrize("plan_field,value", [
    ("keep_max", 3.9), ("keep_max", "7"), ("boundary", True), ("anchor_skipped", 5),
    ("saves", {}), ("restore", ""),
])
def test_plan_values_are_not_coerced(plan_field: str, value: Any) -> None:
    with pytest.raises(ValueError):
        Plan.from_wire({**PLAN.to_wire(), plan_field: value})


@pytest.mark.parametrize("line", [
    b'{"event": "token", "id": "x", "text": "a"}',
    b'{"event": "token", "id": 1, "text": 5}',
    b'{"event": "prefill", "n_live": null}',
    b'{"event": "done", "finish_reason": "maybe", "stop": null, "n_gen": 0, "n_live": 0, '
    b'"prefill_s": 0, "decode_s": 0, "pending_saves": 0}',
    b'{"event": "start", "keep": 0, "restored": 0, "restore_s": 0, "faults": {}}',
])
def test_event_values_are_not_coerced(line: bytes) -> None:
    with pytest.raises(ValueError):
        parse_event(line)


@pytest.mark.parametrize("line", [
    b'{"event": "tier", "kind": "moved", "tier": "ram", "ref": 1, "salt": "", "tenant": "", '
    b'"n_tokens": 1, "ids": []}',
    b'{"event": "tier", "kind": "stored", "tier": "gpu", "ref": 1, "salt": "", "tenant": "", '
    b'"n_tokens": 1, "ids": []}',
    b'{"event": "tier", "kind": "stored", "tier": "ram", "ref": 1, "salt": "", "tenant": "", '
    b'"n_tokens": 1, "ids": ["1"]}',
])
def test_a_tier_event_is_one_of_its_kinds_and_tiers(line: bytes) -> None:
    with pytest.raises(ValueError):
        parse_event(line)


# A ready worker's /health, as a worker of this version writes it (backend.worker.server).
INFO: dict[str, Any] = {
    "ready": True, "worker_id": 0, "pid": 123, "boot_id": "b", "model": "m.gguf",
    "fingerprint": "00" * 16, "llama_cpp_version": "0.3.36", "flash_attn": "off",
    "compute": "CPU", "n_ctx": 8192, "n_ctx_actual": 4096, "slots": 2, "n_live": [0, 12],
    "busy": [False, True], "memory": "plain", "n_swa": 0, "swa_full": True, "align": 128,
    "batch_ends": [2], "exact": True, "exact_failure": "", "borrows": True,
    "decode": {"shape": "batched", "independent": True, "deterministic": "auto",
               "note": "decode steps batched"},
    "threads": 1, "threads_batch": 2, "cache_volume": "v",
    "costs": {"prefill": [0, 0, 0, 0, 0, 0]}, "cache_ram": {"budget_bytes": 1 << 30},
    "shared": None, "writes": {"queued_bytes": 0}, "borrowed": {"slot": 0},
    "placement": {"gpu_layers": 0}, "checked": {"ok": True},
    "identity": {"model_path": "m.gguf", "n_ctx": 4096, "type_k": "f16", "type_v": "f16",
                 "flash_attn": "auto", "lib_version": "0.3.36", "swa_full": True,
                 "batch": 128, "compute": "CPU"},
    "speculation": {"type": "ngram-mod", "drafts": True}, "protocol": PROTOCOL,
}


def test_worker_info_round_trip() -> None:
    info = WorkerInfo.from_wire(json.loads(json.dumps(INFO)))
    assert info.busy == (False, True) and info.decode.shape == "batched"
    assert info.identity.batch == 128
    assert json.loads(json.dumps(info.to_wire())) == INFO


@pytest.mark.parametrize("field", [k for k in INFO if k != "ready"])
def test_worker_info_missing_field(field: str) -> None:
    # a worker that omitted `exact` (or anything else) is not taken as exact: it is refused
    d = {k: v for k, v in INFO.items() if k != field}
    with pytest.raises(ValueError):
        WorkerInfo.from_wire(d)


@pytest.mark.parametrize("protocol", [1, PROTOCOL + 1, str(PROTOCOL), None])
def test_a_worker_of_another_protocol_is_refused(protocol: Any) -> None:
    # a worker of an older version (its /health named no protocol) would take a "prefilling"
    # cancel as a plain one: the proxy takes no worker whose protocol is not its own
    d = {**INFO, "protocol": protocol} if protocol is not None else \
        {k: v for k, v in INFO.items() if k != "protocol"}
    with pytest.raises(ValueError, match=f"worker protocol .*this proxy {PROTOCOL}"):
        WorkerInfo.from_wire(d)


@pytest.mark.parametrize(("field", "value"), [
    ("exact", 1), ("exact", "true"), ("slots", 3), ("busy", [0, 1]), ("n_live", ["1", 2]),
    ("memory", "linear"), ("decode", {"shape": "batched"}), ("identity", {"batch": 128}),
    ("ready", False), ("cache_ram", {"budget_bytes": "1G"}), ("shared", []),
])
def test_worker_info_values_are_not_coerced(field: str, value: Any) -> None:
    with pytest.raises(ValueError):
        WorkerInfo.from_wire({**INFO, field: value})
