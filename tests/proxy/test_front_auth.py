"""`prefixgate front` keeps the server's auth (docs/security.md): with keys every path but
`/health` takes one of them at the front, before a body is read, rendered or placed (a 401 in
the API's own shape), a key option that yields no key stops the start, and no key reaches a log
line. A host's KV events never run beside tenant isolation. No Dynamo runtime is needed: the
front's runtime is not opened, so whatever got past the check would fail otherwise."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.config import Config, add_arguments, from_args
from proxy.front import Front, main, make_app

KEY = "sk-front-secret-1234"


def parse(argv: list[str]) -> Config:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(argv), {})


async def client(keys: frozenset[str], argv: list[str] | None = None) -> TestClient:
    app = make_app(Front(parse(argv or []), "prefixgate", "host", keys))
    app.cleanup_ctx.clear()  # no Dynamo runtime: nothing past the key check would work
    c = TestClient(TestServer(app))
    await c.start_server()
    return c


async def test_every_path_but_health_takes_a_key_before_anything_is_placed(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    c = await client(frozenset({KEY}))
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = await c.post("/v1/chat/completions", json=body,
                         headers={"Authorization": "Bearer sk-wrong"})
        assert r.status == 401
        assert (await r.json())["error"]["type"] == "authentication_error"
        r = await c.post("/v1/messages", json={**body, "max_tokens": 8},
                         headers={"x-api-key": "sk-wrong"})
        assert r.status == 401
        assert (await r.json())["type"] == "error"  # Anthropic's shape
        for path in ("/front/route", "/props", "/v1/models", "/metrics"):
            r = await (c.post(path, json=body) if path == "/front/route" else c.get(path))
            assert r.status == 401, path
        r = await c.get("/health")  # open for orchestrators: no host known yet
        assert r.status == 503 and (await r.json())["status"] == "no host"
    finally:
        await c.close()
    assert KEY not in caplog.text and "sk-wrong" not in caplog.text


async def test_web_pages_get_the_front_s_own_cors_policy() -> None:
    """A preflight is answered at the front before its key check (it carries no key), and the
    front's 401 names an allowed page's origin, as a host's would (proxy/cors.py)."""
    c = await client(frozenset({KEY}), ["--cors-origins", "https://ui.example"])
    try:
        r = await c.options("/v1/chat/completions", headers={
            "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization"})
        assert r.status == 200
        assert r.headers["Access-Control-Allow-Origin"] == "https://ui.example"
        assert r.headers["Access-Control-Allow-Headers"] == "authorization"
        r = await c.post("/v1/chat/completions", json={}, headers={"Origin": "https://ui.example"})
        assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == "https://ui.example"
        r = await c.options("/v1/messages", headers={"Origin": "http://localhost:3000"})
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
    finally:
        await c.close()


def test_a_key_option_that_yields_no_key_stops_the_front(tmp_path: Path) -> None:
    comments = tmp_path / f"{KEY}.keys"  # the path is not shown: it may be a key
    comments.write_text("# the team's keys\n\n")
    with pytest.raises(SystemExit) as e:
        main(["--api-keys", str(comments)])
    assert "holds no API key" in str(e.value) and KEY not in str(e.value)
    with pytest.raises(SystemExit) as e:
        main(["--api-keys", str(tmp_path / KEY)])
    assert "cannot read the --api-keys file" in str(e.value) and KEY not in str(e.value)


def test_the_front_places_every_api_a_host_serves_and_bounds_it_as_a_host_does() -> None:
    from proxy import responses_api

    front = Front(parse(["--limit", "max_messages=2"]), "prefixgate", "host")
    assert front.parsers["/v1/responses"] is front.parsers["/responses"] \
        is responses_api.parse_request  # Codex CLI's API
    assert front.bounds.max_messages == 2
    with pytest.raises(SystemExit) as e:
        main(["--limit", "no_such_bound=1"])
    assert "no_such_bound" in str(e.value)


def test_kv_events_never_run_beside_tenant_isolation() -> None:
    assert parse(["--kv-events", "tcp://127.0.0.1:5557"]).kv_events
    with pytest.raises(SystemExit) as e:
        parse(["--kv-events", "tcp://127.0.0.1:5557", "--tenant-isolation"])
    assert "--tenant-isolation" in str(e.value)


async def test_with_an_api_prefix_the_front_answers_below_it_only() -> None:
    """As a host with --api-prefix: every path below the prefix, the API's own error shape by
    the path below it, nothing outside it."""
    c = await client(frozenset({KEY}), ["--api-prefix", "/llm"])
    try:
        r = await c.get("/llm/health")
        assert r.status == 503 and (await r.json())["status"] == "no host"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        r = await c.post("/llm/v1/messages", json=body)
        assert r.status == 401 and (await r.json())["type"] == "error"  # Anthropic's shape
        r = await c.post("/llm/v1/chat/completions", json=body)
        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        for path in ("/health", "/v1/chat/completions", "/llmv1/models"):
            assert (await c.get(path)).status == 404, path
    finally:
        await c.close()
