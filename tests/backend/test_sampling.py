"""Greedy sampling read off the logits in place (backend.sampling) draws what llama.cpp's sampler
chain draws, on every model family, and only where nothing comes before the greedy pick; the
chain's other samplers (llama-server's: DRY, XTC, typical, top-n-sigma, mirostat, logit biases,
ignore_eos, the order) do what llama.cpp's do. Token for token against llama-server itself:
`python -m bench.samplers`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import llama_cpp
import pytest

from backend.engine import Engine
from backend.sampling import Sampling
from tests.models import FLASH_ATTN, GPU_LAYERS, MODELS, model_file

pytestmark = pytest.mark.model

STEPS = 48


@pytest.mark.parametrize("name", MODELS)
def test_greedy_in_place_draws_what_the_chain_draws(name: str) -> None:
    """Every step of a greedy answer: the in-place pick equals the chain's on the same logits
    (a second sampler made to go through its chain)."""
    eng = Engine(model_file(name), 1024, 2, GPU_LAYERS, flash_attn=FLASH_ATTN)
    try:
        vocab = llama_cpp.Llama(model_file(name), vocab_only=True, verbose=False)
        ids = vocab.tokenize(b"Once upon a time, in a village by the sea, there lived",
                             add_bos=True)
        fast, chain = eng.sampler(Sampling(temperature=0.0)), eng.sampler(Sampling(
            temperature=0.0))
        chain.argmax = 0  # through llama.cpp's chain
        assert fast.argmax == llama_cpp.llama_vocab_n_tokens(eng.vocab)
        eng.prefill(0, ids)
        drawn = []
        for _ in range(STEPS):
            token = eng.sample(0, fast)
            assert token == eng.sample(0, chain), drawn
            drawn.append(token)
            eng.evaluate([(0, [token])])  # on past an end of generation: more steps compared
        assert len(set(drawn)) > 1, "a degenerate answer proves little"
        fast.close()
        chain.close()
    finally:
        eng.close()


@pytest.fixture(scope="module")
def small() -> Iterator[Engine]:
    eng = Engine(model_file(MODELS[0]), 256, 1, GPU_LAYERS)
    yield eng
    eng.close()


@pytest.mark.parametrize(("sampling", "grammar", "in_place"), [
    (Sampling(temperature=0.0), None, True),
    (Sampling(temperature=0.0, repeat_penalty=1.1), None, False),
    (Sampling(temperature=0.0, presence_penalty=0.5), None, False),
    (Sampling(temperature=0.0, frequency_penalty=0.5), None, False),
    (Sampling(temperature=0.0), 'root ::= "yes" | "no"', False),
    (Sampling(temperature=0.7), None, False),
    (Sampling(temperature=0.0, dry_multiplier=0.8), None, False),
    (Sampling(temperature=0.0, dry_multiplier=0.8, samplers=("top_k", "temperature")), None,
     True),  # DRY not in the chain
    (Sampling(temperature=0.0, xtc_probability=0.5), None, False),
    (Sampling(temperature=0.0, xtc_probability=0.5, xtc_threshold=0.6), None, True),  # off
    (Sampling(temperature=0.0, mirostat=2), None, False),
    (Sampling(temperature=0.0, logit_bias=((5, 1.0),)), None, False),
    (Sampling(temperature=0.0, ignore_eos=True), None, False),
    (Sampling(temperature=0.0, samplers=("top_k",)), None, False),  # no temperature stage
    (Sampling(temperature=0.0, typical_p=0.5, top_n_sigma=1.0), None, True),
])
def test_only_greedy_alone_is_read_in_place(small: Engine, sampling: Sampling,
                                            grammar: str | None, in_place: bool) -> None:
    s = small.sampler(sampling, grammar)
    try:
        assert bool(s.argmax) is in_place
    finally:
        s.close()


def _draws(eng: Engine, s: Sampling, ids: list[int], steps: int = STEPS) -> list[int]:
    """A fresh answer to `ids` through one sampler: the tokens drawn, each evaluated."""
    eng.truncate(0, 0)
    eng.prefill(0, ids)
    sampler = eng.sampler(s)
    try:
        out = []
        for _ in range(steps):
            out.append(eng.sample(0, sampler))
            eng.evaluate([(0, [out[-1]])])
        return out
    finally:
        sampler.close()


@pytest.fixture(scope="module")
def echo() -> Iterator[tuple[Engine, list[int]]]:
    """The 135M model and a prompt its greedy answer repeats."""
    eng = Engine(model_file(MODELS[0]), 512, 1, GPU_LAYERS)
    vocab = llama_cpp.Llama(model_file(MODELS[0]), vocab_only=True, verbose=False)
    yield eng, vocab.tokenize(b"red green blue red green blue red green blue red green blue",
                              add_bos=True)
    eng.close()


def test_the_chain_s_samplers_act(echo: tuple[Engine, list[int]]) -> None:
    eng, ids = echo
    greedy = _draws(eng, Sampling(temperature=0.0), ids)
    assert len(set(greedy)) < len(greedy) // 3, "the prompt should make the answer repeat"
    # a ban moves the first draw to another token; a large bias makes a token the draw
    banned = _draws(eng, Sampling(temperature=0.0, logit_bias=((greedy[0], -math.inf),)), ids, 1)
    assert banned[0] != greedy[0]
    forced = _draws(eng, Sampling(temperature=0.0, logit_bias=((1234, 1e4),)), ids, 3)
    assert forced == [1234, 1234, 1234]
    # ignore_eos bans every end-of-generation token, whatever else pushes it
    eog = min(eng.eog)
    assert _draws(eng, Sampling(temperature=0.0, logit_bias=((eog, 1e4),)), ids, 1) == [eog]
    assert _draws(eng, Sampling(temperature=0.0, logit_bias=((eog, 1e4),), ignore_eos=True),
                  ids, 1)[0] not in eng.eog
    # DRY penalizes continuing the repeat: the answer parts from the greedy one
    dry = _draws(eng, Sampling(temperature=0.0, dry_multiplier=2.0, dry_allowed_length=1), ids)
    assert dry != greedy
    # a chain whose order has the temperature stage first is still greedy at 0
    assert _draws(eng, Sampling(temperature=0.0, samplers=("temperature", "top_k")),
                  ids) == greedy
    # seeded draws repeat; another seed or sampler draws otherwise
    hot = Sampling(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    first = _draws(eng, hot, ids)
    assert first == _draws(eng, hot, ids)
    others = [_draws(eng, dataclasses.replace(hot, **kw), ids) for kw in (
        {"seed": 8}, {"typical_p": 0.2}, {"top_n_sigma": 0.5}, {"mirostat": 2},
        {"xtc_probability": 1.0, "xtc_threshold": 0.05}, {"dynatemp_range": 1.4})]
    assert all(o != first for o in others), others


def test_a_draw_the_grammar_forbids_is_an_error_never_an_abort(echo: tuple[Engine, list[int]]
                                                              ) -> None:
    """The fuzz found it (a repetition penalty of 0 made the masked logits NaN): llama.cpp's
    grammar throws from inside its accept when the chain picks a masked token, which aborts the
    worker. Values that make logits no numbers are refused, and a pick is checked before it is
    accepted (here an +inf bias on a masked token, with no temperature stage)."""
    eng, ids = echo
    eng.truncate(0, 0)
    eng.prefill(0, ids)
    with pytest.raises(ValueError, match="repetition penalty must be a number above 0"):
        eng.sampler(Sampling(temperature=0.0, repeat_penalty=0.0))
    nan = eng.sampler(Sampling(temperature=1.0, seed=3, samplers=("top_k",), top_k=0,
                               logit_bias=((999, math.inf),)), 'root ::= "a"', 0)
    try:
        with pytest.raises(ValueError, match="drew no token the grammar allows"):
            eng.sample(0, nan)
    finally:
        nan.close()
    ok = eng.sampler(Sampling(temperature=0.7, seed=3, repeat_penalty=1.3), 'root ::= "a" "b"',
                     0)
    try:
        first = eng.sample(0, ok)
        assert eng.piece(first) == b"a"
    finally:
        ok.close()


def test_a_reasoning_budget_forces_its_end_through_the_chain(echo: tuple[Engine, list[int]]
                                                             ) -> None:
    """The worker's side of the reasoning budget (policies.reasoning_budget): from the block
    the prompt opened, N tokens drawn as the model would, then the forced ones, then the model
    again; greedy in place and seeded through the chain alike (llama-server's answers with a
    budget, token for token: `python -m bench.samplers`)."""
    eng, ids = echo
    OPEN, CLOSE = 1000, 1001  # as the tags' tokens (the model writes neither here)
    forced = (2000, 2001, CLOSE)
    budget = {"reasoning_budget_tokens": 3, "reasoning_budget_start": (OPEN,),
              "reasoning_budget_end": ((CLOSE,),), "reasoning_budget_forced": forced,
              "reasoning_budget_prefill": (OPEN,)}
    for s in (Sampling(temperature=0.0), Sampling(temperature=1.2, top_k=0, top_p=1.0,
                                                  min_p=0.0, seed=11)):
        free = _draws(eng, s, ids, 12)
        cut = _draws(eng, dataclasses.replace(s, **budget), ids, 12)
        assert cut[:3] == free[:3] and tuple(cut[3:6]) == forced, (free, cut)
    # a block it never opens forces nothing
    closed = dataclasses.replace(Sampling(temperature=0.0), **{
        **budget, "reasoning_budget_prefill": ()})
    assert _draws(eng, closed, ids, 8) == _draws(eng, Sampling(temperature=0.0), ids, 8)


def test_a_reasoning_budget_in_a_verify_batch(echo: tuple[Engine, list[int]]) -> None:
    """Speculation's verify (backend.worker.verify): the rows of one batch are drawn in order,
    each drawn token fed to the budget, so the forced token is the correction that ends the
    accepted drafts, at the same place as one token a step."""
    eng, ids = echo
    OPEN, CLOSE = 1000, 1001
    budget = {"reasoning_budget_tokens": 2, "reasoning_budget_start": (OPEN,),
              "reasoning_budget_end": ((CLOSE,),), "reasoning_budget_forced": (2000, CLOSE),
              "reasoning_budget_prefill": (OPEN,)}
    s = dataclasses.replace(Sampling(temperature=0.0), **budget)
    stepwise = _draws(eng, s, ids, 6)
    free = _draws(eng, Sampling(temperature=0.0), ids, 6)
    assert stepwise[:2] == free[:2] and stepwise[2:4] == [2000, CLOSE]
    eng.truncate(0, 0)
    eng.prefill(0, ids)
    sampler = eng.sampler(s)
    try:
        waiting = eng.sample(0, sampler)  # the budget's first token
        drafts = free[1:5]  # a draft of the unbounded answer: the budget parts from it
        eng.evaluate([(0, [waiting, *drafts])], every=[0])
        rows = []
        for i in range(len(drafts) + 1):
            rows.append(eng.sample(0, sampler, i))
            if i == len(drafts) or rows[-1] != drafts[i]:
                break
    finally:
        sampler.close()
    assert [waiting, *rows] == stepwise[:3], "the draft accepted up to the budget, then forced"
