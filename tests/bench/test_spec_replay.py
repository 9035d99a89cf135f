"""bench.spec_replay: the stop rule replayed on a recorded answer, against every draft."""

from __future__ import annotations

import numpy as np

from backend.worker.drafts import Speculation
from bench.spec_replay import replay
from policies.ngram import NgramParams
from policies.speculate import SpecConfig, VerifyCost

FLAT = VerifyCost((1, 2, 64), (1.0, 1.0, 1.0))  # a verify costs a step, whatever its rows
ROW_A_STEP = VerifyCost((1, 2), (1.0, 2.0))  # each row costs a step


def spec(cost: VerifyCost, always: bool) -> Speculation:
    return Speculation(SpecConfig(("ngram-simple",), NgramParams(simple_size_n=3,
                                                                 simple_size_m=8),
                                  always=always), cost, 512, True, "")


def test_a_copied_answer_and_a_novel_one() -> None:
    rng = np.random.default_rng(5)
    block = [int(t) for t in rng.integers(100, 1000, 40)]
    prompt = [1, *block, 2]
    copied = [*block[:30], 3]
    # every draft where a verify costs one step: 8 tokens a draft, all accepted, plus the one
    # waiting: the copy in far fewer steps than tokens
    rate, drafted, kept = replay(prompt, copied, spec(FLAT, True))
    assert rate > 3.0 and kept >= drafted - 8
    # where each row costs a step nothing can pay: the rule drafts nothing, plain decode
    assert replay(prompt, copied, spec(ROW_A_STEP, False)) == (1.0, 0, 0)
    # an answer that repeats nothing: no draft, plain decode either way
    novel = [int(t) for t in rng.integers(1000, 2000, 30)]
    assert replay(prompt, novel, spec(FLAT, True)) == (1.0, 0, 0)
