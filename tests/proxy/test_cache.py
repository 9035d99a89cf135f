"""The proxy's disk cache owner (proxy/cache.py) on a real LMDB index and real state files in
tmp_path: what a lookup finds by token ids, what a commit records and links, which entries
eviction removes, that the mirror stays equal to the index, and that a restart rebuilds the
lookup from LMDB (and from a file's header where LMDB lacks an entry's path)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend import store
from backend.index import Index
from backend.keys import CacheIdentity, prefix_keys
from backend.protocol import Saved
from policies.decide import Facts, Hit
from policies.plan import CacheKnobs, MessageStart
from policies.scope import Scope
from proxy.cache import DiskCache
from proxy.metrics import Metrics
from tests.entries import entry_of

IDS = tuple(range(5000, 6000))  # a 1000-token prompt
OTHER = IDS[:400] + tuple(range(7000, 7600))  # shares its first 400 tokens
UNIT = 64 << 10  # state files are sized in these (a header's ids add at most 4 KB more)


@pytest.fixture
def identity(tmp_path: Path) -> CacheIdentity:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF weights of a test model")
    return CacheIdentity(str(model), 4096, "f16", "f16", "off", "test")


def open_cache(tmp_path: Path, identity: CacheIdentity, budget: int = 1 << 30) -> DiskCache:
    cache = DiskCache(Index(tmp_path / "cache"), identity, CacheKnobs(continued_interval_tokens=0),
                      budget, Metrics())
    cache.load()
    return cache


def close(cache: DiskCache) -> None:
    cache.close()
    cache.index.close()


@pytest.fixture
def cache(tmp_path: Path, identity: CacheIdentity) -> Iterator[DiskCache]:
    c = open_cache(tmp_path, identity)
    yield c
    close(c)


def save(cache: DiskCache, n: int, reason: str = "scoped", ids: tuple[int, ...] = IDS,
         tenant: str = "", units: int = 1) -> bytes:
    """What a worker does (a real state file, keyed as it keys it), then the commit."""
    k = prefix_keys(cache.salt(tenant), ids, [n])[n]
    path, size_bytes, checksum = store.write_state_file(
        cache.index.cache_dir, k, cache.fingerprint, ids[:n], bytes(units * UNIT))
    cache.commit(Saved(n, k.hex(), reason, str(path.relative_to(cache.index.cache_dir)),
                       size_bytes, checksum, 0.0), tenant, ids)
    return k


def found(cache: DiskCache, ids: tuple[int, ...], tenant: str = "") -> list[int]:
    return [h.n_tokens for h in cache.lookup(Facts(ids, (MessageStart(0, "user"),),
                                                   Scope("full")), tenant).hits]


def mirror_matches_index(cache: DiskCache) -> bool:
    return cache.total_bytes == cache.index.total_bytes() and len(cache) == len(cache.index)


def test_lookup_finds_stored_prefixes_by_tokens_longest_first(cache: DiskCache) -> None:
    facts = Facts(IDS, (MessageStart(0, "user"),), Scope("full"))
    assert cache.lookup(facts, "").hits == ()
    keys = {n: save(cache, n) for n in (100, 437, 700, 1000)}  # 437: inside any message
    stored = cache.lookup(facts, "")
    # the hit and its two fallbacks, each named by its key, file and size (decide weighs it)
    assert stored.hits == tuple(Hit(n, keys[n], entry_of(cache.index, keys[n]).file,  # type: ignore
                                    entry_of(cache.index, keys[n]).size_bytes)  # type: ignore
                                for n in (1000, 700, 437))
    assert stored.positions == frozenset({100, 437, 700, 1000})
    assert found(cache, OTHER) == [100]  # diverges at 400: only what lies before it
    assert found(cache, IDS[:699]) == [437, 100]  # a shorter prompt: nothing past its end
    assert found(cache, IDS, "tenant-b") == []  # another tenant sees nothing of this one's


def test_commits_link_each_entry_to_the_one_it_extends(cache: DiskCache) -> None:
    k100 = save(cache, 100, "cold")
    k700 = save(cache, 700, "growing")
    e700 = entry_of(cache.index, k700)
    assert e700 is not None and (e700.prefix_of, e700.reason) == (k100, "growing")
    k400 = save(cache, 400)  # lands between them: 700 now extends 400
    e400, e700 = entry_of(cache.index, k400), entry_of(cache.index, k700)
    assert e400 is not None and e400.prefix_of == k100
    assert e700 is not None and e700.prefix_of == k400
    assert cache.index.paths()[k700] == IDS[400:700]  # the ids past its parent
    cache.drop(k400)  # and back: 700 extends 100 again
    e700 = entry_of(cache.index, k700)
    assert e700 is not None and e700.prefix_of == k100
    assert cache.index.paths()[k700] == IDS[100:700]
    assert mirror_matches_index(cache)


# (entries in commit order: n_tokens, reason, size in UNITs; the budget in UNITs; what remains)
EVICTION = {
    # under the budget: nothing goes
    "within budget": ([(100, "scoped", 10), (400, "scoped", 40)], 60, [100, 400]),
    # over it: the lowest keep-value goes first; here a 400-token checkpoint that a newer entry
    # (700) extends is superseded (x0.25) and goes before anything else
    "superseded checkpoint first": (
        [(100, "cold", 10), (400, "continued", 40), (700, "scoped", 70)], 100, [100, 700]),
    # the entry just written is protected, even when the budget cannot be met without it
    "the new entry stays": ([(100, "cold", 10), (1000, "full", 500)], 100, [1000]),
    # an anchor (x4) outlives a scoped entry of the same density
    # (of the two scoped entries of the same density, the older goes)
    "anchors weigh more": (
        [(100, "scoped", 10), (400, "cold", 40), (700, "scoped", 70)], 111, [400, 700]),
}


@pytest.mark.parametrize("commits,budget,kept", EVICTION.values(), ids=EVICTION.keys())
def test_eviction_order(tmp_path: Path, identity: CacheIdentity,
                        commits: list[tuple[int, str, int]], budget: int, kept: list[int]) -> None:
    cache = open_cache(tmp_path, identity, budget * UNIT)
    for n, reason, units in commits:
        save(cache, n, reason, units=units)
    assert sorted(e.n_tokens for _, e in cache.index.entries()) == kept
    assert found(cache, IDS) == sorted(kept, reverse=True)  # evicted: gone from lookups too
    assert mirror_matches_index(cache)
    assert cache.metrics.cache_bytes._value.get() == cache.total_bytes
    close(cache)


def test_a_restart_rebuilds_the_lookup_from_lmdb(tmp_path: Path, identity: CacheIdentity) -> None:
    cache = open_cache(tmp_path, identity)
    keys = {n: save(cache, n) for n in (100, 400, 700)}
    save(cache, 900, ids=OTHER)
    save(cache, 300, tenant="tenant-b")
    now = time.time()
    cache.touch(keys[400], now)
    close(cache)
    # an entry whose path record is lost (written by an older prefixgate, or adopted from an
    # orphan file) is rebuilt from its file's header, and its record written again
    index = Index(tmp_path / "cache")
    index.relink(keys[700], b"", ())
    index.close()
    again = open_cache(tmp_path, identity)
    assert found(again, IDS) == [700, 400, 100]
    assert found(again, OTHER) == [900, 400, 100]
    assert found(again, IDS, "tenant-b") == [300]
    assert again.index.paths()[keys[700]] == IDS[400:700]
    hit = entry_of(again.index, keys[400])
    assert hit is not None and (hit.hits, hit.last_used_s) == (1, now)
    assert mirror_matches_index(again)
    close(again)


def test_another_models_entries_are_kept_but_never_found(tmp_path: Path,
                                                         identity: CacheIdentity) -> None:
    cache = open_cache(tmp_path, identity)
    save(cache, 400)
    close(cache)
    other_model = tmp_path / "other.gguf"
    other_model.write_bytes(b"GGUF other weights")
    other = open_cache(tmp_path, CacheIdentity(str(other_model), 4096, "f16", "f16", "off",
                                               "test"))
    assert found(other, IDS) == [] and len(other) == 1  # kept for when that model is back
    close(other)
    back = open_cache(tmp_path, identity)
    assert found(back, IDS) == [400]
    close(back)


def test_lookups_racing_the_writer_never_see_half_a_commit(cache: DiskCache) -> None:
    """Lookups run on request threads while the writer thread commits and drops entries: a
    lookup between a tree insert and the mirror update raised KeyError (a 500). With one lock
    over both, every lookup sees whole entries: each hit's file is its own."""
    import sys
    import threading

    positions = range(10, 810, 4)
    files = {n: f"{n}.state" for n in positions}
    done = threading.Event()
    errors: list[BaseException] = []
    seen = 0

    def writer() -> None:
        try:
            for n in positions:
                k = prefix_keys(cache.salt(""), IDS, [n])[n]
                cache.commit(Saved(n, k.hex(), "scoped", files[n], UNIT, 0, 0.0), "", IDS)
            for n in positions:
                cache.drop(prefix_keys(cache.salt(""), IDS, [n])[n])
        finally:
            done.set()

    def reader() -> None:
        nonlocal seen
        facts = Facts(IDS, (MessageStart(0, "user"),), Scope("full"))
        while not done.is_set():
            try:
                stored = cache.lookup(facts, "")
                assert all(h.file == files[h.n_tokens] for h in stored.hits), stored
                seen += len(stored.hits)
            except BaseException as e:  # noqa: BLE001 - collected, re-raised below
                errors.append(e)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader)
                                                        for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    assert seen > 0, "the readers ran while entries were there"
    assert len(cache) == 0 and mirror_matches_index(cache)
