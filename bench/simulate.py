"""`prefixgate simulate`: the cache policies replayed on token ids, without a model.

    prefixgate simulate --trace FILE --policies auto:2,auto:8,auto:30,full,1000

Each row of the trace is rendered and tokenized exactly as the proxy does (`bench.prompts`), then
fed, in order, to one simulated proxy with one worker. The decisions are the proxy's own: the
simulator looks the prompt up as `proxy.cache.DiskCache.lookup` does (a `policies.radix` tree of
the stored entries' token ids) on an in-memory disk, calls the real `policies.decide.decide` with
its `policies.ring.Ring`, then applies the worker's rules to the plan (backend/worker.py: keep
the live prefix, restore the first planned entry longer than it, reuse capped at the plan's
`keep_max`; a save point behind the reuse is snapshotted from the KV held). Every planned save
succeeds and nothing is evicted (the default budget is 20 GiB).

Modes (what survives between two requests):

- `restart` (the default, pessimistic): proxy and worker restart before every request, so only
  what is on disk survives: the index, the state files and the ring of recent prompts (persisted
  in the index); the live KV is lost.
- `live`: one long-lived proxy with one worker: the worker's live KV holds the previous
  request's prompt (interleaved sessions take it from each other).
- `live:N`: as `live` with N slots (`--parallel N`), each holding the last prompt it ran; the
  proxy's router (`policies.router.choose_slot`, every slot idle: requests are replayed one at
  a time) picks the slot. Sessions taking turns keep their own live KV, as on a server with a
  slot per session, which hides from `live` what a restart loses.

Per policy and mode: requests, hits (requests with any cached token) and disk hits, tokens cached
per hit, hit rate, cached and fresh tokens, the mean per-turn hit ratio, the oracle's fresh tokens
(`bench.oracle`) and the excess over it, and the snapshots written (count and tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend import keys
from bench.oracle import Oracle, compute_oracle
from policies.decide import RESTORE_CANDIDATES, Facts, Hit, Stored, WorkerFacts, decide
from policies.plan import CacheKnobs, MessageStart
from policies.prefix import Batching, common_prefix_len
from policies.radix import RadixTree
from policies.ring import Ring
from policies.router import SlotView, choose_slot
from policies.scope import format_scope, parse_scope
from proxy.config import Config
from proxy.gateway import RING_CAPACITY

MODES = ("restart", "live")
DEFAULT_POLICIES = "auto:2,auto:8,auto:30,full,1000"
_SALT = bytes(16)  # the simulator's keys only need to tell token prefixes apart
_TENANT = ""


@dataclass(frozen=True, slots=True)
class SimPrompt:
    """What the policies see of a rendered prompt (`proxy.template.Rendered` has these fields)."""

    ids: tuple[int, ...]
    boundaries: tuple[int, ...]
    message_starts: tuple[tuple[int, str], ...]


@dataclass(frozen=True, slots=True)
class SimTurn:
    n_prompt: int
    cached: int  # tokens not prefilled
    source: str  # "disk" | "live" | "none"
    disk_n: int  # longest stored prefix found
    live_n: int  # live prefix the worker held
    saves: tuple[tuple[int, str], ...]  # (n_tokens, reason) snapshotted in this prefill

    @property
    def fresh(self) -> int:
        return self.n_prompt - self.cached


class Simulator:
    """One proxy and one worker, as far as the cache decisions go."""

    def __init__(self, policy: str, knobs: CacheKnobs | None = None,
                 memory: str = "plain", batching: Batching | None = None, slots: int = 1
                 ) -> None:
        self.batching = batching or Batching()  # the worker's batches: reuse at their edges
        self.knobs = knobs or CacheKnobs()
        # the worker's memory (backend.engine.Memory): a recurrent state is never reused live
        # after generating; a recurrent state or a window cannot cut a restored snapshot back
        self.memory = memory
        self.scope = parse_scope(policy)
        self.policy = format_scope(self.scope)
        self.disk = RadixTree()  # the stored entries' token ids: survive restarts
        self.ring_log: list[tuple[int, ...]] = []  # the persisted ring, oldest first
        self.ring = Ring(RING_CAPACITY)
        self.live: list[tuple[int, ...]] = [()] * max(slots, 1)  # per slot, its live KV
        self.used = [0] * len(self.live)  # per slot, the turn it last ran
        self.turn = 0

    def restart(self) -> None:
        """The proxy and worker processes restart: the live KV is gone; the new proxy reads the
        ring back from the index."""
        self.ring = Ring(RING_CAPACITY)
        for ids in self.ring_log:
            self.ring.push(_TENANT, ids)
        self.live = [()] * len(self.live)

    def lookup(self, facts: Facts) -> Stored:
        """`proxy.cache.DiskCache.lookup` on the in-memory disk."""
        found = self.disk.match(facts.ids)
        return Stored(tuple(Hit(n, k, "") for n, k in found[:RESTORE_CANDIDATES]),
                      frozenset(n for n, _ in found))

    def step(self, p: SimPrompt, live: bool = True) -> SimTurn:
        ids, n, scope = p.ids, len(p.ids), self.scope
        facts = Facts(ids, tuple(MessageStart(q, r) for q, r in p.message_starts), scope)
        stored = self.lookup(facts) if scope.kind != "off" else Stored()
        prefixes = [common_prefix_len(kv, ids) if live and self.memory != "recurrent" else 0
                    for kv in self.live]
        slot = choose_slot([SlotView(i, n, False, True, len(kv), self.used[i])
                            for i, (n, kv) in enumerate(zip(prefixes, self.live, strict=True))],
                           stored.longest) or 0
        live_n = prefixes[slot]
        recent = self.ring.recent(_TENANT, scope.window) if scope.kind == "auto" else []
        plan = decide(facts, stored, WorkerFacts(live_n, True, self.memory == "plain",
                                                 self.batching), recent, self.knobs)
        if scope.kind != "off":  # as Gateway.start: the ring, and its persisted copy
            self.ring.push(_TENANT, ids)
            self.ring_log = [*self.ring_log, ids][-RING_CAPACITY:]
        # the worker: keep the live prefix, restore the first entry longer than it
        last = plan.keep_max
        keep = min(self.batching.edges(ids).floor(live_n), last)
        restored = next((r.n_tokens for r in plan.restore if r.n_tokens > keep), 0)
        cached = min(restored, last) if restored else keep
        saves = tuple((s.n_tokens, str(s.reason)) for s in plan.saves)
        for s in plan.saves:
            self.disk.insert(ids[: s.n_tokens], keys.prefix_keys(_SALT, ids, [s.n_tokens])[
                s.n_tokens])
        self.live[slot] = ids  # the slot's exact live KV after the prefill: the prompt
        self.turn += 1
        self.used[slot] = self.turn
        source = "disk" if restored else "live" if cached else "none"
        return SimTurn(n, cached, source, stored.longest, live_n, saves)


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    mode: str
    turns: tuple[SimTurn, ...]

    @property
    def requests(self) -> int:
        return len(self.turns)

    @property
    def hits(self) -> int:
        return sum(1 for t in self.turns if t.cached > 0)

    @property
    def disk_hits(self) -> int:
        return sum(1 for t in self.turns if t.source == "disk" and t.cached > 0)

    @property
    def cached(self) -> int:
        return sum(t.cached for t in self.turns)

    @property
    def fresh(self) -> int:
        return sum(t.fresh for t in self.turns)

    @property
    def mean_hit_ratio(self) -> float:
        ratios = [t.cached / t.n_prompt if t.n_prompt else 0.0 for t in self.turns]
        return sum(ratios) / len(ratios) if ratios else 0.0

    def summary(self, oracle: Oracle | None = None, batch_oracle: Oracle | None = None
                ) -> dict[str, Any]:
        prompt = sum(t.n_prompt for t in self.turns)
        out: dict[str, Any] = {
            "policy": self.policy, "mode": self.mode, "requests": self.requests,
            "hits": self.hits, "disk_hits": self.disk_hits,
            "hit_rate": self.hits / self.requests if self.requests else 0.0,
            "tokens_cached_per_hit": self.cached / self.hits if self.hits else 0.0,
            "prompt_tokens": prompt, "cached_tokens": self.cached, "fresh_tokens": self.fresh,
            "token_hit_ratio": self.cached / prompt if prompt else 0.0,
            "mean_hit_ratio": self.mean_hit_ratio,
            "saves": sum(len(t.saves) for t in self.turns),
            "snapshot_tokens": sum(q for t in self.turns for q, _ in t.saves),
        }
        if oracle is not None:
            out["oracle_fresh_tokens"] = oracle.total_fresh
            out["excess_over_oracle_tokens"] = self.fresh - oracle.total_fresh
            out["fresh_over_oracle"] = self.fresh / max(oracle.total_fresh, 1)
            out["oracle_mean_hit_ratio"] = oracle.mean_hit_ratio
        if batch_oracle is not None:
            out["batch_oracle_fresh_tokens"] = batch_oracle.total_fresh
            out["fresh_over_batch_oracle"] = self.fresh / max(batch_oracle.total_fresh, 1)
        return out


def simulate(prompts: Sequence[SimPrompt], policy: str, mode: str = "restart",
             knobs: CacheKnobs | None = None, memory: str = "plain",
             batching: Batching | None = None) -> SimResult:
    """Replay `prompts` in order through one simulated proxy under `policy` and `mode`, on a
    worker with this `memory` (plain, window or recurrent) and `batching` (its batch edges)."""
    sim = Simulator(policy, knobs, memory, batching, slots_of(mode))
    turns = []
    for i, p in enumerate(prompts):
        if mode == "restart" and i:
            sim.restart()
        turns.append(sim.step(p, live=mode != "restart"))
    return SimResult(sim.policy, mode, tuple(turns))


def slots_of(mode: str) -> int:
    """The slots a mode's worker has (`restart`, `live`: 1; `live:N`: N); ValueError for an
    unknown mode."""
    kind, colon, n = mode.partition(":")
    if kind in MODES and not colon:
        return 1
    if kind == "live" and n.isascii() and n.isdigit() and int(n) >= 1:
        return int(n)
    raise ValueError(f"unknown mode {mode!r}: use restart, live or live:N (N slots)")


# --- the command -------------------------------------------------------------------------------


def model_ends(model: str = "") -> frozenset[int]:
    """The model's end-of-turn ids, where its workers' batches may end early (llama.cpp's
    end-of-generation tokens, as the proxy's tokenizer knows them)."""
    from bench.prompts import load_builder

    return load_builder(model).tok.eog_ids


def render_trace(path: str, fmt: str = "auto", tool_blocks: str = "openai",
                 turns: int | None = None, model: str = "", stable_layout: bool = True
                 ) -> list[SimPrompt]:
    from bench.prompts import load_builder, render
    from bench.trace import load_rows, to_openai

    builder = load_builder(model, stable_layout)
    out = []
    for kind, row in load_rows(path, fmt, turns):
        # as a client sends it: an Anthropic row through the Anthropic parser; `tool_blocks`
        # text: converted to OpenAI with tool blocks as text (templates without tool support)
        if kind == "anthropic" and tool_blocks == "text":
            r = render(builder, to_openai(row, kind, tool_blocks))
        else:
            r = render(builder, row, kind)
        out.append(SimPrompt(r.ids, r.boundaries, r.message_starts))
    return out


COLUMNS = (
    ("policy", "policy", "{}"), ("mode", "mode", "{}"), ("requests", "requests", "{}"),
    ("hits", "hits", "{}"), ("disk_hits", "disk hits", "{}"), ("hit_rate", "hit rate", "{:.0%}"),
    ("tokens_cached_per_hit", "tokens cached / hit", "{:.0f}"),
    ("fresh_tokens", "fresh tokens", "{}"),
    ("excess_over_oracle_tokens", "excess over oracle", "{:+}"),
    ("fresh_over_oracle", "x oracle", "{:.3f}"),
    ("fresh_over_batch_oracle", "x batch oracle", "{:.3f}"),
    ("mean_hit_ratio", "mean hit ratio", "{:.1%}"), ("saves", "snapshots", "{}"),
    ("snapshot_tokens", "snapshot tokens", "{}"),
)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "|" + "|".join("---" if k in ("policy", "mode") else "---:"
                            for k, _, _ in COLUMNS) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[k]) for k, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def run(prompts: Sequence[SimPrompt], policies: Sequence[str], modes: Sequence[str],
        knobs: CacheKnobs, batching: Batching | None = None
        ) -> tuple[Oracle, list[dict[str, Any]]]:
    oracle = compute_oracle([p.ids for p in prompts])
    batch = compute_oracle([p.ids for p in prompts], batching or Batching())
    rows = [simulate(prompts, pol, mode, knobs, batching=batching).summary(oracle, batch)
            for mode in modes for pol in policies]
    return oracle, rows


def main(argv: list[str] | None = None) -> None:
    d = Config()
    p = argparse.ArgumentParser(prog="prefixgate simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="JSONL trace (Anthropic Messages or OpenAI)")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated scopes (default {DEFAULT_POLICIES})")
    p.add_argument("--modes", default="restart,live",
                   help="comma-separated of restart (the pessimistic default), live and "
                   "live:N (N slots)")
    p.add_argument("--turns", type=int, default=None, help="the first N rows only")
    p.add_argument("--format", default="auto", choices=["auto", "anthropic", "openai"])
    p.add_argument("--tool-blocks", default="openai", choices=["openai", "text"])
    p.add_argument("--model", default="", help="GGUF whose tokenizer and template to use")
    p.add_argument("--min-tokens", type=int, default=d.kv_cache_min_tokens)
    p.add_argument("--cold-max-tokens", type=int, default=d.kv_cache_cold_max_tokens)
    p.add_argument("--continued-interval-tokens", type=int,
                   default=d.kv_cache_continued_interval_tokens)
    p.add_argument("--ubatch-size", type=int, default=d.batch,
                   help=f"the workers' batch size: reuse at batch edges, at most this many "
                   f"tokens apart and at message ends (default {d.batch})")
    p.add_argument("--out", default="", help="directory for simulate-<trace>.json and .md")
    p.add_argument("--note", default="", help="a line for the markdown (e.g. how the trace "
                   "was made)")
    a = p.parse_args(argv)
    policies = [s.strip() for s in a.policies.split(",") if s.strip()]
    modes = [s.strip() for s in a.modes.split(",") if s.strip()]
    for pol in policies:
        try:
            parse_scope(pol)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    for mode in modes:
        try:
            slots_of(mode)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    knobs = CacheKnobs(a.min_tokens, a.cold_max_tokens, a.continued_interval_tokens)
    head, table, data = report(a.trace, policies, modes, knobs, a.ubatch_size, a.format,
                               a.tool_blocks, a.turns, a.model)
    print(head + "\n\n" + table)
    if a.out:
        stem = write_report(a.out, a.trace, head, table, data, a.note)
        print(f"\nwrote {stem}.json and .md", file=sys.stderr)


def report(trace: str, policies: Sequence[str], modes: Sequence[str], knobs: CacheKnobs,
           ubatch_size: int, fmt: str = "auto", tool_blocks: str = "openai",
           turns: int | None = None, model: str = ""
           ) -> tuple[str, str, dict[str, Any]]:
    """One trace under each policy and mode: the heading, the markdown table and the JSON."""
    prompts = render_trace(trace, fmt, tool_blocks, turns, model)
    batching = Batching(ubatch_size, model_ends(model))
    oracle, rows = run(prompts, policies, modes, knobs, batching)
    # the same trace laid out as the client sent it: what the stable-first layout gains
    old = compute_oracle([p.ids for p in render_trace(trace, fmt, tool_blocks, turns, model,
                                                       stable_layout=False)])
    head = (f"trace {Path(trace).name}: {len(prompts)} requests, {oracle.total_prompt} prompt "
            f"tokens; oracle: {oracle.total_fresh} fresh tokens, mean hit ratio "
            f"{oracle.mean_hit_ratio:.1%}; at the batches' edges (batches of at most "
            f"{ubatch_size} that end early at message ends, the last token evaluated: what "
            f"any exact cache here can reach): "
            f"{compute_oracle([p.ids for p in prompts], batching).total_fresh} "
            f"(stable-first layout; the oracle of the client's own "
            f"layout, volatile blocks in place and tools after the system text: "
            f"{old.total_fresh} fresh tokens, {old.mean_hit_ratio:.1%})\n"
            f"knobs: min {knobs.min_tokens}, cold max "
            f"{knobs.cold_max_tokens}, continued interval {knobs.continued_interval_tokens} "
            f"tokens; batch {ubatch_size}; one worker; no eviction. mode restart = proxy and "
            "worker restarted before every request, only the disk (index, state files, "
            "persisted ring) survives: the pessimistic default; live = one long-lived proxy "
            "and worker; live:N = the same with N slots.")
    data = {
        "trace": Path(trace).name, "requests": len(prompts),
        "knobs": {"min_tokens": knobs.min_tokens, "cold_max_tokens": knobs.cold_max_tokens,
                  "continued_interval_tokens": knobs.continued_interval_tokens},
        "oracle": {"prompt_tokens": oracle.total_prompt, "fresh_tokens": oracle.total_fresh,
                   "mean_hit_ratio": oracle.mean_hit_ratio},
        "oracle_client_layout": {"prompt_tokens": old.total_prompt,
                                 "fresh_tokens": old.total_fresh,
                                 "mean_hit_ratio": old.mean_hit_ratio},
        "results": rows}
    return head, markdown_table(rows), data


def write_report(out_dir: str | Path, trace: str, head: str, table: str, data: dict[str, Any],
                 note: str = "") -> Path:
    """simulate-<trace>.md and .json in `out_dir`; returns their path without the suffix."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"simulate-{Path(trace).stem}"
    note = f"{note}\n\n" if note else ""
    (out / f"{stem}.md").write_text(f"# Policy simulator: {Path(trace).name}\n\n" + note
                                     + head.replace("\n", "\n\n") + "\n\n" + table + "\n")
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    return out / stem


if __name__ == "__main__":
    main()
