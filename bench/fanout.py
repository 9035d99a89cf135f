"""Subagents of one kind started at once (issue 41): each server answers three requests that
share one system prompt and the tools and part at the user's task, sent together, each from a
cold start (a new cache directory).

    python -m bench.fanout [--tree DIR ...] [--llama-server PATH] [--rounds N] [--words 1400]
                           [-m MODEL.gguf] [-ub N]

`--tree`: a prefixgate checkout to serve from (`-np 3`, its defaults; a worktree of an older
commit for a before and after, its `.venv` beside it), in turn with the others, round after
round. `--llama-server`: llama.cpp's server from the same llama.cpp, `-np 3 -c 65536 -t 2
--jinja` (it renders the prompt with its own template: the token counts it prints differ).
`-m`: the model for every server (the embedded one if not given); `-ub`: the prefill batch for
every server (else each its default; a prefixgate start on a CPU measures its own, once per
cache directory). Prints each request's seconds to its answer's end (16 tokens at most: about
its time to first token) per server and round; prefixgate's log lines (`ttft_s=`, `cached=`)
are in the logs.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the cache keeps every prefix exact so a restored state answers like a cold one while "
         "agents resend their long prompts on every turn").split()


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def body(i: int, words: int) -> dict[str, Any]:
    system = "You are a subagent (general-purpose): do one task and report.\n\n" + " ".join(
        f"{WORDS[k % len(WORDS)]}{k % 89}" for k in range(words))
    tools = [{"type": "function", "function": {
        "name": f"tool_{k}", "description": f"Tool number {k} reads files.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
        for k in range(6)]
    return {"model": "m", "temperature": 0, "max_tokens": 16, "stream": True, "tools": tools,
            "tool_choice": "none", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Task {i}: search the repository for uses of "
                                            f"helper_{i} and list them."}]}


def answer_s(port: int, payload: dict[str, Any]) -> float:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    t = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(payload),
              {"content-type": "application/json"})
    r = c.getresponse()
    r.read()
    return time.perf_counter() - t


@contextlib.contextmanager
def server(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> Iterator[int]:
    """`cmd` serving on a free port (its output in `log`), once its /health answers: the
    port; stopped after."""
    port = free_port()
    proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=cwd, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(3600):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        proc.wait()


def serve(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, words: int
          ) -> list[float]:
    with server(cmd, cwd, env, log) as port:
        out: dict[int, float] = {}

        def one(i: int) -> None:
            out[i] = answer_s(port, body(i, words))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for th in threads:
            th.start()
            time.sleep(0.05)
        for th in threads:
            th.join()
        return [round(out[i], 2) for i in range(3)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fanout",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[])
    p.add_argument("--llama-server", default="")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--words", type=int, default=1400)
    p.add_argument("-m", "--model", default="")
    p.add_argument("-ub", "--ubatch-size", type=int, default=0)
    a = p.parse_args(argv)
    from proxy.config import default_model

    model = str(Path(a.model).resolve()) if a.model else default_model()
    same = ["-m", model, *(["-ub", str(a.ubatch_size)] if a.ubatch_size else [])]
    trees = [Path(t).resolve() for t in a.tree] or [ROOT]
    logs = Path(tempfile.mkdtemp(prefix="prefixgate-fanout-"))
    for r in range(a.rounds):
        for tree in trees:
            env = dict(os.environ, PREFIXGATE_CACHE_DIR=str(logs / f"cache-{r}-{tree.name}"))
            got = serve([str(tree / ".venv/bin/python"), "-m", "proxy.cli", "serve", "-np", "3",
                         *same], tree, env, logs / f"{tree.name}-{r}.log", a.words)
            print(f"round {r} {tree}: {got} s (max {max(got)})", flush=True)
        if a.llama_server:
            got = serve([a.llama_server, *same, "-np", "3", "-c", "65536", "-t", "2",
                         "--jinja"], ROOT, dict(os.environ),
                        logs / f"llama-server-{r}.log", a.words)
            print(f"round {r} llama-server: {got} s (max {max(got)})", flush=True)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
