"""llama-server's command line and LLAMA_ARG_* variables, read as llama-server reads them, before
prefixgate's own argparse parser sees anything.

The option list is llama.cpp's own: `proxy/llama_options.json`, generated from the `common/arg.cpp`
of the llama.cpp that llama-cpp-python vendors (`python -m bench.llama_options`; a test checks it
against the sdist). The rules, as `common_params_parse_ex` has them:

- A spelling matches exactly (in a `--` spelling `_` reads as `-`): never abbreviated, and never a
  short option with its value glued on (`-mg 0` is llama-server's main GPU, not `-m g 0`;
  `-cmoe` is not `-c moe`; `-s 42` is the seed, whatever Python's argparse would make of it).
- An option that takes a value takes the next argv item, whatever it looks like (`--seed -1`).
  `--flag=value` is prefixgate's own form and works for every option that takes one value.
- Every spelling llama-server takes has one class:
  - **works**: prefixgate implements it; it is rewritten to prefixgate's flag for argparse;
  - **ignored**: accepted, it changes nothing here (prefixgate always serves /metrics, there is no
    web UI): one warning line names it and says why, and /props lists it (`Config.llama_notes`);
  - **refused**: the start stops with one line per such flag that names it and says why, and
    names no other flag and shows no value (a value may be a key).
  A spelling of another llama.cpp program (llama-cli's `-p`) is refused as not llama-server's.
- A spelling that is neither llama.cpp's nor prefixgate's stops the start as before ("not
  supported"); a value that follows no option is "a stray value".
- Variables: a LLAMA_ARG_* variable of an option that works becomes that option's PREFIXGATE_*
  variable unless that one is set (a flag wins over both); one of an ignored or refused option,
  or one llama.cpp does not know, is one warning each, and the start goes on (a container may
  inherit variables meant for another program).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy import rope, samplers

TABLE = Path(__file__).with_name("llama_options.json")


@dataclass(frozen=True, slots=True)
class Option:
    """One row of llama.cpp's option list (bench/llama_options.py describes the fields)."""

    args: tuple[str, ...]
    negs: tuple[str, ...]
    values: int  # argv items after it
    env: str | None
    server: bool  # llama-server takes it
    spec: bool  # one of llama.cpp's speculative-decoding options
    examples: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.args[0]


@functools.cache
def options() -> tuple[Option, ...]:
    rows = json.loads(TABLE.read_text())
    return tuple(Option(tuple(r["args"]), tuple(r["negs"]), r["values"], r["env"], r["server"],
                        r["spec"], tuple(r["examples"])) for r in rows)


@functools.cache
def spellings() -> dict[str, tuple[Option, bool]]:
    """Every spelling -> (its option, whether it is a positive spelling)."""
    out: dict[str, tuple[Option, bool]] = {}
    for o in options():
        out.update({a: (o, True) for a in o.args})
        out.update({a: (o, False) for a in o.negs})
    return out


# --- the classes -----------------------------------------------------------------------------

# works: llama.cpp's option (its first spelling) -> the Config field it sets, or a prefixgate flag;
# for one that takes no value, (field, the value its spelling gives, the value its negation
# gives), "" for a boolean field's own flag (`--swa-full`, `--no-swa-full`)
WORKS: dict[str, str | tuple[str, str, str]] = {
    "-h": "--help", "--version": "--version",
    "-m": "model", "-hf": "hf_repo", "-hff": "hf_file", "-a": "alias",
    "--spec-draft-hf": "hf_repo_draft", "-hft": "hf_token", "--offline": ("offline", "", ""),
    "--log-file": "log_file", "--sleep-idle-seconds": "sleep_idle_seconds",
    "--api-prefix": "api_prefix",
    "--host": "host", "--port": "port", "--api-key": "api_key", "--api-key-file": "api_keys",
    "--cors-origins": "cors_origins", "--cors-methods": "cors_methods",
    "--cors-headers": "cors_headers", "--cors-credentials": ("cors_credentials", "", ""),
    "--chat-template-file": "chat_template_file", "--chat-template": "chat_template",
    "-c": "n_ctx", "-np": "parallel", "-t": "threads", "-tb": "threads_batch",
    "-ngl": "n_gpu_layers", "-sm": "split_mode", "-ts": "tensor_split", "-ot": "override_tensor",
    "-dev": "device", "-mg": "main_gpu",
    "--override-kv": "override_kv",
    "-ncmoe": "n_cpu_moe", "-cmoe": ("n_cpu_moe", "-1", ""), "-lm": "load_mode",
    "-lzm": "lazy_mode", "-fa": "flash_attn", "-ctk": "cache_type_k", "-ctv": "cache_type_v",
    "--swa-full": ("swa_full", "", ""), "-kvo": ("kv_offload", "", ""), "-ub": "ubatch_size",
    "-cram": "cache_ram",
    "--sse-ping-interval": "ping_interval_s", "-v": ("log_level", "DEBUG", ""),
    # server-wide request defaults (proxy/defaults.py)
    "--temp": "temperature", "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p",
    "--repeat-penalty": "repeat_penalty", "--presence-penalty": "presence_penalty",
    "--frequency-penalty": "frequency_penalty", "-s": "seed", "-n": "n_predict",
    "--chat-template-kwargs": "chat_template_kwargs", "--reasoning-format": "reasoning_format",
    "-rea": "reasoning", "--reasoning-budget": "reasoning_budget",
    "--reasoning-budget-message": "reasoning_budget_message",
    "--reasoning-effort": "reasoning_effort",
    "--reasoning-preserve": ("reasoning_preserve", "on", "off"),
    "--repack": ("repack", "on", "off"),
    # llama-server's other samplers (proxy/samplers.py): --sampling NAME=VALUE
    **{flag: "sampling:" + name for flag, name in samplers.FLAGS.items()},
    # RoPE scaling (proxy/rope.py) and NUMA: prefixgate's flags are llama-server's
    **{"--" + f.replace("_", "-"): f for f in (*rope.FIELDS, "numa")},
    # speculative decoding (proxy/speculation.py)
    "--spec-type": "spec_type", "--spec-draft-model": "spec_draft_model",
    "--spec-draft-ngl": "spec_draft_ngl", "--spec-draft-n-max": "spec_draft_n_max",
    "--spec-draft-n-min": "spec_draft_n_min", "--spec-draft-p-min": "spec_draft_p_min",
    **{f"--spec-ngram-{t}-{k}": f"spec_ngram_{t.replace('-', '_')}_{k.replace('-', '_')}"
       for t in ("simple", "map-k", "map-k4v") for k in ("size-n", "size-m", "min-hits")},
    **{f"--spec-ngram-mod-{k}": f"spec_ngram_mod_{k.replace('-', '_')}"
       for k in ("n-min", "n-max", "n-match")},
}

# ignored: spellings accepted with no effect here -> why (one warning line each)
_NO_UI = "prefixgate has no web UI (/ is a status page)"
_NO_PROJECTOR = "no vision projector is loaded: images are not supported yet"
# a projector given: the model still serves, its images are placeholders (proxy/chat.py)
_PROJECTOR_GIVEN = ("no vision projector is loaded (images are not supported yet); an image "
                    "reaches the model as a text placeholder, said in its request's log line")
_OWN_CACHE = "prefixgate keeps and restores each prompt's states itself, exactly"
_IGNORED_GROUPS: dict[str, tuple[str, ...]] = {
    "prefixgate always renders the model's Jinja chat template": ("--jinja", "--no-jinja"),
    "prefixgate always serves this endpoint": ("--metrics", "--props", "--slots", "--no-slots"),
    _NO_UI: ("--ui", "--webui", "--no-ui", "--no-webui", "--ui-config", "--webui-config",
             "--ui-config-file", "--webui-config-file", "--ui-mcp-proxy", "--webui-mcp-proxy",
             "--no-ui-mcp-proxy", "--no-webui-mcp-proxy"),
    "prefill runs in batches of the physical batch size; the logical one changes nothing":
        ("-b", "--batch-size"),
    "slots are always batched together where that is exact":
        ("-cb", "--cont-batching", "-nocb", "--no-cont-batching"),
    "the start-up self-check runs the model before it serves": ("--warmup", "--no-warmup"),
    _OWN_CACHE + " (the prompt cache is always on)": ("--cache-prompt", "--no-cache-prompt"),
    _OWN_CACHE + " (never shifted chunks)": ("--cache-reuse",),
    _OWN_CACHE + " (at its own save points)": ("-ctxcp", "--ctx-checkpoints",
                                               "--swa-checkpoints", "-cms",
                                               "--checkpoint-min-step"),
    _OWN_CACHE + " (a slot's state that gives way goes to the RAM tier)":
        ("--cache-idle-slots", "--no-cache-idle-slots"),
    "prefixgate lays out the slots' KV memory itself": ("-kvu", "--kv-unified", "-no-kvu",
                                                        "--no-kv-unified",
                                                        "--kv-unified-per-slot"),
    _OWN_CACHE + " (every state is kept on disk and found by its prefix; POST /slots save "
    "and restore by file name are not served)": ("--slot-save-path",),
    "a slot is chosen by the longest prefix it shares with the prompt":
        ("-sps", "--slot-prompt-similarity"),
    "the context is never shifted: a prompt longer than a slot is refused":
        ("--no-context-shift", "--keep"),
    "CPU affinity, priority and polling are left to the operating system":
        ("-C", "--cpu-mask", "-Cr", "--cpu-range", "--cpu-strict", "--prio", "--poll", "-Cb",
         "--cpu-mask-batch", "-Crb", "--cpu-range-batch", "--cpu-strict-batch", "--prio-batch",
         "--poll-batch"),
    "prefixgate's workers choose how weights and buffers are laid out": (
        "--no-host", "--op-offload",
        "--no-op-offload", "-bs", "--backend-sampling", "--check-tensors"),
    "the context and layers are as given, not fitted to free memory":
        ("-fit", "--fit", "-fitt", "--fit-target", "-fitc", "--fit-ctx"),
    "deprecated in llama.cpp too; nothing to do": ("-dt", "--defrag-thold"),
    _PROJECTOR_GIVEN: ("-mm", "--mmproj", "-mmu", "--mmproj-url", "--media-path"),
    _NO_PROJECTOR: ("--mmproj-auto", "--no-mmproj", "--no-mmproj-auto", "--mmproj-offload",
                    "--no-mmproj-offload", "-mmdev", "--mmproj-device", "--image-min-tokens",
                    "--image-max-tokens", "--mtmd-batch-max-tokens", "--video-fps",
                    "--video-timestamp-interval", "--video-ffmpeg-dir"),
    "prefixgate's connections wait as long as a request runs": ("-to", "--timeout",
                                                                "--threads-http"),
    "prefixgate logs plain lines to stderr (its own level flag sets how many)": (
        "--perf", "--no-perf", "--log-disable", "--log-colors", "--log-prefix", "--no-log-prefix",
        "--log-timestamps", "--no-log-timestamps", "--no-log-jsonl", "-lv", "--verbosity",
        "--log-verbosity"),
    "a request's text is taken as sent (escapes are the client's)": ("-e", "--escape",
                                                                     "--no-escape"),
    "prefixgate's listening socket is its own": ("--reuse-port",),
    "stop strings come with each request": ("-r", "--reverse-prompt"),
    "a final assistant message is continued on the Anthropic API, as that API defines":
        ("--prefill-assistant", "--no-prefill-assistant"),
    "the model's output is always parsed into text, reasoning and tool calls":
        ("--no-skip-chat-parsing",),
    "there is no built-in agent, tools or MCP to turn off": ("-no-ag", "--no-agent"),
    "one model is served, always loaded": ("--no-models-autoload",),
    "model tags are not shown": ("--tags",),
    "no /infill endpoint is served": ("--spm-infill",),
}
IGNORED: dict[str, str] = {s: why for why, group in _IGNORED_GROUPS.items() for s in group}
# ignored options, every spelling of each (by its first): a draft model's settings, with no
# draft model (-md is refused)
IGNORED_OPTIONS: dict[str, str] = dict.fromkeys((
    "--spec-draft-threads", "--spec-draft-threads-batch", "--spec-draft-cpu-mask",
    "--spec-draft-cpu-range", "--spec-draft-cpu-strict", "--spec-draft-prio",
    "--spec-draft-poll", "--spec-draft-cpu-mask-batch", "--spec-draft-cpu-strict-batch",
    "--spec-draft-prio-batch", "--spec-draft-poll-batch", "--spec-draft-type-k",
    "--spec-draft-type-v", "--spec-draft-override-tensor", "--spec-draft-cpu-moe",
    "--spec-draft-n-cpu-moe", "--spec-draft-p-split", "--spec-draft-backend-sampling",
    "--spec-draft-device"),
    "the draft model runs with the model's own threads, placement and KV types, and drafts "
    "greedily")

# refused: llama.cpp's option (its first spelling, or one spelling of it) -> why the start stops
_SPEC = "this speculative decoding option is not supported (prompt-lookup n-gram drafts are)"
_REFUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "the built-in model presets are not supported: give the model and draft model files": (
        "--spec-default", "--fim-qwen-7b-spec", "--fim-qwen-14b-spec"),
    "the ngram-cache type's lookup files are not supported": ("-lcs", "-lcd"),
    "synthetic acceptance (a benchmarking aid) is not supported": ("--spec-synth-len",
                                                                   "--spec-synth-rates"),
    "removed in llama.cpp too (llama-server refuses it)": (
        "--draft", "--draft-min", "--spec-ngram-size-n", "--spec-ngram-size-m",
        "--spec-ngram-min-hits"),
    "a server-wide grammar is not supported (a request's response_format is)":
        ("--grammar", "--grammar-file", "-j", "-jf"),
    "LoRA adapters are not supported yet": ("--lora", "--lora-scaled",
                                            "--lora-init-without-apply"),
    "control vectors are not supported yet": ("--control-vector", "--control-vector-scaled",
                                              "--control-vector-layer-range"),
    "keeping dense FFN layers on the CPU is not supported yet": ("-ncffn",),
    "RPC devices are not supported": ("--rpc",),
    "listing devices is the doctor command's (prefixgate doctor)": ("--list-devices",),
    "downloading a model by URL or from a registry other than Hugging Face is not supported "
    "yet": ("-mu", "-dr"),
    "the model cache of llama.cpp is not prefixgate's (the Hugging Face cache is)": ("-cl",),
    "shell completion is not supported": ("--completion-bash",),
    "showing special tokens in the output is not supported": ("-sp",),
    "context shift is not supported: a prompt longer than a slot is refused":
        ("--context-shift",),
    "embeddings and reranking are not served": ("--embedding", "--rerank", "--pooling",
                                                "--embd-normalize"),
    "TLS is not supported: put a TLS-terminating proxy in front": ("--ssl-key-file",
                                                                   "--ssl-cert-file"),
    "serving static files is not supported": ("--path",),
    "the server's built-in tools, agent and MCP servers are not supported": (
        "--tools", "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json", "-ag"),
    "serving several models (router mode) is not supported": (
        "--models-dir", "--models-preset", "--models-max", "--models-autoload"),
    "returning the model's output unparsed is not supported yet": ("--skip-chat-parsing",),
    "logging as JSON or each prompt to a file is not supported (prefixgate logs plain "
    "lines)": ("--log-jsonl", "--log-prompts-dir"),
    "the built-in model presets are not supported: give the model file or repository": (
        "--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default",
        "--fim-qwen-7b-default", "--fim-qwen-30b-default", "--gpt-oss-20b-default",
        "--gpt-oss-120b-default", "--vision-gemma-4b-default", "--vision-gemma-12b-default"),
}
REFUSED: dict[str, str] = {o: why for why, group in _REFUSED_GROUPS.items() for o in group}
NOT_SERVER = "not a llama-server option (llama.cpp's {})"


def classify(spelling: str) -> tuple[str, str]:
    """(class, why) of one of llama.cpp's spellings: ("works", ""), ("ignored", why) or
    ("refused", why). A spelling of llama-server's that is in no class is an AssertionError (a
    new llama.cpp: give it one)."""
    o, _ = spellings()[spelling]
    if not o.server:
        return "refused", NOT_SERVER.format(", ".join(e for e in o.examples if e != "common"))
    if spelling in IGNORED:
        return "ignored", IGNORED[spelling]
    if o.name in IGNORED_OPTIONS:
        return "ignored", IGNORED_OPTIONS[o.name]
    if o.name in WORKS:
        return "works", ""
    if spelling in REFUSED or o.name in REFUSED:
        return "refused", REFUSED.get(spelling) or REFUSED[o.name]
    if o.spec:
        return "refused", _SPEC
    raise AssertionError(f"llama-server's {spelling} has no class here")


# --- the scan --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scan:
    argv: list[str]  # for prefixgate's argparse parser
    notes: list[str]  # one warning line each: what was accepted and does nothing
    errors: list[str]  # one line each: what stops the start


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _works(spelling: str, o: Option, positive: bool, value: str | None) -> list[str]:
    target = WORKS[o.name]
    if isinstance(target, tuple):
        field, on, off = target
        fixed = on if positive else off
        return [f"{_flag(field)}={fixed}"] if fixed else [_flag(field) if positive
                                                          else "--no-" + _flag(field)[2:]]
    if target.startswith("sampling:"):
        return [f"--sampling={target[9:]}={value if o.values else 'true'}"]
    if target.startswith("--"):
        return [target]
    return [f"{_flag(target)}={value}"] if o.values else [_flag(target)]


def scan(argv: list[str], parser: argparse.ArgumentParser) -> Scan:
    """llama-server's reading of `argv`, turned into prefixgate's (see the module's rules)."""
    own = parser._option_string_actions  # prefixgate's own spellings -> their actions
    table = spellings()
    out: list[str] = []
    notes: list[str] = []
    errors: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        key = token.replace("_", "-") if token.startswith("--") else token
        head, eq, inline = key.partition("=") if key.startswith("--") else (key, "", "")
        i += 1
        if key in table or (eq and head in table):
            o, positive = table[key] if key in table else table[head]
            name = key if key in table else head
            n = 0 if eq else o.values
            if len(argv) - i < n:
                errors.append(f"{name}: expects {'a value' if n == 1 else f'{n} values'}")
                break
            values, i = argv[i:i + n], i + n
            if eq and o.values != 1:
                errors.append(f"{name}: takes {'no value' if not o.values else 'two values'}")
                continue
            kind, why = classify(name)
            if kind == "works":
                out += _works(name, o, positive, inline if eq else (values or [None])[0])
            elif kind == "ignored":
                notes.append(f"{name}: accepted for llama-server's command line, no effect "
                             f"here: {why}")
            else:
                errors.append(f"{name}: {why}")
        elif head in own:
            action = own[head]
            if eq or action.nargs == 0 or i >= len(argv):
                out.append(token)
            else:
                out.append(f"{head}={argv[i]}")
                i += 1
        elif token.startswith("-") and not _is_number(token):
            unknown.append(head)
        else:
            unknown.append("a stray value")
    if unknown:
        errors.append(f"not supported: {' '.join(dict.fromkeys(unknown))} (`prefixgate --help` "
                      "lists the flags, llama-server's among them)")
    return Scan(out, notes, errors)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def scan_env(environ: Mapping[str, str], reads: set[str]) -> tuple[dict[str, str], list[str]]:
    """llama-server's variables in `environ`: those of options that work become their
    PREFIXGATE_* variable where that is not set (`reads`: the LLAMA_* variables prefixgate reads
    itself, kept as they are); the others are a warning each. Returns (environ, warnings)."""
    env = dict(environ)
    notes: list[str] = []
    by_env: dict[str, tuple[Option, bool]] = {}
    for o in options():
        if o.env:
            by_env[o.env] = (o, True)
            if o.negs:
                by_env[o.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_")] = (o, False)
    for var in sorted(environ):
        if var in reads or not (var.startswith("LLAMA_ARG_") or var in by_env):
            continue
        if var not in by_env:
            if var.startswith("LLAMA_ARG_"):
                notes.append(f"{var} is not a llama-server variable; ignored")
            continue
        o, positive = by_env[var]
        name = o.name if positive else o.negs[0]
        kind, why = classify(name)
        if kind != "works":
            notes.append(f"{var} ({name}) is ignored: {why}")
            continue
        target = WORKS[o.name]
        value: str | None = environ[var]
        if isinstance(target, tuple):  # llama.cpp: a flag's variable counts when it is truthy
            if value.strip().lower() not in ("1", "true", "on", "yes", "enabled"):
                continue
            field, on, off = target
            value = (on if positive else off) or ("1" if positive else "0")
            target = field
        if not target.startswith("--"):
            env.setdefault("PREFIXGATE_" + target.upper(), value)
    return env, notes


def describe() -> dict[str, Any]:
    """Each class's spellings, for docs/llama-server.md and /props."""
    out: dict[str, Any] = {"works": [], "ignored": {}, "refused": {}}
    for s, (o, _) in spellings().items():
        if not o.server:
            continue
        kind, why = classify(s)
        if kind == "works":
            out["works"].append(s)
        else:
            out[kind][s] = why
    return out
