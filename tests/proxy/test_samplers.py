"""llama-server's other samplers (proxy/samplers.py): a request's fields and the command line's
flags checked and carried as the worker's chain takes them (tests/backend/test_sampling.py draws
with them; `python -m bench.samplers` compares the answers with llama-server's), and what a
request asks that prefixgate does not do is a 400 that names it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from proxy import samplers
from proxy.chat import parse_sampling
from proxy.cli import serve_config
from proxy.errors import BadRequest
from proxy.openai_api import parse_chat

MSG = [{"role": "user", "content": "hi"}]


def test_a_request_s_sampler_fields() -> None:
    s = parse_sampling({"temperature": 0.5, "typical_p": 0.9, "top_n_sigma": 1.5,
                        "xtc_probability": 0.5, "xtc_threshold": 0.1, "dry_multiplier": 0.8,
                        "dry_base": 1.75, "dry_allowed_length": 3, "dry_penalty_last_n": 128,
                        "dry_sequence_breakers": ["\n", "###"], "repeat_last_n": 32,
                        "mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2,
                        "dynatemp_range": 0.5, "dynatemp_exponent": 1.2, "min_keep": 1,
                        "adaptive_target": 0.4, "adaptive_decay": 0.5, "ignore_eos": True,
                        "samplers": ["Top-K", "nucleus", "temp", "adaptive_p"],
                        "logit_bias": {"15043": 2, "-1": 1, " hello": False},
                        "typical": 7})  # not a field of llama-server's: left alone
    assert s["typical_p"] == 0.9 and s["repeat_last_n"] == 32 and s["mirostat"] == 2
    assert s["samplers"] == ("top_k", "top_p", "temperature", "adaptive_p")
    assert s["dry_sequence_breakers"] == ("\n", "###") and s["ignore_eos"] is True
    assert s["logit_bias"] == ((15043, 2.0), (-1, 1.0), (" hello", -math.inf))
    assert "typical" not in s
    # llama-server's pair form and its characters
    s = parse_sampling({"logit_bias": [[5, -1.5], ["x", False]], "samplers": "kypmt"})
    assert s["logit_bias"] == ((5, -1.5), ("x", -math.inf))
    assert s["samplers"] == ("top_k", "typ_p", "top_p", "min_p", "temperature")
    # null is not set, as llama-server reads it
    assert parse_sampling({"typical_p": None, "samplers": None}) == {}


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"typical_p": 1.5}, "typical_p", "between 0.0 and 1.0"),
    # logits that are no numbers (the fuzz's worker abort): refused as llama-server refuses them
    ({"repeat_penalty": 0.0}, "repeat_penalty", "between 0.01 and 10.0"),
    ({"logit_bias": {"5": math.inf}}, "logit_bias", "a number (or false"),
    ({"logit_bias": [[5, math.nan]]}, "logit_bias", "a number (or false"),
    ({"repeat_last_n": -1}, "repeat_last_n", "between 0 and"),
    ({"repeat_last_n": 2.5}, "repeat_last_n", "an integer"),
    ({"mirostat": 3}, "mirostat", "between 0 and 2"),
    ({"dry_base": 0.5}, "dry_base", "between 1.0"),
    ({"xtc_probability": "0.5"}, "xtc_probability", "a number"),
    ({"samplers": ["top_k", "beam"]}, "samplers", "'beam': not a sampler"),
    ({"samplers": "kqt"}, "samplers", "'q': not one of llama.cpp's sampler characters"),
    ({"samplers": [1]}, "samplers", "a list of sampler names"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers", "non-empty list"),
    ({"logit_bias": {"5": "high"}}, "logit_bias", "a number (or false"),
    ({"logit_bias": [[5]]}, "logit_bias", "a list of [token, bias] pairs"),
    ({"logit_bias": 5}, "logit_bias", "an object"),
    ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
])
def test_a_bad_sampler_field_is_a_400_that_names_it(body: dict[str, Any], param: str,
                                                    says: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_sampling(body)
    assert e.value.param == param and says in str(e.value), str(e.value)


@pytest.mark.parametrize(("body", "param"), [
    ({"n": 2}, "n"), ({"n_cmpl": 3}, "n_cmpl"), ({"best_of": 2}, "best_of"),
    ({"logprobs": True}, "logprobs"), ({"logprobs": 5}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"n_probs": 3}, "n_probs"), ({"echo": True}, "echo"),
    ({"grammar": "root ::= \"a\"", "grammar_lazy": True}, "grammar_lazy"),
])
def test_what_prefixgate_does_not_do_is_a_400_never_silence(body: dict[str, Any],
                                                            param: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_chat({"messages": MSG, **body}, "")
    assert e.value.param == param and "not supported yet" in str(e.value)


def test_what_asks_nothing_passes() -> None:
    """Clients send the neutral values by habit (the OpenAI SDKs, LangChain)."""
    req = parse_chat({"messages": MSG, "n": 1, "logprobs": False, "top_logprobs": 0,
                      "n_probs": 0, "echo": False, "best_of": None, "grammar_lazy": False}, "")
    assert req.sampling == {} and req.grammar is None


def test_llama_server_s_sampler_flags() -> None:
    cfg = serve_config(["-m", "m.gguf", "-ngl", "0", "--typical", "0.9", "--top-nsigma", "1",
                        "--xtc-probability", "0.5", "--xtc-threshold", "0.2",
                        "--repeat-last-n", "32", "--dry-multiplier", "0.8", "--dry-base", "2",
                        "--dry-allowed-length", "3", "--dry-penalty-last-n", "0",
                        "--dry-sequence-breaker", "a", "--dry-sequence-breaker", "b",
                        "--dynatemp-range", "0.3", "--dynatemp-exp", "1.5", "--mirostat", "2",
                        "--mirostat-lr", "0.2", "--mirostat-ent", "4", "--adaptive-target",
                        "0.5", "--adaptive-decay", "0.8", "--samplers", "top_k;min-p;temp",
                        "-l", "15043+1", "--logit-bias", "7-0.5", "--ignore-eos"], environ={})
    assert samplers.from_items(cfg.sampling) == {
        "typical_p": 0.9, "top_n_sigma": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.2,
        "repeat_last_n": 32, "dry_multiplier": 0.8, "dry_base": 2.0, "dry_allowed_length": 3,
        "dry_penalty_last_n": 0, "dynatemp_range": 0.3, "dynatemp_exponent": 1.5,
        "mirostat": 2, "mirostat_eta": 0.2, "mirostat_tau": 4.0, "adaptive_target": 0.5,
        "adaptive_decay": 0.8, "samplers": ("top_k", "min_p", "temperature"),
        "dry_sequence_breakers": ("a", "b"), "logit_bias": ((15043, 1.0), (7, -0.5)),
        "ignore_eos": True}
    seq = serve_config(["-m", "m.gguf", "-ngl", "0", "--sampler-seq", "kt",
                        "--dry-sequence-breaker", "none"], environ={})
    assert samplers.from_items(seq.sampling) == {"samplers": ("top_k", "temperature"),
                                                 "dry_sequence_breakers": ()}
    # prefixgate's own spelling, and its variable (one item per line)
    own = serve_config(["-m", "m.gguf", "-ngl", "0", "--sampling", "typical_p=0.5"],
                       environ={"PREFIXGATE_SAMPLING": "mirostat=1\nmin_keep=2"})
    assert samplers.from_items(own.sampling) == {"typical_p": 0.5}
    env = serve_config(["-m", "m.gguf", "-ngl", "0"],
                       environ={"PREFIXGATE_SAMPLING": "mirostat=1\nmin_keep=2"})
    assert samplers.from_items(env.sampling) == {"mirostat": 1, "min_keep": 2}


@pytest.mark.parametrize(("item", "says"), [
    ("typical_p=2", "between 0.0 and 1.0"),
    ("typical_p", "give NAME=VALUE"),
    ("mirostat=x", "invalid literal"),
    ("samplers=top_k;beam", "'beam': not a sampler"),
    ("logit_bias=15043*2", "TOKEN_ID+BIAS"),
    ("beam_width=4", "not a sampler setting"),
])
def test_a_bad_sampler_flag_is_one_line(item: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        samplers.from_items([item])
    assert str(e.value).startswith(f"--sampling {item}: ") and says in str(e.value)
    assert "\n" not in str(e.value)


def test_logit_bias_by_text_is_its_tokens_and_an_id_outside_the_vocabulary_is_a_400() -> None:
    """The default model's own tokenizer (the proxy's, equal to llama.cpp's)."""
    from proxy.config import default_model
    from proxy.gguf import read_metadata
    from proxy.tokenizer import load_tokenizer

    path = default_model()
    tok = load_tokenizer(path, read_metadata(path))
    hello = tok.encode(" hello world")
    assert len(hello) == 2
    got = samplers.resolve({"logit_bias": ((" hello world", -1.0), (4, 2.0), ("!", -math.inf))},
                           tok.encode, tok.decode)
    assert got["logit_bias"] == ((hello[0], -1.0), (hello[1], -1.0), (4, 2.0),
                                 (tok.encode("!")[0], -math.inf))
    n_vocab = 49152
    tok.decode([n_vocab - 1])
    with pytest.raises(BadRequest) as e:
        samplers.resolve({"logit_bias": ((n_vocab, 1.0),)}, tok.encode, tok.decode)
    assert e.value.param == "logit_bias" and "outside the vocabulary" in str(e.value)


def test_llama_server_s_grammar_field() -> None:
    g = 'root ::= "yes" | "no"'
    assert parse_chat({"messages": MSG, "grammar": g}, "").grammar == g
    assert parse_chat({"messages": MSG, "grammar": ""}, "").grammar is None
    with pytest.raises(BadRequest) as e:
        parse_chat({"messages": MSG, "grammar": 5}, "")
    assert e.value.param == "grammar"


def test_a_reasoning_budget_is_llama_server_s_request_fields() -> None:
    """`reasoning_budget_tokens` (else `thinking_budget_tokens`; -1: the server's), the
    budget's message, and Anthropic's `thinking.budget_tokens` (10000 when not given, as
    llama-server's Anthropic API takes it); a wrong one is a 400 naming it."""
    from proxy.anthropic_api import thinking_budget

    assert parse_sampling({"reasoning_budget_tokens": 64, "thinking_budget_tokens": 9,
                           "reasoning_budget_message": "Enough."}) == {
        "reasoning_budget_tokens": 64, "reasoning_budget_message": "Enough."}
    assert parse_sampling({"thinking_budget_tokens": 0}) == {"reasoning_budget_tokens": 0}
    assert parse_sampling({"reasoning_budget_start_tag": "<t>", "reasoning_budget_end_tag":
                           "</t>"}) == {"reasoning_budget_start_tag": "<t>",
                                        "reasoning_budget_end_tags": ("</t>",)}
    assert parse_sampling({"reasoning_budget_tokens": -1, "thinking_budget_tokens": 5}) == {}
    assert thinking_budget({"thinking": {"type": "enabled", "budget_tokens": 2048}}) == {
        "reasoning_budget_tokens": 2048}
    assert thinking_budget({"thinking": {"type": "enabled"}}) == {
        "reasoning_budget_tokens": 10000}
    for off in ({}, {"thinking": {"type": "disabled"}}, {"thinking": {"type": "adaptive"}}):
        assert thinking_budget(off) == {}
    for body, param in [({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
                        ({"thinking_budget_tokens": "9"}, "thinking_budget_tokens"),
                        ({"reasoning_budget_message": 1}, "reasoning_budget_message"),
                        ({"reasoning_budget_end_tags": [1]}, "reasoning_budget_end_tags")]:
        with pytest.raises(BadRequest) as e:
            parse_sampling(body)
        assert e.value.param == param
    with pytest.raises(BadRequest) as e:
        thinking_budget({"thinking": {"type": "enabled", "budget_tokens": -5}})
    assert e.value.param == "thinking.budget_tokens"


def test_a_reasoning_budget_reaches_the_worker_as_token_ids() -> None:
    """The tags' and the message's tokens, with the model's own tokenizer; where the model
    writes no reasoning block in tags it changes nothing, and is dropped."""
    from proxy.config import default_model
    from proxy.gguf import read_metadata
    from proxy.tokenizer import load_tokenizer

    path = default_model()
    tok = load_tokenizer(path, read_metadata(path))
    asked = {"temperature": 0.0, "reasoning_budget_tokens": 5,
             "reasoning_budget_message": " Enough."}
    got = samplers.resolve_budget(asked, "<think>", ("</think>",), "<think>\n", tok.encode)
    close = tuple(tok.encode("</think>"))
    assert got == {"temperature": 0.0, "reasoning_budget_tokens": 5,
                   "reasoning_budget_start": tuple(tok.encode("<think>")),
                   "reasoning_budget_end": (close,),
                   "reasoning_budget_forced": (*tok.encode(" Enough."), *close),
                   "reasoning_budget_prefill": tuple(tok.encode("<think>\n"))}
    from backend.sampling import Sampling

    wire = Sampling.from_json(json.loads(json.dumps(got)))  # as the job's wire carries it
    assert wire.reasoning_budget_end == (close,) and wire.reasoning_budget_prefill
    assert samplers.resolve_budget(asked, "", (), "", tok.encode) == {"temperature": 0.0}
    # several closing tags: any ends the block, the first is forced
    two = samplers.resolve_budget({"reasoning_budget_tokens": 1}, "<t>", ("</t>", "<end>"),
                                  "", tok.encode)
    assert two["reasoning_budget_end"] == (tuple(tok.encode("</t>")), tuple(tok.encode("<end>")))
    assert two["reasoning_budget_forced"] == tuple(tok.encode("</t>"))
