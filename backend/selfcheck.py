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

With several slots one more check, ``decode 2-N slots`` (`check_decode`), decides how decode
steps of several slots run (`Engine.decode`), so that a slot answers what it answers alone,
whatever else generates:
- ``batched`` (in one llama_decode as they come) where each slot's logits from one llama_decode
  of the tokens of 2, 3, ... N consecutive slots (llama.cpp runs a run of consecutive sequence
  ids as one batch) equal, bit for bit, its logits from its decode alone;
- else, where a cell can be dropped again (plain attention, a full-size window:
  `Engine.pads`), ``fixed`` (every step one row per slot, padding rows in the slots that do not
  generate) where each slot's logits in that shape are the same with the other slots empty,
  idle (their padding rows, which leave their states as they were) and decoding, and where a
  slot generating alone pays little for it (`FIXED_MAX_COST`: so on a GPU, not on a CPU);
- else ``apart`` (each slot's step alone, as a one-slot worker's).
The slots hold states of different lengths, one past 512 KV cells, so that their KV views are
padded to different sizes. Its failure only keeps the decode steps apart; reuse does not depend
on it. Batched fails with flash attention on a CPU (ggml splits a single query row's attention
among the threads past 512 cells, not a row beside others), on f16 weights on a CPU (one row
multiplies in another order than several), on CUDA and on the hybrid models measured
(bench/results/issue20/decode_batch.md); fixed holds, bit for bit, for the first two, but there
costs a lone step more than it may. What a pass rests on: that no kernel chooses its order of
summation by a length the check does not reach.

A passing verdict is remembered (`recall`, `remember`: one file per verdict in
``$XDG_CACHE_HOME/prefixgate/selfcheck``, the 64 most recent) under `verdict_key`: the cache
identity (model file bytes, n_ctx, KV types, flash attention, batch, library version, the
devices that compute), the worker's other settings (slots, threads, layers and placement), the
llama.cpp and GPU libraries it runs (path, size and mtime of each), ggml's system info, the
GGML_/CUDA_/HIP_ environment variables its kernels read and the source of the code the check
exercises. The same key is the same computation, so a restart with nothing changed skips the
check (33 s on a 1.1B Q4_K_M model on 2 CPU cores); anything changed checks again. A failing
verdict is not remembered (every start checks it again), nor is one under a test's injected
fault; `prefixgate doctor` always checks.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import llama_cpp
import numpy as np
import xxhash

from backend import layout
from backend.engine import Cancel, DecodeMode, Engine
from backend.keys import user_dir

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
    decode: Row | None = None  # `check_decode`; None where it does not apply (one slot, ...)
    decode_mode: DecodeMode = "apart"  # what `check_decode` proved (`Engine.decode`)

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
                    "detail": self.decode.detail, "mode": self.decode_mode}}


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
    decode: Row | None = None
    mode: DecodeMode = "apart"
    if len(eng.seqs) > 1:
        decode, mode = check_decode(
            eng, [(ids, cold_state)] + [(ids[:p], snaps[p]) for p in points])
    eng.truncate(0)
    eng.exact_n = 0
    return Report(all(r.ok for r in rows), tuple(rows), n, time.perf_counter() - t0, decode,
                  mode)


DECODE_LONG = 520  # tokens of the longest state in `check_decode`: a KV view past 512 cells
# The fixed shape is taken only where a slot that generates alone pays at most this for it
# (its step in the shape over its step alone, the least of COST_STEPS each way): on a GPU,
# which reads the weights once for all the rows, a row costs almost nothing; on 2 CPU cores a
# step of 3 rows cost 1.45x one row on a 1.1B f16 model and about 2x on its Q4_K_M, where the
# agent team took 1.36-1.56x llama-server's wall with the fixed shape against 1.04-1.22x apart
# (bench/results/issue20, the twelfth round).
FIXED_MAX_COST = 1.25
COST_STEPS = 3


def check_decode(eng: Engine, states: list[tuple[list[int], bytes]]) -> tuple[Row, DecodeMode]:
    """How decode steps of several slots may run (`Engine.decode`, module docstring):
    ``batched`` where each slot's logits from a llama_decode beside other slots equal its
    logits alone; else, where the engine `pads`, ``fixed`` where its logits in the shape of one
    row per slot are the same whether the other slots are empty, idle (padding rows, their
    states unchanged after) or decoding; else ``apart``. `states`: (ids, state) of this
    engine, the first one extended here past DECODE_LONG tokens; slot s holds the s-th (in
    turn), restored before every decode, and decodes the same token each time. Leaves every
    slot empty."""
    slots, check = len(eng.seqs), f"decode 2-{len(eng.seqs)} slots"
    was = eng.decode
    try:
        ids, state = states[0]
        long_ids = ids + random_ids(eng, max(min(DECODE_LONG, eng.n_ctx - 2) - len(ids), 0), 20)
        eng.use(0)
        eng.restore(ids, state)
        eng.prefill(long_ids, [], lambda _: None, Cancel())
        held = [(long_ids, bytes(eng.snapshot()))] + states[1:]

        def hold(s: int) -> None:
            """Slot s holds its state again."""
            eng.use(s)
            ids, state = held[s % len(held)]
            eng.restore(ids, state)

        took: list[float] = []  # the seconds of each llama_decode below

        def decode(run: list[int]) -> list[np.ndarray]:
            for s in run:
                hold(s)
                eng.seq.next = held[s % len(held)][0][1]
            t = time.perf_counter()
            eng.decode_next(run)
            took.append(time.perf_counter() - t)
            out = []
            for s in run:
                eng.use(s)
                out.append(eng.last_logits())
            return out

        def differ(a: np.ndarray, b: np.ndarray) -> str:
            return "" if a.tobytes() == b.tobytes() else f"{float(np.max(np.abs(a - b))):.3g}"

        eng.decode = "apart"
        alone = [decode([s])[0] for s in range(slots)]
        def batched() -> str:
            """Why decode steps cannot be batched as they come ("": they can)."""
            eng.decode = "batched"
            for k in range(2, slots + 1):
                for first in range(slots - k + 1):
                    run = list(range(first, first + k))
                    for s, logits in zip(run, decode(run), strict=True):
                        if diff := differ(logits, alone[s]):
                            return (f"slot {s} decoded with slots {run[0]}-{run[-1]} "
                                    f"({len(held[s % len(held)][0])} tokens): its logits "
                                    f"differ from its decode alone by up to {diff}")
            return ""

        apart = batched()
        if not apart:
            return Row(check, True, ""), "batched"
        if not eng.pads:  # a padding row's cell could not be dropped again
            return Row(check, False, apart), "apart"
        eng.decode = "fixed"
        for s in range(slots):
            others = [o for o in range(slots) if o != s]
            for o in others:
                eng.use(o)
                eng.truncate(0)
            ref = decode([s])[0]
            n = len(held[s % len(held)][0])
            kept = {}
            for o in others:
                hold(o)
                kept[o] = bytes(eng.snapshot())
            idle = decode([s])[0]
            for o in others:  # the padding rows came and went without a trace
                eng.use(o)
                if bytes(eng.snapshot()) != kept[o]:
                    return Row(check, False, f"{apart}; in a fixed shape, a row per slot, the "
                                             f"padding row changed slot {o}'s state"), "apart"
            for what, logits in (("idle", idle),
                                 ("decoding", decode(list(range(slots)))[s])):
                if diff := differ(logits, ref):
                    return Row(check, False, f"{apart}; in a fixed shape, a row per slot, slot "
                                             f"{s} ({n} tokens) with the other slots {what} "
                                             f"differs from with them empty by up to {diff}"), \
                        "apart"
        # what a slot generating alone pays for the shape: the least of a few steps each way
        lone = {}
        for mode in ("apart", "fixed"):
            eng.decode = mode
            took.clear()
            for _ in range(COST_STEPS):
                decode([0])
            lone[mode] = min(took)
        cost = lone["fixed"] / max(lone["apart"], 1e-9)
        if cost > FIXED_MAX_COST:
            return Row(check, False, f"{apart}; a fixed shape, a row per slot, is exact, but a "
                                     f"slot's step alone costs {cost:.2f}x in it (taken up to "
                                     f"{FIXED_MAX_COST}x)"), "apart"
        return Row(check, True, f"{apart}; a slot's step alone costs {cost:.2f}x in the fixed "
                                f"shape"), "fixed"
    except (ValueError, RuntimeError) as e:
        return Row(check, False, f"the check could not run: {e}"), "apart"
    finally:
        eng.decode = was
        for s in range(slots):
            eng.use(s)
            eng.seq.next = -1
            eng.truncate(0)
        eng.use(0)


# --- remembered verdicts (module docstring) ---------------------------------------------------

VERDICTS_KEPT = 64
_VERDICT_DOMAIN = "prefixgate-selfcheck-v1"
# the code a verdict proves besides llama.cpp's: the check, the engine and what they rest on
_CHECKED_CODE = ("backend.selfcheck", "backend.engine", "backend.layout", "policies.prefix")
# shared libraries whose kernels compute the states: llama.cpp's, and the GPU and BLAS
# libraries it may load
_LIBRARIES = ("libggml", "libllama", "libcu", "libnv", "libhip", "libamdhip", "librocblas",
              "libvulkan", "libOpenCL", "libmkl", "libopenblas", "libblas")
# environment variables whose switches the kernels read at run time (GGML_CUDA_FORCE_CUBLAS, ...)
_KERNEL_ENV = ("GGML_", "CUDA_", "HIP_", "HSA_", "ROCR_")


def verdict_key(fingerprint: bytes, settings: Mapping[str, Any]) -> str:
    """The name of a verdict: the cache identity's fingerprint (backend.keys), the worker's
    other settings, the libraries, ggml's system info and the checked code (module docstring)."""
    code = xxhash.xxh3_128()
    for name in _CHECKED_CODE:
        try:
            code.update(Path(str(importlib.import_module(name).__file__)).read_bytes())
        except OSError:  # no source to read (a zipped install): the version stands for it
            code.update(f"{name} {importlib.metadata.version('prefixgate')}".encode())
    fields = {"domain": _VERDICT_DOMAIN, "fingerprint": fingerprint.hex(),
              "settings": dict(settings), "code": code.hexdigest(), "libraries": _libraries(),
              "system": llama_cpp.llama_print_system_info().decode(errors="replace"),
              "environment": {k: v for k, v in os.environ.items() if k.startswith(_KERNEL_ENV)}}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(canonical.encode())


def _libraries() -> list[str]:
    """Path, size and mtime of each compute library this process has mapped (Linux); elsewhere
    of the files in llama-cpp-python's library directory."""
    paths: set[str] = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:  # address, perms, offset, device, inode, path
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/") and os.path.basename(path).startswith(_LIBRARIES):
                    paths.add(path)
    except OSError:
        pass
    if not paths:
        lib = Path(llama_cpp.__file__).parent / "lib"
        paths = {str(p) for p in lib.glob("*")} if lib.is_dir() else set()
    stamps = []
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            st = os.stat(path)
            stamps.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return stamps


def _decode_mode(mode: object) -> DecodeMode:
    if mode not in ("apart", "batched", "fixed"):
        raise ValueError(f"no decode mode {mode!r}")
    return cast(DecodeMode, mode)


def verdicts_dir() -> Path:
    return user_dir() / "selfcheck"


def recall(key: str, directory: Path | None = None) -> dict[str, Any] | None:
    """The verdict remembered under `key` (`Report.to_wire` and when it was checked), or None."""
    path = (directory or verdicts_dir()) / f"{key}.json"
    try:
        verdict = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the remembered self-check verdict %s: %s", path, e)
        return None
    try:
        if verdict["ok"] is not True:
            raise ValueError("not a pass")
        checks = [{"check": str(c["check"]), "ok": bool(c["ok"]), "detail": str(c["detail"])}
                  for c in verdict["checks"]]
        decode = verdict.get("batch_decode")
        return {**verdict, "checks": checks, "seconds": float(verdict["seconds"]),
                "probe_tokens": int(verdict["probe_tokens"]),
                "checked_at": float(verdict["checked_at"]),
                "batch_decode": None if decode is None else {
                    "ok": decode["ok"] is True, "check": str(decode["check"]),
                    "detail": str(decode["detail"]), "mode": _decode_mode(decode["mode"])}}
    except (KeyError, TypeError, ValueError):
        log.warning("ignoring the remembered self-check verdict %s: not a passing verdict", path)
        return None


def remember(key: str, verdict: Mapping[str, Any], directory: Path | None = None) -> None:
    """Keep a passing verdict for the next start (atomically: a reader sees all or nothing),
    and only the VERDICTS_KEPT most recent. A directory that cannot be written costs a check
    per start, said once here."""
    directory = directory or verdicts_dir()
    tmp = directory / f".{key}.{os.getpid()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**verdict, "checked_at": time.time()}))
        os.replace(tmp, directory / f"{key}.json")
    except OSError as e:
        log.warning("cannot remember the self-check verdict in %s (%s): every start checks",
                    directory, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
        return
    with contextlib.suppress(OSError):  # another start may be pruning at the same time
        kept = sorted(((p.stat().st_mtime, p) for p in directory.glob("*.json")), reverse=True)
        for _, old in kept[VERDICTS_KEPT:]:
            old.unlink(missing_ok=True)
