"""`make bench-spec`: speculative decoding on answers that copy their context (issue 47), prefixgate
and llama-server side by side, with and without drafts.

    python -m bench.spec [--llama-server PATH] [--spec-types ngram-simple,ngram-mod]
        [--workloads edit,patch,log] [--n-predict 256] [--threads 2] [--model GGUF]
        [--draft-model GGUF] [-ngl N] [--arms ...] [--out DIR]

Workloads (built here, the same text every time), each an agent's answer that repeats what it
was given, greedy: `edit` (a 42-line file in the prompt, "rewrite it renaming one function":
an edit that copies the file), `patch` (the same file, "write the unified diff"), `log` (a
quoted log, "quote every ERROR line, then explain"). Each is rendered once by prefixgate's
`/apply-template` and sent as that text to `/completion` of both servers, so both evaluate the
same tokens, in the same batches: prefixgate's cold run ends a prefill batch at the prompt's last
message end (so that the next turn reuses its state exactly), where llama-server fills its
batches to `-ub`, and a batch of other rows computes other bits, so on the same tokens the two
greedy answers part (on this model within a few tokens). Each llama-server arm therefore first
prefills the prompt up to prefixgate's last batch edge (`n_predict` 0, `cache_prompt`), then
asks the whole prompt, which evaluates the rest as one batch, and runs with prefixgate's batch
size (`-ub`): both compute the same bits, and with the same drafts give the same answer.

Arms, one after the other, each on a fresh server for each workload (llama.cpp's ngram-mod keeps
its table across requests, prefixgate's drafts are each request's own: a fresh server drafts the
same for both):
- `prefixgate`: `--spec-type none`;
- `prefixgate:TYPE`: `--spec-type TYPE`, the stop rule on (`--spec-stop auto`, the default);
- `prefixgate:TYPE:all`: `--spec-type TYPE --spec-stop off`: every draft verified, the same
  drafts as llama-server's;
- `llama-server`, `llama-server:TYPE`: llama.cpp's server built from the same llama.cpp
  (`--no-repack` on a CPU with AMX, as prefixgate lays the weights out there).
The type `draft-simple` drafts with `--draft-model` (`-md`; the model itself by default).

Reported per arm and workload: decode tokens/s (`timings.predicted_n` over `predicted_ms`, the
same measure on both; an answer that ended at the end-of-generation token counts it, as
llama-server's `predicted_n` does), drafted and accepted tokens (`draft_n`,
`draft_n_accepted`), the verify cost prefixgate measured at start (a verify of 1 + k rows over
one step, per k) and while serving, and the answer compared with prefixgate's without drafts
and with llama-server's arm of the same type. Printed as markdown; the JSON goes to --out.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.placement import uses_repack
from bench.replay import free_port, http_get
from bench.team import Server

FUNCS = ("parse_line", "load_rows", "merge_counts", "render_table", "main")


def source_file() -> str:
    """A 42-line Python module."""
    lines = ['"""Count words per level in a log file and print a table."""', "",
             "import sys", "from collections import Counter", ""]
    lines += ["", "def parse_line(line):", "    parts = line.strip().split(' ', 2)",
              "    if len(parts) < 3:", "        return None",
              "    stamp, level, message = parts", "    return stamp, level.upper(), message", ""]
    lines += ["", "def load_rows(path):", "    rows = []", "    with open(path) as f:",
              "        for line in f:", "            row = parse_line(line)",
              "            if row is not None:", "                rows.append(row)",
              "    return rows", ""]
    lines += ["", "def merge_counts(rows):", "    counts = Counter()",
              "    for _, level, message in rows:",
              "        counts[level] += len(message.split())", "    return counts", ""]
    lines += ["", "def render_table(counts):",
              "    for level, n in sorted(counts.items()):",
              "        print(f'{level:<8} {n:>6}')", ""]
    lines += ["", "def main():", "    render_table(merge_counts(load_rows(sys.argv[1])))", "",
              "", "if __name__ == '__main__':", "    main()"]
    assert len(lines) == 42, len(lines)
    return "\n".join(lines) + "\n"


def log_text() -> str:
    levels = ("INFO", "INFO", "WARN", "INFO", "ERROR")
    return "\n".join(f"2025-06-0{1 + i % 9}T10:{i:02d}:00 {levels[i % 5]} worker {i % 3}: "
                     f"{'request timed out after 30 s' if i % 5 == 4 else 'served 12 requests'}"
                     for i in range(40)) + "\n"


def workloads() -> dict[str, list[dict[str, str]]]:
    src = source_file()
    system = {"role": "system", "content": "You are a careful coding agent. Answer with code "
                                           "only, no commentary."}
    return {
        "edit": [system, {"role": "user", "content": f"Here is app.py:\n\n```python\n{src}```"
                                                     "\n\nRewrite the whole file, renaming the "
                                                     "function parse_line to parse_entry "
                                                     "everywhere."}],
        "patch": [system, {"role": "user", "content": f"Here is app.py:\n\n```python\n{src}"
                                                      "```\n\nWrite a unified diff that renames "
                                                      "load_rows to read_rows."}],
        "log": [{"role": "user", "content": f"Here is a service log:\n\n```\n{log_text()}```\n"
                                            "\nQuote every ERROR line exactly, then explain "
                                            "what failed."}],
    }


def post_json(port: int, path: str, body: dict[str, Any], timeout_s: float = 1800) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type":
                                                                "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


@dataclass(frozen=True)
class Prompt:
    text: str  # as prefixgate renders it
    ids: list[int]  # its tokens
    edge: int  # prefixgate's last prefill batch edge before its end (0: none)


def render(args: argparse.Namespace, work: Path) -> tuple[dict[str, Prompt], int]:
    """Each workload's prompt, and prefixgate's batch size on this machine."""
    from bench.simulate import model_ends
    from policies.prefix import Batching

    port = free_port()
    srv = Server("render", [sys.executable, "-m", "proxy.cli", "serve", "--model", args.model,
                            "--host", "127.0.0.1", "--port", str(port), "-c", str(args.ctx),
                            "--cache-dir", str(work / "cache-render"), "--no-exact-check",
                            "--disk-prefix-cache", "off"], work / "render.log", port)
    srv.start()
    try:
        batch = int(json.loads(http_get(f"http://127.0.0.1:{port}/props")[1])["ubatch_size"])
        batching = Batching(batch, model_ends(args.model))
        out = {}
        for name, msgs in workloads().items():
            text = post_json(port, "/apply-template", {"messages": msgs})["prompt"]
            ids = post_json(port, "/tokenize", {"content": text, "add_special": True})["tokens"]
            edge = batching.edges(ids).floor(len(ids) - 1)
            out[name] = Prompt(text, ids, edge)
        return out, batch
    finally:
        srv.stop()


def command(arm: str, args: argparse.Namespace, port: int, work: Path) -> list[str]:
    server, _, rest = arm.partition(":")
    kind, _, every = rest.partition(":")
    model = ["-md", args.draft_model] if kind == "draft-simple" else []
    if server == "llama-server":
        spec = ["--spec-type", kind, *model] if kind else []
        repack = [] if uses_repack("auto") else ["--no-repack"]
        return [args.llama_server, "-m", args.model, "-c", str(args.ctx), "-np", "1",
                "-t", str(args.threads), "-ub", str(args.batch), *spec, *repack, *gpu(args, kind),
                "--host", "127.0.0.1", "--port", str(port)]
    spec = ["--spec-type", kind or "none", *model] + (["--spec-stop", "off"] if every else [])
    return [sys.executable, "-m", "proxy.cli", "serve", "--model", args.model, "--host",
            "127.0.0.1", "--port", str(port), "-c", str(args.ctx), "--threads",
            str(args.threads), *spec, *gpu(args, kind), "--cache-dir",
            str(work / f"cache-{arm}"), "--disk-prefix-cache", "off"]


def gpu(args: argparse.Namespace, kind: str) -> list[str]:
    """The layers offloaded, the model's and the draft model's (`-ngl`, `-ngld`), the same
    option for both servers."""
    if not args.gpu_layers:
        return []
    return ["-ngl", str(args.gpu_layers)] + (["-ngld", str(args.gpu_layers)]
                                               if kind == "draft-simple" else [])


def run(arm: str, workload: str, prompt: Prompt, args: argparse.Namespace, work: Path
        ) -> dict[str, Any]:
    port = free_port()
    srv = Server(arm, command(arm, args, port, work), work / f"{arm}-{workload}.log", port,
                 sample_rss=False)
    srv.start()
    try:
        if arm.startswith("llama-server"):  # prefixgate's batches (module docstring)
            if prompt.edge:
                post_json(port, "/completion", {"prompt": prompt.ids[: prompt.edge],
                                            "n_predict": 0, "cache_prompt": True})
            r = post_json(port, "/completion", {"prompt": prompt.ids, "n_predict": args.n_predict,
                                            "temperature": 0, "cache_prompt": True})
            if r["timings"]["prompt_n"] != len(prompt.ids) - prompt.edge:
                raise RuntimeError(f"{arm}: llama-server evaluated {r['timings']['prompt_n']} "
                                   f"of {len(prompt.ids)} prompt tokens after priming "
                                   f"{prompt.edge}: not prefixgate's batches")
        else:
            r = post_json(port, "/completion", {"prompt": prompt.text, "n_predict": args.n_predict,
                                            "temperature": 0, "cache_prompt": False})
        props = {} if arm.startswith("llama-server") else json.loads(
            http_get(f"http://127.0.0.1:{port}/props")[1])
    finally:
        srv.stop()
    t = r["timings"]
    spec = props.get("speculation", {}).get("workers", {}).get("0", {})
    # llama-server counts the end-of-generation token it sampled among the predicted ones,
    # prefixgate (as OpenAI's usage) does not: counted here for both, over the same interval
    tokens = t["predicted_n"] + (not arm.startswith("llama-server") and r["stop_type"] == "eos")
    return {"arm": arm, "workload": workload, "tokens": tokens,
            "decode_tps": tokens / t["predicted_ms"] * 1000 if t["predicted_ms"] else 0.0,
            "drafted": t.get("draft_n", 0),
            "accepted": t.get("draft_n_accepted", 0), "content": r["content"],
            "cost_at_start": spec.get("cost_at_start"),
            "cost_running": spec.get("cost_running"), "note": spec.get("note", "")}


def _ratio(cost: dict[str, Any] | None, k: int) -> str:
    """A verify of 1 + k rows over one step, from prefixgate's measure."""
    if not cost:
        return "-"
    rows, ratios = cost["rows"], cost["ratios"]
    for (r0, t0), (r1, t1) in zip(zip(rows, ratios, strict=True),
                                  zip(rows[1:], ratios[1:], strict=True), strict=False):
        if r0 <= 1 + k <= r1:
            return f"{t0 + (t1 - t0) * (1 + k - r0) / (r1 - r0):.2f}x"
    return "-"


def peer_of(arm: str) -> str:
    """The llama-server arm with the same drafts: `prefixgate:TYPE:all` drafts as llama-server's
    `--spec-type TYPE` does (every draft verified); `prefixgate` against plain llama-server."""
    spec = arm.partition(":")[2].partition(":")[0]
    return f"llama-server:{spec}" if spec else "llama-server"


def collapse(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload and arm over the rounds: the median decode rate, and
    `x_peer`, the median of the rounds' ratios to the llama-server arm with the same drafts
    (each measured in the same round); the first round's answer and counts."""
    rate = {(r["workload"], r["arm"], r.get("round", 0)): r["decode_tps"] for r in rows}
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["workload"], r["arm"])
        if key in out:
            continue
        same = [x for x in rows if (x["workload"], x["arm"]) == key]
        ratios = sorted(x["decode_tps"] / rate[(x["workload"], peer_of(x["arm"]),
                                                 x.get("round", 0))] for x in same
                        if rate.get((x["workload"], peer_of(x["arm"]), x.get("round", 0))))
        out[key] = {**r, "decode_tps": statistics.median(x["decode_tps"] for x in same),
                    "x_peer": ratios, "rounds": len(same)}
    return list(out.values())


def markdown(rows: list[dict[str, Any]]) -> str:
    rows = collapse(rows)
    base = {r["workload"]: r for r in rows if r["arm"] == "prefixgate"}
    peers = {(r["workload"], r["arm"].removeprefix("llama-server")): r for r in rows
             if r["arm"].startswith("llama-server")}
    out = ["| workload | arm | decode tok/s | vs its own none | x llama-server, same drafts "
           "(median of rounds, least-most) | drafted | accepted | verify 4 / 8 drafts (start) "
           "| answer vs none | answer vs llama-server |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        own = base.get(r["workload"]) if not r["arm"].startswith("llama-server") else \
            peers.get((r["workload"], ""))
        spec = r["arm"].partition(":")[2].partition(":")[0]
        peer = peers.get((r["workload"], f":{spec}" if spec else ""))
        vs_own = f"{r['decode_tps'] / own['decode_tps']:.2f}x" if own and own["decode_tps"] \
            else "-"
        same_none = "-" if base.get(r["workload"]) is None else (
            "same" if r["content"] == base[r["workload"]]["content"] else "differs")
        same_peer = "-" if peer is None or peer is r else (
            "same" if r["content"] == peer["content"] else "differs")
        x = r["x_peer"]
        x_peer = "-" if r["arm"].startswith("llama-server") or not x else (
            f"{statistics.median(x):.3f}x ({x[0]:.2f}-{x[-1]:.2f})")
        out.append(f"| {r['workload']} | {r['arm']} | {r['decode_tps']:.1f} | {vs_own} | "
                   f"{x_peer} | {r['drafted']} | {r['accepted']} | "
                   f"{_ratio(r['cost_at_start'], 4)} / {_ratio(r['cost_at_start'], 8)} | "
                   f"{same_none} | {same_peer} |")
    notes = sorted({r["note"] for r in rows if r["note"]})
    return "\n".join(out + [""] + [f"- {n}" for n in notes])


def main(argv: list[str] | None = None) -> None:
    from proxy.config import default_model

    p = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "llama-server"))
    p.add_argument("--spec-types", default="ngram-simple,ngram-mod")
    p.add_argument("--workloads", default="edit,patch,log")
    p.add_argument("--arms", default="", help="comma-separated (default: every arm)")
    p.add_argument("--n-predict", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--model", default="")
    p.add_argument("-ngl", "--gpu-layers", type=int, default=0,
                   help="layers offloaded to the GPU, both servers' (and the draft model's)")
    p.add_argument("--draft-model", default="", help="a draft model of the model's vocabulary "
                   "(for the type draft-simple; default: the model itself)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args.model = args.model or default_model()
    args.draft_model = args.draft_model or args.model
    types = [t for t in args.spec_types.split(",") if t]
    arms = args.arms.split(",") if args.arms else [
        "prefixgate", *(f"prefixgate:{t}" for t in types),
        *(f"prefixgate:{t}:all" for t in types), "llama-server",
        *(f"llama-server:{t}" for t in types)]
    if any(a.startswith("llama-server") for a in arms) and not shutil.which(args.llama_server):
        raise SystemExit(f"llama-server not found ({args.llama_server}); `make bench-spec` "
                         "builds it from the llama-cpp-python sdist, or pass --llama-server")
    work = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    prompts, args.batch = render(args, work)
    rows = []
    for r in range(args.rounds):  # each round every arm once, in an order that turns
        for w in args.workloads.split(","):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                rows.append({**run(arm, w, prompts[w], args, work), "round": r})
    print(markdown(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.json").write_text(json.dumps({"model": args.model, "threads": args.threads,
                                                   "n_predict": args.n_predict,
                                                   "rounds": args.rounds, "rows": rows},
                                                  indent=1))
        (out / "spec.md").write_text(markdown(rows) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
