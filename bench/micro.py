"""Micro-timings of three steps on every request's or every start's path (not timed tests):

- keys: `backend.keys.prefix_keys` of a 60,000-id prompt at every 64th position (937 keys);
- metadata: `proxy.gguf.read_metadata` of the default model (tokenizer, template, settings);
- encode: the proxy's tokenizer (`bench.prompts.load_builder().tok.encode`) on a ~30,000-token
  text, new (a different text each run, as a new conversation) and again (the same text: its
  fragments come from the tokenizer's cache, as a re-sent history's do).

    python -m bench.micro [--reps 20]

Prints the median and the fastest of `--reps` wall-clock runs (`time.perf_counter`) after one
warm-up run, as a markdown table. Timings on a shared machine vary: read them as magnitudes.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from backend.keys import prefix_keys
from bench.prompts import load_builder
from proxy.config import default_model
from proxy.gguf import read_metadata

PROSE = (
    "The proxy decides, per request, which KV state to restore, where to snapshot, and which "
    "worker runs it; the workers execute. Agent sessions resend a large, mostly stable prefix "
    "(system prompt, tool schemas, AGENTS.md, history) followed by a changing tail.\n"
    "def get(self, key, default=None):\n    return self.cache.get(key, default)  # 0x1F\n"
)


def timings(fn: Callable[[], Any], reps: int) -> list[float]:
    fn()  # warm-up: imports, page cache, lazy tables
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    rng = random.Random(2)
    ids = [rng.randrange(49_152) for _ in range(60_000)]
    positions = range(0, 60_001, 64)
    model = default_model()
    tok = load_builder(model).tok
    text = PROSE * (30_000 // len(tok.encode(PROSE)) + 1)
    n_tokens = len(tok.encode(text))
    run = itertools.count()

    rows = [
        (f"prefix_keys, {len(ids):,} ids, every 64th position",
         lambda: prefix_keys(b"w" * 16, ids, positions)),
        ("read_metadata, default model", lambda: read_metadata(model)),
        (f"tokenizer encode, {n_tokens:,} tokens, new", lambda: tok.encode(f"{next(run)} {text}")),
        (f"tokenizer encode, {n_tokens:,} tokens, again", lambda: tok.encode(text)),
    ]
    print(f"{args.reps} runs each, after one warm-up run\n")
    print("| step | median ms | min ms |")
    print("|---|---:|---:|")
    for name, fn in rows:
        ts = timings(fn, args.reps)
        print(f"| {name} | {statistics.median(ts) * 1e3:.2f} | {min(ts) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
