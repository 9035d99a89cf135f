"""llama-server's endpoints meet the bounds the chat APIs meet (issue 46, section 5).

`/tokenize`, `/detokenize` and `/apply-template` took any JSON the body limit let through: a
/tokenize of 8M characters and an /apply-template of 100,000 messages held the render thread
(and so every other client) for seconds. Now every body meets proxy/limits.py's bounds, and text
that cannot fit a slot's context whatever its tokens is refused before it is tokenized or
rendered, on these endpoints and the chat APIs alike: a 400 in the API's own shape, with the
reason (`context_length_exceeded`, or the bound and its name).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from proxy.chat import ChatRequest
from proxy.config import default_model
from proxy.errors import TextTooLong
from proxy.gateway import RENDER_NICE
from proxy.prompt import PromptBuilder
from tests.conftest import N_CTX, Server


def post(srv: Server, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json",
                                          "x-api-key": "k"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder.load(default_model())


def too_long(builder: PromptBuilder) -> str:
    """Text that no tokenization fits in N_CTX tokens: the longest token's length each."""
    return "a" * (N_CTX * builder.max_token_chars)


def test_text_that_cannot_fit_is_refused_before_tokenizing(server: Server,
                                                           builder: PromptBuilder) -> None:
    text = too_long(builder)
    chat = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    for path, body, param in (
            ("/tokenize", {"content": text}, "content"),
            ("/apply-template", chat, "messages"),
            ("/v1/chat/completions", chat, "messages"),
            ("/completion", {"prompt": text, "n_predict": 4}, "prompt")):
        status, err = post(server, path, body)
        assert status == 400, (path, status, err)
        assert err["error"]["code"] == "context_length_exceeded", (path, err)
        assert err["error"]["param"] == param, (path, err)
        assert f"> {N_CTX} maximum" in err["error"]["message"], err
    # what fits is tokenized as before
    status, ok = post(server, "/tokenize", {"content": "hello world"})
    assert status == 200 and len(ok["tokens"]) == 2


def test_the_llama_endpoints_meet_the_chat_apis_bounds(server: Server) -> None:
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"}
            for i in range(100_000)]
    status, err = post(server, "/apply-template", {"messages": many})
    assert status == 400 and "(limit max_messages)" in err["error"]["message"], err
    status, err = post(server, "/detokenize", {"tokens": [1] * 100_001})
    assert status == 400 and "(limit max_array_items)" in err["error"]["message"], err
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {}}}
             for i in range(600)]
    status, err = post(server, "/apply-template",
                       {"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert status == 400 and "(limit max_tools)" in err["error"]["message"], err


def test_the_bound_never_refuses_what_fits(builder: PromptBuilder) -> None:
    """The bound is exact: text of the vocabulary's longest tokens, whitespace runs, and
    ordinary prose all pass it whenever their tokens fit."""
    longest = max((builder.tok.decode([i]) for i in range(2000, 49152, 7)), key=len)
    for text in ("#" * 20_000, " " * 20_000, "\n" + " " * 80, longest * 300,
                 "The quick brown fox. " * 2000, "日本語のテキスト" * 2000):
        n = len(builder.tok.encode(text))
        builder.check_text(len(text), n + 1)  # n tokens fit a context of n + 1
        builder.render(ChatRequest("openai", ({"role": "user", "content": text},)), n + 64)
    with pytest.raises(TextTooLong):
        builder.check_text(N_CTX * builder.max_token_chars, N_CTX)


def nice_of(pid: int, tid: int) -> int:
    """A thread's nice value (/proc: the 19th field of its stat, after the command's name)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def test_preparation_yields_the_cpu_to_the_workers(server: Server) -> None:
    """The render thread (every request's parse, render and tokenization) runs below the
    proxy's other threads and the workers: on 2 cores, a core taken from one of llama.cpp's
    threads stops them all at the next barrier (bench/results/issue46/stall.md)."""
    assert post(server, "/tokenize", {"content": "hello"})[0] == 200  # the thread exists
    pid = server.proc.pid
    threads = {int(t.name): (t / "comm").read_text().strip()
               for t in Path(f"/proc/{pid}/task").iterdir()}
    render = [tid for tid, name in threads.items() if name.startswith("render")]
    assert len(render) == 1, threads
    assert nice_of(pid, render[0]) == min(19, nice_of(pid, pid) + RENDER_NICE)
    workers = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    assert workers and all(nice_of(w, w) == nice_of(pid, pid) for w in workers)
