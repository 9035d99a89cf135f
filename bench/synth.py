"""`make synth`: synthetic long agent sessions, written as an Anthropic Messages JSONL trace.

    python -m bench.synth --out FILE [--seed 0] [--sessions 4] [--parallel 2] [--turns 20]
        [--prefix-tokens 8000] [--tools 6] [--tail-tokens 300] [--rewrite-share 0.25]
        [--rewrite-every 6] [--shape env|clients]

The shape is a coding agent's: every session starts from the same large stable prefix (a system
prompt with an environment block near its top, then AGENTS.md-like project notes, plus tool
schemas), and each turn appends an assistant `tool_use`, a user `tool_result` and some user
text, so each row re-sends the whole history plus about `--tail-tokens` new tokens. Rows are
stateless requests, in the format of shared/traces/ (`bench.trace` reads it; the replay benchmark
and `prefixgate simulate` take it).

Knobs:

- `--prefix-tokens`: size of the stable prefix (system + tools), up to 30K tokens; sizes are
  estimated at `CHARS_PER_TOKEN` characters per token of prose and `JSON_CHARS_PER_TOKEN` of
  tool schema (SmolLM2's tokenizer on this text, within about 10%; the simulator reports the
  exact counts of any model).
- `--turns` per session, `--tail-tokens` of growth per turn.
- `--rewrite-share`: the share of sessions that rewrite an early block: half of them (chosen by
  the seed) change the `git status` line of the environment block every `--rewrite-every` turns
  (a commit), the others change the date line once, halfway (a session across midnight). Either
  change sits in the first lines of the system prompt, so everything after it stops matching.
- `--sessions` in all, `--parallel` of them open at once, their rows interleaved at random.
- `--shape`: `env` (the above); `clients`, the system prompt as Claude Code and Hermes send it:
  a `Conversation started: <date>` line near the top (sessions start on different days, a new
  one every `--rewrite-every` sessions), the project notes, then a per-session `gitStatus:`
  block at the end (branch, changed files, recent commits: different in every session), and the
  tool schemas after the system text. `--rewrite-share` does not apply to it.

Deterministic: the same arguments and `--seed` give the same bytes (one `random.Random(seed)`,
no clock, no `hash()`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 5.2  # prose of _WORDS
JSON_CHARS_PER_TOKEN = 3.0  # tool schemas
MAX_PREFIX_TOKENS = 30000

_WORDS = (
    "the a to of and in is for on with as that this be by from it or are not when use run "
    "test build file config cache token prompt worker proxy request response error value "
    "function module package import return class method string list dict key index store "
    "path directory commit branch merge review change update add remove fix check verify "
    "log metric trace debug release deploy docker image server client session state "
    "snapshot restore prefill decode batch thread process memory disk budget eviction "
    "policy scope anchor boundary template render parse normalize schema tool call result "
    "always never must should may only each every before after first last new old same"
).split()
TOOL_NAMES = ("shell", "read_file", "write_file", "edit_file", "grep", "glob", "list_dir",
               "run_tests", "git_diff", "web_fetch", "todo_write", "ask_user", "multi_edit",
               "notebook_edit", "web_search", "task", "exit_plan_mode", "bash_output",
               "kill_shell", "slash_command", "skill", "list_mcp_resources",
               "read_mcp_resource", "ask_question")
SHAPES = ("env", "clients")


def words(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def paragraphs(rng: random.Random, n_chars: int) -> str:
    parts = []
    size = 0
    k = 0
    while size < n_chars:
        k += 1
        body = words(rng, min(600, n_chars - size))
        parts.append(f"## Section {k}\n\n{body.capitalize()}.")
        size += len(parts[-1]) + 2
    return "\n\n".join(parts)


def tool_schema(rng: random.Random, name: str) -> dict[str, Any]:
    props = {f"{name}_{p}": {"type": rng.choice(["string", "integer", "boolean"]),
                             "description": words(rng, 60)}
             for p in ("target", "mode", "limit")[: 1 + rng.randrange(3)]}
    return {"name": name, "description": words(rng, 160).capitalize() + ".",
            "input_schema": {"type": "object", "properties": props,
                             "required": [next(iter(props))]}}


def hex_digits(rng: random.Random, n: int = 7) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def _git_status(rng: random.Random) -> str:
    """Claude Code's block, as it ends its system prompt: one per session."""
    files = "\n".join(f"M src/{rng.choice(_WORDS)}_{rng.choice(_WORDS)}.py"
                      for _ in range(rng.randrange(1, 5)))
    commits = "\n".join(f"{hex_digits(rng)} {words(rng, 40)}" for _ in range(5))
    return ("gitStatus: This is the git status at the start of the conversation. Note that this "
            "status is a snapshot in time, and will not update during the conversation.\n"
            f"Current branch: main\n\nMain branch (you will usually use this for PRs): main\n\n"
            f"Status:\n{files}\n\nRecent commits:\n{commits}")


@dataclass(frozen=True, slots=True)
class Knobs:
    sessions: int = 4
    parallel: int = 2
    turns: int = 20
    prefix_tokens: int = 8000
    tools: int = 6
    tail_tokens: int = 300
    rewrite_share: float = 0.25
    rewrite_every: int = 6
    max_tokens: int = 256
    shape: str = "env"  # env | clients (see the module docstring)

    def check(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"--shape must be one of {', '.join(SHAPES)}")
        if not 0 < self.prefix_tokens <= MAX_PREFIX_TOKENS:
            raise ValueError(f"--prefix-tokens must be 1..{MAX_PREFIX_TOKENS}")
        if not 0 <= self.rewrite_share <= 1:
            raise ValueError("--rewrite-share must be between 0 and 1")
        if min(self.sessions, self.parallel, self.turns, self.rewrite_every) < 1:
            raise ValueError("--sessions, --parallel, --turns and --rewrite-every must be >= 1")
        if not 0 <= self.tools <= len(TOOL_NAMES):
            raise ValueError(f"--tools must be 0..{len(TOOL_NAMES)}")
        if self.tail_tokens < 10:
            raise ValueError("--tail-tokens must be at least 10")


@dataclass(frozen=True, slots=True)
class Base:
    """What every session starts from: the project notes and the tool schemas."""

    header: str
    notes: str
    tools: tuple[dict[str, Any], ...]
    date: str
    git: str


def make_base(rng: random.Random, k: Knobs) -> Base:
    tools = tuple(tool_schema(rng, n) for n in TOOL_NAMES[: k.tools])
    tool_tokens = len(json.dumps(tools)) / JSON_CHARS_PER_TOKEN
    header = ("You are a coding agent working in a local repository. Use the tools to inspect "
              "files, run commands and verify your work. Answer tersely.")
    notes_chars = max(0, int((k.prefix_tokens - tool_tokens) * CHARS_PER_TOKEN)
                      - len(header) - 200)
    return Base(header, "# AGENTS.md\n\n" + paragraphs(rng, notes_chars), tools,
                "2026-03-14", f"branch main, clean, HEAD {hex_digits(rng)}")


@dataclass
class Session:
    sid: int
    rewrite: str  # "", "git" or "date"
    base: Base
    rng: random.Random
    k: Knobs
    turn: int = 0
    git: str = ""
    date: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)

    def system(self) -> str:
        if self.k.shape == "clients":
            return (f"{self.base.header}\n\nConversation started: {self.date}\n\n"
                    f"{self.base.notes}\n\n{self.git}")
        env = (f"<env>\nWorking directory: /work/repo\nToday's date: {self.date}\n"
               f"git status: {self.git}\n</env>")
        return f"{self.base.header}\n\n{env}\n\n{self.base.notes}"

    def _rewrite(self) -> None:
        if self.k.shape == "clients":
            return  # set when the session starts, as the clients do
        if self.rewrite == "git" and self.turn % self.k.rewrite_every == 0:
            self.git = f"branch main, {self.rng.randrange(1, 9)} files changed, HEAD " \
                       f"{hex_digits(self.rng)}"
        if self.rewrite == "date" and self.turn == max(1, self.k.turns // 2):
            self.date = "2026-03-15"

    def next_row(self) -> dict[str, Any]:
        """The next request of this session: the whole history plus one new turn."""
        self.turn += 1
        tail = int(self.k.tail_tokens * CHARS_PER_TOKEN)
        if self.turn == 1:
            self.messages.append({"role": "user", "content": "Task: " + words(self.rng, 200)})
        else:
            self._rewrite()
            tool_id = f"toolu_{self.sid:02d}_{self.turn - 1:03d}"
            name = self.rng.choice([t["name"] for t in self.base.tools] or ["shell"])
            self.messages.append({"role": "assistant", "content": [
                {"type": "text", "text": words(self.rng, tail // 6).capitalize() + "."},
                {"type": "tool_use", "id": tool_id, "name": name,
                 "input": {"command": words(self.rng, tail // 12)}}]})
            self.messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tool_id,
                 "content": words(self.rng, tail // 2)},
                {"type": "text", "text": words(self.rng, tail // 6)}]})
        row: dict[str, Any] = {
            "model": "synthetic", "system": self.system(),
            "messages": json.loads(json.dumps(self.messages)),  # a snapshot, not a view
            "max_tokens": self.k.max_tokens, "temperature": 0.0, "stream": False,
            "metadata": {"user_id": f"session-{self.sid}"},
        }
        if self.base.tools:
            row["tools"] = list(self.base.tools)
        return row

    @property
    def done(self) -> bool:
        return self.turn >= self.k.turns


def generate(k: Knobs, seed: int = 0) -> Iterator[dict[str, Any]]:
    """The rows of the trace, sessions interleaved."""
    k.check()
    rng = random.Random(seed)
    base = make_base(rng, k)
    n_rewrite = round(k.sessions * k.rewrite_share)
    rewriting = set(rng.sample(range(k.sessions), n_rewrite))
    kinds = {sid: ("git" if i % 2 == 0 else "date") for i, sid in enumerate(sorted(rewriting))}
    pending = [Session(sid, kinds.get(sid, ""), base, random.Random(rng.getrandbits(64)), k,
                       git=base.git, date=base.date) for sid in range(k.sessions)]
    if k.shape == "clients":
        for s in pending:
            s.date = f"2026-03-{14 + s.sid // k.rewrite_every:02d}"
            s.git = _git_status(s.rng)
    active: list[Session] = []
    while pending or active:
        while pending and len(active) < k.parallel:
            active.append(pending.pop(0))
        s = rng.choice(active)
        yield s.next_row()
        if s.done:
            active.remove(s)


def main(argv: list[str] | None = None) -> None:
    d = Knobs()
    p = argparse.ArgumentParser(prog="python -m bench.synth",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSONL file to write ('-' for stdout)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--parallel", type=int, default=d.parallel)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    p.add_argument("--tools", type=int, default=d.tools)
    p.add_argument("--tail-tokens", type=int, default=d.tail_tokens)
    p.add_argument("--rewrite-share", type=float, default=d.rewrite_share)
    p.add_argument("--rewrite-every", type=int, default=d.rewrite_every)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--shape", default=d.shape, choices=SHAPES)
    a = p.parse_args(argv)
    k = Knobs(a.sessions, a.parallel, a.turns, a.prefix_tokens, a.tools, a.tail_tokens,
              a.rewrite_share, a.rewrite_every, a.max_tokens, a.shape)
    try:
        rows = list(generate(k, a.seed))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if a.out == "-":
        sys.stdout.write(text)
    else:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text, encoding="utf-8")
        print(f"wrote {len(rows)} rows ({k.sessions} sessions x {k.turns} turns) to {a.out}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
