"""Speculative decoding on the engine: a verify step, the start-up measure of what a verify costs,
and what the worker's memory allows (policies.speculate has the rules).

    verify(engine, samplers, step, core) -> inputs   one llama_decode of each slot's waiting token
                                                     and its draft, every row's logits; rows
                                                     sampled in order until one differs; the
                                                     rejected drafts cut back
    resolve(config, engine, key, worker_id) -> Speculation   at start, said in one line

**The KV holds exactly the accepted tokens.** After a verify the slot is cut back (the engine's
`truncate`) to the waiting token and the accepted drafts; the step's last sample waits for the
next step, as a single sample does. Generated tokens are never reused (`exact_n` stays the
prompt's end), so the cache is untouched; a verify computes other bits than one-token steps do,
so a greedy answer with drafts can differ from one without (`--spec-type none`), and a cache
hit, which drafts and verifies what its cold run did, answers as its cold run.

**Where it drafts.** Plain attention and a full-size sliding window cut back to any position.
A recurrent or hybrid state (Qwen3.5, Mamba, ...) exists at its last position only; where
llama.cpp keeps the states after each of a llama_decode's last tokens for its architecture
(`n_rs_seq`: Qwen3.5/3.6, Nemotron-H, LFM2, ...), the worker asks for `--spec-draft-n-max` of
them and a verify's rejected drafts are cut off through them (`Memory.rollback`), once per
verify, with no copy of the state. Elsewhere a rejected draft could only be undone by a copy of
the state taken before every verify (llama-server's checkpoints): not done here, so such a
model does not draft (said at start). A real sliding window (`--no-swa-full`) may not cut back
either: no drafts.

**The cost** of a verify of r rows over a one-row step is measured once at start, on slot 0
beside a short probe (the least of REPS runs of each size, after a warm-up), and remembered for
the same model, settings, build and machine as the self-check's verdict is: the stop rule reads
it, and being fixed it keeps a hit's verify batches its cold run's. `prefixgate doctor` is not
needed to measure again: a changed setting, build or machine has another key.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import llama_cpp
import xxhash

from backend import measured
from backend.engine import Engine
from backend.sampling import Sampler
from backend.worker.core import Core
from backend.worker.draft_model import DraftModel
from backend.worker.drafts import Speculation
from backend.worker.messages import Failed, Filling, Input, Sampled, Stepped, Verified
from policies.schedule import Verify
from policies.speculate import MODEL_TOKEN, SpecConfig, VerifyCost

log = logging.getLogger("prefixgate.worker")

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # sizes measured, up to the longest
REPS = 3
PROBE_TOKENS = 64
# the most rollback states a recurrent model keeps (llama.cpp's n_rs_seq), so its longest draft:
# each is one more recurrent state per slot (an ngram-mod draft of 64 would be 64 more)
ROLLBACK_MAX = 16
COMPARED = " Greedy answers can differ from --spec-type none's (a verify computes other bits " \
           "than one-token steps); a cache hit answers as its cold run."


def _model_draft(eng: Engine, core: Core, slot: int, places: int) -> list[int] | None:
    """A draft model's tokens for a draft of `places` (backend.worker.draft_model); None
    while it prefills the prompt, a batch a step."""
    spec = core.spec
    assert spec is not None and spec.model is not None
    j, q = core.jobs[slot], eng.seqs[slot]
    got = spec.model.draft(slot, j.job.run_id, core.owners[slot], j.job.ids,
                           q.ids[: q.n_live], core.waiting(slot), places,
                           spec.config.draft_p_min)
    return got if got is None or len(got) >= spec.config.draft_n_min else []


def verify(eng: Engine, samplers: Mapping[int, Sampler], step: Verify, core: Core
           ) -> list[Input]:
    t = time.perf_counter()
    drafts = {s: core.draft(s) for s in step.slots}
    out: list[Input] = []
    filling = []
    for s, d in list(drafts.items()):
        if d and d[0] == MODEL_TOKEN:
            try:
                got = _model_draft(eng, core, s, len(d))
            except (RuntimeError, ValueError) as ex:  # the draft model failed: that job fails
                out.append(Failed(s, f"the draft model: {type(ex).__name__}: {ex}"))
                del drafts[s]
                continue
            if got is None:  # a batch of its prompt done: the token waits
                filling.append(s)
                del drafts[s]
            else:
                drafts[s] = got
    slots = list(drafts)
    if not slots:
        dt = time.perf_counter() - t
        return [*out, *(Filling(s, dt) for s in filling)]
    before = {s: eng.seqs[s].n_live for s in slots}
    try:
        eng.evaluate([(s, [core.waiting(s), *drafts[s]]) for s in slots],
                     every=[s for s in slots if drafts[s]])
    except (RuntimeError, ValueError) as ex:
        return [*out, *(Failed(s, f"{type(ex).__name__}: {ex}") for s in slots)]
    dt = time.perf_counter() - t
    out += [Filling(s, dt) for s in filling]
    for s in slots:
        draft = drafts[s]
        if not draft:
            out.append(Stepped(s, dt))
            continue
        samples: list[Sampled] = []
        for i in range(len(draft) + 1):
            token = eng.sample(s, samplers[s], i)
            eog = token in eng.eog
            samples.append(Sampled(s, token, b"" if eog else eng.piece(token), eog))
            if i == len(draft) or token != draft[i] or eog:
                break
        keep = before[s] + len(samples)  # the waiting token and the accepted drafts
        if eng.truncate(s, keep) != keep:
            out.append(Failed(s, "the rejected drafts could not be cut back"))
            continue
        out.append(Verified(s, dt, tuple(samples), tuple(draft)))
    return out


def measure(eng: Engine, n_max: int) -> VerifyCost:
    """Seconds of a verify of each size in ROWS up to n_max + 1 rows (and the batch) over one
    step of one row, on slot 0, which is left empty."""
    from backend.selfcheck import random_ids

    top = min(n_max + 1, eng.n_batch)
    rows = sorted({r for r in ROWS if r <= top} | {top})
    ids = random_ids(eng, PROBE_TOKENS + top, 7)
    eng.truncate(0, 0)
    eng.prefill(0, ids[:PROBE_TOKENS])
    base = eng.seqs[0].n_live
    # a recurrent state cannot be cut back by all of a verify's rows: restored instead
    state = bytes(eng.snapshot(0)) if eng.memory.kind == "recurrent" else None
    least: dict[int, float] = {}
    try:
        for r in rows:
            for rep in range(REPS + 1):  # the first builds the graph of this shape
                t = time.perf_counter()
                eng.evaluate([(0, ids[base:base + r])], every=[0] if r > 1 else [])
                dt = time.perf_counter() - t
                if eng.truncate(0, base) != base and state is not None:
                    eng.restore(0, ids[:base], state)
                if rep:
                    least[r] = min(least.get(r, dt), dt)
    finally:
        eng.truncate(0, 0)
    one = least[1]
    return VerifyCost(tuple(rows), tuple(least[r] / one for r in rows))


def _recall(key: str) -> VerifyCost | None:
    data = measured.recall("speculation", key)
    try:
        return None if data is None else VerifyCost.from_wire(data)
    except (KeyError, TypeError, ValueError) as e:
        log.warning("ignoring the remembered verify cost (%s): measuring again", e)
        return None


def _remember(key: str, cost: VerifyCost) -> None:
    measured.remember("speculation", key, cost.to_wire())


def _ratio_at(cost: VerifyCost, k: int) -> str:
    return f"a verify of {k} drafts costs {cost.ratio(1 + k):.2f}x a step"


def resolve(config: SpecConfig, eng: Engine, key: str, worker_id: int,
            model: DraftModel | None = None) -> Speculation:
    """The worker's speculation: off where its memory cannot draft, else the verify cost
    (remembered under `key`, else measured), in one log line."""
    why = ""
    if not config.on:
        return Speculation(config, None, eng.n_batch, False, "speculation off (--spec-type "
                           "none)")
    with_model = f" with the draft model {os.path.basename(model.path)}" if model else ""
    if eng.memory.kind == "recurrent" and not eng.memory.rollback:
        why = ("a recurrent state cannot be cut back to the accepted drafts (backend."
               "worker.verify); llama.cpp keeps rollback states for some architectures only")
    elif eng.memory.kind == "window" and not eng.memory.full:
        why = "a real sliding window (--no-swa-full) may not cut back to the accepted drafts"
    if why:
        note = f"speculation off on this model: {why}; --spec-type {config.name()} does nothing"
        log.info("worker %d: %s", worker_id, note)
        return Speculation(config, None, eng.n_batch, False, note, model)
    bound = eng.memory.rollback  # a recurrent state's (0 elsewhere)
    n_max = Speculation(config, None, eng.n_batch, True, "", None, bound).n_max
    kept = _rollback_note(eng)
    if config.always:
        note = (f"speculation {config.name()}{with_model}: every draft verified, up to {n_max} "
                f"tokens (--spec-stop off, as llama-server does){kept}.{COMPARED}")
        log.info("worker %d: %s", worker_id, note)
        return Speculation(config, None, eng.n_batch, True, note, model, bound)
    cost = _recall(key) if key else None
    where = "remembered"
    if cost is None or cost.rows[-1] < min(n_max + 1, eng.n_batch):
        cost, where = measure(eng, n_max), "measured at start"
        if model is not None:
            cost = replace(cost, draft_step=model.measure(eng))
        if key:
            _remember(key, cost)
    k = min(8, n_max)
    step = f", a draft model's step {cost.draft_step:.2f}x" if model is not None else ""
    if cost.pays_for(config, n_max):
        note = (f"speculation {config.name()}{with_model}: {_ratio_at(cost, k)}{step} "
                f"({where}): each slot verifies the drafts its acceptance pays for{kept}."
                f"{COMPARED}")
    else:
        note = (f"speculation {config.name()} does not pay here: {_ratio_at(cost, k)}{step} "
                f"({where}), so no slot drafts (--spec-stop off verifies every draft)")
    log.info("worker %d: %s", worker_id, note)
    return Speculation(config, cost, eng.n_batch, True, note, model, bound)


def _rollback_note(eng: Engine) -> str:
    """What a recurrent state's rollback states cost, for the note ("" where it has none):
    the size of slot 0's recurrent state, one token evaluated there if it is empty (an empty
    sequence's is a few bytes)."""
    if not eng.memory.rollback:
        return ""
    empty = eng.seqs[0].n_live == 0
    if empty:
        eng.evaluate([(0, [0])])
    per = int(llama_cpp.llama_state_seq_get_size_ext(eng.ctx, 0, 1))  # PARTIAL_ONLY: recurrent
    if empty:
        eng.truncate(0, 0)
    return (f"; a recurrent state: drafts of up to {eng.memory.rollback} tokens, cut off "
            f"through {eng.memory.rollback} rollback states per slot that llama.cpp keeps "
            f"({eng.memory.rollback * per / 2**20:.1f} MiB a slot)")


def cost_key(verdict_key: str, config: SpecConfig, draft_model: str = "") -> str:
    """The name of a remembered verify cost: the self-check's verdict key (model, settings,
    build, machine), the longest draft, and the draft model's file (its path, size, time)."""
    if not verdict_key:
        return ""
    st = os.stat(draft_model) if draft_model else None
    model = f"{draft_model}:{st.st_size}:{st.st_mtime_ns}" if st is not None else ""
    return xxhash.xxh3_128_hexdigest(f"{verdict_key}:{config.n_max}:{model}".encode())


def report(spec: Speculation | None, core: Core, running: Any) -> dict[str, Any]:
    """What /health and /props say of speculation: the setting, its note, the verify cost at
    start and as measured while serving (`running`: policies.costs.Fit of a step's seconds
    over its rows), and the drafted and accepted tokens per source."""
    if spec is None:
        return {}
    fixed, per_row = running.solve() if running.n else (0.0, 0.0)
    one = fixed + per_row
    return {"type": spec.config.name(), "stop": "off" if spec.config.always else "auto",
            "drafts": spec.on, "memory_drafts": spec.drafts, "note": spec.note,
            "cost_at_start": spec.cost.to_wire() if spec.cost is not None else None,
            "cost_running": {str(r): round((fixed + per_row * r) / one, 3)
                             for r in (1, 2, 4, 8, 16, 32, 64)} if one > 0 else None,
            "steps_measured": running.n,
            "sources": {s: {"drafted": d, "accepted": a, "verifies": v}
                        for s, (d, a, v) in sorted(dict(core.drafted).items())},
            **({"draft_model_prompt": dict(spec.model.prompt)} if spec.model is not None
               else {})}
