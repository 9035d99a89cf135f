"""What copying a slot's state costs the llama thread: `python -m bench.snapshot`.

    python -m bench.snapshot [--tokens 6000] [--slots 3] [--rounds 4] [--out DIR]

One worker engine of the default model (`--slots` slots, 12,288 tokens of context each, 2
threads) prefills `--tokens` tokens in slot 0; then, in each round, both ways side by side:

- `populated`: the buffers as the worker makes them (`backend.buffers.empty`: mapped with
  their pages populated in one call);
- `faulted`: the same code with `np.empty` in their place (the allocator's memory, faulted in a
  page at a time as llama.cpp writes it).

Per way: a snapshot of slot 0 (kept, as a tier keeps it: new memory each time), a restore of it
into slot 1 (a queued write's load: one copy), and a copy of slot 0's first tokens into slot 2
(a borrow). Milliseconds of the calling thread, the median of the rounds. The memory a
process gets back from the system is what the `faulted` way pays for; on a VM that hands freed
pages back to its host (this project's machines) every fault is a trip to the host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.replay import ROOT


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.snapshot")
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue41"))
    a = p.parse_args(argv)

    from backend import buffers
    from backend.engine import Engine
    from proxy.config import default_model

    eng = Engine(default_model(), 12288 * a.slots, 2, 0, n_batch=512, flash_attn="auto",
                 n_seq=a.slots)
    rng = random.Random(0)
    ids = [1] + [rng.randrange(100, 40000) for _ in range(a.tokens - 1)]
    eng.prefill(0, ids)
    mib = eng.state_bytes(0) / 2**20
    populated = buffers.empty

    def faulted(n: int) -> np.ndarray:
        return np.empty(n, dtype=np.uint8)

    kept: list[Any] = []  # as a tier holds its snapshots: each one new memory
    rows: dict[str, dict[str, list[float]]] = {w: {"snapshot": [], "restore": [], "copy": []}
                                               for w in ("populated", "faulted")}
    ways = [("populated", populated), ("faulted", faulted)]
    for r in range(a.rounds):
        for way, alloc in ways if r % 2 == 0 else ways[::-1]:  # each first in turn
            buffers.empty = alloc  # states, layout and store call it by the module's name
            t = time.perf_counter()
            s = eng.snapshot(0)
            rows[way]["snapshot"].append(time.perf_counter() - t)
            kept.append(s)
            t = time.perf_counter()
            eng.restore(1, ids, s)
            rows[way]["restore"].append(time.perf_counter() - t)
            t = time.perf_counter()
            eng.copy(0, 2, a.tokens - 100)
            rows[way]["copy"].append(time.perf_counter() - t)
    buffers.empty = populated
    res = {"tokens": a.tokens, "slots": a.slots, "state_mib": round(mib, 1),
           "rounds": a.rounds,
           "ms": {w: {k: round(statistics.median(v) * 1e3, 1) for k, v in r.items()}
                  for w, r in rows.items()},
           "ms_each": {w: {k: [round(x * 1e3, 1) for x in v] for k, v in r.items()}
                       for w, r in rows.items()}}
    lines = [f"# A slot's state copied on the llama thread: {a.tokens} tokens, {mib:.0f} MiB, "
             f"{a.slots} slots",
             "", f"`python -m bench.snapshot --tokens {a.tokens} --slots {a.slots} --rounds "
             f"{a.rounds}`; ms, the median of the rounds (each round both ways, side by side, each "
             "first in turn).",
             "", "| way | snapshot (kept) | restore (one copy) | copy between slots |",
             "|---|---:|---:|---:|"]
    for w, r in res["ms"].items():
        lines.append(f"| {w} | {r['snapshot']} | {r['restore']} | {r['copy']} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "snapshot.json").write_text(json.dumps(res, indent=1))
    (out / "snapshot.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
