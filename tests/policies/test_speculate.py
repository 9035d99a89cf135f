"""policies.speculate: the types llama-server takes, the chain, the draft's room, the target's
acceptance, the verify cost, and the stop rule. Exact tables; the real-model tests are in
tests/backend/test_speculation.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from policies.ngram import NgramParams
from policies.speculate import (
    BUCKETS,
    DECAY,
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
    shadowed,
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


# the verify cost bench.spec measured for ngram-simple with the default model on the 2-core EPYC
EPYC = VerifyCost((1, 2, 4, 8, 16, 32, 49), (1.0, 2.0, 3.1, 4.4, 7.5, 14.2, 21.6))
NO = (0.0,) * (len(BUCKETS) + 1)


def record(*runs: tuple[int, int]) -> Stats:
    """The record of shadows, each (tokens it had right, then 1: one wrong | 0: it ended)."""
    s = Stats()
    for right, wrong in runs:
        for j in range(1, right + wrong + 1):
            s = shadowed(s, j, j <= right, j == 1)
    return s


COPY = record((48, 0))  # a 48-token draft the answer copied whole
NOVEL = record(*[(0, 1)] * 5)  # five drafts wrong at once


def test_rates_start_from_the_bucket_before() -> None:
    assert Stats().rates() == [0.5] * len(NO), "the prior: one token in two"
    assert Stats().yields([0, 1, 2, 3]) == [1.0, 1.5, 1.75, 1.875]
    assert Stats().yields([2, 5]) == pytest.approx([1.75, 1.96875])
    # one bucket measured, the rest carry its rate: rejected 1 of 10, over the prior's 1 of 2
    s = Stats(reached=(10.0, *NO[1:]), rejected=(1.0, *NO[1:]))
    assert s.rates() == pytest.approx([2 / 12] * len(NO))
    # a copied run: the deeper its positions, the surer the next (1st: 1 over the prior's 2)
    assert COPY.reached == (1.0, 1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 0.0)
    assert COPY.rejected == NO
    assert COPY.rates()[0] == pytest.approx(1 / 3) and COPY.rates()[6] < 0.001
    # priced from the run's position: 20 tokens in, the next 8 are all but sure
    assert COPY.yields([8], run=20)[0] > 8.95
    assert COPY.yields([8])[0] == pytest.approx(4.815, abs=0.001), "at a run's start, less sure"


@pytest.mark.parametrize(("why", "stats", "n", "cost", "always", "n_gen", "run", "shadows",
                          "want"), [
    ("always: every draft, as llama-server", Stats(), 6, CPU, True, 0, 0, True, (6, Stats())),
    ("no cost measured: every draft", Stats(), 6, None, False, 0, 0, True, (6, Stats())),
    # on a GPU at the prior one in two, six drafts: 1.984 tokens for 1.0875 steps
    ("a GPU: the most tokens a step", Stats(), 6, GPU, False, 0, 0, True, (6, Stats())),
    ("a CPU where a row costs a step: nothing, never paused (nothing to learn)",
     COPY, 7, CPU, False, 0, 20, False, (0, COPY)),
    # where a verify of k costs about k/2 steps, a draft pays only inside a copied run
    ("this CPU, no record: nothing", Stats(), 48, EPYC, False, 0, 0, True, (0, Stats())),
    ("this CPU, the start of a run: nothing", COPY, 48, EPYC, False, 0, 0, True, (0, COPY)),
    ("this CPU, 8 tokens into a copied run: the whole draft", COPY, 48, EPYC, False, 0, 8,
     True, (48, COPY)),
    ("this CPU, novel text: nothing", NOVEL, 48, EPYC, False, 0, 8, True, (0, NOVEL)),
    # an n-gram's draft turned down is a shadow: the slot never pauses, its record goes on
    ("a GPU, novel text, an n-gram: nothing, not paused", NOVEL, 6, EPYC, False, 40, 0, True,
     (0, NOVEL)),
    # a draft model's tokens are made only for a verify: turned down, the slot pauses
    ("a draft model turned down pauses", NOVEL, 6, EPYC, False, 40, 0, False,
     (0, replace(NOVEL, pause_until=40 + PAUSE_TOKENS, pause=2 * PAUSE_TOKENS, probe=True))),
    # after the pause, a probe: the draft verified as at acceptance 0.8, so the slot's record
    # is measured again (at the record alone a draft model would never draft again)
    ("after the pause, a probe", replace(NOVEL, pause_until=56, pause=32, probe=True), 6,
     GPU, False, 56, 0, False, (6, replace(NOVEL, pause_until=56, pause=32))),
    ("while paused, nothing", Stats(pause_until=50), 6, GPU, False, 49, 0, False,
     (0, Stats(pause_until=50))),
])
def test_draft_len(why: str, stats: Stats, n: int, cost: VerifyCost | None, always: bool,
                   n_gen: int, run: int, shadows: bool, want: tuple[int, Stats]) -> None:
    assert draft_len(stats, n, cost, always, n_gen, shadows=shadows, run=run) == want


def test_a_draft_models_steps_count_in_the_cost() -> None:
    # eleven in twelve accepted, a draft model whose step costs half the model's pays best for
    # three drafts, where free n-gram drafts pay for all six
    good = Stats(reached=(10.0, *NO[1:]), rejected=NO)
    assert good.rates()[0] == pytest.approx(1 / 12)
    assert draft_len(good, 6, GPU, False, 0, per_draft=0.5)[0] == 3
    assert draft_len(good, 6, GPU, False, 0)[0] == 6


def test_the_margin_turns_down_a_draft_that_barely_pays() -> None:
    even = VerifyCost((1, 2), (1.0, 1.0 + 1 / (1 + MARGIN)))
    sure = Stats(reached=(1e9, *NO[1:]), rejected=NO)
    assert sure.yields([1])[0] == pytest.approx(2.0)
    assert draft_len(sure, 1, even, False, 0)[0] == 0


def test_the_record_of_a_verify() -> None:
    s = after(Stats(), 4, 2, 10)  # two accepted, the third examined and rejected
    assert (s.reached, s.rejected, s.rejects) == ((1.0, 1.0, 1.0, *NO[3:]),
                                                  (0.0, 0.0, 1.0, *NO[3:]), 0)
    s = after(Stats(), 8, 8, 10, run=4)  # all accepted, 4 tokens into a run: positions 5-12
    assert (s.reached, s.rejected) == ((0.0, 0.0, 0.0, 4.0, 4.0, *NO[5:]), NO)
    s = after(s, 2, 0, 12, run=12)  # the next verify: older records weigh DECAY
    assert s.reached == pytest.approx((0.0, 0.0, 0.0, 4 * DECAY, 4 * DECAY + 1, *NO[5:]))
    assert s.rejected == (0.0, 0.0, 0.0, 0.0, 1.0, *NO[5:])
    # a shadow's record: each of its tokens as the step that checks it comes; the first
    # begins the draft's record
    s = shadowed(shadowed(Stats(), 1, True, True), 2, False, False)
    assert (s.reached, s.rejected) == ((1.0, 1.0, *NO[2:]), (0.0, 1.0, *NO[2:]))


def test_a_draft_models_rejections_pause_it_an_n_grams_do_not() -> None:
    # a run of rejections pauses a draft model's slot, each pause twice the last, up to
    # PAUSE_MAX
    s = Stats()
    for gen in (1, 2):
        s = after(s, 3, 0, gen, shadows=False)
        assert s.rejects == gen and s.pause_until == 0
    s = after(s, 3, 0, 3, shadows=False)
    assert (s.rejects, s.pause_until, s.pause) == (0, 3 + PAUSE_TOKENS, 2 * PAUSE_TOKENS)
    for _ in range(10):
        for _ in range(3):
            s = after(s, 3, 0, 9, shadows=False)
    assert s.pause == PAUSE_MAX
    assert after(s, 3, 1, 9, shadows=False).pause == PAUSE_TOKENS, \
        "an accepted draft ends the backing off"
    s = Stats()
    for gen in range(10):
        s = after(s, 3, 0, gen)  # an n-gram's: its shadows measure it, it never pauses
    assert s.pause_until == 0
