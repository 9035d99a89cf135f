"""A prompt that shares only part of a state in the worker's memory (another slot's live KV, a
RAM-tier entry) gets that state cut back to the last batch edge both share, as llama-server
does with its slots and prompt cache: a real `prefixgate worker` with three slots. The hit
answers as a cold run does, the source keeps its state, and another tenant never gets any."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from backend.protocol import Event, Job, Start
from policies.decide import Plan
from tests.backend.test_writes_at_rest import run, tokens
from tests.conftest import free_port, http_get
from tests.deploy.test_remote_workers import WorkerProcess
from tests.models import BATCH

pytestmark = pytest.mark.model  # a real worker process (see tests/conftest.py)

# no end-of-turn ids: edges at multiples of BATCH. Two prompts share SHARED, then part.
SHARED = tuple(range(1000, 1000 + 3 * BATCH))
A = SHARED + tuple(range(3000, 3000 + BATCH + 10))
B = SHARED + tuple(range(4000, 4000 + BATCH // 2))


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    tmp = tmp_path_factory.mktemp("borrow")
    n_ctx = 3 * (len(A) + 4 * BATCH)  # each slot holds the longest prompt, at any batch size
    w = WorkerProcess(tmp, free_port(), tmp / "cache", "--parallel", "3", "--cache-ram", "64",
                      "--n-ctx", str(n_ctx))
    yield w
    w.stop()


def job(run_id: str, ids: tuple[int, ...], slot: int, tenant: str = "",
        live_ok: bool = False) -> Job:
    """A job whose plan restores nothing from disk and saves nothing."""
    plan = Plan((), (), len(ids) - 2, live_ok, "off", None, None)
    return Job(run_id, ids, b"", tenant, plan, {"temperature": 0.0}, 8, (), None, slot)


def go(w: WorkerProcess, j: Job) -> list[tuple[float, Event]]:
    seen: list[tuple[float, Event]] = []
    run(w, j, seen)
    return seen


def start(seen: list[tuple[float, Event]]) -> tuple[int, int, int]:
    s = seen[0][1]
    assert isinstance(s, Start)
    return s.keep, s.ram, s.restored


def health(w: WorkerProcess) -> dict:
    return json.loads(http_get(w.url + "/health")[1])


def test_another_slots_state_is_copied_cut_back_and_answers_as_cold(
        worker: WorkerProcess) -> None:
    first = go(worker, job("a", A, 0))
    assert start(first) == (0, 0, 0)
    n_live = health(worker)["n_live"][0]
    hit = go(worker, job("b", B, 1))
    assert start(hit) == (3 * BATCH, 3 * BATCH, 0)  # cut back to the edge both share
    after = health(worker)
    assert after["borrowed"]["slot"] == 1 and after["borrowed"]["tokens"] == 3 * BATCH
    assert after["n_live"][0] == n_live  # the source slot keeps its state
    cold = go(worker, job("b-cold", B, 2, tenant="other"))  # another tenant: never borrows
    assert start(cold) == (0, 0, 0)
    assert tokens(hit) == tokens(cold) and len(tokens(cold)) == 8
    again = go(worker, job("a-again", A, 0, live_ok=True))  # the source's own state, intact
    assert start(again)[0] == (len(A) - 1) // BATCH * BATCH
    assert tokens(again) == tokens(first)


def test_a_ram_tier_entry_is_cut_back_and_stays(worker: WorkerProcess) -> None:
    c = tuple(range(6000, 6000 + 2 * BATCH)) + tuple(range(7000, 7000 + BATCH + 5))
    d = tuple(range(8000, 8000 + BATCH + 3))  # shares nothing: c's state gives way to RAM
    e = c[: 2 * BATCH] + tuple(range(9000, 9000 + BATCH))
    go(worker, job("c", c, 2, tenant="t2"))
    go(worker, job("d", d, 2, tenant="t2", live_ok=True))
    ram = health(worker)["cache_ram"]
    assert ram["entries"] >= 1
    hit = go(worker, job("e", e, 2, tenant="t2", live_ok=True))
    assert start(hit) == (2 * BATCH, 2 * BATCH, 0)
    after = health(worker)
    assert after["borrowed"]["ram"] == 1
    assert after["cache_ram"]["hit"] == ram["hit"]  # the entry stays for its own session
    cold = go(worker, job("e-cold", e, 1, tenant="t3"))
    assert start(cold) == (0, 0, 0)
    assert tokens(hit) == tokens(cold) and len(tokens(cold)) == 8
