"""proxy/memo.py: the memos stay within their bounds, forget the oldest first, and give back
only what was put for that very key."""

from __future__ import annotations

from proxy.memo import IdMemo, TextMemo


def test_id_memo_is_bounded_and_forgets_the_oldest_quarter() -> None:
    memo = IdMemo(max_entries=8)
    keys = [object() for _ in range(9)]
    for k, key in enumerate(keys):
        memo.put(key, k)
    # the ninth put went over: the oldest two (a quarter of 8) are out, the rest kept
    assert memo.get_many(keys) == [None, None, 2, 3, 4, 5, 6, 7, 8]
    assert [memo.get(k, "-") for k in keys[:2]] == ["-", "-"]
    for _ in range(1000):  # many more: never over the bound
        memo.put(object(), 0)
        assert len(memo._data) <= 8


def test_id_memo_answers_for_the_same_object_only() -> None:
    memo = IdMemo()
    a, b = {"role": "user"}, {"role": "user"}  # equal, not the same
    memo.put(a, "A")
    assert (memo.get(a), memo.get(b), memo.get_many([b, a], "-")) == ("A", None, ["-", "A"])


def test_text_memo_is_bounded_by_characters() -> None:
    memo = TextMemo(max_chars=100)
    for k in range(30):
        memo.put(f"key{k}", k, 10)
        assert memo._chars <= 100 and memo._chars == 10 * len(memo._data)
    # over the bound it keeps the newest, at most three quarters of it after a trim
    assert memo.get("key29") == 29 and memo.get("key0") is None
    memo.put("huge", 1, 101)  # bigger than the bound: not kept
    assert memo.get("huge") is None
