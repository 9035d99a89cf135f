"""Load and failure: a bounded queue (429 past it), a worker that dies mid-request."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.conftest import Server, running

pytestmark = pytest.mark.model  # real worker processes (see tests/conftest.py)

LONG = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=120)


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while not check():
        assert time.time() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def busy(srv: Server) -> bool:
    return any(w["busy"] for w in srv.get_json("/health")["workers"])


def queue_depth(srv: Server) -> float:
    for line in srv.get("/metrics")[1].splitlines():
        if line.startswith("prefixgate_queue_depth "):
            return float(line.split()[1])
    raise AssertionError("no prefixgate_queue_depth in /metrics")


def test_queue_is_bounded_with_429_and_retry_after(tmp_path: Path) -> None:
    with running(tmp_path, "--workers", "1", "--max-queue", "1") as srv:
        outcomes: list[object] = []

        def one() -> None:
            try:
                client(srv.v1).chat.completions.create(model="m", messages=LONG,
                                                       max_tokens=64, temperature=0)
                outcomes.append("ok")
            except openai.RateLimitError as e:
                outcomes.append(e)

        # in order: one runs, one waits, the rest find the queue full
        threads = [threading.Thread(target=one) for _ in range(4)]
        threads[0].start()
        wait_for(lambda: busy(srv), "the first request runs")
        threads[1].start()
        wait_for(lambda: queue_depth(srv) == 1, "the second request waits")
        for t in threads[2:]:
            t.start()
        for t in threads:
            t.join()
        limited = [o for o in outcomes if not isinstance(o, str)]
        assert outcomes.count("ok") >= 2 and limited, outcomes
        err = limited[0]
        assert isinstance(err, openai.RateLimitError)
        assert err.response.headers["retry-after"].isdigit()
        assert err.body["type"] == "rate_limit_error"
        health = srv.get_json("/health")
        assert not any(w["busy"] for w in health["workers"])


def test_a_worker_that_dies_fails_its_request_cleanly_and_comes_back(tmp_path: Path) -> None:
    with running(tmp_path, "--workers", "1") as srv:
        client(srv.v1).chat.completions.create(model="m", messages=LONG, max_tokens=4)
        errors: list[Exception] = []
        generating = threading.Event()

        def long_request() -> None:  # greedy, this story runs to max_tokens
            try:
                for chunk in client(srv.v1).chat.completions.create(
                        model="m", messages=LONG, max_tokens=2000, temperature=0, stream=True):
                    if chunk.choices and chunk.choices[0].delta.content:
                        generating.set()
            except openai.APIError as e:
                errors.append(e)

        queued: list[str | None] = []

        def waiting_request() -> None:  # queued behind the one that will crash
            r = client(srv.v1).chat.completions.create(model="m", messages=LONG, max_tokens=4)
            queued.append(r.choices[0].message.content)

        t = threading.Thread(target=long_request)
        t.start()
        assert generating.wait(120), errors  # killed mid-generation, not before or after it
        behind = threading.Thread(target=waiting_request)
        behind.start()
        wait_for(lambda: queue_depth(srv) == 1, "the second request waits for the worker")
        pids = [int(line.split("pid ")[1].split(",")[0]) for line in srv.log().splitlines()
                if "worker 0 ready (pid" in line]
        os.kill(pids[-1], signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the request must not hang"
        assert errors and isinstance(errors[0], openai.APIStatusError | openai.APIError)
        # the queued request is not handed to the dead process: it waits for the restart
        behind.join(180)
        assert not behind.is_alive() and queued and queued[0] is not None
        wait_for(lambda: srv.get("/health")[0] == 200, "the worker is back")
        r = client(srv.v1).chat.completions.create(model="m", messages=LONG, max_tokens=4)
        assert r.choices[0].message.content is not None
        assert "exited" in srv.log() and "restarting" in srv.log()
