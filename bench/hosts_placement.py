"""Where each request goes when most carry no session header (issue 44): `python -m
bench.hosts_placement` (`make bench-hosts`). An agent team's requests over 2 prefixgate hosts,
placed by HAProxy's hash of the session header, or by NVIDIA Dynamo's KV router from the hosts'
KV events, beside one host.

The trace: the team's system prompt and tools (bench.team's generator), shared by a main
session (its header sent), subagents and new sessions (no header: a subagent's own requests,
a new conversation with the team's prompt), their turns interleaved as clients send them; the
new sessions start halfway. Arms, in one run, nothing killed:

- `one host`: the single-host figures;
- `2 hosts`: HAProxy (deploy/haproxy.cfg): a request without a header goes wherever the hash
  of nothing puts it;
- `2 hosts + shared tier`: the same, both hosts on a real redis-server, a miss pulled from it;
- `2 hosts + dynamo`: `prefixgate front` asks Dynamo's `KvRouter` (the hosts' events relayed
  by `prefixgate dynamo-worker`, file discovery on loopback), with the shared tier.

Per arm: fresh prefill tokens (prompt minus reused), time to first token p50/p95, the requests
without a header and their fresh tokens, where the reuse came from, and how many requests each
host took. The target: the Dynamo arm's fresh prefill tokens within 1.1x one host's.

`--concurrent`: the sessions at the same time, each its turns one after another (a new session
starts once the main session has sent its turn where it starts), as a team's clients send them:
where the router's load term meets its overlap term, and the wall time tells whether a second
host carried load. Written to `placement-concurrent.md` and `.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.hosts import Proc, pct, send, serve
from bench.replay import ROOT, free_port, http_get
from bench.synth import TOOL_NAMES, paragraphs, tool_schema, words
from bench.team import SYSTEM_CHARS_PER_TOKEN, Knobs, Request

ARMS = ("one host", "2 hosts", "2 hosts + shared tier", "2 hosts + dynamo")
BLOCK = 16


def conversation(rng: random.Random, system: str, tools: list[dict[str, Any]], turns: int,
                 k: Knobs, name: str) -> list[Request]:
    """One session's requests, each the last plus a tool call, its result and a question (as
    bench.team's sessions)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system},
                                  {"role": "user", "content": words(rng, 300).capitalize()}]
    out = []
    for t in range(turns):
        out.append(Request("main", f"{name}#{t}", {
            "model": "m", "messages": [dict(m) for m in msgs], "tools": tools,
            "tool_choice": "none", "temperature": 0, "max_tokens": k.max_tokens}))
        call = {"id": f"call_{name}_{t}", "type": "function", "function": {
            "name": rng.choice(tools)["function"]["name"],
            "arguments": json.dumps({"target": f"src/{rng.choice(TOOL_NAMES)}.py"})}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": paragraphs(
                     rng, int(k.tail_tokens * SYSTEM_CHARS_PER_TOKEN * 0.8))},
                 {"role": "user", "content": words(rng, 120).capitalize() + "?"}]
    return out


def make_trace(k: Knobs, new_sessions: int) -> list[tuple[str, bool, int, Request]]:
    """(session, sends its header, first turn index, request), in the order they are sent."""
    rng = random.Random(k.seed)
    tools = [{"type": "function", "function": {
        "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
        for t in (tool_schema(rng, n) for n in TOOL_NAMES[:8])]
    chars = int(max(k.main_tokens - len(json.dumps(tools)) // 3, 200) * SYSTEM_CHARS_PER_TOKEN)
    system = "You are Claude Code, a coding agent.\n\n" + paragraphs(rng, chars)
    sessions: dict[str, tuple[bool, int, list[Request]]] = {
        "main": (True, 0, conversation(rng, system, tools, k.turns, k, "main"))}
    for i in (1, 2):  # subagents: the team's prompt and tools, their own task, no header
        sessions[f"sub{i}"] = (False, 0, conversation(rng, system, tools, k.sub_turns, k,
                                                      f"sub{i}"))
    for i in range(new_sessions):  # new conversations halfway, no header
        sessions[f"new{i}"] = (False, k.turns // 2, conversation(
            rng, system, tools, k.sub_turns, k, f"new{i}"))
    order = []
    for t in range(k.turns + k.sub_turns):
        for name, (header, start, reqs) in sessions.items():
            if 0 <= t - start < len(reqs):
                order.append((name, header, t, reqs[t - start]))
    return order


def dynamo_env(discovery: Path) -> dict[str, str]:
    """Dynamo's runtime on loopback, file discovery."""
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(discovery),
            "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
            "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_LOG": "warn"}


def wait_hosts(port: int, n: int, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while f'"hosts": {n}' not in http_get(f"http://127.0.0.1:{port}/health", 2)[1]:
        if time.time() > deadline:
            raise SystemExit(f"the front on port {port} did not see {n} hosts")
        time.sleep(0.3)


def replay(port: int, trace: list[tuple[str, bool, int, Request]], names: dict[str, str],
           concurrent: bool) -> list[dict[str, Any]]:
    """Send the trace: in its order, or each session in a thread of its own (module docstring);
    the results in the order they ended."""
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(session: str, header: bool, turn: int, req: Request) -> None:
        r = send(port, session, req.body, header)
        r.update(turn=turn, header=header, host=names.get(r["host"], r["host"]))
        with lock:
            results.append(r)

    if not concurrent:
        for item in trace:
            one(*item)
        return results
    sessions: dict[str, list[tuple[str, bool, int, Request]]] = {}
    for item in trace:
        sessions.setdefault(item[0], []).append(item)
    main_sent = {t: threading.Event() for _, _, t, _ in sessions["main"]}

    def run(items: list[tuple[str, bool, int, Request]]) -> None:
        try:
            if items[0][0] != "main" and items[0][2] in main_sent:
                main_sent[items[0][2]].wait(600)
            for item in items:
                if item[0] == "main":
                    main_sent[item[2]].set()
                one(*item)
        except BaseException:
            for ev in main_sent.values():  # no session waits on a main session that failed
                ev.set()
            raise

    with ThreadPoolExecutor(len(sessions)) as pool:  # the first error raised after them all
        list(pool.map(run, sessions.values()))
    return results


def run_arm(arm: str, trace: list[tuple[str, bool, int, Request]], work: Path,
            threads: int, concurrent: bool = False) -> dict[str, Any]:
    procs: list[Proc] = []
    tag = arm.replace(" ", "-").replace("+", "")
    try:
        extra: tuple[str, ...] = ()
        if "shared tier" in arm or "dynamo" in arm:
            rport = free_port()
            procs.append(Proc(["redis-server", "--port", str(rport), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], work / f"{tag}-redis.log"))
            time.sleep(0.5)
            extra = ("--shared-tier", f"redis://127.0.0.1:{rport}/0")
        if arm == "one host":
            h1, port = serve(work, f"{tag}-h1", threads, *extra)
            procs.append(h1)
            names: dict[str, str] = {}
        elif "dynamo" in arm:
            env = dynamo_env(work / f"{tag}-discovery")
            names, ev = {}, [free_port(), free_port()]
            for i, e in enumerate(ev, 1):
                h, p = serve(work, f"{tag}-h{i}", threads, *extra, "--kv-events",
                             f"tcp://127.0.0.1:{e}", "--kv-block-size", str(BLOCK))
                procs.append(h)
                names[f"http://127.0.0.1:{p}"] = f"host{i}"
                procs.append(Proc([sys.executable, "-m", "proxy.cli", "dynamo-worker",
                                   "--host-url", f"http://127.0.0.1:{p}", "--kv-events",
                                   f"tcp://127.0.0.1:{e}", "--kv-block-size", str(BLOCK)],
                                  work / f"{tag}-dyn{i}.log", env))
            port = free_port()
            procs.append(Proc([sys.executable, "-m", "proxy.cli", "front", "--port", str(port),
                               "--n-ctx", "16384", "--kv-block-size", str(BLOCK)],
                              work / f"{tag}-front.log", env))
            wait_hosts(port, 2)
        else:
            h1, p1 = serve(work, f"{tag}-h1", threads, *extra)
            h2, p2 = serve(work, f"{tag}-h2", threads, *extra)
            procs += [h1, h2]
            names = {}
            port = free_port()
            haproxy = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
            procs.append(Proc([str(haproxy), "-db", "-f", str(ROOT / "deploy" / "haproxy.cfg")],
                              work / f"{tag}-haproxy.log",
                              {"PG_LISTEN": f"127.0.0.1:{port}", "PG_HOST1": f"127.0.0.1:{p1}",
                               "PG_HOST2": f"127.0.0.1:{p2}", "PG_CHECK_INTERVAL": "500ms"}))
            time.sleep(2)
        t0 = time.perf_counter()
        results = replay(port, trace, names, concurrent)
        return {**summarize(arm, results), "wall_s": round(time.perf_counter() - t0, 1)}
    finally:
        for p in reversed(procs):
            p.stop()


def summarize(arm: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    bare = [r for r in results if not r["header"]]
    return {
        "arm": arm, "requests": len(results),
        "fresh_tokens": sum(r["fresh"] for r in results),
        "prompt_tokens": sum(r["prompt"] for r in results),
        "ttft_p50_s": round(statistics.median(r["ttft_s"] for r in results), 3),
        "ttft_p95_s": round(pct([r["ttft_s"] for r in results], 0.95), 3),
        "no_header_requests": len(bare), "no_header_fresh_tokens": sum(r["fresh"] for r in bare),
        "sources": dict(Counter(r["source"] for r in results)),
        "hosts": dict(Counter(r["host"] for r in results)),
        "turns": results,
    }


def markdown(res: dict[str, Any]) -> str:
    one = next((a for a in res["arms"] if a["arm"] == "one host"), None)
    lines = [f"# Placement without session headers: {res['requests']} requests, the team's "
             "prompt and tools shared", "",
             f"Model `{res['model']}`, {res['threads']} threads per host, on one machine "
             "(the hosts share its cores). Times in seconds.", "",
             f"Sessions {'at the same time' if res.get('concurrent') else 'one request at a time'}"
             ".", "",
             "| arm | requests | wall s | fresh prefill tokens | vs one host | TTFT p50 | "
             "TTFT p95 | no-header requests | their fresh tokens | sources | per host |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for a in res["arms"]:
        ratio = f"{a['fresh_tokens'] / one['fresh_tokens']:.2f}x" \
            if one and one["fresh_tokens"] else "-"
        lines.append(
            f"| {a['arm']} | {a['requests']} | {a.get('wall_s', '-')} | {a['fresh_tokens']} | "
            f"{ratio} | "
            f"{a['ttft_p50_s']} | {a['ttft_p95_s']} | {a['no_header_requests']} | "
            f"{a['no_header_fresh_tokens']} | {json.dumps(a['sources'])} | "
            f"{json.dumps(a['hosts'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.hosts_placement")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--main-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new-sessions", type=int, default=2,
                   help="sessions that start halfway, the team's prompt and tools, no header")
    p.add_argument("--arms", default="", help=f"a comma-separated subset of: {', '.join(ARMS)}")
    p.add_argument("--concurrent", action="store_true",
                   help="the sessions at the same time (module docstring)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue44"))
    a = p.parse_args(argv)
    out = Path(a.out)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()] or list(ARMS)
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"bench.hosts_placement: unknown arms {sorted(unknown)}; give some "
                         f"of {', '.join(ARMS)}")
    k = Knobs(main_tokens=a.main_tokens, sub_tokens=a.main_tokens, turns=a.turns,
              sub_turns=max(a.turns // 2, 1), tail_tokens=300, max_tokens=8)
    trace = make_trace(k, a.new_sessions)
    with tempfile.TemporaryDirectory(prefix="prefixgate-placement-") as tmp:
        results = [run_arm(arm, trace, Path(tmp), a.threads, a.concurrent) for arm in arms]
    from proxy.config import default_model

    res = {"model": Path(default_model()).name, "threads": a.threads,
           "requests": len(trace), "concurrent": a.concurrent, "arms": results}
    out.mkdir(parents=True, exist_ok=True)
    stem = "placement-concurrent" if a.concurrent else "placement"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
