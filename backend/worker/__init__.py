"""The worker process: one llama.cpp context holding `--parallel` slots, behind a small HTTP API
(backend/protocol.py), in the shape vLLM, SGLang and llama-server each give their engine core:

    core      sans-I/O slot machines: apply(input, world) -> effects (what the worker decides)
    messages  the core's inputs, effects and world, as values
    job_state one slot's job as the core keeps it
    tiers     every place a state can be besides a live slot (RAM, the write queue, the disk,
              the shared tier), and what enters and leaves each
    runner    the core's compute effects and the scheduler's steps, done on the engine
    loop      the threads: compute (llama.cpp calls only), reader (restores, pulls,
              verification), writer (state files, publishing)
    server    the HTTP shell
    boot      listen, load, self-check, choose the decode shape, serve

The decisions are pure and live in policies/: which state a prompt starts from
(`policies.sources`, the rule the proxy's `decide()` follows too), which step runs next and how
decode steps of several slots are shaped (`policies.schedule`). The engine (backend/engine.py)
evaluates explicit batches of several sequences and keeps the exactness rules.
"""

from backend.worker.boot import WorkerSpec, exactness, load_engine, serve, verdict_key
from backend.worker.tiers import SLOW_DISK_S, WRITE_REST_BYTES, WRITE_REST_S

__all__ = ["SLOW_DISK_S", "WRITE_REST_BYTES", "WRITE_REST_S", "WorkerSpec", "exactness",
           "load_engine", "serve", "verdict_key"]
