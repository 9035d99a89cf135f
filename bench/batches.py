"""Cold prefill speed under each batch rule, side by side in one process (issue 19):

- ``before``: the rule until issue 19: 512-token batches, llama.cpp's repacked CPU weights
  ("extra buffer types") off;
- ``after``: the batch rule on a CPU: 64-token batches, extra buffer types on (llama.cpp's
  default);
- ``after, no repack``: 64-token batches, extra buffer types off;
- batches of 128, 256 and 512 with the extra buffer types: what a larger CPU batch would buy
  (a hit re-prefills up to one batch less a token).

Each arm prefills the same seeded prompt cold REPEATS times, interleaved arm by arm (so a load
change hits all arms alike); the best time of each is reported, with tokens/s and the ratio to
``before``. The engine's own prefill runs the batches (`backend.engine.Engine.prefill`); the
extra buffer types are the model parameter llama.cpp exposes (`use_extra_bufts`, the
engine's `placement["repack"]`).

    python -m bench.batches [--models smollm2,gemma3,qwen35] [--tokens 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass

import numpy as np

from backend.engine import Engine
from tests.models import model_file


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    n_batch: int
    extra_bufts: bool


ARMS = (Arm("before (512, no repack)", 512, False), Arm("after (64, repack)", 64, True),
        Arm("after (64, no repack)", 64, False), Arm("batch 128, repack", 128, True),
        Arm("batch 256, repack", 256, True), Arm("batch 512, repack", 512, True))


def load(path: str, arm: Arm, n_ctx: int, threads: int) -> Engine:
    return Engine(path, n_ctx, threads, 0, n_batch=arm.n_batch,
                  placement={"repack": "on" if arm.extra_bufts else "off"})


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.batches", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2,gemma3,qwen35")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.2f}; {a.tokens} tokens cold, best of {a.repeats}\n")
    print("| model | rule | prefill s | tokens/s | vs before |\n|---|---|---:|---:|---:|")
    for name in a.models.split(","):
        engines = [load(model_file(name), arm, a.tokens + 64, a.threads) for arm in ARMS]
        rng = np.random.default_rng(5)
        ids = [int(t) for t in rng.integers(100, min(engines[0].n_vocab, 30000), a.tokens)]
        best = [float("inf")] * len(ARMS)
        for _ in range(a.repeats):
            for i, eng in enumerate(engines):
                eng.truncate(0, 0)
                t0 = time.perf_counter()
                eng.prefill(0, ids, [], lambda _: None)
                best[i] = min(best[i], time.perf_counter() - t0)
        for arm, s in zip(ARMS, best, strict=True):
            print(f"| {name} | {arm.name} | {s:.2f} | {a.tokens / s:,.0f} | "
                  f"{best[0] / s:.2f}x |")
        for eng in engines:
            eng.close()


if __name__ == "__main__":
    main()
