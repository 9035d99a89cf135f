"""Trace rows as OpenAI chat bodies: the Anthropic conversion and format detection."""

from __future__ import annotations

import json

import pytest

from bench.trace import anthropic_to_openai, detect_format, load_trace

ROW = {
    "model": "m", "system": [{"type": "text", "text": "Be terse."}],
    "messages": [
        {"role": "user", "content": "Run ls."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm"},
            {"type": "text", "text": "Running it."},
            {"type": "tool_use", "id": "tu1", "name": "shell", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "tu1",
             "content": [{"type": "text", "text": "a.py"}]},
            {"type": "text", "text": "And now?"}]},
    ],
    "tools": [{"name": "shell", "description": "Run.", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "any"}, "max_tokens": 64, "temperature": 0.0,
    "stop_sequences": ["END"],
}


def test_anthropic_to_openai() -> None:
    assert anthropic_to_openai(ROW) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Run ls."},
            {"role": "assistant", "content": "Running it.", "tool_calls": [
                {"id": "tu1", "type": "function",
                 "function": {"name": "shell", "arguments": '{"command": "ls"}'}}]},
            # tool results first, right after the assistant turn, as OpenAI requires
            {"role": "tool", "tool_call_id": "tu1", "content": "a.py"},
            {"role": "user", "content": "And now?"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "shell", "description": "Run.", "parameters": {"type": "object"}}}],
        "tool_choice": "required", "max_tokens": 64, "temperature": 0.0, "stop": ["END"],
    }


def test_tool_blocks_as_text() -> None:
    msgs = anthropic_to_openai(ROW, tool_blocks="text")["messages"]
    assert msgs[2] == {"role": "assistant",
                       "content": 'Running it.\n[tool_use shell tu1] {"command": "ls"}'}
    assert msgs[3] == {"role": "user", "content": "[tool_result tu1] a.py\nAnd now?"}


@pytest.mark.parametrize(("row", "fmt"), [
    (ROW, "anthropic"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "openai"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
     "openai"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                 "content": "ok"}]}]}, "anthropic"),
])
def test_detect_format(row: dict, fmt: str) -> None:  # type: ignore[type-arg]
    assert detect_format(row) == fmt


def test_load_trace_mixes_formats_and_cuts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    openai_row = {"messages": [{"role": "system", "content": "s"},
                               {"role": "user", "content": "hi"}], "max_tokens": 5}
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(ROW) + "\n\n" + json.dumps(openai_row) + "\n" + json.dumps(ROW))
    bodies = load_trace(p)
    assert len(bodies) == 3 and bodies[1] == openai_row
    assert len(load_trace(p, turns=2)) == 2
