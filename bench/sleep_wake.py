"""What `--sleep-idle-seconds` costs the turn after it: `python -m bench.sleep_wake [--model GGUF]
[--rules N] [--out FILE]`.

One server with `--sleep-idle-seconds 3` and its disk cache, one coding-agent prompt (a system
prompt of N rules, about 40 tokens each, and a question): the first turn (cold), a second one
that extends the live KV, then the workers sleep, and the second turn again: the wake (the
model loaded again, the remembered self-check verdict) and its prefix restored from disk,
against the first turn's cold prefill. Each time is the request's wall time as the client sees
it; the answers of the second turn before and after the sleep are compared (greedy).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.replay import free_port, http_get
from bench.spec import post_json
from bench.team import Server


def system(rules: int) -> str:
    return "You are a careful coding agent working in a large repository. " + " ".join(
        f"Rule {i}: read each file before you edit it, run the tests after each change, and "
        f"keep every change small and reviewed; note {i} applies to module_{i}.py."
        for i in range(rules))


def ask(port: int, sys_text: str, question: str) -> dict[str, Any]:
    t = time.perf_counter()
    r = post_json(port, "/v1/chat/completions", {
        "model": "m", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "system", "content": sys_text},
                     {"role": "user", "content": question}]})
    return {"s": round(time.perf_counter() - t, 2), "prompt": r["usage"]["prompt_tokens"],
            "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"],
            "text": r["choices"][0]["message"]["content"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sleep_wake",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--rules", type=int, default=55)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-sleep-"))
    port = free_port()
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--host",
           "127.0.0.1", "--cache-dir", str(work / "cache"), "--sleep-idle-seconds", "3",
           *(["--model", args.model] if args.model else [])]
    srv = Server("prefixgate", cmd, work / "server.log", port, sample_rss=False)
    started = srv.start()
    text = system(args.rules)
    try:
        out = {"start_s": round(started, 1), "first": ask(port, text, "Where do I start?"),
               "live": ask(port, text, "Which file first?")}
        while not json.loads(http_get(f"http://127.0.0.1:{port}/props")[1])["is_sleeping"]:
            time.sleep(0.2)
        time.sleep(2)
        out["after_sleep"] = ask(port, text, "Which file first?")
    finally:
        srv.stop()
    log = (work / "server.log").read_text(errors="replace")
    out["wake"] = [line.split(" INFO ", 1)[-1] for line in log.splitlines()
                   if "awake in" in line]
    out["same_answer"] = out["after_sleep"]["text"] == out["live"]["text"]
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
