"""The OpenAI API end to end: the official `openai` SDK against a real prefixgate with real
worker processes on the default model."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.conftest import N_CTX, Server, running
from tests.models import BATCH

SYSTEM = (
    "You are a careful assistant for a small software team. Answer briefly and precisely. "
    "The project is a reverse proxy written in Python with aiohttp; it forwards requests to "
    "worker processes that run a language model, and it caches the model's key-value state on "
    "disk so that long, repeated prompt prefixes do not have to be computed again. "
    "When asked about code, prefer short examples. When unsure, say so."
)


def client(srv: Server, key: str = "test-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key=key, max_retries=0, timeout=120)


def chat(srv: Server, messages: list[dict], **kw: object):
    raw = client(srv).chat.completions.with_raw_response.create(
        model=kw.pop("model", "claude-sonnet-4-5"), messages=messages,  # any name is accepted
        temperature=0, max_tokens=kw.pop("max_tokens", 12), **kw)
    return raw.parse(), raw.headers


def test_models_lists_the_served_model(server: Server) -> None:
    models = client(server).models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models[0].model_extra["context_length"] == N_CTX


def test_chat_non_streaming(server: Server) -> None:
    resp, headers = chat(server, [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "What is a mutex?"}])
    assert resp.object == "chat.completion"
    assert resp.model == "SmolLM2-135M-Instruct.Q4_1"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content.strip()
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 100
    assert resp.usage.completion_tokens == 12 or resp.choices[0].finish_reason == "stop"
    assert int(headers["x-prefixgate-cached-tokens"]) == \
        resp.usage.prompt_tokens_details.cached_tokens


def test_chat_streaming_with_usage(server: Server) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    stream = client(server).chat.completions.create(
        model="gpt-4o", messages=messages, temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # the streamed text equals the non-streamed greedy text of the same prompt
    full, _ = chat(server, messages, max_tokens=16)
    assert text == full.choices[0].message.content


def test_sampling_parameters_are_accepted(server: Server) -> None:
    resp, _ = chat(server, [{"role": "user", "content": "Say hi."}], top_p=0.9, seed=7,
                   stop=["\n\n"], max_tokens=8,
                   extra_body={"top_k": 20, "min_p": 0.1, "max_completion_tokens": 6})
    assert resp.usage.completion_tokens <= 6


def test_llama_server_s_samplers_through_the_sdk(server: Server) -> None:
    """OpenAI's logit_bias and llama-server's sampler and grammar fields (as extra_body) reach
    the worker's chain; what prefixgate does not do is a 400 in OpenAI's shape, never a silent
    answer."""
    messages = [{"role": "user", "content": "Say hi."}]
    plain, _ = chat(server, messages, max_tokens=4, logprobs=False, n=1)
    first = client(server).post(server.url + "/tokenize", cast_to=object, body={
        "content": plain.choices[0].message.content})["tokens"][0]
    banned, _ = chat(server, messages, max_tokens=4, logit_bias={str(first): -100})
    assert banned.choices[0].message.content != plain.choices[0].message.content
    forced, _ = chat(server, messages, max_tokens=3, logit_bias={"1234": 100})
    piece = client(server).post(server.url + "/detokenize", cast_to=object,
                                body={"tokens": [1234]})
    assert forced.choices[0].message.content == piece["content"] * 3
    endless, _ = chat(server, messages, max_tokens=24, extra_body={
        "ignore_eos": True, "typical_p": 0.9, "dry_multiplier": 0.8, "xtc_probability": 0.5,
        "top_n_sigma": 1.0, "samplers": ["penalties", "dry", "top_k", "temperature"],
        "dry_sequence_breakers": ["\n"], "repeat_last_n": 16})
    assert endless.usage.completion_tokens == 24 and endless.choices[0].finish_reason == "length"
    # llama-server's grammar field constrains the answer (a JSON schema would win over it)
    yes_no, _ = chat(server, messages, max_tokens=4,
                     extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert yes_no.choices[0].message.content in ("yes", "no")
    for kw, param in (({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                      ({"logit_bias": {"49152": 5}}, "logit_bias"),
                      ({"extra_body": {"samplers": ["beam"]}}, "samplers"),
                      ({"extra_body": {"grammar": "root ::= ("}}, "grammar"),
                      ({"extra_body": {"grammar": ["root"]}}, "grammar")):
        with pytest.raises(openai.BadRequestError) as e:
            chat(server, messages, **kw)
        assert e.value.body["param"] == param, e.value.body


def test_completions_endpoint(server: Server) -> None:
    resp = client(server).completions.create(model="x", prompt="The capital of France is",
                                             max_tokens=5, temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].text
    assert resp.usage.completion_tokens <= 5


def test_follow_up_reuses_live_prefix_and_matches_cold_run(server: Server,
                                                            cold_server: Server) -> None:
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Explain what a reverse proxy does."}]
    r1, _ = chat(server, first, max_tokens=24)
    second = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "And why would it cache state on disk?"}]
    r2, h2 = chat(server, second, max_tokens=24)
    # all of the first prompt up to the end of its last message, where a batch ended
    # (policies.prefix.Batching), not up to 63 tokens before: only the generation prompt's
    # "\n<|im_start|>assistant\n" (5 tokens in SmolLM2's vocabulary) is evaluated again (the
    # second prompt extends the first)
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens - 5
    assert h2["x-prefixgate-cache-source"] in ("live", "disk")
    cold, hc = chat(cold_server, second, max_tokens=24)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0, "the reference must be cold"
    assert r2.choices[0].message.content == cold.choices[0].message.content


BAD = [
    # (raw body, expected fragment of the message)
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"model": "m"}).encode(), "'messages' is required"),
    (json.dumps({"model": "m", "messages": []}).encode(), "non-empty list"),
    (json.dumps({"model": "m", "messages": "hi"}).encode(), "non-empty list"),
    (json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
     "role must be one of"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": 5}]}).encode(),
     "content must be a string"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "temperature": "hot"}).encode(), "'temperature' must be a number"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "max_tokens": -3}).encode(), "'max_tokens' must be at least 1"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "stream": "yes"}).encode(), "'stream' must be true or false"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "prefix_cache": {"scope": "sometimes"}}).encode(), "auto:N"),
]


@pytest.mark.parametrize("body,fragment", BAD)
def test_bad_input_is_a_400_in_openai_shape(server: Server, body: bytes, fragment: str) -> None:
    req = urllib.request.Request(server.v1 + "/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("expected HTTP 400")
    except urllib.error.HTTPError as e:
        assert e.code == 400
        err = json.loads(e.read())["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
        assert fragment in err["message"], err["message"]
    health = server.get_json("/health")
    assert not any(w["busy"] for w in health["workers"])


def test_prompt_longer_than_context_is_a_400(server: Server) -> None:
    long = "word " * (N_CTX + 200)
    with pytest.raises(openai.BadRequestError) as exc:
        chat(server, [{"role": "user", "content": long}])
    err = exc.value.body
    assert exc.value.code == "context_length_exceeded"
    assert "maximum context length" in err["message"]
    assert not any(w["busy"] for w in server.get_json("/health")["workers"])


def test_disconnect_mid_stream_frees_the_worker(server: Server) -> None:
    before = server.get_json("/health")
    assert not any(w["busy"] for w in before["workers"])
    stream = client(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Write a very long story about a cat."}],
        max_tokens=3000, temperature=0.8, stream=True)
    got = 0
    for _chunk in stream:
        got += 1
        if got >= 3:
            break
    stream.close()
    deadline = time.time() + 5
    while time.time() < deadline:
        if not any(w["busy"] for w in server.get_json("/health")["workers"]):
            break
        time.sleep(0.1)
    assert not any(w["busy"] for w in server.get_json("/health")["workers"])
    assert 'outcome="cancelled"' in server.get("/metrics")[1]


def test_a_prefill_cut_short_by_the_client_is_kept_for_its_retry(server: Server) -> None:
    """A client that gives up during a long prefill (a timeout) and retries: the worker keeps
    the KV it computed before it saw the cancel, and the retry goes to that worker and reuses it
    (two workers here, so routing must know)."""
    notes = " ".join(f"Note {i}: the cache keeps entry {i * 7 % 13} warm for tenant {i % 5}."
                     for i in range(120))
    messages = [{"role": "user", "content": notes + " Which entry does note 3 keep warm?"}]
    cancelled = re.compile(r"openai prompt=(\d+) cached=\d+ source=\w+ cancelled live=(\d+)")
    timeout_s, live, n = 2.0, 0, 0
    while live == 0:
        mark = len(server.log())
        impatient = openai.OpenAI(base_url=server.v1, api_key="test-key", max_retries=0,
                                  timeout=timeout_s)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="m", messages=messages, temperature=0,
                                              max_tokens=400)
        deadline = time.time() + 120
        while not (m := cancelled.search(server.log()[mark:])) and time.time() < deadline:
            time.sleep(0.2)
        assert m, server.log()[mark:]
        n, live = int(m[1]), int(m[2])
        timeout_s *= 2  # a loaded machine may not finish one batch in time: give it longer
        assert timeout_s < 300
    assert 0 < live <= n
    resp, _ = chat(server, messages)
    assert resp.usage.prompt_tokens == n
    # what it prefilled ends at a batch edge; keep_max is less than a batch before the end
    assert resp.usage.prompt_tokens_details.cached_tokens >= min(live, n - BATCH)


@pytest.mark.model
def test_two_workers_serve_two_requests_concurrently(tmp_path: Path) -> None:
    """The second request arrives while the first is generating: it goes to the other worker
    and both run at once (each stream is read up to its first token before the next step).
    A thread per worker: two workers of two threads each on two cores spin at llama.cpp's
    barriers while both compute, and one step then took seconds (a closed stream held its
    worker past 30 s in make test)."""
    with running(tmp_path, "--workers", "2", "--threads", "1") as server:
        _two_at_once(server)
        assert bool(server.get_json("/props")["cores"]) == (2 > (os.cpu_count() or 1))


def test_workers_whose_threads_outnumber_the_cores_are_said_once(server: Server) -> None:
    """The shared server's two workers of two threads: on fewer than four cores the ready line
    is followed by one line saying they wait for each other's cores, and /props says it."""
    note = server.get_json("/props")["cores"]
    assert bool(note) == (4 > (os.cpu_count() or 1))
    if note:
        assert server.log().count(note) == 1 and "--parallel" in note


def _two_at_once(server: Server) -> None:
    messages = [{"role": "user", "content": "Write a long story about a cat."}]
    streams = []
    for _ in range(2):
        stream = client(server).chat.completions.create(
            model="m", messages=messages, max_tokens=2000, temperature=0, stream=True)
        streams.append(stream)  # greedy, this story runs to max_tokens: the worker stays busy
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
    both_busy = all(w["busy"] for w in server.get_json("/health")["workers"])
    workers = sorted(s.response.headers["x-prefixgate-worker"] for s in streams)
    for s in streams:
        s.close()  # cancels both runs
    deadline = time.time() + 30
    while any(w["busy"] for w in server.get_json("/health")["workers"]):
        assert time.time() < deadline, "the closed streams still hold their workers"
        time.sleep(0.1)
    assert workers == ["0", "1"]
    assert both_busy
