"""A prefixgate host registered with an NVIDIA Dynamo runtime (`prefixgate dynamo-worker`): the
host's KV events relayed into Dynamo's event plane, so Dynamo's KV router knows which prefixes
the host holds, and on which tier. The placement itself is Dynamo's (`proxy/front.py` asks its
`KvRouter`); requests still go to the host over its own HTTP API.

    prefixgate dynamo-worker --host-url http://HOST:8080 --kv-events tcp://HOST:5557
        [--kv-block-size 16] [--namespace prefixgate] [--component host]

What it does, in order (Dynamo's backend contract for an engine with ZMQ KV events, the way
its vLLM backend relays vLLM's):
1. waits for the host's `GET /health` (a loading host takes no requests);
2. opens a `DistributedRuntime` (its discovery, request and event planes from Dynamo's own
   variables: DYN_DISCOVERY_BACKEND, default `file` (DYN_FILE_KV: the directory), etcd or
   kubernetes; DYN_REQUEST_PLANE `tcp`; DYN_EVENT_PLANE `zmq` or nats);
3. registers the host on `NAMESPACE.COMPONENT.generate` as a token-input model with
   `kv_cache_block_size` (what the router reads), a worker-local indexer (a router that starts
   or restarts asks it for the host's blocks), and the host's URL (`engine_specific.host_url`);
4. relays the host's ZMQ KV events with Dynamo's own `KvEventPublisher(zmq_endpoint=...)`;
5. serves the endpoint: any request to it is answered with the host's URL (the front asks it
   once per host; generation goes over HTTP, where prefixgate's APIs, layout and cache live);
6. watches the host: after `DOWN_CHECKS` failed health checks the instance is withdrawn from
   discovery (the router stops placing there), and registered again when the host is back.
   One log line each.

The Dynamo runtime is `ai-dynamo-runtime` (`pip install 'prefixgate[dynamo]'`); nothing else
of prefixgate imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from backend.redact import redact_url

log = logging.getLogger("prefixgate.dynamo")

HEALTH_EVERY_S = 2.0
DOWN_CHECKS = 3
HEALTH_TIMEOUT_S = 5.0


def need_dynamo(what: str) -> None:
    """One line, where the runtime is missing."""
    try:
        import dynamo.llm  # noqa: F401
    except ImportError:
        raise SystemExit(f"prefixgate {what}: NVIDIA Dynamo's runtime is not installed; "
                         "`pip install 'prefixgate[dynamo]'` (ai-dynamo-runtime)") from None


def quiet_dynamo() -> None:
    """Dynamo's Rust runtime logs every step at INFO: warnings only, unless DYN_LOG says."""
    os.environ.setdefault("DYN_LOG", "warn")


async def open_runtime() -> Any:
    from dynamo.runtime import DistributedRuntime

    return DistributedRuntime(asyncio.get_running_loop(),
                              os.environ.get("DYN_DISCOVERY_BACKEND") or "file",
                              os.environ.get("DYN_REQUEST_PLANE") or "tcp",
                              event_plane=os.environ.get("DYN_EVENT_PLANE") or "zmq")


def endpoint_path(namespace: str, component: str) -> str:
    return f"{namespace}.{component}.generate"


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=HEALTH_TIMEOUT_S) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


async def register(runtime: Any, path: str, host_url: str, kv_events: str, block_size: int,
                   model_name: str = "prefixgate") -> tuple[Any, Any]:
    """Register the host (steps 3 and 4): (its endpoint, the relay)."""
    from dynamo.llm import (
        KvEventPublisher,
        ModelInput,
        ModelRuntimeConfig,
        ModelType,
        WorkerType,
        register_model,
    )

    endpoint = runtime.endpoint(path)
    rc = ModelRuntimeConfig()
    rc.enable_local_indexer = True
    rc.set_engine_specific("host_url", json.dumps(host_url))
    await register_model(ModelInput.Tokens, ModelType.Completions, endpoint, "prefixgate",
                         model_name, worker_type=WorkerType.Aggregated,
                         kv_cache_block_size=block_size, runtime_config=rc,
                         skip_model_assets=True)
    relay = KvEventPublisher(endpoint, kv_block_size=block_size, zmq_endpoint=kv_events,
                             enable_local_indexer=True)
    return endpoint, relay


def address_card(host_url: str) -> Any:
    """The endpoint's handler: whatever is asked, the host's URL."""

    async def handler(request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        yield {"host_url": host_url,
               "note": "a prefixgate host: send requests to its HTTP API at host_url"}

    return handler


async def watch(endpoint: Any, host_url: str) -> None:
    """Step 6: withdraw the instance while the host is down, register it again once back."""
    failed, listed = 0, True
    while True:
        await asyncio.sleep(HEALTH_EVERY_S)
        ok = await asyncio.to_thread(healthy, host_url)
        failed = 0 if ok else failed + 1
        if listed and failed >= DOWN_CHECKS:
            await endpoint.unregister_endpoint_instance()
            listed = False
            log.warning("host %s is down (%d failed health checks): withdrawn from Dynamo's "
                        "router", redact_url(host_url), failed)
        elif not listed and ok:
            await endpoint.register_endpoint_instance()
            listed = True
            log.info("host %s is back: registered with Dynamo's router again",
                     redact_url(host_url))


async def run_worker(a: argparse.Namespace) -> None:
    waited = False
    while not await asyncio.to_thread(healthy, a.host_url):
        if not waited:
            log.info("waiting for the host %s to be ready", redact_url(a.host_url))
            waited = True
        await asyncio.sleep(0.5)
    runtime = await open_runtime()
    path = endpoint_path(a.namespace, a.component)
    endpoint, relay = await register(runtime, path, a.host_url, a.kv_events, a.kv_block_size)
    log.info("host %s registered with Dynamo on %s as worker %d: its KV events relayed from "
             "%s in blocks of %d tokens", redact_url(a.host_url), path, endpoint.connection_id(),
             a.kv_events, a.kv_block_size)
    watcher = asyncio.create_task(watch(endpoint, a.host_url))
    try:
        await endpoint.serve_endpoint(address_card(a.host_url))
    finally:
        watcher.cancel()
        relay.shutdown()
        runtime.shutdown()


def worker_main(argv: list[str]) -> None:
    from proxy.kv_events import DEFAULT_BLOCK_SIZE

    p = argparse.ArgumentParser(
        prog="prefixgate dynamo-worker", allow_abbrev=False,
        description="Register a prefixgate host with NVIDIA Dynamo: relay its KV events "
        "(prefixgate serve --kv-events) to Dynamo's KV router (docs/routing.md).")
    p.add_argument("--host-url", required=True,
                   help="the host's HTTP address as the front reaches it, http://HOST:PORT")
    p.add_argument("--kv-events", required=True,
                   help="the host's --kv-events address, tcp://HOST:PORT")
    p.add_argument("--kv-block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="the host's --kv-block-size")
    p.add_argument("--namespace", default="prefixgate", help="Dynamo namespace")
    p.add_argument("--component", default="host", help="Dynamo component of the hosts")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    if not a.host_url.startswith(("http://", "https://")):
        raise SystemExit(f"prefixgate dynamo-worker: --host-url {redact_url(a.host_url)}: give "
                         "http://HOST:PORT")
    need_dynamo("dynamo-worker")
    quiet_dynamo()
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(run_worker(a))
