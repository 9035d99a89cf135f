"""Parsing of both APIs into the internal ChatRequest, as tables: request bodies in, the exact
messages, tools and settings out, or the 400 and the field it names. No server, no model: the
real-model tests in test_openai.py and test_anthropic.py check the same edges end to end."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given as generated
from hypothesis import settings
from hypothesis import strategies as st

from proxy import anthropic_api, openai_api, responses_api
from proxy.chat import placeholder
from proxy.errors import (
    ApiError,
    BadRequest,
    ContextOverflow,
    WorkerFailed,
    anthropic_body,
    openai_body,
)

USER = {"role": "user", "content": "Hi"}
SHELL = {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}

# body -> (messages, other expected fields of the ChatRequest)
OPENAI: dict[str, tuple[dict[str, Any], tuple[dict[str, Any], ...], dict[str, Any]]] = {
    # the least: one user message; everything else at its default
    "minimal": ({"messages": [USER]}, ({"role": "user", "content": "Hi"},),
                {"max_tokens": None, "stream": False, "stop": (), "scope": None,
                 "tool_choice": "auto", "sampling": {}}),
    # developer is a system message; text parts are joined
    "developer and parts": (
        {"messages": [{"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]}]},
        ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}), {}),
    # an earlier tool call: its JSON arguments are parsed; the tool's answer keeps its call id
    "tool history": (
        {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "shell", "arguments": "{\"cmd\": \"ls\"}"}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "a.py"}],
         "tools": [SHELL]},
        ({"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "type": "function",
              "function": {"name": "shell", "arguments": {"cmd": "ls"}}}]},
         {"role": "tool", "content": "a.py", "tool_call_id": "c1"}),
        {"tools": (SHELL,)}),
    # max_completion_tokens wins over max_tokens; settings and the cache scope come through
    "settings": (
        {"messages": [USER], "max_tokens": 5, "max_completion_tokens": 7, "stream": True,
         "stream_options": {"include_usage": True}, "stop": "\n", "temperature": 0,
         "seed": -1, "prefix_cache": {"scope": "auto:8", "window": 4}},
        ({"role": "user", "content": "Hi"},),
        {"max_tokens": 7, "stream": True, "include_usage": True, "stop": ("\n",),
         "sampling": {"temperature": 0.0, "seed": 0xFFFFFFFF}, "scope": "auto:8",
         "window": 4}),
    # a forced call names a declared tool
    "named tool choice": (
        {"messages": [USER], "tools": [SHELL],
         "tool_choice": {"type": "function", "function": {"name": "shell"}}},
        ({"role": "user", "content": "Hi"},), {"tool_choice": {"name": "shell"}}),
}


@pytest.mark.parametrize("body,messages,fields", OPENAI.values(), ids=OPENAI.keys())
def test_openai_parse(body: dict[str, Any], messages: tuple[dict[str, Any], ...],
                      fields: dict[str, Any]) -> None:
    req = openai_api.parse_chat(body, "key-1")
    assert (req.api, req.tenant, req.messages) == ("openai", "key-1", messages)
    assert {k: getattr(req, k) for k in fields} == fields


# body -> the param the 400 names
OPENAI_BAD: dict[str, tuple[Any, str | None]] = {
    "not an object": ([USER], None),
    "no messages": ({}, "messages"),
    "empty messages": ({"messages": []}, "messages"),
    "unknown role": ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    "an unknown part": ({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "x"}}]}]}, "messages[0].content"),
    "temperature out of range": ({"messages": [USER], "temperature": 3}, "temperature"),
    "max_tokens zero": ({"messages": [USER], "max_tokens": 0}, "max_tokens"),
    "stop not strings": ({"messages": [USER], "stop": [1]}, "stop"),
    "bad scope window": ({"messages": [USER], "prefix_cache": {"window": 0}},
                         "prefix_cache.window"),
    "forced call, no tools": ({"messages": [USER], "tool_choice": "required"}, "tool_choice"),
    "forced call, unknown tool": ({"messages": [USER], "tools": [SHELL],
                                   "tool_choice": {"function": {"name": "rm"}}}, "tool_choice"),
    "tool parameters not a schema": ({"messages": [USER], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
}


@pytest.mark.parametrize("body,param", OPENAI_BAD.values(), ids=OPENAI_BAD.keys())
def test_openai_rejects(body: Any, param: str | None) -> None:
    with pytest.raises(BadRequest) as e:
        openai_api.parse_chat(body, "")
    assert e.value.param == param


def test_openai_completion_prompt() -> None:
    req = openai_api.parse_completion({"prompt": ["Once upon"], "max_tokens": 3}, "")
    assert (req.api, req.prompt, req.messages, req.max_tokens) == \
        ("completions", "Once upon", (), 3)
    with pytest.raises(BadRequest):
        openai_api.parse_completion({"prompt": ""}, "")


TOOL = {"name": "shell", "description": "Run.", "input_schema": {"type": "object"}}
ANTHROPIC: dict[str, tuple[dict[str, Any], tuple[dict[str, Any], ...], dict[str, Any]]] = {
    # system blocks join by blank lines and lead; consecutive user turns merge
    "system and merged users": (
        {"system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
         "messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]},
        ({"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "one\n\ntwo"}),
        {"continue_final": False}),
    # tool_use becomes a call; tool_result a tool message carrying the tool's name; thinking is
    # the turn's reasoning_content; is_error marks the result
    "tool round trip": (
        {"tools": [TOOL], "messages": [
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "tool_use", "id": "t1", "name": "shell", "input": {"cmd": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "denied", "is_error": True}]}]},
        ({"role": "user", "content": "list"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "t1", "type": "function",
              "function": {"name": "shell", "arguments": {"cmd": "ls"}}}],
          "reasoning_content": "hm"},
         {"role": "tool", "tool_call_id": "t1", "content": "Error: denied", "name": "shell"}),
        {"tools": ({"type": "function", "function": {"name": "shell", "description": "Run.",
                                                     "parameters": {"type": "object"}}},)}),
    # a system message inside messages (Claude Code sends them) becomes user text
    "system inside messages": (
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "system", "content": "reminder"}]},
        ({"role": "user", "content": "hi\n\nreminder"},), {}),
    # a final assistant turn with text is continued
    "prefill": (
        {"messages": [USER, {"role": "assistant", "content": "The answer is"}]},
        ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}),
        {"continue_final": True}),
    # any -> required; server tools are ignored; stop_sequences and sampling come through
    "choice and settings": (
        {"messages": [USER], "tools": [TOOL, {"type": "web_search_20250305", "name": "web"}],
         "tool_choice": {"type": "any"}, "stop_sequences": ["\n\nHuman:"], "top_k": 5},
        ({"role": "user", "content": "Hi"},),
        {"tool_choice": "required", "stop": ("\n\nHuman:",), "sampling": {"top_k": 5}}),
}


@pytest.mark.parametrize("body,messages,fields", ANTHROPIC.values(), ids=ANTHROPIC.keys())
def test_anthropic_parse(body: dict[str, Any], messages: tuple[dict[str, Any], ...],
                         fields: dict[str, Any]) -> None:
    req = anthropic_api.parse_request({"max_tokens": 16, **body}, "key-1")
    assert (req.api, req.tenant, req.max_tokens, req.messages) == \
        ("anthropic", "key-1", 16, messages)
    assert {k: getattr(req, k) for k in fields} == fields


ANTHROPIC_BAD: dict[str, tuple[dict[str, Any], str | None]] = {
    "no max_tokens": ({"messages": [USER]}, "max_tokens"),
    "no messages": ({"max_tokens": 4}, "messages"),
    "an image in an assistant turn": ({"max_tokens": 4, "messages": [
        USER, {"role": "assistant", "content": [{"type": "image", "source": {}}]}]},
        "messages[1].content[0]"),
    "trailing whitespace in a prefill": (
        {"max_tokens": 4, "messages": [USER, {"role": "assistant", "content": "So "}]},
        "messages.1.content"),
    "bad tool_choice": ({"max_tokens": 4, "messages": [USER], "tool_choice": {"type": "x"}},
                        "tool_choice"),
    "tool without a schema": ({"max_tokens": 4, "messages": [USER],
                               "tools": [{"name": "f"}]}, "tools[0].input_schema"),
}


@pytest.mark.parametrize("body,param", ANTHROPIC_BAD.values(), ids=ANTHROPIC_BAD.keys())
def test_anthropic_rejects(body: dict[str, Any], param: str | None) -> None:
    with pytest.raises(BadRequest) as e:
        anthropic_api.parse_request(body, "")
    assert e.value.param == param


# --- media: a text-only model gets a placeholder in place of each block, never a 400 ----------

IMAGE, AUDIO, FILE = (placeholder(k) for k in ("image", "audio", "file"))
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}

# content parts -> (the message's text, the media kinds replaced)
OPENAI_MEDIA: dict[str, tuple[list[dict[str, Any]], str, tuple[str, ...]]] = {
    # an image between text parts: the placeholder on a line of its own, the text glued as ever
    "image between text": ([{"type": "text", "text": "What is "}, {"type": "text", "text": "this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}},
                            {"type": "text", "text": "Be brief."}],
                           f"What is this?\n{IMAGE}\nBe brief.", ("image",)),
    # an image alone: just the placeholder
    "image alone": ([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}], IMAGE,
                    ("image",)),
    # audio and a file, one after the other
    "audio and file": ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                        {"type": "file", "file": {"file_id": "f"}}], f"{AUDIO}\n{FILE}",
                       ("audio", "file")),
}


@pytest.mark.parametrize("parts,text,media", OPENAI_MEDIA.values(), ids=OPENAI_MEDIA.keys())
def test_openai_media_becomes_a_placeholder(parts: list[dict[str, Any]], text: str,
                                            media: tuple[str, ...]) -> None:
    raw = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": parts}]
    req = openai_api.parse_chat({"messages": raw}, "")
    assert req.messages[1] == {"role": "user", "content": text}
    assert req.media == media
    # the same message objects again (a later turn): parsed from memory, counted again
    again = openai_api.parse_chat({"messages": [*raw, {"role": "assistant", "content": "ok"},
                                                USER]}, "")
    assert again.messages[1] is req.messages[1] and again.media == media


def test_anthropic_media_becomes_a_placeholder() -> None:
    """An image in a user turn and in a tool result (Claude Code's Read of a PNG), a document
    with a plain-text source (its text) and a PDF (a placeholder)."""
    raw = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "image", "source": PNG}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.png"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "image", "source": PNG}]},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "notes"}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                            "data": "JVBERi0="}}]}]
    req = anthropic_api.parse_request({"max_tokens": 4, "messages": raw}, "")
    assert req.messages[0] == {"role": "user", "content": f"Look:\n\n{IMAGE}"}
    assert req.messages[2] == {"role": "tool", "tool_call_id": "t1", "content": IMAGE,
                               "name": "Read"}
    assert req.messages[3] == {"role": "user",
                               "content": f"notes\n\n{placeholder('document')}"}
    assert req.media == ("image", "image", "document")
    # the next turn resumes this body's parse after its messages (the same objects): the media
    # before are still counted, the new ones too
    more = [*raw, {"role": "assistant", "content": "An image."},
            {"role": "user", "content": [{"type": "image", "source": PNG}]}]
    again = anthropic_api.parse_request({"max_tokens": 4, "messages": more}, "")
    assert again.messages[:3] == req.messages[:3]
    assert again.media == ("image", "image", "document", "image")


def test_count_tokens_needs_no_max_tokens() -> None:
    req = anthropic_api.parse_request({"messages": [USER]}, "", count_only=True)
    assert (req.max_tokens, req.stream) == (None, False)


# each error in each API's own shape
ERRORS = [
    (BadRequest("send text", param="messages"),
     {"error": {"message": "send text", "type": "invalid_request_error", "param": "messages",
                "code": None}},
     {"type": "error", "error": {"type": "invalid_request_error", "message": "send text"}}),
    (ContextOverflow(5000, 4096),
     {"error": {"message": ContextOverflow(5000, 4096).message, "type": "invalid_request_error",
                "param": "messages", "code": "context_length_exceeded"}},
     {"type": "error", "error": {"type": "invalid_request_error",
                                 "message": "prompt is too long: 5000 tokens > 4096 maximum"}}),
    (WorkerFailed("worker 0 failed"),
     {"error": {"message": "worker 0 failed", "type": "api_error", "param": None, "code": None}},
     {"type": "error", "error": {"type": "overloaded_error", "message": "worker 0 failed"}}),
]


@pytest.mark.parametrize("error,openai_shape,anthropic_shape", ERRORS)
def test_error_shapes(error: ApiError, openai_shape: dict[str, Any],
                      anthropic_shape: dict[str, Any]) -> None:
    assert openai_body(error) == openai_shape
    assert anthropic_body(error) == anthropic_shape


def _random_anthropic_messages(rng: Any, n: int) -> list[dict[str, Any]]:
    """Turns that exercise every merge: consecutive user turns, system entries inside
    messages (leading ones too), assistant after assistant, tool calls and their results."""
    out: list[dict[str, Any]] = []
    calls = 0
    for _ in range(n):
        kind = rng.choice(["user", "user blocks", "system", "assistant", "assistant thinking",
                           "tool use", "tool result"])
        if kind == "user":
            out.append({"role": "user", "content": f"u{rng.randrange(99)}"})
        elif kind == "user blocks":
            out.append({"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]})
        elif kind == "system":
            out.append({"role": "system", "content": f"note {rng.randrange(9)}"})
        elif kind == "assistant":
            out.append({"role": "assistant", "content": f"a{rng.randrange(99)}"})
        elif kind == "assistant thinking":
            out.append({"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "ok"}]})
        elif kind == "tool use":
            calls += 1
            out.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": f"t{calls}", "name": f"f{calls % 3}",
                 "input": {"n": calls}}]})
        else:
            out.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"t{max(calls, 1)}", "content": "r"},
                {"type": "text", "text": "then"}]})
    return out


def test_anthropic_parse_resumed_from_an_earlier_body_equals_a_fresh_parse() -> None:
    """A body re-sending a recent body's message objects resumes that parse: the result
    equals a parse of copies (nothing remembered), the shared messages come out as the same
    objects, and nothing an earlier parse gave out changes."""
    import copy
    import random

    rng = random.Random(7)
    for _ in range(300):
        raw = _random_anthropic_messages(rng, rng.randint(2, 14))
        system = rng.choice(["", "sys", [{"type": "text", "text": "s1"}]])
        earlier = []
        for end in range(1, len(raw) + 1):  # the conversation growing turn by turn
            body = {"max_tokens": 8, "system": system, "messages": raw[:end]}
            req = anthropic_api.parse_request(body, "")
            fresh = anthropic_api.parse_request(copy.deepcopy(body), "")
            assert req.messages == fresh.messages
            assert (req.continue_final, req.tools) == (fresh.continue_final, fresh.tools)
            earlier.append((req.messages, copy.deepcopy(req.messages)))
        for given, snapshot in earlier:
            assert given == snapshot  # no message given out was changed afterwards
        for (before, _), (after, _) in zip(earlier, earlier[1:], strict=False):
            # the messages before the last one of a turn come out again as the same objects
            assert all(a is b for a, b in zip(before[:-1], after, strict=False))


# --- the Responses API (Codex CLI) -------------------------------------------------------------

FN = {"type": "function", "name": "shell", "description": "Run.",
      "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
RESPONSES: dict[str, tuple[dict[str, Any], tuple[dict[str, Any], ...], dict[str, Any]]] = {
    # a string input is one user message; instructions are the system message, first
    "string input": ({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9},
                     ({"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi"}), {"max_tokens": 9, "stream": False}),
    # a Codex turn: developer text, user parts, a reasoning item that belongs to the call that
    # follows, the call (arguments parsed), its output named after it, the assistant's answer
    "codex turn": (
        {"input": [
            {"type": "message", "role": "developer", "content": "Sandbox: none."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "list "},
                         {"type": "input_text", "text": "files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [
                {"type": "summary_text", "text": "Use the shell."}], "encrypted_content": "x"},
            {"type": "function_call", "call_id": "call_1", "name": "shell",
             "arguments": "{\"cmd\": \"ls\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "One file."}]},
            {"role": "user", "content": "thanks"}],
         "tools": [FN, {"type": "web_search"}], "tool_choice": "auto", "stream": True,
         "reasoning": {"effort": "low"}, "temperature": 0.5, "store": False,
         "include": ["reasoning.encrypted_content"], "parallel_tool_calls": False,
         "prompt_cache_key": "k"},
        ({"role": "system", "content": "Sandbox: none."},
         {"role": "user", "content": "list files"},
         {"role": "assistant", "content": "", "reasoning_content": "Use the shell.",
          "tool_calls": [{"id": "call_1", "type": "function",
                          "function": {"name": "shell", "arguments": {"cmd": "ls"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "a.py", "name": "shell"},
         {"role": "assistant", "content": "One file."},
         {"role": "user", "content": "thanks"}),
        {"tools": ({"type": "function", "function": {
            "name": "shell", "parameters": FN["parameters"], "description": "Run."}},),
         "stream": True, "sampling": {"temperature": 0.5},
         "template_kwargs": {"reasoning_effort": "low"}}),
    # two calls of one turn after its text: one assistant message; a named forced call
    "two calls": (
        {"input": [{"role": "user", "content": "go"},
                   {"role": "assistant", "content": "Running."},
                   {"type": "function_call", "call_id": "a", "name": "shell", "arguments": "{}"},
                   {"type": "function_call", "call_id": "b", "name": "shell", "arguments": "{}"}],
         "tools": [FN], "tool_choice": {"type": "function", "name": "shell"}},
        ({"role": "user", "content": "go"},
         {"role": "assistant", "content": "Running.", "tool_calls": [
             {"id": "a", "type": "function", "function": {"name": "shell", "arguments": {}}},
             {"id": "b", "type": "function", "function": {"name": "shell", "arguments": {}}}]}),
        {"tool_choice": {"name": "shell"}}),
    # Codex's sub-agent tools come as one `namespace` tool: its functions are the model's
    # tools beside the others (a name another tool has gets the namespace's prefix), and a call
    # in the history names its namespace
    "namespace": (
        {"input": [{"role": "user", "content": "go"},
                   {"type": "function_call", "call_id": "a", "name": "spawn_agent",
                    "namespace": "multi_agent_v1", "arguments": "{}"},
                   {"type": "function_call", "call_id": "b", "name": "shell",
                    "namespace": "multi_agent_v1", "arguments": "{}"}],
         "tools": [FN, {"type": "namespace", "name": "multi_agent_v1", "description": "Agents.",
                        "tools": [{"type": "function", "name": "spawn_agent",
                                   "parameters": {"type": "object"}},
                                  {**FN, "description": "Its own shell."},
                                  {"type": "custom", "name": "apply_patch"}]}]},
        ({"role": "user", "content": "go"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "a", "type": "function",
              "function": {"name": "spawn_agent", "arguments": {}}},
             {"id": "b", "type": "function",
              "function": {"name": "multi_agent_v1__shell", "arguments": {}}}]}),
        {"tools": (
            {"type": "function", "function": {"name": "shell", "parameters": FN["parameters"],
                                              "description": "Run."}},
            {"type": "function", "function": {"name": "spawn_agent",
                                              "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "multi_agent_v1__shell",
                                              "parameters": FN["parameters"],
                                              "description": "Its own shell."}}),
         "namespaces": {"spawn_agent": ("multi_agent_v1", "spawn_agent"),
                        "multi_agent_v1__shell": ("multi_agent_v1", "shell")}}),
    # an image part is a placeholder; text.format json_object is a grammar
    "image and json": (
        {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is it?"},
            {"type": "input_image", "image_url": "data:image/png;base64,x"}]}],
         "text": {"format": {"type": "json_object"}}},
        ({"role": "user", "content": f"What is it?\n{IMAGE}"},),
        {"media": ("image",), "json_schema": {"type": "object"}}),
}


def test_an_ignored_tool_type_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Codex sends web_search with every request: one line says it is ignored, not one each."""
    body = {"input": "Hi", "tools": [FN, {"type": "web_search"}, {"type": "local_shell"}]}
    responses_api._IGNORED.clear()  # as a new process starts
    with caplog.at_level(logging.INFO, logger="prefixgate"):
        for _ in range(3):
            assert [t["function"]["name"] for t in responses_api.parse_request(body, "").tools] \
                == ["shell"]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said.count("responses: ignoring tools of type 'web_search': prefixgate cannot run "
                      "them") == 1
    assert sum("ignoring tools of type 'local_shell'" in m for m in said) == 1


@pytest.mark.parametrize("body,messages,fields", RESPONSES.values(), ids=RESPONSES.keys())
def test_responses_parse(body: dict[str, Any], messages: tuple[dict[str, Any], ...],
                         fields: dict[str, Any]) -> None:
    req = responses_api.parse_request(body, "key-1")
    assert (req.api, req.tenant, req.messages) == ("responses", "key-1", messages)
    assert {k: getattr(req, k) for k in fields} == fields


RESPONSES_BAD: dict[str, tuple[Any, str | None]] = {
    "no input": ({}, "input"),
    "stored conversation": ({"input": "Hi", "previous_response_id": "resp_1"},
                            "previous_response_id"),
    "unknown item": ({"input": [{"type": "local_shell_call", "call_id": "c"}]}, "input[0]"),
    "call without an id": ({"input": [{"type": "function_call", "name": "shell",
                                       "arguments": "{}"}]}, "input[0]"),
    "unknown role": ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    "bad tool_choice": ({"input": "Hi", "tools": [FN], "tool_choice": {"type": "x"}},
                        "tool_choice"),
    "forced call, no tools": ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    "max_output_tokens zero": ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    "namespace without tools": ({"input": "Hi", "tools": [{"type": "namespace", "name": "n"}]},
                                "tools[0]"),
    "namespace's bad tool": ({"input": "Hi", "tools": [{"type": "namespace", "name": "n",
                                                        "tools": [{"type": "function"}]}]},
                             "tools[0].tools[0]"),
}


@pytest.mark.parametrize("body,param", RESPONSES_BAD.values(), ids=RESPONSES_BAD.keys())
def test_responses_rejects(body: Any, param: str | None) -> None:
    with pytest.raises(BadRequest) as e:
        responses_api.parse_request(body, "")
    assert e.value.param == param


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                     | st.text(max_size=6),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                          max_size=3),
                     max_leaves=8)
_part = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["input_text", "output_text", "refusal", "input_image", "input_file",
                             "text", "audio"]) | _json,
    "text": st.text(max_size=6) | _json, "refusal": _json, "image_url": _json})
_item = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning",
                             "item_reference"]) | _json,
    "role": st.sampled_from(list(responses_api.ROLES)) | _json,
    "content": st.text(max_size=6) | st.lists(_part, max_size=3) | _json,
    "call_id": st.text(max_size=4) | _json, "name": st.text(max_size=4) | _json,
    "arguments": st.sampled_from(["{}", "{", '{"a": 1}', "[" * 50, "1e999"]) | _json,
    "output": st.text(max_size=6) | st.lists(_part, max_size=2) | _json,
    "summary": st.lists(_part, max_size=2) | _json})
_body = st.fixed_dictionaries({}, optional={
    "input": st.text(max_size=6) | st.lists(_item, max_size=4) | _json,
    "instructions": st.text(max_size=6) | _json,
    "tools": st.lists(st.just(FN) | st.fixed_dictionaries({}, optional={
        "type": st.just("function") | _json, "name": _json, "parameters": _json}),
        max_size=2) | _json,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | _json,
    "max_output_tokens": _json, "temperature": _json, "stream": _json, "reasoning": _json,
    "text": _json, "previous_response_id": st.none() | _json, "prefix_cache": _json})


@generated(_body)
@settings(max_examples=400, deadline=None, derandomize=True, database=None)
def test_hostile_responses_bodies_are_a_400_at_worst(body: dict[str, Any]) -> None:
    """Generated Responses bodies: a request or a BadRequest, never another exception (a
    500)."""
    try:
        responses_api.parse_request(body, "")
    except BadRequest:
        pass
