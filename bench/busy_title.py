"""A title while every slot generates (issue 41, policies/preempt.py rule 4): three sessions
each stream a long answer on a `-np 3` server; once each has streamed `--after` tokens, a short
request (a title: a few hundred tokens in, 12 out at most) comes. Without a free slot it waits
for the first answer to end; prefixgate parks one generating run in host RAM and runs it on
that slot.

    python -m bench.busy_title [--tree DIR ...] [--llama-server PATH] [--rounds N]
                               [--gen 240] [--after 24] [-m MODEL.gguf]

`--tree`: a prefixgate checkout to serve from (`-np 3`, its defaults: a worktree of an older
commit for a before and after, its `.venv` beside it), in turn with the others, round after
round, each from a new cache directory; `--llama-server`: llama.cpp's server from the same
llama.cpp (`-np 3 -c 16384 -t 2 --jinja`). Prints per server and round: the title's time to
its first token and to its end, and each long answer's end, in seconds from when the title was
sent (all answers greedy, `ignore_eos`, so each is `--gen` tokens long).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.fanout import ROOT, WORDS, server

TITLE = ("Write a five-word title for this conversation. Reply with the title only.\n\n"
         + " ".join(f"{WORDS[k % len(WORDS)]}{k % 31}" for k in range(150)))


def long_body(i: int, gen: int) -> dict[str, Any]:
    text = " ".join(f"{WORDS[(k * 7 + i) % len(WORDS)]}{(k + i) % 97}" for k in range(300))
    return {"model": "m", "temperature": 0, "max_tokens": gen, "ignore_eos": True,
            "stream": True, "messages": [
                {"role": "system", "content": f"You are agent {i}. Answer at length."},
                {"role": "user", "content": f"Explain these notes, step by step:\n{text}"}]}


def stream(port: int, payload: dict[str, Any], marks: list[float],
           first: threading.Event | None = None, after: int = 1) -> None:
    """POST and read the SSE stream; `marks`: the time of its first token, then of its end;
    `first` is set once `after` chunks came."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    c.request("POST", "/v1/chat/completions", json.dumps(payload),
              {"content-type": "application/json"})
    r = c.getresponse()
    n = 0
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        delta = json.loads(line[6:]).get("choices", [{}])
        if delta and delta[0].get("delta", {}).get("content"):
            n += 1
            if n == 1:
                marks.append(time.perf_counter())
            if first is not None and n == after:
                first.set()
    marks.append(time.perf_counter())
    if first is not None:
        first.set()


def serve(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, gen: int, after: int
          ) -> dict[str, Any]:
    with server(cmd, cwd, env, log) as port:
        marks: list[list[float]] = [[] for _ in range(3)]
        started = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=stream, args=(port, long_body(i, gen), marks[i],
                                                         started[i], after))
                   for i in range(3)]
        for th in threads:
            th.start()
        for ev in started:
            ev.wait()
        title: list[float] = []
        sent = time.perf_counter()
        stream(port, {"model": "m", "temperature": 0, "max_tokens": 12, "stream": True,
                      "messages": [{"role": "user", "content": TITLE}]}, title)
        for th in threads:
            th.join()
        return {"title_ttft_s": round(title[0] - sent, 2),
                "title_end_s": round(title[-1] - sent, 2),
                "long_end_s": [round(m[-1] - sent, 2) for m in marks]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.busy_title",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[])
    p.add_argument("--llama-server", default="")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--gen", type=int, default=240)
    p.add_argument("--after", type=int, default=24)
    p.add_argument("-m", "--model", default="")
    a = p.parse_args(argv)
    from proxy.config import default_model

    model = str(Path(a.model).resolve()) if a.model else default_model()
    trees = [Path(t).resolve() for t in a.tree] or [ROOT]
    logs = Path(tempfile.mkdtemp(prefix="prefixgate-busy-title-"))
    for r in range(a.rounds):
        for tree in trees:
            env = dict(os.environ, PREFIXGATE_CACHE_DIR=str(logs / f"cache-{r}-{tree.name}"))
            got = serve([str(tree / ".venv/bin/python"), "-m", "proxy.cli", "serve", "-np", "3",
                         "-m", model], tree, env, logs / f"{tree.name}-{r}.log", a.gen, a.after)
            print(f"round {r} {tree}: {got}", flush=True)
        if a.llama_server:
            got = serve([a.llama_server, "-m", model, "-np", "3", "-c", "16384", "-t", "2",
                         "--jinja"], ROOT, dict(os.environ), logs / f"llama-server-{r}.log",
                        a.gen, a.after)
            print(f"round {r} llama-server: {got}", flush=True)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
