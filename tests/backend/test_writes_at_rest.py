"""On the CPU a state file is written while the llama thread rests: a real `prefixgate worker`
with two slots, a snapshot taken in one slot while the other prefills. The file is written
once the other slot's job is done (or WRITE_REST_S later), whole and restorable; while it
waits, a job that starts with its tokens restores it from memory."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

from backend.protocol import Done, Event, Job, Saved, Start, Token, parse_event
from backend.worker import WRITE_REST_S
from policies.decide import Plan, Restore, Save
from tests.conftest import free_port, http_get
from tests.deploy.test_remote_workers import WorkerProcess
from tests.models import BATCH

pytestmark = pytest.mark.model  # a real worker process (see tests/conftest.py)

SHORT = tuple(range(1000, 1000 + 4 * BATCH + 10))  # no end-of-turn id: edges at multiples
OTHER = tuple(range(7000, 7000 + 4 * BATCH + 10))  # a state file of its own (the same state's
# file is written once: a snapshot of a key whose file is there is not taken again)
LONG = tuple(range(2000, 4000))  # its prefill keeps the llama thread busy for seconds


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    tmp = tmp_path_factory.mktemp("rest")
    w = WorkerProcess(tmp, free_port(), tmp / "cache", "--parallel", "2", "--cache-ram", "0")
    yield w
    w.stop()


def run(w: WorkerProcess, j: Job, seen: list[tuple[float, Event]]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", w.port, timeout=300)
    conn.request("POST", "/run", body=j.encode(),
                 headers={"Content-Type": "application/octet-stream"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    while line := resp.readline():
        seen.append((time.monotonic(), parse_event(line)))
    conn.close()


def job(run_id: str, ids: tuple[int, ...], slot: int, saves: tuple[int, ...] = (),
        restore: tuple[Restore, ...] = (), max_tokens: int = 1) -> Job:
    """A job whose plan never keeps the live KV (each restores or prefills)."""
    plan = Plan(restore, tuple(Save(n, "scoped") for n in saves), len(ids) - 2, False, "off",
                None, None)
    return Job(run_id, ids, b"", "", plan, {"temperature": 0.0}, max_tokens, (), None, slot)


def test_a_snapshot_is_written_once_the_llama_thread_rests(worker: WorkerProcess) -> None:
    health = json.loads(http_get(worker.url + "/health")[1])
    assert health["writes"]["at_rest_on"]  # llama.cpp computes on the CPU here
    at_rest = health["writes"]["at_rest"]
    busy: list[tuple[float, Event]] = []
    saving: list[tuple[float, Event]] = []
    long = threading.Thread(target=run, args=(worker, job("long", LONG, 1), busy))
    long.start()
    time.sleep(1.0)  # its prefill has begun
    t0 = time.monotonic()
    run(worker, job("short", SHORT, 0, saves=(4 * BATCH,)), saving)
    long.join()
    done_long = next(t for t, e in busy if isinstance(e, Done))
    saved = [(t, e) for t, e in saving if isinstance(e, Saved)]
    assert len(saved) == 1 and saved[0][1].n_tokens == 4 * BATCH
    # the long prefill was still running when the short job was done: the file waited for it,
    # or for WRITE_REST_S at most
    assert next(t for t, e in saving if isinstance(e, Done)) < done_long
    assert saved[0][0] >= min(done_long, t0 + WRITE_REST_S) - 0.05
    # a written state stays counted as moving until its buffer is freed, which the writer's
    # caller does just after the write that sent `saved` returns: a moment to let it go
    deadline = time.monotonic() + 5.0
    while True:
        health = json.loads(http_get(worker.url + "/health")[1])
        if health["writes"]["moving_bytes"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert health["writes"]["queued_bytes"] == 0 and health["writes"]["moving_bytes"] == 0
    if saved[0][0] < t0 + WRITE_REST_S:
        assert health["writes"]["at_rest"] == at_rest + 1
    # the worker measured its own memory (bench.team reads it): it held the snapshot queued
    # for its file at least, and its memory beyond what it held is more than the model's
    # mapped weights and within its process's peak
    w = health["writes"]
    assert w["peak_held_bytes"] >= 0.9 * saved[0][1].size_bytes  # the state, while queued
    assert 0 < w["peak_moving_bytes"] <= w["peak_held_bytes"]
    assert model_bytes() < w["peak_unheld_bytes"] <= peak_rss(health["pid"])
    # the file is whole: the other slot restores it
    file = saved[0][1]
    again: list[tuple[float, Event]] = []
    run(worker, job("again", SHORT, 1, restore=(Restore(file.n_tokens, bytes.fromhex(file.key),
                                                        file.file),)), again)
    start = again[0][1]
    assert isinstance(start, Start) and start.restored == 4 * BATCH and not start.faults


def peak_rss(pid: int) -> int:
    """A process's resident memory at its peak (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) * 1024


def model_bytes() -> int:
    from proxy.config import default_model

    return os.path.getsize(default_model())


def tokens(seen: list[tuple[float, Event]]) -> list[int | None]:
    return [e.id for _, e in seen if isinstance(e, Token)]


def test_a_state_that_waits_for_its_file_is_restored_from_memory(
        worker: WorkerProcess) -> None:
    """The proxy's index learns of a snapshot only once its file is written; meanwhile a job
    whose prompt starts with it (a subagent arriving while the main session prefills) restores
    it from the worker's memory, and answers as a cold run does."""
    busy: list[tuple[float, Event]] = []
    saving: list[tuple[float, Event]] = []
    long = threading.Thread(target=run, args=(worker, job("long2", LONG[:1800], 1), busy))
    long.start()
    time.sleep(1.0)  # its prefill has begun: the snapshot below waits for it
    # its stream ends once the file is written: the next job starts at its Done
    first = threading.Thread(target=run, args=(worker, job("first", OTHER, 0, saves=(4 * BATCH,)),
                                               saving))
    first.start()
    deadline = time.monotonic() + 120
    while not any(isinstance(e, Done) for _, e in list(saving)):
        assert time.monotonic() < deadline, "the first job never said done"
        time.sleep(0.01)
    extended = OTHER + tuple(range(5000, 5000 + BATCH))
    hit: list[tuple[float, Event]] = []
    run(worker, job("extended", extended, 0, max_tokens=8), hit)  # no restore in its plan
    first.join()
    long.join()
    written = next(t for t, e in saving if isinstance(e, Saved))
    start = hit[0][1]
    assert isinstance(start, Start) and hit[0][0] < written, "the file was still waiting"
    assert (start.keep, start.ram, start.restored) == (4 * BATCH, 4 * BATCH, 0)
    cold: list[tuple[float, Event]] = []  # the file is written now, and this plan names none
    run(worker, job("cold", extended, 0, max_tokens=8), cold)
    assert isinstance(cold[0][1], Start) and cold[0][1].keep == 0
    assert tokens(hit) == tokens(cold) and len(tokens(cold)) == 8
