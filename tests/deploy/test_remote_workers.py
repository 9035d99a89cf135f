"""Proxy and worker as separate processes over TCP, as in docker-compose: `prefixgate worker
--listen` and `prefixgate serve --worker-url`, one cache directory shared between them.

What a deployment relies on: a worker that dies fails its request cleanly (an error in the API's
shape at once, never a hang: an error event in a stream that has started, a 503 otherwise), a
request while it is down fails with 503 without waiting for it to come back, its replacement on
the same address is picked up by the proxy's health checks without restarting the proxy, and
the state files the old worker wrote are disk hits for the new one. A worker that cannot serve
the proxy (other n_ctx, other cache volume) makes the proxy refuse to start, saying why.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from proxy.worker_link import child_env
from tests.conftest import N_CTX, ROOT, Server, free_port, http_get, running, start_server

pytestmark = pytest.mark.model  # real worker processes (see tests/conftest.py)

# ~300 tokens of stable preamble, like an agent's system prompt (the cold anchor is saved)
SYSTEM = " ".join(
    f"Rule {i}: keep answers short, cite the file you read, and never invent an API." for i in
    range(1, 16))
MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Which rule is about files?"}]


class WorkerProcess:
    """`prefixgate worker --listen 127.0.0.1:PORT` as its own process."""

    def __init__(self, tmp: Path, port: int, cache_dir: Path, *args: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = tmp / f"worker-{port}-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "proxy.cli", "worker", "--listen", f"127.0.0.1:{port}",
               "--n-ctx", str(N_CTX), "--threads", "2", "--cache-dir", str(cache_dir), *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=child_env(ROOT))
        deadline = time.time() + 120
        while http_get(self.url + "/health", timeout_s=2)[0] != 200:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"worker did not start:\n{self.log_path.read_text()}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no goodbye to the proxy, as when a container or machine dies."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[WorkerProcess]:
    w = WorkerProcess(tmp_path, free_port(), tmp_path / "cache")
    try:
        yield w
    finally:
        w.stop()


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=180)


def ask(srv: Server, messages: list[dict], max_tokens: int = 10) -> dict:
    raw = client(srv).chat.completions.with_raw_response.create(
        model="m", messages=messages, temperature=0, max_tokens=max_tokens)
    r = raw.parse()
    return {"text": r.choices[0].message.content, "prompt": r.usage.prompt_tokens,
            "cached": r.usage.prompt_tokens_details.cached_tokens,
            "source": raw.headers["x-prefixgate-cache-source"]}


def wait_for(check: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.time() + timeout_s
    while not check():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def worker_ready(srv: Server) -> bool:
    status, body = srv.get("/health")
    return status == 200 and '"ready": true' in body


def assert_worker_error(err: object) -> None:
    """The body of an OpenAI error about the worker (`{"message", "type", ...}`)."""
    assert isinstance(err, dict) and err["type"] == "api_error", err
    assert "worker" in err["message"]


def test_worker_replaced_then_disk_hit_and_failures_are_clean(tmp_path: Path,
                                                              worker: WorkerProcess) -> None:
    with running(tmp_path, "--worker-url", worker.url, cache_dir=tmp_path / "cache") as srv:
        miss = ask(srv, MESSAGES)
        assert (miss["cached"], miss["source"]) == (0, "none")
        wait_for(lambda: srv.get_json("/props")["cache"]["entries"] >= 1)  # the cold anchor

        # the worker dies in the middle of a long generation: the stream ends at once with an
        # error event (the 200 and the first tokens have gone out already)
        errors: list[openai.APIError] = []
        generating = threading.Event()

        def long_request() -> None:  # greedy, this story runs to max_tokens
            try:
                for chunk in client(srv).chat.completions.create(
                        model="m", messages=[{"role": "user", "content":
                                              "Write a long story about a cat."}],
                        temperature=0, max_tokens=2000, stream=True):
                    if chunk.choices and chunk.choices[0].delta.content:
                        generating.set()
            except openai.APIError as e:
                errors.append(e)

        t = threading.Thread(target=long_request)
        t.start()
        assert generating.wait(120), errors  # killed mid-generation, not before or after it
        worker.kill()
        t.join(30)
        assert not t.is_alive(), "the in-flight request hangs"
        assert len(errors) == 1 and not isinstance(errors[0], openai.APIStatusError), errors
        assert_worker_error(errors[0].body)

        # while it is down (no process listens on its port until the replacement below), a
        # request gets a 503 instead of waiting for it: waiting would end in this client's
        # timeout (APITimeoutError after 180 s), not in a 503. The proxy's health says so.
        with pytest.raises(openai.APIStatusError) as exc:
            ask(srv, MESSAGES)
        assert exc.value.status_code == 503
        assert_worker_error(exc.value.body)
        wait_for(lambda: not worker_ready(srv), timeout_s=10)

        # a new worker process on the same address: the proxy picks it up by itself
        replacement = WorkerProcess(tmp_path, worker.port, tmp_path / "cache")
        try:
            wait_for(lambda: worker_ready(srv), timeout_s=30)
            hit = ask(srv, MESSAGES)
        finally:
            replacement.stop()
        assert hit["source"] == "disk", srv.log()
        assert hit["cached"] >= miss["prompt"] - 40, "the anchor covers the system prompt"
        assert hit["text"] == miss["text"]
        assert "restarted" in srv.log()


def test_proxy_refuses_a_worker_that_cannot_serve_it(tmp_path: Path,
                                                     worker: WorkerProcess) -> None:
    # it names what computes its KV (in its fingerprint): here the CPU and its kernels' features
    compute = json.loads(http_get(worker.url + "/health")[1])["compute"]
    assert compute.startswith("CPU (") and "; " in compute, compute
    with pytest.raises(RuntimeError) as exc:
        start_server(tmp_path, "--worker-url", worker.url, "--n-ctx", "2048",
                     cache_dir=tmp_path / "cache")
    assert "runs n_ctx 4096 but the proxy expects 2048" in str(exc.value)
    assert "Traceback" not in str(exc.value)
    with pytest.raises(RuntimeError) as exc:
        start_server(tmp_path, "--worker-url", worker.url, cache_dir=tmp_path / "elsewhere")
    assert "does not share the proxy's cache directory" in str(exc.value)
