"""bench.random_model: the default Qwen3.5 is the test fixture byte for byte (its tests' answers
depend on it), and `--size` makes a Qwen3.5 of other dimensions that llama.cpp loads, runs and
cuts back through its rollback states."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.engine import Engine
from bench.random_model import generate
from tests.models import FIXTURES, model_file

pytestmark = pytest.mark.model

VOCAB = FIXTURES / "llama.cpp" / "models" / "ggml-vocab-qwen35.gguf"


def test_the_default_qwen35_is_the_fixture(tmp_path: Path) -> None:
    out = generate("qwen35", VOCAB, tmp_path / "q.gguf")
    assert out.read_bytes() == Path(model_file("qwen35")).read_bytes()


def test_a_qwen35_of_another_size_runs_and_rolls_back(tmp_path: Path) -> None:
    out = generate("qwen35", VOCAB, tmp_path / "q.gguf", layers=4, size=(512, 4, 2, 640))
    eng = Engine(str(out), 256, 2, 0, n_batch=64, rollback=4, outputs=8)
    try:
        assert eng.memory.kind == "recurrent" and eng.memory.rollback == 4
        ids = list(range(1000, 1040))
        eng.prefill(0, ids[:32])
        eng.evaluate([(0, ids[32:37])], every=[0])  # a verify of 5 rows: 4 may go again
        assert eng.floor(0) == 33 and eng.truncate(0, 34) == 34
        assert eng.floor(0) == 34  # once
    finally:
        eng.close()
