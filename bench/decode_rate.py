"""`python -m bench.decode_rate`: the aggregate decode rate of several sessions generating at once
(issue 41), or of one (`--slots 1`: what a lone agent's streamed answer gets, issue 47):
prefixgate with `--parallel N` in each `--deterministic` mode against llama-server `-np N` built
from the same llama.cpp, on the same model.

    python -m bench.decode_rate [--model GGUF] [--llama-server PATH] [--slots 3] [--tokens 192]
        [--modes auto,on,off] [-ngl 99] [--rounds 1] [--base DIR] [--out DIR]

Each arm is started alone, warmed up with one request, then given N streaming chat requests at
once (distinct short prompts, greedy, `--tokens` each). Its rate is the sum of the streams' own:
each stream's tokens after its first (from its `usage`: a chunk may carry several tokens, as
prefixgate's do) over the time from its first content chunk to its last. Decode only, no
prefill; the streams start together and run long enough to overlap (`window_s`: from the last
stream's first chunk to the first stream's last). With `--rounds`, every arm runs once a round,
in an order that turns each round, and each arm's ratio to llama-server is the median of the
rounds' (each measured beside llama-server's of the same round: this machine's speed drifts more
between minutes than the arms differ). `--base DIR`: another prefixgate checkout (e.g. `git
worktree add /tmp/base HEAD~1`) as one more arm, in the first mode. Run it alone on a quiet
machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from backend.placement import uses_repack
from bench.replay import ROOT, free_port, http_get
from bench.team import Server
from proxy.config import default_model

# distinct prompts whose greedy answers run to 192 tokens and more on the default model (checked
# on llama-server: an answer that ends early leaves no window where all N generate)
PROMPTS = ["List every prime number you know, separated by commas.",
           "List every even number up to five hundred, separated by commas.",
           "List every odd number up to five hundred, separated by commas.",
           "Count from one to three hundred in digits, separated by commas."]


def _stream(port: int, body: dict[str, Any], out: dict[str, Any]) -> None:
    """The stream's first and last content chunks' arrival and its tokens (`usage`: a chunk
    may carry several, as prefixgate's do)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {**body, "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    while line := resp.readline():
        line = line.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        ev = json.loads(line[5:])
        if ev.get("usage"):
            out["tokens"] = ev["usage"]["completion_tokens"]
        delta = (ev.get("choices") or [{}])[0].get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            out.setdefault("first", time.perf_counter())
            out["last"] = time.perf_counter()
    conn.close()


def measure(port: int, slots: int, tokens: int) -> dict[str, Any]:
    def body(i: int, n: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": n, "temperature": 0, "stream": True}

    _stream(port, body(0, 8), {})  # warm up
    streams: list[dict[str, Any]] = [{} for _ in range(slots)]
    threads = [threading.Thread(target=_stream, args=(port, body(i, tokens), streams[i]))
               for i in range(slots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each stream's decode rate: the tokens after its first over the time from its first chunk
    # to its last (the last comes with the answer's end, which is sent at once)
    rates = [(s["tokens"] - 1) / (s["last"] - s["first"]) for s in streams
             if s.get("tokens", 0) > 1 and s["last"] > s["first"]]
    start = max(s["first"] for s in streams if "first" in s)
    end = min(s["last"] for s in streams if "last" in s)
    return {"tokens": [s.get("tokens", 0) for s in streams], "window_s": round(end - start, 3),
            "stream_rates": [round(r, 2) for r in rates],
            "tokens_per_s": round(sum(rates), 2) if len(rates) == slots else None}


def table(rows: list[dict[str, Any]], arms: list[str], slots: int) -> str:
    """Each arm's median rate and its ratio to llama-server's: the median of the rounds'."""
    peer = {r["round"]: r["tokens_per_s"] for r in rows if r["arm"] == "llama-server"}
    out = [f"| arm | tokens/s, {slots} generating at once (median) | x llama-server, median of "
           "the rounds (least-most) |", "|---|---:|---:|"]
    for arm in arms:
        rates = [r["tokens_per_s"] for r in rows if r["arm"] == arm and r["tokens_per_s"]]
        ratios = sorted(r["tokens_per_s"] / peer[r["round"]] for r in rows
                        if r["arm"] == arm and r["tokens_per_s"] and peer.get(r["round"]))
        ratio = f"{statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})" \
            if ratios else "-"
        rate = f"{statistics.median(rates):.1f}" if rates else "-"
        out.append(f"| {arm} | {rate} | {ratio} |")
    return "\n" + "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.decode_rate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a GGUF (default: the embedded model)")
    p.add_argument("--llama-server", default="")
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--modes", default="auto,on,off")
    p.add_argument("-ngl", "--n-gpu-layers", default="0")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--base", type=Path, default=None, help="another prefixgate checkout")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    a.model = a.model or default_model()
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
    if a.base:
        mode = a.modes.split(",")[0]
        arms.append((f"prefixgate {mode} (base)", next(c for n, c in arms
                                                       if n == f"prefixgate {mode}")))
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for name, cmd in arms[r % len(arms):] + arms[:r % len(arms)]:
            port = free_port()
            srv = Server(name, [*cmd, "--host", "127.0.0.1", "--port", str(port)],
                         work / f"{name.replace(' ', '-')}.log", port,
                         root=a.base.resolve() if name.endswith("(base)") else ROOT,
                         sample_rss=False)
            srv.start()
            try:
                row = {"arm": name, "round": r, **measure(port, a.slots, a.tokens)}
                if name != "llama-server":  # what the worker chose, in its own words
                    props = json.loads(http_get(f"http://127.0.0.1:{port}/props")[1])
                    row["decode"] = props["deterministic"]["workers"].get("0", "")
            finally:
                srv.stop()
            rows.append(row)
            print(json.dumps(row), flush=True)
    md = table(rows, [n for n, _ in arms], a.slots)
    print(md)
    result = {"model": a.model, "slots": a.slots, "tokens": a.tokens, "rounds": a.rounds,
              "rows": rows}
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "decode_rate.json").write_text(json.dumps(result, indent=1))
        (a.out / "decode_rate.md").write_text(md.lstrip() + "\n")
    return result


if __name__ == "__main__":
    main()
