"""The host's KV events read by their consumer's own decoder: NVIDIA Dynamo's relay
(`KvEventPublisher(zmq_endpoint=...)`, registered as `prefixgate dynamo-worker` registers a
host) into Dynamo's KV router, whose overlap scores say, per tier, which blocks the host holds.
Dynamo's runtime on loopback with file discovery; no model."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from backend.protocol import TierEvent
from proxy.kv_events import KvEvents
from tests.conftest import free_port

os.environ.setdefault("DYN_LOG", "warn")  # Dynamo logs every step at INFO
llm = pytest.importorskip("dynamo.llm", reason="needs ai-dynamo-runtime (the test extra: "
                          "Linux x86_64 and aarch64 wheels only)")

BS = 16
PROMPT = list(range(1000, 1000 + 5 * BS + 7))  # 5 whole blocks and 7 tokens


def loopback_dynamo(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
    """Dynamo's runtime with file discovery in `tmp`, every socket on 127.0.0.1."""
    for k, v in {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp),
                 "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
                 "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
                 "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_ENABLED": "false",
                 "DYN_LOG": "warn"}.items():
        monkeypatch.setenv(k, v)


async def scores_until(router: Any, ids: list[int], want: Any, timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        s = await router.get_overlap_scores(ids)
        rows = {(w["device_blocks"], w["host_pinned_blocks"], w["disk_blocks"])
                for w in s["workers"]}
        if want(rows) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.2)


async def test_dynamos_router_reads_each_tier_and_each_removal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.dynamo import open_runtime, register

    loopback_dynamo(monkeypatch, tmp_path / "discovery")
    port = free_port()
    pub = KvEvents(f"tcp://127.0.0.1:{port}", BS)
    runtime = await open_runtime()
    try:
        endpoint, relay = await register(runtime, "pgtest.host.generate", "http://h:1",
                                         f"tcp://127.0.0.1:{port}", BS)
        serving = asyncio.ensure_future(endpoint.serve_endpoint(
            lambda req, ctx=None: iter(())))
        router = llm.KvRouter(endpoint=endpoint, block_size=BS,
                              kv_router_config=llm.KvRouterConfig())
        # the disk holds 3 blocks' worth, the RAM tier 4, a slot's live KV all 5
        pub.disk("stored", b"k", PROMPT[: 3 * BS + 5])
        pub.tier_event("worker 0", TierEvent("stored", "ram", 1, "", "", 4 * BS,
                                             tuple(PROMPT[: 4 * BS])))
        pub.tier_event("worker 0", TierEvent("stored", "live", 0, "", "", len(PROMPT),
                                             tuple(PROMPT)))
        # Dynamo's columns are cumulative: device, then host or better, then disk or better
        rows = await scores_until(router, PROMPT, lambda r: r == {(5, 5, 5)})
        assert rows == {(5, 5, 5)}
        # the slot is replaced: what stays is on the host tier (4) and the disk (3)
        pub.tier_event("worker 0", TierEvent("removed", "live", 0, "", "", 0))
        assert await scores_until(router, PROMPT, lambda r: r == {(0, 4, 4)}) == {(0, 4, 4)}
        # the worker restarted: its RAM tier is gone, the disk's entry stays
        pub.forget("worker 0")
        assert await scores_until(router, PROMPT, lambda r: r == {(0, 0, 3)}) == {(0, 0, 3)}
        # evicted from the disk: the host holds nothing of it
        pub.disk("removed", b"k", ())
        assert await scores_until(router, PROMPT, lambda r: r <= {(0, 0, 0)}) <= {(0, 0, 0)}
        serving.cancel()
        relay.shutdown()
    finally:
        runtime.shutdown()
        pub.close()
