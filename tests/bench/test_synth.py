"""The synthetic session generator: deterministic, and shaped by its knobs."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace

import pytest

from bench.synth import Knobs, generate, main
from bench.trace import load_trace

SMALL = Knobs(sessions=4, parallel=2, turns=6, prefix_tokens=400, tools=3, tail_tokens=40,
              rewrite_share=0.5, rewrite_every=2)


def rows(k: Knobs = SMALL, seed: int = 0) -> list[dict]:  # type: ignore[type-arg]
    return list(generate(k, seed))


def by_session(rs: list[dict]) -> dict[str, list[dict]]:  # type: ignore[type-arg]
    out: dict[str, list[dict]] = defaultdict(list)  # type: ignore[type-arg]
    for r in rs:
        out[r["metadata"]["user_id"]].append(r)
    return out


def test_deterministic_with_a_seed() -> None:
    assert json.dumps(rows(seed=3)) == json.dumps(rows(seed=3))
    assert json.dumps(rows(seed=3)) != json.dumps(rows(seed=4))


def test_sessions_turns_and_interleaving() -> None:
    rs = rows()
    sessions = by_session(rs)
    assert len(rs) == 4 * 6 and sorted(len(v) for v in sessions.values()) == [6] * 4
    # two sessions open at once: the first session does not run to its end alone
    first = rs[0]["metadata"]["user_id"]
    assert any(r["metadata"]["user_id"] != first for r in rs[:6])
    # every session shares the same tools and starts from the same system prompt
    assert len({json.dumps(r["tools"]) for r in rs}) == 1
    assert len({v[0]["system"] for v in sessions.values()}) == 1


def test_history_is_resent_and_grows() -> None:
    for turns in by_session(rows(replace(SMALL, rewrite_share=0.0))).values():
        for a, b in zip(turns, turns[1:], strict=False):
            assert b["system"] == a["system"]
            assert b["messages"][: len(a["messages"])] == a["messages"]
            assert len(b["messages"]) == len(a["messages"]) + 2  # tool_use + tool_result


def test_rewrite_share_rewrites_an_early_block() -> None:
    sessions = by_session(rows())
    changed = {sid: len({r["system"] for r in turns}) for sid, turns in sessions.items()}
    # half of the 4 sessions rewrite: one changes its git line every 2 turns (at turns 2, 4
    # and 6: four versions), one its date once, halfway (two versions)
    assert sorted(changed.values()) == [1, 1, 2, 4]
    for turns in sessions.values():
        systems = [r["system"] for r in turns]
        for a, b in zip(systems, systems[1:], strict=False):
            if a != b:  # the change is in the environment block near the top
                at = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
                assert at < 300


def test_knobs_are_checked() -> None:
    with pytest.raises(ValueError, match="prefix-tokens"):
        rows(Knobs(prefix_tokens=30001))
    with pytest.raises(ValueError, match="rewrite-share"):
        rows(Knobs(rewrite_share=1.5))


def test_writes_a_trace_the_loader_reads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "s.jsonl"
    main(["--out", str(out), "--sessions", "2", "--turns", "3", "--prefix-tokens", "300",
          "--tail-tokens", "30"])
    bodies = load_trace(out)
    assert len(bodies) == 6
    last = max(bodies, key=lambda b: len(b["messages"]))
    roles = [m["role"] for m in last["messages"]]
    assert roles[:2] == ["system", "user"] and "tool" in roles
    assert any(m.get("tool_calls") for m in last["messages"])
