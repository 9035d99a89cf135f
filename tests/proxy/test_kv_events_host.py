"""A real host's KV events (`prefixgate serve --kv-events`), every tier of it, read by a ZMQ
subscriber with vLLM's own schema: a prompt's blocks enter the device tier (the slot's live
KV), the disk (its snapshot committed) and the shared tier (published to a real redis-server);
when another prompt replaces the slot, they leave the device tier and enter the RAM tier."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import zmq

from tests.conftest import PASSWORD, Redis, free_port, running
from tests.proxy.test_disk_cache import ask
from tests.proxy.test_kv_events import DECODE, VllmBlockRemoved, VllmBlockStored

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="needs Debian's redis-server (.ci/run installs it)")]

BS = 16
SYSTEM = " ".join(f"Ledger rule {i}: total each column, then round to cents." for i in range(20))


def collect(sub: zmq.Socket, held: dict[str, set[int]], until_s: float) -> None:
    """Apply the batches that come until `until_s` to `held`: medium -> block hashes."""
    while time.monotonic() < until_s:
        if not sub.poll(100):
            continue
        _, _, payload = sub.recv_multipart()
        for e in DECODE.decode(payload).events:
            if isinstance(e, VllmBlockStored):
                held.setdefault(e.medium or "", set()).update(e.block_hashes)
            elif isinstance(e, VllmBlockRemoved):
                held.setdefault(e.medium or "", set()).difference_update(e.block_hashes)
            else:
                held.clear()


def wait_held(sub: zmq.Socket, held: dict[str, set[int]], check, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        collect(sub, held, time.monotonic() + 0.3)
    assert check(), {m: len(h) for m, h in held.items()}


def test_every_tier_of_a_host_is_published(tmp_path: Path, redis_server: Redis) -> None:
    port = free_port()
    with running(tmp_path / "h", "--workers", "1", "--cache-ram", "64", "--kv-events",
                 f"tcp://127.0.0.1:{port}", "--kv-block-size", str(BS),
                 "--shared-tier", redis_server.url) as host:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        held: dict[str, set[int]] = {}
        try:
            p = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "Which rule is about cents?"}]
            first = ask(host, p)
            assert first["cached"] == 0
            # the prompt's blocks: live on the device, its snapshot on the disk and in the
            # shared tier (the first of them: the chat template's own opening)
            wait_held(sub, held, lambda: all(len(held.get(m, ())) >= 10
                                             for m in ("GPU", "DISK", "EXTERNAL")))
            device = set(held["GPU"])
            # another prompt replaces the slot: its blocks leave the device for the RAM tier
            ask(host, [{"role": "user", "content": "Unrelated: name a prime number."}])
            wait_held(sub, held, lambda: device <= held.get("CPU_PINNED", set())
                      and not device & held.get("GPU", set()))
            assert held["DISK"] and held["EXTERNAL"]  # the snapshots stay where they are
        finally:
            sub.close(0)
    assert PASSWORD not in host.log()
