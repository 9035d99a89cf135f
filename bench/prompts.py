"""The proxy's own prompt path for benchmarks: an OpenAI chat body -> exactly the token ids, safe
boundaries and message starts the proxy computes for it.

`load_builder(model)` is `proxy.prompt.PromptBuilder.load` with the default Config's volatile
patterns (what `proxy.app` builds); `prepare` and `render` parse with `openai_api.parse_chat` and
call the builder's real `prepare`, without a context limit (the oracle does not refuse a long
prompt). The oracle, the simulator, the replay and the overhead benchmark all read prompts here.
"""

from __future__ import annotations

from typing import Any

from policies.scope import parse_scope
from proxy import openai_api
from proxy.config import Config
from proxy.prompt import Prepared, PromptBuilder
from proxy.template import Rendered

UNBOUNDED_CTX = 1 << 30


def load_builder(model: str = "") -> PromptBuilder:
    cfg = Config(model=model)
    return PromptBuilder.load(cfg.model_path, cfg.volatile_patterns)


def prepare(builder: PromptBuilder, body: dict[str, Any]) -> Prepared:
    return builder.prepare(openai_api.parse_chat(body, ""), UNBOUNDED_CTX,
                           parse_scope(Config().disk_prefix_cache))


def render(builder: PromptBuilder, body: dict[str, Any]) -> Rendered:
    return prepare(builder, body).rendered
