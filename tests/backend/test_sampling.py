"""Greedy sampling read off the logits in place (backend.sampling) draws what llama.cpp's sampler
chain draws, on every model family, and only where nothing comes before the greedy pick."""

from __future__ import annotations

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
])
def test_only_greedy_alone_is_read_in_place(small: Engine, sampling: Sampling,
                                            grammar: str | None, in_place: bool) -> None:
    s = small.sampler(sampling, grammar)
    try:
        assert bool(s.argmax) is in_place
    finally:
        s.close()
