"""`--workers N` on N GPUs: each local worker sees its own (CUDA_VISIBLE_DEVICES), a table; on a
CPU, workers whose threads outnumber the cores are said (`cores_note`)."""

from __future__ import annotations

import pytest

from proxy.worker_link import Worker, cores_note, worker_gpus


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


def _worker(i: int, threads: int, gpu_layers: int = 0, remote: bool = False) -> Worker:
    w = Worker(i, "http://worker", socket_path=None if remote else f"/tmp/w{i}.sock")
    w.placement = {"backend": "CPU", "gpu_layers": gpu_layers, "threads": threads}
    return w


@pytest.mark.parametrize(
    ("workers", "cores", "says"),
    [
        ([_worker(0, 2), _worker(1, 2)], 2, "--threads-batch 1"),  # 4 threads on 2 cores
        ([_worker(0, 8), _worker(1, 8), _worker(2, 8)], 16, "--threads-batch 5"),
        ([_worker(0, 2), _worker(1, 2)], 4, ""),  # a core per thread
        ([_worker(0, 16)], 2, ""),  # one worker: its own threads, llama.cpp's choice
        ([_worker(0, 2, 99), _worker(1, 2, 99)], 2, ""),  # on GPUs: the CPU threads wait
        ([_worker(0, 2, remote=True), _worker(1, 2, remote=True)], 2, ""),  # other hosts
        ([_worker(0, 2), _worker(1, 2, 99)], 2, ""),  # one CPU worker of the two
    ],
)
def test_cpu_workers_that_share_the_cores_are_said(workers: list[Worker], cores: int,
                                                  says: str) -> None:
    note = cores_note(workers, cores)
    assert (says in note) if says else note == "", note
    if says:
        assert f"share {cores} cores" in note and "--parallel" in note
