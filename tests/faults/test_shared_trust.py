"""The shared tier as a trust boundary (issue 46, section 3), on a real `redis-server` (Debian's
package) on loopback with real state files; the last test runs two real prefixgate hosts.

- A team secret authenticates what a host pulls: an entry whose bytes or fields someone with
  write access to Redis changed (another tenant's state under this tenant's entry, its header
  and checksum rewritten to fit) is a verified miss, and nothing of it stays in the cache
  directory; entry names and tenant tags in Redis are keyed, so no key guess can be tested
  offline against them.
- A malformed entry is a miss and one warning, never an exception (a 500 on the proxy).
- A hung Redis (SIGSTOP) costs one timeout, then the tier is skipped for a while (a breaker,
  one log line when it opens and one when it closes); publishing never makes its caller wait,
  and its queue is bounded (the oldest dropped, counted).
- Redis refusing a write (maxmemory with a policy that evicts nothing) is counted and said once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend import store
from backend.keys import CacheKey
from backend.shared import PUBLISH_QUEUE_MAX, SharedFault, SharedSkipped, SharedTier
from tests.conftest import PASSWORD, Redis, running
from tests.models import BATCH
from tests.proxy.test_disk_cache import ask, convo, entries

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="needs Debian's redis-server (.ci/run installs it)")

FP = b"f" * 16
SECRET = "the-team-secret"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Redis]:
    r = Redis(tmp_path)
    try:
        yield r
    finally:
        os.kill(r.proc.pid, signal.SIGCONT)  # a test may leave it stopped
        r.stop()


def state(tmp: Path, key: bytes, ids: list[int], payload: bytes) -> tuple[Path, int]:
    path, _size, checksum = store.write_state_file(tmp, CacheKey(key), FP, ids,
                                                   memoryview(payload))
    return path, checksum


def leftovers(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()] if directory.exists() else []


def test_a_planted_state_is_a_verified_miss_and_never_stays(tmp_path: Path,
                                                             redis_server: Redis) -> None:
    """Carol's state put under alice's entry, its header given alice's ids and a checksum that
    fits: the MAC refuses it before it reaches the cache directory."""
    tier = SharedTier(redis_server.url, FP, SECRET)
    alice_key, carol_key = b"a" * 16, b"c" * 16
    alice_ids, carol_ids = [1, 2, 3, 4], [1, 2, 3, 5]
    alice, alice_sum = state(tmp_path / "src", alice_key, alice_ids, b"alice's KV " * 100)
    carol, carol_sum = state(tmp_path / "src", carol_key, carol_ids, b"carol's KV " * 100)
    tier.publish(alice_key, "alice", 4, alice_sum, alice)
    tier.publish(carol_key, "carol", 4, carol_sum, carol)
    assert tier.flush()
    r = redis_server.client
    names = list(r.scan_iter("pg:*:e:*"))
    assert len(names) == 2
    tags = {r.hget(n, "tenant") for n in names}
    assert b"alice" not in tags and b"carol" not in tags, tags  # keyed with the secret
    assert not any(alice_key.hex().encode() in n for n in names)  # names keyed too
    alice_entry = next(n for n in names if r.hget(n, "tenant") == tier.tag("alice").encode())

    # the forgery: carol's state bytes with alice's ids, a valid header checksum, its fields
    forged, forged_sum = state(tmp_path / "forge", alice_key, alice_ids,
                               b"carol's KV " * 100)
    part = "0" * 32  # a part of the attacker's naming
    r.set(alice_entry.split(b":e:")[0] + f":p:{part}".encode(), forged.read_bytes())
    r.hset(alice_entry, mapping={"checksum": forged_sum, "size": forged.stat().st_size,
                                 "parts": part, "chunks": 1})
    dest = tmp_path / "cache" / "kv" / "aa" / "alice.kv"
    with pytest.raises(SharedFault, match="MAC does not verify"):
        tier.pull(alice_key, "alice", dest)
    assert leftovers(tmp_path / "cache") == [], "nothing refused stays in the cache dir"
    assert tier.stats()["verify_failures"] == 1

    # a host with another secret (or none) pulls nothing of it either
    for other in (SharedTier(redis_server.url, FP, "another"), SharedTier(redis_server.url, FP,
                                                                         "")):
        assert other.longest({4: carol_key}, "carol") is None
    # alice's true entry, restored, verifies; carol's file never passes as alice's
    tier.publish(alice_key, "alice", 4, alice_sum, alice)
    assert tier.flush()
    assert tier.pull(alice_key, "alice", dest) == alice.stat().st_size
    assert dest.read_bytes() == alice.read_bytes()
    with pytest.raises(SharedFault, match="another tenant"):
        tier.pull(carol_key, "alice", tmp_path / "cache" / "kv" / "cc" / "c.kv")


def test_a_pulled_file_with_a_bad_header_never_stays(tmp_path: Path,
                                                     redis_server: Redis) -> None:
    """Without a secret the MAC still catches damage: a flipped header byte is refused before
    the rename, and no file of it is left in the cache directory."""
    tier = SharedTier(redis_server.url, FP, "")
    key = b"h" * 16
    path, checksum = state(tmp_path / "src", key, [7, 8, 9], b"x" * 5000)
    tier.publish(key, "", 3, checksum, path)
    assert tier.flush()
    entry = next(redis_server.client.scan_iter("pg:*:e:*"))
    first = (redis_server.client.hget(entry, "parts") or b"").split(b",")[0]
    chunk = entry.split(b":e:")[0] + b":p:" + first  # the part with the header
    data = bytearray(redis_server.client.get(chunk) or b"")
    data[5] ^= 0xFF  # the version field
    redis_server.client.set(chunk, bytes(data))
    with pytest.raises(SharedFault, match="refused"):
        tier.pull(key, "", tmp_path / "cache" / "kv" / "hh" / "h.kv")
    assert leftovers(tmp_path / "cache") == []


MALFORMED = [
    # (fields written over a good entry, why it is bad)
    ({"size": "abc"}, "a size that is not an integer"),
    ({"tenant": b"\xff\xfe"}, "a tenant that is not UTF-8"),
    ({"chunks": "-3"}, "a negative chunk count"),
    ({"n_tokens": "1e9"}, "a token count that is not an integer"),
]


@pytest.mark.parametrize(("fields", "why"), MALFORMED)
def test_a_malformed_entry_is_a_miss_and_one_warning(tmp_path: Path, redis_server: Redis,
                                                     caplog: pytest.LogCaptureFixture,
                                                     fields: dict[str, object],
                                                     why: str) -> None:
    tier = SharedTier(redis_server.url, FP, SECRET)
    key = b"m" * 16
    path, checksum = state(tmp_path / "src", key, [1, 2, 3], b"y" * 100)
    tier.publish(key, "t", 3, checksum, path)
    assert tier.flush()
    entry = next(redis_server.client.scan_iter("pg:*:e:*"))
    redis_server.client.hset(entry, mapping=fields)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="prefixgate.shared"):
        for _ in range(3):
            found = tier.longest({3: key}, "t")
            assert found is None or found == (3, key, path.stat().st_size), why
            with pytest.raises(SharedFault):
                tier.pull(key, "t", tmp_path / "cache" / "kv" / "mm" / "m.kv")
    assert leftovers(tmp_path / "cache") == []
    warnings = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    for missing in ("mac", "tenant", "size"):  # fields gone: the same
        redis_server.client.hdel(entry, missing)
        assert tier.longest({3: key}, "t") is None
        with pytest.raises(SharedFault):
            tier.pull(key, "t", tmp_path / "cache" / "kv" / "mm" / "m.kv")


def test_a_hung_redis_is_skipped_and_publishing_never_waits(tmp_path: Path,
                                                             redis_server: Redis,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    tier = SharedTier(redis_server.url, FP, SECRET, backoff_s=1.0)
    key = b"s" * 16
    path, checksum = state(tmp_path / "src", key, [1, 2, 3], b"z" * 1000)
    tier.publish(key, "t", 3, checksum, path)
    assert tier.flush() and tier.longest({3: key}, "t") is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # hung: connections open, no answers
    with caplog.at_level(logging.INFO, logger="prefixgate.shared"):
        with pytest.raises(SharedFault) as first:
            tier.longest({3: key}, "t")  # one timeout
        assert not isinstance(first.value, SharedSkipped) and "Timeout" in str(first.value)
        for _ in range(5):  # then skipped: no round trip, no timeout
            with pytest.raises(SharedSkipped):
                tier.longest({3: key}, "t")
            with pytest.raises(SharedSkipped):
                tier.pull(key, "t", tmp_path / "cache" / "x.kv")
        assert tier.stats()["skipped"] == 10
        opened = [r.getMessage() for r in caplog.records]
        assert sum("skipped for" in m for m in opened) == 1, opened  # said once

        # publishing on another host's tier, its breaker closed: the caller never waits on
        # the hung Redis (its own thread does), and the queue is bounded, the oldest dropped
        other = SharedTier(redis_server.url, FP, SECRET, backoff_s=1.0)
        for _ in range(PUBLISH_QUEUE_MAX + 10):
            assert other.publish(key, "t", 3, checksum, path) == path.stat().st_size
        assert not other.flush(timeout_s=0.1), "the publisher waits on Redis, not the caller"
        stats = other.stats()
        assert PUBLISH_QUEUE_MAX - 1 <= stats["publish_queued"] <= PUBLISH_QUEUE_MAX, stats
        assert stats["publish_dropped"] >= 9, stats  # one may have left the queue already
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        time.sleep(1.1)  # the backoff passes: the next call tries, and closes the breaker
        assert tier.longest({3: key}, "t") == (3, key, path.stat().st_size)
        assert other.flush(60)
    closed = [r.getMessage() for r in caplog.records if r.getMessage() not in opened]
    assert sum("answers again" in m for m in closed) >= 1, closed
    assert not any(PASSWORD in m for m in opened + closed)


def test_a_publish_is_announced_once_redis_holds_it(tmp_path: Path,
                                                    redis_server: Redis) -> None:
    """The shared tier's KV event (a KV-aware router's "any host can pull this") goes out
    once Redis holds the entry, not when the file was queued: never while Redis hangs, never
    for a publish that failed (issue 44)."""
    tier = SharedTier(redis_server.url, FP, SECRET, backoff_s=60.0)
    said: list[bool] = []  # each: whether Redis held the entry when it was said
    key = b"k" * 16
    path, checksum = state(tmp_path / "src", key, [4, 5, 6], b"w" * 2000)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        tier.publish(key, "t", 3, checksum, path,
                     lambda: said.append(bool(redis_server.entries())))
        assert tier.flush(30)  # the send timed out: failed
        assert said == [] and tier.stats()["publish_failures"] == 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    other = SharedTier(redis_server.url, FP, SECRET)  # its breaker closed
    other.publish(key, "t", 3, checksum, path, lambda: said.append(bool(redis_server.entries())))
    assert other.flush(30)
    assert said == [True]


def test_a_refused_write_is_counted_and_said_once(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    redis = Redis(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        tier = SharedTier(redis.url, FP, SECRET)
        with caplog.at_level(logging.WARNING, logger="prefixgate.shared"):
            for i in range(4):
                key = bytes([i]) * 16
                path, checksum = state(tmp_path / "src", key, [1, 2, i], os.urandom(3 << 20))
                tier.publish(key, "t", 3, checksum, path)
                assert tier.flush()
        assert tier.stats()["publish_refused"] == 4
        refusals = [r.getMessage() for r in caplog.records if "refuses writes" in r.getMessage()]
        assert len(refusals) == 1 and "maxmemory" in refusals[0], refusals
        assert not list(redis.client.scan_iter("pg:*:p:*")), "a refused publish's parts go"
    finally:
        redis.stop()


@pytest.mark.model
def test_hosts_answer_through_a_malformed_entry_and_a_hung_redis(tmp_path: Path,
                                                                 redis_server: Redis) -> None:
    """Two real hosts. A malformed entry of a prompt (its size not an integer) was a 500 on
    every request of that prompt; a hung Redis held every request for its timeout."""
    shared = ("--workers", "1", "--shared-tier", redis_server.url)
    env = {"PREFIXGATE_SHARED_TIER_SECRET": SECRET}
    msgs = convo("Which rule mentions the API?")
    with running(tmp_path / "a", *shared, env=env) as a:
        ask(a, msgs)
        entries(a.cache_dir, until=lambda f: any(e.n_tokens > BATCH for e in f))
        assert redis_server.wait_entries(1)
        assert "runs without a secret" not in a.log()
    for name in redis_server.entries():
        redis_server.client.hset(name, "size", "not a number")
    with running(tmp_path / "b", *shared, env=env) as b:
        bad = ask(b, msgs)  # a miss, not a 500
        assert bad["source"] in ("none", "live"), b.log()
        assert "malformed entry" in b.log()
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        hung = [ask(b, convo(f"Name rule {i}.")) for i in range(3)]
        assert all(h["source"] in ("none", "live") for h in hung)
        metrics = b.get("/metrics")[1]
        assert 'prefixgate_shared_lookups_total{result="error"} 1.0' in metrics, metrics
        assert 'prefixgate_shared_lookups_total{result="skipped"} 2.0' in metrics
        log = b.log()
        opened = [line for line in log.splitlines()
                  if "prefixgate.shared" in line and "skipped for" in line]
        assert len(opened) == 1, log  # the proxy's: one line when it opened
        assert PASSWORD not in log and SECRET not in log
        health = json.loads(b.get("/health")[1])
        assert health["status"] == "ok"
    with running(tmp_path / "c", *shared) as c:  # no secret: said in one line
        assert c.log().count("runs without a secret") == 1


def seq_state(n: int, layers: int = 3, row: int = 96) -> bytes:
    """A sequence state of n tokens in llama.cpp's layout (backend/layout.py): position p in
    cell p, per layer a block of K rows and one of V rows; token p's rows the same bytes in
    every state that holds it, as a prompt's snapshots are."""
    import struct as st

    meta = b"".join(st.pack("<iIi", p, 1, 0) for p in range(n))
    out = st.pack("<Ii", 0x67677371, 0) + st.pack("<II", 1, n) + meta + st.pack("<II", 0, layers)
    for kv in (b"K", b"V"):
        for layer in range(layers):
            rows = b"".join((kv + bytes([layer]) + p.to_bytes(4, "little")) * (row // 6)
                            for p in range(n))
            out += st.pack("<iQ", 1, row // 6 * 6) + rows
    return out


def test_snapshots_of_one_prompt_share_their_parts(tmp_path: Path,
                                                   redis_server: Redis) -> None:
    """A prompt's longer snapshot sends only what the shorter one did not hold; both pull back
    byte for byte; pruning one keeps the parts the other still names."""
    from backend.layout import parse
    from backend.shared_admin import prune
    from backend.shared_parts import GROUP_TOKENS

    ids = list(range(1000, 1000 + 3 * GROUP_TOKENS + 50))
    assert len(parse(seq_state(10), 1).sections[0].k) == 3  # the layout parses
    tier = SharedTier(redis_server.url, FP, SECRET)
    short, long_ = 2 * GROUP_TOKENS + 10, len(ids)
    files = {}
    for n in (short, long_):
        key = n.to_bytes(16, "little")
        path, _, checksum = store.write_state_file(tmp_path / "src", CacheKey(key), FP,
                                                   ids[:n], memoryview(seq_state(n)))
        files[n] = (key, path)
        before = tier.stats()["published_bytes"]
        tier.publish(key, "t", n, checksum, path)
        assert tier.flush()
        sent = tier.stats()["published_bytes"] - before
        if n == short:
            assert sent >= path.stat().st_size
    reused = tier.stats()["reused_bytes"]
    assert reused >= 2 * 3 * 2 * GROUP_TOKENS * 96 * 0.9, reused  # 2 groups x 3 layers x K, V
    assert sent < files[long_][1].stat().st_size - reused + 4096, (sent, reused)
    for n, (key, path) in files.items():
        dest = tmp_path / "pulled" / f"{n}.kv"
        assert tier.pull(key, "t", dest) == path.stat().st_size
        assert dest.read_bytes() == path.read_bytes()
    entry_short = next(e for e in redis_server.entries()
                       if redis_server.client.hget(e, "n_tokens") == str(short).encode())
    redis_server.client.hset(entry_short, "published_s", "0")  # the short one is old
    n_entries, _ = prune(redis_server.url, older_than_s=3600)
    assert n_entries == 1
    key, path = files[long_]
    assert tier.pull(key, "t", tmp_path / "again.kv") == path.stat().st_size
    with pytest.raises(SharedFault, match="gone"):
        tier.pull(files[short][0], "t", tmp_path / "short.kv")
