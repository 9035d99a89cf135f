"""Hostile input never reaches a 500 or kills a worker (issue 14): each reproduction against a
real prefixgate (one worker, tenant isolation on, no API key file), driven over HTTP by the
official SDKs where they can send the payload and by http.client where they cannot (raw bodies,
gzip, bad headers). Every answer is a 4xx in the API's own error shape, or a correct answer;
the worker that saw the forced-call schemas is the one that started; the log has no traceback.
"""

from __future__ import annotations

import functools
import gzip
import http.client
import json
import random
import re
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anthropic
import brotli
import llama_cpp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy import edge
from proxy.app import error_middleware
from proxy.chat import ChatRequest
from proxy.dialects import for_template
from proxy.errors import BadRequest, openai_response
from proxy.limits import LIMITS
from proxy.metrics import Metrics
from tests.conftest import Server, running
from tests.proxy.test_limits import hostile

try:  # Python 3.14's own, else its backport (a dependency below 3.14)
    from compression import zstd
except ImportError:
    from backports import zstd

pytestmark = pytest.mark.model

KEY = "sk-hostile"
HI = [{"role": "user", "content": "hi"}]

# endpoint -> (path, error shape, a valid body that generates at most 2 tokens)
ENDPOINTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", "openai", {"messages": HI, "max_tokens": 2}),
    "completions": ("/v1/completions", "openai", {"prompt": "hi", "max_tokens": 2}),
    "messages": ("/v1/messages", "anthropic", {"model": "m", "max_tokens": 2, "messages": HI}),
    "count_tokens": ("/v1/messages/count_tokens", "anthropic", {"model": "m", "messages": HI}),
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(tmp_path_factory.mktemp("hostile"), "--workers", "1", "--tenant-isolation",
                 "--disk-prefix-cache", "off") as s:
        yield s


def post(srv: Server, path: str, body: bytes | str,
         headers: dict[str, str | bytes] | None = None) -> tuple[int, str, bytes]:
    """(status, Content-Type, body) of a raw POST: any bytes, any header bytes."""
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.putrequest("POST", path)
        for k, v in {"Content-Type": "application/json", "x-api-key": KEY,
                     **(headers or {})}.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(raw)))
        conn.endheaders(raw)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read()
    finally:
        conn.close()


def error_of(shape: str, status: int, ctype: str, data: bytes) -> tuple[str, str]:
    """(type, message) of an error answer, checking it is JSON in the API's own shape."""
    assert "application/json" in ctype, (status, ctype, data[:200])
    body = json.loads(data)
    if shape == "openai":
        assert set(body) == {"error"} and set(body["error"]) >= {"message", "type"}, body
        return body["error"]["type"], body["error"]["message"]
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]["type"], body["error"]["message"]


def with_raw(body: dict[str, Any], field: str, raw_json: str) -> str:
    """The body as JSON text with `field` (dotted, list indexes as numbers) set to raw JSON."""
    root: Any = json.loads(json.dumps(body))
    *parents, last = [int(p) if p.isdigit() else p for p in field.split(".")]
    obj = root
    for p in parents:
        obj = obj[p]
    obj[last] = "@@RAW@@"
    return json.dumps(root).replace('"@@RAW@@"', raw_json, 1)


def rejected(srv: Server, name: str, body: bytes | str, *words: str,
             headers: dict[str, str | bytes] | None = None, status: int = 400,
             kind: str = "invalid_request_error") -> None:
    path, shape, _ = ENDPOINTS[name]
    got, ctype, data = post(srv, path, body, headers)
    assert got == status, (got, data[:300])
    etype, message = error_of(shape, got, ctype, data)
    assert etype == kind, (etype, message)
    for w in words:
        assert w in message, message


# --- 1. forced calls with schemas llama.cpp cannot make a grammar of -----------------------

ARRAY_30K = {"type": "array", "items": {"type": "string"}, "maxItems": 30000}

# case -> (tool name, parameters schema, expected status): 400 names the tool; 200 is a call
FORCED: dict[str, tuple[str, dict[str, Any], int]] = {
    # the converter cannot resolve it: any JSON object arguments
    "$ref to itself": ("f", {"$ref": "#"}, 200),
    "$ref to the root": ("f", {"type": "object", "properties": {"a": {"$ref": "#"}}}, 200),
    # a cycle with no way out: the converter writes x ::= y, y ::= x, which llama.cpp refuses
    "$ref cycle": ("f", {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
                         "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}},
                   400),
    "empty enum": ("f", {"type": "object", "properties": {"a": {"enum": []}},
                         "required": ["a"]}, 400),
    "empty anyOf": ("f", {"type": "object", "properties": {"a": {"anyOf": []}},
                          "required": ["a"]}, 400),
    "quote in a property name": ("f", {"type": "object", "properties": {'a"b': {}},
                                       "required": ['a"b']}, 400),
    # names are written as escaped literals: a call to it works
    "quote in the tool name": ('f"g', {"type": "object"}, 200),
    # bounds this large are left out of the grammar: a call, not a crash
    "maxLength 30000": ("f", {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "maxLength": 30000}}}, 200),
    "maxItems 30000": ("f", {"type": "object", "properties": {"a": ARRAY_30K},
                             "required": ["a"]}, 200),
    "pattern a{0,30000}": ("f", {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "pattern": "^a{0,30000}$"}}}, 200),
}


def forced_openai(srv: Server, name: str, schema: dict[str, Any], named: bool) -> Any:
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}}]
    choice: Any = {"type": "function", "function": {"name": name}} if named else "required"
    return openai.OpenAI(base_url=srv.v1, api_key=KEY, max_retries=0).chat.completions.create(
        model="m", messages=HI, max_tokens=4, temperature=0, tools=tools,  # type: ignore[arg-type]
        tool_choice=choice)


def forced_anthropic(srv: Server, name: str, schema: dict[str, Any], named: bool) -> Any:
    tools = [{"name": name, "input_schema": schema}]
    choice = {"type": "tool", "name": name} if named else {"type": "any"}
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0).messages.create(
        model="m", messages=HI, max_tokens=4, tools=tools,  # type: ignore[arg-type]
        tool_choice=choice)  # type: ignore[arg-type]


@pytest.mark.parametrize("named", [False, True], ids=["required", "named"])
@pytest.mark.parametrize("api", ["openai", "anthropic"])
@pytest.mark.parametrize("name, schema, status", FORCED.values(), ids=FORCED.keys())
def test_forced_call_schemas(srv: Server, name: str, schema: dict[str, Any], status: int,
                             api: str, named: bool) -> None:
    send, bad = ((forced_openai, openai.BadRequestError) if api == "openai"
                 else (forced_anthropic, anthropic.BadRequestError))
    if status == 200:
        send(srv, name, schema, named)
        return
    with pytest.raises(bad) as e:
        send(srv, name, schema, named)
    body = e.value.response.json()
    etype, message = error_of(api, 400, e.value.response.headers["content-type"],
                              e.value.response.content)
    assert etype == "invalid_request_error", body
    assert f"tool {name!r}: its schema cannot be made into a grammar" in message


def test_the_tool_that_breaks_the_grammar_is_named() -> None:
    """tool_choice required over several tools: the 400 names the tools at fault."""
    ok = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    bad = [{"type": "function", "function": {"name": name, "parameters": schema}}
           for name, schema in (("e", FORCED["empty enum"][1]),
                                ("q", FORCED["quote in a property name"][1]))]
    with pytest.raises(BadRequest, match="^tool 'e', 'q': its schema"):
        for_template("").forced((ok, *bad), "required", "")
    assert for_template("").forced((ok,), "required", "")


def test_the_worker_refuses_a_grammar_it_cannot_parse(model_path: str) -> None:
    """The worker's own guard (a proxy of another version could send one): a ValueError that
    the worker turns into an error event, before the first sample; a good grammar samples."""
    from backend.engine import Engine
    from backend.sampling import Sampling

    eng = Engine(model_path, 256, 2, 0)
    with pytest.raises(ValueError, match="could not build a sampler from the grammar"):
        next(eng.generate(0, Sampling(temperature=0), 4, None, 'root ::= "'))
    vocab = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
    eng.prefill(0, vocab.tokenize(b"Say a letter:"))
    assert next(eng.generate(0, Sampling(temperature=0), 4, None, 'root ::= "a"'))[1] == b"a"
    eng.close()


# --- 3. what was a 500 with a text/plain body ----------------------------------------------


@pytest.mark.parametrize("name", ENDPOINTS)
def test_nesting_beyond_the_recursion_limit(srv: Server, name: str) -> None:
    body = with_raw(ENDPOINTS[name][2], "messages" if name != "completions" else "prompt",
                    "[" * 100_000 + "]" * 100_000)
    rejected(srv, name, body, "nests far deeper than 64 levels", "max_depth")


@pytest.mark.parametrize("name", ENDPOINTS)
def test_integer_over_4300_digits(srv: Server, name: str) -> None:
    body = with_raw(ENDPOINTS[name][2], "seed", "7" * 5000)
    rejected(srv, name, body, "an integer of 5000 digits", "max_int_digits")


# endpoint -> fields that hold text
TEXT_FIELDS = {
    "chat": ("messages.0.content", "model", "stop", "tools"),
    "completions": ("prompt", "stop"),
    "messages": ("messages.0.content", "system", "stop_sequences", "tools"),
    "count_tokens": ("messages.0.content", "system", "tools"),
}
SURROGATE_CASES = [(n, f) for n, fields in TEXT_FIELDS.items() for f in fields]


@pytest.mark.parametrize("name, field", SURROGATE_CASES,
                         ids=[f"{n}-{f}" for n, f in SURROGATE_CASES])
def test_lone_surrogate(srv: Server, name: str, field: str) -> None:
    if field == "tools":  # in a tool's description, as either API has it
        tool = ('{"type": "function", "function": {"name": "t", "description": "x\\ud800"}}'
                if ENDPOINTS[name][1] == "openai" else
                '{"name": "t", "description": "x\\ud800", "input_schema": {}}')
        body, where = with_raw(ENDPOINTS[name][2], "tools", f"[{tool}]"), "tools[0]"
    else:
        body, where = with_raw(ENDPOINTS[name][2], field, '"a\\ud800b"'), field.split(".")[0]
    rejected(srv, name, body, where, "lone surrogate ('\\ud800')")


@pytest.mark.parametrize("name", ENDPOINTS)
def test_api_key_not_utf8(srv: Server, name: str) -> None:
    """aiohttp keeps a header's invalid UTF-8 as lone surrogates; the tenant's hash could not
    encode them."""
    rejected(srv, name, json.dumps(ENDPOINTS[name][2]), "not valid UTF-8",
             headers={"x-api-key": b"sk-\xff\xfe-\xed\xa0\x80"}, status=401,
             kind="authentication_error")


def nested_schema(levels: int) -> dict[str, Any]:
    """Arrays of arrays: `levels` objects deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("levels, words", [(480, ("nested 65 levels", "max_depth")),
                                           (40, ("nests 40 levels", "max_schema_depth"))])
@pytest.mark.parametrize("name", ["chat", "messages", "count_tokens"])
def test_deep_tool_schema(srv: Server, name: str, levels: int, words: tuple[str, ...]) -> None:
    schema = nested_schema(levels)
    tool = ({"type": "function", "function": {"name": "deep", "parameters": schema}}
            if name == "chat" else {"name": "deep", "input_schema": schema})
    rejected(srv, name, json.dumps({**ENDPOINTS[name][2], "tools": [tool]}), *words)


# the request body codings clients send: gzip, and zstd (Codex's own client compresses its
# /v1/responses bodies with zstd, level 3), br
COMPRESS = {"gzip": lambda b: gzip.compress(b, compresslevel=1),
            "zstd": lambda b: zstd.compress(b, level=3), "br": lambda b: brotli.compress(b)}


@pytest.mark.parametrize("encoding", COMPRESS)
@pytest.mark.parametrize("name", ENDPOINTS)
def test_content_encoding(srv: Server, name: str, encoding: str) -> None:
    body = json.dumps(ENDPOINTS[name][2]).encode()
    rejected(srv, name, body, f"Content-Encoding {encoding!r}",
             headers={"Content-Encoding": encoding})
    # a body in that coding is read as such
    status, _, data = post(srv, ENDPOINTS[name][0], COMPRESS[encoding](body),
                           {"Content-Encoding": encoding})
    assert status == 200, data[:300]
    # a bomb: 65 MiB unpacked (a few hundred KB sent, or less) is over max_body_bytes
    kind = "request_too_large" if ENDPOINTS[name][1] == "anthropic" else "invalid_request_error"
    rejected(srv, name, bomb(encoding), "max_body_bytes",
             headers={"Content-Encoding": encoding}, status=413, kind=kind)


def test_a_codex_request_in_zstd(srv: Server) -> None:
    """Codex's client sends its /v1/responses bodies zstd-compressed: answered as sent plain."""
    body = json.dumps({"model": "m", "input": "hi", "max_output_tokens": 2, "stream": False,
                       "store": False, "temperature": 0}).encode()
    status, _, data = post(srv, "/v1/responses", zstd.compress(body, level=3),
                           {"Content-Encoding": "zstd", "Authorization": f"Bearer {KEY}"})
    assert status == 200, data[:300]
    plain = post(srv, "/v1/responses", body, {"Authorization": f"Bearer {KEY}"})
    text = [[c["text"] for c in json.loads(d)["output"][0]["content"]] for d in (data, plain[2])]
    assert plain[0] == 200 and text[0] == text[1], text


@functools.cache
def bomb(encoding: str) -> bytes:
    return COMPRESS[encoding](b'{"prompt": "' + b" " * (65 << 20) + b'"}')


@pytest.mark.parametrize("name", ["chat", "messages"])
def test_limits_over_http(srv: Server, name: str) -> None:
    stop = "stop" if name == "chat" else "stop_sequences"
    body = {**ENDPOINTS[name][2], stop: [f"s{i}" for i in range(33)]}
    rejected(srv, name, json.dumps(body), "33 strings", "max_stop_strings")
    many = {**ENDPOINTS[name][2], "messages": HI * 20_001}
    rejected(srv, name, json.dumps(many), "20001 messages", "max_messages")


# --- bugs: a 500 in the API's own shape, logged once with its traceback --------------------


async def test_a_bug_is_a_500_in_the_api_shape(caplog: pytest.LogCaptureFixture) -> None:
    """A fault no real part produces on purpose: a parser and handlers that raise."""

    def broken_parse(body: Any, tenant: str) -> ChatRequest:
        raise KeyError("a bug in parsing")

    async def api(request: web.Request) -> web.StreamResponse:
        return await edge.serve(request, "openai", broken_parse, openai_response,
                                None)  # type: ignore[arg-type]

    async def route(request: web.Request) -> web.StreamResponse:
        raise RuntimeError("a bug in a route")

    app = web.Application(middlewares=[error_middleware])
    async def offload(fn: Any, *args: Any) -> Any:  # the gateway's render thread, inline
        return fn(*args)

    app[edge.GATEWAY] = SimpleNamespace(offload=offload)  # type: ignore[assignment]
    app[edge.METRICS] = Metrics()
    app[edge.LIMITS] = LIMITS
    app.router.add_post("/v1/chat/completions", api)
    app.router.add_post("/v1/messages", route)
    app.router.add_get("/props", route)
    cases = [("post", "/v1/chat/completions", "openai", "KeyError"),
             ("post", "/v1/messages", "anthropic", "RuntimeError"),
             ("get", "/props", "openai", "RuntimeError")]
    async with TestClient(TestServer(app)) as client:
        for method, path, shape, exc in cases:
            caplog.clear()
            r = await getattr(client, method)(path, data=b"{}")
            etype, message = error_of(shape, r.status, r.content_type, await r.read())
            assert (r.status, etype) == (500, "api_error")
            assert message == f"internal error: {exc}; this is a bug, please report it"
            logged = [rec for rec in caplog.records if rec.exc_info]
            assert len(logged) == 1 and logged[0].exc_info[0].__name__ == exc  # type: ignore


def test_http_parser_refusals(srv: Server) -> None:
    """What aiohttp refuses before any handler runs (a malformed chunk): its own 400, logged
    in one line (the module's last test checks the log has no traceback)."""
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
                  b"chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n")
        assert s.recv(4096).split(b"\r\n")[0].endswith(b" 400 Bad Request")


# --- generated hostile bodies ---------------------------------------------------------------

MUTABLE = {
    "chat": ("messages", "messages.0", "messages.0.content", "messages.0.role", "stop", "tools",
             "tool_choice", "temperature", "stream_options", "prefix_cache", "seed", "model"),
    "completions": ("prompt", "stop", "top_p", "seed", "logprobs", "echo"),
    "messages": ("messages", "messages.0.content", "system", "tools", "tool_choice",
                 "stop_sequences", "top_k", "metadata", "thinking"),
    "count_tokens": ("messages", "messages.0", "system", "tools", "tool_choice"),
}


@pytest.mark.parametrize("name", ENDPOINTS)
def test_generated_hostile_fields(srv: Server, name: str) -> None:
    """A valid body with one field replaced by a generated hostile value: a 4xx in the API's
    shape or an answer, never a 5xx."""
    rng = random.Random(f"hostile-{name}")
    path, shape, valid = ENDPOINTS[name]
    for _ in range(25):
        body = with_raw(valid, rng.choice(MUTABLE[name]), hostile(rng))
        status, ctype, data = post(srv, path, body)
        assert status < 500, (body[:300], data[:300])
        if status >= 400:
            error_of(shape, status, ctype, data)


# --- 9. operations routes and client disconnects -------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("keyed")
    keys = tmp / "keys.txt"
    keys.write_text(KEY + "\n")
    with running(tmp, "--workers", "1", "--api-keys", str(keys),
                 "--disk-prefix-cache", "off") as s:
        yield s


def get(srv: Server, path: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read()
    finally:
        conn.close()


def test_operations_routes_need_a_key(keyed: Server) -> None:
    for path in ("/props", "/metrics"):
        status, ctype, data = get(keyed, path, {})
        assert status == 401, data
        assert error_of("openai", status, ctype, data)[0] == "authentication_error"
        assert get(keyed, path, {"x-api-key": "wrong"})[0] == 401
        assert get(keyed, path, {"x-api-key": KEY})[0] == 200
        assert get(keyed, path, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert get(keyed, "/health", {})[0] == 200  # orchestrators probe it without a key


def test_client_disconnect_is_one_line(srv: Server) -> None:
    """A client that leaves mid-stream and one that leaves before its answer: no traceback."""
    body = json.dumps({"messages": HI, "max_tokens": 400, "stream": True}).encode()
    for stream in (True, False):
        data = body if stream else body.replace(b'"stream": true', b'"stream": false')
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-api-key: " +
                      KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            if stream:
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(0.3)
        deadline = time.time() + 30  # the worker is free again once the run was cancelled
        while any(w["busy"] for w in srv.get_json("/health")["workers"]):
            assert time.time() < deadline
            time.sleep(0.1)
    assert "Traceback" not in srv.log()


# --- last: the same worker answered everything --------------------------------------------


def test_worker_survived_and_nothing_was_a_bug(srv: Server) -> None:
    log = srv.log()
    assert len(re.findall(r"worker 0 ready \(pid \d+", log)) == 1, log[-3000:]
    assert "exited with" not in log
    assert "Traceback" not in log and "internal error" not in log, log[-5000:]
    reply = openai.OpenAI(base_url=srv.v1, api_key=KEY, max_retries=0).chat.completions.create(
        model="m", messages=HI, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
