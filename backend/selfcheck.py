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
  sequence id the cold state carries);
- ``verify`` (where the memory can be cut back, as speculation needs: not a recurrent state):
  verify batches of `VERIFY_ROWS` rows (a waiting token and its draft, logits for every row,
  as `backend.worker.verify` evaluates them; below a flash-attention tile and past one) after
  the cold prompt, and the same after its state restored into slot 0 and into the last slot:
  every row's logits compared bit for bit. With them a hit drafts, verifies and answers as its
  cold run with speculation on (issue 47).

A failure names the check and where the states first differ (`backend.layout`). The worker then
serves without reuse and says so in `/health` (the proxy in `/props`, `/metrics` and its ready
line); `--no-exact-check` skips the check, `prefixgate doctor` prints it as a table.

With several slots one more check (`check_decode`) measures what decode steps of several slots
do to a slot's logits (`policies.schedule.Proof`), from which `--deterministic` chooses their
shape (`policies.schedule.choose_decode`):
- batched as they come: whether each slot's logits from one llama_decode of the tokens of 2,
  3, ... N consecutive slots (llama.cpp runs a run of consecutive sequence ids as one batch)
  equal, bit for bit, its logits from its decode alone;
- where a cell can be dropped again (plain attention, a full-size window: `Engine.pads`), the
  fixed shape (every step one row per slot, padding rows in the slots that do not generate):
  whether each slot's logits in it are the same with the other slots empty, idle (their padding
  rows, which leave their states as they were) and decoding, and what a slot generating alone
  pays for it (its step in the shape over alone, the least of `COST_STEPS`);
- what running all slots' steps apart costs against one batched step of them.
The slots hold states of different lengths, one past 512 KV cells, so that their KV views are
padded to different sizes. Reuse does not depend on this check. Batched as they come changes
the logits with flash attention on a CPU (ggml splits a single query row's attention among the
threads past 512 cells, not a row beside others), on f16 weights on a CPU (one row multiplies
in another order than several), on CUDA and on the hybrid models measured
(bench/results/issue20/decode_batch.md); the fixed shape holds, bit for bit, for the first two,
but there costs a lone step more than `auto` takes. What a pass rests on: that no kernel
chooses its order of summation by a length the check does not reach.

A passing verdict is remembered under a key of everything it proves (`backend.verdicts`), so a
restart with nothing changed skips the check; `prefixgate doctor` always checks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from backend import layout
from backend.context import DecodeShape
from backend.engine import Engine
from policies.prefix import FA_TILE, Edges
from policies.schedule import Proof

log = logging.getLogger(__name__)


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
    decode: Proof | None = None  # `check_decode`; None where it does not apply (one slot)

    @property
    def failure(self) -> str:
        """The first failing check, in words ("" when all pass)."""
        return next((f"{r.check}: {r.detail}" for r in self.rows if not r.ok), "")

    def to_wire(self) -> dict[str, object]:
        return {"ok": self.ok, "probe_tokens": self.probe_tokens,
                "seconds": round(self.seconds, 3), "failure": self.failure,
                "checks": [{"check": r.check, "ok": r.ok, "detail": r.detail}
                           for r in self.rows],
                "decode": None if self.decode is None else proof_to_wire(self.decode)}


def proof_to_wire(p: Proof) -> dict[str, object]:
    return {"batched": p.batched, "fixed": p.fixed, "fixed_cost": round(p.fixed_cost, 3),
            "apart_cost": round(p.apart_cost, 3)}


def proof_from_wire(d: object) -> Proof:
    """A remembered verdict's decode proof; ValueError where it is not one (the verdict is then
    not taken: the check runs again)."""
    if not isinstance(d, dict):
        raise ValueError(f"malformed decode proof {d!r}")
    fixed, batched = d.get("fixed"), d.get("batched")
    costs = [d.get("fixed_cost"), d.get("apart_cost")]
    if not isinstance(batched, str) or not (fixed is None or isinstance(fixed, str)) or not all(
            isinstance(c, int | float) and not isinstance(c, bool) and c >= 0 for c in costs):
        raise ValueError(f"malformed decode proof {d!r}")
    return Proof(True, batched, fixed, float(costs[0]), float(costs[1]))


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
    (`policies.prefix.Batching`) and the edges are not all multiples of the batch size; where
    the engine pads short batches, two more that leave a last batch it pads."""
    a = eng.batching.size
    window = eng.memory.n_swa if eng.memory.kind == "window" else 0
    n = min(max(3 * a, window + 2 * a) + a // 2 + 1, eng.n_ctx - 1)
    pad = eng.padding  # its last batch one that is padded (policies.prefix.Padding)
    tail = (pad.least + FA_TILE) // 2
    if pad.least:
        n = min(max(n, pad.past + a + tail + 1), eng.n_ctx - 1)
    ids = random_ids(eng, n, 19)
    ends = sorted(eng.batching.ends)
    if ends:
        for p in (a // 4 + 1, a + a // 2 + 3, *((n - tail - FA_TILE - 1, n - tail - 1)
                                                  if pad.least else ())):
            if p < n - 1:
                ids[p] = ends[0]
    return ids


class Progress:
    """The probe tokens the check has prefilled over those it plans to (`planned`), told to
    `report` (0..1) after each batch: on a CPU with a large batch (llama-server's `-ub 2048`)
    the check prefills tens of thousands of tokens, for minutes on its first start."""

    def __init__(self, planned: int, report: Callable[[float], None] | None) -> None:
        self.planned, self.report, self.done = max(planned, 1), report, 0

    def prefill(self, eng: Engine, slot: int, ids: list[int], stops_at: Sequence[int] = (),
                on_stop: Callable[[int], None] | None = None) -> None:
        """`Engine.prefill`, counted."""
        last = eng.seqs[slot].n_live

        def on_batch(n_live: int) -> None:
            nonlocal last
            self.done += max(n_live - last, 0)
            last = n_live
            if self.report is not None:
                self.report(min(self.done / self.planned, 0.99))
        eng.prefill(slot, ids, stops_at, on_stop, on_batch)


def _probe(eng: Engine) -> tuple[list[int], Edges, list[int]]:
    """The probe's ids, their batch edges, and the two edges snapshotted: the first one and the
    last one before the prompt's end."""
    ids = probe_ids(eng)
    edges = eng.batching.edges(ids)
    return ids, edges, sorted({p for p in (edges.next(0), edges.keep_max) if 0 < p < len(ids)})


def _planned(eng: Engine, n: int, edges: Edges, points: list[int]) -> int:
    """Tokens the check prefills in all: the cold run, the live state extended from the batch
    edge below half, each snapshot extended to the end, and with several slots the last one
    again in another slot."""
    live = n - edges.floor(n // 2) if eng.memory.kind != "recurrent" else 0
    other = n - points[-1] if len(eng.seqs) > 1 and points else 0
    return n + live + sum(n - p for p in points) + other


def planned_tokens(eng: Engine) -> tuple[int, int]:
    """(probe tokens, tokens the check prefills in all), for the line said before it runs."""
    ids, edges, points = _probe(eng)
    return len(ids), _planned(eng, len(ids), edges, points)


def run(eng: Engine, progress: Callable[[float], None] | None = None) -> Report:
    """The checks (module docstring); `progress` is told the fraction done after each batch."""
    t0 = time.perf_counter()
    if eng.inexact:  # a configuration no check can make exact
        return Report(False, (Row("configuration", False, eng.inexact),), 0, 0.0)
    ids, edges, points = _probe(eng)
    n = len(ids)
    sections = 2 if eng.memory.kind == "window" else 1
    snaps: dict[int, bytes] = {}
    done = Progress(_planned(eng, n, edges, points), progress)
    eng.truncate(0, 0)
    done.prefill(eng, 0, ids, points, lambda p: snaps.__setitem__(p, bytes(eng.snapshot(0))))
    cold_state, cold_logits = bytes(eng.snapshot(0)), eng.last_logits(0)
    verifies = eng.memory.kind != "recurrent" or eng.memory.rollback > 0
    cold_verify: dict[int, list[bytes]] = {}
    rows: list[Row] = []
    try:
        cold_verify = _verify(eng, 0) if verifies else {}
    except (RuntimeError, ValueError) as e:
        verifies = False
        rows.append(Row(f"verify@{n}", False, f"the cold verify failed: {e}"))

    def compare(check: str, state: bytes, logits: np.ndarray) -> Row:
        where = layout.first_difference(cold_state, state, sections)
        if where is None and logits.tobytes() != cold_logits.tobytes():
            where = "the KV is equal but the last logits differ"
        return Row(check, where is None, where or "")

    def extended(slot: int) -> tuple[bytes, np.ndarray]:
        done.prefill(eng, slot, ids)
        return bytes(eng.snapshot(slot)), eng.last_logits(slot)

    if eng.memory.kind != "recurrent":  # the live state is the cold run's: cut it back first
        cut = max(edges.floor(n // 2), edges.next(eng.floor(0) - 1)) or edges.next(0)
        if cut < n and eng.truncate(0, cut) == cut:
            rows.append(compare(f"live@{cut}", *extended(0)))
        elif cut < n:
            rows.append(Row(f"live@{cut}", False, "the memory refused the cut"))
    for p in points:
        try:
            eng.restore(0, ids[:p], snaps[p])
            rows.append(compare(f"restore@{p}", *extended(0)))
        except ValueError as e:
            rows.append(Row(f"restore@{p}", False, f"the restore failed: {e}"))
    if len(eng.seqs) > 1 and points:  # a snapshot taken in one slot restores into any slot
        p, other = points[-1], len(eng.seqs) - 1
        try:
            eng.restore(other, ids[:p], snaps[p])
            state, logits = extended(other)
            eng.truncate(other, 0)
            eng.restore(0, ids, state)  # back in slot 0: the same sequence id as the cold state
            rows.append(compare(f"slot {other} restore@{p}", bytes(eng.snapshot(0)), logits))
        except ValueError as e:
            rows.append(Row(f"slot {other} restore@{p}", False, f"the restore failed: {e}"))
        finally:
            eng.truncate(other, 0)
    for slot in sorted({0, len(eng.seqs) - 1}) if verifies else ():
        check = f"{f'slot {slot} ' if slot else ''}verify@{n}"
        try:
            eng.truncate(slot, 0)
            eng.restore(slot, ids, cold_state)
            got = _verify(eng, slot)
            bad = [(r, i) for r, logits in cold_verify.items()
                   for i, row in enumerate(logits) if got[r][i] != row]
            rows.append(Row(check, not bad, f"a verify of {bad[0][0]} rows: row {bad[0][1]}'s "
                                            "logits differ" if bad else ""))
        except (RuntimeError, ValueError) as e:
            rows.append(Row(check, False, f"the verify failed: {e}"))
        finally:
            eng.truncate(slot, 0)
    decode: Proof | None = None
    if len(eng.seqs) > 1:
        decode = check_decode(eng, [(ids, cold_state)] + [(ids[:p], snaps[p]) for p in points])
    eng.truncate(0, 0)
    return Report(all(r.ok for r in rows), tuple(rows), n, time.perf_counter() - t0, decode)


VERIFY_ROWS = (2, 9, FA_TILE + 1)  # a verify's rows: a token and its draft (bounded by the batch)


def _verify(eng: Engine, slot: int) -> dict[int, list[bytes]]:
    """Each verify batch of `VERIFY_ROWS` on the slot's state, every row's logits, the state
    cut back after each (rows -> the logits of each row)."""
    n, out = eng.seqs[slot].n_live, {}
    # a recurrent state is cut back by fewer rows than a verify has (its rollback): restored
    held = (eng.live_ids(slot), bytes(eng.snapshot(slot))) \
        if eng.memory.kind == "recurrent" else None
    for rows in sorted({min(r, eng.n_batch, eng.n_ctx - n) for r in VERIFY_ROWS} - {0, 1}):
        draft = random_ids(eng, rows, 23)
        eng.evaluate([(slot, draft)], every=[slot])
        out[rows] = [eng.last_logits(slot, i).tobytes() for i in range(rows)]
        if eng.truncate(slot, n) != n:
            if held is None:
                raise RuntimeError("the memory refused to cut the verified rows back")
            eng.restore(slot, *held)
    return out


DECODE_LONG = 520  # tokens of the longest state in `check_decode`: a KV view past 512 cells
COST_STEPS = 3  # the least of this many steps each way is a shape's cost


def check_decode(eng: Engine, states: list[tuple[list[int], bytes]]) -> Proof:
    """What decode steps of several slots do to a slot's logits (`policies.schedule.Proof`,
    module docstring): whether steps batched as they come leave each slot's logits as they are
    alone; where the engine `pads`, whether in the shape of one row per slot they are the same
    whether the other slots are empty, idle (padding rows, their states unchanged after) or
    decoding, and what a slot generating alone pays for that shape; what running all slots'
    steps apart costs against one batched step. `states`: (ids, state) of this engine, the
    first one extended here past DECODE_LONG tokens; slot s holds the s-th (in turn), restored
    before every decode, and decodes the same token each time. Leaves every slot empty."""
    slots = len(eng.seqs)
    was = eng.decode_shape
    try:
        ids, state = states[0]
        long_ids = ids + random_ids(eng, max(min(DECODE_LONG, eng.n_ctx - 2) - len(ids), 0), 20)
        eng.restore(0, ids, state)
        eng.prefill(0, long_ids)
        held = [(long_ids, bytes(eng.snapshot(0)))] + states[1:]

        def hold(s: int) -> None:
            """Slot s holds its state again."""
            ids, state = held[s % len(held)]
            eng.restore(s, ids, state)

        took: list[float] = []  # the seconds of each llama_decode below

        def decode(run: list[int]) -> list[np.ndarray]:
            for s in run:
                hold(s)
            t = time.perf_counter()
            eng.decode({s: held[s % len(held)][0][1] for s in run})
            took.append(time.perf_counter() - t)
            return [eng.last_logits(s) for s in run]

        def differ(a: np.ndarray, b: np.ndarray) -> str:
            return "" if a.tobytes() == b.tobytes() else f"{float(np.max(np.abs(a - b))):.3g}"

        def least(shape: DecodeShape, run: list[int]) -> float:
            eng.decode_shape = shape
            took.clear()
            for _ in range(COST_STEPS):
                decode(run)
            return min(took)

        eng.decode_shape = "apart"
        alone = [decode([s])[0] for s in range(slots)]
        everyone = list(range(slots))
        apart_cost = sum(least("apart", [s]) for s in everyone) / max(
            least("batched", everyone), 1e-9)

        def batched() -> str:
            """Why decode steps cannot be batched as they come ("": they can)."""
            eng.decode_shape = "batched"
            for k in range(2, slots + 1):
                for first in range(slots - k + 1):
                    run = list(range(first, first + k))
                    for s, logits in zip(run, decode(run), strict=True):
                        if diff := differ(logits, alone[s]):
                            return (f"slot {s} decoded with slots {run[0]}-{run[-1]} "
                                    f"({len(held[s % len(held)][0])} tokens): its logits "
                                    f"differ from its decode alone by up to {diff}")
            return ""

        why = batched()
        proof = Proof(True, why, None, 0.0, apart_cost)
        if not why or not eng.pads:  # batched holds; or a padding row could not be dropped
            return proof
        return replace(proof, fixed=_fixed(eng, slots, held, hold, decode, differ),
                       fixed_cost=least("fixed", [0]) / max(least("apart", [0]), 1e-9))
    except (ValueError, RuntimeError) as e:
        return Proof(True, f"the check could not run: {e}", None)
    finally:
        eng.decode_shape = was
        for s in range(slots):
            eng.truncate(s, 0)


def _fixed(eng: Engine, slots: int, held: list[tuple[list[int], bytes]],
           hold: Callable[[int], None], decode: Callable[[list[int]], list[np.ndarray]],
           differ: Callable[[np.ndarray, np.ndarray], str]) -> str:
    """Why a slot's logits in the fixed shape depend on the other slots ("": they do not)."""
    eng.decode_shape = "fixed"
    for s in range(slots):
        others = [o for o in range(slots) if o != s]
        for o in others:
            eng.truncate(o, 0)
        ref = decode([s])[0]
        n = len(held[s % len(held)][0])
        kept = {}
        for o in others:
            hold(o)
            kept[o] = bytes(eng.snapshot(o))
        idle = decode([s])[0]
        for o in others:  # the padding rows came and went without a trace
            if bytes(eng.snapshot(o)) != kept[o]:
                return f"the padding row changed slot {o}'s state"
        for what, logits in (("idle", idle), ("decoding", decode(list(range(slots)))[s])):
            if diff := differ(logits, ref):
                return (f"slot {s} ({n} tokens) with the other slots {what} differs from with "
                        f"them empty by up to {diff}")
    return ""
