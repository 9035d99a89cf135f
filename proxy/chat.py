"""The internal request: what every API parses into, validated once at the edge.

Messages are kept OpenAI-shaped (`role`, `content` as a string, optional `tool_calls`,
`tool_call_id`, `name`) because that is what chat templates read.

Media (an image, audio, a file, a document) reaches a text-only model as a short text
placeholder in its place (`placeholder(kind)`), never a 400: one image in a Claude Code session
(a pasted screenshot, the Read tool on a PNG) would otherwise fail that request and every later
one of the session. The placeholder is the same text every time, so the conversation still
extends its earlier turns in the cache. The request carries the kinds it replaced (`media`):
the edge says so in one log line and counts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy import samplers
from proxy.errors import BadRequest

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ChatRequest:
    api: str  # "openai" | "anthropic" | "completions": for logs and metrics
    messages: tuple[dict[str, Any], ...]  # OpenAI-shaped; empty for raw completions
    prompt: str | None = None  # raw text for /v1/completions
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI function-tool shape
    tool_choice: Any = "auto"  # "auto" | "none" | "required" | {"name": ...}
    sampling: dict[str, Any] = field(default_factory=dict)  # engine.Sampling fields
    max_tokens: int | None = None  # None = up to the context's end
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    scope: str | None = None  # per-request prefix_cache.scope
    window: int | None = None  # per-request prefix_cache.window
    tenant: str = ""  # the API key when tenant isolation is on
    continue_final: bool = False  # the reply continues the final assistant message (Anthropic)
    # variables for the chat template: chat_template_kwargs, reasoning_effort, enable_thinking
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # OpenAI's response_format as the JSON schema the answer must match (json_object: any
    # object); None: free text
    json_schema: Any = None
    grammar: str | None = None  # llama-server's `grammar` (GBNF), where no JSON schema is given
    # the kind of each media block replaced by a text placeholder, in order (MEDIA_KINDS)
    media: tuple[str, ...] = ()
    # Responses API: a tool given inside a `namespace` tool -> (that namespace, its name
    # there); the model sees it among the others, its calls name the namespace
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)


MEDIA_KINDS = ("image", "audio", "file", "document")
MEDIA_MODE = "placeholder"  # what a text-only model does with media (shown in /props)


def placeholder(kind: str) -> str:
    """The text a `kind` of media block becomes for a text-only model."""
    assert kind in MEDIA_KINDS
    return f"[{kind} omitted: this model reads text only]"


# --- validation helpers: each raises BadRequest naming the field and what to send -----------


def expect_dict(body: Any, what: str = "request body") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object")
    return body


def opt_number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadRequest(f"'{name}' must be a number between {lo} and {hi}", param=name)
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
    return float(v)


def opt_int(body: dict[str, Any], name: str, lo: int, hi: int = 2**31) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{name}' must be an integer", param=name)
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be at least {lo}, got {v}", param=name)
    return v


def opt_bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false", param=name)
    return v


def parse_stop(v: Any, name: str = "stop") -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise BadRequest(f"'{name}' must be a string or a list of strings", param=name)


def parse_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI-style sampling fields (Anthropic's share the names), and llama-server's other
    samplers' (proxy/samplers.py); a field that asks what prefixgate does not do is a 400."""
    samplers.refuse_unsupported(body)
    s: dict[str, Any] = samplers.parse(body)
    for name, key, lo, hi in (
        ("temperature", "temperature", 0.0, 2.0),
        ("top_p", "top_p", 0.0, 1.0),
        ("min_p", "min_p", 0.0, 1.0),
        ("presence_penalty", "presence_penalty", -2.0, 2.0),
        ("frequency_penalty", "frequency_penalty", -2.0, 2.0),
        ("repeat_penalty", "repeat_penalty", 0.01, 10.0),  # 0 divides the logits by 0
    ):
        v = opt_number(body, name, lo, hi)
        if v is not None:
            s[key] = v
    top_k = opt_int(body, "top_k", 0)
    if top_k is not None:
        s["top_k"] = top_k
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise BadRequest("'seed' must be an integer", param="seed")
        s["seed"] = seed & 0xFFFFFFFF
    # llama-server's reasoning budget (policies.reasoning_budget): -1 none, as not set
    name = "reasoning_budget_tokens" if body.get("reasoning_budget_tokens") is not None \
        else "thinking_budget_tokens"
    budget = opt_int(body, name, -1)
    if budget is not None and budget >= 0:
        s["reasoning_budget_tokens"] = budget
    # raw text's tags and generation prompt (a chat's are its model's and its template's)
    for name, key in (("reasoning_budget_message", "reasoning_budget_message"),
                      ("reasoning_budget_start_tag", "reasoning_budget_start_tag"),
                      ("generation_prompt", "reasoning_budget_generation_prompt")):
        text = body.get(name)
        if text is not None:
            if not isinstance(text, str):
                raise BadRequest(f"'{name}' must be a string", param=name)
            s[key] = text
    ends = body.get("reasoning_budget_end_tags", body.get("reasoning_budget_end_tag"))
    if ends is not None:
        ends = [ends] if isinstance(ends, str) else ends
        if not isinstance(ends, list) or not all(isinstance(e, str) for e in ends):
            raise BadRequest("'reasoning_budget_end_tags' must be a list of strings",
                             param="reasoning_budget_end_tags")
        s["reasoning_budget_end_tags"] = tuple(ends)
    return s


def parse_grammar(body: dict[str, Any]) -> str | None:
    """llama-server's `grammar`: GBNF text the answer must match (checked by llama.cpp's parser
    when the prompt is rendered); "" or null: none."""
    g = body.get("grammar")
    if g is not None and not isinstance(g, str):
        raise BadRequest("'grammar' must be GBNF text (a string)", param="grammar")
    return g or None


def parse_prefix_cache(body: dict[str, Any]) -> tuple[str | None, int | None]:
    pc = body.get("prefix_cache")
    if pc is None:
        return None, None
    if not isinstance(pc, dict):
        raise BadRequest(
            "'prefix_cache' must be an object like {\"scope\": \"auto:8\", \"window\": 8}; "
            "scope is off, full, auto, auto:N or N", param="prefix_cache")
    scope = pc.get("scope")
    if scope is not None and not isinstance(scope, str | int):
        raise BadRequest("'prefix_cache.scope' must be off, full, auto, auto:N or N",
                         param="prefix_cache.scope")
    window = pc.get("window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise BadRequest("'prefix_cache.window' must be a positive integer",
                         param="prefix_cache.window")
    return (str(scope) if scope is not None else None), window
