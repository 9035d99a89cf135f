"""`make overhead`: what the proxy itself costs per request, against what the worker costs.

    python -m bench.overhead [--sizes 2000,8000,32000] [--reps 20] [--worker-sizes 2000]

For each size, one synthetic agent session (`bench.synth`, one tool-heavy prefix, ~300 new tokens
a turn) is grown until its prompt reaches that many tokens. The proxy has already served the
earlier turns (its template prefix cache, tokenizer fragment cache, ring of recent prompts and
LMDB index are as a running proxy's would be), and the measured request re-sends the unchanged
history plus one new user turn (a different one each repetition, so the new text is never
cached). Stages, each timed on the proxy's real code:

- parse: `proxy.edge.parse_body` of the body bytes, as the server parses every request: JSON
  within `proxy.limits`' bounds, then `openai_api.parse_chat`
- prepare: `proxy.prompt.PromptBuilder.prepare` (normalize, lay out, tools into the prompt,
  render the template, tokenize, find the safe boundaries); its parts are timed again alone, on
  requests of their own: `messages` (`PromptBuilder.messages`: normalize, lay out, tools,
  dialect) and `render_prompt` (`proxy.template.render_prompt`: the template rendered, resumed
  from the previous turn's render where proven equal, the message starts, the tokenization)
- decide: `proxy.cache.DiskCache.lookup` and `policies.decide.decide`, as `Gateway.start` calls
  them (candidate keys over the prompt, one LMDB read, the ring comparison, the save plan),
  against a real `backend.index.Index` in a temporary directory, filled as the earlier turns
  left it
- send: `backend.protocol.Job.encode` of the request's job (its fields, then the prompt's ids),
  the body the proxy POSTs to the worker (before worker protocol 3: the job as JSON); and,
  apart from the proxy's total, the worker's read of that body (`Job.decode`: parsed and
  checked, before it can start)

then `anthropic`: the same session as Claude Code sends it, through the Anthropic API
(`anthropic_api.parse_request`: the system prompt apart, tool results as blocks), parse and
prepare, plus decide as above; and `cold`: `prepare` of the same prompt in a fresh process
state (nothing cached: a new conversation of that size): a new builder and a body of new
objects, the median of 3. Times are medians over `--reps`, of CPU time
(`time.process_time`, robust to other load on the machine) and wall time.

The worker's time for the same request is the prefill of its uncached tail (the new turn, plus
the two tokens always re-evaluated) and a 16-token decode, measured on the real model through
`backend.engine.Engine` with the history already in its KV, for the sizes in
`--worker-sizes`. For the other sizes it is estimated from the prefill and decode rates
measured at the largest measured size, which understates the worker's time at a longer context
(attention grows with it), so the overhead fraction shown for them is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.synth import Knobs, generate
from bench.trace import to_openai

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
DECODE_TOKENS = 16
COLD_REPS = 3
RING_WINDOW = 30


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(median CPU ms, median wall ms) of `reps` calls."""
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    return statistics.median(cpu), statistics.median(wall)


def session_knobs(target_tokens: int) -> Knobs:
    return Knobs(sessions=1, parallel=1, turns=400,
                 prefix_tokens=max(500, min(target_tokens // 4, 30000)), rewrite_share=0.0)


def session_rows(target_tokens: int, builder: Any) -> list[dict[str, Any]]:
    """OpenAI bodies of one growing session whose last prompt reaches `target_tokens`."""
    from bench.prompts import render

    rows: list[dict[str, Any]] = []
    for row in generate(session_knobs(target_tokens), seed=7):
        rows.append(to_openai(row))
        if len(rows) >= 2 and len(render(builder, rows[-1]).ids) >= target_tokens:
            return rows
    raise SystemExit(f"could not grow a session to {target_tokens} tokens")


def with_new_turn(body: dict[str, Any], rep: int) -> dict[str, Any]:
    """`body` with its last user message made new (never seen by the caches); an OpenAI or
    an Anthropic body (whose last message may hold blocks: a text block is added)."""
    messages = [dict(m) for m in body["messages"]]
    content, note = messages[-1]["content"], f"(variant {rep}: check again)"
    messages[-1]["content"] = [*content, {"type": "text", "text": note}] \
        if isinstance(content, list) else f"{content} {note}"
    return {**body, "messages": messages}


def anthropic_rows(target_tokens: int, n: int) -> list[dict[str, Any]]:
    """The first `n` bodies of `session_rows`' session as Claude Code sends them (Anthropic
    Messages: the system prompt apart, tool results as blocks)."""
    return [row for row, _ in zip(generate(session_knobs(target_tokens), seed=7), range(n),
                                  strict=False)]


def fill(cache: Any, prompt: Any, n: int, shape: str, seed: int = 3) -> None:
    """`n` more stored entries, as other sessions leave them (`shape` "sessions": 200 sessions
    that share this prompt up to one of its message starts, then go their own way, each with a
    snapshot at every turn end; "adversarial": every entry branches off this prompt at a
    different random token, the worst case for the lookup's walk)."""
    from backend.protocol import Saved

    rng = random.Random(seed)
    ids, starts = prompt.ids, [p for p, _ in prompt.message_starts] or [len(prompt.ids) // 2]

    def save(i: int, entry: tuple[int, ...]) -> None:
        key = f"{i:032x}"
        cache.commit(Saved(len(entry), key, "growing", f"kv/{key}.kv", 1, 0, 0.0), "", entry)

    if shape == "adversarial":
        for i in range(n):
            cut = rng.randrange(1, len(ids))
            save(i, ids[:cut] + tuple(rng.randrange(49_000) for _ in range(50)))
        return
    sessions = 200
    for s in range(sessions):
        path = ids[: rng.choice(starts)]
        for t in range(n // sessions):
            path += tuple(rng.randrange(49_000) for _ in range(300))  # one more turn
            save(s * (n // sessions) + t, path)


def measure_proxy(target: int, reps: int, entries: int = 0, fill_shape: str = "sessions"
                  ) -> dict[str, Any]:
    from backend.index import Index
    from backend.keys import CacheIdentity, prefix_keys
    from backend.protocol import Job, Saved
    from bench.prompts import load_builder, prepare, prepare_request
    from policies.decide import WorkerFacts, decide
    from policies.prefix import Batching
    from policies.ring import Ring
    from proxy import anthropic_api, edge, limits, openai_api
    from proxy.cache import DiskCache
    from proxy.config import Config
    from proxy.gateway import RING_CAPACITY, facts_of, knobs_of
    from proxy.metrics import Metrics
    from proxy.template import render_prompt

    builder = load_builder()
    rows = session_rows(target, builder)
    body = rows[-1]
    cfg = Config()
    knobs = knobs_of(cfg)
    # the default worker's batches (its batch size, its model's end-of-turn ids)
    worker = WorkerFacts(0, True, batching=Batching(cfg.batch, builder.tok.eog_ids))
    ring = Ring(RING_CAPACITY)
    with tempfile.TemporaryDirectory(prefix="prefixgate-overhead-") as tmp:
        identity = CacheIdentity(cfg.model_path, 65536, "f16", "f16", "off", "bench")
        cache = DiskCache(Index(Path(tmp)), identity, knobs, cfg.cache_max_bytes, Metrics())

        def decide_one(prep: Any) -> Any:
            """Gateway.start's decide step: one index read, then the pure decision."""
            facts = facts_of(prep, prep.scope)
            stored = cache.lookup(facts, "")
            recent = ring.recent("", facts.scope.window)
            return stored, decide(facts, stored, worker, recent, knobs)

        # the earlier turns, served: caches warm, ring filled, their snapshots in the index
        for earlier in rows[:-1]:
            prep = prepare(builder, earlier)
            _, plan = decide_one(prep)
            ring.push("", prep.rendered.ids)
            for s in plan.saves:  # as a worker keys and writes them
                key = prefix_keys(cache.salt(""), prep.rendered.ids, [s.n_tokens])[s.n_tokens]
                cache.commit(Saved(s.n_tokens, key.hex(), s.reason, f"kv/{key.hex()}.kv", 1, 0,
                                   0.0), "", prep.rendered.ids)
        prev_n = len(prepare(builder, rows[-2]).rendered.ids)
        if entries:  # other sessions' snapshots: the lookup walks a bigger tree
            fill(cache, prepare(builder, rows[-2]).rendered, entries, fill_shape)
        variants = iter(range(10**6))

        def fresh_raw() -> bytes:
            return json.dumps(with_new_turn(body, next(variants))).encode()

        raws = [fresh_raw() for _ in range(reps * 4 + 2)]
        it_parse, it_prep, it_msgs, it_render = (iter(raws[i::4]) for i in range(4))

        def parse_one(raw: bytes) -> Any:
            return edge.parse_body(raw, "", openai_api.parse_chat, limits.LIMITS)

        parse = timed(lambda: parse_one(next(it_parse)), reps)
        reqs = {name: [parse_one(r) for r in rs]
                for name, rs in (("prep", it_prep), ("msgs", it_msgs), ("render", it_render))}
        prep_reqs, msg_reqs, render_reqs = (iter(reqs[k]) for k in ("prep", "msgs", "render"))
        prepare_t = timed(lambda: prepare_request(builder, next(prep_reqs)), reps)
        prep = prepare(builder, body)
        decide_t = timed(lambda: decide_one(prep), reps)
        job = Job("bench", prep.rendered.ids, cache.salt(""), "", decide_one(prep)[1],
                  {"temperature": 0.0}, DECODE_TOKENS, (), None)
        # the body POSTed to the worker: the ids as bytes after a JSON line, or (a build before
        # worker protocol 3) all of it as JSON, as aiohttp's json= wrote it
        new_wire = hasattr(job, "encode")
        send_t = timed(job.encode if new_wire else lambda: json.dumps(job.to_wire()).encode(),
                       reps)
        # and what the worker does with that body before it can start: read and check it
        wire = job.encode() if new_wire else json.dumps(job.to_wire()).encode()
        read_t = timed((lambda: Job.decode(wire)) if new_wire
                       else lambda: Job.from_wire(json.loads(wire)), reps)
        # the parts of prepare (a build before issue 23 has no PromptBuilder.messages: None)
        messages_t: tuple[float, float] | None = None
        render_t: tuple[float, float] | None = None
        if hasattr(builder, "messages"):
            messages_t = timed(lambda: builder.messages(next(msg_reqs)), reps)

            def render_one() -> None:
                messages, tools = builder.messages(next(render_reqs))
                render_prompt(builder.template, builder.tok, messages, tools)

            both = timed(render_one, reps)
            render_t = (max(0.0, both[0] - messages_t[0]), max(0.0, both[1] - messages_t[1]))
        # the same conversation through the Anthropic API (Claude Code): its earlier turns
        # served, then the same request re-sent with a new turn, parsed and prepared
        arows = anthropic_rows(target, len(rows))
        for earlier in arows[:-1]:
            prepare(builder, earlier, "anthropic")
        araws = iter([json.dumps(with_new_turn(arows[-1], r)).encode()
                      for r in range(reps + 2)])

        def anthropic_one() -> Any:
            req = edge.parse_body(next(araws), "", anthropic_api.parse_request, limits.LIMITS)
            return prepare_request(builder, req)

        anthropic_t = timed(anthropic_one, reps)
        cache.close()
        cache.index.close()
    # a new conversation: a fresh builder (its tokenizer and template caches empty) and a body
    # of new objects (nothing remembered by identity); the median of COLD_REPS such
    colds = []
    for rep in range(COLD_REPS):
        cold_builder = load_builder()
        cold_body = json.loads(json.dumps(with_new_turn(body, -1 - rep)))
        colds.append(timed(lambda b=cold_builder, c=cold_body: prepare(b, c), 1))
    cold = (statistics.median(c[0] for c in colds), statistics.median(c[1] for c in colds))
    n = len(prep.rendered.ids)
    return {
        "target_tokens": target, "prompt_tokens": n, "messages": len(body["messages"]),
        "stored_entries": len(cache),
        "uncached_tail_tokens": n - prev_n, "reps": reps,
        "parse_ms": parse, "prepare_ms": prepare_t, "messages_ms": messages_t,
        "render_prompt_ms": render_t, "decide_ms": decide_t, "send_ms": send_t,
        "worker_read_ms": read_t,
        "proxy_ms": tuple(map(sum, zip(parse, prepare_t, decide_t, send_t, strict=True))),
        "anthropic_ms": tuple(map(sum, zip(anthropic_t, decide_t, send_t, strict=True))),
        "cold_prepare_ms": cold,
    }


def measure_worker(target: int, tail: int, threads: int) -> dict[str, Any]:
    """Prefill of `tail` tokens after `target - tail` tokens of history, then a short decode."""
    from backend.engine import Engine
    from backend.sampling import Sampling
    from bench.prompts import load_builder, render
    from proxy.config import Config

    builder = load_builder()
    rows = session_rows(target, builder)
    ids = list(render(builder, rows[-1]).ids)
    prev = len(render(builder, rows[-2]).ids)
    eng = Engine(Config().model_path, n_ctx=len(ids) + DECODE_TOKENS + 64,
                 n_threads=threads, n_gpu_layers=0)
    t0 = time.perf_counter()
    eng.prefill(0, ids[:prev])
    history_s = time.perf_counter() - t0
    keep = min(prev, len(ids) - 2)
    eng.truncate(0, keep)
    c1, t1 = time.process_time(), time.perf_counter()
    eng.prefill(0, ids)
    t2 = time.perf_counter()
    n_gen = sum(1 for _ in eng.generate(0, Sampling(temperature=0.0), DECODE_TOKENS))
    c3, t3 = time.process_time(), time.perf_counter()
    del eng
    return {"prompt_tokens": len(ids), "history_tokens": prev, "tail_tokens": len(ids) - keep,
            "history_prefill_s": history_s, "tail_prefill_ms": (t2 - t1) * 1e3,
            "decode_ms": (t3 - t2) * 1e3, "decode_tokens": n_gen,
            "worker_ms": (t3 - t1) * 1e3, "worker_cpu_ms": (c3 - c1) * 1e3, "measured": True,
            "prefill_tok_s": (len(ids) - keep) / (t2 - t1), "decode_tok_s": n_gen / (t3 - t2),
            "cpu_per_wall": (c3 - c1) / (t3 - t1)}


FLOOR_PREFILL_TOK_S = 300.0


def floor_ms(row: dict[str, Any], rate: float) -> float:
    """The least the worker could take for this request: its new tail at `rate`, no decode."""
    return (row["uncached_tail_tokens"] + 2) / rate * 1e3


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# Proxy overhead per request",
        "",
        f"Machine: {res['machine']}; model {res['model']}; {res['threads']} threads"
        + (f"; load average at the end {tuple(round(x, 1) for x in res['load_avg_at_end'])} "
           "(other work shared the cores)" if res.get("load_avg_at_end") else "")
        + (f"; commit {res['commit'][:12]}" if res.get("commit") else "") + ". "
        "History re-sent unchanged plus one new user turn; the proxy's caches, ring and index "
        "as after the earlier turns. CPU ms = median process time of the stage (robust to "
        "other load on the machine); wall ms in parentheses. Worker = prefill of the uncached "
        f"tail + a {DECODE_TOKENS}-token decode on the real model.",
        "",
        "| prompt tokens | stored entries | new tail tokens | parse (limits + API) "
        "| prepare (messages + render + tokenize + boundaries) "
        "| of which messages | of which render_prompt | decide | send | **proxy total** "
        "| the same, Anthropic API | worker | "
        "proxy / worker | proxy / worker CPU per thread | **proxy / worker floor** | "
        "cold prepare (new conversation) | the worker's read of the job |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ms(v: Any) -> str:
        return "-" if v is None else f"{v[0]:.1f} ({v[1]:.1f})"

    rate = res.get("floor_prefill_tok_s", FLOOR_PREFILL_TOK_S)

    for r in res["sizes"]:
        w = r["worker"]
        est = "" if w is None or w["measured"] else " (estimated)"
        lines.append(
            f"| {r['prompt_tokens']} | {r.get('stored_entries', '-')} | "
            f"{r['uncached_tail_tokens']} | {ms(r['parse_ms'])} | "
            f"{ms(r['prepare_ms'])} | {ms(r['messages_ms'])} | {ms(r['render_prompt_ms'])} | "
            f"{ms(r['decide_ms'])} | {ms(r.get('send_ms'))} | **{ms(r['proxy_ms'])}** | "
            f"{ms(r.get('anthropic_ms'))} | "
            + (f"{w['worker_ms']:.0f}{est} | {r['proxy_fraction_of_worker']:.3%} | "
               f"{r['proxy_fraction_of_worker_idle']:.3%} | " if w else "- | - | - | ") +
            f"**{r['proxy_ms'][0] / floor_ms(r, rate):.2%}** | {ms(r['cold_prepare_ms'])} | "
            f"{ms(r.get('worker_read_ms'))} |")
    lines += ["", "All times in ms. proxy / worker: the proxy's CPU time against the worker's "
              "wall time as measured (on a loaded machine the worker's wall time is inflated); "
              "proxy / worker CPU per thread: against the worker's CPU time divided by its "
              "threads (also inflated under load: llama.cpp's threads spin while they wait for "
              "each other); proxy / worker floor: against the least the worker could take on an "
              f"idle machine, the new tail prefilled at {rate:g} tokens/s (the top of the "
              "150-300 tokens/s DESIGN.md gives for this model on 2 cores) and no decode at all, "
              "the worst case for the proxy. Estimated worker "
              "times use the prefill and decode rates measured at "
              f"{res['rates_from_tokens']} tokens; at a longer context the real worker is slower"
              ", so their fractions are upper bounds.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2000,8000,32000")
    p.add_argument("--worker-sizes", default="2000",
                   help="sizes whose worker time is measured on the model (the rest "
                   "estimated); none: the proxy alone")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--entries", type=int, default=0,
                   help="fill the cache with this many more entries first (e.g. 10000)")
    p.add_argument("--fill", default="sessions", choices=["sessions", "adversarial"],
                   help="how those entries branch off the measured prompt (see fill())")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--markdown-only", action="store_true",
                   help="rewrite overhead.md from the overhead.json in --out")
    a = p.parse_args(argv)
    if a.markdown_only:
        res = json.loads((Path(a.out) / "overhead.json").read_text())
        (Path(a.out) / "overhead.md").write_text(markdown(res))
        print(markdown(res))
        return
    sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    measured_sizes = {int(s) for s in a.worker_sizes.split(",")
                      if s.strip() and s.strip() != "none"}
    rows = []
    for size in sizes:
        print(f"proxy stages at {size} tokens ...", file=sys.stderr)
        rows.append(measure_proxy(size, a.reps, a.entries, a.fill))
    workers = {}
    for size in sorted(measured_sizes):
        print(f"worker at {size} tokens ...", file=sys.stderr)
        tail = next((r["uncached_tail_tokens"] for r in rows if r["target_tokens"] == size), 300)
        workers[size] = measure_worker(size, tail, a.threads)
    ref_size = max(workers) if workers else None
    for r in rows:
        w = workers.get(r["target_tokens"])
        if w is None and ref_size is None:  # --worker-sizes none: the proxy alone
            r["worker"] = r["proxy_fraction_of_worker"] = r["proxy_fraction_of_worker_idle"] = None
            continue
        if w is None:
            ref = workers[ref_size]
            tail = r["uncached_tail_tokens"] + 2
            pre = tail / ref["prefill_tok_s"] * 1e3
            dec = DECODE_TOKENS / ref["decode_tok_s"] * 1e3
            w = {"tail_tokens": tail, "tail_prefill_ms": pre, "decode_ms": dec,
                 "worker_ms": pre + dec, "worker_cpu_ms": (pre + dec) * ref["cpu_per_wall"],
                 "measured": False}
        r["worker"] = w
        r["proxy_fraction_of_worker"] = r["proxy_ms"][0] / w["worker_ms"]
        # on an idle machine the worker's 2 threads run in parallel: wall ~ CPU / threads
        r["proxy_fraction_of_worker_idle"] = r["proxy_ms"][0] / (w["worker_cpu_ms"] / a.threads)
    import subprocess

    from proxy.config import default_model

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=RESULTS.parent.parent,
                            capture_output=True, text=True).stdout.strip()
    res = {"machine": f"{os.cpu_count()} cores", "load_avg_at_end": os.getloadavg(),
           "commit": commit,
           "model": Path(default_model()).name, "threads": a.threads,
           "rates_from_tokens": ref_size, "floor_prefill_tok_s": FLOOR_PREFILL_TOK_S,
           "sizes": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (out / "overhead.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
