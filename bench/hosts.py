"""Beyond one host (issue 22): an agent team's sessions over 2 prefixgate hosts behind HAProxy,
one host killed halfway, with and without the shared tier, beside one host alone. Where each
request goes when most carry no session header, HAProxy's hash beside NVIDIA Dynamo's KV router
(issue 44), is bench/hosts_placement.py; `make bench-hosts` runs both.

    python -m bench.hosts [--turns 6] [--main-tokens 2000] [--out bench/results/issue22]

The trace is `bench.team`'s (a main session and two subagents, each its own system prompt and
the same tools, ~300 new tokens a turn), its sessions' turns sent interleaved as clients send
them, each with its session header (X-Claude-Code-Session-Id). Arms, in one run:

- `one host`: one prefixgate, nothing killed (the single-host figures);
- `2 hosts`: two prefixgate behind HAProxy (deploy/haproxy.cfg), the host that holds the most
  sessions SIGKILLed after half the turns: its sessions go on on the other host;
- `2 hosts + shared tier`: the same, both hosts with `--shared-tier` on a real redis-server.

Per arm: fresh prefill tokens (prompt minus reused), time to first token p50/p95, both for all
requests and for the moved sessions' turns after the kill, and where the reuse came from.

Needs Debian's haproxy and redis-server. Nothing else runs meanwhile: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.replay import free_port, http_get
from bench.team import Knobs, make_trace

ROOT = Path(__file__).resolve().parent.parent


def wait_ready(port: int, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while http_get(f"http://127.0.0.1:{port}/health", 2)[0] != 200:
        if time.time() > deadline:
            raise SystemExit(f"nothing ready on port {port} in {timeout_s:.0f} s")
        time.sleep(0.2)


class Proc:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = open(log, "wb")
        self.p = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})})

    def stop(self, sig: int = signal.SIGINT) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def serve(work: Path, name: str, threads: int, *extra: str) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc([sys.executable, "-m", "proxy.cli", "serve", "--port", str(port),
                 "--cache-dir", str(work / name / "cache"), "--n-ctx", "16384",
                 "--threads", str(threads), "--cache-ram", "0", *extra],
                work / f"{name}.log")
    try:  # a first start measures the batch and checks exactness: minutes on 1 thread
        wait_ready(port, 900)
    except BaseException:
        proc.stop()
        raise
    return proc, port


def send(port: int, session: str, body: dict[str, Any], header: bool = True) -> dict[str, Any]:
    """One streamed request; with its session header unless `header` is False."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json",
                          **({"X-Claude-Code-Session-Id": session} if header else {})})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    headers = {k.lower(): v for k, v in resp.getheaders()}
    ttft, usage = None, {}
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[5:])
        if ev.get("usage"):
            usage = ev["usage"]
        if ttft is None and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
            ttft = time.perf_counter() - t0
    prompt = int(usage.get("prompt_tokens", 0))
    cached = int(headers.get("x-prefixgate-cached-tokens", "0"))
    return {"session": session, "prompt": prompt, "cached": cached, "fresh": prompt - cached,
            "source": headers.get("x-prefixgate-cache-source", ""),
            "host": headers.get("x-prefixgate-host")
            or headers.get("x-prefixgate-upstream", "host1"),
            "ttft_s": ttft if ttft is not None else time.perf_counter() - t0}


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run_arm(arm: str, trace: dict[str, list[Any]], work: Path, threads: int) -> dict[str, Any]:
    sessions = [s for s in trace if s != "background"]
    turns = max(len(trace[s]) for s in sessions)
    procs: list[Proc] = []
    redis = None
    try:
        extra: tuple[str, ...] = ()
        if arm.endswith("shared tier"):
            rport = free_port()
            redis = Proc(["redis-server", "--port", str(rport), "--bind", "127.0.0.1",
                          "--save", "", "--appendonly", "no"], work / f"{arm}-redis.log")
            time.sleep(0.5)
            extra = ("--shared-tier", f"redis://127.0.0.1:{rport}/0")
        tag = arm.replace(" ", "-").replace("+", "")
        if arm == "one host":
            h1, port = serve(work, f"{tag}-h1", threads, *extra)
            procs.append(h1)
            hosts = {"host1": h1}
        else:
            h1, p1 = serve(work, f"{tag}-h1", threads, *extra)
            h2, p2 = serve(work, f"{tag}-h2", threads, *extra)
            procs += [h1, h2]
            hosts = {"host1": h1, "host2": h2}
            port = free_port()
            haproxy = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
            lb = Proc([str(haproxy), "-db", "-f", str(ROOT / "deploy" / "haproxy.cfg")],
                      work / f"{tag}-haproxy.log",
                      {"PG_LISTEN": f"127.0.0.1:{port}", "PG_HOST1": f"127.0.0.1:{p1}",
                       "PG_HOST2": f"127.0.0.1:{p2}", "PG_CHECK_INTERVAL": "500ms"})
            procs.append(lb)
            time.sleep(2)
        results, moved_names, killed = [], set(), ""
        for t in range(turns):
            if t == turns // 2 and len(hosts) == 2:  # the busiest host goes
                on = Counter(r["host"] for r in results if r["turn"] == t - 1)
                killed = on.most_common(1)[0][0]
                moved_names = {r["session"] for r in results
                               if r["turn"] == t - 1 and r["host"] == killed}
                hosts[killed].stop(signal.SIGKILL)
                time.sleep(2)  # two failed health checks: HAProxy takes it out
            for s in sessions:
                if t < len(trace[s]):
                    r = send(port, s, trace[s][t].body)
                    r.update(turn=t, moved=s in moved_names and t >= turns // 2)
                    results.append(r)
        return summarize(arm, results, killed)
    finally:
        for p in reversed(procs):
            p.stop()
        if redis is not None:
            redis.stop()


def summarize(arm: str, results: list[dict[str, Any]], killed: str) -> dict[str, Any]:
    moved = [r for r in results if r["moved"]]
    return {
        "arm": arm, "requests": len(results), "killed": killed or "-",
        "fresh_tokens": sum(r["fresh"] for r in results),
        "prompt_tokens": sum(r["prompt"] for r in results),
        "ttft_p50_s": round(statistics.median(r["ttft_s"] for r in results), 3),
        "ttft_p95_s": round(pct([r["ttft_s"] for r in results], 0.95), 3),
        "moved_requests": len(moved), "moved_fresh_tokens": sum(r["fresh"] for r in moved),
        "moved_ttft_p50_s": round(statistics.median([r["ttft_s"] for r in moved]), 3)
        if moved else 0.0,
        "sources": dict(Counter(r["source"] for r in results)),
        "moved_sources": dict(Counter(r["source"] for r in moved)),
        "turns": results,
    }


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# Beyond one host: {res['sessions']} sessions x {res['turns']} turns, a host "
             "killed halfway", "",
             f"Model `{res['model']}`, {res['threads']} threads per host, on one machine "
             "(the hosts share its cores). Times in seconds.", "",
             "| arm | requests | killed | fresh prefill tokens | TTFT p50 | TTFT p95 | moved "
             "turns | their fresh tokens | their TTFT p50 | sources | moved sources |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for a in res["arms"]:
        lines.append(
            f"| {a['arm']} | {a['requests']} | {a['killed']} | {a['fresh_tokens']} | "
            f"{a['ttft_p50_s']} | {a['ttft_p95_s']} | {a['moved_requests']} | "
            f"{a['moved_fresh_tokens']} | {a['moved_ttft_p50_s']} | "
            f"{json.dumps(a['sources'])} | {json.dumps(a['moved_sources'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.hosts")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--main-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue22"))
    a = p.parse_args(argv)
    trace = make_trace(Knobs(main_tokens=a.main_tokens, sub_tokens=a.main_tokens * 3 // 4,
                             turns=a.turns, sub_turns=a.turns, tail_tokens=300, max_tokens=8))
    with tempfile.TemporaryDirectory(prefix="prefixgate-hosts-") as tmp:
        arms = [run_arm(arm, trace, Path(tmp), a.threads)
                for arm in ("one host", "2 hosts", "2 hosts + shared tier")]
    from proxy.config import default_model

    res = {"model": Path(default_model()).name, "threads": a.threads, "turns": a.turns,
           "sessions": len([s for s in trace if s != "background"]), "arms": arms}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hosts.json").write_text(json.dumps(res, indent=1))
    (out / "hosts.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
