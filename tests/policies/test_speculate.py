"""policies.speculate: the types llama-server takes, the chain, the draft's room, the target's
acceptance, the verify cost, and the stop rule. Exact tables; the real-model tests are in
tests/backend/test_speculation.py."""

from __future__ import annotations

import numpy as np
import pytest

from policies.ngram import NgramParams
from policies.speculate import (
    MARGIN,
    MODEL_TOKEN,
    PAUSE_MAX,
    PAUSE_TOKENS,
    Chain,
    SpecConfig,
    Stats,
    VerifyCost,
    accepted,
    after,
    draft_len,
    expected,
    parse_types,
    room,
)


@pytest.mark.parametrize(("value", "want"), [
    ("none", ()),
    ("ngram-simple", ("ngram-simple",)),
    # llama.cpp tries them in its own order, whatever order they are given in
    ("ngram-mod,ngram-simple", ("ngram-simple", "ngram-mod")),
    ("ngram-map-k4v, ngram-map-k", ("ngram-map-k", "ngram-map-k4v")),
    ("draft-simple,ngram-mod", ("ngram-mod", "draft-simple")),  # a draft model last
])
def test_types(value: str, want: tuple[str, ...]) -> None:
    assert parse_types(value) == want


@pytest.mark.parametrize(("value", "error"), [
    ("ngram-big", "unknown type ngram-big (llama.cpp's: none, draft-simple"),
    ("draft-eagle3", "draft-eagle3: EAGLE-3 draft heads are not supported"),
    ("ngram-mod,draft-mtp", "draft-mtp: multi-token prediction heads are not supported"),
    ("ngram-cache", "ngram-cache: the n-gram cache type, with its lookup files, is not"),
])
def test_types_refused(value: str, error: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_types(value)
    assert str(e.value).startswith(error), str(e.value)


def test_the_chain_takes_the_first_that_drafts_and_tells_it_alone() -> None:
    config = SpecConfig(("ngram-simple", "ngram-mod"),
                        NgramParams(simple_size_n=3, simple_size_m=4, mod_n_match=2,
                                    mod_n_min=1, mod_n_max=3))
    chain = Chain(config)
    prompt = np.asarray([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 1, 2, 3], dtype=np.intc)
    chain.begin(prompt)
    # "2 3 4" came before: ngram-simple drafts what followed it
    assert chain.draft(prompt, 4, room=8) == ("ngram-simple", [5, 6, 7, 8])
    # "2 3 9" did not, nor "3 9" in ngram-mod's table: no draft
    assert chain.draft(prompt, 9, room=8) == ("", [])
    # "8 9 9" did not either, but ngram-mod chains 9 9 -> 1, 9 1 -> 2, 1 2 -> 3
    assert chain.draft(prompt[:9], 9, room=8) == ("ngram-mod", [1, 2, 3])
    assert chain.draft(prompt[:9], 9, room=2) == ("ngram-mod", [1, 2]), "cut to the room"
    assert chain.draft(prompt[:9], 9, room=0) == ("", [])
    assert config.n_max == 4 and config.name() == "ngram-simple,ngram-mod"
    # a draft model's turn: places for its tokens, filled when the step runs
    chain = Chain(SpecConfig(("ngram-simple", "draft-simple"),
                             NgramParams(simple_size_n=3, simple_size_m=4), draft_n_max=5))
    chain.begin(prompt)
    assert chain.draft(prompt, 4, room=8) == ("ngram-simple", [5, 6, 7, 8])
    assert chain.draft(prompt, 9, room=3) == ("draft-simple", [MODEL_TOKEN] * 3)


@pytest.mark.parametrize(("n_live", "n_ctx", "left", "n_batch", "want"), [
    (100, 4096, 50, 128, 49),  # the answer's tokens left, less the waiting one
    (100, 4096, 500, 128, 127),  # the batch, less the waiting token's row
    (4090, 4096, 500, 128, 4),  # the context, less two
    (100, 4096, 1, 128, 0),  # the last token: nothing to draft
    (4095, 4096, 9, 128, 0),
])
def test_room(n_live: int, n_ctx: int, left: int, n_batch: int, want: int) -> None:
    assert room(n_live, n_ctx, left, n_batch) == want


@pytest.mark.parametrize(("draft", "sampled", "want"), [
    ([4, 5, 6], [4, 5, 6, 7], 3),  # all accepted; the fourth sample is the step's last token
    ([4, 5, 6], [4, 9], 1),  # the second differs: one accepted, 9 ends the step
    ([4, 5, 6], [8], 0),
    ([], [8], 0),
])
def test_accepted(draft: list[int], sampled: list[int], want: int) -> None:
    assert accepted(draft, sampled) == want


GPU = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.02, 1.05, 1.1, 1.3))  # rows cost almost nothing
CPU = VerifyCost((1, 2, 4, 8), (1.0, 2.0, 4.0, 8.0))  # a row costs a step


def test_verify_cost() -> None:
    assert GPU.ratio(1) == 1.0 and GPU.ratio(3) == pytest.approx(1.035)
    assert GPU.ratio(32) == pytest.approx(1.7), "past the last size: its slope"
    assert VerifyCost().ratio(5) == 5.0, "one size measured: a row a step"
    assert GPU.can_pay(4) and not CPU.can_pay(7)
    assert VerifyCost.from_wire(GPU.to_wire()) == GPU
    assert VerifyCost.from_wire(VerifyCost((1, 2), (1.0, 1.1), 0.3).to_wire()).draft_step == 0.3
    # a draft model's steps count: at 0.3 of a step each, three drafts cost 0.9 more
    assert GPU.can_pay(4, 0.3) and not GPU.can_pay(4, 1.0)
    for bad in ({"rows": [2, 1], "ratios": [1, 1]}, {"rows": [], "ratios": []}, [1],
                {"rows": [1], "ratios": [1, 2]}):
        with pytest.raises(ValueError):
            VerifyCost.from_wire(bad)


def test_expected_tokens() -> None:
    assert expected(0.0, 4) == 1.0
    assert expected(0.5, 2) == pytest.approx(1.75)
    assert expected(1.0, 4) == 5.0


@pytest.mark.parametrize(("why", "stats", "n", "cost", "always", "n_gen", "want"), [
    ("always: every draft, as llama-server", Stats(), 6, CPU, True, 0, (6, Stats())),
    ("no cost measured: every draft", Stats(), 6, None, False, 0, (6, Stats())),
    # on a GPU at the prior acceptance 0.5 a sixth draft adds less than it costs: five,
    # 1.97 tokens for 1.075 steps
    ("a GPU: the most tokens a step", Stats(), 6, GPU, False, 0, (5, Stats())),
    ("a GPU and a slot that accepts nine in ten: the whole draft",
     Stats(hits=9.0, trials=10.0), 6, GPU, False, 0, (6, Stats(9.0, 10.0))),
    # 1 + 0.05 + ... tokens never pay 1.02 steps and the margin
    ("a slot that accepts little pauses", Stats(hits=0.1, trials=10.0), 6, GPU, False, 40,
     (0, Stats(0.1, 10.0, pause_until=40 + PAUSE_TOKENS, pause=2 * PAUSE_TOKENS,
               probe=True))),
    # after a turned-down draft's pause, a probe: the draft verified as at acceptance 0.8, so
    # the slot's acceptance is measured (at the prior alone a type never drafted once)
    ("after the pause, a probe", Stats(0.1, 10.0, pause_until=56, pause=32, probe=True), 6,
     GPU, False, 56, (6, Stats(0.1, 10.0, pause_until=56, pause=32))),
    ("while paused, nothing", Stats(pause_until=50), 6, GPU, False, 49,
     (0, Stats(pause_until=50))),
    ("a CPU where a row costs a step: nothing, never paused (nothing to learn)",
     Stats(hits=10.0, trials=10.0), 7, CPU, False, 0, (0, Stats(10.0, 10.0))),
])
def test_draft_len(why: str, stats: Stats, n: int, cost: VerifyCost | None, always: bool,
                   n_gen: int, want: tuple[int, Stats]) -> None:
    assert draft_len(stats, n, cost, always, n_gen) == want


def test_a_draft_models_steps_count_in_the_cost() -> None:
    # accepting nine in ten, a draft model whose step costs half the model's pays best for
    # three drafts (3.44 tokens for 1.05 + 1.5 steps), where free n-gram drafts pay for all six
    good = Stats(hits=9.0, trials=10.0)
    assert draft_len(good, 6, GPU, False, 0, per_draft=0.5)[0] == 3
    assert draft_len(good, 6, GPU, False, 0)[0] == 6


def test_the_margin_turns_down_a_draft_that_barely_pays() -> None:
    even = VerifyCost((1, 2), (1.0, 1.0 + 1 / (1 + MARGIN)))
    assert draft_len(Stats(hits=10.0, trials=10.0), 1, even, False, 0)[0] == 0


def test_after_a_verify() -> None:
    s = after(Stats(), 4, 2, 10)  # two accepted, the third examined and rejected
    assert (s.hits, s.trials, s.rejects) == (pytest.approx(0.8 + 2), pytest.approx(1.6 + 3), 0)
    s = after(Stats(), 4, 4, 10)  # all accepted: four examined
    assert s.trials == pytest.approx(1.6 + 4)
    # a run of rejections pauses the slot, each pause twice the last, up to PAUSE_MAX
    s = Stats()
    for gen in (1, 2):
        s = after(s, 3, 0, gen)
        assert s.rejects == gen and s.pause_until == 0
    s = after(s, 3, 0, 3)
    assert (s.rejects, s.pause_until, s.pause) == (0, 3 + PAUSE_TOKENS, 2 * PAUSE_TOKENS)
    for _ in range(10):
        s = after(after(after(s, 3, 0, 9), 3, 0, 9), 3, 0, 9)
    assert s.pause == PAUSE_MAX
    assert after(s, 3, 1, 9).pause == PAUSE_TOKENS, "an accepted draft ends the backing off"
