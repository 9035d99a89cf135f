"""Interleaved agent sessions on one repository, written as an Anthropic Messages JSONL trace.

    python -m bench.interleaved [--out bench/traces/interleaved-gitstatus.jsonl] [--seed 46]
        [--sessions 4] [--turns 6] [--changed 2] [--system-tokens 2000] [--tail-tokens 120]

The shape (issue 46): `--sessions` coding-agent sessions on the same repository take turns, one
request each, round robin (session 1's turn 1, session 2's turn 1, ..., session 1's turn 2, ...),
`--turns` turns per session. Every session sends one system prompt of about `--system-tokens`
tokens, the same in every session but for its last line, the session's own git status as Claude
Code writes it when the session starts (`gitStatus: main @ <hash>, clean`, a different commit
per session). In `--changed` of the sessions (the first ones) that line changes in the middle of
the session, at turn `turns // 2 + 1`, to `gitStatus: main @ <hash>, 1 file changed` (the agent
edited a file and the client re-read the status). Six tool definitions follow the system prompt
(the request's `tools`), then the conversation: a task, then per turn the assistant's text and
one `tool_use`, and the user's `tool_result` with a line of text, about `--tail-tokens` tokens a
turn. Each request re-sends its session's whole history, so a session's prompts extend each other
except where its status line changed.

What the shape tests: the prefix the sessions share ends inside the system prompt (at the status
line, wherever the layout puts it), a cache that stores only that shared prefix keeps nothing a
restarted server could use for a session's own history, and two sessions taking turns on one
worker take its live KV from each other. Sizes are estimates at `bench.synth.CHARS_PER_TOKEN`;
`prefixgate simulate` counts the exact tokens of any model.

Deterministic: the same arguments give the same bytes (one `random.Random(seed)`, no clock).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.synth import CHARS_PER_TOKEN, TOOL_NAMES, hex_digits, paragraphs, tool_schema, words

DEFAULT_OUT = "bench/traces/interleaved-gitstatus.jsonl"
N_TOOLS = 6


@dataclass(frozen=True, slots=True)
class Knobs:
    sessions: int = 4
    turns: int = 6
    changed: int = 2  # sessions whose status line changes halfway
    system_tokens: int = 2000
    tail_tokens: int = 120
    max_tokens: int = 256

    def check(self) -> None:
        if min(self.sessions, self.turns) < 1:
            raise ValueError("--sessions and --turns must be >= 1")
        if not 0 <= self.changed <= self.sessions:
            raise ValueError("--changed must be 0..--sessions")
        if self.system_tokens < 100 or self.tail_tokens < 10:
            raise ValueError("--system-tokens must be >= 100 and --tail-tokens >= 10")


def _session_rows(rng: random.Random, sid: int, k: Knobs, system: str,
                  tools: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """One session's requests in order: its whole history re-sent every turn."""
    status = f"gitStatus: main @ {hex_digits(rng)}, clean"
    change_at = k.turns // 2 + 1 if sid < k.changed else 0
    tail = int(k.tail_tokens * CHARS_PER_TOKEN)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Task: " + words(rng, tail).capitalize() + "."}]
    for turn in range(1, k.turns + 1):
        if turn > 1:
            tool_id = f"toolu_{sid:02d}_{turn - 1:03d}"
            name = rng.choice([t["name"] for t in tools])
            messages.append({"role": "assistant", "content": [
                {"type": "text", "text": words(rng, tail // 5).capitalize() + "."},
                {"type": "tool_use", "id": tool_id, "name": name,
                 "input": {"command": words(rng, tail // 10)}}]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tool_id,
                 "content": words(rng, tail // 2)},
                {"type": "text", "text": words(rng, tail // 10)}]})
        if turn == change_at:
            status = f"gitStatus: main @ {hex_digits(rng)}, 1 file changed"
        yield {"model": "synthetic", "system": f"{system}\n\n{status}",
               "messages": json.loads(json.dumps(messages)),  # a snapshot, not a view
               "tools": tools, "max_tokens": k.max_tokens, "temperature": 0.0,
               "stream": False, "metadata": {"user_id": f"session-{sid}"}}


def generate(k: Knobs, seed: int = 46) -> Iterator[dict[str, Any]]:
    """The rows of the trace: the sessions' turns, round robin."""
    k.check()
    rng = random.Random(seed)
    tools = [tool_schema(rng, n) for n in TOOL_NAMES[:N_TOOLS]]
    header = ("You are a coding agent working in a local repository. Use the tools to inspect "
              "files, run commands and verify your work. Answer tersely.")
    system = f"{header}\n\n# AGENTS.md\n\n" + paragraphs(
        rng, max(0, int(k.system_tokens * CHARS_PER_TOKEN) - len(header) - 60))
    sessions = [_session_rows(random.Random(rng.getrandbits(64)), sid, k, system, tools)
                for sid in range(k.sessions)]
    for _ in range(k.turns):
        for s in sessions:
            yield next(s)


def main(argv: list[str] | None = None) -> None:
    d = Knobs()
    p = argparse.ArgumentParser(prog="python -m bench.interleaved",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="JSONL file to write ('-' for stdout)")
    p.add_argument("--seed", type=int, default=46)
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--changed", type=int, default=d.changed)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--tail-tokens", type=int, default=d.tail_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    a = p.parse_args(argv)
    k = Knobs(a.sessions, a.turns, a.changed, a.system_tokens, a.tail_tokens, a.max_tokens)
    try:
        rows = list(generate(k, a.seed))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if a.out == "-":
        sys.stdout.write(text)
        return
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text, encoding="utf-8")
    print(f"wrote {len(rows)} rows ({k.sessions} sessions x {k.turns} turns) to {a.out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
