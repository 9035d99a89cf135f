"""Restore from the RAM tier versus from disk versus prefill (issue 20), and what `decide`
makes of it: the break-even table (issue 21).

    python -m bench.ramtier [--model GGUF] [--tokens 1024,4096,16384,32768] [--repeats 3]

For each prompt length n (a multiple of the batch size): a cold prefill of n tokens, then the
worker's three ways to get the same state back into a slot, each timed and checked to hold
exactly n tokens:
- ram: `Engine.restore` from the snapshot held in memory (what the RAM tier keeps);
- disk (page cache): `store.read_state_file` of the state file just written (the OS still
  has it cached, as for a recent snapshot), then `Engine.restore`;
- disk (cold): the same after `posix_fadvise(DONTNEED)` drops the file from the page cache
  (where the OS honours it);
- prefill: the n tokens evaluated again.
Medians of `--repeats` runs, in one process, one after the other.

Then the worker's cost model (`policies.costs`) is fed these measurements, as a worker feeds it
as it runs, and each row says what `pays` chooses for a restore from RAM and from a cold disk,
beside which one was measured faster: the two columns must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from backend import keys, store
from backend.engine import Engine
from policies.costs import Costs, pays
from proxy.config import Config, cache_identity, default_model

ROOT = Path(__file__).resolve().parent.parent


def median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(eng: Engine, fp: bytes, tmp: Path, part: list[int], repeats: int
            ) -> dict[str, Any]:
    """One prompt length: its prefill, then its state back from RAM, from disk, from a cold
    disk (medians)."""
    n = len(part)

    def prefill() -> None:
        eng.truncate(0, 0)
        eng.prefill(0, part, [], lambda _: None)

    prefill_s = median_s(prefill, repeats)
    state = eng.snapshot(0)
    path, size, _ = store.write_state_file(tmp, keys.prefix_keys(b"", part, [n])[n], fp, part,
                                           state)

    def ram() -> None:
        eng.restore(0, part, state)
        assert eng.seqs[0].n_live == n

    def disk(cold: bool) -> None:
        if cold:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        got, data = store.read_state_file(path, fp, part)
        eng.restore(0, part[:got], data)
        assert eng.seqs[0].n_live == n

    ram_s = median_s(ram, repeats)
    warm_s = median_s(lambda: disk(False), repeats)
    cold_s = median_s(lambda: disk(True), repeats)
    return {"tokens": n, "state_mib": round(size / 2**20, 1), "state_bytes": size,
            "ram_s": round(ram_s, 4), "disk_page_cache_s": round(warm_s, 4),
            "disk_cold_s": round(cold_s, 4), "prefill_s": round(prefill_s, 3),
            "prefill_over_ram": round(prefill_s / ram_s, 1),
            "disk_cold_over_ram": round(cold_s / ram_s, 2)}


def run(model: str, lengths: list[int], repeats: int, threads: int) -> list[dict[str, Any]]:
    n_ctx = max(lengths) + 256
    eng = Engine(model, n_ctx, threads, 0)
    fp = cache_identity(Config(model=model, n_ctx=n_ctx)).fingerprint()
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(1, eng.n_vocab, 2 * max(lengths)) if int(t) not in
           eng.eog][:max(lengths)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return [measure(eng, fp, Path(tmp), ids[:n], repeats) for n in lengths]
    finally:
        eng.close()


def decisions(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with what decide would choose from the costs all rows taught the model (as a
    worker learns them: each prefill from 0, each restore with its bytes), beside the faster
    one measured."""
    costs = Costs()
    for r in rows:
        costs = costs.add_prefill(0, r["tokens"], r["prefill_s"])
        costs = costs.add_restore("ram", r["state_bytes"], r["ram_s"])
        costs = costs.add_restore("disk", r["state_bytes"], r["disk_cold_s"])
    out = []
    for r in rows:
        row = dict(r)
        for source, measured in (("ram", r["ram_s"]), ("disk", r["disk_cold_s"])):
            row[f"{source}_choice"] = "restore" if pays(costs, 0, r["tokens"], r["state_bytes"],
                                                        source) else "prefill"
            row[f"{source}_faster"] = "restore" if measured < r["prefill_s"] else "prefill"
            row[f"{source}_est_s"] = round(costs.restore_s(r["state_bytes"], source), 4)
        row["prefill_est_s"] = round(costs.prefill_s(0, r["tokens"]), 3)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.ramtier")
    p.add_argument("--model", default="")
    p.add_argument("--tokens", default="1024,4096,16384,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue21"))
    a = p.parse_args(argv)
    model = a.model or default_model()
    rows = decisions(run(model, [int(x) for x in a.tokens.split(",")], a.repeats, a.threads))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ramtier.json").write_text(json.dumps({"model": model, "rows": rows}, indent=1))
    lines = [f"Model `{Path(model).name}`, {a.threads} threads, median of {a.repeats}.", "",
             "| tokens | state MiB | RAM restore s | disk restore s (page cache) | "
             "disk restore s (cold) | prefill s | prefill / RAM | disk cold / RAM |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['state_mib']} | {r['ram_s']} | {r['disk_page_cache_s']} | "
              f"{r['disk_cold_s']} | {r['prefill_s']} | {r['prefill_over_ram']} | "
              f"{r['disk_cold_over_ram']} |" for r in rows]
    lines += ["", "What decide chooses from the cost model these measurements taught "
              "(policies.costs, as a worker learns it), beside the faster one measured:", "",
              "| tokens | prefill est s | RAM est s | RAM: chosen / faster | disk est s | "
              "disk (cold): chosen / faster |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['prefill_est_s']} | {r['ram_est_s']} | {r['ram_choice']} / "
              f"{r['ram_faster']} | {r['disk_est_s']} | {r['disk_choice']} / {r['disk_faster']} |"
              for r in rows]
    (out / "ramtier.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
