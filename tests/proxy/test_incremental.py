"""Incremental preparation equals the full one (issue 23): a template that resumes its renders
from the previous turn's (proxy/resume.py) and reuses its tokenization gives, for every request,
the text, token ids, boundaries and message starts of a template that prepares it from nothing.

Random agent sessions (tool calls with typed arguments, reasoning, tool results, user turns,
a background request between turns, an edit in the middle of the history, a continued final
message) are grown turn by turn through every template in tests/fixtures/templates and the
shapes tests/proxy/test_template_starts.py writes, with and without tools; each request is
prepared by one warm template (as the proxy keeps it) and by a fresh one."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from proxy.config import default_model
from proxy.dialects import for_template
from proxy.gguf import read_metadata
from proxy.template import CannotContinue, ChatTemplate, Rendered, render_prompt
from proxy.tokenizer import Tokenizer, load_tokenizer
from tests.proxy.test_template_starts import TEMPLATES as SHAPES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
REAL = {p.stem: p.read_text() for p in sorted(FIXTURES.glob("*.jinja"))}
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                    "limit": {"type": "integer"}},
                   "required": ["path"]}}}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    model = default_model()
    return load_tokenizer(model, read_metadata(model), verify=False)


def session(seed: int, turns: int) -> list[list[dict[str, Any]]]:
    """The requests of one agent session: each extends the one before it, except a background
    request now and then, and one edit of an early message."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent." + " Be brief." * rng.randrange(3)},
        {"role": "user", "content": "Fix the bug in main.py"}]
    requests = [list(messages)]
    for t in range(turns):
        r = rng.random()
        if r < 0.55:
            args = {"path": f"src/f{t}.py", "limit": rng.choice([1, 1.0, 20, True])}
            turn: dict[str, Any] = {"role": "assistant", "content": rng.choice(["", "Looking."]),
                                    "tool_calls": [{"id": f"call{t:05d}", "type": "function",
                                                    "function": {"name": "read_file",
                                                                 "arguments": args}}]}
            if rng.random() < 0.5:
                turn["reasoning_content"] = "Read it first. " * rng.randrange(1, 3)
            messages = [*messages, turn, {"role": "tool", "tool_call_id": f"call{t:05d}",
                                          "content": f"x = {t}\n" * rng.randrange(1, 4)}]
        elif r < 0.85:
            turn = {"role": "assistant", "content": f"Step {t} done."}
            if rng.random() < 0.5:
                turn["reasoning_content"] = "ok"
            messages = [*messages, turn, {"role": "user", "content": f"Now step {t + 1}"}]
        elif r < 0.93:  # a title request beside the session
            requests.append([messages[0], {"role": "user", "content": f"Title for {t}?"}])
            continue
        else:  # the client rewrote an early message (a compaction, an edited prompt)
            messages = [messages[0], {"role": "user", "content": f"Fix the bug (take {t})"},
                        *messages[2:]]
        requests.append(list(messages))
    return requests


def prepared(template: ChatTemplate, tok: Tokenizer, messages: list[dict[str, Any]],
             tools: Any, continue_final: bool) -> Rendered | str:
    """The rendered prompt, or the kind of error the template raised."""
    try:
        return render_prompt(template, tok, messages, tools, continue_final)
    except CannotContinue:
        return "cannot continue"
    except Exception as e:  # the template refuses this conversation: both must
        return type(e).__name__


def resumed(template: ChatTemplate) -> int:
    assert template.runs is not None
    return max((r.resumed for r in template.runs._runs.values()), default=0)


@pytest.mark.parametrize("name", [*REAL, *SHAPES])
def test_incremental_preparation_equals_the_full_one(name: str, tok: Tokenizer) -> None:
    source = REAL.get(name) or SHAPES[name]
    warm = ChatTemplate(source, "<s>", "</s>")
    history = for_template(source).messages
    compared = skipped_loops = 0
    for seed in range(3):
        for tools in (TOOLS, None):
            for messages in session(seed, turns=12):
                messages = history(messages)
                continue_final = messages[-1]["role"] == "assistant"
                got = prepared(warm, tok, messages, tools, continue_final)
                cold = ChatTemplate(source, "<s>", "</s>")
                assert got == prepared(cold, tok, messages, tools, continue_final), \
                    (name, seed, len(messages))
                if isinstance(got, Rendered):
                    assert got.text == _plain(cold, messages, tools, continue_final)
                    compared += 1
                    skipped_loops += resumed(warm) if warm.runs is not None else 0
    assert compared >= 20
    if name in REAL:  # every real template resumes its renders, some more than others
        assert skipped_loops > 0


def _plain(template: ChatTemplate, messages: list[dict[str, Any]], tools: Any,
           continue_final: bool) -> str:
    text = template.render(messages, tools, not continue_final)
    if not continue_final:
        return text
    body = str(messages[-1].get("content") or "").strip()
    return text[: text.rfind(body) + len(body)]


def test_a_fault_while_resuming_costs_a_full_render_not_the_request(
        tok: Tokenizer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A bug in deciding where to resume (a fault injected here) renders in full: the same
    prompt, and a log line that says so."""
    from proxy import resume

    source = REAL["Qwen3-Coder"]
    warm = ChatTemplate(source, "<s>", "</s>")
    first, second = session(5, turns=4)[-2:]
    render_prompt(warm, tok, first, TOOLS)

    def broken(self: Any, it: Any) -> int:
        raise RuntimeError("injected")

    monkeypatch.setattr(resume.Run, "_holds", broken)
    got = render_prompt(warm, tok, second, TOOLS)
    assert got == render_prompt(ChatTemplate(source, "<s>", "</s>"), tok, second, TOOLS)
    assert "resuming a render failed" in caplog.text


PREFIX_BY_FLAG = ("{% if add_generation_prompt %}[asked]{% else %}[told]{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_continued_message_after_a_prompted_turn_equals_the_full_one(tok: Tokenizer) -> None:
    """A template that reads the generation flag only outside its loop writes another text
    before the loop with it than without: the render without it still resumes from the last
    turn's, whose tokenized text is the prompted one, so what the two texts share is not what
    the renders share (a continued final message, then a prompted turn again)."""
    warm = ChatTemplate(PREFIX_BY_FLAG, "<s>", "</s>")
    assert warm.late_prompt
    talk = [{"role": "user", "content": f"Step {i}, please." * 20} for i in range(6)]
    for messages, continued in ((talk[:3], False),
                                ([*talk[:4], {"role": "assistant", "content": "Sure"}], True),
                                ([*talk[:5], {"role": "assistant", "content": "Sure, so"}], True),
                                (talk, False)):
        cold = ChatTemplate(PREFIX_BY_FLAG, "<s>", "</s>")
        got = prepared(warm, tok, messages, None, continued)
        assert got == prepared(cold, tok, messages, None, continued), (len(messages), continued)


def test_the_renders_kept_are_conversations_not_turns(tok: Tokenizer) -> None:
    """A turn's render supersedes the one it resumed from: after many turns of one conversation
    the template keeps one render of it, and a conversation that waited meanwhile still
    resumes from its own (before, each turn took a place among the 64 kept)."""
    source = REAL["Qwen3-Coder"]
    warm = ChatTemplate(source, "<s>", "</s>")
    assert warm.runs is not None
    other = [{"role": "user", "content": "Write a haiku. " * 30}]
    render_prompt(warm, tok, other)
    talk: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
    for t in range(100):
        talk = [*talk, {"role": "assistant", "content": f"Done {t}."},
                {"role": "user", "content": f"Now step {t}."}]
        render_prompt(warm, tok, talk)
    assert len(warm.runs._runs) <= 2 + (not warm.late_prompt) * 2
    later = [*other, {"role": "assistant", "content": "Leaves fall."},
             {"role": "user", "content": "Another."}]
    got = render_prompt(warm, tok, later)
    assert resumed(warm) > 0  # it resumed from its own render, 100 turns later
    assert got == render_prompt(ChatTemplate(source, "<s>", "</s>"), tok, later)


def test_positions_carried_from_the_last_text_are_the_ones_found_afresh(tok: Tokenizer) -> None:
    """`_positions` takes the leading offsets' token positions from the text before where its
    offsets below the reused characters are the same list, finds each by offset where they
    are not (an offset located now and not then), and both equal what the segments give."""
    from proxy.template import _positions

    text = "".join(f"<|im_start|>user\nStep {i}: read src/f{i}.py, then x = {i}.<|im_end|>\n"
                   for i in range(12))
    segments = tok.encode_segments(text)
    offsets = sorted({*range(0, len(text), 37), *(s.start for s in segments), len(text)})
    fresh = tok.token_positions(text, segments, offsets)
    k = len(segments) // 2
    while not segments[k - 1].special:
        k -= 1
    reused, tokens = segments[k - 1].end, sum(len(s.ids) for s in segments[:k])
    below = [o for o in offsets if o < reused]
    others = [o for o in offsets if o != below[len(below) // 2]]  # one offset not located then
    for prior in (([], []), (offsets, fresh),
                  (others, tok.token_positions(text, segments, others))):
        assert _positions(tok, text, segments, offsets, reused, tokens, prior) == fresh
