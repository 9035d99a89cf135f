"""Speculative decoding as the proxy sees it: the Config's `--spec-*` settings as the workers'
`SpecConfig` (their bounds are llama.cpp's, refused in llama.cpp's words), and what a request's
log line, metrics and `timings` say of its drafts.

What works as in llama-server: `--spec-type` (LLAMA_ARG_SPEC_TYPE) with llama.cpp's n-gram
types and `draft-simple`, alone or comma-separated, and each type's `--spec-ngram-*` sizes with
llama.cpp's defaults; a draft model (`-md`, `-ngld`, `--spec-draft-n-max`, `--spec-draft-n-min`,
`--spec-draft-p-min`; `-md` alone means draft-simple, which llama.cpp of this version would
load and not draft with); `timings.draft_n` and `timings.draft_n_accepted` in an answer that
drafted. The draft model's own placement and threads options are ignored (proxy/llama_cli.py);
this llama.cpp takes no speculative fields in a request (its server schema has them disabled),
nor does prefixgate. `--spec-stop
auto|off` is prefixgate's own: auto verifies a slot's drafts only where they pay (the worker's
measured verify cost, the slot's acceptance: policies.speculate), off verifies every draft, as
llama-server does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from policies.ngram import NgramParams
from policies.speculate import SpecConfig, parse_types

Config = Any  # proxy.config.Config (which imports this module)

# field -> (the least, the most, llama.cpp's words when it refuses)
BOUNDS: dict[str, tuple[int, int, str]] = {
    **{f"spec_ngram_{t}_size_n": (1, 1024, "ngram size N must be between 1 and 1024 inclusive")
       for t in ("simple", "map_k", "map_k4v")},
    **{f"spec_ngram_{t}_size_m": (1, 1024, "ngram size M must be between 1 and 1024 inclusive")
       for t in ("simple", "map_k", "map_k4v")},
    **{f"spec_ngram_{t}_min_hits": (1, 65535, "ngram min hits must be at least 1")
       for t in ("simple", "map_k", "map_k4v")},
    "spec_ngram_mod_n_match": (1, 1024, "ngram size N must be between 1 and 1024 inclusive"),
    "spec_ngram_mod_n_min": (0, 1024, "ngram n-min must be between 0 and 1024 inclusive"),
    "spec_ngram_mod_n_max": (0, 1024, "ngram n-max must be between 0 and 1024 inclusive"),
}


def resolve(cfg: Config) -> Config:
    """The Config's speculation as it runs: a size out of llama.cpp's bounds stops the start in
    one line, as llama-server does; a draft model drafts (draft-simple), and draft-simple needs
    one."""
    for name, (lo, hi, why) in BOUNDS.items():
        if not lo <= getattr(cfg, name) <= hi:
            raise SystemExit(f"prefixgate: --{name.replace('_', '-')} {getattr(cfg, name)}: "
                             f"{why}")
    if cfg.spec_draft_n_max < 0 or not 0 <= cfg.spec_draft_p_min <= 1:
        raise SystemExit("prefixgate: --spec-draft-n-max is at least 0, --spec-draft-p-min "
                         "between 0 and 1")
    types = parse_types(cfg.spec_type)
    if cfg.spec_draft_model and "draft-simple" not in types:
        # llama.cpp of this version loads the model and drafts nothing with it: a user who
        # gives one means it to draft
        return dataclasses.replace(cfg, spec_type=",".join((*types, "draft-simple")))
    if "draft-simple" in types and not cfg.spec_draft_model:
        raise SystemExit("prefixgate: --spec-type draft-simple drafts with a draft model: give "
                         "its GGUF with -md")
    return cfg


def draft_gpu_layers(cfg: Config) -> int:
    """--spec-draft-ngl: auto follows --n-gpu-layers, all is every layer, else N."""
    value = str(cfg.spec_draft_ngl).strip().lower()
    if value == "auto":
        return int(cfg.n_gpu_layers)
    return -1 if value == "all" else int(value)


def spec_config(cfg: Config) -> SpecConfig:
    """The workers' speculation settings of this Config."""
    sizes = {name.removeprefix("spec_ngram_"): getattr(cfg, name) for name in BOUNDS}
    return SpecConfig(parse_types(cfg.spec_type), NgramParams(**sizes),
                      always=cfg.spec_stop == "off", draft_n_max=cfg.spec_draft_n_max,
                      draft_n_min=cfg.spec_draft_n_min, draft_p_min=cfg.spec_draft_p_min)


def totals(draft: dict[str, Any]) -> tuple[int, int]:
    """(drafted, accepted) tokens of a `Done`'s per-source counts."""
    return (sum(int(s.get("drafted", 0)) for s in draft.values()),
            sum(int(s.get("accepted", 0)) for s in draft.values()))


def log_fields(draft: dict[str, Any]) -> str:
    """A request's log line's part: " drafted=N accepted=M acceptance=0.xx" ("" without)."""
    drafted, accepted = totals(draft)
    if not drafted:
        return ""
    return f" drafted={drafted} accepted={accepted} acceptance={accepted / drafted:.2f}"


def speculative_settings(settings: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """llama-server's `generation_settings` with its `params["speculative.types"]`."""
    params = {**settings.get("params", {}), "speculative.types": cfg.spec_type}
    return {**settings, "params": params}
