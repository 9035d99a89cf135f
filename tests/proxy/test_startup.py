"""Start-up you can watch (issue 21): the server listens at once, and while the worker loads
its model `/health` and `/v1/health` answer 503 {"status": "loading", "phase", "progress"} with
llama.cpp's loading progress; every other path answers 503 in its API's shape (OpenAI's
`unavailable_error`, Anthropic's `overloaded_error`) with a Retry-After, as llama-server does.
Then it is ready and serves. The worker reads a slow disk by an injected fault
(PREFIXGATE_FAULT=slow-load: a pause in llama.cpp's progress callback); everything else is real.

A start that fails after the listener is up (here: no worker can load the model) still ends
with one line and a non-zero status. (A `-ngl` on a CPU-only build runs on the CPU and says so:
tests/proxy/test_llama_options.py.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Server, http_get, start_server

pytestmark = pytest.mark.model


def post(srv: Server, path: str, body: Any) -> tuple[int, Any, dict[str, str]]:
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_health_says_loading_with_progress_until_ready(tmp_path: Path) -> None:
    health: list[dict[str, Any]] = []
    refused: list[tuple[str, int, Any, dict[str, str]]] = []
    pages: list[str] = []  # the status page at / while loading

    def probe(srv: Server) -> None:
        status, page = http_get(srv.url + "/", timeout_s=2)
        if status == 200 and "prefixgate · loading" in page:
            pages.append(page)
        for path in ("/health", "/v1/health"):
            status, body = http_get(srv.url + path, timeout_s=2)
            if status == 200:  # it became ready between two probes: loading is over
                assert json.loads(body)["status"] == "ok", (path, body)
                return
            if status:  # 0: not listening yet (the interpreter is still importing)
                assert status == 503, (path, status, body)
                health.append(json.loads(body))
        if len(refused) < 4:
            chat = {"model": "m", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]}
            for path in ("/v1/chat/completions", "/v1/messages"):
                try:
                    refused.append((path, *post(srv, path, chat)))
                except OSError:
                    pass

    srv = start_server(tmp_path, env={"PREFIXGATE_FAULT": "slow-load"}, while_loading=probe)
    try:
        assert health and all(h["status"] == "loading" for h in health)
        progress = [h["progress"] for h in health]
        assert progress == sorted(progress), progress  # it only moves forward
        assert any(0 < p < 1 for p in progress), progress  # seen part-way, not just 0 and 1
        assert {"hashing the model file", "loading the model"} & {h["phase"] for h in health}
        # a worker that is ready while the proxy still opens its index carries no loading note
        loading = [w["loading"] for h in health for w in h["workers"] if not w["ready"]]
        assert any(note.startswith("loading the model ") for note in loading), loading
        assert any('id="state">loading: ' in page for page in pages), pages[:1]
        assert refused, "no API request was made while loading"
        for path, status, body, headers in refused:
            assert status == 503 and headers.get("Retry-After") == "5", (path, status, body)
            if path == "/v1/messages":
                assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            else:
                assert body["error"]["type"] == "unavailable_error"
            assert "Loading model" in json.dumps(body)
        # ready: /health says ok, the API serves, and the ready line names where the model went
        assert srv.get_json("/health")["status"] == "ok"
        assert srv.get_json("/v1/health")["status"] == "ok"
        status, body, _ = post(srv, "/v1/chat/completions", {
            "model": "m", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
        log = srv.log()
        assert "worker 0 is loading" not in log or "loading the model" in log
        ready = next(line for line in log.splitlines() if "prefixgate ready on" in line)
        assert "CPU: no layers on a GPU, weights" in ready, ready
    finally:
        srv.stop()
