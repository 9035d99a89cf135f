"""`make bench-team`: the agent-team benchmark (issue 20): one model copy, several sessions.

    python -m bench.team [--llama-server PATH] [--arms slots,workers,llama-server]
        [--main-tokens 6000] [--sub-tokens 3000] [--turns 5] [--tail-tokens 400]
        [--slot-ctx 12288] [--max-tokens 32] [--threads 2] [--flash-attn on] [--ubatch-size N]
        [--model GGUF] [--rounds N] [--peer-defaults]
        [--out DIR]

The trace (synthetic, seeded, built here): a main Claude Code-shaped session (a system prompt
with project notes, tool schemas; each turn appends an assistant tool call, its result and
user text, about `--tail-tokens`), two subagent sessions started once the main session's
second turn is answered (their own system prompt, the same tools; with `--same-kind` one
system prompt for both, as parallel subagents of one kind have), and background requests
(a title after the first turn, a summary between later turns: about 300 tokens, sharing
nothing with a session). Sent as clients send them: each session's turns one after another,
the sessions and the background requests at the same time.

Arms, run one after the other in one invocation on one machine (two cores cannot run them at
once without measuring each other):
- `slots`: prefixgate, 1 worker with 3 slots (`--parallel 3`, `-c 3 x slot-ctx`);
- `one`: prefixgate, 1 worker with 1 slot (`--parallel 1`, `-c slot-ctx`), its RAM tier holding
  the states that give way: whether the slots pay for themselves;
- `workers`: prefixgate, 3 workers of 1 slot (`--workers 3`, `-c slot-ctx`): 3 model copies;
- `llama-server`: llama.cpp's server, `-np 3 -c 3 x slot-ctx`, its defaults otherwise (the
  host-RAM prompt cache included), sent the exact text prefixgate renders for each request
  (prefixgate's `/apply-template`), to `/v1/completions`, so both prefill the same tokens.

Reported per arm: wall time, TTFT p50/p95 per request class (main, subagent, background),
fresh prefill tokens (prefixgate: prompt minus cached; llama-server: its `timings.prompt_n`),
peak RSS of the server's process tree (read from /proc every 0.1 s), and for prefixgate where
each main turn's cache came from (it must never be the disk because of a background request).
The worker's peak RSS less the states it held in RAM at that moment (its RAM tier and the
snapshots queued for their files: what `--cache-ram` budgets, as llama-server's does; and the
states on their way between them and the slots, reported apart), which the worker measures
itself and gives in its /health (`writes`: `peak_unheld_bytes`, read once at the end), is
compared with the model file plus its KV (slot-ctx x 3 tokens x the bytes per token llama.cpp
reports) plus 20%. Nothing asks a worker anything while the trace runs.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from backend.placement import uses_repack
from bench.replay import ROOT, free_port, http_get, stream_request
from bench.synth import TOOL_NAMES, paragraphs, tool_schema, words
from proxy.worker_link import child_env

CLASSES = ("main", "subagent", "background")
SYSTEM_CHARS_PER_TOKEN = 5.2  # bench.synth's prose estimate (SmolLM2's tokenizer)


# --- the trace --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Knobs:
    main_tokens: int = 6000
    sub_tokens: int = 3000
    turns: int = 5
    sub_turns: int = 3
    tail_tokens: int = 400
    max_tokens: int = 32
    seed: int = 0
    same_kind: bool = False  # the two subagents of one kind: one system prompt, other tasks


@dataclass(slots=True)
class Request:
    cls: str  # main | subagent | background
    name: str  # e.g. main#2, sub1#0, title
    body: dict[str, Any]  # an OpenAI chat completions body
    text: str = ""  # what prefixgate renders for it (sent to llama-server)


def _session(rng: random.Random, system: str, tools: list[dict[str, Any]], turns: int,
             tail_tokens: int, max_tokens: int, cls: str, name: str) -> list[Request]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system},
                                  {"role": "user", "content": words(rng, 300).capitalize()}]
    out = []
    for t in range(turns):
        out.append(Request(cls, f"{name}#{t}", {
            "model": "m", "messages": [dict(m) for m in msgs], "tools": tools,
            "tool_choice": "none", "temperature": 0, "max_tokens": max_tokens,
            "stream": True}))
        call = {"id": f"call_{name}_{t}", "type": "function", "function": {
            "name": rng.choice(tools)["function"]["name"],
            "arguments": json.dumps({"target": f"src/{rng.choice(TOOL_NAMES)}.py"})}}
        result_chars = int(tail_tokens * SYSTEM_CHARS_PER_TOKEN * 0.8)
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"],
                  "content": paragraphs(rng, result_chars)},
                 {"role": "user", "content": words(rng, 120).capitalize() + "?"}]
    return out


def make_trace(k: Knobs) -> dict[str, list[Request]]:
    """{"main": [...], "sub1": [...], "sub2": [...], "background": [...]}."""
    rng = random.Random(k.seed)
    tools = [{"type": "function", "function": {
        "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
        for t in (tool_schema(rng, n) for n in TOOL_NAMES[:8])]
    tool_tokens = len(json.dumps(tools)) // 3

    def system(title: str, tokens: int) -> str:
        chars = int(max(tokens - tool_tokens, 200) * SYSTEM_CHARS_PER_TOKEN)
        return f"{title}\n\n" + paragraphs(rng, chars)

    trace = {"main": _session(rng, system("You are Claude Code, a coding agent.", k.main_tokens),
                              tools, k.turns, k.tail_tokens, k.max_tokens, "main", "main")}
    kind = system("You are a subagent (general-purpose): do one task and report.",
                  k.sub_tokens) if k.same_kind else ""
    for i in (1, 2):
        trace[f"sub{i}"] = _session(
            rng, kind or system(f"You are a subagent ({'search' if i == 1 else 'review'}): do "
                                "one task and report.", k.sub_tokens),
            tools, k.sub_turns, k.tail_tokens, k.max_tokens, "subagent", f"sub{i}")
    background = []
    for t in range(k.turns):
        what = "a five-word title" if t == 0 else "a one-line summary"
        background.append(Request("background", f"{'title' if t == 0 else 'summary'}#{t}", {
            "model": "m", "temperature": 0, "max_tokens": 12, "stream": True,
            "messages": [{"role": "system", "content": f"Write {what} for this conversation."},
                         {"role": "user", "content": words(rng, 1200)}]}))
    trace["background"] = background
    return trace


# --- servers ----------------------------------------------------------------------------------


@dataclass
class Server:
    arm: str
    cmd: list[str]
    log_path: Path
    port: int
    root: Path = ROOT  # the prefixgate tree it runs (another checkout: a `--base` arm)
    # read the tree's memory from /proc every 100 ms (`_sample`); the workers' own peaks once,
    # at the end (`worker_peaks`)
    sample_rss: bool = True
    proc: subprocess.Popen[bytes] | None = None
    peak_rss: int = 0
    peak_children_rss: int = 0  # the workers, without the proxy process
    peak_children_anon: int = 0  # of it, their own memory (not pages of a mapped file)
    # the workers' RSS less the states they hold in RAM at that moment (the RAM tier's entries
    # and the snapshots queued for their files: --cache-ram's budget), as the workers measured
    # it (summed over workers: at most what they held beyond their states at any one moment)
    peak_children_unheld: int = 0
    peak_held: int = 0
    peak_moving: int = 0  # of it, states on their way between tiers and slots
    # every sample (its clock, the workers' RSS), written beside the log
    samples: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self, ready_path: str = "/health", timeout_s: float = 600) -> float:
        t0 = time.perf_counter()
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=self.root, stdout=log,
                                     stderr=subprocess.STDOUT, env=child_env(self.root))
        log.close()
        while http_get(f"http://127.0.0.1:{self.port}{ready_path}", 2.0)[0] != 200:
            if self.proc.poll() is not None or time.perf_counter() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"{self.arm} did not start:\n"
                                   + self.log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        if self.sample_rss:
            threading.Thread(target=self._sample, daemon=True).start()
        return time.perf_counter() - t0

    def _sample(self) -> None:
        while not self._stop.is_set() and self.proc is not None:
            (rss, anon), (own, own_anon) = tree_rss(self.proc.pid), tree_rss(self.proc.pid, False)
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_children_rss = max(self.peak_children_rss, rss - own)
            self.peak_children_anon = max(self.peak_children_anon, anon - own_anon)
            self.samples.append((time.time(), rss - own))
            time.sleep(0.1)

    def worker_peaks(self) -> None:
        """The workers' own peaks (`Tiers.measure`), summed over them: before `stop`."""
        if self.proc is None:
            return
        peaks = [worker_writes(p) for p in tree(self.proc.pid) if p != self.proc.pid]
        for attr, k in (("peak_children_unheld", "peak_unheld_bytes"),
                        ("peak_held", "peak_held_bytes"), ("peak_moving", "peak_moving_bytes")):
            setattr(self, attr, sum(int(w.get(k, 0)) for w in peaks))

    def stop(self) -> None:
        self._stop.set()
        if self.samples:  # for a look at what the peak was: `clock rss` per line, MiB
            self.log_path.with_suffix(".rss").write_text("".join(
                f"{time.strftime('%H:%M:%S', time.localtime(t))}.{int(t % 1 * 100):02d} "
                f"{r / 2**20:.0f}\n" for t, r in self.samples))
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def tree(pid: int) -> Iterator[int]:
    """A process and all its descendants (/proc), those that have not ended."""
    todo = [pid]
    while todo:
        p = todo.pop()
        yield p
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]


def tree_cpu(pid: int, children: bool = True) -> float:
    """CPU seconds (user and system) a process and all its descendants have used (/proc); of
    it alone without `children`."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for p in tree(pid) if children else [pid]:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def worker_writes(pid: int) -> dict[str, Any]:
    """A prefixgate worker process's `writes` from its own /health on its socket (its queued
    and moving bytes, and its memory peaks: `backend.worker.tiers.PEAKS`); {} for any other
    process."""
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"worker" not in args or b"--socket" not in args:
            return 0
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(2.0)
        sock.connect(args[args.index(b"--socket") + 1].decode())
        conn = http.client.HTTPConnection("localhost")
        conn.sock = sock
        try:
            conn.request("GET", "/health")
            info = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        return dict(info["writes"])
    return {}


def tree_rss(pid: int, children: bool = True) -> tuple[int, int]:
    """Resident bytes of a process and all its descendants (/proc; of it alone without
    `children`), and of them their own memory (RssAnon): without the pages of mapped files (the
    model's weights where llama.cpp maps them), which the kernel can drop and read again."""
    rss = anon = 0
    for p in tree(pid) if children else [pid]:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{p}/status").read_text()
            m, a = (re.search(f + r":\s+(\d+) kB", status) for f in ("VmRSS", "RssAnon"))
            rss += int(m.group(1)) * 1024 if m else 0
            anon += int(a.group(1)) * 1024 if a else 0
    return rss, anon


# --- one request ------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    cls: str
    name: str
    ttft_s: float
    total_s: float
    prompt: int
    fresh: int  # prompt tokens prefilled (not from any cache)
    source: str  # prefixgate's cache source; "-" for llama-server
    sent_s: float = 0.0  # when it was sent, from the replay's start


def send(port: int, req: Request, llama_server: bool, t0: float) -> Result:
    sent = time.perf_counter() - t0
    if llama_server:
        path, body = "/v1/completions", {
            "prompt": req.text, "max_tokens": req.body["max_tokens"], "temperature": 0,
            "stream": True, "cache_prompt": True}
    else:
        path, body = "/v1/chat/completions", {**req.body,
                                              "stream_options": {"include_usage": True}}
    r = stream_request(port, path, body, 1800)
    if llama_server:
        fresh = int(r.timings.get("prompt_n", 0))
        prompt, source = fresh + int(r.timings.get("cache_n", 0)), "-"
    else:
        u = r.usage or {}
        prompt = int(u.get("prompt_tokens", 0))
        cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        fresh, source = prompt - cached, r.headers.get("x-prefixgate-cache-source", "?")
    return Result(req.cls, req.name, r.ttft_s, r.total_s, prompt, fresh, source, round(sent, 2))


def replay(port: int, trace: dict[str, list[Request]], llama_server: bool) -> list[Result]:
    """The sessions as clients send them (module docstring); results in completion order."""
    results: list[Result] = []
    lock = threading.Lock()
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def go(reqs: list[Request]) -> None:
        try:
            for r in reqs:
                res = send(port, r, llama_server, t0)
                with lock:
                    results.append(res)
        except BaseException as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    def spawn(reqs: list[Request]) -> None:
        t = threading.Thread(target=go, args=(reqs,))
        t.start()
        threads.append(t)

    for t, req in enumerate(trace["main"]):
        go([req])
        spawn([trace["background"][t]])  # between turns, as the client does
        if t == 1:
            spawn(trace["sub1"])
            spawn(trace["sub2"])
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


# --- the run ----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def kv_bytes_per_token(model: str) -> int:
    """An f16 KV cache's bytes per token of this model: K and V of every layer's KV heads."""
    import llama_cpp

    p = llama_cpp.llama_model_default_params()  # mapped, not read (llama.cpp's default)
    p.n_gpu_layers = 0
    m = llama_cpp.llama_model_load_from_file(model.encode(), p)
    try:
        head_dim = llama_cpp.llama_model_n_embd(m) // llama_cpp.llama_model_n_head(m)
        return 2 * 2 * llama_cpp.llama_model_n_layer(m) * llama_cpp.llama_model_n_head_kv(m) \
            * head_dim
    finally:
        llama_cpp.llama_model_free(m)


def run_arm(arm: str, args: argparse.Namespace, trace: dict[str, list[Request]],
            work: Path) -> dict[str, Any]:
    port = free_port()
    log = work / f"{arm}.log"
    slot_ctx = args.slot_ctx
    common = ["--host", "127.0.0.1", "--port", str(port), "--threads", str(args.threads)]
    ub = ["-ub", str(args.ubatch_size)] if args.ubatch_size else []
    if arm == "llama-server":
        own = [] if args.peer_defaults else ["-fa", args.flash_attn, *ub]
        # the weights as prefixgate lays them out here (--repack auto: not on a CPU with AMX,
        # whose kernels crash on some machines, llama-server's included)
        repack = [] if uses_repack("auto") else ["--no-repack"]
        cmd = [args.llama_server, "-m", args.model, "-c", str(3 * slot_ctx), "-np", "3",
               "-t", str(args.threads), *own, *repack, "--host", "127.0.0.1", "--port",
               str(port)]
    else:
        shape = {"slots": ["--parallel", "3", "-c", str(3 * slot_ctx)],
                 "one": ["--parallel", "1", "-c", str(slot_ctx)],
                 "workers": ["--workers", "3", "-c", str(slot_ctx)]}[arm]
        if args.deterministic:
            shape += ["--deterministic", args.deterministic]
        cmd = [sys.executable, "-m", "proxy.cli", "serve", "--model", args.model, *common,
               *shape, "-fa", args.flash_attn, *ub, "--cache-dir", str(work / f"cache-{arm}"),
               "--log-level", "DEBUG" if args.debug else "INFO"]
    srv = Server(arm, cmd, log, port)
    startup_s = srv.start()
    ram_bytes = 0
    try:
        assert srv.proc is not None
        t0, cpu0 = time.perf_counter(), tree_cpu(srv.proc.pid)
        own0 = tree_cpu(srv.proc.pid, False)
        results = replay(port, trace, arm == "llama-server")
        wall = time.perf_counter() - t0
        cpu = tree_cpu(srv.proc.pid) - cpu0
        own = tree_cpu(srv.proc.pid, False) - own0
        if arm != "llama-server":
            ram = json.loads(http_get(f"http://127.0.0.1:{port}/props")[1])["cache_ram"]
            ram_bytes = sum(w.get("used_bytes", 0) for w in ram["workers"].values())
            srv.worker_peaks()
    finally:
        srv.stop()
    by = {c: [r for r in results if r.cls == c] for c in CLASSES}
    out: dict[str, Any] = {
        "arm": arm, "command": " ".join(cmd[1:]),
        "startup_s": round(startup_s, 2), "wall_s": round(wall, 2),
        # CPU seconds its processes used during the replay, and that over all cores' wall
        "cpu_s": round(cpu, 1), "cpu_busy": round(cpu / (wall * (os.cpu_count() or 1)), 3),
        # of it, the server's own process: prefixgate's proxy (its workers are children)
        "cpu_s_proxy": round(own, 1) if arm != "llama-server" else None,
        "fresh_tokens": sum(r.fresh for r in results),
        "prompt_tokens": sum(r.prompt for r in results),
        "peak_rss_mib": round(srv.peak_rss / 2**20, 1),
        "peak_workers_rss_mib": round(srv.peak_children_rss / 2**20, 1),
        "peak_workers_anon_mib": round(srv.peak_children_anon / 2**20, 1),
        "ram_tier_mib_at_end": round(ram_bytes / 2**20, 1),
        "peak_workers_unheld_mib": round(srv.peak_children_unheld / 2**20, 1),
        "peak_held_mib": round(srv.peak_held / 2**20, 1),
        "peak_moving_mib": round(srv.peak_moving / 2**20, 1),
        "ttft": {c: {"p50": round(pct([r.ttft_s for r in rs], 0.5), 3),
                     "p95": round(pct([r.ttft_s for r in rs], 0.95), 3),
                     "mean": round(statistics.fmean([r.ttft_s for r in rs] or [0.0]), 3),
                     "n": len(rs)}
                 for c, rs in by.items()},
        "main_sources": [r.source for r in sorted(by["main"], key=lambda r: r.name)],
        # runs that gave their slot to a short request (policies/preempt.py), from the log
        "preemptions": None if arm == "llama-server" else
        log.read_text(errors="replace").count("preempt: a request of"),
        "requests": [asdict(r) for r in results],
    }
    return out


def render_all(args: argparse.Namespace, trace: dict[str, list[Request]], work: Path) -> None:
    """Every request's prompt text as prefixgate renders it (for llama-server)."""
    port = free_port()
    srv = Server("render", [sys.executable, "-m", "proxy.cli", "serve", "--model", args.model,
                            "--host", "127.0.0.1", "--port", str(port), "-c", "32768",
                            "--cache-dir", str(work / "cache-render"), "--no-exact-check",
                            "--disk-prefix-cache", "off"], work / "render.log", port)
    srv.start()
    try:
        for reqs in trace.values():
            for r in reqs:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("POST", "/apply-template", json.dumps(r.body).encode(),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                r.text = json.loads(resp.read())["prompt"]
                conn.close()
    finally:
        srv.stop()


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# Agent team on one model copy (issue 20)", "",
        f"`{res['command']}` on {res['machine']}, model `{Path(res['model']).name}` "
        f"({res['model_mib']:.0f} MiB), slot context {res['slot_ctx']} tokens, "
        f"{res['requests']} requests ({res['trace']}).", "",
        "| arm | wall s | CPU s (busy; of it the proxy's) | fresh prefill tokens "
        "| TTFT main p50/p95 s | TTFT subagent p50/p95 s | TTFT background p50/p95 s "
        "| peak RSS MiB (all) | peak RSS MiB (workers (of it anonymous)) | RAM tier MiB at end "
        "| main turns' cache |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in res["arms"]:
        t = a["ttft"]
        lines.append(
            f"| {a['arm']} | {a['wall_s']:.1f} | {a.get('cpu_s', 0):.0f} "
            f"({a.get('cpu_busy', 0):.0%}"
            + (f"; {a['cpu_s_proxy']:.1f}" if a.get("cpu_s_proxy") is not None else "")
            + f") | {a['fresh_tokens']} | "
            + " | ".join(f"{t[c]['p50']:.2f} / {t[c]['p95']:.2f}" for c in CLASSES)
            + f" | {a['peak_rss_mib']:.0f} | {a.get('peak_workers_rss_mib', 0):.0f} "
            f"({a.get('peak_workers_anon_mib', 0):.0f}) | "
            f"{a.get('ram_tier_mib_at_end', 0):.0f} | "
            f"{' '.join(a['main_sources'])} |")
    lines += ["", "Ratios against llama-server (same run): " + ", ".join(
        f"{a['arm']} wall x{a['wall_vs_llama_server']:.2f}, fresh tokens "
        f"x{a['fresh_vs_llama_server']:.2f}" for a in res["arms"]
        if "wall_vs_llama_server" in a), ""]
    lines += [f"- {c}" for c in res["checks"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.team", description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="slots,workers,llama-server",
                   help="of slots, one, workers, llama-server")
    p.add_argument("--deterministic", default="", help="prefixgate's --deterministic (default: "
                   "its own default, auto)")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "llama-server"))
    p.add_argument("--model", default="")
    p.add_argument("--main-tokens", type=int, default=6000)
    p.add_argument("--sub-tokens", type=int, default=3000)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--same-kind", action="store_true",
                   help="both subagents of one kind (Claude Code's parallel Task calls): one "
                   "system prompt, started at once with other tasks")
    p.add_argument("--tail-tokens", type=int, default=400)
    p.add_argument("--slot-ctx", type=int, default=12288)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ubatch-size", type=int, default=0, help="-ub for every arm (default: "
                   "each server's own: prefixgate's measured at start on a CPU, llama-server 512)")
    p.add_argument("--flash-attn", default="on", help="on | off | auto, for every arm "
                   "(llama-server's default, auto, turns it on where it can)")
    p.add_argument("--peer-defaults", action="store_true", help="llama-server with its own "
                   "batch and flash attention defaults (-ub 512, -fa auto), whatever "
                   "prefixgate's arms use")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="run the arms this many times, "
                   "reversing their order every other round, and report each round's wall "
                   "ratio and the median (this machine's speed drifts over minutes)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue20"))
    p.add_argument("--debug", action="store_true")
    p.add_argument("--keep-logs", action="store_true",
                   help="copy each arm's server log into OUT/logs (the proxy's request lines "
                        "say where each request waited: ttft_s - prefill_s is the wait for a "
                        "slot)")
    args = p.parse_args(argv)
    if not args.model:
        from proxy.config import default_model
        args.model = default_model()
    arms = args.arms.split(",")
    if "llama-server" in arms and not shutil.which(args.llama_server):
        raise SystemExit(f"llama-server not found ({args.llama_server}); build it from the "
                         "llama-cpp-python sdist (README: benchmarks) and pass --llama-server")
    k = Knobs(args.main_tokens, args.sub_tokens, args.turns, 3, args.tail_tokens,
              args.max_tokens, args.seed, args.same_kind)
    trace = make_trace(k)
    work = Path(tempfile.mkdtemp(prefix="prefixgate-team-"))
    try:
        render_all(args, trace, work)
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(args.rounds):  # the arms in turn, the order reversed every other round
            got: dict[str, dict[str, Any]] = {}
            (work / f"round{r}").mkdir()
            for arm in arms if r % 2 == 0 else arms[::-1]:
                print(f"bench.team: round {r + 1}, {arm} ...", file=sys.stderr, flush=True)
                a = got[arm] = run_arm(arm, args, trace, work / f"round{r}")
                print(f"  wall {a['wall_s']} s, fresh {a['fresh_tokens']}, "
                      f"RSS {a['peak_rss_mib']} MiB, main {a['main_sources']}", file=sys.stderr)
            rounds.append(got)
        results = [rounds[0][arm] for arm in arms]  # the table: the first round
        if args.keep_logs:
            logs = Path(args.out) / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            for f in [*work.glob("round*/*.log"), *work.glob("round*/*.rss")]:
                shutil.copy(f, logs / f"{f.parent.name}-{f.name}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    model_mib = os.path.getsize(args.model) / 2**20
    peer = next((a for a in results if a["arm"] == "llama-server"), None)
    checks = []
    kv = kv_bytes_per_token(args.model) * 3 * args.slot_ctx / 2**20
    for a in results:
        if a["arm"] == "slots":
            a["rss_bound_mib"] = round((model_mib + kv) * 1.2, 1)
            worker = a["peak_workers_unheld_mib"]
            checks.append(f"slots: the worker's peak RSS {a['peak_workers_rss_mib']:.0f} MiB; "
                          f"less the states it held in RAM at the same moment (its RAM tier and "
                          f"the snapshots queued for their files, and the states on their way "
                          f"between tiers and slots, at most {a['peak_held_mib']:.0f} MiB, of it "
                          f"on their way at most {a.get('peak_moving_mib', 0):.0f} MiB), at "
                          f"most {worker:.0f} MiB "
                          f"{'<=' if worker <= a['rss_bound_mib'] else '>'} model + KV of 3 slots "
                          f"+ 20% = {a['rss_bound_mib']:.0f} MiB (the model {model_mib:.0f} MiB,"
                          f" the KV {kv:.0f} MiB); its own memory, without the mapped model "
                          f"file's pages, peaked at {a.get('peak_workers_anon_mib', 0):.0f} MiB")
        if a["arm"] != "llama-server":
            disk = [s for s in a["main_sources"][1:] if s == "disk"]
            checks.append(f"{a['arm']}: main turns restored from disk: {len(disk)} "
                          f"(sources {' '.join(a['main_sources'])}); runs preempted for a "
                          f"short request: {a.get('preemptions')}")
        if peer is not None and a is not peer:
            a["wall_vs_llama_server"] = a["wall_s"] / peer["wall_s"]
            a["fresh_vs_llama_server"] = a["fresh_tokens"] / max(peer["fresh_tokens"], 1)
            checks.append(f"{a['arm']}: wall {a['wall_s']:.1f} s vs llama-server "
                          f"{peer['wall_s']:.1f} s (x{a['wall_vs_llama_server']:.2f})")
            if len(rounds) > 1:
                a["wall_vs_llama_server_rounds"] = [
                    round(rd[a["arm"]]["wall_s"] / rd["llama-server"]["wall_s"], 3)
                    for rd in rounds]
                a["wall_vs_llama_server_median"] = statistics.median(
                    a["wall_vs_llama_server_rounds"])
                checks.append(f"{a['arm']}: wall / llama-server's in each of {len(rounds)} "
                              f"rounds {a['wall_vs_llama_server_rounds']}, median "
                              f"x{a['wall_vs_llama_server_median']:.2f} (walls "
                              + ", ".join(f"{rd[a['arm']]['wall_s']:.1f}/"
                                          f"{rd['llama-server']['wall_s']:.1f} s" for rd in rounds)
                              + ")")
                a["ttft_p95_vs_llama_server_rounds"] = {
                    c: [round(rd[a["arm"]]["ttft"][c]["p95"]
                              / max(rd["llama-server"]["ttft"][c]["p95"], 1e-9), 3)
                        for rd in rounds]
                    for c in a["ttft"] if c in peer["ttft"]}
                checks.append(f"{a['arm']}: TTFT p95 / llama-server's in each round: " + "; ".join(
                    f"{c} {v} (median x{statistics.median(v):.2f})"
                    for c, v in a["ttft_p95_vs_llama_server_rounds"].items()))
                # with a handful of requests per class a p95 is the class's slowest one (main's
                # is its cold first turn): the mean says what the others waited
                a["ttft_mean_vs_llama_server_rounds"] = {
                    c: [round(rd[a["arm"]]["ttft"][c].get("mean", 0.0)
                              / max(rd["llama-server"]["ttft"][c].get("mean", 0.0), 1e-9), 3)
                        for rd in rounds]
                    for c in a["ttft"] if c in peer["ttft"]}
                checks.append(f"{a['arm']}: TTFT mean / llama-server's in each round: " + "; ".join(
                    f"{c} {v} (median x{statistics.median(v):.2f})"
                    for c, v in a["ttft_mean_vs_llama_server_rounds"].items()))
    res = {"command": "python -m bench.team " + " ".join(argv or sys.argv[1:]),
           "machine": f"{os.cpu_count()} cores", "model": args.model, "model_mib": model_mib,
           "slot_ctx": args.slot_ctx, "requests": sum(len(v) for v in trace.values()),
           "trace": f"main {k.main_tokens} tokens x {k.turns} turns of +{k.tail_tokens}, "
                    f"2 subagents {k.sub_tokens} tokens x {k.sub_turns} turns, "
                    f"{len(trace['background'])} background requests, max_tokens "
                    f"{k.max_tokens}",
           "arms": results, "checks": checks,
           # every round's requests per arm (the table reads the first round's)
           "rounds": [{arm: rd[arm]["requests"] for arm in arms} for rd in rounds]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "team.json").write_text(json.dumps(res, indent=1))
    (out / "team.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
