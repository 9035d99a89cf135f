"""Server-wide request defaults as llama-server has them (issue 42, proxy/defaults.py): a
request's own setting over the command line's, over the model's `general.sampling.*` keys, over
llama.cpp's built-in values; `--chat-template-kwargs` and the reasoning flags under a request's
template variables; `-n` as the default maximum; `--reasoning-format` in OpenAI answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.chat import ChatRequest
from proxy.cli import serve_config
from proxy.defaults import Defaults, inline_reasoning
from proxy.dialects.stream import CallOpen, Event, ReasoningDelta, TextDelta
from proxy.gguf import read_metadata


def defaults(*argv: str, model: dict[str, Any] | None = None) -> Defaults:
    return Defaults.of(serve_config(["-m", "m.gguf", "-ngl", "0", *argv], environ={}),
                       model or {})


def request(**kw: Any) -> ChatRequest:
    return ChatRequest(api="openai", messages=({"role": "user", "content": "hi"},), **kw)


def write_gguf(path: Path, keys: dict[str, Any]) -> None:
    """A GGUF holding only metadata, written by llama.cpp's own gguf package."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_int32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_request_over_the_command_line_over_the_model_over_llama_cpp(tmp_path: Path
                                                                        ) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, {"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                      "general.sampling.top_p": 0.95, "general.sampling.mirostat": 2,
                      "general.sampling.sequence": "top_k;TOP-P;temp",
                      "general.sampling.penalty_last_n": 128,
                      "general.sampling.dry_multiplier": 0.5})
    model = {k: v for k, v in read_metadata(str(path)).items()
             if k.startswith("general.sampling.")}
    d = defaults("--temp", "0.7", "--presence-penalty", "1.5", "-s", "7", "--typical", "0.9",
                 "--mirostat", "0", "-l", "15043+1", "-l", "17-2.5", "--ignore-eos",
                 model=model)
    assert d.sampling == {"temperature": 0.7, "top_k": 20, "top_p": pytest.approx(0.95),
                          "presence_penalty": 1.5, "seed": 7, "typical_p": 0.9, "mirostat": 0,
                          "samplers": ("top_k", "top_p", "temperature"), "repeat_last_n": 128,
                          "logit_bias": ((15043, 1.0), (17, -2.5)), "ignore_eos": True}
    # llama.cpp reads no DRY key from a model: said at start
    assert d.unused == ("general.sampling.dry_multiplier",)
    req = d.apply(request(sampling={"top_k": 50}))
    assert req.sampling["top_k"] == 50 and req.sampling["temperature"] == 0.7
    params = d.props()["params"]
    assert (params["temperature"], params["top_k"], params["min_p"]) == (0.7, 20, 0.05)
    assert (params["typical_p"], params["dry_base"], params["xtc_threshold"]) == (0.9, 1.75, 0.1)
    source = d.props()["params_source"]
    assert {k: source[k] for k in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                                   "seed", "samplers", "mirostat", "typical_p", "dry_base")} == {
        "temperature": "command line", "top_k": "model", "top_p": "model",
        "min_p": "built-in", "presence_penalty": "command line", "seed": "command line",
        "samplers": "model", "mirostat": "command line", "typical_p": "command line",
        "dry_base": "built-in"}


def test_built_in_values_are_the_workers() -> None:
    """/props shows what the worker draws with when nothing is set: backend.sampling's
    defaults, which are llama.cpp's common_params_sampling's."""
    from backend.sampling import Sampling
    from proxy.defaults import BUILT_IN

    assert BUILT_IN == {k: getattr(Sampling(), k) for k in BUILT_IN}
    # the seed, and the reasoning budget in the worker's terms (token ids: a request's own)
    assert set(Sampling.__dataclass_fields__) - set(BUILT_IN) == {
        "seed", "reasoning_budget_tokens", "reasoning_budget_start", "reasoning_budget_end",
        "reasoning_budget_forced", "reasoning_budget_prefill"}
    assert Sampling().reasoning_budget_tokens == -1


def test_nothing_set_changes_nothing() -> None:
    req = request(sampling={"temperature": 0.1})
    assert defaults().apply(req) is req
    assert defaults().props()["params"]["temperature"] == 0.8


def test_template_variables_a_request_over_the_server() -> None:
    d = defaults("--chat-template-kwargs", '{"enable_thinking": true, "x": 1}', "-rea", "off",
                 "--reasoning-effort", "high", "--reasoning-preserve")
    assert d.template_kwargs == {"enable_thinking": True, "x": 1, "reasoning_effort": "high",
                                 "preserve_reasoning": True}
    assert defaults("--reasoning", "off").template_kwargs == {"enable_thinking": False}
    # a budget is not a template variable (llama-server's current meaning of 0: the block is
    # closed at once, by the sampler): the worker forces the end of reasoning
    budget = defaults("--reasoning-budget", "0", "--reasoning-budget-message", "Done.")
    assert budget.template_kwargs == {}
    assert budget.apply(request()).sampling == {"reasoning_budget_tokens": 0,
                                                "reasoning_budget_message": "Done."}
    assert budget.apply(request(sampling={"reasoning_budget_tokens": 9})).sampling[
        "reasoning_budget_tokens"] == 9, "a request's own budget wins"
    assert budget.props()["params_source"]["reasoning_budget_tokens"] == "command line"
    assert defaults().props()["params"]["reasoning_budget_tokens"] == -1
    assert defaults("--no-reasoning-preserve").template_kwargs == {"preserve_reasoning": False}
    req = defaults("-rea", "off").apply(request(template_kwargs={"enable_thinking": True}))
    assert req.template_kwargs == {"enable_thinking": True}
    raw = ChatRequest(api="completion", messages=(), prompt="hi")
    assert defaults("-rea", "off").apply(raw).template_kwargs == {}  # no template


def test_the_default_maximum_of_generated_tokens() -> None:
    assert defaults("-n", "64").apply(request()).max_tokens == 64
    assert defaults("-n", "64").apply(request(max_tokens=8)).max_tokens == 8
    assert defaults("-n", "-1").apply(request()).max_tokens is None


@pytest.mark.parametrize(("argv", "line"), [
    (["--chat-template-kwargs", "[1]"], "invalid value for --chat-template-kwargs: '[1]' (a "
                                        "JSON object)"),
    (["--chat-template-kwargs", "{"], "invalid value for --chat-template-kwargs: '{' ("),
    (["--reasoning-budget", "-2"], "prefixgate: --reasoning-budget -2: give -1 (no limit), 0"),
    (["--reasoning-format", "think"], "invalid value for --reasoning-format: 'think' (one of "
                                      "auto, deepseek, deepseek-legacy, none)"),
    (["-rea", "maybe"], "invalid value for --reasoning: 'maybe' (one of on, off, auto)"),
])
def test_a_value_that_cannot_be_used_is_one_line(argv: list[str], line: str) -> None:
    with pytest.raises(SystemExit) as e:
        serve_config(["-m", "m.gguf", *argv], environ={})
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_llama_cpps_words_for_on_and_off() -> None:
    assert defaults("-rea", "enabled").template_kwargs == {"enable_thinking": True}
    assert defaults("-rea", "-1").template_kwargs == {}  # auto: the template's own default


async def collect(fmt: str, evs: list[Event], tags: tuple[str, str] | None = None
                  ) -> list[Event]:
    async def source() -> Any:
        for ev in evs:
            yield ev

    return [ev async for ev in inline_reasoning(source(), fmt, tags)]


async def test_reasoning_format_puts_the_thoughts_where_llama_server_does() -> None:
    evs: list[Event] = [ReasoningDelta("a"), ReasoningDelta("b"), TextDelta("ok")]
    assert await collect("auto", evs) == evs
    assert await collect("deepseek", evs) == evs
    assert await collect("none", evs) == [TextDelta("<think>a"), TextDelta("b"),
                                          TextDelta("</think>"), TextDelta("ok")]
    assert await collect("deepseek-legacy", evs, ("<seed:think>", "</seed:think>")) == [
        ReasoningDelta("a"), TextDelta("<seed:think>a"), ReasoningDelta("b"), TextDelta("b"),
        TextDelta("</seed:think>"), TextDelta("ok")]
    call = CallOpen(0, "00", "f")
    assert await collect("none", [ReasoningDelta("a"), call]) == [
        TextDelta("<think>a"), TextDelta("</think>"), call]
    assert await collect("none", [ReasoningDelta("a")]) == [TextDelta("<think>a"),
                                                             TextDelta("</think>")]
