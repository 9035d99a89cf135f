"""Steps 2 and 3 of a request: normalize and lay out, then render and tokenize. One
`PromptBuilder` per model, used alike by the app, the benchmarks and the tests.

    PromptBuilder.load(model_path, ...)    the GGUF's metadata, tokenizer and chat template
    builder.prepare(req, ...) -> Prepared  normalize volatile bytes, lay the prompt out stable
                                           first, tools into the prompt, render the template,
                                           tokenize; reject what does not fit

Rules:
- Normalization strips the volatile patterns (regexes) from system, developer and user text
  before templating: bytes that change on every request but mean nothing to the model (Claude
  Code's billing line). A system message that held nothing else is dropped, so a request renders
  the same with and without such a block.
- Stable first (`stable_layout`): a prefix cache can only reuse what comes before the first
  difference, so what changes between sessions goes behind what does not. The volatile blocks
  (regexes: Claude Code's `gitStatus:` block at the end of its system prompt, Hermes's
  `Conversation started:` date line) are cut out of the system message and put at the start of
  the first user message, where Claude Code already puts the date; and where prefixgate writes
  the tools section itself (a template without tool support), it comes before the system text
  (proxy/tools.py). The model still sees everything; history renders the same every turn, so
  each turn still extends the last. Anthropic's own cache orders a request the same way: tools,
  system, messages.
- A prompt of zero tokens, or of at least n_ctx tokens, is a 400 (`ContextOverflow` for the
  latter, in the shape clients compact on). A template that raises is a 400 that quotes it.
- Text that cannot fit the context whatever its tokens is refused before it is rendered or
  tokenized (`TextTooLong`, a ContextOverflow): more characters of message content (or raw
  prompt), after normalization, than n_ctx tokens of the vocabulary's longest could cover. No
  token covers more characters than its own text has, and every template renders each
  message's content, so this never refuses a prompt that fits.
- `max_tokens` is what the request asked for, capped at the room left in the context.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from llama_cpp.llama_grammar import json_schema_to_gbnf

from backend import kv_override
from policies.prefix import TokenIds
from policies.scope import Scope, format_scope, parse_scope
from proxy import samplers
from proxy.chat import ChatRequest
from proxy.dialects import Dialect, Stream, for_template
from proxy.dialects.grammar import clean_schema, grammar_error
from proxy.errors import BadRequest, ContextOverflow, TextTooLong
from proxy.gguf import read_metadata
from proxy.memo import IdMemo, PrefixMemo, TextMemo
from proxy.template import (
    CHATML_TEMPLATE,
    CannotContinue,
    ChatTemplate,
    Rendered,
    render_prompt,
)
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
    dialect: Dialect | None = None  # how the model writes calls and reasoning; None: raw text

    def stream(self) -> Stream | None:
        """The parser of this request's generated text into text, reasoning and calls; None
        when it is all text."""
        if self.dialect is None:
            return None
        return self.dialect.stream(self.req.tools, self.req.tool_choice, self.rendered.text)


_NONE = object()


def check_template_options(template: str, template_file: str) -> None:
    """llama-server's --chat-template beside --chat-template-file, or naming one of llama.cpp's
    built-in templates other than chatml (with Jinja, llama-server would render the name as the
    template's text): one line that stops the start."""
    if template and template_file:
        raise SystemExit("prefixgate: --chat-template and --chat-template-file both give the chat "
                         "template: give one")
    if re.fullmatch(r"[\w.-]+", template) and template != "chatml":
        raise SystemExit(f"prefixgate: --chat-template {template}: a built-in template by name "
                         "is not supported (chatml is): give its Jinja source or file")


class Normalizer:
    """Strips volatile bytes (per-request ids, billing lines) from system and user text."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self.patterns = patterns
        self._res = [re.compile(p) for p in patterns]
        self._memo = TextMemo()
        self._messages = IdMemo()
        self._histories = PrefixMemo()  # a history's normalized messages, for its next turn

    def text(self, s: str) -> str:
        hit = self._memo.get(s)
        if hit is not None:
            return str(hit)
        out = s
        for r in self._res:
            out = r.sub("", out)
        self._memo.put(s, out, len(s))
        return out

    def messages(self, messages: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        # per message: its normalized one, or None
        done = self._histories.carried(messages, self._messages, lambda _, m: self._message(m))
        return [d for d in done if d is not None]

    def _message(self, m: dict[str, Any]) -> dict[str, Any] | None:
        """`m` normalized; None when it held only volatile bytes."""
        c = m.get("content")
        if self._res and m.get("role") in ("system", "developer", "user") and isinstance(c, str):
            text = self.text(c)
            if c and not text and m.get("role") == "system":
                return None
            return m if text == c else {**m, "content": text}
        return m


class Layout:
    """Moves the volatile blocks of the first system message to the start of the first user
    message (see the module rules)."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self.patterns = patterns
        self._res = [re.compile(p) for p in patterns]
        self._memo = TextMemo()
        self._pairs = IdMemo(1024)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        s = u = -1  # the first system message before the first user message, and that one
        for i, m in enumerate(messages if self._res else ()):
            role = m.get("role")
            if role == "user":
                u = i
                break
            if role == "system" and s < 0:
                s = i
        if s < 0 or u < 0:
            return messages
        system, user = messages[s].get("content"), messages[u].get("content")
        if not isinstance(system, str) or not isinstance(user, str):
            return messages
        moved = self._memo.get((system, user), _NONE)
        if moved is _NONE:
            moved = self._move(system, user)
            self._memo.put((system, user), moved, len(system) + len(user))
        if moved is None:
            return messages
        out = list(messages)
        pair = self._pairs.get(messages[u])  # the same messages as before: the same objects
        if pair is None or pair[0] is not messages[s] or pair[1] != moved:
            pair = self._pairs.put(messages[u], (
                messages[s], moved, {**messages[s], "content": moved[0]},
                {**messages[u], "content": moved[1]}))
        out[s], out[u] = pair[2], pair[3]
        return out

    def _move(self, system: str, user: str) -> tuple[str, str] | None:
        """(the system text without its volatile blocks, the user text after them), or None
        when there are none."""
        blocks: list[str] = []
        for r in self._res:
            blocks += [b.strip() for b in r.findall(system)]
            system = r.sub("", system)
        blocks = [b for b in blocks if b]
        if not blocks:
            return None
        return system.rstrip(), "\n\n".join([*blocks, user])


class PromptBuilder:
    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer,
                 volatile_patterns: tuple[str, ...] = (), volatile_blocks: tuple[str, ...] = (),
                 stable_layout: bool = False, tool_dialect: str = "",
                 max_token_chars: int = 0) -> None:
        self.template = template
        self.tok = tokenizer
        # the longest token's text, in characters (0: unknown, no bound): no token covers more
        # characters of a text than that
        self.max_token_chars = max_token_chars
        self.dialect, self.section = _dialect_of(template, tool_dialect)
        self.normalizer = Normalizer(volatile_patterns)
        self.layout = Layout(volatile_blocks if stable_layout else ())
        self.stable_layout = stable_layout
        self.model_keys: dict[str, Any] = {}  # the GGUF's general.sampling.* (proxy/defaults.py)

    @classmethod
    def load(cls, model_path: str, volatile_patterns: tuple[str, ...] = (),
             volatile_blocks: tuple[str, ...] = (), stable_layout: bool = False,
             template_file: str = "", tool_dialect: str = "", template: str = "",
             override_kv: str = "") -> PromptBuilder:
        """The model's own tokenizer and chat template, read from its GGUF (blocking);
        `template_file`: a chat template used instead of the GGUF's (users fix broken templates
        this way), or `template`, its source (`chatml`: ChatML, as llama-server takes it). A
        template that does not compile raises `jinja2.TemplateSyntaxError`. `override_kv`: the
        metadata as llama.cpp reads it with llama-server's --override-kv (a key the file has
        with another type raises `kv_override.Mismatch`)."""
        meta = read_metadata(model_path)
        if overrides := kv_override.parse(override_kv):
            kv_override.checked(meta, overrides)
            meta = kv_override.applied(meta, overrides)
        values = {o.key: o.value for o in overrides}  # llama.cpp's tokenizer reads them too
        tok = load_tokenizer(model_path, meta, overrides=values or None)
        source = CHATML_TEMPLATE if template == "chatml" else template or (
            Path(template_file).read_text(encoding="utf-8") if template_file else
            meta.get("tokenizer.chat_template") or "")
        template = ChatTemplate(source,
                                tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
                                tok.decode([tok.eos_id]) if tok.eos_id is not None else "")
        tokens = meta.get("tokenizer.ggml.tokens")
        longest = max((len(t) for t in tokens if isinstance(t, str)), default=0) \
            if isinstance(tokens, list) else 0
        builder = cls(template, tok, volatile_patterns, volatile_blocks, stable_layout,
                      tool_dialect, max(longest, 1) if longest else 0)
        builder.model_keys = {k: v for k, v in meta.items() if k.startswith("general.sampling.")}
        return builder

    def messages(self, req: ChatRequest
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(the messages, the tools) the template renders: volatile bytes stripped, laid out
        stable first, tools into the prompt where the template does not take them, history
        in the dialect's fields."""
        messages, tools = tool_prompt(
            self.template.supports_tools,
            self.layout.messages(self.normalizer.messages(req.messages)), req.tools,
            self.stable_layout, self.section)
        return self.dialect.messages(messages), tools

    def check_text(self, n_chars: int, n_ctx: int, param: str = "messages") -> None:
        """`TextTooLong` when this much text cannot fit `n_ctx` tokens (0: no bound)."""
        if n_ctx and self.max_token_chars and n_chars > (n_ctx - 1) * self.max_token_chars:
            raise TextTooLong(n_chars, n_ctx, self.max_token_chars, param)

    def render(self, req: ChatRequest, n_ctx: int = 0) -> tuple[Rendered, str | None]:
        """(the rendered, tokenized prompt, the forced-call grammar or None); with `n_ctx`, a
        text that cannot fit it is refused before it is rendered (`check_text`)."""
        if req.prompt is not None:
            text = self.normalizer.text(req.prompt)
            self.check_text(len(text), n_ctx, "prompt")
            ids = TokenIds(self.tok.encode(text))
            if self.tok.add_bos and self.tok.bos_id is not None:
                ids = TokenIds((self.tok.bos_id,)) + ids
            return Rendered(req.prompt, ids, (len(ids),), ()), answer_grammar(req)
        messages, tools = self.messages(req)
        self.check_text(content_chars(messages), n_ctx)
        try:
            rendered = render_prompt(self.template.bound(req.template_kwargs), self.tok,
                                     messages, tools, req.continue_final)
        except jinja2.TemplateError as e:  # e.g. a template that wants alternating roles
            raise BadRequest(f"the model's chat template rejected these messages: {e}",
                             param="messages") from None
        except CannotContinue as e:
            raise BadRequest(str(e), param="messages") from None
        except Exception as e:  # any other failure inside the template: untrusted code
            if not _raised_in_template(e):
                raise
            raise BadRequest(f"the model's chat template failed on these messages: "
                             f"{type(e).__name__}: {e}", param="messages") from None
        grammar = self.dialect.forced(req.tools, req.tool_choice, rendered.text) \
            if req.tools else None
        return rendered, grammar or answer_grammar(req)

    def _budget(self, req: ChatRequest, text: str) -> dict[str, Any]:
        """The request's reasoning budget in token ids: a chat's tags are its dialect's (as
        llama-server takes the template's) and its generation prompt the prompt's tail from the
        opening tag where that opened the block; raw text's are what the request names."""
        s = req.sampling
        if req.prompt is not None:
            return samplers.resolve_budget(
                s, s.get("reasoning_budget_start_tag", ""), s.get("reasoning_budget_end_tags", ()),
                s.get("reasoning_budget_generation_prompt", ""), self.tok.encode)
        think = self.dialect.think
        if think is None:
            return samplers.resolve_budget(s, "", (), "", self.tok.encode)
        inside = self.dialect.inside_think(text)
        return samplers.resolve_budget(s, think[0], think[1:],
                                       text[text.rfind(think[0]):] if inside else "",
                                       self.tok.encode)

    def prepare(self, req: ChatRequest, n_ctx: int, default_scope: Scope) -> Prepared:
        """Blocking (rendering a long conversation takes milliseconds): the gateway runs it on
        its render thread."""
        t0 = time.perf_counter()
        try:
            scope = parse_scope(req.scope or format_scope(default_scope), req.window)
        except ValueError as e:
            raise BadRequest(str(e), param="prefix_cache") from None
        rendered, grammar = self.render(req, n_ctx)
        if req.sampling.get("logit_bias"):
            req = dataclasses.replace(req, sampling=samplers.resolve(
                req.sampling, self.tok.encode, self.tok.decode))
        if any(k.startswith("reasoning_budget_") for k in req.sampling):
            req = dataclasses.replace(req, sampling=self._budget(req, rendered.text))
        n = len(rendered.ids)
        if n == 0:
            raise BadRequest("the prompt renders to zero tokens; send some text",
                             param="messages")
        if n >= n_ctx:
            raise ContextOverflow(n, n_ctx)
        room = n_ctx - n
        max_tokens = min(req.max_tokens, room) if req.max_tokens else room
        return Prepared(req, rendered, scope, max_tokens, t0, grammar,
                        self.dialect if req.prompt is None else None)


def content_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of the messages' content (a string, or parts with text)."""
    hit = _COUNTED.found(messages)
    upto = [0] if hit is None else list(hit[1][: hit[0] + 1])  # chars before each message
    n = upto[-1]
    for m in messages[len(upto) - 1:]:
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p["text"]) for p in content
                     if isinstance(p, dict) and isinstance(p.get("text"), str))
        upto.append(n)
    _COUNTED.keep(messages, tuple(upto))
    return n


_COUNTED = PrefixMemo()  # a history's content characters, for its next turn


def answer_grammar(req: ChatRequest) -> str | None:
    """The grammar of a request's JSON schema (response_format, `json_schema`), else of its
    `grammar` (the schema wins, as in llama-server), checked by llama.cpp's parser."""
    if req.json_schema is not None:
        return json_grammar(req.json_schema)
    if req.grammar is not None:
        error = grammar_error(req.grammar)
        if error:
            raise BadRequest(f"'grammar' does not parse (llama.cpp's grammar parser says "
                             f"{error!r})", param="grammar")
    return req.grammar


def json_grammar(schema: Any) -> str:
    """The grammar of an answer that is one JSON value of `schema` (response_format), parsed by
    llama.cpp here: a schema it cannot express is a 400 that says why, never ignored. Bounds too
    big to unroll are left out, as for tool schemas (proxy/dialects/grammar.py)."""
    try:
        grammar = json_schema_to_gbnf(json.dumps(clean_schema(schema)))
    except Exception as e:  # the converter's own refusal of a schema feature
        raise BadRequest(f"response_format: this JSON schema cannot be made into a grammar "
                         f"({type(e).__name__}: {str(e)[:160]})", param="response_format"
                         ) from None
    error = grammar_error(grammar)
    if error is not None:
        raise BadRequest(f"response_format: this JSON schema cannot be made into a grammar "
                         f"(llama.cpp's grammar parser says {error!r})",
                         param="response_format")
    return grammar


def _dialect_of(template: ChatTemplate, name: str
                ) -> tuple[Dialect, Callable[[list[dict[str, Any]]], str] | None]:
    """(the dialect, the tools section prefixgate writes into the system prompt or None):
    a template that reads the tools renders them itself; one that renders calls but not the
    tools gets its dialect's section; one that does neither gets prefixgate's Hermes
    convention (proxy/tools.py)."""
    dialect = for_template(template.source, name)
    if template.supports_tools:
        return dialect, None
    if "tool_calls" in template.source and dialect.section is not None:
        return dialect, dialect.section
    return for_template(template.source, "hermes"), None


def _raised_in_template(e: BaseException) -> bool:
    """Jinja compiles a template from a string to code whose file name is "<template>"."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False
