"""common_prefix_len: exact answers, including chunk edges of the fast path."""

from __future__ import annotations

import random

import pytest

from policies.prefix import (
    BATCH_GAIN,
    CHUNK_TOKENS,
    FA_TILE,
    Batching,
    Padding,
    TokenIds,
    aligned,
    choose_batch,
    choose_padding,
    common_prefix_len,
    keep_max,
    outputs_max,
    pack,
)

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


def test_common_prefix_len_of_texts_is_the_characters_they_share() -> None:
    """Two texts (a body, a render) are compared in place, bisected: every mismatch position,
    from any known shared start, as the character-by-character definition says."""
    rng = random.Random(3)
    base = "".join(rng.choice("ab\u00e9\U0001f600") for _ in range(300))
    for at in range(len(base) + 1):
        for other in (base[:at] + "x" + base[at + 1:], base[:at]):
            want = next((i for i, (x, y) in enumerate(zip(base, other, strict=False))
                         if x != y), min(len(base), len(other)))
            for start in (0, want // 2, want):
                assert common_prefix_len(base, other, start) == want
                assert common_prefix_len(other, base, start) == want


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


def test_token_ids_read_their_packed_form_as_a_tuple_would() -> None:
    import pickle

    import numpy as np

    ids = TokenIds([5, 70_000, 0, 2**31 - 1])
    assert ids == (5, 70_000, 0, 2**31 - 1) and (5, 70_000, 0, 2**31 - 1) == ids
    assert hash(ids) == hash((5, 70_000, 0, 2**31 - 1)) and ids != [5, 70_000, 0, 2**31 - 1]
    assert len(ids) == 4 and len(ids.packed) == 4 * len(ids) and list(ids) == ids.tolist()
    assert (ids[0], ids[-1], ids[1:3], ids[::2]) == (5, 2**31 - 1, (70_000, 0), (5, 0))
    with pytest.raises(IndexError):
        ids[4]
    again = pickle.loads(pickle.dumps(ids))
    assert (type(again), again, again.packed) == (TokenIds, ids, ids.packed)
    # slices and sums stay packed: their bytes are copied, not their ints
    assert isinstance(ids[:2], TokenIds) and ids[:2].packed == ids.packed[:8]
    assert ids[:2] + (1,) == (5, 70_000, 1) and (1,) + ids[:1] == (1, 5)
    assert isinstance(ids[:2] + [1], TokenIds) and ids + ids == (*ids, *ids)
    assert common_prefix_len(ids, ids[:2] + (1,)) == 2
    assert common_prefix_len(ids, (5, 70_000, 9)) == 2 == common_prefix_len([5, 70_000], ids)
    assert TokenIds.from_packed(ids.packed) == ids and TokenIds(ids).packed is ids.packed
    # numpy reads the packed ids in place
    assert np.asarray(ids, dtype=np.intc).tolist() == list(ids)
    assert np.asarray(ids).dtype == np.intc and np.array_equal(np.asarray(ids[1:]), ids[1:])
    mine = np.array(ids)  # a copy it may write to; the ids stay as they were
    mine[0] = 9
    assert ids[0] == 5 and np.array(ids, dtype=np.int64).flags.writeable


# --- batch edges (policies.prefix.Batching) ---------------------------------------------------

END = 7  # an end-of-turn id in these tests


def reference_edges(ids: list[int], size: int, ends: set[int]) -> list[int]:
    """The rule, token by token: a batch ends after `size` tokens, or right after an end id once
    it holds at least size // 8 (and 1) tokens."""
    least = max(size // 8, 1)
    out, start = [0], 0
    for p in range(1, len(ids) + 1):
        if p - start == size or (ids[p - 1] in ends and p - start >= least):
            out.append(p)
            start = p
    return out


def conversation(rng: random.Random, n: int) -> list[int]:
    """Messages of 1-150 ids, each closed by END, ids 0-300 (END inside them too)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += [rng.randrange(300) for _ in range(rng.randrange(1, 150))] + [END]
    return ids[:n]


@pytest.mark.parametrize("size", [1, 8, 64, 512])
def test_batch_edges_follow_the_rule_and_never_depend_on_what_comes_after(size: int) -> None:
    rng = random.Random(size)
    b = Batching(size, frozenset({END, 11}))
    for _ in range(30):
        ids = conversation(rng, rng.randrange(0, 2000))
        want = reference_edges(ids, size, {END, 11})
        for form in (ids, tuple(ids), TokenIds(ids)):
            e = b.edges(form)
            assert [p for p in range(len(ids) + 1) if p in e] == want
        e = b.edges(TokenIds(ids))
        floor, nxt = [0] * (len(ids) + 1), [len(ids)] * (len(ids) + 1)
        for q, r in zip(want, [*want[1:], len(ids)], strict=True):
            floor[q : r + 1] = [q] * (r + 1 - q)
            nxt[q:r] = [r] * (r - q)
        for p in range(len(ids) + 1):  # floor and next agree with the edges
            assert e.floor(p) == floor[p]
            if p < len(ids):
                assert e.next(p) == nxt[p]
                assert 0 < nxt[p] - floor[p] <= size, "a batch holds at most `size` tokens"
        assert e.keep_max == max(q for q in want if q <= max(len(ids) - 1, 0))
        cut = rng.randrange(len(ids) + 1)  # a prefix: the same edges up to its end
        assert [p for p in range(cut + 1) if p in b.edges(ids[:cut])] == \
            [p for p in want if p <= cut]
        lo, hi = sorted(rng.sample(range(len(ids) + 2), 2))
        assert e.down(hi, lo) == [q for q in reversed(want) if lo < q <= hi]
        stored = frozenset(rng.sample(range(-2, len(ids) + 3), min(len(ids) + 5, 40)) + want[:3])
        for most in (hi, len(ids), len(ids) + 9):  # `among`: the membership test, as a set
            assert e.among(stored, most) == {p for p in stored if p in e and p <= most}


def test_batch_edges_fall_at_message_ends() -> None:
    """A conversation's edges: after each message of at least size // 8 tokens, and every
    `size` tokens inside a long one; a short message joins the next batch."""
    msgs = [[1] * 100, [END], [2] * 30, [END], [3] * 3, [END], [4] * 1200, [END], [5] * 10]
    ids = [t for m in msgs for t in m]
    e = Batching(512, frozenset({END})).edges(ids)
    got = [p for p in range(len(ids) + 1) if p in e]
    # 100 + END = 101 >= 64: an edge; 30 + END (31) and 3 + END (35 in all) < 64: joined with
    # the long message, cut at 101 + 512 and 101 + 1024, then its END at 1337 (212 >= 64)
    assert got == [0, 101, 613, 1125, 1337]
    assert e.keep_max == 1337 and e.next(1337) == len(ids)
    assert Batching(512).edges(ids).keep_max == 1024, "without end ids: multiples of 512"


def test_without_end_ids_the_edges_are_the_batch_multiples() -> None:
    for n in (0, 1, 63, 64, 65, 1025):
        e = Batching(64).edges(list(range(n)))
        assert e.keep_max == keep_max(n, 64)
        assert all(e.floor(p) == aligned(p, 64) for p in range(n + 1))
        assert [p for p in range(n + 1) if p in e] == list(range(0, n + 1, 64))
        assert e.among(frozenset(range(-64, n + 65)), n // 2) == set(range(0, n // 2 + 1, 64))


def test_an_end_id_found_across_two_packed_ids_is_not_an_end() -> None:
    """The end ids are found in the packed bytes: a match that straddles two ids (here the
    bytes of END spread over the high bytes of one id and the low bytes of the next) is not one."""
    end = int.from_bytes(pack([0x01020304])[2:] + pack([0x05060708])[:2], "little", signed=True)
    ids = [0x01020304, 0x05060708] * 40 + [end] + [9] * 20
    b = Batching(64, frozenset({end}))
    assert [p for p in range(len(ids) + 1) if p in b.edges(TokenIds(ids))] == \
        reference_edges(ids, 64, {end})


def test_batch_edges_resumed_from_a_recent_prompt_equal_a_fresh_walk() -> None:
    """Edges are remembered for a few recent prompts and a prompt that shares a prefix with one
    resumes the walk where they part: a conversation growing a turn at a time, interleaved with
    others and with edits far back, always gets the rule's edges."""
    rng = random.Random(5)
    b = Batching(64, frozenset({END}))
    sessions = [conversation(rng, 200) for _ in range(12)]  # more than are remembered
    for _ in range(200):
        i = rng.randrange(len(sessions))
        ids = sessions[i]
        if rng.random() < 0.2 and len(ids) > 10:  # an edit far back
            ids = ids[: rng.randrange(len(ids))] + [rng.randrange(300)]
        ids = ids + conversation(rng, rng.randrange(1, 300))
        sessions[i] = ids
        form = TokenIds(ids) if rng.random() < 0.5 else ids
        assert [p for p in range(len(ids) + 1) if p in b.edges(form)] == \
            reference_edges(ids, 64, {END})


# --- a CPU worker's batch, from what it measured (issue 41) -------------------------------------

@pytest.mark.parametrize(("token_s", "batch"), [
    ({128: 1.00, 512: 1.00}, 128),  # equal (2 AMD EPYC cores): the finer edges
    ({128: 1.07, 512: 1.00}, 128),  # within BATCH_GAIN: not worth edges 4x apart
    ({128: 1.08, 512: 1.00}, 512),
    ({128: 1.19, 512: 1.00}, 512),  # 2 Intel Xeon cores with AMX
    ({128: 0.90, 512: 1.00}, 128),
    ({128: 1.20}, 128), ({}, 128), ({128: 0.0, 512: 0.0}, 128),  # nothing measured
])
def test_a_cpu_takes_512_only_where_it_prefills_enough_faster(token_s: dict[int, float],
                                                              batch: int) -> None:
    assert BATCH_GAIN == 1.08
    assert choose_batch(token_s) == batch


# --- flash attention batches padded to a tile (issue 41) ----------------------------------------

def test_a_padding_takes_the_short_batches_past_its_position() -> None:
    pad = Padding(16, 2048)
    assert FA_TILE == 64
    assert [pad.rows(n, 2048) for n in (1, 15, 16, 40, 63, 64, 300)] == [0, 0, 48, 24, 1, 0, 0]
    assert pad.rows(40, 2047) == 0 and pad.rows(40, 9000) == 24  # before its position: not
    assert Padding().rows(40, 9000) == 0 and str(Padding()) == ""
    assert str(pad) == "flash attention batches of 16-63 rows from position 2048 padded to 64"


@pytest.mark.parametrize(("seconds", "least"), [
    # 2 Intel Xeon cores, SmolLM2, flash attention on, 2K tokens in (ms): from 16 rows
    ({16: 0.402, 32: 0.820, 48: 1.220, 64: 0.379}, 16),
    ({16: 0.251, 32: 0.465, 48: 0.700, 64: 0.272}, 32),  # 1K tokens in: from 32
    ({16: 0.054, 32: 0.100, 48: 0.150, 64: 0.177}, 0),  # at the start: never
    ({16: 0.2, 32: 0.4, 48: 0.6}, 0), ({}, 0),  # the tile not measured: never
])
def test_the_padding_starts_where_a_short_batch_costs_a_tile(seconds: dict[int, float],
                                                             least: int) -> None:
    assert choose_padding(seconds, 2048) == (Padding(least, 2048) if least else Padding())


def test_the_rows_with_logits_cover_every_slots_verify_and_the_self_checks() -> None:
    assert outputs_max(1, 0) == FA_TILE + 1, "the self-check's longest verify"
    assert outputs_max(4, 0) == FA_TILE + 1
    assert outputs_max(3, 64) == 3 * 65, "each slot's token and a draft of 64"
    assert outputs_max(200, 0) == 200, "a row each in a decode step of every slot"
