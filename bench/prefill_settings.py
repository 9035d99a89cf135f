"""`python -m bench.prefill_settings`: one cold prefill in a worker's engine, per batch size and
flash-attention setting, in a context of several slots (issue 20's question: where does the
3-slot worker's prefill lose to llama-server's?).

    python -m bench.prefill_settings [--tokens 2048,5569] [--slots 3] [--settings 64:off,...]

Random token ids (100..40000) of each length are prefilled from nothing by
`backend.engine.Engine` (2 threads, CPU), one engine per setting, one after the other: run it
alone on a quiet machine. Prints the seconds and tokens per second.
"""

from __future__ import annotations

import argparse
import random
import time


def prefill_s(model: str, n_tokens: int, ubatch: int, flash_attn: str, slots: int,
              threads: int) -> float:
    from backend.engine import Engine

    rng = random.Random(1)
    ids = [rng.randrange(100, 40000) for _ in range(n_tokens)]
    eng = Engine(model, n_ctx=12288 * slots, n_threads=threads, n_gpu_layers=0, n_batch=ubatch,
                 flash_attn=flash_attn, n_seq=slots)
    t0 = time.perf_counter()
    eng.prefill(0, ids, [], lambda p: None)
    dt = time.perf_counter() - t0
    del eng
    return dt


def main(argv: list[str] | None = None) -> None:
    from proxy.config import Config

    p = argparse.ArgumentParser(prog="python -m bench.prefill_settings",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="2048,5569")
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--settings", default="64:off,64:on,512:off,512:on",
                   help="UBATCH:FLASH_ATTN pairs")
    p.add_argument("--model", default=Config().model_path)
    a = p.parse_args(argv)
    print("| tokens | -ub | -fa | slots | prefill s | tokens/s |")
    print("|---:|---:|---|---:|---:|---:|")
    for n in (int(t) for t in a.tokens.split(",")):
        for setting in a.settings.split(","):
            ub, fa = setting.split(":")
            dt = prefill_s(a.model, n, int(ub), fa, a.slots, a.threads)
            print(f"| {n} | {ub} | {fa} | {a.slots} | {dt:.1f} | {n / dt:.0f} |", flush=True)


if __name__ == "__main__":
    main()
