"""Replaying a recorded agent conversation through /v1/messages: each row re-sends the whole,
growing conversation (system, a tool schema, history), and the reused part grows with it.

The full trace reaches ~8K tokens, minutes of prefill on a CPU: it is `slow`. The default run
replays the same rows with every message cut to its first characters, which keeps the shape
(each row extends the previous one at a chat boundary) at a few hundred tokens a turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest

from tests.conftest import ROOT, running
from tests.models import reusable

pytestmark = pytest.mark.model  # real worker processes (see tests/conftest.py)

TRACE = ROOT.parent / "shared" / "traces" / "luce_tool_6turn_replay.jsonl"


def rows(cut_chars: int | None) -> list[dict]:
    if not TRACE.exists():
        pytest.skip(f"the replay trace is not here: {TRACE}")
    out = []
    for line in TRACE.read_text().splitlines():
        row = json.loads(line)
        if cut_chars is not None:
            for m in row["messages"]:
                if isinstance(m["content"], str):
                    m["content"] = m["content"][:cut_chars]
        out.append(row)
    return out


def replay(tmp: Path, cut_chars: int | None, n_ctx: int) -> list[tuple[int, int, int]]:
    """(prompt tokens, cache_read_input_tokens, cache_creation_input_tokens) per row."""
    seen = []
    with running(tmp, "--workers", "1", "--n-ctx", str(n_ctx)) as srv:
        c = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0, timeout=900)
        for row in rows(cut_chars):
            msg = c.messages.create(model=row["model"], max_tokens=1, system=row["system"],
                                    tools=row["tools"], messages=row["messages"],
                                    extra_body={"temperature": row["temperature"]})
            u = msg.usage
            read, created = u.cache_read_input_tokens or 0, u.cache_creation_input_tokens or 0
            seen.append((u.input_tokens + read + created, read, created))
    return seen


def check_growth(seen: list[tuple[int, int, int]]) -> None:
    prompts = [p for p, _, _ in seen]
    reads = [r for _, r, _ in seen]
    assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)
    assert reads[0] == 0  # a fresh server: the first row is cold
    for i in range(1, len(seen)):
        if prompts[i] > prompts[i - 1]:
            assert reads[i] > reads[i - 1], seen  # the reused part grows turn after turn
        # everything the previous row sent is reused (the worker re-evaluates at most its
        # last two tokens when the row is the previous one plus nothing new)
        assert reads[i] >= reusable(prompts[i - 1]), seen


def test_replay_short(tmp_path: Path) -> None:
    seen = replay(tmp_path, cut_chars=160, n_ctx=4096)
    check_growth(seen)
    assert sum(r for _, r, _ in seen) > 0.6 * sum(p for p, _, _ in seen)


@pytest.mark.slow
def test_replay_full(tmp_path: Path) -> None:
    seen = replay(tmp_path, cut_chars=None, n_ctx=16384)
    check_growth(seen)
    assert seen[-1][0] > 7000
    assert seen[-1][1] >= 0.95 * seen[-1][0]
