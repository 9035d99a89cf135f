"""The words of each Config flag: its help line, and llama-server's names for the same setting
(its short and long flags beside prefixgate's own, and its LLAMA_ARG_* variable, read after
prefixgate's PREFIXGATE_* one); and the volatile patterns' defaults. A default stated in a help
line is the one the Config resolves (tests/proxy/test_llama_options.py checks each).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from policies.prefix import CPU_BATCH, GPU_BATCH
from proxy import rope

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


HELP = {
    "host": "listen address", "port": "listen port", "model": "GGUF model path",
    "hf_repo": "a Hugging Face repository's GGUF instead of --model: user/model[:quant] "
               "(no quant: Q4_K_M, else Q8_0, else the first model file; every part of a split "
               "model), through the Hugging Face cache (HF_HUB_OFFLINE=1: only the cache)",
    "hf_file": "the GGUF file in the --hf-repo repository (default: picked by the quant)",
    "hf_repo_draft": "the draft model's Hugging Face repository, user/model[:quant], as "
                     "--hf-repo (--spec-draft-model then names the file in it)",
    "hf_token": "the Hugging Face token for --hf-repo and --hf-repo-draft (default: HF_TOKEN, "
                "else huggingface_hub's stored login)",
    "offline": "take --hf-repo and --hf-repo-draft from the Hugging Face cache only, as "
               "HF_HUB_OFFLINE=1: nothing is fetched",
    "log_file": "also append every log line to this file",
    "api_prefix": "serve every endpoint below this path, e.g. /llama (/llama/v1/chat/"
                  "completions), for a reverse proxy that forwards one",
    "sleep_idle_seconds": "after this many seconds with no request the workers leave memory "
                          "(the model and its KV) until the next request loads them again; "
                          "what the cache wrote to disk stays (-1: never)",
    "chat_template_file": "a Jinja chat template file used instead of the model's own",
    "chat_template": "a Jinja chat template's source used instead of the model's own (chatml: "
                     "ChatML)",
    "tool_dialect": "tool-call format: harmony | minimax | kimi | deepseek | glm | qwen3_coder | "
                    "mistral | hermes (default: found from the chat template)",
    "workers": "worker processes",
    "n_ctx": "context tokens per worker, shared among its --parallel slots (0 = the model's "
             "trained context)",
    "threads": "CPU threads per worker (0 = one per physical core, less one where no SMT "
               "sibling is shown; -1 = every core)",
    "n_gpu_layers": "layers on the GPU: N, all, or auto (the default: all where this build "
                    "can offload, CUDA or Metal; none on a CPU-only build)",
    "flash_attn": "flash attention: on | off | auto",
    "cache_type_k": "K cache type: f16 | q8_0 | q4_0 | ... (llama.cpp's -ctk)",
    "cache_type_v": "V cache type (llama.cpp's -ctv; quantized needs --flash-attn on)",
    "swa_full": "sliding-window models: a full-size cache (exact reuse) instead of a real window",
    "kv_offload": "the KV cache on the GPU with its layers (--no-kv-offload: in host RAM, as "
                  "llama-server's -nkvo)",
    "ubatch_size": f"tokens per prefill batch and the reuse granularity (0 = {GPU_BATCH} on a "
                   f"GPU, else {CPU_BATCH} or {GPU_BATCH}, measured once)",
    "exact_check": "at start, prove that a cache hit answers exactly as a cold run (off: skip)",
    "disk_prefix_cache": "off | full | auto | auto:N | N",
    "volatile_patterns": "regex of volatile bytes to strip (repeatable)",
    "volatile_blocks": "regex of a volatile system-prompt block to move behind the stable part "
                       "(repeatable)",
    "stable_layout": "tools before system text, volatile blocks moved behind the stable part",
    "limits": "a request bound NAME=VALUE, e.g. max_messages=50000 (repeatable; env: one per "
              "line)",
    "worker_url": "URL of a remote worker instead of --workers (repeatable; env comma-separated)",
    "api_key": "an accepted API key (repeatable or comma-separated; with --api-keys FILE too)",
    "api_keys": "file of accepted API keys, one per line",
    "alias": "the model id in responses and /v1/models",
    "cors_origins": "browser pages that may call the API from another origin: localhost, * "
                    "(any), or a comma-separated list of origins; empty: none",
    "cors_methods": "the methods a cross-origin page may use (a preflight's answer)",
    "cors_headers": "the headers a cross-origin page may send (*: those it asks for)",
    "cors_credentials": "whether a cross-origin page may send cookies and Authorization",
    "threads_batch": "CPU threads per worker for prefill (0 = all cores)",
    "split_mode": "how to split the model across GPUs: layer | row | none",
    "tensor_split": "proportions of the model per GPU, e.g. 3,1",
    "device": "the GPUs to offload to, by name: CUDA0,CUDA1 (none: the CPU only; "
              "`prefixgate doctor` lists them)",
    "main_gpu": "with -sm none, the GPU (of those -dev names) that holds the model (-1: "
                "none); with -sm row, the one for intermediate results and the KV",
    "override_tensor": "tensor buffer overrides PATTERN=BUFFER,... (llama.cpp's -ot)",
    "override_kv": "the model's metadata changed, KEY=TYPE:VALUE,... (TYPE int, float, bool or "
                   "str; given again: more)",
    "n_cpu_moe": "keep the MoE experts of the first N layers on the CPU (-1: every layer, "
                 "llama-server's -cmoe)",
    "load_mode": "how the weights are read: auto (mapped) | none (read) | mmap | mlock (read "
                 "and locked in RAM) | mmap+mlock | dio (direct I/O); --mlock and --no-mmap "
                 "are older spellings",
    "lazy_mode": "read the rows of tensors the architecture marks (per-layer embeddings) from "
                 "the mapped file on demand: on | auto (tensors over 4 GiB) | off",
    "parallel": "slots per worker: sessions served at once from one model copy, sharing "
                "-c (llama-server's -np)",
    "shared_tier": "redis://HOST:PORT of a Redis or Valkey shared by several prefixgate hosts: "
                   "snapshots are published there and pulled by a host that misses locally "
                   "(bound it with Redis's maxmemory and an LRU policy)",
    "kv_events": "tcp://HOST:PORT: publish this host's KV events there (ZMQ, vLLM's shape) "
                 "for a KV-aware router, NVIDIA Dynamo's (>tcp://HOST:PORT: connect to a "
                 "subscriber, llm-d's)",
    "kv_events_topic": "the KV events' ZMQ topic (llm-d: kv@POD@MODEL)",
    "kv_block_size": "tokens per block in the KV events (the router's block size)",
    "cache_ram": "MiB of host RAM for live states that gave way, restored before the disk "
                 "(-1 no limit, 0 off)",
    "shared_tier_secret": "a secret the team's hosts share: what a host pulls from the shared "
                          "tier is authenticated with it (give it by the variable: a flag "
                          "shows in ps)",
    "repack": "weights repacked for the CPU's kernels (llama.cpp's extra buffer types): "
              "--repack, -nr/--no-repack as llama-server spells them; by default on, except "
              "on a CPU with AMX, whose llama.cpp kernels crash on some machines (auto)",
    "rope_scaling": "RoPE frequency scaling: none | linear | yarn (default: the model's)",
    "rope_scale": "RoPE context scaling factor N: a context N times the trained one "
                  "(--rope-freq-scale 1/N; default: the model's)",
    "rope_freq_base": "RoPE base frequency (0 = the model's)",
    "rope_freq_scale": "RoPE frequency scaling factor: a context 1/N times the trained one "
                       "(0 = the model's)",
    "yarn_orig_ctx": "YaRN: the model's original context (0 = the one it was trained with)",
    "yarn_ext_factor": "YaRN: extrapolation mix factor (-1 = the model's or llama.cpp's)",
    "yarn_attn_factor": "YaRN: attention magnitude scale (-1 = the model's or llama.cpp's)",
    "yarn_beta_slow": "YaRN: high correction dim or alpha (-1 = the model's or llama.cpp's)",
    "yarn_beta_fast": "YaRN: low correction dim or beta (-1 = the model's or llama.cpp's)",
    "numa": "NUMA placement of the compute threads: distribute | isolate | numactl (default: "
            "none), as llama-server's --numa",
    "deterministic": "auto | on | off: on keeps each slot's answer what it is alone whatever "
                     "other sessions generate, at a cost; off batches their decode steps as "
                     "llama-server does; auto: independent where the start-up check proves it "
                     "cheap, else batched (a cache hit is exact in every mode)",
    "spec_type": "speculative decoding: none, or llama.cpp's n-gram types ngram-simple | "
                 "ngram-map-k | ngram-map-k4v | ngram-mod, comma-separated (tried in that order); "
                 "greedy answers can differ from none's, a cache hit answers as its cold run",
    "spec_stop": "auto | off: auto verifies a slot's drafts where they pay (the verify cost the "
                 "worker measured at start, the slot's acceptance); off verifies every draft, "
                 "as llama-server does",
    **{f"spec_ngram_{t}_{k}": f"{t.replace('_', '-')}: " + {
        "size_n": "n-gram size N looked up", "size_m": "m-gram size M drafted",
        "min_hits": "least hits of a key before its m-grams are drafted"}[k]
       for t in ("simple", "map_k", "map_k4v") for k in ("size_n", "size_m", "min_hits")},
    "spec_draft_model": "a draft model's GGUF, of the model's vocabulary: --spec-type "
                        "draft-simple (-md alone means it)",
    "spec_draft_ngl": "the draft model's layers on the GPU: N, all, or auto (as -ngl)",
    "spec_draft_n_max": "draft-simple: most tokens of a draft",
    "spec_draft_n_min": "draft-simple: least tokens of a draft",
    "spec_draft_p_min": "draft-simple: least probability of a drafted token (0: greedy)",
    "spec_ngram_mod_n_match": "ngram-mod: lookup length",
    "spec_ngram_mod_n_min": "ngram-mod: least tokens of a draft",
    "spec_ngram_mod_n_max": "ngram-mod: most tokens of a draft",
    "temperature": "default temperature of a request that sets none (unset: the model's "
                   "general.sampling.temp, else 0.8)",
    "top_k": "default top-k (unset: the model's general.sampling.top_k, else 40)",
    "top_p": "default top-p (unset: the model's general.sampling.top_p, else 0.95)",
    "min_p": "default min-p (unset: the model's general.sampling.min_p, else 0.05)",
    "repeat_penalty": "default repetition penalty (unset: the model's "
                      "general.sampling.penalty_repeat, else 1.0, off)",
    "presence_penalty": "default presence penalty (unset: 0.0, off)",
    "frequency_penalty": "default frequency penalty (unset: 0.0, off)",
    "seed": "default seed of a request that sets none (-1: random)",
    "sampling": "a default of llama-server's other samplers, NAME=VALUE, e.g. typical_p=0.9, "
                "samplers=top_k;temperature, dry_multiplier=0.8, logit_bias=15043+1, "
                "ignore_eos=true (repeatable; env: one per line)",
    "n_predict": "tokens generated at most when a request sets no maximum (-1: to the "
                 "context's end)",
    "chat_template_kwargs": "a JSON object of chat template variables, under a request's own "
                            "chat_template_kwargs",
    "reasoning_format": "where reasoning goes in OpenAI answers: auto | deepseek (in "
                        "reasoning_content) | deepseek-legacy (also in the content, in <think> "
                        "tags) | none (in the content)",
    "reasoning": "thinking of templates that have the switch: on | off | auto (the template's "
                 "default); a request's own setting wins",
    "reasoning_budget": "thinking tokens at most, then the end of thinking is forced: -1 no "
                        "limit, 0 at once (a request's reasoning_budget_tokens wins)",
    "reasoning_budget_message": "text forced before the end of thinking when the budget is "
                                "spent",
    "reasoning_effort": "default reasoning_effort template variable (gpt-oss: low | medium | "
                        "high)",
    "reasoning_preserve": "the preserve_reasoning template variable: on | off (unset: the "
                          "template's default)",
}


# llama-server's names for the same settings, so its command line works unchanged: its short
# and long flags beside prefixgate's own, and its LLAMA_ARG_* variable (read after prefixgate's
# PREFIXGATE_* one).
LLAMA_SERVER: dict[str, tuple[tuple[str, ...], str]] = {
    "host": ((), "LLAMA_ARG_HOST"),
    "port": ((), "LLAMA_ARG_PORT"),
    "model": (("-m",), "LLAMA_ARG_MODEL"),
    "hf_repo": (("-hf", "-hfr"), "LLAMA_ARG_HF_REPO"),
    "hf_file": (("-hff",), "LLAMA_ARG_HF_FILE"),
    "hf_repo_draft": (("-hfd", "-hfrd"), "LLAMA_ARG_SPEC_DRAFT_HF_REPO"),
    "hf_token": (("-hft",), "HF_TOKEN"),
    "offline": ((), "LLAMA_ARG_OFFLINE"),
    "log_file": ((), "LLAMA_ARG_LOG_FILE"),
    "api_prefix": ((), "LLAMA_ARG_API_PREFIX"),
    "alias": (("-a",), "LLAMA_ARG_ALIAS"),
    "cors_origins": ((), "LLAMA_ARG_CORS_ORIGINS"),
    "cors_methods": ((), "LLAMA_ARG_CORS_METHODS"),
    "cors_headers": ((), "LLAMA_ARG_CORS_HEADERS"),
    "cors_credentials": ((), "LLAMA_ARG_CORS_CREDENTIALS"),
    "chat_template_file": ((), "LLAMA_ARG_CHAT_TEMPLATE_FILE"),
    "chat_template": ((), "LLAMA_ARG_CHAT_TEMPLATE"),
    "n_ctx": (("-c", "--ctx-size"), "LLAMA_ARG_CTX_SIZE"),
    "threads": (("-t",), "LLAMA_ARG_THREADS"),
    "threads_batch": (("-tb",), "LLAMA_ARG_THREADS_BATCH"),
    "n_gpu_layers": (("-ngl", "--gpu-layers"), "LLAMA_ARG_N_GPU_LAYERS"),
    "split_mode": (("-sm",), "LLAMA_ARG_SPLIT_MODE"),
    "tensor_split": (("-ts",), "LLAMA_ARG_TENSOR_SPLIT"),
    "device": (("-dev",), "LLAMA_ARG_DEVICE"),
    "main_gpu": (("-mg",), "LLAMA_ARG_MAIN_GPU"),
    "override_tensor": (("-ot",), "LLAMA_ARG_OVERRIDE_TENSOR"),
    "n_cpu_moe": (("-ncmoe",), "LLAMA_ARG_N_CPU_MOE"),
    "flash_attn": (("-fa",), "LLAMA_ARG_FLASH_ATTN"),
    "cache_type_k": (("-ctk",), "LLAMA_ARG_CACHE_TYPE_K"),
    "cache_type_v": (("-ctv",), "LLAMA_ARG_CACHE_TYPE_V"),
    "ubatch_size": (("-ub",), "LLAMA_ARG_UBATCH"),
    "parallel": (("-np",), "LLAMA_ARG_N_PARALLEL"),
    "cache_ram": (("-cram",), "LLAMA_ARG_CACHE_RAM"),
    "load_mode": (("-lm",), "LLAMA_ARG_LOAD_MODE"),
    "lazy_mode": (("-lzm",), "LLAMA_ARG_LAZY_MODE"),
    "api_key": ((), "LLAMA_API_KEY"),
    "api_keys": (("--api-key-file",), "LLAMA_ARG_API_KEY_FILE"),
    "temperature": (("--temp",), "LLAMA_ARG_TEMPERATURE"),
    "top_k": ((), "LLAMA_ARG_TOP_K"),
    "top_p": ((), "LLAMA_ARG_TOP_P"),
    "min_p": ((), "LLAMA_ARG_MIN_P"),
    "repeat_penalty": ((), "LLAMA_ARG_REPEAT_PENALTY"),
    "presence_penalty": ((), "LLAMA_ARG_PRESENCE_PENALTY"),
    "frequency_penalty": ((), "LLAMA_ARG_FREQUENCY_PENALTY"),
    "seed": (("-s",), ""),
    "n_predict": (("-n", "--predict"), "LLAMA_ARG_N_PREDICT"),
    "chat_template_kwargs": ((), "LLAMA_ARG_CHAT_TEMPLATE_KWARGS"),
    "reasoning_format": ((), "LLAMA_ARG_THINK"),
    "reasoning": (("-rea",), "LLAMA_ARG_REASONING"),
    "reasoning_budget": ((), "LLAMA_ARG_THINK_BUDGET"),
    "reasoning_budget_message": ((), "LLAMA_ARG_THINK_BUDGET_MESSAGE"),
    "reasoning_effort": ((), "LLAMA_ARG_REASONING_EFFORT"),
    "ping_interval_s": (("--sse-ping-interval",), "LLAMA_ARG_SSE_PING_INTERVAL"),
    **{k: ((), "LLAMA_ARG_" + k.upper()) for k in (*rope.FIELDS, "numa")},
    "rope_scaling": ((), "LLAMA_ARG_ROPE_SCALING_TYPE"),  # llama.cpp's one other name
    "spec_type": ((), "LLAMA_ARG_SPEC_TYPE"),
    "spec_draft_model": (("-md", "--model-draft"), "LLAMA_ARG_SPEC_DRAFT_MODEL"),
    "spec_draft_ngl": (("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"),
                       "LLAMA_ARG_N_GPU_LAYERS_DRAFT"),
    "spec_draft_n_max": ((), "LLAMA_ARG_SPEC_DRAFT_N_MAX"),
    "spec_draft_n_min": ((), "LLAMA_ARG_SPEC_DRAFT_N_MIN"),
    "spec_draft_p_min": (("--draft-p-min",), "LLAMA_ARG_SPEC_DRAFT_P_MIN"),
}


class Accumulate(argparse.Action):
    """A flag that llama.cpp takes again and again, each time adding to what it said before
    (`-ot A=CPU -ot B=CUDA0` keeps both overrides; `--chat-template-kwargs` merges its JSON
    objects; `-a` names more aliases): joined with commas, as one `-ot A,B` or `-a x,y` means;
    JSON objects merged, the later key winning. (argparse's own store would keep the last one
    and drop the rest unsaid.)"""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        before, value = getattr(namespace, self.dest, None), str(values)
        if before is not None and value:
            value = _merged(before, value) if self.dest == "chat_template_kwargs" \
                else f"{before},{value}"
        setattr(namespace, self.dest, value or before)


ACCUMULATE = ("override_tensor", "override_kv", "chat_template_kwargs", "alias")


def _merged(before: str, value: str) -> str:
    """Two JSON objects merged; where one is not a JSON object, the first such is kept (the
    Config's check says it)."""
    a, b = _object(before), _object(value)
    if a is None:
        return before
    if b is None:
        return value
    return json.dumps({**a, **b}, ensure_ascii=False)


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
