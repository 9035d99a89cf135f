"""`--sleep-idle-seconds` (llama-server's): after the idle spell the worker processes are gone
(the model and its KV leave memory), the server still answers /health, /props and /metrics
without waking, and the next request loads them again and is answered, its prefix restored
from what the cache wrote to disk before the sleep: the answer a cold run gives."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from proxy.cli import serve_config
from proxy.idle import due
from tests.conftest import Server, running

SYSTEM = "You are a careful coding agent. " + " ".join(
    f"Rule {i}: read the file before you edit it, and keep each change small." for i in range(40))


def workers_of(srv: Server) -> list[int]:
    """The pids of the server's worker processes (its children running `proxy.cli worker`)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == srv.proc.pid and b"worker" in cmd:
            out.append(int(stat.parent.name))
    return out


def ask(srv: Server, question: str) -> tuple[str, str, int]:
    c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=300)
    raw = c.chat.completions.with_raw_response.create(
        model="m", temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    r = raw.parse()
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return (r.choices[0].message.content or "", raw.headers["x-prefixgate-cache-source"],
            r.usage.prompt_tokens_details.cached_tokens or 0)


@pytest.mark.model
def test_idle_workers_leave_memory_and_a_request_wakes_them(tmp_path: Path) -> None:
    with running(tmp_path / "cold", "--disk-prefix-cache", "off") as cold:
        expected = ask(cold, "Which file should I read first?")[0]
    with running(tmp_path / "s", "--sleep-idle-seconds", "2") as srv:
        assert srv.get_json("/props")["sleep_idle_seconds"] == 2
        ask(srv, "Where do I start?")  # its snapshot goes to disk
        assert workers_of(srv)
        deadline = time.time() + 60
        while not srv.get_json("/props")["is_sleeping"]:
            assert time.time() < deadline, srv.log()
            time.sleep(0.2)
        deadline = time.time() + 20
        while workers_of(srv):  # SIGTERM: they write what they hold, then exit
            assert time.time() < deadline, srv.log()
            time.sleep(0.2)
        health = srv.get_json("/health")
        assert health["status"] == "ok" and health["sleeping"] is True
        assert [w["asleep"] for w in health["workers"]] == [True]
        assert srv.get("/metrics")[0] == 200 and srv.get_json("/props")["is_sleeping"]
        assert "asleep: the next request loads the workers again" in srv.get("/")[1]
        assert not workers_of(srv), "answering them woke nothing"
        with ThreadPoolExecutor(2) as pool:  # two at once: one wake, both answered
            first, other = pool.map(lambda q: ask(srv, q), [
                "Which file should I read first?", "And then which one?"])
        assert first[0] == expected, "a hit after the sleep answers as a cold run does"
        # the shared prefix came back from the disk for whichever ran first (the other then
        # extends its live KV)
        assert "disk" in (first[1], other[1]) and first[2] > 0 and other[2] > 0, (first, other)
        assert other[0] and workers_of(srv) and not srv.get_json("/props")["is_sleeping"]
        log = srv.log()
    assert "no request for 2 s (--sleep-idle-seconds): the workers leave memory" in log
    assert log.count("a request wakes the workers") == 1 and "awake in " in log


@pytest.mark.parametrize(("now", "used", "busy", "waiting", "ready", "sleep"), [
    (10.0, 7.0, False, 0, True, True),  # 3 s idle, nothing running or waiting
    (10.0, 8.5, False, 0, True, False),  # not long enough
    (10.0, 0.0, True, 0, True, False),  # a request runs
    (10.0, 0.0, False, 1, True, False),  # one waits
    (10.0, 0.0, False, 0, False, False),  # a worker is loading or restarting
])
def test_when_the_workers_sleep(now: float, used: float, busy: bool, waiting: int, ready: bool,
                                sleep: bool) -> None:
    assert due(now, used, 3.0, busy, waiting, ready) is sleep


@pytest.mark.parametrize(("argv", "said"), [
    (["--sleep-idle-seconds", "0"], "--sleep-idle-seconds 0: give the idle seconds"),
    (["--sleep-idle-seconds", "-2"], "--sleep-idle-seconds -2: give the idle seconds"),
    (["--sleep-idle-seconds", "60", "--worker-url", "http://127.0.0.1:9"],
     "remote workers are not this server's to stop"),
])
def test_a_sleep_that_cannot_be_is_one_line(argv: list[str], said: str) -> None:
    with pytest.raises(SystemExit) as e:
        serve_config(["-m", "m.gguf", *argv], environ={})
    assert said in str(e.value) and "\n" not in str(e.value)
    assert serve_config(["-m", "m.gguf", "--sleep-idle-seconds", "-1"],
                        environ={}).sleep_idle_seconds == -1
