"""The interleaved-sessions trace (issue 46): its generator, the checked-in file, and the cache's
promises on it through the proxy's own tokenizer and template (`prefixgate simulate`)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from bench.interleaved import DEFAULT_OUT, Knobs, generate, main
from bench.scorecard import FULL_RATIO, ORACLE_RATIO, RESTART_RATIO, check
from bench.simulate import report
from policies.plan import CacheKnobs
from proxy.config import Config

TRACE = Path(__file__).resolve().parents[2] / DEFAULT_OUT


def test_the_checked_in_trace_is_the_generators() -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in generate(Knobs()))
    assert TRACE.read_text(encoding="utf-8") == text


def test_the_shape() -> None:
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()]
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["metadata"]["user_id"]].append(r)
    # four sessions take turns, one request each, six turns per session
    assert len(rows) == 24 and len(by) == 4
    assert [r["metadata"]["user_id"] for r in rows[:8]] == [f"session-{s}" for s in range(4)] * 2
    systems = {s: [r["system"] for r in rs] for s, rs in by.items()}
    heads = {sys.rsplit("\n", 1)[0] for ss in systems.values() for sys in ss}
    assert len(heads) == 1  # one system prompt, but for its last line
    last = {s: [sys.rsplit("\n", 1)[1] for sys in ss] for s, ss in systems.items()}
    assert all(line.startswith("gitStatus: main @ ") for ls in last.values() for line in ls)
    assert len({ls[0] for ls in last.values()}) == 4  # a different commit per session
    # in two sessions the line changes once, in the middle, to "1 file changed"
    changed = {s: ls for s, ls in last.items() if len(set(ls)) > 1}
    assert len(changed) == 2
    for ls in changed.values():
        assert ls[:3] == [ls[0]] * 3 and ls[3:] == [ls[3]] * 3
        assert ls[0].endswith(", clean") and ls[3].endswith(", 1 file changed")
    assert all(len(r["tools"]) == 6 for r in rows)
    # a session re-sends its history: each turn's messages extend the last one's
    for rs in by.values():
        for a, b in zip(rs, rs[1:], strict=False):
            assert b["messages"][: len(a["messages"])] == a["messages"]


def test_main_writes_it(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    main(["--out", str(out), "--sessions", "2", "--turns", "3", "--changed", "1"])
    assert len(out.read_text().splitlines()) == 6
    with pytest.raises(SystemExit, match="--changed"):
        main(["--out", str(out), "--sessions", "2", "--changed", "3"])


def test_the_promises_hold_on_it() -> None:
    # as `make simulate-all` checks them: every auto:N against full and the oracle at the
    # batches' edges, live and with a restart before every request
    d = Config()
    knobs = CacheKnobs(d.kv_cache_min_tokens, d.kv_cache_cold_max_tokens,
                       d.kv_cache_continued_interval_tokens)
    _, _, data = report(str(TRACE), ["auto:2", "auto:30", "full"],
                        ["restart", "live", "live:4"], knobs, d.batch)
    rows = check(data, 4)
    assert [r["policy"] for r in rows] == ["auto:2", "auto:30"]
    for r in rows:
        assert r["restart_over_batch_oracle"] <= ORACLE_RATIO, r
        assert max(r["restart_over_full"], r["live_over_full"]) <= FULL_RATIO, r
        assert r["restart_over_live"] <= RESTART_RATIO, r
        assert r["holds"]
