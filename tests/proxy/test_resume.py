"""A render resumed from an earlier one (proxy/resume.py) equals a fresh render, for any
template: the templates of tests/fixtures/templates/resume read the messages where the proof
could miss it (`messages | last`, a reversed list or a negative slice inside the message loop;
`messages[-1]` read before choosing one of two loops), and hypothesis grows, cuts and rewrites
conversations through them and through every real template. No model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.template import ChatTemplate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
GAPS = {p.stem: p.read_text() for p in sorted((FIXTURES / "resume").glob("*.jinja"))}
REAL = {p.stem: p.read_text() for p in sorted(FIXTURES.glob("*.jinja"))}


def warm_and_fresh(tpl: ChatTemplate, messages: list[dict[str, Any]], gen: bool
                   ) -> tuple[str, str, int]:
    """(the render resumed from the template's recent ones, a fresh render, loop items the
    resumed one did not render again)."""
    run = tpl.record(messages, None, gen, tpl.key_of(None))
    return run.text, tpl.render(messages, None, gen), run.resumed


USER = {"role": "user", "content": "Fix the bug"}
ANSWER = {"role": "assistant", "content": "Done."}
AGAIN = {"role": "user", "content": "Thanks, now the tests"}


@pytest.mark.parametrize("name", sorted(GAPS))
def test_a_turn_that_moves_the_last_message_renders_as_fresh(name: str) -> None:
    """A conversation, then its next turn ended by the assistant (the last message is another
    one, of another role): the read of the last message (or of the list's end) before or inside
    the loop keeps the render from resuming where its text would differ."""
    tpl = ChatTemplate(GAPS[name], "<s>", "</s>")
    for messages in ([USER, ANSWER, AGAIN], [USER, ANSWER, AGAIN, ANSWER]):
        warm, fresh, _ = warm_and_fresh(tpl, messages, False)
        assert warm == fresh, (name, messages)


PLAIN = """{%- for message in messages -%}
[{{ message.role }}] {{ message.content }}
{% endfor -%}"""


def test_a_template_that_reads_nothing_of_the_end_still_resumes() -> None:
    """The same loop without those reads resumes from the turn before (the proof is not
    simply off)."""
    tpl = ChatTemplate(PLAIN, "<s>", "</s>")
    warm_and_fresh(tpl, [USER, ANSWER, AGAIN], False)
    warm, fresh, resumed = warm_and_fresh(tpl, [USER, ANSWER, AGAIN, ANSWER], False)
    assert warm == fresh and resumed == 3


def test_the_generation_prompt_is_proven_late_only_where_no_loop_reads_it() -> None:
    """A render with the generation prompt resumes from the one without only for a template
    that reads the flag nowhere inside a loop or a macro; one that reads it before its loop
    passes the proof, and the loop's start finds the state it put in variables unlike."""
    late = {name: ChatTemplate(src, "<s>", "</s>").late_prompt for name, src in REAL.items()}
    assert late.pop("openai-gpt-oss-120b") is False  # it reads the flag inside its loop
    assert all(late.values()), late
    assert not ChatTemplate(GAPS["prompt-inside-loop"], "<s>", "</s>").late_prompt
    tpl = ChatTemplate(GAPS["prompt-before-loop"], "<s>", "</s>")
    assert tpl.late_prompt
    messages = [USER, ANSWER, AGAIN]
    bare = tpl.record(messages, None, False, tpl.key_of(None))
    prompted = tpl.record(messages, None, True, tpl.key_of(None), keep=False, source=bare)
    assert prompted.resumed == 0 and prompted.text == tpl.render(messages, None, True)
    plain = ChatTemplate(PLAIN + "{% if add_generation_prompt %}>{% endif %}", "<s>", "</s>")
    bare = plain.record(messages, None, False, plain.key_of(None))
    prompted = plain.record(messages, None, True, plain.key_of(None), keep=False, source=bare)
    assert prompted.resumed == 2 and prompted.text == bare.text + ">"


ROLES = st.sampled_from(["user", "assistant"])
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": st.sampled_from(
    ["a", "b", "Fix it", "ok", ""])})
# what the next request does to the conversation: grow it by a turn or two, retry it, cut it
# back, rewrite its last message, or start another
STEP = st.one_of(
    st.tuples(st.just("grow"), st.lists(MESSAGE, min_size=1, max_size=2)),
    st.tuples(st.just("retry"), st.just([])),
    st.tuples(st.just("cut"), st.integers(1, 3)),
    st.tuples(st.just("rewrite"), MESSAGE),
    st.tuples(st.just("new"), st.lists(MESSAGE, min_size=1, max_size=3)),
)


def apply(messages: list[dict[str, Any]], step: tuple[str, Any]) -> list[dict[str, Any]]:
    kind, arg = step
    if kind == "grow":
        return [*messages, *arg]
    if kind == "cut":
        return messages[: max(1, len(messages) - arg)]
    if kind == "rewrite":
        return [*messages[:-1], arg]
    if kind == "new":
        return list(arg)
    return list(messages)


CONVERSATIONS = {"start": st.lists(MESSAGE, min_size=1, max_size=3),
                 "steps": st.lists(st.tuples(STEP, st.booleans()), min_size=1, max_size=6)}


@pytest.mark.parametrize("name", sorted(GAPS))
@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(**CONVERSATIONS)
def test_resumed_renders_equal_fresh_ones(name: str, start: list[dict[str, Any]],
                                          steps: list[tuple[tuple[str, Any], bool]]) -> None:
    replay_against_fresh(GAPS[name], start, steps)


@pytest.mark.parametrize("name", sorted(REAL))
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(**CONVERSATIONS)
def test_resumed_renders_equal_fresh_ones_with_real_templates(
        name: str, start: list[dict[str, Any]], steps: list[tuple[tuple[str, Any], bool]]
) -> None:
    replay_against_fresh(REAL[name], start, steps)


def replay_against_fresh(source: str, start: list[dict[str, Any]],
                         steps: list[tuple[tuple[str, Any], bool]]) -> None:
    """Each request of the conversation rendered by one warm template (which resumes from its
    recent renders, as the proxy keeps it) equals a fresh render, or both refuse it."""
    tpl = ChatTemplate(source, "<s>", "</s>")
    messages = start
    for step, gen in [(("retry", []), True), *steps]:
        messages = apply(messages, step)
        try:
            fresh = tpl.render(messages, None, gen)
        except Exception as e:  # the template refuses this conversation: the resumed must too
            with pytest.raises(type(e)):
                tpl.record(messages, None, gen, tpl.key_of(None))
            continue
        run = tpl.record(messages, None, gen, tpl.key_of(None))
        assert run.text == fresh, (messages, gen)
        if tpl.late_prompt and not gen:  # the render with the prompt, resumed from this one
            prompted = tpl.record(messages, None, True, tpl.key_of(None), keep=False, source=run)
            assert prompted.text == tpl.render(messages, None, True), messages
