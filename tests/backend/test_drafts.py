"""backend.worker.drafts: a slot's drafts as the core drives them (sans-I/O): a draft turned
down is a shadow that the next plain steps check, and the stop rule prices a draft by where it
stands in the run of tokens the drafts had right. The rules are policies.speculate's; the
real-model tests are in tests/backend/test_speculation.py."""

from __future__ import annotations

import numpy as np

from backend.worker.drafts import SlotDrafts, Speculation
from bench.spec_replay import drive
from policies.ngram import NgramParams
from policies.speculate import SpecConfig, VerifyCost

# the verify cost bench.spec measured for ngram-simple with the default model on the 2-core EPYC
EPYC = VerifyCost((1, 2, 4, 8, 16, 32, 49), (1.0, 2.0, 3.1, 4.4, 7.5, 14.2, 21.6))


def answer(prompt: list[int], tokens: list[int], spec: Speculation
           ) -> tuple[SlotDrafts, list[tuple[int, int, int]]]:
    """`tokens` generated after `prompt` as the core steps a slot (bench.spec_replay.drive):
    (tokens generated before it, drafts verified, accepted) per verify."""
    d, verifies = drive(prompt, tokens, spec, left=1000, n_ctx=4096)
    assert isinstance(d, SlotDrafts)
    return d, verifies


def test_a_copied_answer_is_verified_once_the_copy_shows_and_novel_text_is_not() -> None:
    rng = np.random.default_rng(7)
    block = [int(t) for t in rng.integers(1000, 2000, 60)]  # a file in the prompt
    prompt = [1, *[int(t) for t in rng.integers(2000, 3000, 30)], *block, 2]
    # the answer's own words, a copy of the file, its own words again
    before, after = ([int(t) for t in rng.integers(lo, lo + 1000, 20)] for lo in (3000, 4000))
    spec = Speculation(SpecConfig(("ngram-simple",)), EPYC, 512, True, "")
    d, verifies = answer(prompt, before + block + after, spec)
    # no verify on the answer's words; the copy checked by shadows until it is a run, then
    # verified in long drafts
    assert verifies, "the copy was verified"
    end = len(before) + len(block)
    assert len(before) < verifies[0][0] <= len(before) + 16, verifies
    assert all(len(before) < g < end for g, _, _ in verifies), verifies
    assert max(k for _, k, _ in verifies) >= 16, verifies
    copied = sum(min(m, end - g) for g, _, m in verifies)  # tokens of the copy verified
    assert copied >= len(block) - 16 - len(verifies), verifies
    assert d.summary()["ngram-simple"]["verifies"] == len(verifies)
    # an answer that copies nothing: shadows only, never a verify, never a pause
    d, verifies = answer(prompt, before + after, spec)
    assert verifies == [] and d.stats.pause_until == 0


def test_a_shadow_checks_the_tokens_that_come_instead() -> None:
    spec = Speculation(SpecConfig(("ngram-simple",), NgramParams(simple_size_n=3,
                                                                 simple_size_m=4)),
                       EPYC, 512, True, "")
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    d = SlotDrafts.start(spec, np.asarray(prompt, dtype=np.intc))
    # the waiting token 8 after "6 7": ngram-simple drafts what followed "6 7 8" in the prompt
    assert d.propose(np.asarray([*prompt, 6, 7], dtype=np.intc), 8, 3, 100, 4096) == []
    assert d.shadow == [9, 10, 11, 12] and d.shadowed == 0, "turned down: a shadow"
    d.propose(np.asarray([*prompt, 6, 7, 8], dtype=np.intc), 9, 4, 100, 4096)
    d.propose(np.asarray([*prompt, 6, 7, 8, 9], dtype=np.intc), 10, 5, 100, 4096)
    assert (d.shadowed, d.run) == (2, 2), "two of its tokens came"
    assert d.stats.reached[:2] == (1.0, 1.0) and sum(d.stats.rejected) == 0
    d.propose(np.asarray([*prompt, 6, 7, 8, 9, 10], dtype=np.intc), 99, 6, 100, 4096)
    assert d.run == 0 and d.stats.rejected[2] == 1.0, "the third did not: the run ends there"
