"""What a CPU worker measures once on the user's model and cores before it serves, and remembers
for the next start (`backend.measured`, under a key of the model, the settings that change a
prefill's speed, the build and the machine):

- its prefill batch, where no `-ub` is given: 128 against 512 (`policies.prefix.choose_batch`);
- with flash attention, which short prefill batches it pads to a tile of 64 rows
  (`policies.prefix.Padding`, `choose_padding`).

    engine(name, worker_id, make, batch, types) -> Engine   the engine as measured, each
                                   choice said in one line and in its placement (the ready
                                   line, /props); the padding in its compute identity

The measure: slot 0 prefilled with `DEPTH` seeded ids, batches of 16, 32, 48 and 64 rows from
there; then prefilled on to `BATCH_DEPTH`, and from there the same 512 ids in four batches of
128 and in one of 512; the least of `REPS` runs each. Depth matters, and agents' prompts are
deep: with flash attention on, 2 Intel Xeon cores prefilled SmolLM2 as fast at 128 as at 512
at the start of a prompt, 1.13x slower 2K tokens in and 1.20x 4K in; 2 AMD EPYC cores 1.05x
slower 1-2K in (which a measure there read as 0.99x, and took 128) and 1.13-1.17x 3-5K in,
where the agent team took 176 s at 128 against 163 s at 512 (bench/results/issue41); with
flash attention off, 128 was as fast or faster at any depth. It runs on an
engine made at 512 (where the batch is measured); where 128 wins, the engine is made again at
128, so that its buffers are no larger than they need be. The self-check then proves
exactness with the batch and padding chosen, as with any other.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from backend import measured, selfcheck, verdicts
from backend.engine import Engine
from backend.keys import CacheIdentity
from policies.prefix import (
    CPU_BATCH,
    FA_TILE,
    GPU_BATCH,
    Padding,
    choose_batch,
    choose_padding,
)

log = logging.getLogger("prefixgate.worker")

REPS = 2
DEPTH = 2048  # tokens before the padded batches measured: where a short batch costs a tile
BATCH_DEPTH = 4096  # before the batch's measure: agents' prompts are long, and the gap grows
AFTER = 2 * GPU_BATCH  # the slot's room each depth leaves after it: the batches measured there
PAD_ROWS = (16, 32, 48, FA_TILE)
KIND = "batch"
VERSION = 3  # of what is measured: another version measures again


def pads_here(eng: Engine, type_k: str, type_v: str) -> bool:
    """Whether short batches may take ggml's tiled flash attention here: the attention computed
    on the CPU with flash attention (on, or llama.cpp's auto, which takes it on a CPU), K and V
    of one type the tiled kernel reads (f16, f32), a memory that can drop the padding's cells
    again, and batches of a tile or more."""
    return (eng.placement.get("gpu_layers") == 0 and eng.flash_attn in ("on", "auto")
            and type_k == type_v and type_k in ("f16", "f32") and eng.pads
            and eng.n_batch >= FA_TILE)


def measure(eng: Engine, batch: bool, pad: bool,
            progress: Callable[[float], None] | None = None) -> dict[str, Any]:
    """{"depth", "pad_s": seconds of a batch of each of PAD_ROWS rows `depth` tokens into slot 0
    (where `pad`), "batch_depth", "token_s": seconds per prefilled token in batches of 128 and
    512 `batch_depth` tokens in (where `batch`)}; slot 0 is left empty; the parts that could
    not be measured (a state that cannot be cut back) are left out. `progress`: told the
    share of the tokens to evaluate evaluated, after each batch (a big model on a CPU measures
    for minutes on its first start)."""
    batch, step = batch and eng.n_batch >= GPU_BATCH, eng.n_batch
    pad = pad and step >= FA_TILE
    if not batch and not pad:
        return {}

    def room(d: int) -> int:
        return max(min(d, eng.n_ctx - AFTER) // step * step, 0)
    depth, batch_depth = room(DEPTH), room(BATCH_DEPTH) if batch else 0
    ids = selfcheck.random_ids(eng, max(depth, batch_depth) + GPU_BATCH, 11)
    out: dict[str, Any] = {"depth": depth}
    least: dict[int, float] = {}
    planned = max(depth + REPS * sum(PAD_ROWS) * pad + (
        batch_depth - depth + CPU_BATCH + REPS * 2 * GPU_BATCH if batch else 0), 1)
    done = 0

    def evaluate(b: list[int]) -> None:
        nonlocal done
        eng.evaluate([(0, b)])
        done += len(b)
        if progress is not None:
            progress(min(done / planned, 1.0))

    def timed(at: int, key: int, batches: list[list[int]]) -> bool:
        if eng.truncate(0, at) != at:
            return False
        t = time.perf_counter()
        for b in batches:
            evaluate(b)
        dt = time.perf_counter() - t
        least[key] = min(least.get(key, dt), dt)
        return True

    def prefill(start: int, end: int) -> bool:
        if eng.truncate(0, start) != start:
            return False
        for i in range(start, end, step):
            evaluate(ids[i:i + step])
        return True
    try:
        prefill(0, depth)
        for _ in range(REPS):
            for n in PAD_ROWS if pad else ():
                if not timed(depth, n, [ids[depth:depth + n]]):
                    return out
        if least:
            out["pad_s"] = dict(least)
        least = {}
        if not batch or not prefill(depth, batch_depth):
            return out
        out["batch_depth"] = batch_depth
        at = batch_depth
        evaluate(ids[at:at + CPU_BATCH])  # the graph of 128 built once
        for _ in range(REPS):
            for size in (CPU_BATCH, GPU_BATCH):
                if not timed(at, size, [ids[i:i + size] for i in range(at, at + GPU_BATCH,
                                                                        size)]):
                    return out
        if least:
            out["token_s"] = {k: v / GPU_BATCH for k, v in least.items()}
    finally:
        eng.truncate(0, 0)
    return out


def key(identity: CacheIdentity, settings: Mapping[str, Any]) -> str:
    """The measure's name: the model file and KV settings (the cache identity without its
    batch, and with as much of one slot's context as the measure can use), the worker's
    `settings` that change a prefill's speed (the batch given, threads, where the weights go,
    whether flash attention may be turned off for several slots), the build and the machine
    (`verdicts.verdict_key`).

    Not the number of slots: the measure prefills slot 0 alone, in a KV stream of its own, so
    `-np 1 -c 12288` and `-np 3 -c 36864` (one slot's context alike) share one measure and so
    one batch. Measured apart, their readings fell either side of `policies.prefix.BATCH_GAIN`
    on one machine (1.05x and 1.11x), chose 128 and 512, and the 128 prefilled 1.3% more of an
    agent team (bench/results/issue41)."""
    room = min(identity.n_ctx, BATCH_DEPTH + AFTER)  # beyond it the measure reads the same
    identity = dataclasses.replace(identity, batch=0, compute="", n_ctx=room)
    return verdicts.verdict_key(identity.fingerprint(), {"measure": KIND, "version": VERSION,
                                                      **settings})


def _seconds(d: Any) -> dict[int, float]:
    return {int(k): float(v) for k, v in d.items()} if isinstance(d, dict) else {}


def engine(name: str, worker_id: int, make: Callable[[int], Engine], batch: int,
           types: tuple[str, str], progress: Callable[[float], None] | None = None) -> Engine:
    """The engine at the batch given or measured, with the padding measured where it may pay
    (or both remembered under `name`), each choice said; `progress`: the measure's (`measure`)."""
    kept = measured.recall(KIND, name)
    eng, when = None, "remembered"
    if kept is None:
        eng = make(batch or GPU_BATCH)
        if batch and not pads_here(eng, *types):
            return eng  # nothing to measure
        t = time.perf_counter()
        kept = measure(eng, not batch, pads_here(eng, *types), progress)
        when = f"measured at start in {time.perf_counter() - t:.1f} s"
        measured.remember(KIND, name, kept)
    token_s, pad_s = _seconds(kept.get("token_s")), _seconds(kept.get("pad_s"))
    size = batch or choose_batch(token_s)
    if eng is not None and eng.n_batch != size:
        eng.close()
        eng = None
    eng = eng or make(size)
    depth = int(kept.get("depth", 0))
    if not batch:
        small, large = token_s.get(CPU_BATCH, 0.0), token_s.get(GPU_BATCH, 0.0)
        speed = (f"{int(kept.get('batch_depth', depth))} tokens into a prompt a token "
                 f"prefills {small / large:.2f}x as fast in "
                 f"batches of {GPU_BATCH} as of {CPU_BATCH}" if small > 0 and large > 0 else
                 "not measured: this model's state cannot be cut back")
        eng.placement["batch"] = f"prefill batch {size} on this CPU ({speed}, {when}; -ub sets it)"
        log.info("worker %d: %s", worker_id, eng.placement["batch"])
    if pads_here(eng, *types):
        eng.padding = choose_padding(pad_s, depth) if size >= FA_TILE else Padding()
        if eng.padding.least:
            eng.compute += f"; {eng.padding}"  # other bits than unpadded: other cache keys
        shown = ", ".join(f"{n} rows {s * 1000:.0f} ms" for n, s in sorted(pad_s.items()))
        eng.placement["padding"] = (f"{eng.padding or 'no flash attention batch padded'} ("
                                    f"{depth} tokens in: {shown or 'not measured'}; {when})")
        log.info("worker %d: %s", worker_id, eng.placement["padding"])
    return eng
