"""The reasoning budget's machine, state by state as llama.cpp's reasoning-budget sampler
(common/reasoning-budget.cpp) goes: what it forces after each generated token."""

from __future__ import annotations

import pytest

from policies.reasoning_budget import (
    COUNTING,
    DONE,
    FORCING,
    IDLE,
    WAITING,
    Budget,
    utf8_complete,
)

OPEN, CLOSE, MSG = 10, 11, 12  # <think>, </think>, a one-token budget message


def run(b: Budget, tokens: list[int], incomplete: frozenset[int] = frozenset(),
        prefill: tuple[int, ...] = ()) -> list[tuple[int | None, str]]:
    """(the forced token before each draw, the state after it): a forced token is taken, else
    the next of `tokens`; `prefill` (the generation prompt's) is fed first."""
    for token in prefill:
        b.prefill(token, token not in incomplete)
    out = []
    it = iter(tokens)
    while True:
        forced = b.forced_token
        token = forced if forced is not None else next(it, None)
        if token is None:
            return out
        b.accept(token, token not in incomplete)
        out.append((forced, b.state))


def test_it_counts_from_the_opening_tag_and_forces_the_end_when_spent() -> None:
    b = Budget.of(3, [OPEN], [[CLOSE]], [CLOSE])
    assert run(b, [1, OPEN, 2, 3, 4, 5, 6]) == [
        (None, IDLE), (None, COUNTING), (None, COUNTING), (None, COUNTING),
        (None, FORCING),  # the third reasoning token spends it
        (CLOSE, DONE),  # the next draw is the closing tag, whatever the model says
        (None, DONE), (None, DONE)]


def test_a_generation_prompt_that_opens_the_block_counts_its_own_tokens() -> None:
    """As llama.cpp feeds its sampler the generation prompt (`<think>` then `\n`): the tokens
    after the tag count against the budget."""
    b = Budget.of(3, [OPEN], [[CLOSE]], [MSG, CLOSE])
    assert run(b, [1, 2, 3], prefill=(20, OPEN, 21)) == [
        (None, COUNTING), (None, FORCING), (MSG, FORCING), (CLOSE, DONE), (None, DONE)]
    b = Budget.of(3, [OPEN], [[CLOSE]], [CLOSE])
    assert run(b, [1], prefill=(OPEN, 21, CLOSE)) == [(None, DONE)], "opened and closed"


def test_a_natural_end_within_the_budget_forces_nothing() -> None:
    b = Budget.of(5, [OPEN], [[CLOSE]], [CLOSE])
    assert run(b, [1, CLOSE, 2, 3, 4, 5, 6], prefill=(OPEN,)) == [
        (None, COUNTING), (None, DONE)] + [(None, DONE)] * 5


def test_zero_ends_the_block_at_once() -> None:
    assert run(Budget.of(0, [OPEN], [[CLOSE]], [CLOSE]), [7], prefill=(OPEN,)) == [
        (CLOSE, DONE), (None, DONE)]
    assert run(Budget.of(0, [OPEN], [[CLOSE]], [CLOSE]), [OPEN, 7]) == [
        (None, FORCING), (CLOSE, DONE), (None, DONE)]


def test_a_prompt_token_never_stands_for_a_forced_one() -> None:
    """The deliberate difference from llama.cpp (the module docstring): spent inside the
    generation prompt (0, then `\n`), the closing tag is still forced whole."""
    b = Budget.of(0, [OPEN], [[CLOSE]], [8, CLOSE])
    assert run(b, [7], prefill=(OPEN, 21)) == [(8, FORCING), (CLOSE, DONE), (None, DONE)]


def test_a_spent_budget_waits_for_a_whole_character() -> None:
    b = Budget.of(2, [OPEN], [[CLOSE]], [CLOSE])
    # token 2 ends inside a UTF-8 character, and so does 3: forced after 4 completes it
    assert run(b, [1, 2, 3, 4, 5], frozenset({2, 3}), prefill=(OPEN,)) == [
        (None, COUNTING), (None, WAITING), (None, WAITING), (None, FORCING), (CLOSE, DONE),
        (None, DONE)]


def test_a_new_block_gets_a_fresh_budget() -> None:
    b = Budget.of(1, [OPEN], [[CLOSE]], [CLOSE])
    assert [s for _, s in run(b, [1, 2, OPEN, 3, 4], prefill=(OPEN,))] == [
        FORCING, DONE, DONE, COUNTING, FORCING, DONE, DONE]


@pytest.mark.parametrize("tokens", [[5, 6, 7], [5, 5, 6, 7]])
def test_sequences_of_several_tokens_match_at_their_end(tokens: list[int]) -> None:
    b = Budget.of(9, [5, 6], [[7, 8], [8]], [7, 8])
    states = [s for _, s in run(b, tokens)]
    assert states[-2:] == [COUNTING, COUNTING] and b.remaining == 8
    b.accept(8)
    assert b.state == DONE, "the longest end sequence that ends here"


def test_no_forced_tokens_is_no_forcing() -> None:
    b = Budget.of(1, [OPEN], [[CLOSE]], [])
    assert run(b, [1, 2], prefill=(OPEN,)) == [(None, DONE), (None, DONE)]


@pytest.mark.parametrize(("piece", "complete"), [
    (b"", True), (b"ab", True), ("é".encode(), True), ("é".encode()[:1], False),
    ("日".encode()[:2], False), ("日".encode(), True), ("🙂".encode()[:3], False),
    ("a🙂".encode(), True), (b"\x80\x80", False),
])
def test_a_token_s_text_ends_a_character_or_not(piece: bytes, complete: bool) -> None:
    """llama.cpp's common_utf8_is_complete, which the budget waits on."""
    assert utf8_complete(piece) is complete
