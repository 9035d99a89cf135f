"""What a CPU worker measures once before it serves (backend.worker.batch, issue 41), on the real
model: the padded batches where short batches may cost a flash attention tile, then the batch
of 128 against 512 deeper into the prompt, each bounded by the slot's room, the slot left
empty; and the choices made from it."""

from __future__ import annotations

import pytest

from backend.engine import Engine
from backend.worker import batch
from policies.prefix import CPU_BATCH, GPU_BATCH, choose_batch, choose_padding
from tests.models import model_file

pytestmark = pytest.mark.model


def test_the_measure_reads_the_padding_and_the_batch_within_the_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch, "REPS", 1)  # the least of one run each: what is read, not how fast
    # a slot of 1,536 tokens: room for both measures 512 tokens in (each leaves two batches of
    # 512 after it), not the 2,048 and 4,096 of a long slot
    eng = Engine(model_file("smollm2"), 1536, 2, 0, n_batch=GPU_BATCH, flash_attn="on")
    try:
        seen: list[float] = []
        got = batch.measure(eng, batch=True, pad=True, progress=seen.append)
        assert eng.seqs[0].n_live == 0, "the measured slot is left empty"
        # the loading worker's progress while it measures: batch by batch, to all it planned
        assert len(seen) > 4 and seen == sorted(seen) and seen[-1] == 1.0, seen
    finally:
        eng.close()
    assert got["depth"] == got["batch_depth"] == 512
    assert batch.DEPTH < batch.BATCH_DEPTH
    assert set(got["pad_s"]) == set(batch.PAD_ROWS)
    assert set(got["token_s"]) == {CPU_BATCH, GPU_BATCH}
    assert all(s > 0 for s in [*got["pad_s"].values(), *got["token_s"].values()])
    assert choose_batch(got["token_s"]) in (CPU_BATCH, GPU_BATCH)
    pad = choose_padding(got["pad_s"], got["depth"])
    assert pad.past in (0, 512)


def test_one_measure_for_any_number_of_slots_of_the_same_context() -> None:
    """`-np 1 -c 12288` and `-np 3 -c 36864` measure the same slot and share one measure (and so
    one batch); several slots under `--deterministic on` may take flash attention off, and a
    slot too short for the measure's depths reads other depths: each its own."""
    from backend.worker.boot import WorkerSpec, measure_name
    from proxy.cli import worker_spec
    from proxy.config import Config

    def name(**kw: object) -> str:
        spec = worker_spec(Config(model=model_file("smollm2"), n_gpu_layers=0, **kw), 0)  # type: ignore[arg-type]
        assert isinstance(spec, WorkerSpec)
        return measure_name(spec)

    one = name(parallel=1, n_ctx=12288)
    assert name(parallel=3, n_ctx=3 * 12288) == name(parallel=2, n_ctx=2 * 12288) == one
    assert name(parallel=1, n_ctx=65536) == one, "past the measure's depths a slot reads alike"
    assert name(parallel=3, n_ctx=3 * 2048) != name(parallel=1, n_ctx=3 * 2048)
    assert name(parallel=3, n_ctx=3 * 12288, deterministic="on") != one
    assert name(parallel=1, n_ctx=12288, deterministic="on") == one
    assert name(parallel=1, n_ctx=12288, threads=1) != one
