"""Browser pages of another origin (proxy/cors.py): llama-server's --cors-* flags work, a
preflight is answered before the key is checked, every answer to an allowed page names its
origin (streamed ones and errors too), and by default only pages from this machine are let
in, said at start and in /props. Driven over HTTP against a real prefixgate with an API key."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest

from proxy.cli import serve_config
from proxy.cors import Cors, is_local
from tests.conftest import Server, running

KEY = "sk-cors-test-key"
LOCAL = "http://localhost:5173"
OTHER = "https://pages.example"


@pytest.mark.parametrize("origin, local", [
    ("http://localhost:3000", True), ("http://127.0.0.1", True), ("http://[::1]:8080", True),
    ("https://localhost.example", False), ("http://192.168.1.5:3000", False),
    ("null", False), ("http://[not-closed", False), ("", False),
])
def test_what_is_this_machine(origin: str, local: bool) -> None:
    assert is_local(origin) is local


def test_the_policies() -> None:
    default = Cors()
    assert default.allow_origin(LOCAL) == LOCAL and default.allow_origin(OTHER) is None
    assert default.allow_origin("") is None, "a request with no Origin needs no header"
    # llama-server's default: any page; with credentials the page's own origin is named
    assert Cors("*").allow_origin(OTHER) == OTHER
    assert Cors("*", credentials=False).answer_headers(OTHER) == {
        "Access-Control-Allow-Origin": "*"}
    listed = Cors(f"{OTHER}/, http://b.example")
    assert listed.allow_origin(OTHER) == OTHER and listed.allow_origin(LOCAL) is None
    assert Cors("").allow_origin(LOCAL) is None and "no web page" in Cors("").describe()
    assert default.answer_headers(LOCAL) == {"Access-Control-Allow-Origin": LOCAL,
                                             "Vary": "Origin",
                                             "Access-Control-Allow-Credentials": "true"}
    # the headers a page asks for, where `*` is given: a browser reads `*` literally here
    pre = default.preflight_headers(LOCAL, "authorization, content-type")
    assert pre["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert pre["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert Cors(headers="content-type").preflight_headers(LOCAL, "x-api-key")[
        "Access-Control-Allow-Headers"] == "content-type"
    assert default.preflight_headers(OTHER, "authorization") == {}


def test_llama_server_flags_and_variables() -> None:
    cfg = serve_config(["--cors-origins", OTHER, "--cors-methods", "POST", "--cors-headers",
                        "authorization", "--no-cors-credentials"], environ={})
    assert (cfg.cors_origins, cfg.cors_methods, cfg.cors_headers, cfg.cors_credentials) == \
        (OTHER, "POST", "authorization", False)
    env = serve_config([], environ={"LLAMA_ARG_CORS_ORIGINS": "*",
                                    "LLAMA_ARG_CORS_CREDENTIALS": "0"})
    assert (env.cors_origins, env.cors_credentials) == ("*", False)
    assert serve_config([], environ={}).cors_origins == "localhost"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(tmp_path_factory.mktemp("cors"), "--workers", "1", "--api-key", KEY,
                 "--disk-prefix-cache", "off") as s:
        yield s


def request(srv: Server, method: str, path: str, headers: dict[str, str],
            body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data,
                     headers={**headers, **({"Content-Type": "application/json"} if data else {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.mark.model  # a real server and its worker
def test_a_page_from_this_machine(srv: Server) -> None:
    # the preflight carries no key and is answered anyway, on any path
    for path in ("/v1/chat/completions", "/v1/messages", "/no/such/path"):
        status, headers, body = request(srv, "OPTIONS", path, {
            "Origin": LOCAL, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 200 and body == b""
        assert headers["access-control-allow-origin"] == LOCAL
        assert headers["access-control-allow-headers"] == "authorization, content-type"
        assert "POST" in headers["access-control-allow-methods"]
        assert headers["access-control-allow-credentials"] == "true"
    # the key is still checked on the request itself: a 401 the page can read
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3,
            "temperature": 0, "stream": True}
    status, headers, _ = request(srv, "POST", "/v1/chat/completions", {"Origin": LOCAL}, chat)
    assert status == 401 and headers["access-control-allow-origin"] == LOCAL
    # a streamed answer names the origin in its headers, sent before the first token
    status, headers, body = request(srv, "POST", "/v1/chat/completions", {
        "Origin": LOCAL, "Authorization": f"Bearer {KEY}"}, chat)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["access-control-allow-origin"] == LOCAL and b"data: [DONE]" in body
    assert "origin" in headers["vary"].lower()
    # a client that sends no Origin (every agent) gets no CORS header at all
    status, headers, _ = request(srv, "GET", "/v1/models", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and "access-control-allow-origin" not in headers


@pytest.mark.model
def test_a_page_from_elsewhere_is_not_let_in_and_it_is_said(srv: Server) -> None:
    status, headers, _ = request(srv, "OPTIONS", "/v1/chat/completions", {
        "Origin": OTHER, "Access-Control-Request-Method": "POST"})
    assert status == 200 and not [h for h in headers if h.startswith("access-control-")]
    status, headers, _ = request(srv, "GET", "/v1/models", {
        "Origin": OTHER, "Authorization": f"Bearer {KEY}"})
    assert status == 200 and "access-control-allow-origin" not in headers
    # the server's own pages (the status page) are no other origin: nothing to say
    own = f"http://127.0.0.1:{srv.port}"
    assert request(srv, "GET", "/v1/models", {"Origin": own,
                                              "Authorization": f"Bearer {KEY}"})[0] == 200
    log = srv.log()
    assert log.count(f"a web page from {OTHER!r} was not let call the API") == 1, \
        "one line per origin, not one per request"
    assert f"a web page from {own!r}" not in log
    assert "web pages from this machine may call the API (--cors-origins localhost; " \
        "llama-server's default is *, any page)" in log
    assert KEY not in log
    props = json.loads(request(srv, "GET", "/props", {"Authorization": f"Bearer {KEY}"})[2])
    assert props["cors"]["origins"] == "localhost"
