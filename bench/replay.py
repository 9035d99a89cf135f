"""`make bench`: replay a trace against prefixgate under several cache arms and against a peer.

    python -m bench.replay --trace FILE [--arms off,full,auto:30,...] [--turns N] [--max-tokens M]

Arms:

- `off`, `full`, `auto:N`, `N`: a prefixgate started by the harness with that
  `--disk-prefix-cache` (`off` = live reuse only), one worker, a fresh cache directory per arm.
- `peer`: llama-cpp-python's own OpenAI server (`python -m llama_cpp.server`) on the same model
  file, n_ctx and threads, its prompt cache on (`--cache true --cache_type disk`). It is sent the
  exact prompt text prefixgate renders, through its `/v1/completions`, so both servers prefill the
  same tokens (its chat handler would drop the tool schemas that prefixgate writes into the
  system prompt for templates without tool support). Its cached and fresh token counts are read
  from its own log (`Llama.generate: N prefix-match hit, remaining M prompt tokens to eval`).
- any arm with `+restart` (e.g. `auto:30+restart`, `off+restart`, `peer+restart`): the server
  and its workers are stopped and started again before every turn (the cache directory kept),
  so only a disk cache can help.

Each row is one stateless, streaming request, sent to prefixgate as a client sends it: an
Anthropic row (the traces in shared/traces/, `bench.synth`) to `/v1/messages` as it is, an OpenAI
row to `/v1/chat/completions`; the oracle and the simulator render it through the same parser.
The arms run side by side: every server stays up,
and for each turn every arm sends that turn (the order rotated per turn), so noise from other
work on the machine spreads over all arms alike. Time to first token (TTFT) is the time to the
first streamed content; the request's `tool_choice` is set to `none` by default (`--tool-choice
keep` to send the trace's), which leaves the prompt unchanged but stops prefixgate holding text
back while it looks for a `<tool_call>`, so TTFT measures the prefill on both servers.

Per turn: prompt tokens, cached tokens and source (prefixgate's usage and
`X-Prefixgate-Cache-Source`; the peer's log), fresh prefill tokens, TTFT, total time, decode
tokens/s, the oracle's fresh tokens and the simulator's prediction. Per arm: wall time (requests
plus server starts), request time, fresh prefill tokens, mean hit ratio, TTFT p50/p95, the oracle
(`bench.oracle`) and the excess over it, prefixgate's cache metrics, and total time and TTFT as
ratios against the peer of the same restart mode. Written to bench/results/ as JSON, a markdown
table and a PNG plot.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from proxy.worker_link import child_env

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "light_tool_schema_38.jsonl"
DEFAULT_ARMS = ("off,full,auto:2,auto:8,auto:30,1000,"
                "off+restart,auto:30+restart,full+restart,peer,peer+restart")
START_TIMEOUT_S = 240.0


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Arm:
    name: str  # as given, e.g. "auto:30+restart"
    server: str  # "prefixgate" | "peer"
    scope: str  # --disk-prefix-cache for prefixgate; "" for the peer
    restart: bool

    @property
    def peer_name(self) -> str:
        return "peer+restart" if self.restart else "peer"


def parse_arm(spec: str) -> Arm:
    spec = spec.strip()
    base, _, flag = spec.partition("+")
    if flag not in ("", "restart"):
        raise SystemExit(f"invalid arm {spec!r}: the only suffix is +restart")
    if base == "peer":
        return Arm(spec, "peer", "", bool(flag))
    from policies.scope import parse_scope

    try:
        parse_scope(base)
    except ValueError as e:
        raise SystemExit(f"invalid arm {spec!r}: {e}") from None
    return Arm(spec, "prefixgate", base, bool(flag))


# --- servers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError:
        return 0, ""


@dataclass(slots=True)
class Settings:
    model: str
    n_ctx: int
    threads: int
    code_root: Path = ROOT  # where the proxy's packages are imported from


def snapshot_code(dest: Path, source: str = "worktree") -> Path:
    """A copy of the proxy's packages, so that every (re)start in a long run runs the same code
    even while the checkout changes: the working tree's, or a commit's (`source` = a rev)."""
    pkgs = ("proxy", "backend", "policies")
    if source == "worktree":
        for pkg in pkgs:
            shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        return dest
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", source, *pkgs], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


@dataclass
class ServerProc:
    """One server process of an arm, restartable with the same cache directory."""

    arm: Arm
    settings: Settings
    cache_dir: Path
    log_path: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    startup_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # summed over restarts
    _log_offset: int = 0

    def command(self) -> list[str]:
        s = self.settings
        if self.arm.server == "peer":
            return [sys.executable, "-m", "llama_cpp.server", "--model", s.model,
                    "--n_ctx", str(s.n_ctx), "--n_threads", str(s.threads),
                    "--n_threads_batch", str(s.threads), "--cache", "true",
                    "--cache_type", "disk", "--host", "127.0.0.1", "--port", str(self.port)]
        return [sys.executable, "-m", "proxy.cli", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--model", s.model, "--n-ctx", str(s.n_ctx),
                "--threads", str(s.threads), "--workers", "1",
                "--cache-dir", str(self.cache_dir), "--disk-prefix-cache", self.arm.scope]

    @property
    def ready_path(self) -> str:
        return "/v1/models" if self.arm.server == "peer" else "/health"

    def start(self) -> None:
        t0 = time.perf_counter()
        self.port = free_port()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        code = self.settings.code_root
        env = child_env(code)
        # the peer's disk cache lives in .cache/llama_cache under its working directory
        self.proc = subprocess.Popen(self.command(), cwd=self.cache_dir if self.arm.server ==
                                     "peer" else code, stdout=log, stderr=subprocess.STDOUT,
                                     env=env)
        log.close()
        deadline = time.time() + START_TIMEOUT_S
        url = f"http://127.0.0.1:{self.port}{self.ready_path}"
        while http_get(url, 2.0)[0] != 200:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.arm.name}: server exited {self.proc.returncode}:\n"
                                 + self.log_tail())
            if time.time() > deadline:
                self.stop()
                raise BenchError(f"{self.arm.name}: not ready in {START_TIMEOUT_S:.0f} s:\n"
                                 + self.log_tail())
            time.sleep(0.1)
        self._log_offset = self.log_path.stat().st_size
        self.starts += 1
        self.startup_s += time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None and self.arm.server == "prefixgate":
            self.collect_metrics()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, n_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def new_log(self) -> str:
        """Log written since the last call (the peer's per-request lines)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            data = f.read()
        self._log_offset += len(data)
        return data.decode(errors="replace")

    def collect_metrics(self) -> None:
        status, text = http_get(f"http://127.0.0.1:{self.port}/metrics")
        if status != 200:
            return
        for name, value in parse_prometheus(text).items():
            if name.startswith(("prefixgate_cache_", "prefixgate_restore_seconds_",
                                "prefixgate_save_seconds_", "prefixgate_cached_tokens_total",
                                "prefixgate_prefilled_tokens_total")) and \
                    not name.endswith("_bucket") and "_created" not in name:
                if name in ("prefixgate_cache_bytes", "prefixgate_cache_entries",
                            "prefixgate_cache_budget_bytes"):
                    self.metrics[name] = value  # gauges: the last value
                else:
                    self.metrics[name] = self.metrics.get(name, 0.0) + value


_PROM_LINE = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$")


def parse_prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = _PROM_LINE.match(line)
        if m and not line.startswith("#"):
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


# --- one request ----------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    ttft_s: float
    total_s: float
    completion_tokens: int
    usage: dict[str, Any] | None
    headers: dict[str, str]
    timings: dict[str, Any] = field(default_factory=dict)  # llama-server's, where it sends them


def _openai_event(ev: dict[str, Any], got: dict[str, Any]) -> bool:
    """One OpenAI stream chunk into `got` (usage, and llama-server's timings); whether it
    carried content."""
    if ev.get("usage"):
        got["usage"] = ev["usage"]
    if ev.get("timings"):
        got["timings"] = ev["timings"]
    return any((ch.get("delta") or {}).get("content") or (ch.get("delta") or {}).get("tool_calls")
               or ch.get("text") for ch in ev.get("choices") or ())


def _anthropic_event(ev: dict[str, Any], got: dict[str, Any]) -> bool:
    """One Anthropic stream event into `got` (usage in OpenAI's terms); whether it carried
    content."""
    u = (ev.get("message") or {}).get("usage") or ev.get("usage")
    if u:
        cached = int(u.get("cache_read_input_tokens") or 0)
        prompt = int(u.get("input_tokens", 0)) + cached + \
            int(u.get("cache_creation_input_tokens") or 0)
        got["usage"] = {"prompt_tokens": prompt, "completion_tokens": u.get("output_tokens", 0),
                        "prompt_tokens_details": {"cached_tokens": cached}}
    return ev.get("type") == "content_block_delta"


def stream_request(port: int, path: str, body: dict[str, Any], timeout_s: float) -> Reply:
    """POST a streaming request (OpenAI or Anthropic SSE, by path); time to the first content
    chunk and to the end."""
    on_event = _anthropic_event if path.startswith("/v1/messages") else _openai_event
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        t0 = time.perf_counter()
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"HTTP {resp.status} from {path}: {resp.read()[:2000]!r}")
        headers = {k.lower(): v for k, v in resp.getheaders()}
        ttft: float | None = None
        got: dict[str, Any] = {}
        chunks = 0
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise BenchError(f"error event from {path}: {ev['error']}")
            if on_event(ev, got):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if ev.get("type") == "message_stop":
                break
        total = time.perf_counter() - t0
        usage = got.get("usage")
    finally:
        conn.close()
    n_gen = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage \
        else chunks
    return Reply(ttft if ttft is not None else total, total, n_gen, usage, headers,
                 got.get("timings") or {})


_PEER_PREFIX = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt")
_PEER_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


def peer_cache_stats(log: str, n_prompt: int) -> tuple[int, str]:
    """(cached tokens, source) of one peer request, from its log lines."""
    m = _PEER_PREFIX.search(log)
    cached = int(m.group(1)) if m else 0
    if m is None:
        ev = _PEER_EVAL.search(log)
        cached = max(n_prompt - int(ev.group(1)), 0) if ev else 0
    if not cached:
        return 0, "none"
    return cached, "disk" if "Llama._create_completion: cache hit" in log else "live"


# --- the run --------------------------------------------------------------------------------


def request_body(arm: Arm, body: dict[str, Any], kind: str, text: str, max_tokens: int,
                 tool_choice: str) -> tuple[str, dict[str, Any]]:
    common = {"max_tokens": max_tokens, "temperature": body.get("temperature", 0.0),
              "stream": True}
    if arm.server == "peer":
        return "/v1/completions", {"prompt": text, **common}
    if kind == "anthropic":
        out = {**body, **common}
        if tool_choice != "keep" and out.get("tools"):
            out["tool_choice"] = {"type": tool_choice}
        return "/v1/messages", out
    out = {**body, **common, "stream_options": {"include_usage": True}}
    if tool_choice != "keep" and out.get("tools"):
        out["tool_choice"] = tool_choice
    return "/v1/chat/completions", out


def run_turn(srv: ServerProc, turn: int, body: dict[str, Any], kind: str, text: str,
             n_prompt: int, args: argparse.Namespace) -> dict[str, Any]:
    arm = srv.arm
    if arm.restart and turn > 0:
        srv.restart()
    path, req = request_body(arm, body, kind, text, args.max_tokens, args.tool_choice)
    if arm.server == "peer":
        srv.new_log()
    r = stream_request(srv.port, path, req, args.request_timeout_s)
    if arm.server == "peer":
        time.sleep(0.05)  # let the last log lines land
        cached, source = peer_cache_stats(srv.new_log(), n_prompt)
        prompt = n_prompt
    else:
        assert r.usage is not None, "prefixgate sent no usage chunk"
        prompt = int(r.usage["prompt_tokens"])
        cached = int(r.usage["prompt_tokens_details"]["cached_tokens"])
        source = r.headers.get("x-prefixgate-cache-source", "?")
        assert int(r.headers.get("x-prefixgate-cached-tokens", cached)) == cached
    decode_s = r.total_s - r.ttft_s
    return {"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached, "source": source,
            "fresh_tokens": prompt - cached, "ttft_s": r.ttft_s, "total_s": r.total_s,
            "completion_tokens": r.completion_tokens,
            "decode_tok_s": (r.completion_tokens - 1) / decode_s
            if r.completion_tokens > 1 and decode_s > 0 else None}


def summarize(arm: Arm, srv: ServerProc, turns: list[dict[str, Any]], oracle: Any,
              predicted: list[int] | None) -> dict[str, Any]:
    ttft = np.array([t["ttft_s"] for t in turns])
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    fresh = sum(t["fresh_tokens"] for t in turns)
    requests_s = sum(t["total_s"] for t in turns)
    rates = [t["decode_tok_s"] for t in turns if t["decode_tok_s"]]
    ratios = [t["cached_tokens"] / t["prompt_tokens"] for t in turns if t["prompt_tokens"]]
    out: dict[str, Any] = {
        "arm": arm.name, "server": arm.server, "scope": arm.scope, "restart": arm.restart,
        "turns": len(turns), "wall_s": requests_s + srv.startup_s, "requests_s": requests_s,
        "startup_s": srv.startup_s, "starts": srv.starts,
        "prompt_tokens": prompt, "cached_tokens": cached, "fresh_tokens": fresh,
        "mean_hit_ratio": float(np.mean(ratios)) if ratios else 0.0,
        "token_hit_ratio": cached / prompt if prompt else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p95_s": float(np.percentile(ttft, 95)),
        "ttft_mean_s": float(ttft.mean()),
        "decode_tok_s": float(np.mean(rates)) if rates else None,
        "completion_tokens": sum(t["completion_tokens"] for t in turns),
        "oracle_fresh_tokens": oracle.total_fresh,
        "excess_over_oracle_tokens": fresh - oracle.total_fresh,
        "oracle_mean_hit_ratio": oracle.mean_hit_ratio,
        "sources": {s: sum(1 for t in turns if t["source"] == s)
                    for s in sorted({t["source"] for t in turns})},
    }
    if predicted is not None:
        out["predicted_fresh_tokens"] = sum(predicted)
        out["predicted_turns_matched"] = sum(
            1 for t, p in zip(turns, predicted, strict=True) if t["fresh_tokens"] == p)
    if srv.metrics:
        out["metrics"] = srv.metrics
    return out


def add_peer_ratios(summaries: list[dict[str, Any]]) -> None:
    by_name = {s["arm"]: s for s in summaries}
    for s in summaries:
        if s["server"] != "prefixgate":
            continue
        peer = by_name.get("peer+restart" if s["restart"] else "peer") or by_name.get("peer")
        if peer is None:
            continue
        s["vs_peer"] = {
            "peer_arm": peer["arm"],
            "requests_time_ratio": s["requests_s"] / peer["requests_s"],
            "ttft_p50_ratio": s["ttft_p50_s"] / peer["ttft_p50_s"],
            "ttft_mean_ratio": s["ttft_mean_s"] / peer["ttft_mean_s"],
            "fresh_tokens_ratio": s["fresh_tokens"] / peer["fresh_tokens"]
            if peer["fresh_tokens"] else None,
        }


def checks(summaries: list[dict[str, Any]]) -> list[str]:
    """The issue's two claims about --restart-per-turn, stated as measured."""
    by = {s["arm"]: s for s in summaries}
    lines = []
    a = by.get("auto:30+restart")
    if a:
        rel = a["mean_hit_ratio"] / a["oracle_mean_hit_ratio"] if a["oracle_mean_hit_ratio"] \
            else 0.0
        ok = rel >= 0.9
        lines.append(f"- auto:30 with a restart per turn: mean hit ratio "
                     f"{a['mean_hit_ratio']:.1%} vs the oracle's {a['oracle_mean_hit_ratio']:.1%}"
                     f" ({rel:.0%} of it): **{'within' if ok else 'NOT within'} 10%**.")
    o = by.get("off+restart")
    if o:
        cold = o["cached_tokens"] == 0
        lines.append(f"- live reuse only (off) with a restart per turn: {o['cached_tokens']} "
                     f"cached tokens, {o['fresh_tokens']} of {o['prompt_tokens']} prompt tokens "
                     f"prefilled: **{'collapses to cold prefill' if cold else 'does NOT collapse'}"
                     "**.")
    return lines


def environment(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except OSError:
            return ""

    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import llama_cpp

    worktree = args.code == "worktree"
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "commit": git("rev-parse", "HEAD" if worktree else args.code),
            "uncommitted": git("status", "--porcelain", "--untracked-files=no").splitlines()
            if worktree else [],
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {cpu}",
            "python": platform.python_version(), "llama_cpp_python": llama_cpp.__version__,
            "model": Path(settings.model).name, "n_ctx": settings.n_ctx,
            "threads": settings.threads, "max_tokens": args.max_tokens,
            "tool_choice": args.tool_choice}


def replay(args: argparse.Namespace) -> dict[str, Any]:
    from bench.oracle import compute_oracle
    from bench.prompts import load_builder, render
    from bench.simulate import SimPrompt, simulate
    from bench.trace import load_rows, to_openai
    from policies.prefix import Batching
    from proxy.config import Config

    arms = [parse_arm(s) for s in args.arms.split(",") if s.strip()]
    builder = load_builder(args.model)
    settings = Settings(Config(model=args.model).model_path, args.n_ctx, args.threads)
    rows = load_rows(args.trace, args.format, args.turns)
    if args.tool_blocks == "text":  # tool blocks as text: converted to OpenAI bodies
        rows = [("openai", to_openai(row, kind, "text")) for kind, row in rows]
    bodies = [row for _, row in rows]
    rendered = [render(builder, row, kind) for kind, row in rows]
    too_long = [i for i, r in enumerate(rendered) if len(r.ids) + args.max_tokens > args.n_ctx]
    if too_long:
        raise SystemExit(f"turns {too_long[:5]} do not fit --n-ctx {args.n_ctx} with "
                         f"--max-tokens {args.max_tokens}; raise --n-ctx or cut --turns")
    oracle = compute_oracle([r.ids for r in rendered])
    prompts = [SimPrompt(r.ids, r.boundaries, r.message_starts) for r in rendered]
    predicted = {a.name: [t.fresh for t in simulate(prompts, a.scope,
                                                    "restart" if a.restart else "live",
                                                    memory=args.memory,
                                                    batching=Batching(
                                                        Config().batch,
                                                        builder.tok.eog_ids)).turns]
                 for a in arms if a.server == "prefixgate"}
    load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="prefixgate-bench-"))
    settings.code_root = snapshot_code(work / "code", args.code)
    env = environment(args, settings)  # the commit the snapshot was taken from
    print(f"{len(bodies)} turns, {oracle.total_prompt} prompt tokens, oracle "
          f"{oracle.total_fresh} fresh; arms {', '.join(a.name for a in arms)}; work dir {work}",
          file=sys.stderr)
    servers = [ServerProc(a, settings, work / f"arm{i}-cache", work / f"arm{i}.log")
               for i, a in enumerate(arms)]
    per_turn: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
    t_start = time.perf_counter()
    stopped = ""
    try:
        for srv in servers:
            srv.start()
        for turn, ((kind, body), r) in enumerate(zip(rows, rendered, strict=True)):
            elapsed_min = (time.perf_counter() - t_start) / 60
            if args.time_budget_min and turn and elapsed_min > args.time_budget_min:
                stopped = (f"Stopped after {turn} of {len(bodies)} turns: the time budget of "
                           f"{args.time_budget_min:g} min was spent ({elapsed_min:.0f} min).")
                print(stopped, file=sys.stderr)
                break
            k = turn % len(servers)
            for srv in servers[k:] + servers[:k]:  # rotate who goes first
                row = run_turn(srv, turn, body, kind, r.text, len(r.ids), args)
                row["oracle_fresh_tokens"] = oracle.fresh_tokens[turn]
                if srv.arm.name in predicted:
                    row["predicted_fresh_tokens"] = predicted[srv.arm.name][turn]
                per_turn[srv.arm.name].append(row)
            print(f"turn {turn + 1}/{len(bodies)}: {len(r.ids)} tokens; fresh "
                  + ", ".join(f"{a}={rows[-1]['fresh_tokens']}" for a, rows in per_turn.items())
                  + f" ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    except KeyboardInterrupt:
        done = min(len(rows) for rows in per_turn.values())
        if not done:
            raise
        stopped = f"Interrupted after {done} of {len(bodies)} turns."
        print(stopped, file=sys.stderr)
    finally:
        for srv in servers:
            srv.stop()
    n_done = min(len(rows) for rows in per_turn.values())
    if n_done < len(bodies):
        oracle = compute_oracle([r.ids for r in rendered[:n_done]])
        for rows in per_turn.values():
            del rows[n_done:]
        predicted = {a: p[:n_done] for a, p in predicted.items()}
    summaries = [summarize(srv.arm, srv, per_turn[srv.arm.name], oracle,
                           predicted.get(srv.arm.name)) for srv in servers]
    add_peer_ratios(summaries)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    env["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")  # the end of the run
    env["load_avg_at_start"] = load_at_start
    env["load_avg_at_end"] = os.getloadavg()
    return {"trace": Path(args.trace).name, "turns": n_done, "trace_rows": len(bodies),
            "stopped": stopped, "environment": env,
            "total_wall_s": time.perf_counter() - t_start,
            "oracle": {"prompt_tokens": oracle.total_prompt, "fresh_tokens": oracle.total_fresh,
                       "mean_hit_ratio": oracle.mean_hit_ratio,
                       "per_turn_fresh": list(oracle.fresh_tokens)},
            "arms": summaries, "checks": checks(summaries), "per_turn": per_turn}


# --- reports --------------------------------------------------------------------------------


def _ratio(s: dict[str, Any], key: str) -> str:
    v = s.get("vs_peer", {}).get(key)
    return f"{v:.2f}x" if v is not None else "-"


def _short(commit: str) -> str:
    return commit[:12] if re.fullmatch(r"[0-9a-f]{40}", commit) else commit


def markdown(res: dict[str, Any], note: str = "") -> str:
    env = res["environment"]
    o = res["oracle"]
    lines = [
        f"# Replay: {res['trace']}",
        "",
        f"{res['turns']} turns, {o['prompt_tokens']} prompt tokens in all; the oracle (fewest "
        f"fresh tokens any prefix cache could prefill) is {o['fresh_tokens']} tokens, a mean "
        f"hit ratio of {o['mean_hit_ratio']:.1%}.",
        "",
        f"Machine: {env['machine']}; model {env['model']}, n_ctx {env['n_ctx']}, "
        f"{env['threads']} threads, max_tokens {env['max_tokens']}, tool_choice "
        f"{env['tool_choice']}; llama-cpp-python {env['llama_cpp_python']}; commit "
        f"{_short(env['commit'])}{' plus uncommitted changes' if env['uncommitted'] else ''}; "
        f"{env['date']}; total {res['total_wall_s'] / 60:.0f} min. Arms ran side by side "
        "(each turn sent to every arm in rotation), so machine noise hits all arms alike; "
        "times are noisy on a shared 2-core machine, compare the ratios.",
    ]
    if res.get("stopped") or res["turns"] < res.get("trace_rows", res["turns"]):
        lines += ["", f"**Cut: the first {res['turns']} of the trace's {res['trace_rows']} "
                  f"turns.** {res.get('stopped', '')}"]
    la0, la1 = env.get("load_avg_at_start"), env.get("load_avg_at_end")
    if la0 and la1:
        lines += ["", f"Load average (1, 5, 15 min) at the start {tuple(round(x, 1) for x in la0)}"
                  f", at the end {tuple(round(x, 1) for x in la1)}, on {os.cpu_count()} cores: "
                  "other people's tests shared the machine."]
    if res.get("command"):
        lines += ["", f"Command: `{res['command']}`"]
    if note:
        lines += ["", note]
    lines += [
        "",
        "| arm | wall s | requests s | fresh prefill tokens | excess over oracle | "
        "mean hit ratio | TTFT p50 s | TTFT p95 s | decode tok/s | requests time vs peer | "
        "TTFT p50 vs peer | simulator: fresh (turns exact) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["arms"]:
        pred = (f"{s['predicted_fresh_tokens']} ({s['predicted_turns_matched']}/{s['turns']})"
                if "predicted_fresh_tokens" in s else "-")
        dec = f"{s['decode_tok_s']:.1f}" if s["decode_tok_s"] else "-"
        lines.append(
            f"| {s['arm']} | {s['wall_s']:.1f} | {s['requests_s']:.1f} | {s['fresh_tokens']} | "
            f"{s['excess_over_oracle_tokens']:+} | {s['mean_hit_ratio']:.1%} | "
            f"{s['ttft_p50_s']:.3f} | {s['ttft_p95_s']:.3f} | {dec} | "
            f"{_ratio(s, 'requests_time_ratio')} | {_ratio(s, 'ttft_p50_ratio')} | {pred} |")
    lines.append(f"| oracle | | | {o['fresh_tokens']} | +0 | {o['mean_hit_ratio']:.1%} | | | "
                 "| | | |")
    lines += ["", "Ratios are prefixgate / peer with the same restart mode (below 1: prefixgate "
              "is faster). wall s = request time + server starts (restart arms start once per "
              "turn). Mean hit ratio = mean over turns of cached / prompt tokens. The simulator "
              "column is `prefixgate simulate`'s prediction for the arm (mode live, or restart "
              "for +restart arms) and how many turns it got exactly."]
    if res["checks"]:
        lines += ["", "## The restart claims", "", *res["checks"]]
    names = [s["arm"] for s in res["arms"]]
    lines += ["", "## Fresh prefill tokens per turn", "", "<details>", "",
              "| turn | prompt | oracle | " + " | ".join(names) + " |",
              "|---:|---:|---:|" + "---:|" * len(names)]
    for i in range(res["turns"]):
        rows = [res["per_turn"][n][i] for n in names]
        lines.append(f"| {i + 1} | {rows[0]['prompt_tokens']} | {o['per_turn_fresh'][i]} | "
                     + " | ".join(f"{r['fresh_tokens']} ({r['source'][0]})" for r in rows)
                     + " |")
    lines += ["", "Source: l = live KV kept, d = restored from disk, n = none.", "",
              "</details>", ""]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # `make bench` installs it; the tables are written either way
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = res["arms"]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 13))
    for s in arms:
        rows = res["per_turn"][s["arm"]]
        ax1.plot([r["turn"] + 1 for r in rows], [r["ttft_s"] for r in rows], marker=".",
                 linestyle="--" if s["restart"] else "-", label=s["arm"])
    ax1.set_yscale("log")
    ax1.set_xlabel("turn")
    ax1.set_ylabel("time to first token, s (log)")
    ax1.set_title(f"{res['trace']}: TTFT per turn")
    ax1.legend(fontsize=8, ncol=3)
    names = [s["arm"] for s in arms]
    colors = ["tab:gray" if s["server"] == "peer" else "tab:blue" for s in arms]
    ax2.bar(names, [s["fresh_tokens"] for s in arms], color=colors)
    ax2.axhline(res["oracle"]["fresh_tokens"], color="tab:red", linestyle=":",
                label=f"oracle ({res['oracle']['fresh_tokens']})")
    ax2.set_ylabel("fresh prefill tokens, all turns")
    ax2.legend()
    ax2.tick_params(axis="x", rotation=30)
    ax3.bar(names, [s["requests_s"] for s in arms], color=colors, label="requests")
    ax3.bar(names, [s["startup_s"] if s["restart"] else 0 for s in arms],
            bottom=[s["requests_s"] for s in arms], color="tab:orange", alpha=0.5,
            label="server restarts")
    ax3.set_ylabel("seconds")
    ax3.legend()
    ax3.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the servers are stopped on the way out


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated (default {DEFAULT_ARMS})")
    p.add_argument("--turns", type=int, default=None, help="replay the first N rows only")
    p.add_argument("--max-tokens", type=int, default=16, help="per request (the trace's "
                   "max_tokens is replaced; default 16 keeps decode short on a CPU)")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="", help="GGUF path (default: the embedded SmolLM2)")
    p.add_argument("--memory", default="plain", choices=["plain", "window", "recurrent"],
                   help="the model's memory, for the simulator column (window: Gemma 3, "
                   "gpt-oss; recurrent: Qwen3.5, hybrids)")
    p.add_argument("--format", default="auto", choices=["auto", "anthropic", "openai"])
    p.add_argument("--tool-blocks", default="openai", choices=["openai", "text"])
    p.add_argument("--tool-choice", default="none", choices=["none", "auto", "keep"])
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="", help="results file stem (default replay-<trace>)")
    p.add_argument("--note", default="", help="a line added to the markdown (e.g. why turns "
                   "were cut)")
    p.add_argument("--time-budget-min", type=float, default=0.0,
                   help="start no new turn after this many minutes; report the turns done")
    p.add_argument("--code", default="worktree", help="the proxy code the servers run: "
                   "worktree (default) or a git rev such as HEAD")
    p.add_argument("--keep-work", action="store_true", help="keep cache dirs and server logs")
    p.add_argument("--from-json", default="", help="only rewrite the markdown and the plot "
                   "from an earlier run's JSON")
    args = p.parse_args(argv)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
    else:
        res = replay(args)
        res["command"] = "python -m bench.replay " + " ".join(
            sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"replay-{Path(args.trace).stem}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res, args.note)
    (out / f"{stem}.md").write_text(md)
    plot(res, out / f"{stem}.png")
    print(md)
    print(f"wrote {out / stem}.json, .md and .png", file=sys.stderr)


if __name__ == "__main__":
    main()
