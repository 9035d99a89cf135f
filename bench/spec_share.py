"""A session's stream while another session's first turn starts, with a draft model (issue 47):
how long the streaming session stops while the draft model prefills the newcomer's prompt,
side by side with llama-server.

    python -m bench.spec_share [--llama-server PATH] [--base REV_TREE] [--rounds 2]
        [--lines 180] [--model GGUF] [--draft-model GGUF] [--out FILE]

Each arm on a fresh server, `-np 2`, `--spec-type draft-simple -md` (the model itself by
default: its drafts cost as much as the model's steps, so its prompt prefill is as slow as the
model's), greedy. Session `a` streams a long completion (`Line 5`, `Line 6`, ...: `--answer`
tokens, long enough to outlast `b`: the table says where it did not); once it has
streamed a few, session `b` sends a file of `--lines` lines to edit (not streamed, 16 tokens).
Reported per arm: `a`'s median gap between streamed chunks before `b` came, its longest gap
while `b` ran and its tokens while `b` ran, and `b`'s wall seconds. Before prefixgate's draft
model prefilled a prompt a batch a step, `b`'s whole prompt went through the draft model in one
step and `a` stopped meanwhile (as llama-server does: its draft context evaluates the prompt
inside one `update_slots`). `--base`: a checkout of another prefixgate revision as one more arm.
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

from bench.replay import ROOT, free_port
from bench.spec import post_json
from bench.spec_return import file_text, parser, run_arms
from bench.team import Server

LINES = "Line 1\nLine 2\nLine 3\nLine 4\n"  # the model goes on with Line 5, 6, ...


def command(arm: str, args: argparse.Namespace, port: int, work: Path) -> list[str]:
    common = ["-c", "16384", "-np", "2", "-md", args.draft_model, "--port", str(port)]
    if arm == "llama-server":
        return [args.llama_server, "-m", args.model, *common, "-t", str(args.threads),
                "--spec-type", "draft-simple", "--host", "127.0.0.1"]
    return [sys.executable, "-m", "proxy.cli", "serve", "--model", args.model, *common,
            "--threads", str(args.threads), "--spec-type", "draft-simple", "--spec-stop", "off",
            "--host", "127.0.0.1", "--cache-dir", str(work / f"cache-{arm}"),
            "--disk-prefix-cache", "off"]


def stream(port: int, body: dict[str, Any], chunks: list[tuple[float, int]]) -> None:
    """POST a streamed completion; (arrival time, characters) of each chunk with text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status} {resp.read()!r}")
    while line := resp.readline():
        if not line.startswith(b"data: {"):
            continue
        delta = json.loads(line[6:])["choices"][0].get("text") or ""
        if delta:
            chunks.append((time.perf_counter(), len(delta)))
    conn.close()


def run(arm: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    port = free_port()
    root = Path(args.base) if arm == "base" else ROOT
    srv = Server(arm, command(arm, args, port, work), work / f"{arm}.log", port, root=root,
                 sample_rss=False)
    srv.start()
    try:
        chunks: list[tuple[float, int]] = []
        a = threading.Thread(target=stream, args=(port, {
            "prompt": LINES, "temperature": 0, "max_tokens": args.answer}, chunks))
        a.start()
        while len(chunks) < 8:
            if not a.is_alive():
                raise RuntimeError(f"{arm}: session a ended after {len(chunks)} chunks")
            time.sleep(0.005)
        came = time.perf_counter()
        r = post_json(port, "/v1/chat/completions", {"messages": [
            {"role": "system", "content": "You edit code."},
            {"role": "user", "content": f"File app.py:\n{file_text(args.lines)}\n\n"
                                        "Rename step_3 to advance."}],
            "temperature": 0, "max_tokens": 16})
        ended = time.perf_counter()
        a.join()
        times = [t for t, _ in chunks]
        before = [y - x for x, y in zip(times, times[1:], strict=False) if y <= came]
        during = [t for t in times if came <= t <= ended]
        edges = [came, *during, ended]
        return {"arm": arm, "a_gap_before_s": round(statistics.median(before), 4),
                "a_longest_gap_during_b_s": round(max(
                    y - x for x, y in zip(edges, edges[1:], strict=False)), 3),
                "a_chunks_during_b": len(during), "a_ended_before_b": times[-1] < ended,
                "b_s": round(ended - came, 3),
                "b_prompt": r["usage"]["prompt_tokens"]}
    finally:
        srv.stop()


def markdown(rows: list[dict[str, Any]], cmd: str) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    out = [f"`{cmd}`, {len(rows) // len(arms)} round(s), each arm on a fresh server; the median "
           "of the rounds.", "",
           "| arm | a: gap between chunks before b (s) | **a: longest gap while b ran (s)** "
           "| a: chunks while b ran | b: wall (s) | b: prompt tokens |",
           "|---|---:|---:|---:|---:|---:|"]
    for a in arms:
        mine = [r for r in rows if r["arm"] == a]

        def med(k: str, mine: list[dict[str, Any]] = mine) -> float:
            return float(statistics.median(r[k] for r in mine))
        early = sum(r["a_ended_before_b"] for r in mine)
        out.append(f"| {a} | {med('a_gap_before_s'):.3f} | "
                   f"**{med('a_longest_gap_during_b_s'):.2f}** | "
                   f"{med('a_chunks_during_b'):.0f}"
                   + (f" (a ended first in {early})" if early else "")
                   + f" | {med('b_s'):.2f} | {mine[-1]['b_prompt']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = parser("python -m bench.spec_share", __doc__)
    p.add_argument("--answer", type=int, default=1500)
    run_arms(p.parse_args(argv), "bench.spec_share", argv, run, markdown)


if __name__ == "__main__":
    main()
