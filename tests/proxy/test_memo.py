"""proxy/memo.py: the memos stay within their bounds, forget the oldest first, and give back
only what was put for that very key; the stages that carry a history's work on to its next turn
(PrefixMemo) give what they give without it, whatever the new messages do to the last ones."""

from __future__ import annotations

import random
from typing import Any

from proxy import prompt, tools, traced
from proxy.memo import IdMemo, PrefixMemo, TextMemo


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


def test_prefix_memo_finds_the_longest_run_of_the_same_leading_objects() -> None:
    memo = PrefixMemo(entries=2)
    a, b, c, d = ({"role": "user", "content": "x"} for _ in range(4))  # equal, not the same
    memo.keep([a, c, d], "ACD")
    memo.keep([a, b, c], "ABC")
    assert memo.found([a, b, d]) == (2, "ABC") and memo.found([a, c]) == (2, "ACD")
    assert memo.found([a, b, c, d]) == (3, "ABC") and memo.found([a])[0] == 1  # type: ignore
    assert memo.found([b]) is None and memo.found([]) is None
    assert memo.found([{"role": "user", "content": "x"}, b]) is None  # by identity only
    memo.keep([d], "D")  # two entries: the oldest, [a, c, d], out
    assert memo.found([a, c]) == (1, "ABC") and memo.found([d, a]) == (1, "D")


def test_prefix_memo_lets_go_of_the_lists_a_new_one_carries_on() -> None:
    memo = PrefixMemo(entries=8)
    a, b, c, d = (object() for _ in range(4))
    memo.keep([a, b], "AB")
    memo.keep([a, b, c], "ABC")  # the next turn: AB is all in it
    memo.keep([a, b, d], "ABD")  # the same history, another last turn: ABC let go
    assert [kept for _, kept in memo._kept] == ["ABD"]
    memo.keep([c], "C")
    assert [kept for _, kept in memo._kept] == ["C", "ABD"]


def test_prefix_memo_that_skips_lists_parting_early_finds_and_lets_go_as_a_full_scan() -> None:
    """Lists that part from the new one where the best so far does are not scanned: what is
    found and what is let go are those of scanning every list (sessions that take turns, edits
    far back, repeats)."""
    rng = random.Random(7)
    pool = [object() for _ in range(3)]
    memo = PrefixMemo(entries=5)
    sessions: list[list[object]] = [[] for _ in range(4)]
    for step in range(600):
        i = rng.randrange(len(sessions))
        cut = len(sessions[i]) if rng.random() < 0.5 else rng.randrange(len(sessions[i]) + 1)
        items = sessions[i][:cut] + [rng.choice(pool) for _ in range(rng.randrange(0, 3))]
        sessions[i] = items
        kept = [(list(old), v) for old, v in memo._kept]
        full = [next((j for j, (x, y) in enumerate(zip(old, items, strict=False)) if x is not y),
                     min(len(old), len(items))) for old, _ in kept]
        k = max(full, default=0)
        assert memo.found(items) == ((k, kept[full.index(k)][1]) if k else None)
        memo.keep(items, step)
        carried = [v for (old, v), j in zip(kept, full, strict=True) if j < len(old) - 1]
        assert [v for _, v in memo._kept] == \
            ([step, *carried[: memo.entries - 1]] if items else [v for _, v in kept])


def _history(rng: random.Random, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for i in range(n):
        role = rng.choice(["user", "assistant", "tool", "tool", "assistant-call"])
        if role == "assistant-call":
            out.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{i}", "type": "function",
                 "function": {"name": "read", "arguments": {"path": f"f{i}"}}}]})
        elif role == "tool":
            out.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}"})
        else:
            out.append({"role": role, "content": f"{role} {i} 2026-11-29" if rng.random() < 0.3
                        else f"{role} {i}"})
    return out


def test_a_history_carried_on_gives_what_a_fresh_pass_gives() -> None:
    """Each turn re-sends the history's objects and adds messages, so a run of tool results may
    go on past the old end (its group then takes them, and the user message after them); a
    turn may also replace the last message or branch off an earlier point. Every stage equals
    its work on new objects."""
    rng = random.Random(7)
    defs = ({"type": "function", "function": {"name": "read", "parameters": {}}},)
    norm = prompt.Normalizer((r"\d{4}-\d\d-\d\d",))
    history = _history(rng, 3)
    for turn in range(80):
        if turn % 10 == 9:  # a branch: an earlier point of the history, then its own turn
            history = history[: rng.randrange(1, len(history))]
        elif turn % 3 == 2:  # the same history, another last turn (a retry, an edit)
            history = history[:-1]
        history = history + _history(rng, rng.randrange(1, 4))[1:]
        fresh = [dict(m) for m in history]  # equal, none the same object: nothing carried
        assert norm.messages(tuple(history)) == norm.messages(tuple(fresh))
        assert tools.hermes_messages(history, defs) == tools.hermes_messages(fresh, defs)
        assert prompt.content_chars(history) == prompt.content_chars(fresh)
        assert traced.signed(history) == traced.signed(fresh)
        assert [(w._i, dict(dict.items(w))) for w in traced.wrapped(history)] == [
            (w._i, dict(dict.items(w))) for w in traced.wrapped(fresh)]
