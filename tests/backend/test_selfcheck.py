"""The start-up self-check (issue 19) on each kind of memory, in this process: it passes on the
suite's models with the default settings and with flash attention and a quantized KV cache, it
refuses a real sliding window by rule, and an injected inexact restore (one bit of the loaded
state flipped, PREFIXGATE_FAULT=restore-bit) is caught, named by cache, layer and cell, and
by the verify batches speculation runs after a restore where the flipped bit reaches them."""

from __future__ import annotations

from typing import Any

import llama_cpp
import pytest

from backend import selfcheck
from backend.engine import Engine
from policies.prefix import FA_TILE, Padding
from tests.models import BATCH, FLASH_ATTN, GPU_LAYERS, MEMORY, MODELS, model_file

pytestmark = pytest.mark.model

SETTINGS = {
    "default": {"flash_attn": FLASH_ATTN},
    "flash attention, q8_0 KV": {"flash_attn": "on", "type_k": "q8_0", "type_v": "q8_0"},
}


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
@pytest.mark.parametrize("name", MODELS)
def test_the_self_check_proves_exact_reuse(name: str, settings: dict[str, str]) -> None:
    eng = Engine(model_file(name), 4096, 2, GPU_LAYERS, n_batch=BATCH,
                 **settings)  # type: ignore[arg-type]
    seen: list[float] = []
    report = selfcheck.run(eng, seen.append)
    eng.close()
    assert report.ok, report.failure
    assert report.decode is None, "one slot: no decode steps to batch"
    # its progress (the loading worker's /health while it runs) rises batch by batch to about
    # all it planned, and never says done before it is
    assert len(seen) > 3 and seen == sorted(seen) and 0.9 <= seen[-1] <= 0.99, seen
    checks = [r.check.split("@")[0] for r in report.rows]
    assert checks.count("restore") == 2
    assert checks.count("live") == (0 if name == "qwen35" else 1)
    # a recurrent state cannot cut rejected drafts back: it never speculates
    assert checks.count("verify") == (0 if name == "qwen35" else 1)
    # past the window and two batches (a window snapshot's padding is exercised), and past
    # three: 225 tokens at a batch of 64, 673 on Gemma 3's window of 512
    window = 512 if name == "gemma3" else 0
    assert max(3 * BATCH, window + 2 * BATCH) < report.probe_tokens <= max(
        3 * BATCH, window + 2 * BATCH) + BATCH


@pytest.mark.parametrize("name", MODELS)
def test_an_inexact_restore_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXGATE_FAULT", "restore-bit")
    eng = Engine(model_file(name), 4096, 2, GPU_LAYERS, n_batch=BATCH, flash_attn=FLASH_ATTN)
    # the probe's first batch ends early, after an end-of-turn token: off the batch multiples
    first = eng.batching.edges(selfcheck.probe_ids(eng)).next(0)
    assert 0 < first < eng.batching.size
    report = selfcheck.run(eng)
    eng.close()
    assert not report.ok
    failed = [r for r in report.rows if not r.ok]
    # a verify after the cold state restored (speculation's rows) fails where the flipped bit
    # reaches its logits (on SmolLM2; not on Gemma 3's global layer)
    verify = [r for r in failed if r.check.startswith("verify")]
    assert [r.check.split("@")[0] for r in failed if r not in verify] == ["restore", "restore"]
    assert all(r.detail.startswith("a verify of ") and r.detail.endswith("logits differ")
               for r in verify), failed
    assert verify or name != "smollm2", "the flipped bit changed no verify row's logits"
    # the flipped bit is the last K row of the first cache's first layer: position p - 1
    assert failed[0].detail.startswith("cache: layer 0 K differs"), failed[0].detail
    assert f"(position {first - 1})" in failed[0].detail
    assert report.failure.startswith(f"restore@{first}: ")


def test_a_real_window_is_refused_by_rule() -> None:
    eng = Engine(model_file("gemma3"), 4096, 2, GPU_LAYERS, swa_full=False)
    report = selfcheck.run(eng)
    eng.close()
    assert not report.ok and report.rows[0].check == "configuration"
    assert "--swa-full" in report.failure


@pytest.mark.parametrize("name", [m for m in MODELS if MEMORY[m] != "recurrent"])
def test_padded_short_batches_are_replayed_exactly(name: str) -> None:
    """Flash attention batches of 16-63 rows padded to a tile of 64 (policies.prefix.Padding,
    issue 41): the padding's cells are dropped after each step, and the self-check's cold run,
    cut-back and restores, each padding the same batches, agree bit for bit. Not on a recurrent
    model, whose state cannot drop the padding's cells (the worker never pads one)."""
    eng = Engine(model_file(name), 4096, 2, GPU_LAYERS, n_batch=BATCH, flash_attn="on")
    eng.padding = Padding(16, 0)
    ids = selfcheck.probe_ids(eng)
    edges = eng.batching.edges(ids)
    assert 16 <= len(ids) - edges.floor(len(ids) - 1) < FA_TILE  # its last batch is padded
    fills: list[int] = []
    evaluate = eng.evaluate

    def spy(rows: Any, pads: Any = (), every: Any = (), fill: int = 0) -> None:
        fills.append(fill)
        evaluate(rows, pads, every, fill)
    eng.evaluate = spy  # type: ignore[method-assign]
    eng.prefill(0, ids)
    assert eng.seqs[0].n_live == len(ids)
    assert llama_cpp.llama_memory_seq_pos_max(eng.mem, 0) == len(ids) - 1  # no padding cell
    cuts = [0, *sorted(edges.down(len(ids) - 1, 0)), len(ids)]
    sizes = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    assert fills == [FA_TILE - n if 16 <= n < FA_TILE else 0 for n in sizes]
    assert any(fills)
    eng.truncate(0, 0)
    report = selfcheck.run(eng)
    eng.close()
    assert report.ok, report.failure
