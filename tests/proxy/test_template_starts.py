"""Message starts from one traced rendering equal the definition (every prefix rendered) for
every template the tests use and for templates written the other ways real ones are (text
before the first read of a message, ``loop.last``, ``messages[1:]``, history that depends on
later turns, refusals of partial conversations), on generated conversations; and 3,000
messages take well under a second where rendering every prefix took 19 s."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from proxy.config import default_model
from proxy.gguf import read_metadata
from proxy.starts import (
    _SHAPE_SAMPLES,
    _chain_keys,
    _checked,
    _rendered_starts,
    _shape_firsts,
    _traced_starts,
    message_char_starts,
)
from proxy.template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    _open_final_message,
    load_template,
    render_prompt,
)
from proxy.tokenizer import load_tokenizer

MODEL = default_model()
METADATA = read_metadata(MODEL)

TEMPLATES: dict[str, str] = {
    "smollm2": METADATA["tokenizer.chat_template"],
    "chatml": CHATML_TEMPLATE,
    # tests/proxy/test_template.py's own
    "counting": "{{ messages|length }} messages\n" + CHATML_TEMPLATE,
    "tools": "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
             + CHATML_TEMPLATE,
    "bos in text": "<|endoftext|>" + CHATML_TEMPLATE,
    # text written before the message is read: the pull, not the read, is the start
    "text first": "{% for message in messages %}<|im_start|>{{ message.role }}\n"
                  "{{ message.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    # loop.last pulls the next message early; the last turn has no newline
    "peeks at loop.last": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + "
                          "m['content'] + '<|im_end|>' }}{% if not loop.last %}\n{% endif %}"
                          "{% endfor %}{% if add_generation_prompt %}\n<|im_start|>assistant\n"
                          "{% endif %}",
    # Llama 2: the system message goes into the first user turn, the loop runs over messages[1:]
    "llama2": "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
              "{% set system = messages[0]['content'] %}{% else %}"
              "{% set loop_messages = messages %}{% set system = false %}{% endif %}"
              "{% for message in loop_messages %}{% if loop.index0 == 0 and system %}"
              "{% set content = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' + message['content'] %}"
              "{% else %}{% set content = message['content'] %}{% endif %}"
              "{% if message['role'] == 'user' %}{{ '<s>[INST] ' + content + ' [/INST]' }}"
              "{% else %}{{ ' ' + content + ' </s>' }}{% endif %}{% endfor %}",
    # Qwen3: reasoning shown only after the last user turn, so history depends on later turns
    "reasoning after the last user turn":
        "{% set ns = namespace(last_user=-1) %}{% for m in messages|reverse %}"
        "{% if m.role == 'user' and ns.last_user < 0 %}"
        "{% set ns.last_user = messages|length - loop.index %}{% endif %}{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and loop.index0 > ns.last_user and m.reasoning %}"
        "<think>{{ m.reasoning }}</think>\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    # refuses a conversation that ends with a tool result (only partial ones do)
    "refuses a partial conversation":
        "{% if messages and messages[-1].role == 'tool' %}"
        "{{ raise_exception('a tool result must be answered') }}{% endif %}" + CHATML_TEMPLATE,
}
# the templates whose traced starts are trusted (the others fall back to rendering every prefix)
FAST = {"smollm2", "chatml", "tools", "bos in text", "text first", "peeks at loop.last", "llama2"}
TOOLS = [{"type": "function", "function": {"name": "grep", "description": "搜索 files"}}]


def template_of(name: str) -> ChatTemplate:
    return ChatTemplate(TEMPLATES[name], "<|endoftext|>", "<|im_end|>")  # a fresh prefix cache


def conversation(seed: int, n_messages: int) -> list[dict[str, Any]]:
    """Generated: an optional system message, then users, assistants (some with tool calls or
    reasoning, some empty) and tool results, with text that repeats across messages."""
    rng = random.Random(seed)
    words = ["the", "cache", "  ", "\n", "日本", "<|im_end|>", "x", "{}", "🙂", "42"]
    text = lambda: "".join(rng.choice(words) for _ in range(rng.randrange(0, 12)))  # noqa: E731
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": "You are a coding agent." + text()})
    for _ in range(n_messages - len(messages)):
        role = rng.choice(["user", "user", "assistant", "assistant", "tool"])
        message: dict[str, Any] = {"role": role, "content": text()}
        if role == "assistant" and rng.random() < 0.3:
            message["reasoning"] = text() or "hm"
        if role == "assistant" and rng.random() < 0.2:
            message["tool_calls"] = [{"type": "function",
                                      "function": {"name": "grep", "arguments": "{}"}}]
        if role == "tool":
            message["tool_call_id"] = f"call_{rng.randrange(100)}"
        messages.append(message)
    return messages


def prompt_text(template: ChatTemplate, messages: list[dict[str, Any]], tools: Any,
                continue_final: bool) -> str | None:
    """The text render_prompt renders (None when the template refuses the conversation)."""
    try:
        if continue_final:
            return _open_final_message(template.render(messages, tools, False),
                                       str(messages[-1].get("content") or ""))
        return template.render(messages, tools, add_generation_prompt=True)
    except Exception:  # refused, or cannot be continued
        return None


def by_definition(name: str, messages: list[dict[str, Any]], tools: Any, text: str
                  ) -> dict[int, int]:
    return _rendered_starts(template_of(name), messages, tools, text, _chain_keys(messages, tools))


def traced_ones_trusted(template: ChatTemplate, messages: list[dict[str, Any]], tools: Any,
                        text: str) -> bool:
    return any(_checked(template, messages, tools, text, None, candidate) is not None
               for candidate in _traced_starts(template, messages, tools, text))


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_starts_are_the_definitions_on_generated_conversations(name: str) -> None:
    template = template_of(name)  # one template, warm across the cases, as in the proxy
    compared = trusted = 0
    for seed in range(25):
        messages = conversation(seed, n_messages=1 + seed % 30)
        for tools in (None, TOOLS):
            for continue_final in (False, True):
                text = prompt_text(template, messages, tools, continue_final)
                if text is None:
                    continue
                starts = message_char_starts(template, messages, tools, text)
                assert starts == by_definition(name, messages, tools, text), (seed, tools)
                compared += 1
                trusted += traced_ones_trusted(template_of(name), messages, tools, text)
    assert compared >= 50
    # where the traced starts are trusted, they are for every conversation; elsewhere they
    # fall back (a conversation short enough for the sample to cover every start may pass)
    assert trusted == compared if name in FAST else trusted < compared


def test_a_conversation_growing_turn_by_turn_keeps_the_definitions_starts() -> None:
    """The prefix cache of one template across a growing session, edited in the middle once."""
    for name in ("smollm2", "text first", "reasoning after the last user turn"):
        template = template_of(name)
        messages = conversation(7, n_messages=80)
        for n in range(2, len(messages), 3):
            turn = messages[:n]
            if n == 50:
                turn = [*turn[:20], {"role": "user", "content": "edited"}, *turn[21:]]
            text = prompt_text(template, turn, None, False)
            assert text is not None
            assert message_char_starts(template, turn, None, text) == \
                by_definition(name, turn, None, text), (name, n)


def test_smollm2_render_prompt_of_400_messages_equals_the_definition() -> None:
    tok = load_tokenizer(MODEL, METADATA, verify=False)
    messages = conversation(11, n_messages=400)
    template = load_template(METADATA)
    r = render_prompt(template, tok, messages)
    starts = by_definition("smollm2", messages, None, r.text)
    assert len(r.message_starts) == len(messages) == len(starts) - 1
    assert [tok.encode(r.text[: starts[i]]) == list(r.ids[:p])
            for i, (p, _) in enumerate(r.message_starts)] == [True] * len(messages)


def test_3000_messages_take_well_under_a_second_per_render() -> None:
    tok = load_tokenizer(MODEL, METADATA, verify=False)
    template = load_template(METADATA)
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"message {i} " * 8}
                for i in range(3000)]
    started = time.perf_counter()
    r = render_prompt(template, tok, messages)  # cold: nothing in the prefix cache
    cold_s = time.perf_counter() - started
    started = time.perf_counter()
    render_prompt(template, tok, [*messages, {"role": "assistant", "content": "ok"},
                                  {"role": "user", "content": "and?"}])  # the next turn
    warm_s = time.perf_counter() - started
    assert len(r.message_starts) == 3000
    assert cold_s < 2.0 and warm_s < 2.0, (cold_s, warm_s)  # every prefix rendered: 19 s


def test_shape_pairs_carried_from_the_turn_before_are_a_fresh_scans() -> None:
    """The sampled shape pairs of a conversation that grows (or is edited back to `common`
    shapes) are taken from the previous list's scan where they lie in the shared part: the
    same positions as a scan of the whole list, whatever the edit."""
    rng = random.Random(11)
    shapes: list[Any] = []
    firsts = _shape_firsts(shapes)
    for _ in range(400):
        common = len(shapes) if rng.random() < 0.7 else rng.randrange(len(shapes) + 1)
        shapes = shapes[:common] + [rng.choice("abcdefghijklmnopqrstuvw")
                                    for _ in range(rng.randrange(0, 6))]
        firsts = _shape_firsts(shapes, firsts, common)
        assert firsts == _shape_firsts(shapes)
        seen, want = set(), []
        for i in range(len(shapes)):
            pair = (shapes[i - 1] if i else None, shapes[i])
            if pair not in seen and len(seen) < _SHAPE_SAMPLES:
                seen.add(pair)
                want.append(i)
            elif pair not in seen:
                break
        assert firsts[0] == want
