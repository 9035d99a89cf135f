"""Tool dialects as tables: recorded model outputs per dialect parsed whole and in every split
into two stream chunks; history rendered through each real template and parsed back; each
template's five-turn agent conversation checked for byte-for-byte extension. The templates are
llama.cpp's (tests/fixtures/templates/PROVENANCE.md); the recorded outputs follow llama.cpp's
tests/test-chat.cpp."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.dialects import (
    ArgsDelta,
    CallDone,
    CallOpen,
    Dialect,
    ReasoningDelta,
    TextDelta,
    for_template,
)
from proxy.template import ChatTemplate

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"

READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                    "limit": {"type": "integer"}},
                   "required": ["path"]}}}
GREP = {"type": "function", "function": {
    "name": "grep", "description": "Search the tree.",
    "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                    "opts": {"type": "object"}},
                   "required": ["pattern"]}}}
TOOLS = (READ, GREP)


def source(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


# --- which dialect a template writes --------------------------------------------------------

DETECT = {
    # template file -> (dialect, reasons in <think>)
    "Qwen3-Coder": ("qwen3_coder", False),
    "Qwen3.5-4B": ("qwen3_coder", True),
    "Qwen-Qwen3-0.6B": ("hermes", True),
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", False),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", False),
    "openai-gpt-oss-120b": ("harmony", False),  # reasons in its analysis channel
    "GLM-4.6": ("glm", True),
    "GLM-4.7-Flash": ("glm", True),
    "unsloth-mistral-Devstral-Small-2507": ("mistral", False),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek", True),
    "moonshotai-Kimi-K2": ("kimi", False),
    "MiniMax-M2": ("minimax", True),
}


@pytest.mark.parametrize("name", DETECT)
def test_the_template_names_its_dialect(name: str) -> None:
    d = for_template(source(name))
    assert (d.name, d.think is not None) == DETECT[name]


def test_the_dialect_can_be_named() -> None:
    assert for_template(source("Qwen3-Coder"), "hermes").name == "hermes"
    with pytest.raises(ValueError, match="unknown tool dialect 'llama3'"):
        for_template("", "llama3")


# --- recorded outputs -----------------------------------------------------------------------

Parsed = tuple[str, str, list[tuple[str, dict[str, Any]]]]  # (text, reasoning, calls)


def parse(d: Dialect, chunks: list[str], prompt: str = "", choice: Any = "auto"
          ) -> tuple[Parsed, list[Any]]:
    s = d.stream(TOOLS, choice, prompt)
    evs = [e for c in chunks for e in s.feed(c)] + s.finish()
    text = "".join(e.text for e in evs if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in evs if isinstance(e, ReasoningDelta))
    calls = [(e.call.name, e.call.arguments) for e in evs if isinstance(e, CallDone)]
    return (text, reasoning, calls), evs


CODE = 'def f(x):\n    return {"a": [1, 2]}  # </tool_call> in a string\n'
NESTED = {"pattern": "f\\(", "opts": {"glob": ["*.py", "*.pyi"], "depth": {"max": 3}}}
R = ("read_file", {"path": "main.py"})
R2 = ("read_file", {"path": "a.py", "limit": 40})
G = ("grep", NESTED)

# dialect (by a template that writes it) -> case -> (generation prompt tail, output, expected)
RECORDED: dict[str, dict[str, tuple[str, str, Parsed]]] = {
    "Qwen-Qwen2.5-7B-Instruct": {
        "one call": ("", '<tool_call>\n{"name": "read_file", "arguments": {"path": "main.py"}}'
                     "\n</tool_call>", ("", "", [R])),
        "two calls": ("", '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", '
                      '"limit": 40}}\n</tool_call>\n<tool_call>\n{"name": "grep", "arguments": '
                      + json.dumps(NESTED) + "}\n</tool_call>", ("", "", [R2, G])),
        "text then call": ("", 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": '
                           '{"path": "main.py"}}\n</tool_call>', ("Let me look.", "", [R])),
        "code in arguments": ("", '<tool_call>\n{"name": "read_file", "arguments": {"path": '
                              + json.dumps(CODE) + "}}\n</tool_call>",
                              ("", "", [("read_file", {"path": CODE})])),
        "undeclared": ("", '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',
                       ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', "", [])),
        "malformed": ("", '<tool_call>\n{"name": "read_file", "arguments": {path}}\n</tool_call>',
                      ('<tool_call>\n{"name": "read_file", "arguments": {path}}\n</tool_call>',
                       "", [])),
    },
    "Qwen-Qwen3-0.6B": {
        "reasoning then call": ("", '<think>\nFirst read it.\n</think>\n\n<tool_call>\n{"name": '
                                '"read_file", "arguments": {"path": "main.py"}}\n</tool_call>',
                                ("", "First read it.", [R])),
        # a call inside the reasoning is not a call
        "call inside reasoning": ("", '<think>\n<tool_call>{"name": "grep"}</tool_call>\n'
                                  "</think>\n\nNo.", ("No.", '<tool_call>{"name": "grep"}'
                                                      "</tool_call>", [])),
    },
    "Qwen3-Coder": {
        "one call": ("", "<tool_call>\n<function=read_file>\n<parameter=path>\nmain.py\n"
                     "</parameter>\n</function>\n</tool_call>", ("", "", [R])),
        "two calls, typed": ("", "<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n"
                             "</parameter>\n<parameter=limit>\n40\n</parameter>\n</function>\n"
                             "</tool_call>\n<tool_call>\n<function=grep>\n<parameter=pattern>\n"
                             "f\\(\n</parameter>\n<parameter=opts>\n"
                             + json.dumps(NESTED["opts"]) + "\n</parameter>\n</function>\n"
                             "</tool_call>", ("", "", [R2, G])),
        "code in a value": ("", "<tool_call>\n<function=read_file>\n<parameter=path>\n" + CODE
                            + "\n</parameter>\n</function>\n</tool_call>",
                            ("", "", [("read_file", {"path": CODE})])),
        "no opening tag": ("", "<function=read_file>\n<parameter=path>\nmain.py\n</parameter>\n"
                           "</function>\n</tool_call>", ("", "", [R])),
        "undeclared": ("", "<tool_call>\n<function=rm>\n</function>\n</tool_call>",
                       ("<tool_call>\n<function=rm>\n</function>\n</tool_call>", "", [])),
    },
    "Qwen3.5-4B": {
        "reasoning then call": ("<|im_start|>assistant\n<think>\n",
                                "I'm\nthinking\n</think>\n\n<tool_call>\n<function=read_file>\n"
                                "<parameter=path>\nmain.py\n</parameter>\n</function>\n"
                                "</tool_call>", ("", "I'm\nthinking", [R])),
        "reasoning then text": ("<|im_start|>assistant\n<think>\n",
                                "Easy.\n</think>\n\nHello!", ("Hello!", "Easy.", [])),
    },
    "GLM-4.6": {
        "one call": ("", "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>main.py"
                     "</arg_value>\n</tool_call>", ("", "", [R])),
        "reasoning then two calls": ("", "<think>Two reads.</think>\n<tool_call>read_file\n"
                                     "<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n"
                                     "<arg_key>limit</arg_key>\n<arg_value>40</arg_value>\n"
                                     "</tool_call>\n<tool_call>grep\n<arg_key>pattern</arg_key>\n"
                                     "<arg_value>f\\(</arg_value>\n<arg_key>opts</arg_key>\n"
                                     "<arg_value>" + json.dumps(NESTED["opts"]) +
                                     "</arg_value>\n</tool_call>", ("", "Two reads.", [R2, G])),
        "undeclared": ("", "<tool_call>rm\n</tool_call>", ("<tool_call>rm\n</tool_call>", "",
                                                           [])),
    },
    "GLM-4.7-Flash": {
        "reasoning then call": ("<|assistant|><think>", "I'm\nthinking</think><tool_call>"
                                "read_file<arg_key>path</arg_key><arg_value>main.py</arg_value>"
                                "</tool_call>", ("", "I'm\nthinking", [R])),
    },
    "MiniMax-M2": {
        "reasoning then two calls": ("]~b]ai\n<think>\n", "Two.\n</think>\n\n<minimax:tool_call>"
                                     '\n<invoke name="read_file">\n<parameter name="path">a.py'
                                     '</parameter>\n<parameter name="limit">40</parameter>\n'
                                     '</invoke>\n<invoke name="grep">\n<parameter name="pattern">'
                                     'f\\(</parameter>\n<parameter name="opts">'
                                     + json.dumps(NESTED["opts"]) + "</parameter>\n</invoke>\n"
                                     "</minimax:tool_call>", ("", "Two.", [R2, G])),
        "text": ("]~b]ai\n<think>\n", "\n</think>\n\nHello", ("Hello", "", [])),
    },
    "deepseek-ai-DeepSeek-V3.1": {
        "reasoning then two calls": ("<｜Assistant｜><think>", "Two.</think><｜tool▁calls▁begin｜>"
                                     "<｜tool▁call▁begin｜>read_file<｜tool▁sep｜>"
                                     '{"path": "a.py", "limit": 40}<｜tool▁call▁end｜>'
                                     "<｜tool▁call▁begin｜>grep<｜tool▁sep｜>" + json.dumps(NESTED)
                                     + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                                     ("", "Two.", [R2, G])),
        "no thinking": ("<｜Assistant｜></think>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                        'read_file<｜tool▁sep｜>{"path": "main.py"}<｜tool▁call▁end｜>'
                        "<｜tool▁calls▁end｜>", ("", "", [R])),
    },
    "moonshotai-Kimi-K2": {
        "text then two calls": ("", "Reading.<|tool_calls_section_begin|><|tool_call_begin|>"
                                "functions.read_file:0<|tool_call_argument_begin|>"
                                '{"path": "a.py", "limit": 40}<|tool_call_end|>'
                                "<|tool_call_begin|>functions.grep:1<|tool_call_argument_begin|>"
                                + json.dumps(NESTED) + "<|tool_call_end|>"
                                "<|tool_calls_section_end|>", ("Reading.", "", [R2, G])),
        "undeclared": ("", "<|tool_calls_section_begin|><|tool_call_begin|>functions.rm:0"
                       "<|tool_call_argument_begin|>{}<|tool_call_end|>"
                       "<|tool_calls_section_end|>",
                       ("<|tool_calls_section_begin|><|tool_call_begin|>functions.rm:0"
                        "<|tool_call_argument_begin|>{}<|tool_call_end|>"
                        "<|tool_calls_section_end|>", "", [])),
    },
    "unsloth-mistral-Devstral-Small-2507": {
        "text then two calls": ("", 'Sure.[TOOL_CALLS]read_file[ARGS]{"path": "a.py", '
                                '"limit": 40}[TOOL_CALLS]grep[ARGS]' + json.dumps(NESTED),
                                ("Sure.", "", [R2, G])),
        "the older list": ("", '[TOOL_CALLS][{"name": "read_file", "arguments": {"path": '
                           '"main.py"}}]', ("", "", [R])),
        "undeclared": ("", '[TOOL_CALLS]rm[ARGS]{"a": 1}', ('[TOOL_CALLS]rm[ARGS]{"a": 1}', "",
                                                            [])),
    },
    "openai-gpt-oss-120b": {
        "reasoning then call": ("<|start|>assistant", "<|channel|>analysis<|message|>Read it."
                                "<|end|><|start|>assistant<|channel|>commentary "
                                "to=functions.read_file <|constrain|>json<|message|>"
                                '{"path": "main.py"}', ("", "Read it.", [R])),
        "recipient first": ("<|start|>assistant", " to=functions.grep<|channel|>commentary "
                            "<|constrain|>json<|message|>" + json.dumps(NESTED),
                            ("", "", [G])),
        "reasoning then answer": ("<|start|>assistant", "<|channel|>analysis<|message|>Hm."
                                  "<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
                                  ("Hello!", "Hm.", [])),
    },
}
CASES = [(t, c) for t, cases in RECORDED.items() for c in cases]


def splits(text: str) -> list[list[str]]:
    """The text whole, in every split into two chunks, and a character at a time."""
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


@pytest.mark.parametrize("template, case", CASES, ids=[f"{t}: {c}" for t, c in CASES])
def test_recorded_output_parses_in_any_chunks(template: str, case: str) -> None:
    prompt, output, expected = RECORDED[template][case]
    d = for_template(source(template))
    for chunks in splits(output):
        got, evs = parse(d, chunks, prompt)
        assert got == expected, chunks
        # each call's argument pieces concatenate to its arguments' JSON
        for done in (e for e in evs if isinstance(e, CallDone)):
            pieces = "".join(e.json for e in evs
                             if isinstance(e, ArgsDelta) and e.index == done.index)
            assert pieces == done.call.arguments_json


def test_arguments_stream_as_they_complete() -> None:
    """A two-parameter call sends its first parameter before the second is written."""
    d = for_template(source("Qwen3-Coder"))
    s = d.stream(TOOLS, "auto", "")
    head = "<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n"
    evs = s.feed(head + "<parameter=limit>\n4")
    assert [type(e) for e in evs] == [CallOpen, ArgsDelta]
    assert evs[1].json == '{"path": "a.py"'  # type: ignore[union-attr]
    evs = s.feed("0\n</parameter>\n</function>\n</tool_call>")
    assert [e.json for e in evs if isinstance(e, ArgsDelta)] == [', "limit": 40', "}"]


def test_a_call_cut_short_closes_with_what_completed() -> None:
    d = for_template(source("Qwen-Qwen2.5-7B-Instruct"))
    got, _ = parse(d, ['<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", '
                       '"limit": 4'])
    assert got == ("", "", [("read_file", {"path": "a.py"})])


def test_tool_choice_none_parses_no_calls_but_still_reasoning() -> None:
    d = for_template(source("Qwen-Qwen3-0.6B"))
    out = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "grep", "arguments": {}}\n</tool_call>'
    got, _ = parse(d, [out], choice="none")
    assert got == ('<tool_call>\n{"name": "grep", "arguments": {}}\n</tool_call>', "hm", [])


# --- history: rendered by the real template, parsed back --------------------------------------

HISTORY_CALLS = [("read_file", {"path": "a.py", "limit": 40}), ("grep", {"pattern": "f("})]


def call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call{i:05d}", "type": "function", "function": {"name": name, "arguments": args}}


@pytest.mark.parametrize("template", DETECT)
def test_history_renders_to_calls_that_parse_back(template: str) -> None:
    """The template's rendering of an assistant turn with two calls, read by the dialect,
    gives the same two calls."""
    src = source(template)
    d, tpl = for_template(src), ChatTemplate(src, "<s>", "</s>")
    head = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Look at a.py"}]
    # gpt-oss makes one call a turn (`<|call|>` ends it); its template renders one
    expected = HISTORY_CALLS[:1] if d.name == "harmony" else HISTORY_CALLS
    turn = {"role": "assistant", "content": "",
            "tool_calls": [call(i, n, a) for i, (n, a) in enumerate(expected)]}
    before = tpl.render(d.messages(head), list(TOOLS), False)
    full = tpl.render(d.messages([*head, turn, {"role": "tool", "tool_call_id": "call00000",
                                                "content": "x"}]), list(TOOLS), False)
    assert full.startswith(before)
    (_, _, calls), _ = parse(d, [full[len(before):]])  # header, the turn, what follows
    assert calls == expected


# --- five turns of an agent: each prompt extends the previous one ----------------------------

FIVE_TURNS: list[list[dict[str, Any]]] = [
    [{"role": "system", "content": "You are a coding agent."},
     {"role": "user", "content": "Fix the bug in main.py"}],
    [{"role": "assistant", "content": "", "reasoning_content": "Read main.py first.",
      "tool_calls": [call(1, "read_file", {"path": "main.py", "limit": 40})]},
     {"role": "tool", "tool_call_id": "call00001", "content": "def main():\n    print('hi'\n"}],
    [{"role": "assistant", "content": "", "reasoning_content": "A paren is missing.",
      "tool_calls": [call(2, "grep", {"pattern": "main("}), call(3, "read_file",
                                                                  {"path": "cli.py"})]},
     {"role": "tool", "tool_call_id": "call00002", "content": "main.py:1"},
     {"role": "tool", "tool_call_id": "call00003", "content": "import main"}],
    [{"role": "assistant", "content": "Line 2 lacks a closing parenthesis.",
      "reasoning_content": "Only main.py needs the fix."},
     {"role": "user", "content": "Also check utils.py"}],
    [{"role": "assistant", "content": "", "reasoning_content": "Read utils.py.",
      "tool_calls": [call(4, "read_file", {"path": "utils.py"})]},
     {"role": "tool", "tool_call_id": "call00004", "content": "x = 1"}],
]

# Where a template makes the extension impossible (turn -> why). Everything up to the previous
# user message is still shared, which the test checks, so the cache reuses all of it and
# re-prefills the tail (see docs/models.md, tool calls and reasoning).
BREAKS: dict[str, dict[int, str]] = {
    # reasoning is kept only for the turns after the last user message: a new user message
    # drops the reasoning of the turns before it
    "Qwen-Qwen3-0.6B": {4: "drops earlier reasoning"},
    "Qwen3.5-4B": {4: "drops earlier reasoning"},
    "GLM-4.6": {4: "drops earlier reasoning"},
    "GLM-4.7-Flash": {4: "drops earlier reasoning (clear_thinking=false keeps it)"},
    "MiniMax-M2": {4: "drops earlier reasoning"},
    "openai-gpt-oss-120b": {4: "drops earlier analysis"},
    # a tool response gets a newline after it only when another message follows
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": {3: "newline after the last tool response",
                                                    4: "newline after the last tool response"},
}


def broken_turns(template: str, variables: dict[str, Any] | None = None) -> set[int]:
    """The turns whose prompt does not extend the previous turn's; at each, everything up to
    the previous user message is still shared."""
    src = source(template)
    d, tpl = for_template(src), ChatTemplate(src, "<s>", "</s>").bound(variables or {})
    messages: list[dict[str, Any]] = []
    previous = ""
    broken: set[int] = set()
    for turn, new in enumerate(FIVE_TURNS, start=1):
        before_user = [i for i, m in enumerate(messages) if m["role"] == "user"]
        shared = tpl.render(d.messages(messages[: before_user[-1] + 1]), list(TOOLS), False) \
            if before_user else ""
        messages += new
        prompt = tpl.render(d.messages(messages), list(TOOLS), True)
        if not prompt.startswith(previous):
            broken.add(turn)
            same = next(i for i, (a, b) in enumerate(zip(previous, prompt, strict=False))
                        if a != b)
            assert same >= len(shared), "a break before the previous user message"
        previous = prompt
    return broken


@pytest.mark.parametrize("template", DETECT)
def test_five_turns_extend_byte_for_byte(template: str) -> None:
    assert broken_turns(template) == set(BREAKS.get(template, {}))


def test_glm_47_keeping_its_reasoning_extends_on_every_turn() -> None:
    assert broken_turns("GLM-4.7-Flash", {"clear_thinking": False}) == set()


@pytest.mark.parametrize("template", ["Qwen3.5-4B", "GLM-4.7-Flash", "openai-gpt-oss-120b"])
def test_request_variables_reach_the_template(template: str) -> None:
    src = source(template)
    tpl = ChatTemplate(src, "<s>", "</s>")
    msgs = FIVE_TURNS[0]
    plain = tpl.render(msgs, None, True)
    varied = tpl.bound({"enable_thinking": False, "reasoning_effort": "high"}).render(
        msgs, None, True)
    assert plain != varied
    assert for_template(src).inside_think(plain) != for_template(src).inside_think(varied) \
        or template == "openai-gpt-oss-120b"


# --- gpt-oss: a Claude Code turn with thinking, text and a tool call (issue 46) -----------------

CLAUDE_CODE_TURN = {
    "model": "gpt-oss", "max_tokens": 64, "system": "You are Claude Code.",
    "tools": [{"name": "Read", "description": "Read a file.", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"}}}}],
    "messages": [
        {"role": "user", "content": "Fix the bug in main.py"},
        # a thinking turn that called a tool, echoed back with the text the model wrote
        # before the call, as Claude Code sends it
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Read main.py first.", "signature": ""},
            {"type": "text", "text": "I'll read main.py."},
            {"type": "tool_use", "id": "toolu_01", "name": "Read",
             "input": {"file_path": "main.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "print('hi'"}]}],
}


def test_gpt_oss_renders_a_turn_with_thinking_text_and_a_tool_call(tmp_path: Path) -> None:
    """Through the Anthropic parser, gpt-oss's own template and the default tokenizer: the turn
    renders as llama-server renders it (the reasoning in the analysis channel, then the call;
    the text, which the template has no place for beside both, left out), not a 400. The same
    turn through the OpenAI API renders the same prompt."""
    from bench.prompts import prepare
    from proxy.config import default_model
    from proxy.prompt import PromptBuilder

    builder = PromptBuilder.load(default_model(), template_file=str(TEMPLATES /
                                                                    "openai-gpt-oss-120b.jinja"))
    text = prepare(builder, CLAUDE_CODE_TURN, "anthropic").rendered.text
    assert text.endswith(
        "<|start|>user<|message|>Fix the bug in main.py<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Read main.py first.<|end|>"
        '<|start|>assistant to=functions.Read<|channel|>commentary json<|message|>'
        '{"file_path": "main.py"}<|call|>'
        "<|start|>functions.Read to=assistant<|channel|>commentary<|message|>"
        '"print(\'hi\'"<|end|><|start|>assistant')
    openai = {"model": "gpt-oss", "max_tokens": 64, "tools": [{"type": "function", "function": {
        "name": "Read", "description": "Read a file.",
        "parameters": CLAUDE_CODE_TURN["tools"][0]["input_schema"]}}],  # type: ignore[index]
        "messages": [
            {"role": "system", "content": "You are Claude Code."},
            {"role": "user", "content": "Fix the bug in main.py"},
            {"role": "assistant", "content": "I'll read main.py.",
             "reasoning_content": "Read main.py first.",
             "tool_calls": [{"id": "toolu_01", "type": "function", "function": {
                 "name": "Read", "arguments": '{"file_path": "main.py"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_01", "content": "print('hi'"}]}
    assert prepare(builder, openai).rendered.text == text
    # text beside a call without reasoning is still rendered (as the analysis, by the template)
    plain = json.loads(json.dumps(openai))
    del plain["messages"][2]["reasoning_content"]
    assert "<|channel|>analysis<|message|>I'll read main.py.<|end|>" in \
        prepare(builder, plain).rendered.text
