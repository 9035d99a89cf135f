"""llama-server's samplers past the common seven, as a request's fields and the command line
choose them (the worker draws with them: backend/sampling.py).

    parse(body) -> dict            a request's fields, each checked (BadRequest naming it)
    from_items(items) -> dict      `--sampling NAME=VALUE` items, ValueError in one line;
                                   llama-server's flags (`--typical 0.9`, `--samplers
                                   "top_k;temperature"`, `-l 15043+1`, `--ignore-eos`...) become
                                   these (proxy/llama_cli.py)
    resolve(sampling, encode, decode) -> dict    logit biases by text, as token ids
    resolve_budget(sampling, start, ends, generation_prompt, encode) -> dict    a reasoning
                                   budget as token ids
    refuse_unsupported(body)       what a request asks that prefixgate does not do: a 400

The names are llama-server's request fields and `backend.sampling.Sampling`'s; the bounds are
llama-server's schema's (tools/server/server-schema.cpp), with one difference: a value out of
them is a 400 that names it, where llama-server clamps it or falls back to its default without a
word. `samplers` takes names (a list, or `;`-separated on the command line) or llama.cpp's
characters (`kypmt`), and a name llama.cpp does not know is refused, where llama-server drops it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from proxy.errors import BadRequest

# name -> (int or float, lowest, highest)
NUMBERS: dict[str, tuple[type, float, float]] = {
    "repeat_last_n": (int, 0, 2**31 - 1),
    "typical_p": (float, 0.0, 1.0),
    "top_n_sigma": (float, -1.0, 100.0),
    "xtc_probability": (float, 0.0, 1.0),
    "xtc_threshold": (float, 0.0, 1.0),
    "dry_multiplier": (float, 0.0, 100.0),
    "dry_base": (float, 1.0, 100.0),
    "dry_allowed_length": (int, 0, 2**31 - 1),
    "dry_penalty_last_n": (int, 0, 2**31 - 1),
    "dynatemp_range": (float, 0.0, 100.0),
    "dynatemp_exponent": (float, 0.0, 100.0),
    "mirostat": (int, 0, 2),
    "mirostat_tau": (float, 0.0, 100.0),
    "mirostat_eta": (float, 0.0, 1.0),
    "adaptive_target": (float, -1.0, 1.0),
    "adaptive_decay": (float, 0.0, 0.99),
    "min_keep": (int, 0, 2**31 - 1),
}
FIELDS = (*NUMBERS, "samplers", "dry_sequence_breakers", "logit_bias", "ignore_eos")

# llama.cpp's sampler names (common_sampler_types_from_names), the first nine its default order,
# and their characters (common_sampler_type_to_chr)
CANONICAL = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
             "temperature", "infill", "adaptive_p")
ORDER = CANONICAL[:9]
CHARS = dict(zip("edskypmxtia", CANONICAL, strict=True))
ALIASES = {**{n: n for n in CANONICAL}, **{n.replace("_", "-"): n for n in CANONICAL},
           **{n.replace("_", ""): n for n in CANONICAL}, "nucleus": "top_p",
           "temp": "temperature", "typ": "typ_p"}

# what llama-server's own flags set (proxy/llama_cli.py rewrites them to --sampling NAME=VALUE)
FLAGS = {"--top-nsigma": "top_n_sigma", "--xtc-probability": "xtc_probability",
         "--xtc-threshold": "xtc_threshold", "--typical": "typical_p",
         "--repeat-last-n": "repeat_last_n", "--dry-multiplier": "dry_multiplier",
         "--dry-base": "dry_base", "--dry-allowed-length": "dry_allowed_length",
         "--dry-penalty-last-n": "dry_penalty_last_n",
         "--dry-sequence-breaker": "dry_sequence_breaker", "--adaptive-target": "adaptive_target",
         "--adaptive-decay": "adaptive_decay", "--dynatemp-range": "dynatemp_range",
         "--dynatemp-exp": "dynatemp_exponent", "--mirostat": "mirostat",
         "--mirostat-lr": "mirostat_eta", "--mirostat-ent": "mirostat_tau",
         "--samplers": "samplers", "--sampler-seq": "sampler_seq", "--ignore-eos": "ignore_eos",
         "-l": "logit_bias"}


def sampler_names(value: Any) -> tuple[str, ...]:
    """A sampler chain's order: a list of names, or a string of llama.cpp's characters
    (`--sampler-seq`); ValueError naming what is not one."""
    if isinstance(value, str):
        bad = [c for c in value if c not in CHARS]
        if bad:
            raise ValueError(f"{''.join(bad)!r}: not one of llama.cpp's sampler characters "
                             f"({''.join(CHARS)})")
        return tuple(CHARS[c] for c in value)
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ValueError("a list of sampler names, or a string of their characters")
    bad = [n for n in value if n.lower() not in ALIASES]
    if bad:
        raise ValueError(f"{', '.join(map(repr, bad))}: not a sampler (one of "
                         f"{', '.join(CANONICAL)})")
    return tuple(ALIASES[n.lower()] for n in value)


def _number(name: str, v: Any) -> int | float:
    kind, lo, hi = NUMBERS[name]
    if isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and
                                                                 not isinstance(v, int)):
        raise ValueError(f"must be {'an integer' if kind is int else 'a number'}")
    if not lo <= v <= hi:
        raise ValueError(f"must be between {lo} and {hi}, got {v}")
    return int(v) if kind is int else float(v)


def _bias_value(v: Any) -> float | None:
    """A bias: a number, or false for -inf (the token is never drawn); None: not one."""
    if v is False:
        return -math.inf
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None  # (Python's JSON reads Infinity and NaN: +inf would unmask a grammar's ban)
    return float(v)


def logit_bias(raw: Any) -> tuple[tuple[int | str, float], ...]:
    """OpenAI's {"token id": bias} or llama-server's [[token id or text, bias], ...] (a bias of
    false bans the token); text is tokenized where the tokenizer is (`resolve`)."""
    pairs: list[tuple[Any, Any]]
    if isinstance(raw, dict):
        pairs = [(int(k) if k.lstrip("-").isdigit() else k, v) for k, v in raw.items()]
    elif isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        pairs = [(p[0], p[1]) for p in raw]
    else:
        raise ValueError('must be an object {"token id": bias} or a list of [token, bias] pairs')
    out: list[tuple[int | str, float]] = []
    for key, v in pairs:
        bias = _bias_value(v)
        if bias is None or isinstance(key, bool) or not isinstance(key, int | str):
            raise ValueError(f"[{key!r}, {v!r}]: give a token id or its text, and a number (or "
                             "false to ban it)")
        out.append((key, bias))
    return tuple(out)


def _field(name: str, v: Any) -> Any:
    if name in NUMBERS:
        return _number(name, v)
    if name == "samplers":
        return sampler_names(v)
    if name == "dry_sequence_breakers":
        if not isinstance(v, list) or not v or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a non-empty list of strings")
        return tuple(v)
    if name == "logit_bias":
        return logit_bias(v)
    if not isinstance(v, bool):  # ignore_eos
        raise ValueError("must be true or false")
    return v


def parse(body: dict[str, Any]) -> dict[str, Any]:
    """A request's llama-server sampling fields (null: not set, as llama-server reads it)."""
    out: dict[str, Any] = {}
    for name in FIELDS:
        v = body.get(name)
        if v is not None:
            try:
                out[name] = _field(name, v)
            except ValueError as e:
                raise BadRequest(f"'{name}' {e}" if str(e).startswith("must") else
                                 f"'{name}': {e}", param=name) from None
    return out


def from_items(items: Iterable[str]) -> dict[str, Any]:
    """`--sampling NAME=VALUE` items, in order, as llama-server's flags set them: a later one
    wins; `dry_sequence_breaker` adds one breaker (the first clears llama.cpp's, `none` clears
    all); `logit_bias` adds one `TOKEN+BIAS` or `TOKEN-BIAS`; `samplers` is `;`-separated names,
    `sampler_seq` characters. A ValueError in one line names what is wrong."""
    out: dict[str, Any] = {}
    breakers: list[str] | None = None
    biases: list[tuple[int | str, float]] = []
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip().replace("-", "_")
        try:
            if not eq:
                raise ValueError("give NAME=VALUE")
            if name in NUMBERS:
                kind = NUMBERS[name][0]
                out[name] = _number(name, kind(float(text)) if kind is float else int(text))
            elif name == "samplers":
                out[name] = sampler_names([n for n in text.split(";") if n])
            elif name == "sampler_seq":
                out["samplers"] = sampler_names(text)
            elif name == "dry_sequence_breaker":
                breakers = [] if text == "none" else [*(breakers or []), text]
            elif name == "logit_bias":
                token, sign, value = text.partition("+") if "+" in text else \
                    text.rpartition("-")
                if not sign or not token.strip().isdigit():
                    raise ValueError("give TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1")
                biases.append((int(token), float(sign + value)))
            elif name == "ignore_eos":
                out[name] = text.strip().lower() in ("1", "true", "on", "yes")
            else:
                raise ValueError(f"not a sampler setting (one of {', '.join(FIELDS)})")
        except ValueError as e:
            raise ValueError(f"--sampling {item}: {e}") from None
    if breakers is not None:
        out["dry_sequence_breakers"] = tuple(breakers)
    if biases:
        out["logit_bias"] = tuple(biases)
    return out


def resolve(sampling: dict[str, Any], encode: Callable[[str], list[int]],
            decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """`sampling` with its logit biases as (token id, bias): text is every token of its
    encoding, as llama-server's; an id outside the vocabulary (`decode` raises ValueError) is
    a 400."""
    raw = sampling.get("logit_bias")
    if not raw:
        return sampling
    out: list[tuple[int, float]] = []
    for key, bias in raw:
        if isinstance(key, str):
            out += [(t, bias) for t in encode(key)]
            continue
        try:
            decode([key])
        except ValueError as e:
            raise BadRequest(f"'logit_bias': {e}", param="logit_bias") from None
        out.append((key, bias))
    return {**sampling, "logit_bias": tuple(out)}


def resolve_budget(sampling: dict[str, Any], start: str, ends: tuple[str, ...],
                   generation_prompt: str, encode: Callable[[str], list[int]]) -> dict[str, Any]:
    """`sampling` with its reasoning budget as the worker applies it (backend.sampling): the
    token ids of the reasoning block's opening tag (`start`) and closing ones (`ends`), of what
    is forced at its end (the budget's message, then the first closing tag), and of the
    generation prompt (fed to it first, as llama.cpp feeds its sampler). A budget without tags
    (a model that writes no reasoning in tags: Harmony's channels; raw text that names none)
    changes nothing, as in llama-server, and is dropped."""
    out = {k: v for k, v in sampling.items() if not k.startswith("reasoning_budget_")}
    n = sampling.get("reasoning_budget_tokens", -1)
    if n < 0 or not start or not ends:
        return out
    closes = tuple(tuple(encode(e)) for e in ends if e)
    message = sampling.get("reasoning_budget_message") or ""
    return {**out, "reasoning_budget_tokens": n, "reasoning_budget_start": tuple(encode(start)),
            "reasoning_budget_end": closes,
            "reasoning_budget_forced": (*(encode(message) if message else ()), *closes[0]),
            "reasoning_budget_prefill": tuple(encode(generation_prompt))
            if generation_prompt else ()}


# what a request may ask that prefixgate does not do: field -> (the value that asks nothing,
# what is not supported)
UNSUPPORTED = {
    "n": (1, "more than one choice per request"),
    "n_cmpl": (1, "more than one choice per request"),
    "best_of": (1, "more than one choice per request"),
    "logprobs": (False, "token log-probabilities"),
    "top_logprobs": (0, "token log-probabilities"),
    "n_probs": (0, "token probabilities"),
    "echo": (False, "echoing the prompt"),
    "grammar_lazy": (False, "a lazy grammar (one that applies from a trigger on)"),
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """A 400 naming a field that asks what prefixgate does not do yet (its neutral value, or
    null, passes: clients send `n: 1` and `logprobs: false`)."""
    for name, (neutral, what) in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v != neutral and not (v == 0 and neutral is False):
            raise BadRequest(f"'{name}': {what} is not supported yet; send {name}: "
                             f"{str(neutral).lower()} or leave it out", param=name)
