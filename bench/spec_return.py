"""A session comes back to the one slot after another took it, with a draft model (issue 47):
what its turn costs when the draft model's state came back from RAM with the model's, side by
side with llama-server, whose prompt cache keeps both too. `--restart`: it comes back after the
server restarted instead, its states from disk (the draft model's as the twin of the model's).

    python -m bench.spec_return [--llama-server PATH] [--base REV_TREE] [--rounds 2]
        [--lines 60] [--max-tokens 64] [--model GGUF] [--draft-model GGUF] [--restart]
        [--out FILE]

Each arm on a fresh server, `-np 1`, `--cache-ram 4096`, `--spec-type draft-simple -md` (the
model itself by default), every draft verified (`--spec-stop off` on prefixgate, as llama-server
drafts), greedy, not streamed, three chat requests in a row: `a1` (a file of `--lines` lines to
edit), `b` (another session's prompt, which takes the slot: a1's state gives way into RAM),
`a2` (a1, its answer and a new request: the returning turn). Reported per arm: each request's
wall seconds, and for prefixgate where the draft model's prompt came from at each job's first
draft (`/props` speculation: kept, restored with the RAM entry, copied from another slot,
prefilled). `--base`: a checkout of another prefixgate revision as one more arm (`base`).

`--restart`: four steps, `a1`, `a2` (the session's second turn, live), the server stopped and
started again on the same cache directory (prefixgate's disk tier on; llama-server keeps its
prompt cache in RAM only), and `a3` (a2, its answer and a new request): the returning turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.replay import ROOT, free_port, http_get
from bench.spec import post_json
from bench.team import Server


def file_text(lines: int) -> str:
    return "\n".join(f"def step_{i}(state, value):\n    total = state.count + value * {i}\n"
                     f"    return total if total > {i * 3} else state.count"
                     for i in range(lines // 3))


def command(arm: str, args: argparse.Namespace, port: int, work: Path) -> list[str]:
    common = ["-c", "16384", "-np", "1", "-md", args.draft_model, "--port", str(port)]
    if arm == "llama-server":
        return [args.llama_server, "-m", args.model, *common, "-t", str(args.threads),
                "--spec-type", "draft-simple", "--cache-ram", "4096", "--host", "127.0.0.1"]
    return [sys.executable, "-m", "proxy.cli", "serve", "--model", args.model, *common,
            "--threads", str(args.threads), "--spec-type", "draft-simple", "--spec-stop", "off",
            "--cache-ram", "4096", "--host", "127.0.0.1", "--cache-dir",
            str(work / (f"cache-{arm}-{args.round}" if args.restart else f"cache-{arm}")),
            *([] if args.restart else ["--disk-prefix-cache", "off"])]


def run(arm: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    port = free_port()
    root = Path(args.base) if arm == "base" else ROOT
    args.round = getattr(args, "round", 0) + 1
    cmd = command(arm, args, port, work)
    srv = Server(arm, cmd, work / f"{arm}.log", port, root=root, sample_rss=False)
    srv.start()
    try:
        a = [{"role": "system", "content": "You edit code."},
             {"role": "user", "content": f"File app.py:\n{file_text(args.lines)}\n\n"
                                         "Rename step_3 to advance and print the whole file."}]
        b = [{"role": "system", "content": "You summarize."},
             {"role": "user", "content": "Summarize this log:\n" + file_text(args.lines)[::-1]}]
        out: dict[str, Any] = {"arm": arm}
        turns = {"a1": a}
        for name in ("a1", "a2", "b", "a3") if args.restart else ("a1", "b", "a2"):
            if name == "b" and args.restart:  # the server again, on the same cache directory
                srv.stop()
                srv = Server(arm, cmd, work / f"{arm}-again.log", port, root=root,
                             sample_rss=False)
                out[name] = {"s": round(srv.start(), 3)}
                continue
            if name in ("a2", "a3"):
                last = "a2" if name == "a3" else "a1"
                turns[name] = [*turns[last], {"role": "assistant", "content": out[last]["text"]},
                               {"role": "user", "content": f"Now rename step_{3 + int(name[1])} "
                                                           "too."}]
            msgs = b if name == "b" else turns[name]
            t = time.perf_counter()
            r = post_json(port, "/v1/chat/completions", {"messages": msgs, "temperature": 0,
                                                     "max_tokens": args.max_tokens})
            out[name] = {"s": round(time.perf_counter() - t, 3),
                         "prompt": r["usage"]["prompt_tokens"],
                         "text": r["choices"][0]["message"]["content"]}
        if arm != "llama-server":
            props = json.loads(http_get(f"http://127.0.0.1:{port}/props")[1])
            spec = props.get("speculation", {}).get("workers", {})
            out["draft_prompt"] = next(iter(spec.values()), {}).get("draft_model_prompt")
        return out
    finally:
        srv.stop()


def markdown(rows: list[dict[str, Any]], cmd: str) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    back = "a3" if "a3" in rows[0] else "a2"  # the returning turn
    steps = ("a1", "a2", "b", "a3") if back == "a3" else ("a1", "b", "a2")
    med = {a: {k: statistics.median(r[k]["s"] for r in rows if r["arm"] == a)
               for k in steps} for a in arms}
    heads = {"a1": "a1 (first turn)", "a2": "a2 (second turn)",
             "b": "restart (up again)" if back == "a3" else "b (another session)"}
    out = [f"`{cmd}`, {len(rows) // len(arms)} round(s), each arm on a fresh server; wall "
           "seconds, the median of the rounds.", "",
           "| arm | " + " | ".join(heads[k] for k in steps if k != back)
           + f" | **{back} (the return)** | {back} prompt tokens | the draft model's prompt "
           "tokens (kept / restored / copied / prefilled, every turn since the server started) "
           f"| {back} answer as prefixgate's |",
           "|---|" + "---|" * (len(steps) + 3)]
    ref = next((r[back]["text"] for r in rows if r["arm"] == "prefixgate"), None)
    for a in arms:
        last = [r for r in rows if r["arm"] == a][-1]
        d = last.get("draft_prompt") or {}
        dp = " / ".join(str(d.get(k, "-")) for k in ("kept", "restored", "copied", "prefilled")) \
            if d else "-"
        same = "-" if ref is None or a == "prefixgate" else \
            "same" if last[back]["text"] == ref else "differs"
        out.append(f"| {a} | " + " | ".join(f"{med[a][k]:.2f}" for k in steps if k != back)
                   + f" | **{med[a][back]:.2f}** | {last[back]['prompt']} | {dp} | {same} |")
    return "\n".join(out)


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The options this bench and bench.spec_share share (their arms, model and rounds)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""))
    p.add_argument("--base", default="", help="another prefixgate checkout, as the arm `base`")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--lines", type=int, default=180)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="")
    p.add_argument("--draft-model", default="")
    p.add_argument("--out", default="")
    return p


def run_arms(args: argparse.Namespace, prog: str, argv: list[str] | None,
             run_one: Callable[[str, argparse.Namespace, Path], dict[str, Any]],
             table: Callable[[list[dict[str, Any]], str], str]) -> None:
    """Each arm (prefixgate, `--base`, llama-server) on a fresh server, round after round; the
    table printed, the rows written to `--out`."""
    from proxy.config import default_model

    args.model = args.model or default_model()
    args.draft_model = args.draft_model or args.model
    arms = ["prefixgate", *(["base"] if args.base else []),
            *(["llama-server"] if args.llama_server else [])]
    work = Path(tempfile.mkdtemp(prefix=f"{prog.replace('.', '-')}-"))
    rows = [run_one(arm, args, work) for _ in range(args.rounds) for arm in arms]
    print(table(rows, f"python -m {prog} " + " ".join(argv or sys.argv[1:])))
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = parser("python -m bench.spec_return", __doc__)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--restart", action="store_true",
                   help="the session returns after a restart, not after another session")
    run_arms(p.parse_args(argv), "bench.spec_return", argv, run, markdown)


if __name__ == "__main__":
    main()
