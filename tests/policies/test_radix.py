"""The radix tree of stored prefixes: inserts, matches, deletes, with exact positions."""

from __future__ import annotations

import random

import pytest

from policies.prefix import TokenIds
from policies.radix import Forest, RadixTree

A = tuple(range(100, 130))  # a 30-token prompt
B = A[:12] + tuple(range(500, 518))  # shares A's first 12 tokens, then diverges


def tree(*entries: tuple[tuple[int, ...], bytes]) -> RadixTree:
    t = RadixTree()
    for ids, key in entries:
        t.insert(ids, key)
    return t


# (entries inserted, prompt, every stored prefix of it: (n_tokens, key), longest first)
MATCH = {
    # nothing stored: nothing found
    "empty": ([], A, []),
    # an entry for the whole prompt, and one for a prefix of it
    "prefixes": ([(A[:10], b"a10"), (A, b"a30")], A, [(30, b"a30"), (10, b"a10")]),
    # an entry longer than the prompt is not a prefix of it
    "longer entry": ([(A, b"a30")], A[:20], []),
    # the prompt diverges inside a run: only the entries before the divergence
    "divergence": ([(A[:5], b"a5"), (A, b"a30")], B, [(5, b"a5")]),
    # an entry at exactly the shared prefix of two prompts (the split point) is found by both
    "shared prefix": ([(A, b"a30"), (B, b"b30"), (A[:12], b"s12")], B,
                      [(30, b"b30"), (12, b"s12")]),
    # an entry ending inside another run splits it; both stay findable
    "split": ([(A, b"a30"), (A[:17], b"a17")], A, [(30, b"a30"), (17, b"a17")]),
    # a prompt that is a prefix of a run's end: nothing beyond what is stored at or before it
    "inside a run": ([(A[:3], b"a3"), (A, b"a30")], A[:29], [(3, b"a3")]),
}


@pytest.mark.parametrize("entries,prompt,found", MATCH.values(), ids=MATCH.keys())
def test_match(entries: list[tuple[tuple[int, ...], bytes]], prompt: tuple[int, ...],
               found: list[tuple[int, bytes]]) -> None:
    assert tree(*entries).match(prompt) == found


def test_delete_keeps_the_rest_and_prunes() -> None:
    t = tree((A[:10], b"a10"), (A, b"a30"), (B, b"b30"))
    assert t.delete(b"a30") and not t.delete(b"a30")  # a second delete finds nothing
    assert t.match(A) == [(10, b"a10")]
    assert t.match(B) == [(30, b"b30"), (10, b"a10")]
    assert t.delete(b"a10")
    assert t.match(B) == [(30, b"b30")]
    assert t.ids_of(b"b30") == B  # the runs merged back together, ids intact
    assert t.delete(b"b30") and len(t) == 0 and t.match(B) == []


def test_reinserting_a_key_moves_it_and_same_tokens_keep_the_newest_key() -> None:
    t = tree((A[:10], b"k"))
    t.insert(A[:20], b"k")
    assert t.match(A) == [(20, b"k")]
    t.insert(A[:20], b"k2")
    assert t.match(A) == [(20, b"k2")] and b"k" not in t and len(t) == 1


def test_parent_children_and_ids() -> None:
    t = tree((A[:5], b"a5"), (A[:12], b"s12"), (A, b"a30"), (B, b"b30"))
    assert t.parent_of(b"a30") == (12, b"s12")
    assert t.parent_of(b"a5") is None
    assert t.children_of(b"s12") == [(30, b"a30"), (30, b"b30")]
    assert t.children_of(b"a5") == [(12, b"s12")]
    t.delete(b"s12")
    assert t.parent_of(b"b30") == (5, b"a5")
    assert t.children_of(b"a5") == [(30, b"a30"), (30, b"b30")]
    assert t.ids_of(b"a30") == A and t.ids_of(b"b30") == B


def test_tenants_never_see_each_other() -> None:
    f = Forest()
    f.tree("t1").insert(A, b"one")
    f.tree("t2").insert(A[:10], b"two")
    assert f.match("t1", A) == [(30, b"one")]
    assert f.match("t2", A) == [(10, b"two")]
    assert f.match("t3", A) == [] and len(f) == 2


def test_agrees_with_brute_force_on_random_prompts() -> None:
    """Many prompts sharing random prefixes, entries inserted and deleted at random: the tree's
    answer is always the brute-force one (every stored entry that is a prefix)."""
    rng = random.Random(7)
    base = [tuple(rng.randrange(50) for _ in range(40)) for _ in range(4)]
    prompts = [b[:rng.randrange(1, 40)] + tuple(rng.randrange(50) for _ in range(20))
               for b in base for _ in range(10)]
    t, stored = RadixTree(), {}
    for step in range(400):
        p = rng.choice(prompts)
        n = rng.randrange(1, len(p) + 1)
        if rng.random() < 0.7:
            key = bytes(f"k{p[:n]}", "ascii")
            t.insert(p[:n], key)
            stored = {k: v for k, v in stored.items() if v != p[:n]}
            stored[key] = p[:n]
        elif stored:
            key = rng.choice(sorted(stored))
            t.delete(key)
            del stored[key]
        q = rng.choice(prompts)
        want = sorted(((len(v), k) for k, v in stored.items() if q[:len(v)] == v), reverse=True)
        assert t.match(q) == want, step
        assert t.match(TokenIds(q)) == want, step  # packed runs, through splits and merges
