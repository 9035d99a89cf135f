"""Server-wide request defaults, as llama-server has them.

    Defaults.of(cfg, model_keys) -> Defaults;  defaults.apply(req) -> req

- **Sampling** (`--temp`, `--top-k`, `--top-p`, `--min-p`, `--repeat-penalty`,
  `--presence-penalty`, `--frequency-penalty`, `--seed`, and llama-server's other samplers'
  flags as `--sampling NAME=VALUE`: proxy/samplers.py): a request's own field wins, then the
  command line's, then the model's `general.sampling.*` keys (llama.cpp's
  `common_params_sampling_from_model`: temp, top_k, top_p, min_p, penalty_repeat,
  penalty_last_n, mirostat and its tau and eta, the XTC probability and threshold, the sampler
  sequence), then llama.cpp's built-in values (backend.sampling.Sampling). A model key that
  is not one of these, or whose value is not one, is said in one line at start
  (`Defaults.unused`).
- **Template variables**: a request's `chat_template_kwargs` (and Anthropic's `thinking`) over
  `--chat-template-kwargs`, over `--reasoning on|off` (`enable_thinking`, as llama-server sets
  it), `--reasoning-effort` (`reasoning_effort`) and `--reasoning-preserve`
  (`preserve_reasoning`).
- **Reasoning budget**: `--reasoning-budget N` (and `--reasoning-budget-message`) under a
  request's `reasoning_budget_tokens` (or `thinking_budget_tokens`; Anthropic's
  `thinking.budget_tokens`): at most N tokens of reasoning, then its end is forced
  (policies.reasoning_budget; 0 ends it at once, as llama-server's current meaning of 0).
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

from proxy import samplers
from proxy.chat import ChatRequest
from proxy.config import Config
from proxy.dialects.stream import Event, ReasoningDelta, TextDelta

SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
            "frequency_penalty")
# the model's general.sampling.* keys -> the sampling field each sets (llama.cpp's
# common_params_sampling_from_model)
MODEL_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repeat_penalty",
              "general.sampling.penalty_last_n": "repeat_last_n",
              "general.sampling.mirostat": "mirostat",
              "general.sampling.mirostat_tau": "mirostat_tau",
              "general.sampling.mirostat_eta": "mirostat_eta",
              "general.sampling.xtc_probability": "xtc_probability",
              "general.sampling.xtc_threshold": "xtc_threshold",
              "general.sampling.sequence": "samplers"}
_INTS = ("top_k", "repeat_last_n", "mirostat")
# llama.cpp's built-in values (backend.sampling.Sampling's: a test holds them equal), in /props
BUILT_IN = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repeat_last_n": 64, "typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
            "xtc_threshold": 0.1, "dry_multiplier": 0.0, "dry_base": 1.75,
            "dry_allowed_length": 2, "dry_penalty_last_n": 64,
            "dry_sequence_breakers": ("\n", ":", "\"", "*"), "dynatemp_range": 0.0,
            "dynatemp_exponent": 1.0, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
            "adaptive_target": -1.0, "adaptive_decay": 0.9, "min_keep": 0,
            "samplers": samplers.ORDER, "logit_bias": (), "ignore_eos": False}
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
        bad: list[str] = []
        for key, name in MODEL_KEYS.items():
            value = model_keys.get(key)
            if value is None:
                continue
            try:
                if name == "samplers":
                    sampling[name] = samplers.sampler_names(
                        [n for n in str(value).split(";") if n])
                elif isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(value)
                else:
                    sampling[name] = int(value) if name in _INTS else float(value)
                source[name] = "model"
            except ValueError:
                bad.append(key)
        for name, value in [*((n, getattr(cfg, n)) for n in SAMPLING),
                            *samplers.from_items(cfg.sampling).items()]:
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
        if cfg.reasoning_budget >= 0:  # a budget of thinking tokens (0: end at once)
            sampling["reasoning_budget_tokens"] = cfg.reasoning_budget
            source["reasoning_budget_tokens"] = "command line"
        if cfg.reasoning_budget_message:
            sampling["reasoning_budget_message"] = cfg.reasoning_budget_message
            source["reasoning_budget_message"] = "command line"
        if cfg.chat_template_kwargs:
            kwargs.update(json.loads(cfg.chat_template_kwargs))
        unused = tuple(sorted([*bad, *(k for k in model_keys
                                       if k.startswith("general.sampling.")
                                       and k not in MODEL_KEYS)]))
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
        params = {**BUILT_IN, "seed": -1, "reasoning_budget_tokens": -1, **self.sampling,
                  "n_predict": -1 if self.max_tokens is None else self.max_tokens,
                  "chat_template_kwargs": self.template_kwargs,
                  "reasoning_format": self.reasoning_format}
        return {"params": params, "params_source": {k: self.source.get(k, "built-in")
                                                    for k in (*BUILT_IN, "seed",
                                                              "reasoning_budget_tokens")}}


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
