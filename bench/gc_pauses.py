"""`python -m bench.gc_pauses`: what CPython's cyclic garbage collector costs the proxy's
requests, with its default threshold and with the one `prefixgate serve` sets
(`proxy.cli.GC_GEN0_THRESHOLD`).

    python -m bench.gc_pauses [--tokens 32000] [--requests 1500]

As `bench.overhead`: one synthetic agent session grown to `--tokens`, its earlier turns served,
then `--requests` requests re-sending the history with a new user turn, each parsed and
prepared as the gateway does (wall ms). Each setting runs in a process of its own (a
threshold changes what the heap holds). Reports the request time's p50 / p90 / p99 / max and
the collections seen (`gc.callbacks`): how many, their total and longest pause.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from typing import Any


def measure(tokens: int, requests: int, threshold: int | None) -> dict[str, Any]:
    from bench.overhead import session_rows, with_new_turn
    from bench.prompts import load_builder, prepare, prepare_request
    from proxy import edge, limits, openai_api

    builder = load_builder()
    rows = session_rows(tokens, builder)
    for row in rows[:-1]:
        prepare(builder, row)
    raws = [json.dumps(with_new_turn(rows[-1], i)).encode() for i in range(requests)]
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started[0]) * 1e3)

    if threshold is not None:
        gc.set_threshold(threshold, *gc.get_threshold()[1:])
    gc.callbacks.append(on_gc)
    times = []
    for raw in raws:
        t0 = time.perf_counter()
        prepare_request(builder, edge.parse_body(raw, "", openai_api.parse_chat, limits.LIMITS))
        times.append((time.perf_counter() - t0) * 1e3)
    gc.callbacks.remove(on_gc)
    times.sort()

    def q(p: float) -> float:
        return times[min(len(times) - 1, int(p * len(times)))]

    return {"threshold": gc.get_threshold()[0], "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "max": times[-1], "mean": sum(times) / len(times), "collections": len(pauses),
            "gc_ms": sum(pauses), "longest_gc_ms": max(pauses, default=0.0)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gc_pauses",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32000)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--threshold", type=int, help=argparse.SUPPRESS)  # one setting, in-process
    a = p.parse_args(argv)
    if a.threshold is not None:
        print(json.dumps(measure(a.tokens, a.requests, a.threshold or None)))
        return
    from proxy.cli import GC_GEN0_THRESHOLD

    print(f"{a.requests} requests at {a.tokens} tokens, wall ms per request (parse + prepare)")
    print("| gen0 threshold | p50 | p90 | p99 | max | mean | collections | their total ms "
          "| longest |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for threshold in (0, GC_GEN0_THRESHOLD):  # 0: the interpreter's default
        out = subprocess.run([sys.executable, "-m", "bench.gc_pauses", "--tokens",
                              str(a.tokens), "--requests", str(a.requests), "--threshold",
                              str(threshold)], check=True, capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {r['threshold']} | {r['p50']:.2f} | {r['p90']:.2f} | {r['p99']:.2f} | "
              f"{r['max']:.2f} | {r['mean']:.2f} | {r['collections']} | {r['gc_ms']:.0f} | "
              f"{r['longest_gc_ms']:.1f} |")


if __name__ == "__main__":
    main()
