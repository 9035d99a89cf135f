"""Server-wide request defaults, as llama-server has them.

    Defaults.of(cfg, model_keys) -> Defaults;  defaults.apply(req) -> req

- **Sampling** (`--temp`, `--top-k`, `--top-p`, `--min-p`, `--repeat-penalty`,
  `--presence-penalty`, `--frequency-penalty`, `--seed`): a request's own field wins, then the
  command line's, then the model's `general.sampling.*` keys (temp, top_k, top_p, min_p,
  penalty_repeat), then llama.cpp's built-in values (backend.engine.Sampling). The model's keys
  for samplers prefixgate does not have (mirostat, XTC, penalty_last_n, the sampler sequence)
  are not used: said in one line at start (`Defaults.unused`).
- **Template variables**: a request's `chat_template_kwargs` (and Anthropic's `thinking`) over
  `--chat-template-kwargs`, over `--reasoning on|off` (`enable_thinking`, as llama-server sets
  it), `--reasoning-budget 0` (thinking off: llama-server's older meaning of 0),
  `--reasoning-effort` (`reasoning_effort`) and `--reasoning-preserve` (`preserve_reasoning`).
- **Length**: `-n N`, the most tokens a request that sets no maximum generates.
- **Reasoning in OpenAI answers** (`--reasoning-format`, `inline_reasoning`): auto and deepseek
  put it in `reasoning_content`; deepseek-legacy there and also in the content inside the
  model's think tags; none only in the content, inside the tags (`<think>` and `</think>` for
  a model whose dialect has none of its own).

All of it is in /props (`default_generation_settings.params`, as llama-server shows it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.chat import ChatRequest
from proxy.config import Config
from proxy.dialects.stream import Event, ReasoningDelta, TextDelta

SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
            "frequency_penalty")
# the model's general.sampling.* keys -> the sampling field each sets (llama.cpp's
# common_params_sampling_from_model)
MODEL_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repeat_penalty"}
# llama.cpp's built-in values (backend.engine.Sampling's), shown in /props
BUILT_IN = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
THINK_TAGS = ("<think>", "</think>")


@dataclass(frozen=True, slots=True)
class Defaults:
    sampling: dict[str, Any] = field(default_factory=dict)  # the command line's and the model's
    source: dict[str, str] = field(default_factory=dict)  # field -> "command line" | "model"
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    reasoning_format: str = "auto"
    unused: tuple[str, ...] = ()  # the model's sampling keys not used (said at start)

    @classmethod
    def of(cls, cfg: Config, model_keys: Mapping[str, Any]) -> Defaults:
        sampling: dict[str, Any] = {}
        source: dict[str, str] = {}
        for key, name in MODEL_KEYS.items():
            value = model_keys.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                sampling[name] = int(value) if name == "top_k" else float(value)
                source[name] = "model"
        for name in SAMPLING:
            value = getattr(cfg, name)
            if value is not None:
                sampling[name], source[name] = value, "command line"
        if cfg.seed >= 0:
            sampling["seed"], source["seed"] = cfg.seed & 0xFFFFFFFF, "command line"
        kwargs: dict[str, Any] = {}
        if cfg.reasoning_effort:
            kwargs["reasoning_effort"] = cfg.reasoning_effort
        if cfg.reasoning_preserve:
            kwargs["preserve_reasoning"] = cfg.reasoning_preserve == "on"
        if cfg.reasoning != "auto":
            kwargs["enable_thinking"] = cfg.reasoning == "on"
        if cfg.reasoning_budget == 0:
            kwargs["enable_thinking"] = False
        if cfg.chat_template_kwargs:
            kwargs.update(json.loads(cfg.chat_template_kwargs))
        unused = tuple(sorted(k for k in model_keys
                              if k.startswith("general.sampling.") and k not in MODEL_KEYS))
        return cls(sampling, source, kwargs, cfg.n_predict if cfg.n_predict >= 0 else None,
                   cfg.reasoning_format, unused)

    def apply(self, req: ChatRequest) -> ChatRequest:
        """The request with these defaults under its own settings."""
        if not (self.sampling or self.template_kwargs or self.max_tokens is not None):
            return req
        return dataclasses.replace(
            req, sampling={**self.sampling, **req.sampling},
            template_kwargs={**self.template_kwargs, **req.template_kwargs}
            if req.prompt is None else req.template_kwargs,
            max_tokens=req.max_tokens if req.max_tokens is not None else self.max_tokens)

    def props(self) -> dict[str, Any]:
        """What a request that sets nothing gets, and where each value comes from."""
        params = {**BUILT_IN, "seed": -1, **self.sampling,
                  "n_predict": -1 if self.max_tokens is None else self.max_tokens,
                  "chat_template_kwargs": self.template_kwargs,
                  "reasoning_format": self.reasoning_format}
        return {"params": params, "params_source": {k: self.source.get(k, "built-in")
                                                    for k in (*BUILT_IN, "seed")}}


async def inline_reasoning(events: AsyncIterator[Event], fmt: str,
                           tags: tuple[str, str] | None) -> AsyncIterator[Event]:
    """The events as `--reasoning-format` wants them: reasoning also (deepseek-legacy) or only
    (none) in the text, inside the think tags; auto and deepseek leave them as they are."""
    if fmt not in ("none", "deepseek-legacy"):
        async for ev in events:
            yield ev
        return
    open_, close = tags or THINK_TAGS
    inside = False
    async for ev in events:
        if isinstance(ev, ReasoningDelta):
            if fmt == "deepseek-legacy":
                yield ev
            yield TextDelta(ev.text if inside else open_ + ev.text)
            inside = True
            continue
        if inside:
            yield TextDelta(close)
            inside = False
        yield ev
    if inside:
        yield TextDelta(close)
