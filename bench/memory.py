"""Snapshot bytes per token by model and KV configuration (issue 11): what a state file costs on
disk, and what the KV costs in memory, for f16 vs q8_0 KV and a full-size vs a real sliding
window.

    python -m bench.memory [--tokens 2048] [--out bench/results/issue11/memory.md]

Each configuration loads the model in a fresh engine, prefills the same real text (tokenized by
the model's own vocabulary) to `--tokens`, and takes one snapshot there, exactly as a worker
does between prefill segments; the time of that prefill and of restoring the snapshot into the
emptied state are given too (restore/prefill is the disk hit's gain before reading the file).
The models are the test suite's (`make fixtures`): SmolLM2-135M (plain attention), Gemma 3 270M
(sliding window 512; `--swa-full` is prefixgate's default), the random-weight Qwen3.5 hybrid.
A quantized V cache needs flash attention, so the q8_0 rows run with it on.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import llama_cpp

from backend.engine import Engine
from tests.models import model_file

CONFIGS: list[tuple[str, str, dict[str, Any]]] = [  # (model, label, engine settings)
    ("smollm2", "f16", {}),
    ("smollm2", "f16, flash attention", {"flash_attn": "on"}),
    ("smollm2", "q8_0", {"flash_attn": "on", "type_k": "q8_0", "type_v": "q8_0"}),
    ("gemma3", "f16, full window cache", {}),
    ("gemma3", "f16, real window", {"swa_full": False}),
    ("gemma3", "q8_0, full window cache",
     {"flash_attn": "on", "type_k": "q8_0", "type_v": "q8_0"}),
    ("gemma3", "q8_0, real window",
     {"flash_attn": "on", "type_k": "q8_0", "type_v": "q8_0", "swa_full": False}),
    ("qwen35", "f16", {}),
    ("qwen35", "q8_0", {"flash_attn": "on", "type_k": "q8_0", "type_v": "q8_0"}),
]


def text_ids(model: str, n: int) -> list[int]:
    vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    words = " ".join(f"line {i}: the cache restores state instead of computing it again."
                     for i in range(n))
    ids = vocab.tokenize(words.encode(), add_bos=False)
    return ids[:n]


def measure(name: str, settings: dict[str, Any], n: int, threads: int) -> dict[str, float]:
    path = model_file(name)
    ids = text_ids(path, n)
    eng = Engine(path, n + 64, threads, 0, **settings)
    t0 = time.perf_counter()
    eng.prefill(0, ids, [], lambda p: None)
    prefill_s = time.perf_counter() - t0
    state = eng.snapshot(0)
    eng.truncate(0, 0)
    t1 = time.perf_counter()
    eng.restore(0, ids, state)
    restore_s = time.perf_counter() - t1
    eng.close()
    return {"bytes": len(state), "prefill_s": prefill_s, "restore_s": restore_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/issue11/memory.md")
    a = p.parse_args(argv)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    rows, base = [], {}
    for name, label, settings in CONFIGS:
        m = measure(name, settings, a.tokens, a.threads)
        base.setdefault(name, m["bytes"])
        rows.append(f"| {name} | {label} | {m['bytes'] / 2**20:.1f} | {m['bytes'] / a.tokens:,.0f} "
                    f"| {m['bytes'] / base[name]:.2f}x | {m['prefill_s']:.2f} | "
                    f"{m['restore_s'] * 1e3:.1f} | {m['prefill_s'] / m['restore_s']:.0f}x |")
        print(rows[-1], flush=True)
    head = (f"Snapshot of {a.tokens} tokens, {a.threads} threads, CPU "
            f"(`python -m bench.memory`), on {time.strftime('%Y-%m-%d')}.\n\n"
            "| model | KV | snapshot MiB | bytes/token | vs the model's first row | prefill s "
            "| restore ms | prefill/restore |\n|---|---|---|---|---|---|---|---|\n")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(head + "\n".join(rows) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
