"""The RAM tier (issue 20): its byte bound, eviction by the disk's value score, superseded
entries, and that a request only ever gets its own salt's and tenant's prefix."""

from __future__ import annotations

import numpy as np

from backend.ramtier import RamTier

SALT, OTHER = b"s" * 16, b"o" * 16


def ids(n: int, seed: int = 0) -> np.ndarray:
    return (np.arange(n, dtype=np.intc) * 7 + seed) % 5000


def state(n_bytes: int, fill: int = 1) -> memoryview:
    return memoryview(np.full(n_bytes, fill, dtype=np.uint8))


def test_the_longest_own_prefix_is_taken_and_leaves() -> None:
    tier = RamTier(1 << 20)
    tier.put(SALT, "t", ids(128), state(1000, 1))
    tier.put(SALT, "t", ids(64, seed=9), state(1000, 2))  # another conversation
    prompt = ids(300)
    assert tier.longest(SALT, "t", prompt, 256) == 128
    assert tier.longest(SALT, "t", prompt, 127) == 0, "never past the caller's limit"
    assert tier.longest(OTHER, "t", prompt, 256) == 0, "another salt (model, settings) gets none"
    assert tier.longest(SALT, "u", prompt, 256) == 0, "another tenant gets none"
    n, got = tier.take(SALT, "t", prompt, 256) or (0, b"")
    assert n == 128 and bytes(got) == bytes(state(1000, 1))
    assert tier.take(SALT, "t", prompt, 256) is None, "a restored entry leaves the tier"
    assert tier.stats()["entries"] == 1 and tier.used == 1000


def test_the_budget_evicts_the_least_valuable_first() -> None:
    tier = RamTier(3000)
    tier.put(SALT, "t", ids(1024, 1), state(1000), now_s=0.0)  # 1024 tokens per 1000 bytes
    tier.put(SALT, "t", ids(64, 2), state(1000), now_s=0.0)  # 64 tokens: worth the least
    tier.put(SALT, "t", ids(512, 3), state(1000), now_s=0.0)
    tier.put(SALT, "t", ids(256, 4), state(1000), now_s=0.0)  # 4000 > 3000: one must go
    held = sorted(len(e.ids) for e in tier.entries.values())
    assert held == [256, 512, 1024] and tier.used == 3000
    assert tier.stats()["evicted"] == 1
    tier.put(SALT, "t", ids(2048, 5), state(5000))  # larger than the whole budget
    assert tier.stats()["too_big"] == 1 and tier.used == 3000


def test_a_longer_state_of_the_same_conversation_supersedes_the_shorter() -> None:
    tier = RamTier(-1)  # no limit
    tier.put(SALT, "t", ids(128), state(100))
    tier.put(SALT, "t", ids(256), state(200))
    assert [len(e.ids) for e in tier.entries.values()] == [256] and tier.used == 200
    tier.put(SALT, "t", ids(64), state(50))  # already inside the longer one
    assert [len(e.ids) for e in tier.entries.values()] == [256]
    assert tier.stats()["superseded"] == 2


def test_off_keeps_nothing() -> None:
    tier = RamTier.from_mib(0)
    tier.put(SALT, "t", ids(128), state(100))
    assert not tier.on and tier.stats()["entries"] == 0
    assert RamTier.from_mib(-1).budget < 0 and RamTier.from_mib(2).budget == 2 << 20


def test_a_draft_models_state_counts_in_the_entry_and_the_budget() -> None:
    """An entry holding a draft model's state beside the target's (as llama-server's prompt
    cache does) weighs both: in its size, the tier's use, the budget's evictions and
    `too_big`; both leave with it."""
    tier = RamTier(3000)
    tier.put(SALT, "t", ids(1024, 1), state(1000), now_s=0.0, draft=(1024, state(500)))
    (e,) = tier.entries.values()
    assert (e.size, e.draft_n, tier.used) == (1500, 1024, 1500)
    tier.put(SALT, "t", ids(64, 2), state(1000), now_s=0.0, draft=(64, state(500)))
    assert tier.used == 3000 and len(tier.entries) == 2, "within the budget: both kept"
    tier.put(SALT, "t", ids(512, 3), state(100), now_s=0.0)  # 3100 > 3000: the 64 goes
    assert sorted(len(e.ids) for e in tier.entries.values()) == [512, 1024]
    assert tier.used == 1600 and tier.stats()["evicted"] == 1
    assert tier.take(SALT, "t", ids(2000, 1), 4096) is not None
    assert tier.used == 100, "the draft model's state left with its entry"
    tier.put(SALT, "t", ids(2048, 5), state(2000), draft=(2048, state(1001)))
    e = tier.entries[max(tier.entries)]
    assert (e.size, e.draft_n, tier.stats()["too_big"]) == (2000, 0, 0), \
        "the two together are larger than the budget: the model's state is kept alone"
    tier.put(SALT, "t", ids(4096, 6), state(3001), draft=(4096, state(1)))
    assert tier.stats()["too_big"] == 1 and len(tier.entries) == 2
