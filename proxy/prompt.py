"""Steps 2 and 3 of a request: normalize, then render and tokenize. One `PromptBuilder` per
model, used alike by the app, the benchmarks and the tests.

    PromptBuilder.load(model_path)        the GGUF's metadata, tokenizer and chat template
    builder.prepare(req, ...) -> Prepared  normalize volatile bytes, tools into the prompt, render
                                           the template, tokenize; reject what does not fit

Rules:
- Normalization strips the volatile patterns (regexes) from system, developer and user text
  before templating: bytes that change on every request but mean nothing to the model (Claude
  Code's billing line). Nothing else is rewritten.
- A prompt of zero tokens, or of at least n_ctx tokens, is a 400 (`ContextOverflow` for the
  latter, in the shape clients compact on). A template that raises is a 400 that quotes it.
- `max_tokens` is what the request asked for, capped at the room left in the context.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import jinja2

from policies.scope import Scope, format_scope, parse_scope
from proxy.chat import ChatRequest
from proxy.errors import BadRequest, ContextOverflow
from proxy.gguf import read_metadata
from proxy.template import CannotContinue, ChatTemplate, Rendered, render_prompt
from proxy.tokenizer import Tokenizer, load_tokenizer
from proxy.tools import apply as tool_prompt


@dataclass(frozen=True, slots=True)
class Prepared:
    req: ChatRequest
    rendered: Rendered
    scope: Scope
    max_tokens: int
    arrived_s: float  # perf_counter at arrival, for time to first token
    grammar: str | None = None  # GBNF constraining the output (forced tool calls)


class Normalizer:
    """Strips volatile bytes (per-request ids, billing lines) from system and user text."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self.patterns = patterns
        self._res = [re.compile(p) for p in patterns]

    def text(self, s: str) -> str:
        for r in self._res:
            s = r.sub("", s)
        return s

    def messages(self, messages: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            c = m.get("content")
            if (self._res and m.get("role") in ("system", "developer", "user")
                    and isinstance(c, str)):
                m = {**m, "content": self.text(c)}
            out.append(m)
        return out


class PromptBuilder:
    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer,
                 volatile_patterns: tuple[str, ...] = ()) -> None:
        self.template = template
        self.tok = tokenizer
        self.normalizer = Normalizer(volatile_patterns)

    @classmethod
    def load(cls, model_path: str, volatile_patterns: tuple[str, ...] = ()) -> PromptBuilder:
        """The model's own tokenizer and chat template, read from its GGUF (blocking)."""
        meta = read_metadata(model_path)
        tok = load_tokenizer(model_path, meta)
        template = ChatTemplate(meta.get("tokenizer.chat_template") or "",
                                tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
                                tok.decode([tok.eos_id]) if tok.eos_id is not None else "")
        return cls(template, tok, volatile_patterns)

    def render(self, req: ChatRequest) -> tuple[Rendered, str | None]:
        """(the rendered, tokenized prompt, the forced-call grammar or None)."""
        if req.prompt is not None:
            ids = tuple(self.tok.encode(self.normalizer.text(req.prompt)))
            if self.tok.add_bos and self.tok.bos_id is not None:
                ids = (self.tok.bos_id, *ids)
            return Rendered(req.prompt, ids, (len(ids),), ()), None
        messages, tools, grammar = tool_prompt(self.template.supports_tools,
                                               self.normalizer.messages(req.messages),
                                               req.tools, req.tool_choice)
        try:
            return render_prompt(self.template, self.tok, messages, tools,
                                 req.continue_final), grammar
        except jinja2.TemplateError as e:  # e.g. a template that wants alternating roles
            raise BadRequest(f"the model's chat template rejected these messages: {e}",
                             param="messages") from None
        except CannotContinue as e:
            raise BadRequest(str(e), param="messages") from None

    def prepare(self, req: ChatRequest, n_ctx: int, default_scope: Scope) -> Prepared:
        t0 = time.perf_counter()
        try:
            scope = parse_scope(req.scope or format_scope(default_scope), req.window)
        except ValueError as e:
            raise BadRequest(str(e), param="prefix_cache") from None
        rendered, grammar = self.render(req)
        n = len(rendered.ids)
        if n == 0:
            raise BadRequest("the prompt renders to zero tokens; send some text",
                             param="messages")
        if n >= n_ctx:
            raise ContextOverflow(n, n_ctx)
        room = n_ctx - n
        max_tokens = min(req.max_tokens, room) if req.max_tokens else room
        return Prepared(req, rendered, scope, max_tokens, t0, grammar)
