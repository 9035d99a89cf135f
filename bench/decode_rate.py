"""`python -m bench.decode_rate`: the aggregate decode rate of several sessions generating at once
(issue 41): prefixgate with `--parallel N` in each `--deterministic` mode against llama-server
`-np N` built from the same llama.cpp, on the same model.

    python -m bench.decode_rate --model GGUF [--llama-server PATH] [--slots 3] [--tokens 192]
        [--modes auto,on,off] [-ngl 99] [--out DIR]

Each arm is started alone, warmed up with one request, then given N streaming chat requests at
once (distinct short prompts, greedy, `--tokens` each). Its rate is the tokens the N streams
received while all N were generating (from the last stream's first token to the first stream's
last) over that window: decode only, no prefill. Reported beside each: the ratio to
llama-server's rate in the same run. Run it alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from backend.placement import uses_repack
from bench.replay import free_port, http_get
from bench.team import Server

# distinct prompts whose greedy answers run to 192 tokens and more on the default model (checked
# on llama-server: an answer that ends early leaves no window where all N generate)
PROMPTS = ["List every prime number you know, separated by commas.",
           "List every even number up to five hundred, separated by commas.",
           "List every odd number up to five hundred, separated by commas.",
           "Count from one to three hundred in digits, separated by commas."]


def _stream(port: int, body: dict[str, Any], times: list[float]) -> None:
    """Each content chunk's arrival time (one generated token a chunk)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    while line := resp.readline():
        line = line.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        ev = json.loads(line[5:])
        delta = (ev.get("choices") or [{}])[0].get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            times.append(time.perf_counter())
    conn.close()


def measure(port: int, slots: int, tokens: int) -> dict[str, Any]:
    def body(i: int, n: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": n, "temperature": 0, "stream": True}

    _stream(port, body(0, 8), [])  # warm up
    streams: list[list[float]] = [[] for _ in range(slots)]
    threads = [threading.Thread(target=_stream, args=(port, body(i, tokens), streams[i]))
               for i in range(slots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(s[0] for s in streams if s)
    end = min(s[-1] for s in streams if s)
    inside = sum(start <= t <= end for s in streams for t in s)
    window = end - start
    return {"tokens": [len(s) for s in streams], "window_s": round(window, 3),
            "tokens_in_window": inside,
            "tokens_per_s": round(inside / window, 2) if window > 0 else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.decode_rate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--llama-server", default="")
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--modes", default="auto,on,off")
    p.add_argument("-ngl", "--n-gpu-layers", default="0")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    work = Path("/tmp/decode-rate")
    work.mkdir(exist_ok=True)
    ctx = str(a.slots * 4096)
    threads = ["--threads", str(a.threads)] if a.threads else []
    arms: list[tuple[str, list[str]]] = []
    if a.llama_server:
        repack = [] if uses_repack("auto") else ["--no-repack"]
        arms.append(("llama-server", [a.llama_server, "-m", a.model, "-c", ctx, "-np",
                                      str(a.slots), "-ngl", a.n_gpu_layers, *threads, *repack]))
    for mode in a.modes.split(","):
        arms.append((f"prefixgate {mode}", [
            sys.executable, "-m", "proxy.cli", "serve", "--model", a.model, "-c", ctx,
            "--parallel", str(a.slots), "-ngl", a.n_gpu_layers, *threads, "--deterministic",
            mode, "--cache-dir", str(work / "cache"), "--disk-prefix-cache", "off"]))
    rows = []
    for name, cmd in arms:
        port = free_port()
        srv = Server(name, [*cmd, "--host", "127.0.0.1", "--port", str(port)],
                     work / f"{name.replace(' ', '-')}.log", port)
        srv.start()
        try:
            row = {"arm": name, **measure(port, a.slots, a.tokens)}
            if name != "llama-server":  # what the worker chose, in its own words
                props = json.loads(http_get(f"http://127.0.0.1:{port}/props")[1])
                row["decode"] = props["deterministic"]["workers"].get("0", "")
        finally:
            srv.stop()
        rows.append(row)
        print(json.dumps(row), flush=True)
    peer = next((r["tokens_per_s"] for r in rows if r["arm"] == "llama-server"), None)
    print(f"\n| arm | tokens/s, {a.slots} generating at once | x llama-server |\n|---|---:|---:|")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / peer:.2f}x" if peer and r["tokens_per_s"] else "-"
        print(f"| {r['arm']} | {r['tokens_per_s']} | {ratio} |")
    result = {"model": a.model, "slots": a.slots, "tokens": a.tokens, "rows": rows}
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "decode_rate.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
