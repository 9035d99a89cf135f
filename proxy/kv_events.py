"""A host's KV events in vLLM's shape over ZMQ (`--kv-events tcp://HOST:PORT`): what NVIDIA
Dynamo's KV router (through its ZMQ relay, `KvEventPublisher(zmq_endpoint=...)`) and llm-d's
precise prefix scheduler consume to place each request on the host that holds its prefix.

    KvEvents(endpoint, block_size, topic)   the publisher: an XPUB socket bound at `endpoint`
                                     (`>tcp://...`: connected there, ZMQ's own spelling)
      .tier_event(source, event)     a worker's `TierEvent` (live, ram, shared)
      .disk(kind, key, ids)          the proxy's disk index: an entry committed or deleted
      .forget(source)                a worker's events stream ended: its states are gone
    Held(block_size)                 the bookkeeping, without I/O: states in, events out
    encode(events) -> bytes          one `KVEventBatch`, msgpack

The wire is vLLM's `ZmqEventPublisher`: three frames, the topic (--kv-events-topic, "" by
default; llm-d reads `kv@POD@MODEL`), the batch's sequence
number (8 bytes, big-endian) and the batch, msgpack-encoded as vLLM's `KVEventBatch` with
msgspec's `array_like` (the form Dynamo's relay decodes; a batch as a map is refused there):

    [ts, [event, ...], data_parallel_rank]
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Rules:
- A block is `block_size` tokens (--kv-block-size, 16 as vLLM's and Dynamo's examples; the
  router must be given the same). A prefixgate state holds a prompt prefix of n tokens, which
  ends at a batch edge, not a block's: it is published as its first n // block_size blocks,
  only blocks wholly inside it. What the mapping loses is in docs/routing.md.
- A block's hash is Dynamo's: the block's own hash is xxh3_64 of its token ids (u32
  little-endian) with seed 1337, the one `dynamo.llm.compute_block_hash_for_seq` gives; its
  hash in the chain is xxh3_64 of the previous block's chain hash and its own (u64
  little-endian each), so a block names its whole prefix; sent as signed 64-bit, as vLLM does.
  Consumers match on the token ids (Dynamo recomputes its own hashes from them, llm-d its
  request keys); the hashes name blocks for removals.
- Tiers map to Dynamo's storage tiers by `medium`: a slot's live KV "GPU" (the device tier,
  served in place), the RAM tier "CPU_PINNED" (host), the disk "DISK", the shared tier
  "EXTERNAL" (a pool every host reaches; Dynamo counts it for all workers alike). A snapshot
  queued for its file is not published: it is the disk's within the second its write takes.
- A block is held in a medium while any state of that medium covers it (a count per medium and
  hash): `BlockStored` when the first state covers it, `BlockRemoved` when the last leaves.
  The states of one prompt share their first blocks, and a block held covers its prefix, so
  what is new is always a chain's tail, and what leaves too.
- The shared tier's removals are not seen (Redis evicts by LRU without telling): the newest
  shared states, `SHARED_TOKENS_KEPT` tokens of them, are kept and an older one's removal is
  published, a recent window as Redis keeps one.
- Memory: a state keeps its tokens packed (4 bytes each) and its hashes; the disk's tokens are
  bounded by its budget (a token's KV is kilobytes), the shared window by its own bound.
- A block is stored once per medium, never again while held: Dynamo's index counts a second
  store as a second holder, which one removal would not clear.
- A subscriber that joins (the relay starting, or coming back) gets everything held
  (`snapshot`): `AllBlocksCleared`, then each block once (an XPUB socket sees it subscribe),
  queued behind what was published before and ahead of what follows, so nothing is missing
  and nothing counted twice. A worker restarted or lost forgets its states.
- Publishing never blocks a caller: events go to the sender thread's queue; the thread alone
  touches the socket. A failure to send is one log line, never an error upstream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from backend.protocol import TierEvent

if TYPE_CHECKING:
    from proxy.cache import DiskCache
    from proxy.config import Config
    from proxy.workers import Pool

log = logging.getLogger("prefixgate")

DEFAULT_BLOCK_SIZE = 16
HASH_SEED = 1337  # Dynamo's block hash seed
SHARED_TOKENS_KEPT = 2_000_000  # shared-tier tokens remembered (their removal is not seen)
MEDIUM = {"live": "GPU", "ram": "CPU_PINNED", "disk": "DISK", "shared": "EXTERNAL"}


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str

    def wire(self) -> list[object]:
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash,
                list(self.token_ids), self.block_size, None, self.medium]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str

    def wire(self) -> list[object]:
        return ["BlockRemoved", list(self.block_hashes), self.medium]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    def wire(self) -> list[object]:
        return ["AllBlocksCleared"]


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def block_hashes(ids: Sequence[int], block_size: int) -> list[int]:
    """The chain hashes of the blocks wholly inside `ids` (signed 64-bit)."""
    n = len(ids) // block_size
    raw = np.asarray(ids[: n * block_size], dtype="<u4").tobytes()
    out: list[int] = []
    prev = 0
    step = block_size * 4
    for i in range(n):
        local = xxhash.xxh3_64_intdigest(raw[i * step:(i + 1) * step], seed=HASH_SEED)
        prev = local if i == 0 else xxhash.xxh3_64_intdigest(
            prev.to_bytes(8, "little") + local.to_bytes(8, "little"), seed=HASH_SEED)
        out.append(prev)
    return [signed(h) for h in out]


def encode(events: Sequence[KvEvent], ts: float, dp_rank: int = 0) -> bytes:
    """One vLLM `KVEventBatch` (array_like), msgpack."""
    import msgpack  # only where --kv-events is on, as zmq

    return bytes(msgpack.packb([ts, [e.wire() for e in events], dp_rank], use_bin_type=True))


StateKey = tuple[str, str, Hashable]  # (source, tier, the tier's ref)


@dataclass(slots=True)
class _State:
    medium: str
    packed: bytes  # the tokens of its blocks, u32 little-endian
    hashes: tuple[int, ...]

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(np.frombuffer(self.packed, dtype="<u4").tolist())


@dataclass(slots=True)
class Held:
    """Which states each medium holds, and so which blocks (module rules); no I/O."""

    block_size: int = DEFAULT_BLOCK_SIZE
    states: dict[StateKey, _State] = field(default_factory=dict)
    counts: Counter[tuple[str, int]] = field(default_factory=Counter)
    shared: OrderedDict[StateKey, int] = field(default_factory=OrderedDict)  # -> its tokens

    def store(self, key: StateKey, tier: str, ids: Sequence[int]) -> list[KvEvent]:
        """A state of `ids` is held (it replaces what `key` held before)."""
        medium = MEDIUM[tier]
        n = len(ids) // self.block_size * self.block_size
        kept = tuple(int(t) for t in ids[:n])
        packed = np.asarray(kept, dtype="<u4").tobytes()
        old = self.states.get(key)
        if old is not None and old.packed == packed and old.medium == medium:
            return []
        hashes = tuple(block_hashes(kept, self.block_size))
        self.states[key] = _State(medium, packed, hashes)
        out: list[KvEvent] = []
        new = [i for i, h in enumerate(hashes) if self.counts[(medium, h)] == 0]
        for h in hashes:
            self.counts[(medium, h)] += 1
        if new:
            first = new[0]
            out.append(BlockStored(hashes[first:], hashes[first - 1] if first else None,
                                   kept[first * self.block_size:], self.block_size, medium))
        if old is not None:
            out += self._release(old)
        if tier == "shared":
            self.shared[key] = n
            self.shared.move_to_end(key)
            while sum(self.shared.values()) > SHARED_TOKENS_KEPT and len(self.shared) > 1:
                out += self.remove(next(iter(self.shared)))
        return out

    def remove(self, key: StateKey) -> list[KvEvent]:
        self.shared.pop(key, None)
        old = self.states.pop(key, None)
        return [] if old is None else self._release(old)

    def forget(self, source: str) -> list[KvEvent]:
        """Every state of `source` is gone."""
        out: list[KvEvent] = []
        for key in [k for k in self.states if k[0] == source]:
            out += self.remove(key)
        return out

    def snapshot(self) -> list[KvEvent]:
        """Everything held, for a subscriber that joins: a clean slate, then each chain."""
        out: list[KvEvent] = [AllBlocksCleared()]
        seen: set[tuple[str, int]] = set()  # each block once: Dynamo counts a second store
        for s in self.states.values():
            new = [i for i, h in enumerate(s.hashes) if (s.medium, h) not in seen]
            if new:
                first = new[0]
                out.append(BlockStored(s.hashes[first:], s.hashes[first - 1] if first else None,
                                       s.ids[first * self.block_size:], self.block_size,
                                       s.medium))
                seen.update((s.medium, h) for h in s.hashes[first:])
        return out

    def _release(self, old: _State) -> list[KvEvent]:
        gone = []
        for h in old.hashes:
            self.counts[(old.medium, h)] -= 1
            if self.counts[(old.medium, h)] <= 0:
                del self.counts[(old.medium, h)]
                gone.append(h)
        # deepest first: a block leaves after the blocks that extend it
        return [BlockRemoved(tuple(reversed(gone)), old.medium)] if gone else []


class KvEvents:
    """The publisher (module docstring): callers from any thread, one sender thread."""

    POLL_S = 0.1

    def __init__(self, endpoint: str, block_size: int = DEFAULT_BLOCK_SIZE,
                 topic: str = "") -> None:
        import zmq

        self.endpoint, self.held = endpoint, Held(block_size)
        self._topic = topic.encode()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[list[KvEvent] | None] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's join, not the first
        connect = endpoint.startswith(">")  # a subscriber that binds (llm-d's indexer)
        try:
            if connect:
                self._sock.connect(endpoint[1:])
            else:
                self._sock.bind(endpoint.removeprefix("@"))
        except zmq.ZMQError as e:
            self._sock.close(0)
            self._ctx.term()
            raise ValueError(f"--kv-events {endpoint}: cannot {'connect' if connect else 'bind'}"
                             f" it: {e}") from None
        self._seq = 0
        self.sent = 0  # batches sent
        self._thread = threading.Thread(target=self._send_loop, name="kv-events", daemon=True)
        self._thread.start()
        self._publish([AllBlocksCleared()])  # what this host held before a restart is gone

    # --- callers ---------------------------------------------------------------------------

    def tier_event(self, source: str, ev: TierEvent) -> None:
        """A worker's tier event; the shared tier is one pool whoever published into it."""
        if ev.tier not in MEDIUM or ev.tier == "disk":
            return
        key: StateKey = ("shared" if ev.tier == "shared" else source, ev.tier,
                         (ev.salt, ev.ref) if ev.tier == "shared" else ev.ref)
        with self._lock:  # queued in the order the bookkeeping saw them
            self._publish(self.held.store(key, ev.tier, ev.ids) if ev.kind == "stored"
                          else self.held.remove(key))

    def disk(self, kind: str, key: bytes, ids: Sequence[int]) -> None:
        """The proxy's disk index committed (stored) or deleted (removed) an entry."""
        with self._lock:
            self._publish(self.held.store(("disk", "disk", key), "disk", ids) if kind == "stored"
                          else self.held.remove(("disk", "disk", key)))

    def forget(self, source: str) -> None:
        with self._lock:
            self._publish(self.held.forget(source))

    def props(self) -> dict[str, object]:
        """What /props shows: where it publishes, and what it holds per medium."""
        with self._lock:
            blocks = Counter(medium for medium, _ in self.held.counts)
            states = len(self.held.states)
        return {"endpoint": self.endpoint, "block_size": self.held.block_size,
                "topic": self._topic.decode(), "batches_sent": self.sent, "states": states,
                "blocks": dict(blocks)}

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    # --- the sender thread -----------------------------------------------------------------

    def _publish(self, events: list[KvEvent]) -> None:
        if events:
            self._queue.put(events)

    def _send_loop(self) -> None:
        import zmq

        try:
            while True:
                if self._sock.poll(0, zmq.POLLIN):
                    if self._sock.recv()[:1] == b"\x01":  # a subscriber joined
                        with self._lock:  # in order: after what it holds, before what follows
                            self._publish(self.held.snapshot())
                    continue
                try:
                    events = self._queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    continue
                if events is None:
                    return
                self._send(events)
        finally:
            self._sock.close(0)
            self._ctx.term()

    def _send(self, events: list[KvEvent]) -> None:
        import zmq

        try:
            self._sock.send_multipart([self._topic, self._seq.to_bytes(8, "big"),
                                       encode(events, time.time())])
            self._seq += 1
            self.sent += 1
        except zmq.ZMQError as e:
            log.warning("kv events: a batch of %d events not sent: %s", len(events), e)


# --- the host's wiring (proxy/app.py) -----------------------------------------------------------


def open_kv_events(cfg: Config, pool: Pool) -> KvEvents | None:
    """The host's publisher where --kv-events asks for one, fed by every worker's tier events."""
    if not cfg.kv_events:
        return None
    events = KvEvents(cfg.kv_events, cfg.kv_block_size, cfg.kv_events_topic)

    def on_tier(source: str, ev: TierEvent | None) -> None:
        if ev is None:
            events.forget(source)
        else:
            events.tier_event(source, ev)

    pool.on_tier = on_tier
    log.info("KV events on %s: blocks of %d tokens, vLLM's KVEventBatch (a KV-aware router "
             "subscribes: docs/routing.md)", cfg.kv_events, cfg.kv_block_size)
    return events


def publish_disk(events: KvEvents, cache: DiskCache) -> None:
    """The disk's entries as they are at start, then each commit and deletion (blocking)."""
    for key, ids in cache.held():
        events.disk("stored", key, ids)
    cache.on_event = events.disk
