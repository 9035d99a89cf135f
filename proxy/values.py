"""What a flag's or a variable's text means for its Config field (`coerce`), and the words each
field takes: proxy/config.py's `from_args` reads every flag and variable through it.
"""

from __future__ import annotations

from typing import Any

from policies.schedule import DETERMINISTIC
from proxy import rope

CHOICE_FIELDS = ("flash_attn", "cache_type_k", "cache_type_v", "tool_dialect", "split_mode",
                 "load_mode", "lazy_mode", "reasoning_format", "reasoning", "reasoning_preserve",
                 "deterministic", "repack")
SPLIT_MODES = ("none", "layer", "row")  # llama.cpp's enum llama_split_mode, in order
LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")  # backend.placement's
LAZY_MODES = ("on", "auto", "off")  # likewise
REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")  # llama.cpp's names
WORDS = {"split_mode": SPLIT_MODES, "load_mode": LOAD_MODES, "lazy_mode": LAZY_MODES,
         "reasoning_format": REASONING_FORMATS, "reasoning": ("on", "off", "auto"),
         "reasoning_preserve": ("on", "off", ""), "deterministic": DETERMINISTIC,
         "repack": ("auto", "on", "off"), "spec_stop": ("auto", "off"),
         "rope_scaling": rope.SCALINGS, "numa": ("", "distribute", "isolate", "numactl")}
# llama.cpp's words for on, off and auto (common_arg_utils::is_truthy, is_falsey, is_autoy)
LLAMA_WORDS = {"enabled": "on", "true": "on", "1": "on", "disabled": "off", "false": "off",
               "0": "off", "-1": "auto"}
# the older spellings of --load-mode, (mmap, mlock) as --no-mmap and --mlock give them: llama-server
# took these before -lm, and its LLAMA_ARG_MMAP / LLAMA_ARG_MLOCK variables as well
OLD_LOAD_MODES = {(True, False): "auto", (False, False): "none", (True, True): "mmap+mlock",
                  (False, True): "mlock"}
_ON_OFF = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}


def coerce(name: str, value: Any, default: Any) -> Any:
    """What `value` (a flag's or a variable's text, or argparse's list) means for the Config
    field `name`, whose default is `default`; a ValueError that says what it takes."""
    if name == "n_gpu_layers" and str(value).strip().lower() in ("all", "auto"):
        # llama-server's words: all layers; auto: all where there is a device to offload to
        # (a CUDA build on a machine with no GPU visible has none)
        from backend.placement import offload_devices

        auto = str(value).strip().lower() == "auto"
        return -1 if not auto or offload_devices() else 0
    if name == "api_key":  # comma-separated, as llama-server takes it, or repeated
        items = value if isinstance(value, list) else [value]
        return tuple(k.strip() for item in items for k in str(item).split(",") if k.strip())
    if name in WORDS:
        choices = WORDS[name]
        v = str(value).strip().lower()
        v = LLAMA_WORDS.get(v, v) if name in ("reasoning", "reasoning_preserve", "repack") \
            else v
        if v not in choices:
            raise ValueError(f"one of {', '.join(c for c in choices if c)}")
        return v
    if name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                "frequency_penalty"):
        return None if value is None else float(value)
    if name == "top_k":
        return None if value is None else int(value)
    if name == "spec_draft_ngl":
        v = str(value).strip().lower()
        return v if v in ("auto", "all") else str(int(v))
    if name == "spec_type":
        from policies.speculate import parse_types

        return ",".join(parse_types(str(value))) or "none"
    if name == "chat_template_kwargs":
        import json

        if str(value).strip() and not isinstance(json.loads(value), dict):
            raise ValueError("a JSON object")
        return str(value).strip()
    if name in CHOICE_FIELDS:  # what the worker's engine accepts
        from backend.context import CACHE_TYPES, FLASH_ATTN  # llama_cpp: only when one is given

        choices = FLASH_ATTN if name == "flash_attn" else tuple(CACHE_TYPES)
        if name == "tool_dialect":
            from proxy.dialects import NAMES as choices
        v = str(value).strip().lower()
        v = _ON_OFF.get(v, v) if name == "flash_attn" else v
        if v not in choices and not (name == "tool_dialect" and not v):
            raise ValueError(f"one of {', '.join(choices)}")
        return v
    if isinstance(value, str):
        if isinstance(default, bool):
            return value.strip().lower() in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        if name == "worker_url":  # URLs hold no commas; regexes (one per line) may
            return tuple(u.strip() for u in value.split(",") if u.strip())
        if isinstance(default, tuple):
            return tuple(v for v in value.split("\n") if v)
    if name == "worker_url" and isinstance(value, list):
        return coerce(name, ",".join(value), default)
    if isinstance(default, tuple) and isinstance(value, list):
        return tuple(value)
    return value
