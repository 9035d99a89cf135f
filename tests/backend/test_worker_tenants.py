"""Tenants stay apart in the worker itself: a real `prefixgate worker --listen` process, sent
jobs directly as a proxy would, including a proxy whose view of the worker is stale (it says
`live_ok` for the wrong tenant, as after a request that failed before the worker ran it). The
worker keeps live KV only for the tenant whose prompt it holds: on success, after a cancel,
after a refused job. Its RAM tier gives a tenant back only its own states."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest

from backend.protocol import Cancelled, Done, Event, Job, Prefill, Start, parse_event
from policies.decide import Plan
from policies.prefix import keep_max
from tests.conftest import free_port, http_get
from tests.deploy.test_remote_workers import WorkerProcess
from tests.models import BATCH

pytestmark = pytest.mark.model  # a real worker process (see tests/conftest.py)

SHORT = tuple(range(1000, 1300))  # 300 token ids of the default model's vocabulary, none an
# end of turn: batch edges at multiples of the batch size (policies.prefix.Batching)
LONG = tuple(range(2000, 3600))  # long enough that a cancel lands during its prefill


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    tmp = tmp_path_factory.mktemp("tenants")
    w = WorkerProcess(tmp, free_port(), tmp / "cache", "--cache-ram", "0")  # live KV only
    yield w
    w.stop()


def job(ids: tuple[int, ...], tenant: str, run_id: str = "r", keep_max: int | None = None,
        salt: bytes = b"") -> Job:
    """A job whose plan lets the worker keep any live KV (live_ok): the proxy's view."""
    plan = Plan((), (), len(ids) - 2 if keep_max is None else keep_max, True, "off", None, None)
    return Job(run_id, ids, salt, tenant, plan, {"temperature": 0.0}, 1, (), None)


def run(w: WorkerProcess, j: Job, cancel_at_prefill: bool = False) -> list[Event]:
    conn = http.client.HTTPConnection("127.0.0.1", w.port, timeout=300)
    conn.request("POST", "/run", body=j.encode(),
                 headers={"Content-Type": "application/octet-stream"})
    resp = conn.getresponse()
    if resp.status != 200:
        conn.close()
        return []
    events: list[Event] = []
    while line := resp.readline():
        ev = parse_event(line)
        events.append(ev)
        if cancel_at_prefill and isinstance(ev, Prefill) and len(events) == 2:
            c = http.client.HTTPConnection("127.0.0.1", w.port, timeout=30)
            c.request("POST", "/cancel", body=json.dumps({"run_id": j.run_id}))
            assert c.getresponse().status == 200
            c.close()
    conn.close()
    return events


def kept(events: list[Event]) -> int:
    start = events[0]
    assert isinstance(start, Start), events
    return start.keep


def test_a_tenant_never_keeps_another_tenants_live_kv(worker: WorkerProcess) -> None:
    assert kept(run(worker, job(SHORT, "a"))) == 0  # cold
    assert kept(run(worker, job(SHORT, "a"))) == keep_max(len(SHORT), BATCH)  # its own live KV
    # b with a plan that allows live reuse (a stale proxy view): nothing of a's is kept
    assert kept(run(worker, job(SHORT, "b"))) == 0
    assert kept(run(worker, job(SHORT, "b"))) == keep_max(len(SHORT), BATCH)  # now b's own
    assert kept(run(worker, job(SHORT, "a"))) == 0


def test_a_refused_job_does_not_change_the_owner(worker: WorkerProcess) -> None:
    run(worker, job(SHORT, "a"))
    assert run(worker, job(SHORT, "b", keep_max=len(SHORT))) == []  # malformed: a 400
    assert kept(run(worker, job(SHORT, "b"))) == 0  # the KV is still a's
    assert kept(run(worker, job(SHORT, "a"))) == 0  # and now b's, not a's


def test_after_a_cancel_the_kv_is_the_cancelled_tenants(worker: WorkerProcess) -> None:
    events = run(worker, job(LONG, "a", run_id="cancel-me"), cancel_at_prefill=True)
    assert isinstance(events[-1], Cancelled) or isinstance(events[-1], Done), events[-1]
    live = next(e.n_live for e in events if isinstance(e, Cancelled | Done))
    assert live > 0
    assert kept(run(worker, job(LONG, "b"))) == 0  # a's partial prefill is not b's
    assert kept(run(worker, job(LONG, "b"))) == keep_max(len(LONG), BATCH)


def test_the_ram_tier_gives_a_tenant_back_only_its_own(tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    tmp = tmp_path_factory.mktemp("ram")
    w = WorkerProcess(tmp, free_port(), tmp / "cache", "--cache-ram", "64")
    try:
        assert kept(run(w, job(SHORT, "a"))) == 0
        assert kept(run(w, job(SHORT, "b"))) == 0  # a's live KV gave way to RAM: not b's
        back = run(w, job(SHORT, "a"))[0]  # a's own, from RAM (b's went there meanwhile)
        assert isinstance(back, Start) and back.keep == back.ram == keep_max(len(SHORT), BATCH)
        assert kept(run(w, job(SHORT, "b", salt=b"\x01" * 16))) == 0, \
            "b's state under another salt (another model or settings) is not this request's"
        health = json.loads(http_get(w.url + "/health")[1])
        assert health["cache_ram"]["hit"] == 1 and health["cache_ram"]["entries"] >= 1
    finally:
        w.stop()
