"""A CPU worker's prefill batch, where no `-ub` is given: measured once on the user's model and
cores, 128 against 512 (`policies.prefix.choose_batch` chooses), and remembered for the next
start (`backend.measured`, under a key of the model, the settings that change a prefill's speed,
the build and the machine).

    engine(spec, make) -> Engine   the worker's engine at the batch in force, said in one line
                                   and in its placement (the ready line, /props)

The measure: slot 0 prefilled with `DEPTH` seeded ids, then the same 512 more prefilled from
there in four batches of 128 and in one of 512, the least of `REPS` runs each, in seconds per
token. Depth matters: with flash attention on, 2 Intel Xeon cores prefilled SmolLM2 as fast at
128 as at 512 at the start of a prompt, 1.13x slower 2K tokens in and 1.20x 4K in; with it off,
as fast at any depth. It runs on an engine made at 512 (a 128-token batch fits it); where 128
wins, the engine is made again at 128, so that its buffers are no larger than they need be.
The self-check then proves exactness at the batch chosen, as at any other.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from backend import measured, selfcheck
from backend.engine import Engine
from backend.keys import CacheIdentity
from policies.prefix import CPU_BATCH, GPU_BATCH, choose_batch

log = logging.getLogger("prefixgate.worker")

REPS = 2
DEPTH = 2048  # tokens before the measured ones: agents' prompts are long, and the gap grows
KIND = "batch"


def measure(eng: Engine) -> dict[int, float]:
    """Seconds per prefilled token in batches of 128 and of 512, `DEPTH` tokens into slot 0
    (left empty); {} where the slot cannot be cut back to that depth (a recurrent state)."""
    depth = max(min(DEPTH, eng.n_ctx - 2 * GPU_BATCH) // GPU_BATCH * GPU_BATCH, 0)
    ids = selfcheck.random_ids(eng, depth + GPU_BATCH, 11)
    least: dict[int, float] = {}
    try:
        eng.truncate(0, 0)
        for i in range(0, depth, GPU_BATCH):
            eng.evaluate([(0, ids[i:i + GPU_BATCH])])
        eng.evaluate([(0, ids[depth:depth + CPU_BATCH])])  # the graph of 128 built once
        for _ in range(REPS):
            for size in (CPU_BATCH, GPU_BATCH):
                if eng.truncate(0, depth) != depth:
                    return {}
                t = time.perf_counter()
                for i in range(depth, depth + GPU_BATCH, size):
                    eng.evaluate([(0, ids[i:i + size])])
                dt = (time.perf_counter() - t) / GPU_BATCH
                least[size] = min(least.get(size, dt), dt)
    finally:
        eng.truncate(0, 0)
    return least


def key(identity: CacheIdentity, settings: Mapping[str, Any]) -> str:
    """The measure's name: the model file and KV settings (the cache identity without its
    batch), the worker's `settings` that change a prefill's speed (threads, where the weights
    go, whether flash attention may be turned off for several slots), the build and the
    machine (`selfcheck.verdict_key`)."""
    identity = dataclasses.replace(identity, batch=0, compute="")
    return selfcheck.verdict_key(identity.fingerprint(), {"measure": KIND, **settings})


def engine(name: str, worker_id: int, make: Callable[[int], Engine]) -> Engine:
    """The engine at the batch measured (or remembered under `name`), with the choice said."""
    kept = measured.recall(KIND, name)
    try:
        token_s = {int(k): float(v) for k, v in kept["token_s"].items()} if kept else None
    except (KeyError, TypeError, ValueError, AttributeError):
        token_s = None
    eng, when = None, "remembered"
    if token_s is None:
        eng = make(GPU_BATCH)
        t = time.perf_counter()
        token_s = measure(eng)
        when = f"measured at start in {time.perf_counter() - t:.1f} s"
        measured.remember(KIND, name, {"token_s": token_s})
    size = choose_batch(token_s)
    if eng is not None and eng.n_batch != size:
        eng.close()
        eng = None
    eng = eng or make(size)
    small, large = token_s.get(CPU_BATCH, 0.0), token_s.get(GPU_BATCH, 0.0)
    speed = (f"{DEPTH} tokens into a prompt a token prefills {small / large:.2f}x as fast in "
             f"batches of {GPU_BATCH} as of {CPU_BATCH}" if small > 0 and large > 0 else
             "not measured: this model's state cannot be cut back")
    note = (f"prefill batch {size} on this CPU ({speed}, {when}; -ub sets it)")
    eng.placement["batch"] = note
    log.info("worker %d: %s", worker_id, note)
    return eng
