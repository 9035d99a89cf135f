"""Tool-call and reasoning dialects: how a model family writes tool calls and reasoning into
its answer, found from its chat template.

    dialect = for_template(template_source)   # or for_template(source, "qwen3_coder")
    stream = dialect.stream(tools, choice, prompt_text)   # events out of generated text
    grammar = dialect.forced(tools, choice, prompt_text)  # GBNF for a forced call, or None

One module per format, each with `detect(template) -> bool`, what opens a call (`OPENS`) and
`section(...)` (one call section -> calls; base.scan_sections reads reasoning and text around
them; Harmony, whose answer is channels, has its own `scan`), and `grammar(tools)` (one call to
one of the tools, in its format); `history(messages)` where the template wants the history in
other fields, `tools_section(tools)` where it renders calls but not the tools:

    harmony       gpt-oss (channels, `to=functions.NAME`)
    minimax       MiniMax-M2 (`<minimax:tool_call><invoke name=...>`)
    kimi          Kimi K2 (`<|tool_calls_section_begin|>`)
    deepseek      DeepSeek V3.1 (`<｜tool▁calls▁begin｜>`)
    glm           GLM-4.5/4.6/4.7 (`<arg_key>/<arg_value>`)
    qwen3_coder   Qwen3-Coder, Qwen3.5/3.6 (`<function=NAME><parameter=P>`)
    mistral       Mistral, Devstral (`[TOOL_CALLS]NAME[ARGS]{...}`)
    hermes        Hermes, Qwen2.5, Qwen3 (`<tool_call>{json}</tool_call>`); also the default, and
                  the format of the tools section prefixgate writes for templates without tools

Rules:
- The first module, in the order above, whose `detect` recognizes the template wins (a
  template holds its own call format as text); `--tool-dialect NAME` overrides. A template
  that renders calls but not the tools (DeepSeek V3.1) gets its dialect's `tools_section` in
  the system prompt; one that takes neither gets prefixgate's Hermes tools section, so its
  dialect is hermes.
- Reasoning in `<think>...</think>` (Qwen3, Qwen3.5, GLM, DeepSeek, MiniMax, Kimi thinking)
  is recognized when the template mentions `</think>`: a block at the start of the answer, or
  one the prompt opened (the generation prompt ends inside `<think>`). Harmony reasons in its
  analysis channel. Calls inside reasoning are not calls.
- A forced call's grammar is the dialect's own call format; when the prompt opened a
  reasoning block, the grammar closes it first (a forced call does not reason).
- tool_choice "none": reasoning is still separated; nothing is parsed as a call.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from proxy.dialects import deepseek, glm, harmony, hermes, kimi, minimax, mistral, qwen3_coder
from proxy.dialects.base import Tools, scan_sections
from proxy.dialects.grammar import assemble, grammar_error, literal, refusal
from proxy.dialects.stream import (
    ArgsDelta,
    CallDone,
    CallOpen,
    Event,
    ReasoningDelta,
    Stream,
    TextDelta,
    ToolCall,
)

__all__ = ["NAMES", "ArgsDelta", "CallDone", "CallOpen", "Dialect", "Event", "ReasoningDelta",
           "Stream", "TextDelta", "ToolCall", "events", "for_template"]

_MODULES: dict[str, Any] = {
    "harmony": harmony, "minimax": minimax, "kimi": kimi, "deepseek": deepseek, "glm": glm,
    "qwen3_coder": qwen3_coder, "mistral": mistral, "hermes": hermes,
}
NAMES = tuple(_MODULES)
THINK = ("<think>", "</think>")


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str
    scan: Callable[..., Any]
    grammar: Callable[[list[dict[str, Any]]], tuple[str, list[str]]]
    think: tuple[str, str] | None  # reasoning tags, None when it has none (or its own)
    channels: bool  # the answer is a run of channels (Harmony), parsed even without tools
    history: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
    # the tools for the system prompt, where the template renders calls but not the tools
    section: Callable[[list[dict[str, Any]]], str] | None = None

    def inside_think(self, prompt: str) -> bool:
        """Whether the generation prompt opened a reasoning block."""
        if self.think is None:
            return False
        tail = prompt[-256:]
        return tail.rfind(self.think[0]) > max(tail.rfind(self.think[1]), -1)

    def stream(self, tools: tuple[dict[str, Any], ...], choice: Any, prompt: str
               ) -> Stream | None:
        """The parser of an answer to `prompt`; None when the answer can only be text (no
        tools in play, no reasoning format): the pieces then go out as they come."""
        declared = Tools.of(() if choice == "none" else tools)
        if not declared.types and self.think is None and not self.channels:
            return None
        forced = tuple(t["function"]["name"] for t in tools
                       if choice == "required" or (isinstance(choice, dict)
                                                   and t["function"]["name"] == choice["name"]))
        return Stream(functools.partial(self.scan, think=self.think), declared,
                      self.inside_think(prompt), forced)

    def forced(self, tools: tuple[dict[str, Any], ...], choice: Any, prompt: str) -> str | None:
        """GBNF for exactly one call (to the named tool for {"name"}); None unless forced."""
        if choice == "required":
            chosen = list(tools)
        elif isinstance(choice, dict):
            chosen = [t for t in tools if t["function"]["name"] == choice["name"]]
        else:
            return None
        grammar = self._grammar(chosen, prompt)
        error = grammar_error(grammar)
        if error is not None:
            bad = [t for t in chosen if grammar_error(self._grammar([t], prompt))] or chosen
            raise refusal(bad, error)
        return grammar

    def _grammar(self, chosen: list[dict[str, Any]], prompt: str) -> str:
        root, rules = self.grammar(chosen)
        if self.think is not None and self.inside_think(prompt):
            root = f"{literal(self.think[1] + chr(10) + chr(10))} {root}"
        return assemble(root, rules)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.history(messages) if self.history is not None else messages


def for_template(source: str, name: str = "") -> Dialect:
    """The dialect a chat template writes (see the module rules); `name` overrides. Raises
    ValueError for a name that is not one of NAMES."""
    if name and name not in _MODULES:
        raise ValueError(f"unknown tool dialect {name!r}; one of {', '.join(NAMES)}")
    found = name or next((n for n, m in _MODULES.items() if m.detect(source)), "hermes")
    mod = _MODULES[found]
    think = None if mod is harmony or "</think>" not in source else THINK
    scan = getattr(mod, "scan", None) or functools.partial(scan_sections, opens=mod.OPENS,
                                                            section=mod.section)
    return Dialect(found, scan, mod.grammar, think, mod is harmony,
                   getattr(mod, "history", None), getattr(mod, "tools_section", None))


async def events(pieces: AsyncIterator[str], stream: Stream | None) -> AsyncIterator[Event]:
    """Generated text pieces as events: parsed by `stream`, or all text when it is None."""
    async for piece in pieces:
        if stream is None:
            yield TextDelta(piece)
            continue
        for ev in stream.feed(piece):
            yield ev
    if stream is not None:
        for ev in stream.finish():
            yield ev
