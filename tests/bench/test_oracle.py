"""The oracle: per turn, the tokens beyond its longest common prefix with any earlier turn."""

from __future__ import annotations

import json

import pytest

from bench.oracle import compute_oracle, longest_earlier_prefix

CASES = [
    # prompts, longest shared prefix with an earlier one, fresh tokens
    # the first turn is all fresh; an extension reuses all of its base
    ([[1, 2, 3], [1, 2, 3, 4, 5]], [0, 3], (3, 2)),
    # a branch reuses up to the fork; the best earlier prompt wins, not the latest
    ([[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 9], [7], [1, 2, 3, 4, 6]],
     [0, 3, 2, 0, 4], (3, 2, 1, 1, 1)),
    # an exact repeat is entirely cached (a real server still evaluates a token or two)
    ([[5, 6], [5, 6]], [0, 2], (2, 0)),
    # a prompt that is a prefix of an earlier one is entirely cached too
    ([[5, 6, 7, 8], [5, 6]], [0, 2], (4, 0)),
    # a change in the first token: nothing shared
    ([[1, 2, 3], [0, 2, 3]], [0, 0], (3, 3)),
]


@pytest.mark.parametrize(("prompts", "shared", "fresh"), CASES)
def test_oracle_table(prompts: list[list[int]], shared: list[int],
                      fresh: tuple[int, ...]) -> None:
    assert longest_earlier_prefix(prompts) == shared
    assert compute_oracle(prompts).fresh_tokens == fresh


def test_oracle_totals() -> None:
    o = compute_oracle([[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 9], [7], [1, 2, 3, 4, 6]])
    assert (o.total_prompt, o.total_fresh) == (17, 8)
    assert o.token_hit_ratio == pytest.approx(9 / 17)
    assert o.mean_hit_ratio == pytest.approx((0 + 3 / 5 + 2 / 3 + 0 + 4 / 5) / 5)
    assert compute_oracle([]).mean_hit_ratio == 0.0


def test_oracle_with_the_proxys_tokenizer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # an append-only trace rendered as the proxy renders it: each turn's fresh tokens are
    # exactly its growth, because the old prompt ends where the new assistant message begins
    from bench.prompts import load_builder, render
    from bench.trace import load_trace

    rows, messages = [], []
    for k in range(3):
        if k:
            messages.append({"role": "assistant", "content": [
                {"type": "text", "text": f"Looking at step {k}."},
                {"type": "tool_use", "id": f"t{k}", "name": "shell", "input": {"command": "ls"}}]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"t{k}", "content": "a.py b.py"}]})
        else:
            messages.append({"role": "user", "content": "List the files."})
        rows.append({"system": "You are a coding agent.", "messages": list(messages),
                     "tools": [{"name": "shell", "description": "Run a command.",
                                "input_schema": {"type": "object", "properties": {
                                    "command": {"type": "string"}}}}]})
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = load_builder()
    ids = [render(builder, b).ids for b in load_trace(trace)]
    oracle = compute_oracle(ids)
    assert oracle.fresh_tokens == (len(ids[0]), len(ids[1]) - len(ids[0]),
                                   len(ids[2]) - len(ids[1]))
    assert all(n > 0 for n in oracle.fresh_tokens)
