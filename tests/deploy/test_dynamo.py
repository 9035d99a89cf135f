"""Two prefixgate hosts placed by NVIDIA Dynamo's KV router (issue 44), every part a real
process on loopback: the hosts (`prefixgate serve --kv-events`), each registered with Dynamo by
its `prefixgate dynamo-worker` (file discovery, TCP request plane, ZMQ event plane), and
`prefixgate front`, which asks Dynamo's `KvRouter` where each request goes.

A prompt whose prefix only host B holds, sent with no session header, goes to B and is served
from B's cache with the cold answer; once B has evicted the prefix (its live KV replaced, its
snapshots evicted under a small disk budget), the removals were published and the router
finds nothing of it on B."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from proxy.worker_link import child_env
from tests.conftest import N_CTX, ROOT, Server, free_port, http_get, start_server
from tests.proxy.test_disk_cache import entries

pytest.importorskip("dynamo.llm", reason="needs ai-dynamo-runtime (the test extra: "
                    "Linux x86_64 and aarch64 wheels only)")
pytestmark = pytest.mark.model

BS = 16
KEY = "team-key-never-logged"  # the hosts' and the front's (docs/routing.md: auth)
# two system prompts that part in their first block: no block of one is a block of the other
SYSTEM_P = " ".join(f"Project Alpha rule {i}: read the file, quote one line, answer in five "
                    "words." for i in range(1, 21))
SYSTEM_Q = " ".join(f"Weather desk note {i}: report rain in millimetres and wind in knots."
                    for i in range(1, 21))


def chat(system: str, *turns: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        if i:
            msgs.append({"role": "assistant", "content": "Noted."})
        msgs.append({"role": "user", "content": t})
    return msgs


def ask(url: str, messages: list[dict], key: str = "") -> dict:
    c = openai.OpenAI(base_url=url + "/v1", api_key=key or KEY, max_retries=0, timeout=120)
    raw = c.chat.completions.with_raw_response.create(model="m", messages=messages,
                                                      max_tokens=12, temperature=0)
    r = raw.parse()
    return {"text": r.choices[0].message.content, "prompt": r.usage.prompt_tokens,
            "cached": r.usage.prompt_tokens_details.cached_tokens,
            "source": raw.headers["x-prefixgate-cache-source"],
            "upstream": raw.headers.get("x-prefixgate-upstream", ""),
            "route": raw.headers.get("x-prefixgate-route", "")}


def dynamo_env(discovery: Path) -> dict[str, str]:
    return {**child_env(ROOT), "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(discovery),
            "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
            "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_LOG": "warn"}


@contextlib.contextmanager
def process(argv: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "proxy.cli", *argv], cwd=ROOT, stdout=out,
                             stderr=subprocess.STDOUT, env=env)
        try:
            yield p
        finally:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def route(front: str, messages: list[dict], key: str = "") -> dict:
    """Where the front would place it and Dynamo's overlap per host (its API key needed)."""
    key = key or KEY
    req = urllib.request.Request(front + "/front/route?path=/v1/chat/completions",
                                 data=json.dumps({"messages": messages}).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        return {"status": e.code}


def blocks_on(r: dict, url: str, tier: str = "disk_blocks") -> int:
    """The blocks Dynamo's router finds of the prompt on the host at `url`: on its device
    ("device_blocks": a slot's live KV), or on any tier ("disk_blocks": Dynamo's columns are
    cumulative)."""
    ids = [int(k) for k, v in r["hosts"].items() if v == url]
    return max((w[tier] for w in r["dynamo"]["workers"] if w["worker_id"] in ids), default=0)


def wait_for(what: str, check, timeout_s: float = 30, logs: tuple[Path, ...] = (),
             seen=lambda: "") -> None:
    deadline = time.time() + timeout_s
    while not check():
        if time.time() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                              for p in logs if p.exists())
            raise AssertionError(f"{what} not in {timeout_s:.0f} s\n{seen()}\n{tails}")
        time.sleep(0.3)


def test_dynamos_router_places_a_prefix_on_the_host_that_holds_it(tmp_path: Path) -> None:
    env = dynamo_env(tmp_path / "discovery")
    # a disk budget that holds one snapshot of these prompts (~9 MB), not two: the newest
    budget = ("--cache-max-bytes", str(12 << 20))
    ports = {h: free_port() for h in "ab"}
    hosts: dict[str, Server] = {}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as starting:
        started = {h: starting.submit(
            start_server, tmp_path / h, "--workers", "1", "--kv-events",
            f"tcp://127.0.0.1:{ports[h]}", "--kv-block-size", str(BS), "--api-key", KEY,
            *budget) for h in "ab"}
        for f in started.values():  # both load at once; each stopped at the end
            with contextlib.suppress(Exception):
                stack.callback(f.result().stop)
        for h in "ab":
            hosts[h] = started[h].result()
            stack.enter_context(process(
                ["dynamo-worker", "--host-url", hosts[h].url,
                 "--kv-events", f"tcp://127.0.0.1:{ports[h]}", "--kv-block-size", str(BS)],
                tmp_path / f"dyn-{h}.log", env))
        fport = free_port()
        front = f"http://127.0.0.1:{fport}"
        stack.enter_context(process(
            ["front", "--port", str(fport), "--n-ctx", str(N_CTX), "--kv-block-size", str(BS),
             "--api-key", KEY],
            tmp_path / "front.log", env))
        logs = (tmp_path / "front.log", tmp_path / "dyn-a.log", tmp_path / "dyn-b.log")
        wait_for("the front with both hosts", lambda: '"hosts": 2' in http_get(
            front + "/health", 2)[1], logs=logs)
        a, b = hosts["a"].url, hosts["b"].url

        # only B holds the prefix: its first turn was sent to B itself
        first = ask(b, chat(SYSTEM_P, "Which rule is about quoting?"))
        assert first["cached"] == 0
        follow = chat(SYSTEM_P, "Which rule is about quoting?", "And which is about files?")
        wait_for("B's blocks at the router", lambda: blocks_on(route(front, follow), b) > 10,
                 logs=logs)
        r = route(front, follow)
        assert r["best"]["url"] == b and blocks_on(r, a) == 0, r
        assert route(front, follow, key="guess") == {"status": 401}  # no probing without a key
        assert blocks_on(r, b, "device_blocks") > 10, r  # B's slot holds it live

        # the follow-up, with no session header, through the front: placed on B, from its cache
        # (the team's key: without it the front answers 401 before placing anything)
        with pytest.raises(openai.AuthenticationError):
            ask(front, follow, key="guess")
        placed = ask(front, follow)
        assert (placed["upstream"], placed["route"]) == (b, "dynamo-kv"), placed
        assert placed["source"] in ("live", "ram", "disk"), placed
        assert placed["cached"] >= first["prompt"] - 2 * 128, (placed, first)

        # B evicts the prefix: another prompt replaces its live KV and, past the disk budget,
        # its snapshots; each removal is published and the router finds nothing left on B
        ask(b, chat(SYSTEM_Q, "Any rain today?"))
        ask(b, chat(SYSTEM_Q, "Any rain today?", "And wind?"))
        last: list[dict] = []
        wait_for("B's removals at the router",
                 lambda: blocks_on(last.append(route(front, follow)) or last[-1], b) == 0,
                 logs=logs,
                 seen=lambda: f"{last[-1]}\nB's entries: {entries(hosts['b'].cache_dir)}")

        # the cold answer: host A never held any of it
        cold = ask(a, follow)
        assert cold["cached"] == 0 and cold["source"] == "none", cold
        assert placed["text"] == cold["text"]
    for h in "ab":
        assert "Traceback" not in hosts[h].log() and KEY not in hosts[h].log()
    assert KEY not in (tmp_path / "front.log").read_text()


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(k, raising=False)
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
