"""Two quick side-by-side measurements on the real default model (not timed tests):

1. live reuse: a ~1,500-token conversation, cold prefill time vs the follow-up turn's time to
   first token when the worker keeps the shared prefix live;
2. disk reuse: a >= 2,000-token prompt, cold time to first token vs after a restart of proxy and
   workers (only the disk cache can help), and the worker's restore time vs the time to read the
   same bytes from disk.

    make bench-quick        (or: python -m bench.quick [--tokens 2000])

Prints ratios; timings are wall-clock on a shared machine, so read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.index import Index  # noqa: E402
from tests.conftest import running  # noqa: E402

TOPICS = ["caching", "routing", "tokenization", "snapshots", "eviction", "metrics", "restarts",
          "tenants", "streaming", "templates", "workers", "durability"]


def system_prompt(n_words: int) -> str:
    """A long, varied, deterministic preamble (agents send tool schemas and project notes)."""
    lines = []
    i = 0
    while sum(len(line.split()) for line in lines) < n_words:
        t = TOPICS[i % len(TOPICS)]
        lines.append(f"Note {i}: the {t} module keeps invariant {i * 7 % 13} and must log one "
                     f"line per request about {t}; see docs/{t}.md section {i % 5}.")
        i += 1
    return "\n".join(lines)


def stream_ttft(base: str, messages: list[dict]) -> tuple[float, float, dict]:
    c = openai.OpenAI(base_url=base, api_key="bench", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    with c.chat.completions.with_streaming_response.create(
            model="m", messages=messages, temperature=0, max_tokens=16, stream=True,
            stream_options={"include_usage": True}) as resp:
        headers = dict(resp.headers)
        ttft = None
        usage = None
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get(
                    "content"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    total = time.perf_counter() - t0
    return ttft or total, total, {"headers": headers, "usage": usage}


def live_reuse(tmp: Path) -> None:
    msgs = [{"role": "system", "content": system_prompt(900)},
            {"role": "user", "content": "Which module handles restarts?"}]
    with running(tmp / "live", "--workers", "1", "--disk-prefix-cache", "off") as srv:
        cold_ttft, _, info = stream_ttft(srv.v1, msgs)
        n1 = info["usage"]["prompt_tokens"]
        follow = [*msgs, {"role": "assistant", "content": "The restarts module."},
                  {"role": "user", "content": "And which one handles eviction?"}]
        warm_ttft, _, info2 = stream_ttft(srv.v1, follow)
    u = info2["usage"]
    sys.stdout.write(
        f"live reuse: first turn {n1} tokens, cold TTFT {cold_ttft:.3f} s; follow-up "
        f"{u['prompt_tokens']} tokens, {u['prompt_tokens_details']['cached_tokens']} cached, "
        f"TTFT {warm_ttft:.3f} s; ratio cold/follow-up = {cold_ttft / warm_ttft:.1f}x\n")


def disk_reuse(tmp: Path, n_words: int) -> None:
    msgs = [{"role": "system", "content": system_prompt(n_words)},
            {"role": "user", "content": "Summarize the durability notes."}]
    cache = tmp / "disk-cache"
    with running(tmp / "disk1", "--workers", "1", cache_dir=cache) as srv:
        cold_ttft, _, info = stream_ttft(srv.v1, msgs)
        stream_ttft(srv.v1, msgs)  # the ring now knows the prompt: `auto` stores all of it
    n = info["usage"]["prompt_tokens"]
    with running(tmp / "disk2", "--workers", "1", cache_dir=cache) as srv:
        hit_ttft, _, info2 = stream_ttft(srv.v1, msgs)
    h = info2["headers"]
    restore_s = float(h.get("x-prefixgate-restore-seconds", "nan"))
    with Index(cache) as index:
        entry = max((e for _, e in index.entries()), key=lambda e: e.n_tokens)
    t0 = time.perf_counter()
    data = (cache / entry.file).read_bytes()
    read_s = time.perf_counter() - t0
    sys.stdout.write(
        f"disk reuse: prompt {n} tokens; cold TTFT {cold_ttft:.3f} s; after restart "
        f"{h.get('x-prefixgate-cache-source')} hit of {h.get('x-prefixgate-cached-tokens')} "
        f"tokens, TTFT {hit_ttft:.3f} s; ratio cold/disk-hit = {cold_ttft / hit_ttft:.1f}x\n"
        f"restore: {restore_s * 1000:.1f} ms for {len(data) / 2**20:.1f} MiB "
        f"({entry.n_tokens} tokens) vs {read_s * 1000:.1f} ms to read the same file; "
        f"ratio restore/read = {restore_s / read_s:.1f}x\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--words", type=int, default=1700, help="system prompt words for the "
                   "disk benchmark (1700 words is about 2,400 tokens)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefixgate-bench-") as tmp:
        live_reuse(Path(tmp))
        disk_reuse(Path(tmp), args.words)


if __name__ == "__main__":
    main()
