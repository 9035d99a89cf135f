"""`--workers N` on N GPUs: each local worker sees its own (CUDA_VISIBLE_DEVICES), a table."""

from __future__ import annotations

import pytest

from proxy.worker_link import worker_gpus


@pytest.mark.parametrize(
    ("visible", "workers", "worker_id", "gpu_layers", "expected"),
    [
        ("0,1", 2, 0, -1, "0"),  # one worker per GPU
        ("0,1", 2, 1, 99, "1"),
        ("GPU-ab12, GPU-cd34,GPU-ef56", 3, 2, -1, "GPU-ef56"),  # UUIDs, spaces
        ("2,3,5", 2, 1, -1, "3"),  # more GPUs than workers: the first ones
        ("0", 2, 1, -1, None),  # fewer GPUs than workers: left as it is
        ("0,1", 1, 0, -1, None),  # one worker: it sees them all (one model split across)
        ("0,1", 2, 0, 0, None),  # a CPU worker: nothing to pin
        (None, 2, 0, -1, None),  # nothing said: nothing changed
        ("", 2, 0, -1, None),
    ],
)
def test_each_worker_gets_its_own_gpu(visible: str | None, workers: int, worker_id: int,
                                      gpu_layers: int, expected: str | None) -> None:
    assert worker_gpus(visible, workers, worker_id, gpu_layers) == expected
