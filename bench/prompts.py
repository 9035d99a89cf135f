"""The proxy's own prompt path for benchmarks: an OpenAI chat body -> exactly the token ids, safe
boundaries and message starts the proxy computes for it.

`load_builder(model)` is `proxy.prompt.PromptBuilder.load` with the default Config's volatile
patterns and layout (what `proxy.app` builds); `prepare` and `render` parse with the API's own
parser (`anthropic_api.parse_request` for an Anthropic row, `openai_api.parse_chat` otherwise)
and call the builder's real `prepare`, without a context limit (the oracle does not refuse a long
prompt). The oracle, the simulator, the replay and the overhead benchmark all read prompts here.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from policies.scope import Scope, parse_scope
from proxy import anthropic_api, openai_api
from proxy.chat import ChatRequest
from proxy.config import Config
from proxy.prompt import Prepared, PromptBuilder
from proxy.template import Rendered

UNBOUNDED_CTX = 1 << 30


def load_builder(model: str = "", stable_layout: bool = True) -> PromptBuilder:
    """As the proxy builds it by default (`stable_layout=False`: the layout before it moved
    volatile blocks and tools, for comparisons)."""
    cfg = Config(model=model)
    return PromptBuilder.load(cfg.model_path, cfg.volatile_patterns, cfg.volatile_blocks,
                              stable_layout)


def prepare(builder: PromptBuilder, body: dict[str, Any], fmt: str = "openai") -> Prepared:
    """`fmt`: 'openai' (a chat completions body) or 'anthropic' (a Messages body)."""
    req = anthropic_api.parse_request(body, "") if fmt == "anthropic" else \
        openai_api.parse_chat(body, "")
    return prepare_request(builder, req)


@cache
def default_scope() -> Scope:
    """The default config's scope, read once (as the gateway reads its config once: a `Config()`
    a request cost the overhead bench's prepare about 0.03 ms)."""
    return parse_scope(Config().disk_prefix_cache)


def prepare_request(builder: PromptBuilder, req: ChatRequest) -> Prepared:
    """A parsed request prepared as the gateway prepares it (no context limit)."""
    return builder.prepare(req, UNBOUNDED_CTX, default_scope())


def render(builder: PromptBuilder, body: dict[str, Any], fmt: str = "openai") -> Rendered:
    return prepare(builder, body, fmt).rendered
