"""The host's KV events (proxy/kv_events.py): which blocks each tier change publishes, exact
tables first; then the wire, decoded by vLLM's own msgpack schema (its `KVEventBatch` as
msgspec declares it, array_like) and by a real ZMQ subscriber that joins late."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from backend.protocol import TierEvent
from proxy.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Held,
    KvEvents,
    block_hashes,
    encode,
)
from tests.conftest import free_port

B = 4  # tokens per block in these tables
P = list(range(100, 118))  # 18 tokens: 4 whole blocks, 2 tokens past the last
H = block_hashes(P, B)


# --- vLLM's schema, as vllm/distributed/kv_events.py declares it (array_like) -----------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[object]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VllmAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]  # type: ignore


DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def test_only_whole_blocks_are_published_and_a_chain_names_its_prefix() -> None:
    assert len(H) == 4  # the 2 tokens past the 4th block are not a block
    assert block_hashes(P[:8], B) == H[:2]  # a block's hash is the same in every prompt
    other = block_hashes([7, *P[1:]], B)
    assert all(a != b for a, b in zip(H, other, strict=True))  # and names its whole prefix
    assert all(-(1 << 63) <= h < 1 << 63 for h in H)  # signed 64-bit, as vLLM sends them


def test_states_publish_new_tails_and_remove_what_no_state_covers() -> None:
    held = Held(B)
    # a RAM entry of the first 8 tokens: its 2 blocks, from the root
    assert held.store(("w0", "ram", 1), "ram", P[:8]) == [
        BlockStored(tuple(H[:2]), None, tuple(P[:8]), B, "CPU_PINNED")]
    # a longer entry of the same prompt: only its new tail, hung on the block before it
    assert held.store(("w0", "ram", 2), "ram", P) == [
        BlockStored(tuple(H[2:]), H[1], tuple(P[8:16]), B, "CPU_PINNED")]
    # the same blocks on the disk are another medium's: all of them again
    assert held.store(("disk", "disk", b"k"), "disk", P) == [
        BlockStored(tuple(H), None, tuple(P[:16]), B, "DISK")]
    # the short entry leaves: the long one still covers its blocks, nothing is removed
    assert held.remove(("w0", "ram", 1)) == []
    # the long one leaves: every RAM block goes, deepest first; the disk's stay
    assert held.remove(("w0", "ram", 2)) == [BlockRemoved(tuple(reversed(H)), "CPU_PINNED")]
    assert held.remove(("w0", "ram", 2)) == []  # an unknown state: nothing


def test_a_slot_replaced_keeps_the_blocks_its_new_prompt_shares() -> None:
    held = Held(B)
    held.store(("w0", "live", 0), "live", P)
    q = [*P[:8], 9, 9, 9, 9, 9]  # shares 2 blocks, then differs
    hq = block_hashes(q, B)
    assert held.store(("w0", "live", 0), "live", q) == [
        BlockStored((hq[2],), H[1], (9, 9, 9, 9), B, "GPU"),
        BlockRemoved((H[3], H[2]), "GPU")]
    assert held.store(("w0", "live", 0), "live", q) == []  # said again: nothing new
    # the worker's events stream ended (a restart): what it held is gone, the disk's is not
    held.store(("disk", "disk", b"k"), "disk", P)
    assert held.forget("w0") == [BlockRemoved(tuple(reversed(hq)), "GPU")]
    assert [s.medium for s in held.states.values()] == ["DISK"]


def test_the_wire_is_vllms_kv_event_batch() -> None:
    events = [AllBlocksCleared(), BlockStored(tuple(H), None, tuple(P[:16]), B, "DISK"),
              BlockRemoved((H[3],), "DISK")]
    batch = DECODE.decode(encode(events, 12.5))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    cleared, stored, removed = batch.events
    assert isinstance(cleared, VllmAllBlocksCleared)
    assert stored == VllmBlockStored(H, None, P[:16], B, None, "DISK")
    assert removed == VllmBlockRemoved([H[3]], "DISK")


def subscribe(port: int) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def events_of(sub: zmq.Socket) -> tuple[int, list[object]]:
    topic, seq, payload = sub.recv_multipart()
    assert topic == b""
    return int.from_bytes(seq, "big"), DECODE.decode(payload).events


def test_a_subscriber_that_joins_late_gets_what_the_host_holds() -> None:
    port = free_port()
    pub = KvEvents(f"tcp://127.0.0.1:{port}", B)
    try:
        # before anyone listens: a worker's RAM entry and a disk entry
        pub.tier_event("worker 0", TierEvent("stored", "ram", 3, "aa", "", len(P), tuple(P)))
        pub.disk("stored", b"key", P[:8])
        sub = subscribe(port)
        seq, events = events_of(sub)
        while len(events) < 2:  # batches sent as it joined, before its own
            seq, events = events_of(sub)
        assert isinstance(events[0], VllmAllBlocksCleared)
        assert {(e.medium, tuple(e.block_hashes)) for e in events[1:]} == {
            ("CPU_PINNED", tuple(H)), ("DISK", tuple(H[:2]))}
        # then each change as it comes, numbered in order
        pub.tier_event("worker 0", TierEvent("removed", "ram", 3, "aa", "", len(P)))
        seq2, events = events_of(sub)
        assert seq2 == seq + 1
        assert events == [VllmBlockRemoved(list(reversed(H)), "CPU_PINNED")]
        pub.disk("removed", b"key", ())
        assert events_of(sub)[1] == [VllmBlockRemoved(list(reversed(H[:2])), "DISK")]
        props = pub.props()
        assert props.pop("batches_sent") >= seq2 + 1  # (counted just after each is sent)
        assert props == {"endpoint": f"tcp://127.0.0.1:{port}", "block_size": B, "topic": "",
                         "states": 0, "blocks": {}}
        sub.close(0)
    finally:
        pub.close()


def test_a_taken_address_is_one_clear_error() -> None:
    port = free_port()
    pub = KvEvents(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(ValueError, match=f"--kv-events tcp://127.0.0.1:{port}: cannot bind"):
            KvEvents(f"tcp://127.0.0.1:{port}")
    finally:
        pub.close()
    time.sleep(0.1)


def test_a_snapshot_stores_each_block_once_per_medium() -> None:
    # Dynamo counts a second store of a block as a second holder: one removal would not clear it
    held = Held(B)
    held.store(("w0", "ram", 1), "ram", P[:8])
    held.store(("w0", "ram", 2), "ram", P)
    held.store(("w0", "live", 0), "live", P[:12])
    assert held.snapshot() == [
        AllBlocksCleared(),
        BlockStored(tuple(H[:2]), None, tuple(P[:8]), B, "CPU_PINNED"),
        BlockStored(tuple(H[2:]), H[1], tuple(P[8:16]), B, "CPU_PINNED"),
        BlockStored(tuple(H[:3]), None, tuple(P[:12]), B, "GPU")]


def test_the_shared_tier_is_a_recent_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # Redis evicts without telling: the newest shared states, SHARED_TOKENS_KEPT tokens of them,
    # are kept, and an older one's removal is published
    monkeypatch.setattr("proxy.kv_events.SHARED_TOKENS_KEPT", 16)
    held = Held(B)
    q, r = [7, *P[1:8]], [8, *P[1:8]]
    held.store(("shared", "shared", 1), "shared", P[:8])
    held.store(("shared", "shared", 2), "shared", q)
    assert held.store(("shared", "shared", 3), "shared", r) == [
        BlockStored(tuple(block_hashes(r, B)), None, tuple(r), B, "EXTERNAL"),
        BlockRemoved(tuple(reversed(H[:2])), "EXTERNAL")]


def test_it_connects_to_a_subscriber_that_binds_with_its_topic() -> None:
    # llm-d's indexer binds one SUB socket and each pod connects to it, under kv@POD@MODEL
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.bind(f"tcp://127.0.0.1:{port}")
    pub = KvEvents(f">tcp://127.0.0.1:{port}", B, "kv@10.0.0.7@smollm2")
    try:
        pub.disk("stored", b"key", P)
        while True:
            topic, _, payload = sub.recv_multipart()
            events = DECODE.decode(payload).events
            if any(isinstance(e, VllmBlockStored) for e in events):
                break
        assert topic == b"kv@10.0.0.7@smollm2"
        assert [e.medium for e in events if isinstance(e, VllmBlockStored)] == ["DISK"]
    finally:
        pub.close()
        sub.close(0)
