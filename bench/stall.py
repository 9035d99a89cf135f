"""`make bench-stall`: one request must not stall everyone (issue 46, section 5).

    python -m bench.stall [--ctx 8192] [--probes 10] [--out bench/results/issue46]

prefixgate serves the default model on loopback. A client sends a short chat request
(streaming, its time to the first token) again and again; first alone (its unloaded time, the
median), then while another client sends the heaviest requests the bounds let through, each
at least three times in a row and until the probe has seen five answers:

- `/tokenize` of the longest text that may fit a slot's context (`n_ctx - 1` times the
  longest token's characters): words, and one run of a single letter (one pre-token, the
  worst case of a BPE merge);
- `/apply-template` with `max_messages` short messages;
- `/detokenize` of `n_ctx` token ids.

For each, the probe's worst time to first token while the heavy request was being prepared,
against its unloaded median; the target: within 1 s of it. A chat request's own prefill is
compute, not preparation, and is not among them (it waits for a slot as any request does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.replay import ROOT, free_port, http_get, stream_request
from proxy.config import default_model
from proxy.limits import LIMITS
from proxy.worker_link import child_env

TARGET_S = 1.0
PROBE = {"model": "m", "max_tokens": 1, "temperature": 0, "stream": True,
         "messages": [{"role": "system", "content": "You answer in one word."},
                      {"role": "user", "content": "Name a colour."}]}


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, float]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    return status, time.perf_counter() - t0


def probe(port: int) -> float:
    reply = stream_request(port, "/v1/chat/completions", PROBE, 120)
    return float(reply.ttft_s)


def heavy(n_ctx: int, max_token_chars: int) -> list[tuple[str, str, dict[str, Any]]]:
    chars = (n_ctx - 1) * max_token_chars  # the most proxy.prompt lets through
    rng = random.Random(5)
    vocab = ["def", "return", "self", "value", "import", "the", "cache", "state", "token", "(",
             ")", ":", "\n", "    ", "x", "1", "==", "None"]
    words = "".join(rng.choice(vocab) + " " for _ in range(chars // 4))[:chars]
    return [
        ("/tokenize", f"{chars:,} characters of code-like words", {"content": words}),
        ("/tokenize", f"{chars:,} characters of one letter", {"content": "a" * chars}),
        ("/apply-template", f"{LIMITS.max_messages:,} messages",
         {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                       for i in range(LIMITS.max_messages)]}),
        ("/detokenize", f"{n_ctx:,} token ids", {"tokens": [rng.randrange(1000, 30000)
                                                           for _ in range(n_ctx)]}),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=default_model())
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--probes", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue46"))
    a = p.parse_args(argv)
    from proxy.prompt import PromptBuilder

    max_token_chars = PromptBuilder.load(a.model).max_token_chars
    port = free_port()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="prefixgate-stall-") as tmp:
        log = Path(tmp) / "serve.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy.cli", "serve", "--model", a.model, "--host",
                 "127.0.0.1", "--port", str(port), "-c", str(a.ctx), "--cache-dir",
                 f"{tmp}/cache", "--log-level", "WARNING"],
                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=child_env(ROOT))
        try:
            t0 = time.perf_counter()
            while http_get(f"http://127.0.0.1:{port}/health", 2.0)[0] != 200:
                if proc.poll() is not None or time.perf_counter() - t0 > 600:
                    raise SystemExit(log.read_text(errors="replace")[-2000:])
                time.sleep(0.3)
            probe(port)  # its prompt is now live: what follows times the proxy, not a prefill
            alone = [probe(port) for _ in range(a.probes)]
            base = statistics.median(alone)
            for path, what, body in heavy(a.ctx, max_token_chars):
                times: list[float] = []
                statuses: list[int] = []
                during: list[float] = []
                done = threading.Event()

                def load(path: str, body: dict[str, Any], times: list[float],
                         statuses: list[int], during: list[float], done: threading.Event
                         ) -> None:
                    while len(times) < 3 or len(during) < 5:
                        status, s = post(port, path, body)
                        statuses.append(status)
                        times.append(s)
                    done.set()

                threading.Thread(target=load, args=(path, body, times, statuses, during, done),
                                 daemon=True).start()
                while not done.is_set():
                    during.append(probe(port))
                row = {"path": path, "what": what, "status": sorted(set(statuses)),
                       "heavy_s": statistics.median(times), "probes": len(during),
                       "probe_max_s": max(during), "probe_median_s": statistics.median(during),
                       "alone_s": base, "over_s": max(during) - base}
                row["met"] = row["over_s"] <= TARGET_S
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(30)
    lines = [
        "# One request must not stall everyone (issue 46, section 5)", "",
        f"`python -m bench.stall --ctx {a.ctx}` on {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), model {Path(a.model).name}. A short "
        f"streaming chat's time to first token alone: median {base:.3f} s of {a.probes}. Then "
        "the same probe, again and again, while another client sends the heaviest request the "
        f"bounds let through, at least three times in a row. Target: the probe's worst within "
        f"{TARGET_S:.0f} s of its time alone.", "",
        "| request | status | its time (median) | probes | probe median s | probe worst s | "
        "worst over alone | met |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| `{r['path']}` {r['what']} | {', '.join(map(str, r['status']))} | "
                     f"{r['heavy_s']:.2f} s | {r['probes']} | {r['probe_median_s']:.3f} | "
                     f"{r['probe_max_s']:.3f} | {r['over_s']:+.3f} s | "
                     f"{'yes' if r['met'] else 'NO'} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stall.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "stall.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
