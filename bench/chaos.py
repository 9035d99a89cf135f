"""`make chaos` (issue 14): kill -9 a worker or the proxy at each phase of a save, many times;
every greedy answer must equal a cold run's, and `prefixgate cache verify` must be clean after
every restart.

    python -m bench.chaos --kills 100 [--seed N] [--keep]    (make chaos [CHAOS_KILLS=100])

Against a real prefixgate on loopback (one worker, the default model, n_ctx 4096, one cache
directory kept across restarts, a small `--cache-max-bytes` so that eviction keeps making room
for new snapshots):

1. Cold answers first. The prompts: a few conversations on one shared system prompt, each grown
   turn by turn with fixed assistant turns, so the cache stores cold anchors, scoped prefixes and
   growing turn ends. Each prompt is answered once on a separate server started with
   `--disk-prefix-cache off --tenant-isolation`, under an API key of its own: not even the live
   KV can help (each reference must report 0 cached tokens).
2. A round: wait until the cache is quiet, stream the prompt least covered by the stored
   entries (the likeliest to save), and kill the target (worker or proxy) when the planned phase
   comes. The kill: SIGSTOP the proxy (and the worker when the proxy is the target), SIGKILL the
   target, read what is on disk and in the index (the evidence), SIGCONT the rest: nothing moves
   between the kill and the look. (A worker is not stopped before its kill: a stop would wait for
   the write() in progress to end, and a kill cuts it short.)
3. Recovery. A killed proxy: its worker must exit by itself (after finishing the files it
   started); `cache verify` runs on the cache as the crash left it; the proxy is restarted (its
   "cache reconcile:" line counted), `cache verify` runs again, and every state file must now be
   indexed, no temp file left. A killed worker: the proxy must restart it; `cache verify` runs
   once the cache is quiet.
4. Checks: the killed prompt and one other are sent again; each answer, and the killed request's
   own when it completed, must equal the cold answer.

Phases: the plan cycles through every (target, phase) pair, in a seeded order. What was hit is
read from the evidence at the kill, first match wins:

    after     the response had ended (killed 0-0.5 s after it; saves may still be in flight)
    write     a temp file of this request existed: empty, partial, or complete and not yet
              renamed (fsync); planned: a random delay after a temp file appears, up to the
              create-to-rename time seen so far (half of them up to 20 ms: bytes going in)
    renamed   a state file of this request was renamed into place and was not in the index:
              between the rename and the commit; planned: at the rename
    snapshot  the worker's resident and virtual memory both grew by 4+ MiB within 60 ms (a
              new buffer being filled) and no file was begun: a snapshot being copied, or
              copied and not yet written; planned: at that growth
    restore   the worker had a state file open for reading
    generate  tokens had come, none of the above
    prefill   nothing had come, none of the above; planned: a random delay within the first
              15% of the prompt's cold time to first token (a disk hit leaves less to prefill)

Files are watched with inotify (kv/ and each subdirectory as it appears, index.lmdb/data.mdb);
memory is /proc/PID/statm (the server runs with a fixed glibc mmap threshold, see MALLOC_ENV).

Prints one line per kill and the counts. Exit status 1 on an answer that differs from the cold
one, a verify that fails, or a recovery that fails (a hang, a worker outliving its proxy, a
request failing after recovery, a state file left unindexed by a restart); the cache and the
server logs are then kept (always with --keep).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import os
import random
import re
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import lmdb
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend import store  # noqa: E402
from backend.index import Index  # noqa: E402
from bench.prompts import load_builder, render  # noqa: E402
from bench.quick import system_prompt  # noqa: E402
from tests.conftest import Server, start_server  # noqa: E402

T = TypeVar("T")
PHASES = ("prefill", "snapshot", "write", "renamed", "after")
TARGETS = ("worker", "proxy")
RISE_BYTES = 4 << 20  # memory growth that is a snapshot (a prefill touches ~23 KB a token)
RISE_WINDOW_S = 0.06
QUIET_S = 0.4  # no file or index event for this long: the cache is settled
REQUEST_TIMEOUT_S = 300.0
RESTART_TIMEOUT_S = 180.0
AFTER_MAX_S = 0.5  # `after`: killed up to this long after the response
PREFILL_SHARE = 0.15  # `prefill`: killed within this share of the prompt's cold time to 1st token
# glibc reuses a freed snapshot buffer's heap pages for the next one (its mmap threshold grows
# to the largest block freed), and the copy then grows no memory; a fixed threshold keeps every
# snapshot buffer a fresh mapping, visible in /proc/PID/statm while it is filled
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


@dataclass(frozen=True, slots=True)
class Options:
    kills: int = 100
    seed: int = 0
    words: int = 500  # shared system prompt (~900 tokens; a state file of ~20 MiB)
    convs: int = 3  # conversations on it
    turns: int = 3  # prompts per conversation, each one turn longer
    max_tokens: int = 6  # greedy tokens per answer
    cache_max_mb: int = 100  # a few state files: eviction keeps new saves coming
    checks: int = 2  # answers checked after each recovery (the killed prompt first)


# --- prompts and answers -------------------------------------------------------------------

Key = tuple[int, int]  # (conversation, turn)


def prompts(opts: Options) -> dict[Key, list[dict]]:
    """Every conversation at every length: prompt (c, t) is prompt (c, t - 1), its fixed answer
    and one more question."""
    system = system_prompt(opts.words)
    out: dict[Key, list[dict]] = {}
    for c in range(opts.convs):
        msgs = [{"role": "system", "content": system}]
        for t in range(opts.turns):
            if t:
                msgs = [*msgs, {"role": "assistant", "content": f"Module {c * 7 + t} keeps it."}]
            msgs = [*msgs, {"role": "user", "content": f"Conversation {c}, step {t}: which "
                            f"module keeps invariant {(c * 5 + t * 3) % 13}?"}]
            out[(c, t)] = msgs
    return out


@dataclass(slots=True)
class Answer:
    text: str = ""
    source: str = ""  # x-prefixgate-cache-source
    cached: int = -1
    first_s: float | None = None  # since the request was sent
    done_s: float | None = None  # the whole answer, [DONE] included
    error: str = ""


def ask(url: str, msgs: list[dict], max_tokens: int, api_key: str = "chaos",
        into: Answer | None = None) -> Answer:
    """One greedy streamed request; fills `into` as it goes (another thread may look)."""
    a = into if into is not None else Answer()
    c = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S)
    t0 = time.perf_counter()
    try:
        with c.chat.completions.with_streaming_response.create(
                model="m", messages=msgs, temperature=0, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}) as resp:
            a.source = resp.headers.get("x-prefixgate-cache-source", "")
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    a.done_s = time.perf_counter() - t0
                elif line.startswith("data: "):
                    _take(a, json.loads(line[6:]), time.perf_counter() - t0)
    except Exception as e:  # the kill: reset, a 5xx, a stream cut short
        a.error = a.error or f"{type(e).__name__}: {e}"
    if a.done_s is None and not a.error:
        a.error = "the stream ended without [DONE]"
    return a


def _take(a: Answer, chunk: dict, now_s: float) -> None:
    if "error" in chunk:
        a.error = str(chunk["error"].get("message"))
    for choice in chunk.get("choices") or ():
        piece = choice["delta"].get("content") or ""
        if piece and a.first_s is None:  # not the role chunk, which comes before the prefill
            a.first_s = now_s
        a.text += piece
    if chunk.get("usage"):
        a.cached = int((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                       or 0)


@dataclass(frozen=True, slots=True)
class Cold:
    text: str
    first_s: float  # time to first token, cold: scales the `prefill` delays


def cold_answers(tmp: Path, ps: dict[Key, list[dict]], max_tokens: int) -> dict[Key, Cold]:
    srv = start_server(tmp / "cold", "--workers", "1", "--disk-prefix-cache", "off",
                       "--tenant-isolation")
    try:
        out = {}
        for i, (key, msgs) in enumerate(ps.items()):
            a = ask(srv.v1, msgs, max_tokens, api_key=f"cold-{i}")
            if a.error or a.cached != 0:
                raise RuntimeError(f"cold answer {key}: "
                                   f"{a.error or f'{a.cached} cached tokens'}")
            out[key] = Cold(a.text, a.first_s or a.done_s or 1.0)
        return out
    finally:
        srv.stop()


# --- watching the cache: inotify -------------------------------------------------------------

IN_MODIFY, IN_CLOSE_NOWRITE, IN_OPEN = 0x2, 0x10, 0x20
IN_MOVED_TO, IN_CREATE, IN_DELETE, IN_ISDIR = 0x80, 0x100, 0x200, 0x40000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name


@dataclass(frozen=True, slots=True)
class FileEvent:
    t: float  # time.perf_counter()
    kind: str  # tmp (created), kv (renamed into place), open, close, gone, index
    path: Path


class Watch:
    """File events in `cache/kv/**` and on `cache/index.lmdb/data.mdb`."""

    FILES = IN_CREATE | IN_MOVED_TO | IN_OPEN | IN_CLOSE_NOWRITE | IN_DELETE

    def __init__(self, cache: Path) -> None:
        self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.dirs: dict[int, Path] = {}
        self.kv = cache / "kv"
        self.kv.mkdir(parents=True, exist_ok=True)
        (cache / "index.lmdb").mkdir(parents=True, exist_ok=True)
        self._add(self.kv, IN_CREATE)
        self._add(cache / "index.lmdb", IN_MODIFY)
        for d in self.kv.iterdir():
            if d.is_dir():
                self._add(d, self.FILES)

    def close(self) -> None:
        os.close(self.fd)

    def _add(self, path: Path, mask: int) -> None:
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
        self.dirs[wd] = path

    def poll(self, timeout_s: float) -> list[FileEvent]:
        if not select.select([self.fd], [], [], timeout_s)[0]:
            return []
        out: list[FileEvent] = []
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self.fd, 1 << 16):
                out += self._parse(data, time.perf_counter())
        return out

    def _parse(self, data: bytes, now: float) -> Iterator[FileEvent]:
        at = 0
        while at < len(data):
            wd, mask, _, n = _EVENT.unpack_from(data, at)
            name = data[at + _EVENT.size: at + _EVENT.size + n].rstrip(b"\0").decode()
            at += _EVENT.size + n
            path = self.dirs.get(wd, Path("?")) / name
            if mask & IN_ISDIR:
                if mask & IN_CREATE and path.parent == self.kv:
                    yield from self._new_dir(path, now)
            elif path.parent.name == "index.lmdb":
                if name == "data.mdb":
                    yield FileEvent(now, "index", path)
            elif name.startswith(".tmp-"):
                if mask & IN_CREATE:
                    yield FileEvent(now, "tmp", path)
            elif name.endswith(".kv"):
                kind = ("kv" if mask & IN_MOVED_TO else "open" if mask & IN_OPEN else
                        "close" if mask & IN_CLOSE_NOWRITE else "gone" if mask & IN_DELETE
                        else "")
                if kind:
                    yield FileEvent(now, kind, path)

    def _new_dir(self, d: Path, now: float) -> Iterator[FileEvent]:
        """Watch a new subdirectory; what was made in it before the watch was added is
        reported as if seen now."""
        self._add(d, self.FILES)
        for p in sorted(d.iterdir()):
            if p.name.startswith(".tmp-"):
                yield FileEvent(now, "tmp", p)
            elif p.suffix == ".kv":
                yield FileEvent(now, "kv", p)

    def settle(self, quiet_s: float = QUIET_S, limit_s: float = 60.0) -> bool:
        """Wait until nothing happened for `quiet_s`; False when that never came."""
        t0 = last = time.perf_counter()
        while time.perf_counter() - last < quiet_s:
            if self.poll(0.05):
                last = time.perf_counter()
            if time.perf_counter() - t0 > limit_s:
                return False
        return True


# --- processes -------------------------------------------------------------------------------


def memory_bytes(pid: int) -> tuple[int, int]:
    """(resident, virtual) bytes of a process."""
    try:
        size, resident = Path(f"/proc/{pid}/statm").read_text().split()[:2]
    except (OSError, ValueError):
        return 0, 0
    page = os.sysconf("SC_PAGESIZE")
    return int(resident) * page, int(size) * page


def _states(pid: int) -> list[str]:
    out = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError, IndexError):
            out.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return out


def alive(pid: int) -> bool:
    return any(s not in "ZX" for s in _states(pid))


def freeze(pids: list[int], limit_s: float = 5.0) -> None:
    """SIGSTOP, and wait until every thread is stopped (one in a syscall stops at its end)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline and any(
            s not in "tTZX" for pid in pids for s in _states(pid)):
        time.sleep(0.0005)


def socket_dir(pid: int) -> Path | None:
    """The directory of a local worker's Unix socket (`--socket PATH` in its command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    at = argv.index(b"--socket") if b"--socket" in argv else -1
    return Path(os.fsdecode(argv[at + 1])).parent if 0 <= at < len(argv) - 1 else None


def wait_gone(pid: int, limit_s: float) -> bool:
    """True once the process is gone (a zombie counts: it holds no file any more)."""
    deadline = time.perf_counter() + limit_s
    while alive(pid):
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.005)
    return True


# --- one kill ------------------------------------------------------------------------------


@dataclass(slots=True)
class Flight:
    """The request being killed: its answer filling in on a thread, and what the watch saw."""

    key: Key
    answer: Answer = field(default_factory=Answer)
    t0: float = field(default_factory=time.perf_counter)
    thread: threading.Thread | None = None
    tmps: dict[Path, float] = field(default_factory=dict)  # temp files made, when
    renamed: dict[Path, float] = field(default_factory=dict)  # state files renamed in, when
    reading: set[Path] = field(default_factory=set)  # state files open (a restore)
    memory: deque[tuple[float, int, int]] = field(default_factory=deque)  # the worker's
    peak_rise: int = 0  # the largest `rise_bytes` seen

    def rise_bytes(self) -> int:
        """Growth within RISE_WINDOW_S of both resident and virtual memory: a new buffer being
        filled (a snapshot). Filling the preallocated KV (a fresh worker's first restore or
        prefill) grows only the resident size; a new thread's stack only the virtual."""
        if not self.memory:
            return 0
        _, rss, vsz = self.memory[-1]
        return min(rss - min(m[1] for m in self.memory), vsz - min(m[2] for m in self.memory))

    def see(self, ev: FileEvent) -> None:
        if ev.kind == "tmp":
            self.tmps[ev.path] = ev.t
        elif ev.kind == "kv":
            self.renamed[ev.path] = ev.t
        elif ev.kind == "open":
            self.reading.add(ev.path)
        elif ev.kind == "close":
            self.reading.discard(ev.path)
            self.memory.clear()  # a restore's buffer stays for the run: not a snapshot

    def sample(self, pid: int) -> None:
        now = time.perf_counter()
        self.memory.append((now, *memory_bytes(pid)))
        while self.memory and self.memory[0][0] < now - RISE_WINDOW_S:
            self.memory.popleft()
        self.peak_rise = max(self.peak_rise, self.rise_bytes())

    @property
    def ended(self) -> bool:
        return self.answer.done_s is not None or bool(self.answer.error)


Trigger = Callable[[Flight, float], bool]  # (flight, now) -> kill now


@dataclass(slots=True)
class Triggers:
    """When to kill, for each planned phase; a phase that does not come falls back to
    killing after the response."""

    rng: random.Random
    cold: dict[Key, Cold]
    write_s: list[float] = field(default_factory=lambda: [0.1])  # create -> rename, seen
    _deadline: float | None = None
    _armed_for: Path | None = None  # `write`: the temp file the deadline is for
    _after_at: float | None = None

    def make(self, phase: str, flight: Flight) -> Trigger:
        self._deadline, self._armed_for, self._after_at = None, None, None
        if phase == "prefill":  # early: most prompts restore all but their last turns
            self._deadline = flight.t0 + self.rng.uniform(0.01, PREFILL_SHARE) * \
                self.cold[flight.key].first_s
        return {"prefill": self._prefill, "snapshot": self._snapshot, "write": self._write,
                "renamed": self._renamed, "after": self._after}[phase]

    def _prefill(self, f: Flight, now: float) -> bool:
        assert self._deadline is not None
        return now >= self._deadline or self._after(f, now)

    def _snapshot(self, f: Flight, now: float) -> bool:
        return (f.rise_bytes() >= RISE_BYTES and not f.reading) or self._after(f, now)

    def _write(self, f: Flight, now: float) -> bool:
        live = [p for p in f.tmps if p.exists()]
        if live and self._armed_for not in live:
            self._armed_for = live[-1]
            typical_s = statistics.median(self.write_s[-20:])  # mostly the fsync
            if self.rng.random() < 0.5:  # half of them while the bytes are still going in
                typical_s = min(typical_s, 0.02)
            self._deadline = f.tmps[live[-1]] + self.rng.uniform(0, typical_s)
        if self._armed_for is not None and self._deadline is not None and now >= self._deadline:
            return True
        return not live and self._after(f, now, grace_s=1.0)

    def _renamed(self, f: Flight, now: float) -> bool:
        return bool(f.renamed) or self._after(f, now, grace_s=1.0)

    def _after(self, f: Flight, now: float, grace_s: float = 0.0) -> bool:
        """Up to AFTER_MAX_S after the response (after `grace_s` more for a save to begin)."""
        if not f.ended:
            return False
        if self._after_at is None:
            self._after_at = now + grace_s + self.rng.uniform(0, AFTER_MAX_S)
        return now >= self._after_at


@dataclass(slots=True)
class Evidence:
    at_s: float  # the kill, since the request was sent
    phase: str  # observed (see the module docstring)
    detail: str  # what on disk says so


def tmp_state(path: Path) -> str:
    """How far a temp file's write had come."""
    try:
        h = store.read_header(path)
    except store.CacheFault as e:
        return "empty" if e.reason == "truncated" and _size(path) == 0 else "partial"
    except OSError:
        return "gone"
    if h.file_size_bytes < h.state_offset + h.state_len:
        return f"partial {h.file_size_bytes >> 20}/{(h.state_offset + h.state_len) >> 20} MiB"
    return f"complete {h.file_size_bytes >> 20} MiB, not renamed"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def stored_ids(cache: Path) -> list[tuple[int, ...]]:
    """The token ids of every indexed state file (from its header)."""
    with Index(cache) as index:
        files = [cache / e.file for _, e in index.entries()]
    out = []
    for path in files:
        with contextlib.suppress(store.CacheFault):
            out.append(store.read_ids(path))
    return out


def indexed(cache: Path, paths: list[Path]) -> set[Path]:
    """The state files among `paths` that have an index entry (its key is the file's name). A
    read-only look that takes no writer lock: the proxy may be stopped inside a write
    transaction (`Index` would wait for it, opening its databases in one)."""
    env = lmdb.open(str(cache / "index.lmdb"), readonly=True, max_dbs=8)
    try:
        with env.begin() as txn:
            db = env.open_db(b"entries", txn=txn, create=False)
            return {p for p in paths if txn.get(bytes.fromhex(p.stem), db=db) is not None}
    except lmdb.NotFoundError:  # no entry was ever written
        return set()
    finally:
        env.close()


def within(fn: Callable[[], T], limit_s: float, unblock: Callable[[], None]) -> T:
    """fn(), on a thread; if it takes longer than `limit_s`, unblock() (thaw the proxy, which
    may hold LMDB's reader-table lock), and then its result."""
    done: list[T] = []
    t = threading.Thread(target=lambda: done.append(fn()), daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        unblock()
        t.join()
    return done[0]


@dataclass(frozen=True, slots=True)
class Moment:
    """The client's side at the kill (a killed proxy then cuts the stream)."""

    t: float  # time.perf_counter() just before the kill
    at_s: float  # since the request was sent
    ended: bool
    streaming: bool
    chars: int

    @classmethod
    def of(cls, f: Flight) -> Moment:
        a, now = f.answer, time.perf_counter()
        return cls(now, now - f.t0, a.done_s is not None, a.first_s is not None, len(a.text))


def observe(f: Flight, m: Moment, cache: Path, unblock: Callable[[], None]) -> Evidence:
    """Classify the moment of the kill from the files and the index (nothing moves: the worker
    is dead or stopped, the proxy stopped or dead)."""
    at = m.at_s
    if m.ended:
        return Evidence(at, "after", f"{at - (f.answer.done_s or at):.3f} s after the response"
                        + (f"; temp files {len(tmps)}" if (tmps := _live(f.tmps)) else "")
                        + f"; saves {len(f.tmps)}, peak growth {f.peak_rise >> 20} MiB")
    if tmps := _live(f.tmps):
        return Evidence(at, "write", "; ".join(tmp_state(p) for p in tmps))
    renamed = [p for p in f.renamed if p.exists()]
    if renamed and (loose := [p for p in renamed if p not in
                              within(lambda: indexed(cache, renamed), 5.0, unblock)]):
        return Evidence(at, "renamed", f"{len(loose)} renamed, not in the index, "
                        f"killed {(m.t - f.renamed[loose[-1]]) * 1e3:.1f} ms after the rename")
    if f.rise_bytes() >= RISE_BYTES:
        return Evidence(at, "snapshot", f"+{f.rise_bytes() >> 20} MiB in "
                        f"{RISE_WINDOW_S * 1e3:.0f} ms, no file begun")
    if f.reading:
        return Evidence(at, "restore", "a state file open for reading")
    if m.streaming:
        return Evidence(at, "generate", f"{m.chars} chars so far")
    return Evidence(at, "prefill", f"{len(f.renamed)} saves done before")


def _live(tmps: dict[Path, float]) -> list[Path]:
    return [p for p in tmps if p.exists()]


# --- the loop ------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    kills: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # target, plan, seen
    details: Counter[tuple[str, str]] = field(default_factory=Counter)  # phase, sub-state
    answers: Counter[str] = field(default_factory=Counter)  # by cache source
    differing: list[str] = field(default_factory=list)
    verifies: int = 0
    verify_failures: list[str] = field(default_factory=list)
    reconcile: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # recovery: hangs, errors, unadopted
    killed_requests_failed: int = 0
    proxy_starts: int = 0
    worker_restarts: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.differing or self.verify_failures or self.failures)


class Chaos:
    def __init__(self, opts: Options, tmp: Path, cold: dict[Key, Cold],
                 ps: dict[Key, list[dict]], out: Callable[[str], None]) -> None:
        self.opts, self.tmp, self.cold, self.ps, self.out = opts, tmp, cold, ps, out
        self.cache = tmp / "cache"
        self.rng = random.Random(opts.seed)
        self.triggers = Triggers(random.Random(opts.seed + 1), cold)
        self.tally = Tally()
        self.srv: Server | None = None
        self.worker_pid = 0
        self.watch = Watch(self.cache)
        self.sent: dict[Key, int] = {key: 0 for key in ps}  # when each was last sent
        builder = load_builder()  # the proxy's own prompt path: the exact token ids
        self.ids = {k: render(builder, {"model": "m", "messages": m}).ids for k, m in ps.items()}
        self.sends = 0

    # --- the server ----------------------------------------------------------------------

    def start(self) -> None:
        self.tally.proxy_starts += 1
        self.srv = start_server(self.tmp / f"run{self.tally.proxy_starts}", "--workers", "1",
                                "--cache-max-bytes", str(self.opts.cache_max_mb << 20),
                                cache_dir=self.cache, timeout_s=RESTART_TIMEOUT_S,
                                env=MALLOC_ENV)
        m = re.search(r"cache reconcile: ReconcileReport\((.*?)\)", self.srv.log())
        for name, n in re.findall(r"(\w+)=(\d+)", m[1] if m else ""):
            if name != "kept":
                self.tally.reconcile[name] += int(n)
        self.worker_pid = self._worker_pid()

    def _worker_pid(self) -> int:
        assert self.srv is not None
        found = re.findall(r"worker 0 ready \(pid (\d+)", self.srv.log())
        return int(found[-1]) if found else 0

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()
        self.watch.close()

    # --- checks --------------------------------------------------------------------------

    def check(self, key: Key, a: Answer, why: str) -> None:
        if a.error:
            self.tally.failures.append(f"{why}: {key} failed: {a.error}")
            return
        self.tally.answers[a.source or "?"] += 1
        if a.text != self.cold[key].text:
            self.tally.differing.append(f"{why}: {key} ({a.source}, {a.cached} cached) "
                                        f"{a.text!r} != cold {self.cold[key].text!r}")

    def ask(self, key: Key, why: str) -> None:
        assert self.srv is not None
        self.check(self.sending(key), ask(self.srv.v1, self.ps[key], self.opts.max_tokens), why)

    def verify(self, why: str) -> None:
        self.tally.verifies += 1
        r = subprocess.run([sys.executable, "-m", "proxy.cli", "cache", "verify",
                            "--cache-dir", str(self.cache)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0:
            self.tally.verify_failures.append(f"{why}: {r.stdout.strip()} {r.stderr.strip()}")

    def all_indexed(self, why: str) -> None:
        """After a start: every state file indexed (adopted if need be), no temp file left."""
        files = sorted(self.cache.glob("kv/*/*.kv"))
        loose = [p.name for p in set(files) - indexed(self.cache, files)]
        temps = [p.name for p in self.cache.glob("kv/*/.tmp-*")]
        if loose or temps:
            self.tally.failures.append(f"{why}: not indexed {loose}, temp files {temps}")

    # --- a round -------------------------------------------------------------------------

    def sending(self, key: Key) -> Key:
        self.sends += 1
        self.sent[key] = self.sends
        return key

    def pick(self) -> Key:
        """One of the prompts whose longest stored prefix is shortest (then the least recently
        sent): the likeliest to prefill long and save a snapshot."""
        stored = stored_ids(self.cache)
        cover = {k: max((len(s) for s in stored if ids[: len(s)] == s), default=0) / len(ids)
                 for k, ids in self.ids.items()}
        order = sorted(self.ps, key=lambda k: (round(cover[k], 2), self.sent[k]))
        return self.sending(self.rng.choice(order[: max(1, len(self.ps) // 3)]))

    def round(self, n: int, target: str, phase: str) -> None:
        """One kill: settle, send a prompt, wait for the planned phase, kill, recover, check."""
        assert self.srv is not None
        if not self.watch.settle():
            self.tally.failures.append(f"kill {n}: the cache never settled before it")
        f = Flight(self.pick())
        f.thread = threading.Thread(target=ask, args=(self.srv.v1, self.ps[f.key],
                                                      self.opts.max_tokens, "chaos",
                                                      f.answer), daemon=True)
        trigger = self.triggers.make(phase, f)
        f.t0 = time.perf_counter()
        f.thread.start()
        if not self.wait(f, trigger):
            self.tally.failures.append(f"kill {n}: the request hung ({f.key})")
        ev = self.kill(target, f)
        self.tally.kills[(target, phase, ev.phase)] += 1
        self.tally.details[(ev.phase, re.sub(r"[\d.]+", "N", ev.detail))] += 1
        self.out(f"kill {n:3d}: {target:6} planned {phase:8} hit {ev.phase:8} at "
                 f"+{ev.at_s:.3f} s prompt {f.key}: {ev.detail}")
        if target == "proxy":
            self.recover_proxy(n, f)
        else:
            self.recover_worker(n, f)
        self.check_after(n, f)

    def wait(self, f: Flight, trigger: Trigger) -> bool:
        """Watch files and memory until the trigger says kill; False if the request hung."""
        while True:
            for ev in self.watch.poll(0.001):
                self._learn(ev, f)
                f.see(ev)
            f.sample(self.worker_pid)
            now = time.perf_counter()
            if trigger(f, now):
                return True
            if now - f.t0 > REQUEST_TIMEOUT_S:
                return False

    def _learn(self, ev: FileEvent, f: Flight) -> None:
        """Create-to-rename times of the writes seen, for the `write` delays."""
        if ev.kind == "kv":
            made = [t for p, t in f.tmps.items() if p.name.startswith(f".tmp-{ev.path.stem[:8]}")]
            if made:
                self.triggers.write_s.append(ev.t - made[-1])

    def kill(self, target: str, f: Flight) -> Evidence:
        """SIGKILL the target with the proxy frozen (it commits nothing while the evidence is
        read) and, for a proxy kill, the worker too (it goes on once thawed). A worker is not
        frozen first: a stop waits for the end of the write() in progress, a kill cuts it."""
        assert self.srv is not None
        proxy, worker = self.srv.proc.pid, self.worker_pid
        freeze([proxy, worker] if target == "proxy" else [proxy])
        f.sample(worker)
        moment = Moment.of(f)
        if f.answer.error:
            self.tally.failures.append(f"the request failed before its kill: {f.answer.error}")
        victim = worker if target == "worker" else proxy
        os.kill(victim, signal.SIGKILL)
        if target == "proxy":
            self.srv.proc.wait()
        wait_gone(victim, 10.0)
        survivor = worker if target == "proxy" else proxy
        ev = observe(f, moment, self.cache, lambda: os.kill(survivor, signal.SIGCONT))
        os.kill(survivor, signal.SIGCONT)
        return ev

    def recover_proxy(self, n: int, f: Flight) -> None:
        """The worker exits by itself; verify the cache as it was left, restart, verify again,
        and every state file must now be indexed."""
        old, sockets = self.worker_pid, socket_dir(self.worker_pid)
        if not wait_gone(old, RESTART_TIMEOUT_S):
            self.tally.failures.append(f"kill {n}: worker {old} outlived its proxy")
            os.kill(old, signal.SIGKILL)
        if sockets is not None and sockets.exists():  # a killed proxy leaves its socket dir
            subprocess.run(["rm", "-rf", str(sockets)], check=False)
        assert f.thread is not None
        f.thread.join(REQUEST_TIMEOUT_S)
        self.verify(f"kill {n}: the cache as the proxy left it")
        self.start()
        self.verify(f"kill {n}: after the restart")
        self.all_indexed(f"kill {n}: after the restart")

    def recover_worker(self, n: int, f: Flight) -> None:
        """The proxy restarts the worker; verify once the cache is quiet."""
        if not self._worker_back(self.worker_pid):
            self.tally.failures.append(f"kill {n}: worker not restarted")
        self.tally.worker_restarts += 1
        assert f.thread is not None
        f.thread.join(REQUEST_TIMEOUT_S)
        self.watch.settle()
        self.verify(f"kill {n}: after the worker restart")

    def check_after(self, n: int, f: Flight) -> None:
        """The killed request's answer if it completed, then the killed prompt and others."""
        assert f.thread is not None
        if f.thread.is_alive():
            self.tally.failures.append(f"kill {n}: the killed request never ended")
        if f.answer.error:
            self.tally.killed_requests_failed += 1
        else:
            self.check(f.key, f.answer, f"kill {n}: the killed request")
        others = [k for k in self.ps if k != f.key]
        for key in [f.key, *self.rng.sample(others, min(len(others), self.opts.checks - 1))]:
            self.ask(key, f"kill {n}: after recovery")

    def _worker_back(self, old: int) -> bool:
        deadline = time.perf_counter() + RESTART_TIMEOUT_S
        while time.perf_counter() < deadline:
            pid = self._worker_pid()
            if pid != old and pid and self._ready():
                self.worker_pid = pid
                return True
            time.sleep(0.1)
        return False

    def _ready(self) -> bool:
        assert self.srv is not None
        status, body = self.srv.get("/health")
        return status == 200 and all(w["ready"] for w in json.loads(body)["workers"])


def plan(kills: int, seed: int) -> list[tuple[str, str]]:
    """Blocks of every (target, phase) pair: the targets alternate, the worker's phases in a
    seeded order, the proxy's in the same order from its third: any 2 kills cover both targets,
    any 6 every phase, any 10 every pair."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    while len(out) < kills:
        order = rng.sample(PHASES, len(PHASES))
        for i in range(len(PHASES)):
            out += [("worker", order[i]), ("proxy", order[(i + 2) % len(PHASES)])]
    return out[:kills]


def run(opts: Options, tmp: Path, out: Callable[[str], None] = lambda line: None) -> Tally:
    t0 = time.perf_counter()
    ps = prompts(opts)
    cold = cold_answers(tmp, ps, opts.max_tokens)
    out(f"cold answers: {len(cold)} prompts in {time.perf_counter() - t0:.0f} s")
    chaos = Chaos(opts, tmp, cold, ps, out)
    try:
        chaos.start()
        for key in ps:  # the cache starts with the set's anchors and turn ends
            chaos.ask(key, "warm-up")
        for n, (target, phase) in enumerate(plan(opts.kills, opts.seed), 1):
            chaos.round(n, target, phase)
    finally:
        chaos.stop()
    chaos.tally.seconds = time.perf_counter() - t0
    return chaos.tally


def report(t: Tally, opts: Options) -> str:
    lines = [f"chaos: {sum(t.kills.values())} kills (seed {opts.seed}) in {t.seconds:.0f} s; "
             f"{t.proxy_starts} proxy starts, {t.worker_restarts} worker restarts"]
    lines.append("kills by target, planned phase -> phase hit:")
    for (target, planned, seen), n in sorted(t.kills.items()):
        lines.append(f"  {target:6} {planned:8} -> {seen:8} {n}")
    seen_by: Counter[tuple[str, str]] = Counter()
    for (target, _, seen), n in t.kills.items():
        seen_by[(target, seen)] += n
    lines.append("phases hit: " + ", ".join(f"{tg}/{ph} {n}" for (tg, ph), n in
                                             sorted(seen_by.items())))
    lines.append("evidence: " + "; ".join(f"{ph}: {d} x{n}" for (ph, d), n in
                                           sorted(t.details.items())))
    lines.append(f"answers checked {sum(t.answers.values())} ("
                 + ", ".join(f"{s} {n}" for s, n in sorted(t.answers.items()))
                 + f"), differing {len(t.differing)}; killed requests that failed "
                 f"{t.killed_requests_failed}")
    lines.append(f"cache verify runs {t.verifies}, failures {len(t.verify_failures)}")
    lines.append("reconcile: " + ", ".join(f"{k} {n}" for k, n in sorted(t.reconcile.items())))
    lines.append(f"recovery failures {len(t.failures)}")
    lines += [f"  DIFFERS {d}" for d in t.differing]
    lines += [f"  VERIFY {v}" for v in t.verify_failures]
    lines += [f"  FAILED {x}" for x in t.failures]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    p.add_argument("--kills", type=int, default=d.kills)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--words", type=int, default=d.words, help="shared system prompt words")
    p.add_argument("--convs", type=int, default=d.convs)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--cache-max-mb", type=int, default=d.cache_max_mb)
    p.add_argument("--checks", type=int, default=d.checks, help="answers checked per recovery")
    p.add_argument("--keep", action="store_true", help="keep the cache and the server logs")
    a = p.parse_args()
    opts = Options(a.kills, a.seed, a.words, a.convs, a.turns, a.max_tokens, a.cache_max_mb,
                   a.checks)

    def out(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    tmp = Path(tempfile.mkdtemp(prefix="prefixgate-chaos-"))
    tally = None
    try:
        tally = run(opts, tmp, out)
    finally:
        if a.keep or tally is None or not tally.ok:
            out(f"kept the cache and the server logs in {tmp}")
        else:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    out(report(tally, opts))
    sys.exit(0 if tally.ok else 1)


if __name__ == "__main__":
    main()
