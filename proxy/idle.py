"""`--sleep-idle-seconds N` (llama-server's): after N seconds in which no request ran or waited,
the local workers leave memory (the model's weights and KV: the GPU is free for something
else); the next request loads them again and waits for it, as llama-server's does.

What survives the sleep is what the cache keeps on disk: the prompts' snapshots (and the shared
tier), so the first turn after waking restores its prefix instead of prefilling it. The live KV
and the RAM tier go with the workers. `/health`, `/props`, `/metrics`, `/slots`, the status page
and the tokenizer endpoints answer while it sleeps without waking it; `/props` says
`is_sleeping`. Remote workers (`--worker-url`) are not this server's to stop: refused at start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

log = logging.getLogger("prefixgate")


class Sleeper(Protocol):
    """What of `proxy.workers.Pool` the watch reads and drives."""

    sleeping: bool
    used_s: float  # when a request last took or gave back a slot (monotonic)

    @property
    def all_ready(self) -> bool: ...

    @property
    def queue_depth(self) -> int: ...

    def busy(self) -> bool: ...

    async def sleep(self) -> None: ...


def due(now_s: float, used_s: float, seconds: float, busy: bool, waiting: int,
        ready: bool) -> bool:
    """Whether to sleep now: every worker ready (none loading or restarting), no slot busy, no
    request waiting, and the last one given back `seconds` ago or more."""
    return ready and not busy and waiting == 0 and now_s - used_s >= seconds


async def watch(pool: Sleeper, seconds: float) -> None:
    """For as long as the server runs: put the pool to sleep when it is due."""
    while True:
        await asyncio.sleep(min(1.0, seconds / 4))
        if not pool.sleeping and due(time.monotonic(), pool.used_s, seconds, pool.busy(),
                                     pool.queue_depth, pool.all_ready):
            log.info("no request for %.0f s (--sleep-idle-seconds): the workers leave memory; "
                     "the next request loads them again", seconds)
            await pool.sleep()
