"""Two prefixgate hosts behind a real HAProxy (Debian's package) run with deploy/haproxy.cfg,
only its addresses given by the environment, and a real redis-server as their shared tier
(issue 22). Interleaved sessions stay on their hosts; after one host is killed, its session
goes on on the other, from the shared tier, with the cold answer."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest

from tests.conftest import ROOT, Redis, free_port, running
from tests.models import BATCH
from tests.proxy.test_disk_cache import convo, entries

HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
pytestmark = [pytest.mark.model,
              pytest.mark.skipif(HAPROXY is None
                                 or shutil.which("redis-server") is None,
                                 reason="needs Debian's haproxy and redis-server "
                                        "(.ci/run installs them)")]


def ask(url: str, session: str, messages: list[dict]) -> dict:
    c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120,
                      default_headers={"X-Claude-Code-Session-Id": session})
    raw = c.chat.completions.with_raw_response.create(model="m", messages=messages,
                                                      max_tokens=10, temperature=0)
    r = raw.parse()
    return {"text": r.choices[0].message.content, "prompt": r.usage.prompt_tokens,
            "cached": r.usage.prompt_tokens_details.cached_tokens,
            "source": raw.headers["x-prefixgate-cache-source"],
            "host": raw.headers.get("x-prefixgate-host", "")}  # set by HAProxy


def own(session: str, messages: list[dict]) -> list[dict]:
    """The conversation of one session: its system prompt names its project."""
    system = {**messages[0], "content": f"Project {session}. {messages[0]['content']}"}
    return [system, *messages[1:]]


def test_sessions_stay_on_their_hosts_and_move_with_their_cache(
        tmp_path: Path, redis_server: Redis) -> None:
    shared = ("--workers", "1", "--shared-tier", redis_server.url)
    with running(tmp_path / "h1", *shared) as h1, running(tmp_path / "h2", *shared) as h2:
        port = free_port()
        proc = subprocess.Popen(
            [str(HAPROXY), "-db", "-f", str(ROOT / "deploy" / "haproxy.cfg")],
            env={"PG_LISTEN": f"127.0.0.1:{port}", "PG_HOST1": f"127.0.0.1:{h1.port}",
                 "PG_HOST2": f"127.0.0.1:{h2.port}", "PG_CHECK_INTERVAL": "500ms",
                 "PATH": "/usr/sbin:/usr/bin:/bin"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            time.sleep(2)  # two health checks: both hosts up
            # sessions until one lands on each host
            hosts: dict[str, str] = {}
            for i in range(16):
                session = f"session-{i}"
                host = ask(url, session, convo("Name one rule.", history=0))["host"]
                hosts.setdefault(host, session)
                if len(hosts) == 2:
                    break
            assert set(hosts) == {"host1", "host2"}, hosts
            # interleaved turns (each session its own project): each stays where it is
            turns = {s: [own(s, convo("Which rule is about files?", history=h))
                         for h in (0, 1, 2)] for s in hosts.values()}
            seen: dict[str, set[str]] = {s: set() for s in turns}
            last = {}
            for t in (0, 1):
                for s in turns:
                    r = ask(url, s, turns[s][t])
                    seen[s].add(r["host"])
                    last[s] = r
            assert all(len(h) == 1 for h in seen.values()), seen
            # host1 goes: its session continues on host2, from the shared tier
            moving = hosts["host1"]
            entries(h1.cache_dir, until=lambda f: any(e.n_tokens > BATCH * 4 for e in f))
            redis_server.wait_entries(3)
            h1.proc.send_signal(signal.SIGKILL)
            time.sleep(2)  # HAProxy sees it down (two failed checks)
            moved = ask(url, moving, turns[moving][2])
            assert moved["host"] == "host2" and moved["source"] == "shared", moved
            new_tokens = moved["prompt"] - last[moving]["prompt"]
            assert moved["prompt"] - moved["cached"] <= new_tokens + 2 * BATCH, moved
            staying = hosts["host2"]  # still on host2 (its live slot went to the moved one)
            stayed = ask(url, staying, turns[staying][2])
            assert stayed["host"] == "host2" and stayed["source"] in ("live", "disk"), stayed
            assert stayed["prompt"] - stayed["cached"] <= \
                stayed["prompt"] - last[staying]["prompt"] + 2 * BATCH, stayed
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
    with running(tmp_path / "cold", "--workers", "1", "--disk-prefix-cache", "off") as cold:
        assert ask(cold.url, "x", turns[moving][2])["text"] == moved["text"]
