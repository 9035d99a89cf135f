"""The start-up self-check: proves, on this machine's build, model, KV types and backend, that a
hit computes exactly what a cold run does, before a worker reuses anything (issue 19).

    run(engine) -> Report

A probe prompt (seeded ids, long enough to pass a batch edge three times and, for a sliding
window, the window plus two batches) is prefilled cold, with snapshots at two batch edges: the
first one and the last one before the prompt's end (past the window). Then, each compared bit
for bit with the cold run's sequence state (every KV cell, and the recurrent state) and its
last logits:

- ``live``: the cold run's live state cut back to a batch edge and extended again (where the
  memory can be cut back: not a recurrent state);
- ``restore``: each snapshot restored into an emptied state and extended to the prompt's end;
- ``slot N restore`` (with several slots): the last snapshot, taken in slot 0, restored into
  the last slot and extended there (compared after moving the result back into slot 0, whose
  sequence id the cold state carries).

A failure names the check and where the states first differ (`backend.layout`). The worker then
serves without reuse and says so in `/health` (the proxy in `/props`, `/metrics` and its ready
line); `--no-exact-check` skips the check, `prefixgate doctor` prints it as a table.

With several slots one more check, ``decode 2-N slots`` (`check_decode`), decides whether decode
steps of several slots may share a llama_decode (`Engine.batch_decode`): each slot's logits from
one llama_decode of the tokens of 2, 3, ... N consecutive slots (llama.cpp runs a run of
consecutive sequence ids as one batch) must equal, bit for bit, its logits from its decode
alone. The slots hold states of different lengths, one past 512 KV cells, so that their KV
views are padded to different sizes. Its failure only keeps the decode steps apart (each slot
decodes alone, as a one-slot worker does); reuse does not depend on it. It fails with flash
attention on a CPU (ggml splits a single query row's attention among the threads past 512
cells, not a row beside others) and on the hybrid models measured (bench/results/issue20/
decode_batch.md). What a pass rests on: that no kernel chooses its order of summation by a
length the check does not reach.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from backend import layout
from backend.engine import Cancel, Engine


@dataclass(frozen=True, slots=True)
class Row:
    check: str  # restore@<n> | live@<n>
    ok: bool
    detail: str  # "" when equal; else where the states first differ


@dataclass(frozen=True, slots=True)
class Report:
    ok: bool
    rows: tuple[Row, ...]
    probe_tokens: int
    seconds: float
    decode: Row | None = None  # `check_decode`; None where it does not apply (one slot, ...)

    @property
    def failure(self) -> str:
        """The first failing check, in words ("" when all pass)."""
        return next((f"{r.check}: {r.detail}" for r in self.rows if not r.ok), "")

    def to_wire(self) -> dict[str, object]:
        return {"ok": self.ok, "probe_tokens": self.probe_tokens,
                "seconds": round(self.seconds, 3), "failure": self.failure,
                "checks": [{"check": r.check, "ok": r.ok, "detail": r.detail}
                           for r in self.rows],
                "batch_decode": None if self.decode is None else {
                    "ok": self.decode.ok, "check": self.decode.check,
                    "detail": self.decode.detail}}


def random_ids(eng: Engine, n: int, seed: int) -> list[int]:
    """n seeded ids of the vocabulary, none that ends generation."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += [int(t) for t in rng.integers(1, int(eng.n_vocab), n) if int(t) not in eng.eog]
    return ids[:n]


def probe_ids(eng: Engine) -> list[int]:
    """Seeded ids, long enough for the checks (within the context), with an end-of-turn token
    a little past the start and past the first batch, so that batches end early there
    (`policies.prefix.Batching`) and the edges are not all multiples of the batch size."""
    a = eng.batching.size
    window = eng.memory.n_swa if eng.memory.kind == "window" else 0
    n = min(max(3 * a, window + 2 * a) + a // 2 + 1, eng.n_ctx - 1)
    ids = random_ids(eng, n, 19)
    ends = sorted(eng.batching.ends)
    if ends:
        for p in (a // 4 + 1, a + a // 2 + 3):
            if p < n - 1:
                ids[p] = ends[0]
    return ids


def run(eng: Engine) -> Report:
    t0 = time.perf_counter()
    if eng.inexact:  # a configuration no check can make exact
        return Report(False, (Row("configuration", False, eng.inexact),), 0, 0.0)
    ids = probe_ids(eng)
    n, edges = len(ids), eng.batching.edges(ids)
    sections = 2 if eng.memory.kind == "window" else 1
    points = sorted({p for p in (edges.next(0), edges.keep_max) if 0 < p < n})
    snaps: dict[int, bytes] = {}
    eng.truncate(0)
    eng.prefill(ids, points, lambda p: snaps.__setitem__(p, bytes(eng.snapshot())), Cancel())
    cold_state, cold_logits = bytes(eng.snapshot()), eng.last_logits()

    def compare(check: str) -> Row:
        state, logits = bytes(eng.snapshot()), eng.last_logits()
        where = layout.first_difference(cold_state, state, sections)
        if where is None and logits.tobytes() != cold_logits.tobytes():
            where = "the KV is equal but the last logits differ"
        return Row(check, where is None, where or "")

    rows = []
    if eng.memory.kind != "recurrent":  # the live state is the cold run's: cut it back first
        cut = max(edges.floor(n // 2), edges.next(eng.floor() - 1)) or edges.next(0)
        if cut < n and eng.truncate(cut) == cut:
            eng.prefill(ids, [], lambda _: None, Cancel())
            rows.append(compare(f"live@{cut}"))
        elif cut < n:
            rows.append(Row(f"live@{cut}", False, "the memory refused the cut"))
    for p in points:
        try:
            eng.restore(ids[:p], snaps[p])
            eng.prefill(ids, [], lambda _: None, Cancel())
            rows.append(compare(f"restore@{p}"))
        except ValueError as e:
            rows.append(Row(f"restore@{p}", False, f"the restore failed: {e}"))
    if len(eng.seqs) > 1 and points:  # a snapshot taken in one slot restores into any slot
        p, other = points[-1], len(eng.seqs) - 1
        try:
            eng.use(other)
            eng.restore(ids[:p], snaps[p])
            eng.prefill(ids, [], lambda _: None, Cancel())
            state, logits = bytes(eng.snapshot()), eng.last_logits()
            eng.truncate(0)
            eng.use(0)
            eng.restore(ids, state)  # back in slot 0: the same sequence id as the cold state
            where = layout.first_difference(cold_state, bytes(eng.snapshot()), sections)
            if where is None and logits.tobytes() != cold_logits.tobytes():
                where = "the KV is equal but the last logits differ"
            rows.append(Row(f"slot {other} restore@{p}", where is None, where or ""))
        except ValueError as e:
            rows.append(Row(f"slot {other} restore@{p}", False, f"the restore failed: {e}"))
        finally:
            eng.use(other)
            eng.truncate(0)
            eng.use(0)
    decode = None
    if len(eng.seqs) > 1:
        decode = check_decode(eng, [(ids, cold_state)] + [(ids[:p], snaps[p]) for p in points])
    eng.truncate(0)
    eng.exact_n = 0
    return Report(all(r.ok for r in rows), tuple(rows), n, time.perf_counter() - t0, decode)


DECODE_LONG = 520  # tokens of the longest state in `check_decode`: a KV view past 512 cells


def check_decode(eng: Engine, states: list[tuple[list[int], bytes]]) -> Row:
    """Decode steps of several slots in one llama_decode against each alone (module
    docstring). `states`: (ids, state) of this engine, the first one extended here past
    DECODE_LONG tokens; slot s holds the s-th (in turn), restored before every decode, and
    decodes the same token each time. Leaves every slot empty."""
    slots, check = len(eng.seqs), f"decode 2-{len(eng.seqs)} slots"
    was = eng.batch_decode
    try:
        ids, state = states[0]
        long_ids = ids + random_ids(eng, max(min(DECODE_LONG, eng.n_ctx - 2) - len(ids), 0), 20)
        eng.use(0)
        eng.restore(ids, state)
        eng.prefill(long_ids, [], lambda _: None, Cancel())
        held = [(long_ids, bytes(eng.snapshot()))] + states[1:]

        def decode(run: list[int]) -> list[np.ndarray]:
            for s in run:
                eng.use(s)
                ids, state = held[s % len(held)]
                eng.restore(ids, state)
                eng.seq.next = ids[1]
            eng.decode_next(run)
            out = []
            for s in run:
                eng.use(s)
                out.append(eng.last_logits())
            return out

        alone = [decode([s])[0] for s in range(slots)]
        eng.batch_decode = True
        for k in range(2, slots + 1):
            for first in range(slots - k + 1):
                run = list(range(first, first + k))
                for s, logits in zip(run, decode(run), strict=True):
                    if logits.tobytes() != alone[s].tobytes():
                        diff = float(np.max(np.abs(logits - alone[s])))
                        return Row(check, False, f"slot {s} decoded with slots {run[0]}-"
                                                 f"{run[-1]} ({len(held[s % len(held)][0])} "
                                                 f"tokens): its logits differ from its decode "
                                                 f"alone by up to {diff:.3g}")
        return Row(check, True, "")
    except (ValueError, RuntimeError) as e:
        return Row(check, False, f"the check could not run: {e}")
    finally:
        eng.batch_decode = was
        for s in range(slots):
            eng.use(s)
            eng.seq.next = -1
            eng.truncate(0)
        eng.use(0)
