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

    @property
    def failure(self) -> str:
        """The first failing check, in words ("" when all pass)."""
        return next((f"{r.check}: {r.detail}" for r in self.rows if not r.ok), "")

    def to_wire(self) -> dict[str, object]:
        return {"ok": self.ok, "probe_tokens": self.probe_tokens,
                "seconds": round(self.seconds, 3), "failure": self.failure,
                "checks": [{"check": r.check, "ok": r.ok, "detail": r.detail}
                           for r in self.rows]}


def probe_ids(eng: Engine) -> list[int]:
    """Seeded ids, long enough for the checks (within the context), with an end-of-turn token
    a little past the start and past the first batch, so that batches end early there
    (`policies.prefix.Batching`) and the edges are not all multiples of the batch size."""
    a = eng.batching.size
    window = eng.memory.n_swa if eng.memory.kind == "window" else 0
    n = min(max(3 * a, window + 2 * a) + a // 2 + 1, eng.n_ctx - 1)
    n_vocab = int(eng.n_vocab)
    rng = np.random.default_rng(19)
    ids: list[int] = []
    while len(ids) < n:
        ids += [int(t) for t in rng.integers(1, n_vocab, n) if int(t) not in eng.eog]
    ids = ids[:n]
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
    eng.truncate(0)
    eng.exact_n = 0
    return Report(all(r.ok for r in rows), tuple(rows), n, time.perf_counter() - t0)
