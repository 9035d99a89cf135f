"""common_prefix_len: exact answers, including chunk edges of the fast path."""

from __future__ import annotations

import pytest

from policies.prefix import CHUNK_TOKENS, TokenIds, common_prefix_len

BASE = list(range(1000, 31000))  # a 30K-token prompt; ids >= 1000, so 7 never matches


def diverge(at: int, n: int = len(BASE)) -> list[int]:
    """BASE, changed from position ``at`` on, ``n`` tokens long: shares exactly ``at`` ids."""
    return BASE[:at] + [7] * (n - at)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        # Empty against anything shares nothing.
        ([], [], 0),
        ([], [1, 2, 3], 0),
        # Identical prompts share all of it.
        ([1, 2, 3], [1, 2, 3], 3),
        # One is a prefix of the other (the agent case: the last prompt is a prefix of this one).
        ([1, 2, 3], [1, 2, 3, 4, 5], 3),
        ([1, 2, 3, 4, 5], [1, 2], 2),
        # Differ at the first token.
        ([9, 2, 3], [1, 2, 3], 0),
        # Differ in the middle; what follows the mismatch does not count.
        ([1, 2, 9, 4], [1, 2, 3, 4], 2),
        # A list and a tuple of the same ids compare as equal ids.
        ([1, 2, 3], (1, 2, 3, 4), 3),
        # Long prompts: mismatches around the first chunk edge and deep inside.
        (BASE, diverge(0), 0),
        (BASE, diverge(CHUNK_TOKENS - 1), CHUNK_TOKENS - 1),
        (BASE, diverge(CHUNK_TOKENS), CHUNK_TOKENS),
        (BASE, diverge(CHUNK_TOKENS + 1), CHUNK_TOKENS + 1),
        (BASE, diverge(17_321), 17_321),
        (BASE, diverge(29_999), 29_999),
        # A shorter prompt that diverges before its own end, against a longer one.
        (diverge(5_000, 6_000), BASE, 5_000),
        (tuple(BASE), tuple(BASE), 30_000),
    ],
)
def test_common_prefix_len(a: list[int], b: list[int], expected: int) -> None:
    assert common_prefix_len(a, b) == expected
    assert common_prefix_len(b, a) == expected
    # packed ids (memcmp) give the same answer, from any known shared start
    pa, pb = TokenIds(a), TokenIds(b)
    for start in (0, expected // 2, expected):
        assert common_prefix_len(pa, pb, start) == expected
        assert common_prefix_len(pb, pa, start) == expected


def test_common_prefix_len_every_mismatch_position_near_chunk_edges() -> None:
    # Every mismatch position across two chunks (and with fresh int objects, as a separately
    # tokenized prompt has) gives the same answer as the obvious element-wise definition.
    base = BASE[: 2 * CHUNK_TOKENS + 50]
    for at in range(len(base)):
        other = tuple(x + 1 - 1 for x in base[:at]) + (7,) + tuple(base[at + 1 :])
        assert common_prefix_len(base, other) == at
        assert common_prefix_len(TokenIds(base), TokenIds(other)) == at


def test_texts_and_a_known_shared_start() -> None:
    """Two texts compare by character (the proxy's previous request's text against this one's),
    and a start known to be shared is not compared again; the answer is the same."""
    a = "x" * 5000 + "abc" + "y" * 3000
    b = "x" * 5000 + "abd"
    for start in (0, 17, 5000, 5002):
        assert common_prefix_len(a, b, start) == 5002
    assert common_prefix_len(a, a[:4096], 100) == 4096


def test_token_ids_are_a_tuple_with_their_packed_form() -> None:
    import pickle

    ids = TokenIds([5, 70_000, 0, 2**31 - 1])
    assert ids == (5, 70_000, 0, 2**31 - 1) and isinstance(ids, tuple)
    assert len(ids.packed) == 4 * len(ids)
    again = pickle.loads(pickle.dumps(ids))
    assert (type(again), again, again.packed) == (TokenIds, ids, ids.packed)
    assert ids[:2] == (5, 70_000)  # a slice is a plain tuple: compared the plain way
    assert common_prefix_len(ids, ids[:2] + (1,)) == 2
