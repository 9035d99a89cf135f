"""The compose file as shipped, read as docker-compose reads it (PyYAML, anchors and merge keys,
`${NAME:-default}` from deploy/.env.example; no docker-compose needed), each service's command
and environment turned into prefixgate's own Config (issue 42): every `.env` setting reaches the
proxy and every worker, the proxy's and the worker's cache identities agree field for field (the
one the proxy learns from its first worker aside), .env.example states the compose file's
defaults and fits a 24 GB card, and the healthchecks pass while a model loads, however long."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import serve_config, worker_config
from proxy.config import NOT_FLAGS, Config, cache_identity
from tests.conftest import ROOT, free_port

DEPLOY = ROOT / "deploy"
# set by the compose file itself, per container (where the API listens, the cache volume's
# mount, the proxy's workers and key file), and the API keys the proxy alone holds
COMPOSE_OWNED = {"host", "port", "cache_dir", "worker_url", "api_keys"}
PROXY_ONLY = {"api_key"}
# fingerprint fields the proxy takes from its first worker rather than its own Config
TAKEN_FROM_WORKER = {"compute"}
_VAR = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*))?\}")


def env_example() -> dict[str, str]:
    """deploy/.env.example's settings (the lines not commented out)."""
    lines = (DEPLOY / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """docker-compose's interpolation: ${NAME}, ${NAME:-default} (unset or empty), ${NAME-default}
    (unset)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _VAR.sub(one, value)


def compose(env: dict[str, str]) -> dict[str, Any]:
    return dict(interpolate(yaml.safe_load((DEPLOY / "docker-compose.yml").read_text()), env))


def image_env(dockerfile: str) -> dict[str, str]:
    """The PREFIXGATE_* variables a Dockerfile's ENV sets (compose's environment wins)."""
    return dict(re.findall(r"(PREFIXGATE_\w+)=(\S+)", (DEPLOY / dockerfile).read_text()))


def container_env(service: dict[str, Any]) -> dict[str, str]:
    return {**image_env(Path(service["build"]["dockerfile"]).name),
            **{k: str(v) for k, v in service["environment"].items()}}


def configs(env: dict[str, str]) -> tuple[Config, Config]:
    """(the proxy's Config, worker-0's), as their containers build them."""
    services = compose(env)["services"]
    proxy, worker = services["proxy"], services["worker-0"]
    assert worker["command"][0] == "worker" and proxy["command"] == ["serve"]
    return (serve_config(proxy["command"], container_env(proxy)),
            worker_config(worker["command"][1:], container_env(worker))[0])


def differing(env: dict[str, str]) -> set[str]:
    """The cache identity's fields (backend/keys.py) on which proxy and worker differ."""
    proxy, worker = (dataclasses.asdict(cache_identity(c)) for c in configs(env))
    assert proxy.keys() == worker.keys()
    return {k for k in proxy if proxy[k] != worker[k]}


def test_every_setting_reaches_the_proxy_and_every_worker() -> None:
    knobs = [f for f in Config.__dataclass_fields__ if f not in {*NOT_FLAGS, *COMPOSE_OWNED}]
    env = {**env_example(), **{"PREFIXGATE_" + k.upper(): f"set-{k}" for k in knobs}}
    services = compose(env)["services"]
    for name in ("proxy", "worker-0", "worker-1"):
        got = services[name]["environment"]
        for k in knobs:
            if name != "proxy" and k in PROXY_ONLY:
                assert "PREFIXGATE_" + k.upper() not in got, (name, k)
            else:
                assert got.get("PREFIXGATE_" + k.upper()) == f"set-{k}", (name, k)


@pytest.mark.parametrize("settings", [
    {},  # .env.example as shipped
    {"PREFIXGATE_PARALLEL": "4", "PREFIXGATE_N_CTX": "131072"},
    {"PREFIXGATE_UBATCH_SIZE": "1024"},
    {"PREFIXGATE_N_GPU_LAYERS": "30", "PREFIXGATE_N_CPU_MOE": "8"},
    {"PREFIXGATE_CACHE_TYPE_K": "f16", "PREFIXGATE_CACHE_TYPE_V": "f16",
     "PREFIXGATE_FLASH_ATTN": "auto", "PREFIXGATE_SWA_FULL": "false"},
    {"PREFIXGATE_N_CTX": "", "PREFIXGATE_FLASH_ATTN": ""},  # set empty: the compose defaults
])
def test_the_proxy_and_its_workers_key_the_cache_alike(settings: dict[str, str]) -> None:
    assert differing({**env_example(), **settings}) <= TAKEN_FROM_WORKER


def test_the_shipped_configuration_is_the_one_env_example_describes() -> None:
    proxy, worker = configs(env_example())
    for cfg in (proxy, worker):
        assert (cfg.n_ctx, cfg.parallel, cfg.flash_attn, cfg.cache_type_k, cfg.cache_type_v,
                cfg.n_gpu_layers, cfg.batch) == (65536, 1, "on", "q8_0", "q8_0", -1, 512)
    assert (proxy.cache_ram, proxy.alias, proxy.worker_url) == (8192, "",
                                                                ("http://worker-0:9000",))


def test_env_example_states_the_defaults() -> None:
    """"Every line is optional; the value shown is the default": each setting .env.example
    shows is what compose gives a container without a .env."""
    bare = compose({})["services"]
    env = {**container_env(bare["proxy"]), **container_env(bare["worker-0"])}
    defaults = serve_config(["-m", "m.gguf"], environ={})
    for key, shown in env_example().items():
        if not key.startswith("PREFIXGATE_") or key == "PREFIXGATE_WORKER_URL":
            continue
        given = env.get(key, "")
        field = key.removeprefix("PREFIXGATE_").lower()
        if given:
            assert given == shown, key
        else:  # compose leaves it to prefixgate's own default
            assert shown == "" or str(getattr(defaults, field)) == shown, key


def test_env_example_fits_a_24_gb_card_at_its_context() -> None:
    """The arithmetic of .env.example's comment, for Qwen3-Coder-30B-A3B Q4_K_M (48 layers, 4 KV
    heads of 128): q8_0 KV at 64K fits in 24 GiB with a GiB of compute buffers; f16 does not."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, buffers, gib = 18.6e9, 1 << 30, 1 << 30
    values_per_token = 48 * 4 * 128 * 2  # K and V

    def kv_bytes(kind: str, n_ctx: int) -> float:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind.upper()]]
        return values_per_token * n_ctx * size / block

    settings = env_example()
    n_ctx, kind = int(settings["PREFIXGATE_N_CTX"]), settings["PREFIXGATE_CACHE_TYPE_V"]
    assert settings["PREFIXGATE_CACHE_TYPE_K"] == kind == "q8_0"
    assert settings["PREFIXGATE_FLASH_ATTN"] == "on"  # a quantized V cache needs it
    assert weights + kv_bytes(kind, n_ctx) + buffers < 23 * gib  # a GiB to spare
    assert weights + kv_bytes("f16", n_ctx) + buffers > 24 * gib


# --- healthchecks ------------------------------------------------------------------------------


def healthcheck(service: dict[str, Any], port: int) -> int:
    """The exit status of the service's healthcheck command run here, against `port`."""
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    code = re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", test[3])
    return subprocess.run([sys.executable, "-c", code], capture_output=True,
                          timeout=30).returncode


@pytest.mark.parametrize(("status", "body", "healthy"), [
    (200, {"status": "ok"}, True),
    (503, {"status": "loading", "phase": "loading the model", "progress": 0.4}, True),
    (503, {"status": "error"}, False),
    (None, None, False),  # nothing listens
])
def test_a_loading_worker_and_proxy_are_healthy_for_as_long_as_it_takes(
        status: int | None, body: dict[str, Any] | None, healthy: bool) -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(status or 500)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args: Any) -> None:
            pass

    services = compose(env_example())["services"]
    port = free_port()
    server = HTTPServer(("127.0.0.1", port), Health) if status else None
    if server is not None:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in ("worker-0", "proxy"):
            assert (healthcheck(services[name], port) == 0) == healthy, name
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    # the proxy starts beside its workers and waits for them itself, with no time limit
    assert services["proxy"]["depends_on"]["worker-0"]["condition"] == "service_started"
