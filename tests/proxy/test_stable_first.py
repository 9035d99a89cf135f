"""Cross-session reuse as Claude Code sends it, end to end: a long system prompt that ends in a
`gitStatus:` block, 24 tool schemas, the billing block in one session and not in the other, the
git status different in each. Stable first, the second session after a restart restores what the
first stored before its first user message, and its greedy answer equals a cold run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest

from bench.prompts import load_builder
from proxy import anthropic_api
from tests.conftest import Server, running

pytestmark = pytest.mark.model  # real worker processes (see tests/conftest.py)

PROMPT = "You are Claude Code, a coding agent in the user's terminal. " + " ".join(
    f"Rule {i}: read before you edit, run the tests after, and keep answers short." for i in
    range(1, 40))
TOOLS = [{"name": f"tool_{i:02d}", "description": f"Tool number {i}: acts on one file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                           "required": ["path"]}} for i in range(24)]
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=cli; cch=%s;"


def git_status(branch: str, commit: str) -> str:
    return ("gitStatus: This is the git status at the start of the conversation. Note that this "
            "status is a snapshot in time, and will not update during the conversation.\n"
            f"Current branch: {branch}\n\nStatus:\nM src/proxy.py\n\nRecent commits:\n"
            f"{commit} fix the cache")


def body(billing: str | None, status: str, task: str) -> dict[str, Any]:
    system = [{"type": "text", "text": billing}] if billing else []
    system.append({"type": "text", "text": PROMPT + "\n\n" + status})
    return {"model": "claude-code", "max_tokens": 12, "system": system,
            "tools": TOOLS, "messages": [{"role": "user", "content": task}]}


def ask(srv: Server, b: dict[str, Any]) -> tuple[str, int, int]:
    c = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0, timeout=600)
    m = c.messages.create(**b, extra_body={"temperature": 0})  # the 2.x SDK has no argument
    text = "".join(getattr(block, "text", "") for block in m.content)
    u = m.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + \
        (u.cache_creation_input_tokens or 0)
    return text, prompt, u.cache_read_input_tokens or 0


def before_first_user(b: dict[str, Any]) -> int:
    """Tokens before the first user message, as the proxy renders this body."""
    rendered = load_builder().render(anthropic_api.parse_request({**b, "temperature": 0},
                                                                 ""))[0]
    return next(pos for pos, role in rendered.message_starts if role == "user")


def test_two_claude_code_sessions_share_the_prefix_after_a_restart(tmp_path: Path) -> None:
    first = body(BILLING % "81f2a", git_status("main", "19caf2a"), "List the test files.")
    second = body(None, git_status("fix-cache", "2a13fee"), "Which module parses requests?")
    # the billing block changes nothing, and the git status only what follows the stable part
    shared = before_first_user(second)
    assert shared == before_first_user(first) > 1000
    cache = tmp_path / "cache"
    with running(tmp_path / "one", "--workers", "1", cache_dir=cache) as srv:
        _, n1, cached1 = ask(srv, first)
        assert cached1 == 0 and n1 > shared
    with running(tmp_path / "two", "--workers", "1", cache_dir=cache) as srv:  # a restart
        text, n2, cached2 = ask(srv, second)
        assert srv.log().count("source=disk") == 1, srv.log()
    assert cached2 >= 0.95 * shared, (cached2, shared, n2)
    # a cold run: no disk cache, and a worker whose live KV holds nothing yet
    with running(tmp_path / "cold", "--workers", "1", "--disk-prefix-cache", "off") as cold:
        cold_text, cold_n, cold_cached = ask(cold, second)
    assert (cold_n, cold_cached) == (n2, 0)
    assert text == cold_text
