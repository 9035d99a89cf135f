"""`python -m bench.latency`: does a heavy request stall everyone else? (issue 14: the event loop
froze for 19 s on a 3,000-message request.)

    python -m bench.latency [--probes 200] [--messages 3000]

Starts one prefixgate (one worker, the default model, n_ctx 4096) and measures the round trip of
`GET /health` (what load balancers and other clients see of the event loop) in two phases, side
by side in one run:

- idle: nothing else running;
- under load: two client processes send, back to back, requests the proxy must render and then
  reject: a conversation of `--messages` messages (it renders to more than n_ctx tokens: a 400
  after rendering), and a request with 200 large tool schemas (a heavy render and tool section).

Prints the p50, p95 and max of each phase in ms and the rejected requests' count and time, as a
markdown table. Rendering runs on the gateway's render thread, so the loop stays free; what is
left is Python's GIL, which a thread holds for up to its switch interval (5 ms) at a time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import running


def post(url: str, data: bytes) -> int:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def load(url: str, data: bytes, stop: Any, results: Any) -> None:
    """A load generator process: posts `data` back to back until `stop`."""
    done: list[tuple[int, float]] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        status = post(url, data)
        done.append((status, time.perf_counter() - t0))
    results.put(done)


def probe(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            r.read()
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.01)
    return out


def heavy_bodies(n_messages: int) -> list[dict[str, Any]]:
    long = [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"Message {i}: please look at file number {i} and report back."}
            for i in range(n_messages)]
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "A tool. " * 40,
        "parameters": {"type": "object", "properties": {
            f"p{j}": {"type": "string", "description": "a field " * 10} for j in range(20)}}}}
        for i in range(200)]
    return [{"model": "m", "max_tokens": 4, "messages": long},
            {"model": "m", "max_tokens": 4, "tools": tools,
             "messages": [{"role": "user", "content": "hi"}]}]


def stats(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=20)
    return f"{statistics.median(xs):.2f} | {q[18]:.2f} | {max(xs):.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.latency",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--probes", type=int, default=200)
    p.add_argument("--messages", type=int, default=3000)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="prefixgate-latency-") as tmp, \
            running(Path(tmp), "--workers", "1", "--disk-prefix-cache", "off") as srv:
        idle = probe(srv.url, a.probes)
        # the load comes from other processes, its bodies encoded once: the probe's own
        # process holds no GIL contention of the load generator's making
        ctx = multiprocessing.get_context("spawn")
        stop, results = ctx.Event(), ctx.Queue()
        loaders = [ctx.Process(target=load, args=(srv.v1 + "/chat/completions",
                                                  json.dumps(b).encode(), stop, results))
                   for b in heavy_bodies(a.messages)]
        for proc in loaders:
            proc.start()
        time.sleep(2.0)  # both are in flight
        loaded = probe(srv.url, a.probes)
        stop.set()
        rejected: list[tuple[int, float]] = []
        for _ in loaders:
            rejected += results.get(timeout=600)
        for proc in loaders:
            proc.join()
    statuses = sorted({s for s, _ in rejected})
    print("| phase | /health p50 ms | p95 ms | max ms |\n|---|---:|---:|---:|")
    print(f"| idle | {stats(idle)} |")
    print(f"| under load | {stats(loaded)} |")
    print(f"\nheavy requests during the load phase: {len(rejected)}, statuses {statuses}, "
          f"median {statistics.median(s for _, s in rejected) * 1e3:.0f} ms each")


if __name__ == "__main__":
    main()
