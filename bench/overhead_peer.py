"""`make overhead-compare PEER=1`: the proxy's prompt preparation against llama-server's own, in
one run (issue 46, section 7).

    python -m bench.overhead_peer [--llama-server build/llama-server/build/bin/llama-server]
                                  [--sizes 2000,8000,32000] [--reps 5] [--out bench/results/..]

Both servers run the default model side by side on loopback (one at a time computes: each
request waits for its answer). For each size, `--reps` new conversations of that size (a
synthetic agent session, `bench.synth`, a different seed each: nothing of it is in either
server's caches) are sent to both servers in turn through llama-server's own two endpoints:
`POST /apply-template` with the chat body (messages and tools), then `POST /tokenize` of the
text it returned. The time is the wall time of the two calls as the client sees them (HTTP and
JSON included on both sides), the median over the reps; `warm` re-sends the last conversation
with one new user turn (prefixgate's template and tokenizer caches hold its history;
llama-server has none).

What the two compute differs where the template cannot say it: llama-server renders the tools
with its own generic tool prompt; prefixgate lays them out in the model's tool dialect. The
token counts of both are in the table.

The in-process stages of the same work (parse, prepare, decide; CPU time, without HTTP) are
`make overhead` (bench/overhead.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from backend.placement import uses_repack
from bench.overhead import session_knobs, with_new_turn
from bench.replay import ROOT, free_port, http_get
from bench.synth import generate
from bench.trace import to_openai
from proxy.config import default_model
from proxy.worker_link import child_env

N_CTX = 65536


def conversation(target: int, seed: int, builder: Any) -> dict[str, Any]:
    """An OpenAI body of a new synthetic session whose prompt reaches `target` tokens."""
    from bench.prompts import render

    last: dict[str, Any] | None = None
    for row in generate(session_knobs(target), seed=seed):
        last = to_openai(row)
        if len(render(builder, last).ids) >= target:
            return last
    raise SystemExit(f"could not grow a session to {target} tokens (seed {seed})")


def post(port: int, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out, (time.perf_counter() - t0) * 1e3


def prepare(port: int, body: dict[str, Any]) -> tuple[float, int]:
    """(wall ms of /apply-template then /tokenize, tokens)."""
    chat = {"messages": body["messages"], **({"tools": body["tools"]} if body.get("tools")
                                             else {})}
    rendered, t1 = post(port, "/apply-template", chat)
    tokens, t2 = post(port, "/tokenize", {"content": rendered["prompt"]})
    return t1 + t2, len(tokens["tokens"])


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=child_env(ROOT))
    t0 = time.perf_counter()
    while http_get(f"http://127.0.0.1:{port}/health", 2.0)[0] != 200:
        if proc.poll() is not None or time.perf_counter() - t0 > 600:
            proc.kill()
            raise SystemExit(f"{cmd[0]} did not start:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.3)
    return proc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.overhead_peer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=str(ROOT / "build/llama-server/build/bin/"
                                                    "llama-server"))
    p.add_argument("--model", default=default_model())
    p.add_argument("--sizes", default="2000,8000,32000")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue46"))
    a = p.parse_args(argv)
    from bench.prompts import load_builder

    builder = load_builder()
    sizes = [int(s) for s in a.sizes.split(",")]
    print("growing the conversations ...", file=sys.stderr)
    bodies = {size: [conversation(size, 1000 + 17 * size + rep, builder) for rep in range(a.reps)]
              for size in sizes}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="prefixgate-peer-") as tmp:
        ports = {"prefixgate": free_port(), "llama-server": free_port()}
        repack = [] if uses_repack("auto") else ["--no-repack"]
        cmds = {
            "prefixgate": [sys.executable, "-m", "proxy.cli", "serve", "--model", a.model,
                           "--host", "127.0.0.1", "--port", str(ports["prefixgate"]), "-c",
                           str(N_CTX), "--cache-dir", f"{tmp}/cache", "--log-level", "WARNING"],
            "llama-server": [a.llama_server, "-m", a.model, "-c", str(N_CTX), *repack,
                             "--host", "127.0.0.1", "--port", str(ports["llama-server"])]}
        procs = {name: start(cmd, ports[name], Path(tmp) / f"{name}.log")
                 for name, cmd in cmds.items()}
        try:
            for size in sizes:
                times: dict[str, list[float]] = {n: [] for n in cmds}
                tokens: dict[str, int] = {}
                for body in bodies[size]:
                    for name in cmds:  # in turn: the machine's noise falls on both
                        ms, tokens[name] = prepare(ports[name], body)
                        times[name].append(ms)
                warm: dict[str, list[float]] = {n: [] for n in cmds}
                for rep in range(a.reps):
                    body = with_new_turn(bodies[size][-1], rep)
                    for name in cmds:
                        warm[name].append(prepare(ports[name], body)[0])
                row: dict[str, Any] = {
                    "size": size, "tokens": tokens,
                    "cold_ms": {n: statistics.median(v) for n, v in times.items()},
                    "warm_ms": {n: statistics.median(v) for n, v in warm.items()}}
                row["cold_ratio"] = row["cold_ms"]["prefixgate"] / row["cold_ms"]["llama-server"]
                row["warm_ratio"] = row["warm_ms"]["prefixgate"] / row["warm_ms"]["llama-server"]
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(30)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    lines = [
        "# Prompt preparation: prefixgate against llama-server, side by side (issue 46, "
        "section 7)", "",
        f"`python -m bench.overhead_peer --sizes {a.sizes} --reps {a.reps}` on "
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), commit {head}, "
        f"model {Path(a.model).name}, both servers `-c {N_CTX}`. Wall ms of `POST "
        "/apply-template` then `POST /tokenize` of its text, as the client sees them, the "
        f"median of {a.reps}; cold = a new conversation each time, warm = the last one re-sent "
        "with a new user turn.", "",
        "| prompt tokens (prefixgate / llama-server) | cold prefixgate | cold llama-server | "
        "**cold ratio** | warm prefixgate | warm llama-server | warm ratio |",
        "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c, w = r["cold_ms"], r["warm_ms"]
        lines.append(f"| {r['tokens']['prefixgate']} / {r['tokens']['llama-server']} | "
                     f"{c['prefixgate']:.1f} | {c['llama-server']:.1f} | "
                     f"**{r['cold_ratio']:.2f}x** | {w['prefixgate']:.1f} | "
                     f"{w['llama-server']:.1f} | {r['warm_ratio']:.2f}x |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead-peer.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "overhead-peer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
