"""llama-server's native endpoints on the real server (issue 21), in llama-server's documented
shapes: /tokenize (ids, with pieces, with BOS), /detokenize, /apply-template, /v1/health,
/models, and /props' total_slots, chat_template and build_info. The ids are the ones a chat
completion counts: the template /apply-template shows, tokenized by /tokenize, is the prompt
usage.prompt_tokens reports. Bad input is a 400 in the OpenAI error shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from tests.conftest import Server

pytestmark = pytest.mark.model


def post(srv: Server, path: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name the <|im_end|> token's job in one line."}]


def test_tokenize_detokenize_and_apply_template_agree_with_a_chat_completion(server: Server
                                                                              ) -> None:
    status, applied = post(server, "/apply-template", {"messages": MESSAGES})
    assert status == 200 and set(applied) == {"prompt"}
    prompt = applied["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n"), "the generation prompt is there"
    status, tok = post(server, "/tokenize", {"content": prompt})
    assert status == 200 and set(tok) == {"tokens"}
    assert all(isinstance(t, int) for t in tok["tokens"])
    c = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(tok["tokens"]), "the ids a completion counts"
    status, back = post(server, "/detokenize", {"tokens": tok["tokens"]})
    assert (status, back) == (200, {"content": prompt})
    # special tokens in the text are parsed (one id), pieces decode one id each
    status, pieces = post(server, "/tokenize", {"content": "<|im_end|>hi", "with_pieces": True})
    assert status == 200 and pieces["tokens"][0]["piece"] == "<|im_end|>"
    assert "".join(p["piece"] for p in pieces["tokens"]) == "<|im_end|>hi"
    assert set(pieces["tokens"][0]) == {"id", "piece"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", [], None),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 12]}, "tokens"),
    ("/apply-template", {"messages": "hi"}, "messages"),
])
def test_bad_input_is_a_400_in_the_openai_shape(server: Server, path: str, body: Any,
                                                param: str | None) -> None:
    status, err = post(server, path, body)
    assert status == 400 and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["param"] == param


def test_health_models_and_props_in_llama_servers_shapes(server: Server) -> None:
    assert server.get("/v1/health")[0] == 200
    assert json.loads(server.get("/v1/health")[1])["status"] == "ok"
    models = json.loads(server.get("/models")[1])
    assert models["object"] == "list" and models["data"][0]["id"]
    status, raw = server.get("/slots")
    slots = json.loads(raw)
    assert status == 200 and [s["id"] for s in slots] == [0, 1]
    assert set(slots[0]) == {"id", "worker", "slot", "n_ctx", "is_processing", "ready",
                             "live_tokens", "exact", "tenant"}
    assert [(s["worker"], s["slot"]) for s in slots] == [(0, 0), (1, 0)]
    props = server.get_json("/props")
    assert props["total_slots"] == 2  # two workers, one slot each
    assert "im_start" in props["chat_template"]
    assert props["build_info"].startswith("prefixgate ") and "llama-cpp-python 0.3.36" in \
        props["build_info"]


def test_slot_save_and_restore_by_name_is_llama_servers_501(server: Server) -> None:
    """--slot-save-path is taken (a note: the states are kept here by their prefix); its
    actions answer as llama-server's do without it, in the OpenAI error shape."""
    for action in ("save", "restore", "erase"):
        status, err = post(server, f"/slots/0?action={action}", {"filename": "a.bin"})
        assert status == 501 and err["error"]["type"] == "not_supported_error", err
        assert "restores it for any request" in err["error"]["message"]


FORECAST = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "days": {"type": "integer", "minimum": 1, "maximum": 9}}}


def test_response_format_json_schema_gives_json_of_that_schema(server: Server) -> None:
    c = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0, timeout=120)
    r = c.chat.completions.create(
        model="m", temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Forecast for Paris, 3 days, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "forecast",
                                                                "schema": FORECAST}})
    assert r.choices[0].finish_reason == "stop", r
    out = json.loads(r.choices[0].message.content or "")
    assert set(out) == {"city", "days"} and isinstance(out["city"], str)
    assert len(out["city"]) <= 20 and out["days"] in range(1, 10)
    anything = c.chat.completions.create(
        model="m", temperature=0, max_tokens=80, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}])
    text = (anything.choices[0].message.content or "").lstrip()
    assert text.startswith("{")
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"x": {"enum": []}}, "required": ["x"]},
    {"type": "object", "properties": {"x": {"anyOf": []}}, "required": ["x"]},
])
def test_a_schema_no_grammar_can_express_is_a_400(server: Server, schema: Any) -> None:
    c = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": schema}})
    assert "response_format" in str(e.value)


def test_a_schema_with_huge_bounds_is_served_not_unrolled(server: Server) -> None:
    """maxLength 10**9 would unroll into a grammar llama.cpp cannot parse (or a proxy busy for
    minutes): the bound is left out, as for tool schemas, and the answer is still JSON."""
    import time

    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "string", "maxLength": 10 ** 9,
                                   "pattern": "^x{1,99999999}$"},
                             "b": {"type": "array", "minItems": 0, "maxItems": 10 ** 9}}}
    t0 = time.perf_counter()
    status, r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 8,
        "temperature": 0, "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "a", "schema": schema}}})
    assert status == 200, r
    assert r["choices"][0]["message"]["content"].lstrip().startswith("{")
    assert time.perf_counter() - t0 < 60


def test_a_malformed_response_format_is_a_400(server: Server) -> None:
    status, err = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "yaml"}})
    assert status == 400 and err["error"]["param"] == "response_format"


def test_an_openai_stream_sends_keepalives_while_it_prefills(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A long prefill sends nothing for seconds; an SSE comment every --ping-interval-s keeps
    a reverse proxy with an idle timeout from cutting the stream. The SDK skips the comments."""
    from tests.conftest import running

    body = {"model": "m", "stream": True, "max_tokens": 3, "temperature": 0, "messages": [
        {"role": "user", "content": " ".join(f"word{i}" for i in range(600))}]}
    with running(tmp_path, "--ping-interval-s", "0.05", "--disk-prefix-cache", "off") as srv:
        req = urllib.request.Request(srv.v1 + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
        events = [e for e in raw.split("\n\n") if e]
        assert events[0].startswith("data: ") and '"role": "assistant"' in events[0]
        first_text = next(i for i, e in enumerate(events) if '"content": "' in e and i > 0)
        assert ": keepalive" in events[1:first_text], "comments while it prefilled"
        assert events[-1] == "data: [DONE]"
        c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=120)
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            stream=True, model="m", messages=body["messages"], max_tokens=3, temperature=0)
            if ch.choices)
        assert text


def test_timings_in_llama_servers_shape(server: Server) -> None:
    body = {"model": "m", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Count to three."}]}
    for _ in range(2):  # cold, then (most of) the prompt from the cache
        status, r = post(server, "/v1/chat/completions", body)
        assert status == 200
        t, u = r["timings"], r["usage"]
        assert t["prompt_n"] + t["cache_n"] == u["prompt_tokens"]
        assert t["cache_n"] == u["prompt_tokens_details"]["cached_tokens"]
        assert t["predicted_n"] == u["completion_tokens"]
        assert t["prompt_ms"] > 0 and t["predicted_ms"] >= 0


def test_native_completion_in_llama_servers_shape(server: Server) -> None:
    """/completion: the same greedy text as /v1/completions for the same raw prompt; why it
    stopped (limit, word); streamed chunks that add up to it, then the final object."""
    prompt = "<|im_start|>user\nWrite a long story about a cat.<|im_end|>\n<|im_start|>assistant\n"
    c = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0, timeout=120)
    oai = c.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    status, r = post(server, "/completion", {"prompt": prompt, "n_predict": 12,
                                             "temperature": 0})
    assert status == 200, r
    assert r["content"] == oai.choices[0].text and r["stop"] is True
    assert r["stop_type"] == "limit" and r["stopping_word"] == ""
    assert r["tokens_predicted"] == 12 and r["tokens_evaluated"] == oai.usage.prompt_tokens
    assert r["timings"]["prompt_n"] + r["timings"]["cache_n"] == r["tokens_evaluated"]
    assert r["tokens_cached"] == r["timings"]["cache_n"]
    assert {"id_slot", "model", "prompt", "generation_settings", "truncated"} <= set(r)
    word = r["content"].split()[1] if len(r["content"].split()) > 1 else r["content"][:2]
    status, w = post(server, "/completion", {"prompt": prompt, "n_predict": 12,
                                             "temperature": 0, "stop": [word]})
    assert status == 200 and w["stop_type"] == "word" and w["stopping_word"] == word
    assert r["content"].startswith(w["content"]) and word not in w["content"]
    req = urllib.request.Request(server.url + "/completion", data=json.dumps(
        {"prompt": prompt, "n_predict": 12, "temperature": 0, "stream": True}).encode(),
        headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [json.loads(e[len("data: "):]) for e in resp.read().decode().split("\n\n")
                  if e.startswith("data: ")]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events[:-1]) == r["content"]
    assert events[-1]["stop_type"] == "limit" and events[-1]["tokens_predicted"] == 12
    status, err = post(server, "/completion", {"prompt": [1, 2, 3]})
    assert status == 400 and err["error"]["param"] == "prompt"


def test_a_raw_prompt_s_answer_keeps_its_grammar_and_schema(server: Server) -> None:
    """/completion's `grammar` and `json_schema`, and /v1/completions' `grammar`, constrain a
    raw prompt's answer as a chat's (they were dropped there before)."""
    prompt = "Colours: red, green, blue, red.\nOnce upon a time, there lived a fisherman who"
    colours = 'root ::= ("red" | "green" | "blue" | ", ")+'
    for temperature in (0, 0.8):
        status, r = post(server, "/completion", {"prompt": prompt, "n_predict": 10, "seed": 1,
                                                 "temperature": temperature,
                                                 "grammar": colours})
        assert status == 200, r
        assert r["content"] and set(r["content"]) <= set("redgreenblu, "), r["content"]
    status, r = post(server, "/completion", {"prompt": prompt, "n_predict": 40,
                                             "temperature": 0, "json_schema": {
                                                 "type": "object", "required": ["n"],
                                                 "properties": {"n": {"type": "integer"}}}})
    assert status == 200 and r["stop_type"] == "eos", r
    assert isinstance(json.loads(r["content"])["n"], int)
    c = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0, timeout=120)
    oai = c.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0,
                               extra_body={"grammar": colours})
    assert oai.choices[0].text and set(oai.choices[0].text) <= set("redgreenblu, ")


def test_the_affinity_key_follows_the_session(server: Server) -> None:
    """X-Prefixgate-Affinity: the same for every turn of a session, from the client's session
    header where one is sent (Claude Code's X-Claude-Code-Session-Id), else from the prompt's
    stable prefix (system prompt and tools); different for another session."""
    def affinity(system: str, user: str, session: str = "") -> str:
        req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps({
            "model": "m", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}).encode(),
            headers={"content-type": "application/json",
                     **({"X-Claude-Code-Session-Id": session} if session else {})})
        with urllib.request.urlopen(req, timeout=60) as r:
            return str(r.headers["X-Prefixgate-Affinity"])
    by_header = affinity("You are terse.", "Hi", "3f6c-session")
    assert by_header.startswith("s-") and "3f6c" not in by_header
    assert affinity("Another system prompt.", "Bye", "3f6c-session") == by_header
    by_prefix = affinity("You are terse.", "Hi")
    assert by_prefix.startswith("p-") and by_prefix != by_header
    assert affinity("You are terse.", "A later turn, longer.") == by_prefix
    assert affinity("You are verbose.", "Hi") != by_prefix
