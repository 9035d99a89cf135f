"""A worker that dies in the middle of a request, behind a real prefixgate, on both APIs.

The worker is a fake (a real aiohttp app on a loopback port, answering `/health` as a worker of
this model would and replaying scripted events on `/run`), because a real worker cannot be made
to die at an exact point of its stream on demand. The proxy is real: it takes it as a remote
worker (`--worker-url`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from aiohttp import web

from backend.protocol import (
    PROTOCOL,
    DecodeInfo,
    Identity,
    Job,
    Prefill,
    Start,
    Token,
    WorkerInfo,
    encode_event,
)
from policies.costs import Costs
from proxy.config import Config, cache_identity
from tests.conftest import N_CTX, Server, free_port, running, start_server
from tests.models import BATCH, FLASH_ATTN

pytestmark = pytest.mark.model  # a real proxy process (see tests/conftest.py)


class DyingWorker:
    """Answers like a worker of the default model; every run streams a start, a prefill batch
    and one token, then the connection drops with no end of stream."""

    def __init__(self, compute: str = "CPU (test)", protocol: int = PROTOCOL) -> None:
        self.port = free_port()
        self.compute = compute  # the devices it says compute its KV (in its fingerprint)
        self.protocol = protocol  # the worker protocol its /health names
        self.identity = dataclasses.replace(cache_identity(Config(
            n_ctx=N_CTX, ubatch_size=BATCH, flash_attn=FLASH_ATTN)),  # the suite's
            compute=compute)
        self.fingerprint = self.identity.fingerprint().hex()
        self.runs = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._started.wait(30)

    async def health(self, request: web.Request) -> web.Response:
        info = WorkerInfo(
            worker_id=0, pid=0, boot_id="fake", model="fake", fingerprint=self.fingerprint,
            llama_cpp_version=self.identity.lib_version, flash_attn=FLASH_ATTN,
            compute=self.compute, n_ctx=N_CTX, n_ctx_actual=N_CTX, slots=1, n_live=(0,),
            busy=(False,), memory="plain", n_swa=0, swa_full=True, align=BATCH, batch_ends=(),
            exact=True, exact_failure="", borrows=False,
            decode=DecodeInfo("apart", True, "auto", "one slot"), threads=1, threads_batch=1,
            cache_volume="", costs=Costs().to_wire(), cache_ram={}, shared=None, writes={},
            borrowed={}, placement={}, checked={},
            identity=Identity(**dataclasses.asdict(self.identity)), protocol=self.protocol)
        return web.json_response(info.to_wire())

    async def run(self, request: web.Request) -> web.StreamResponse:
        self.runs += 1
        job = Job.decode(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        n = len(job.ids)
        for ev in (Start(0, 0, 0.0, ()), Prefill(n), Token(42, "Once")):
            await resp.write(encode_event(ev))
        assert request.transport is not None
        request.transport.abort()  # as a killed process: no end of stream
        return resp

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/run", self.run)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, DyingWorker]]:
    worker = DyingWorker()
    with running(tmp_path_factory.mktemp("dying"), "--worker-url",
                 f"http://127.0.0.1:{worker.port}", "--disk-prefix-cache", "off") as srv:
        yield srv, worker
    worker.stop()


MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def test_openai_a_worker_dying_mid_request_is_a_503(proxy: tuple[Server, DyingWorker]) -> None:
    srv, worker = proxy
    c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50)  # type: ignore
    assert e.value.status_code == 503
    err = e.value.body
    assert isinstance(err, dict) and err["type"] == "api_error" and "worker" in err["message"]
    # streamed: the 200 already went out, so the failure is an error event in the stream
    stream = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50,  # type: ignore
                                       stream=True)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert worker.runs == 2


def test_anthropic_a_worker_dying_mid_request_is_overloaded(
        proxy: tuple[Server, DyingWorker]) -> None:
    srv, _ = proxy
    c = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError) as e:
        c.messages.create(model="m", max_tokens=50, messages=MESSAGES)  # type: ignore
    assert e.value.status_code == 503
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error", json.dumps(body)


def test_the_proxy_stays_up_and_healthy(proxy: tuple[Server, DyingWorker]) -> None:
    srv, _ = proxy
    # after a lost stream the proxy rechecks the worker's /health before it routes to it
    # again (Pool._recheck): on a loaded machine that can still be under way here
    deadline = time.monotonic() + 10
    while (status := srv.get("/health")[0]) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    status, body = srv.get("/health")
    assert status == 200 and json.loads(body)["workers"][0]["busy"] is False
    assert "Traceback" not in srv.log()


def test_workers_that_compute_on_other_devices_make_the_proxy_refuse(tmp_path: Path) -> None:
    """A state one device made is not the bits another computes cold: one cache cannot serve
    a CPU worker and a GPU worker (a real worker cannot be given another device on demand)."""
    cpu, gpu = DyingWorker("CPU (AMD EPYC; AVX2)"), DyingWorker("CUDA (NVIDIA H100 80GB HBM3)")
    try:
        with pytest.raises(RuntimeError) as exc:
            start_server(tmp_path, "--worker-url", f"http://127.0.0.1:{cpu.port}",
                         "--worker-url", f"http://127.0.0.1:{gpu.port}",
                         "--disk-prefix-cache", "off")
    finally:
        cpu.stop()
        gpu.stop()
    said = str(exc.value)
    assert "computes on" in said and "CUDA (NVIDIA H100 80GB HBM3)" in said, said
    assert "CPU (AMD EPYC; AVX2)" in said and "Traceback" not in said


def test_a_worker_of_another_version_is_refused_at_start_and_kept_out_later(
        tmp_path: Path) -> None:
    """A remote worker of another prefixgate version (its /health names another worker
    protocol: an older one would take a preemption's "prefilling" cancel as a plain one and
    stop an answer under way) stops the start with one line; one that turns into another
    version while the proxy runs (replaced, upgraded alone) is kept out of routing, once
    said, and taken back when it speaks this version again. A fake: a real worker of another
    version cannot be had on demand."""
    old = DyingWorker(protocol=1)
    try:
        with pytest.raises(RuntimeError) as exc:
            start_server(tmp_path / "a", "--worker-url", f"http://127.0.0.1:{old.port}",
                         "--disk-prefix-cache", "off")
    finally:
        old.stop()
    said = str(exc.value)
    assert f"worker protocol 1, this proxy {PROTOCOL}" in said, said
    assert "same prefixgate version" in said and "Traceback" not in said

    worker = DyingWorker()
    try:
        with running(tmp_path / "b", "--worker-url", f"http://127.0.0.1:{worker.port}",
                     "--disk-prefix-cache", "off") as srv:
            assert srv.get("/health")[0] == 200
            worker.protocol = PROTOCOL + 1
            deadline = time.monotonic() + 30
            while srv.get("/health")[0] == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            status, body = srv.get("/health")
            assert status == 503, body
            c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=60)
            with pytest.raises(openai.APIStatusError) as e:
                c.chat.completions.create(model="m", messages=MESSAGES,  # type: ignore
                                          max_tokens=5)
            assert e.value.status_code == 503 and worker.runs == 0
            time.sleep(3)  # several probes: said once
            log = srv.log()
            assert log.count("is kept out") == 1, log
            assert f"protocol {PROTOCOL + 1}, this proxy" in log
            worker.protocol = PROTOCOL
            deadline = time.monotonic() + 30
            while srv.get("/health")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert srv.get("/health")[0] == 200
            assert "Traceback" not in srv.log()
    finally:
        worker.stop()
