"""The proxy's disk cache owner (proxy/cache.py) on a real LMDB index in tmp_path: what a lookup
returns, what a commit records, which entries eviction removes, and that its in-memory mirror
stays equal to the index through commits, hits, drops and a restart."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.index import Entry, Index
from backend.keys import CacheIdentity, prefix_keys
from backend.protocol import Saved
from policies.decide import Facts, Hit
from policies.plan import CacheKnobs, MessageStart
from policies.scope import Scope
from proxy.cache import DiskCache
from proxy.metrics import Metrics

IDS = tuple(range(5000, 6000))  # a 1000-token prompt
BOUNDARIES = (100, 400, 700, 1000)


@pytest.fixture
def identity(tmp_path: Path) -> CacheIdentity:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF weights of a test model")
    return CacheIdentity(str(model), 4096, "f16", "f16", False, "test")


def open_cache(tmp_path: Path, identity: CacheIdentity, budget: int) -> DiskCache:
    cache = DiskCache(Index(tmp_path / "cache"), identity, CacheKnobs(continued_interval_tokens=0),
                      budget, Metrics())
    cache.load()
    return cache


@pytest.fixture
def cache(tmp_path: Path, identity: CacheIdentity) -> Iterator[DiskCache]:
    c = open_cache(tmp_path, identity, 1 << 30)
    yield c
    c.close()
    c.index.close()


def key(cache: DiskCache, n: int) -> bytes:
    return prefix_keys(cache.salt(""), IDS, [n])[n]


def save(cache: DiskCache, n: int, reason: str, size: int, keyed: dict[int, bytes]) -> bytes:
    k = key(cache, n)
    cache.commit(Saved(n, k.hex(), reason, f"kv/{k.hex()}.kv", size, 1, 0.0), "", keyed)
    return k


def mirror_matches_index(cache: DiskCache) -> bool:
    index = cache.index
    return cache.total_bytes == index.total_bytes() and len(cache) == len(index)


def test_lookup_finds_the_stored_candidates_longest_first(cache: DiskCache) -> None:
    facts = Facts(IDS, BOUNDARIES, (MessageStart(0, "system"), MessageStart(400, "user")),
                  Scope("full"))
    empty = cache.lookup(facts, "")
    assert (empty.hits, empty.positions) == ((), frozenset())
    assert sorted(empty.keys) == [100, 400, 700, 1000]  # candidates: boundaries and the end
    for n in (100, 400, 700):
        save(cache, n, "scoped", 10, empty.keys)
    found = cache.lookup(facts, "")
    # the hit and its two fallbacks, each named by its key and file
    assert found.hits == tuple(Hit(n, empty.keys[n], f"kv/{empty.keys[n].hex()}.kv")
                               for n in (700, 400, 100))
    assert found.positions == frozenset({100, 400, 700})
    assert found.longest == 700
    # another tenant's salt: nothing of this tenant's is found
    assert cache.lookup(facts, "tenant-b").hits == ()


def test_a_commit_records_which_entry_it_extends(cache: DiskCache) -> None:
    keyed = {n: key(cache, n) for n in (100, 400, 700)}
    save(cache, 100, "cold", 10, keyed)
    save(cache, 700, "growing", 70, keyed)  # extends 100 (400 is not stored)
    e100, e700 = cache.index.get(keyed[100]), cache.index.get(keyed[700])
    assert e100 is not None and e100.prefix_of == b""
    assert e700 is not None and (e700.prefix_of, e700.reason) == (keyed[100], "growing")
    assert e700.fingerprint == cache.fingerprint and e700.size_bytes == 70
    assert mirror_matches_index(cache)


# (entries in commit order: n_tokens, reason, size_bytes; the budget; what remains)
EVICTION = {
    # under the budget: nothing goes
    "within budget": ([(100, "scoped", 10), (400, "scoped", 40)], 50, [100, 400]),
    # over it: the lowest keep-value goes first; here a 400-token checkpoint that a newer entry
    # (700) extends is superseded (x0.25) and goes before anything else
    "superseded checkpoint first": (
        [(100, "cold", 10), (400, "continued", 40), (700, "scoped", 70)], 100, [100, 700]),
    # the entry just written is protected, even when the budget cannot be met without it
    "the new entry stays": ([(100, "cold", 10), (1000, "full", 500)], 100, [1000]),
    # an anchor (x4) outlives a scoped entry of the same density
    "anchors weigh more": (
        [(100, "scoped", 10), (400, "cold", 40), (700, "scoped", 70)], 110, [400, 700]),
}


@pytest.mark.parametrize("commits,budget,kept", EVICTION.values(), ids=EVICTION.keys())
def test_eviction_order(tmp_path: Path, identity: CacheIdentity,
                        commits: list[tuple[int, str, int]], budget: int, kept: list[int]) -> None:
    cache = open_cache(tmp_path, identity, budget)
    keyed = {n: key(cache, n) for n, _, _ in commits}
    for n, reason, size in commits:
        save(cache, n, reason, size, keyed)
    assert sorted(e.n_tokens for _, e in cache.index.entries()) == kept
    assert mirror_matches_index(cache)
    assert cache.metrics.cache_bytes._value.get() == cache.total_bytes
    cache.close()
    cache.index.close()


def test_the_mirror_follows_hits_drops_and_a_restart(tmp_path: Path,
                                                     identity: CacheIdentity) -> None:
    cache = open_cache(tmp_path, identity, 1 << 30)
    keyed = {n: key(cache, n) for n in (100, 400, 700)}
    for n in (100, 400, 700):
        save(cache, n, "scoped", n, keyed)
    now = time.time()
    cache.touch(keyed[400], now)
    cache.drop(keyed[100])
    assert mirror_matches_index(cache) and len(cache) == 2
    hit = cache.index.get(keyed[400])
    assert hit is not None and (hit.hits, hit.last_used_s) == (1, now)
    cache.close()
    cache.index.close()
    # a restart with a smaller budget: reconcile drops entries whose file is gone (these have
    # none), so write the files first, then reopen: load() evicts down to the budget at once,
    # keeping the entry that was hit (400) over the one that never was (700)
    index = Index(tmp_path / "cache")
    for _, e in index.entries():
        path = tmp_path / "cache" / e.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * e.size_bytes)
    index.put(keyed[100], Entry(100, "kv/gone.kv", 5, 0, "cold", 0.0, 0.0, 0, b"", ""))
    index.close()
    again = open_cache(tmp_path, identity, 500)
    assert sorted(e.n_tokens for _, e in again.index.entries()) == [400]  # 100: no file
    assert mirror_matches_index(again) and again.total_bytes == 400
    again.close()
    again.index.close()
