"""`python -m bench.slot_share`: how the worker's scheduler shares one llama thread between a
slot that answers and a slot that prefills a long prompt beside it (issue 20).

    python -m bench.slot_share [--model GGUF] [--prompt 4096] [--answer 128] [--ubatch-size N]
        [--flash-attn auto]

Two slots of one engine (`backend.worker.Scheduler`, real llama.cpp calls): slot 0 prefills a
short prompt (256 tokens) and answers `--answer` greedy tokens; slot 1 prefills `--prompt`
tokens cold, submitted first. Then each alone, one after the other. Prints the seconds until
the answer's last token and until the prefill's end, beside each alone: what the answer pays
for the prefill beside it, and the prefill for the answer. Run it alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator


def main(argv: list[str] | None = None) -> None:
    from backend.engine import Cancel, Engine, Sampling
    from backend.worker import Scheduler
    from policies.prefix import default_batch
    from proxy.config import Config

    p = argparse.ArgumentParser(prog="python -m bench.slot_share",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=Config().model_path)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--answer", type=int, default=128)
    p.add_argument("--ubatch-size", type=int, default=default_batch(0))
    p.add_argument("--flash-attn", default="auto")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    rng = random.Random(1)
    short = [rng.randrange(100, 20000) for _ in range(256)]
    long = [rng.randrange(100, 20000) for _ in range(a.prompt)]
    eng = Engine(a.model, 2 * (a.prompt + 512), a.threads, 0, n_batch=a.ubatch_size,
                 flash_attn=a.flash_attn, n_seq=2)
    ends: dict[str, float] = {}
    t0 = 0.0

    def answer() -> Iterator[int | None]:
        yield from eng.prefill_steps(short, [], lambda _: None, Cancel())
        n = 0
        for _ in eng.generate(Sampling(temperature=0), a.answer, Cancel()):
            n += 1
            yield None  # a generated token: no prefill left
        ends["answer"] = time.perf_counter() - t0
        ends["tokens"] = n

    def prefill() -> Iterator[int | None]:
        yield from eng.prefill_steps(long, [], lambda _: None, Cancel())
        ends["prefill"] = time.perf_counter() - t0

    def run(jobs: list[tuple[int, Iterator[int | None]]]) -> None:
        nonlocal t0
        for slot in (0, 1):
            eng.use(slot)
            eng.truncate(0)
        sched = Scheduler(eng)
        t0 = time.perf_counter()
        for d in [sched.submit(slot, steps) for slot, steps in jobs]:
            d.result()
        sched.stop()

    run([(1, prefill()), (0, answer())])
    both = dict(ends)
    run([(0, answer())])
    run([(1, prefill())])
    eng.close()

    def row(what: str, key: str) -> str:
        return f"| {what} | {both[key]:.1f} | {ends[key]:.1f} | {both[key] / ends[key]:.2f}x |"

    print("| what | beside the other s | alone s | ratio |\n|---|---:|---:|---:|")
    print(row(f"answer: {a.answer} tokens after a 256-token prompt ({ends['tokens']:.0f} "
              "generated)", "answer"))
    print(row(f"prefill: {a.prompt} tokens cold", "prefill"))


if __name__ == "__main__":
    main()
