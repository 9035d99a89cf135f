"""Bytes one host sends to the shared tier for an agent session (issue 46, section 3): a count,
not a timing.

    python -m bench.shared_bytes [--turns 40] [--system-tokens 2000] [--out FILE]

One prefixgate (the default model, one worker, -c 8192) with `--shared-tier` on a real
`redis-server` on loopback (Debian's package; `maxmemory 1gb`, allkeys-lru: what it evicts does
not change what was sent). One session: a ~2K-token system prompt, then `--turns` prompts, each
the last one plus an answer and a new ~40-token question, as an agent sends them; every
snapshot the worker saves is published. Reported: the bytes Redis received
(`total_net_input_bytes`: the published chunks and entries, plus a little protocol), the
entries written (HSET calls), and the state bytes those snapshots hold. Run it before and after
a change of the tier's format, on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.replay import free_port, http_get

ROOT = Path(__file__).resolve().parent.parent


def redis_stats(r: Any) -> tuple[int, int, int]:
    """(bytes Redis received, HSET calls, SET calls)."""
    net = int(r.info("stats")["total_net_input_bytes"])
    cmds = r.info("commandstats")
    return (net, int(cmds.get("cmdstat_hset", {}).get("calls", 0)),
            int(cmds.get("cmdstat_set", {}).get("calls", 0)))


def chat(port: int, messages: list[dict[str, str]]) -> dict[str, Any]:
    import urllib.request

    body = json.dumps({"model": "m", "messages": messages, "temperature": 0,
                       "max_tokens": 8}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return dict(json.loads(resp.read()))


def session(turns: int, system_tokens: int) -> list[list[dict[str, str]]]:
    rules = [f"Rule {i}: read the file before you edit it, keep the diff small, run the tests "
             f"of module m{i} and say what changed." for i in range(system_tokens // 25)]
    messages = [{"role": "system", "content": " ".join(rules)}]
    prompts = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Step {t}: open src/module_{t}.py, find "
                         f"the function that parses option {t}, and tell me which rule "
                         "applies before you change anything in it."})
        prompts.append(list(messages))
        messages.append({"role": "assistant", "content": f"Rule {t % 7} applies to step {t}."})
    return prompts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.shared_bytes")
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server (Debian's package)")
    tmp = Path(tempfile.mkdtemp(prefix="pg-shared-bytes-"))
    rport, port = free_port(), free_port()
    rproc = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(tmp),
                              "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = open(tmp / "server.log", "wb")
    srv = subprocess.Popen([sys.executable, "-m", "proxy.cli", "serve", "--port", str(port),
                            "--workers", "1", "-c", "8192", "--cache-dir", str(tmp / "cache"),
                            "--cache-ram", "0", "--shared-tier",
                            f"redis://127.0.0.1:{rport}/0"], cwd=ROOT, stdout=log,
                           stderr=subprocess.STDOUT, env={**os.environ,
                                                          "PREFIXGATE_SHARED_TIER_SECRET": "b"})
    try:
        r = redis.Redis(port=rport)
        deadline = time.time() + 300
        while http_get(f"http://127.0.0.1:{port}/health", 2)[0] != 200:
            if srv.poll() is not None or time.time() > deadline:
                raise SystemExit((tmp / "server.log").read_text()[-3000:])
            time.sleep(0.5)
        net0, hset0, _ = redis_stats(r)
        prompt_tokens = 0
        for messages in session(a.turns, a.system_tokens):
            prompt_tokens += chat(port, messages)["usage"]["prompt_tokens"]
        last, still = redis_stats(r), 0  # the worker publishes after the answers: wait for it
        while still < 10:  # (INFO itself adds to the bytes received: writes must stop)
            time.sleep(1)
            now = redis_stats(r)
            still = still + 1 if now[1:] == last[1:] else 0
            last = now
        net, hset = last[0] - net0, last[1] - hset0
        row = {"turns": a.turns, "prompt_tokens": prompt_tokens, "entries": hset,
               "received_bytes": net}
        line = (f"| {a.turns} | {prompt_tokens} | {hset} | {net / 1e6:.1f} MB |")
        print("| prompts | prompt tokens | entries published | bytes Redis received |\n"
              "|---|---|---|---|\n" + line)
        print(json.dumps(row))
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        srv.send_signal(signal.SIGINT)
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
        rproc.kill()
        rproc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
