"""The shared snapshot tier across hosts (issue 22): a real `redis-server` (Debian's package)
on loopback, two prefixgate instances with their own cache directories and the same model.

A session's turns run on A; A is killed (SIGKILL); the next turn, sent to B, restores from the
shared tier: it prefills at most the turn's new tokens, and its greedy answer equals a cold
run's. A corrupted chunk is a verified miss; a Redis that is gone is a miss; a tenant never
pulls another's entry. No request fails in any of it."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PASSWORD, Redis, running
from tests.models import BATCH
from tests.proxy.test_disk_cache import ask, convo, entries

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="needs Debian's redis-server (.ci/run installs it)")]


def test_a_session_moves_to_another_host_with_its_cache(tmp_path: Path,
                                                        redis_server: Redis) -> None:
    # the team's secret by its flag: the proxy and its workers key and verify with it
    shared = ("--workers", "1", "--shared-tier", redis_server.url, "--shared-tier-secret",
              "team-secret")
    turn1, turn2, turn3 = (convo("Which rule is about files?", history=h) for h in (0, 1, 2))
    with running(tmp_path / "a", *shared) as a:
        ask(a, turn1)
        second = ask(a, turn2)
        entries(a.cache_dir, until=lambda f: any(e.n_tokens > BATCH * 4 for e in f))
        published = redis_server.wait_entries(2)
        assert published, a.log()
        a.proc.send_signal(signal.SIGKILL)  # the host goes; its worker follows its parent
        a.proc.wait()
    with running(tmp_path / "b", *shared) as b:
        moved = ask(b, turn3)
        assert moved["source"] == "shared", b.log()
        new_tokens = moved["prompt"] - second["prompt"]
        assert moved["prompt"] - moved["cached"] <= new_tokens + 2 * BATCH, (moved, second)
        pulled = entries(b.cache_dir, until=lambda f: any(e.reason == "shared" for e in f))
        assert any(e.reason == "shared" for e in pulled), "a pulled snapshot is local now"
        metrics = b.get("/metrics")[1]
        assert 'prefixgate_shared_lookups_total{result="hit"} 1.0' in metrics
        assert 'prefixgate_shared_worker{stat="pulls",worker="0"} 1.0' in metrics
        assert PASSWORD not in a.log() + b.log() and "team-secret" not in a.log() + b.log()
        assert "without a secret" not in a.log() + b.log()
    with running(tmp_path / "cold", "--workers", "1", "--disk-prefix-cache", "off") as cold:
        assert ask(cold, turn3)["text"] == moved["text"]


def test_a_corrupted_chunk_a_lost_redis_and_another_tenant_are_misses(
        tmp_path: Path, redis_server: Redis) -> None:
    shared = ("--workers", "1", "--shared-tier", redis_server.url, "--tenant-isolation")
    msgs = convo("Which rule mentions the API?")
    other = convo("Which rule is about invented APIs?")
    with running(tmp_path / "a", *shared) as a:
        ask(a, msgs, key="alice")
        ask(a, other, key="alice")
        redis_server.wait_entries(2)
    for chunk in redis_server.client.scan_iter("pg:*:p:*"):  # flip a byte in every part
        data = bytearray(redis_server.client.get(chunk) or b"")
        data[len(data) // 2] ^= 0xFF
        redis_server.client.set(chunk, bytes(data))
    with running(tmp_path / "b", *shared) as b:
        bob = ask(b, msgs, key="bob")  # alice's entry: never bob's
        assert (bob["source"], bob["cached"]) == ("none", 0)
        corrupt = ask(b, other, key="alice")  # alice's, but its bytes do not verify
        assert corrupt["source"] in ("none", "live") and corrupt["cached"] < BATCH * 2, \
            b.log()
        assert "shared" not in {e.reason for e in entries(b.cache_dir)}, "nothing bad kept"
        redis_server.stop()  # the tier goes away: a miss, never an error
        gone = ask(b, convo("Name one rule."), key="alice")
        assert gone["source"] in ("none", "live")
        assert 'prefixgate_shared_lookups_total{result="error"}' in b.get("/metrics")[1]
        assert "shared tier lookup failed" in b.log() and PASSWORD not in b.log()
    with running(tmp_path / "cold", "--workers", "1", "--disk-prefix-cache", "off") as cold:
        assert ask(cold, msgs)["text"] == bob["text"]
        assert ask(cold, other)["text"] == corrupt["text"]


def test_cache_commands_list_and_prune_the_shared_tier(tmp_path: Path,
                                                       redis_server: Redis) -> None:
    """`prefixgate cache shared-ls|shared-prune` on a state file published here (no model)."""
    import sys

    from backend import store
    from backend.keys import CacheKey
    from backend.shared import SharedTier
    from tests.conftest import ROOT

    path, _size, checksum = store.write_state_file(tmp_path, CacheKey(b"k" * 16), b"f" * 16,
                                                   [1, 2, 3], memoryview(b"x" * 1000))
    tier = SharedTier(redis_server.url, b"f" * 16)
    tier.publish(b"k" * 16, "", 3, checksum, path)
    assert tier.flush()  # published on the tier's own thread

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "proxy.cli", "cache", *args,
                               "--shared-tier", redis_server.url], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    ls = cli("shared-ls")
    assert ls.returncode == 0 and (b"k" * 16).hex() in ls.stdout and "1 entries" in ls.stdout
    assert cli("shared-prune", "--older-than", "3600").stdout.startswith("pruned 0 entries")
    assert cli("shared-prune").stdout.startswith("pruned 1 entries (1 chunks)")
    assert redis_server.entries() == [] and not list(redis_server.client.scan_iter("pg:*"))
    redis_server.stop()
    down = cli("shared-ls")
    assert down.returncode != 0 and "Connection refused" in down.stderr
    assert PASSWORD not in down.stdout + down.stderr


def test_a_publish_or_pull_cut_short_is_a_miss(tmp_path: Path, redis_server: Redis) -> None:
    """What Redis killed mid-publish or mid-pull leaves (no model: state files written here):
    chunks without their entry are never found; an entry whose chunk is gone, or a Redis that
    dies before the pull, is a SharedFault (the caller's miss) and leaves no file behind."""
    from backend import store
    from backend.keys import CacheKey
    from backend.shared import SharedFault, SharedTier

    tier = SharedTier(redis_server.url, b"f" * 16)
    key = b"a" * 16
    path, _size, checksum = store.write_state_file(tmp_path / "src", CacheKey(key), b"f" * 16,
                                                   [1, 2, 3], memoryview(b"x" * 1000))
    tier.publish(key, "t", 3, checksum, path)
    assert tier.flush()
    entry = redis_server.client.scan_iter("pg:*:e:*").__next__()
    fields = redis_server.client.hgetall(entry)
    redis_server.client.delete(entry)  # a publish killed before its entry was written
    assert tier.longest({3: key}, "t") is None
    redis_server.client.hset(entry, mapping=fields)
    assert tier.longest({3: key}, "t") == (3, key, path.stat().st_size)
    assert tier.longest({3: key}, "another tenant") is None
    dest = tmp_path / "dst" / "kv" / "a.kv"
    for chunk in redis_server.client.scan_iter("pg:*:p:*"):
        redis_server.client.delete(chunk)  # evicted, or the pull's Redis went away
    with pytest.raises(SharedFault, match="chunk 0 of 1 is gone"):
        tier.pull(key, "t", dest)
    assert not dest.exists() and not list(dest.parent.iterdir()), "no file, no temp file"
    redis_server.stop()
    with pytest.raises(SharedFault, match="ConnectionError"):
        tier.pull(key, "t", dest)
    with pytest.raises(SharedFault):
        tier.longest({3: key}, "t")


def test_a_draft_models_twin_stays_on_its_host(tmp_path: Path, redis_server: Redis) -> None:
    """A state file with a draft model's twin (no model: written here) is published without
    it: Redis holds the model's state alone, and the pulled file is that state, verified,
    with no twin."""
    from backend import store
    from backend.keys import CacheKey
    from backend.shared import SharedTier

    tier = SharedTier(redis_server.url, b"f" * 16)
    key = b"t" * 16
    path, size, checksum = store.write_state_file(
        tmp_path / "src", CacheKey(key), b"f" * 16, [1, 2, 3], memoryview(b"x" * 1000),
        store.Twin(b"d" * 16, 2, b"y" * 5000))
    plain = store.model_state_end(path.read_bytes())
    assert size > plain
    tier.publish(key, "t", 3, checksum, path)
    assert tier.flush()
    assert tier.longest({3: key}, "t") == (3, key, plain)
    dest = tmp_path / "dst" / "kv" / "t.kv"
    assert tier.pull(key, "t", dest) == plain
    assert dest.read_bytes() == path.read_bytes()[:plain]
    assert store.read_twin_into(dest, b"d" * 16, [1, 2, 3]) is None
    sent = sum(len(redis_server.client.get(k)) for k in redis_server.client.scan_iter("pg:*:p:*"))
    assert sent == plain, "no byte of the twin in Redis"
