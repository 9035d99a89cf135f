"""The deploy/ files, each checked by its own tool: `docker-compose config` (Debian's
docker-compose package; no Docker engine needed) for the compose file, `promtool check` and
`promtool test rules` for the Prometheus files, plus the wiring between them that no single
tool sees (the same model, n_ctx and cache volume for proxy and workers; Grafana's dashboard
and data source where the provisioning looks for them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
GRAFANA = DEPLOY / "grafana"


def need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed: apt-get install -y {package} (.ci/run does)")
    return path


def run(*cmd: str, env: dict[str, str] | None = None) -> str:
    p = subprocess.run(cmd, cwd=DEPLOY, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def compose_config(*args: str) -> dict[str, Any]:
    """The compose file as docker-compose resolves it with .env.example, unaffected by any
    variable of the same name in the test's environment."""
    exe = need("docker-compose", "docker-compose")
    names = {line.split("=", 1)[0].lstrip("# ").strip()
             for line in (DEPLOY / ".env.example").read_text().splitlines() if "=" in line}
    env = {k: v for k, v in os.environ.items() if k not in names}
    out = run(exe, "--env-file", ".env.example", *args, "config", env=env)
    return dict(yaml.safe_load(out))


def test_compose_file_is_valid_and_wires_proxy_to_workers() -> None:
    cfg = compose_config()
    services = cfg["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert default == {"proxy", "worker-0", "prometheus", "grafana"}
    proxy, worker = services["proxy"], services["worker-0"]
    # the same model, context and flash-attn on both sides, and one cache volume
    for key in ("PREFIXGATE_MODEL", "PREFIXGATE_N_CTX", "PREFIXGATE_FLASH_ATTN",
                "PREFIXGATE_CACHE_DIR"):
        assert proxy["environment"][key] == worker["environment"][key], key
    assert set(worker["volumes"]) <= set(proxy["volumes"])
    assert any(v.endswith(":/cache:rw") for v in proxy["volumes"])
    # the proxy points at the worker's listen address; the worker gets a GPU
    assert proxy["environment"]["PREFIXGATE_WORKER_URL"] == "http://worker-0:9000"
    assert "0.0.0.0:9000" in worker["command"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert worker["build"]["dockerfile"] == "deploy/Dockerfile"
    assert proxy["build"]["dockerfile"] == "deploy/Dockerfile.cpu"
    for name in ("Dockerfile", "Dockerfile.cpu"):
        assert "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}" in (DEPLOY / name).read_text()
    assert "-DGGML_CUDA=on" in (DEPLOY / "Dockerfile").read_text()


def test_compose_two_gpus_profile_adds_a_second_worker() -> None:
    services = compose_config("--profile", "two-gpus")["services"]
    assert services["worker-1"]["profiles"] == ["two-gpus"]
    assert services["worker-1"]["deploy"]["resources"]["reservations"]["devices"][0][
        "device_ids"] == ["1"]
    assert services["worker-1"]["volumes"] == services["worker-0"]["volumes"]


def test_compose_dynamo_profile_registers_the_host_and_fronts_the_team() -> None:
    services = compose_config("--profile", "dynamo")["services"]
    assert {"etcd", "nats", "dynamo-worker", "front"} <= set(services)
    proxy, worker, front = services["proxy"], services["dynamo-worker"], services["front"]
    # the host's registration reads the events where the proxy publishes them
    cmd = worker["command"]
    assert cmd[:3] == ["dynamo-worker", "--host-url", "http://proxy:8080"]
    assert cmd[cmd.index("--kv-events") + 1] == "tcp://proxy:5557"
    assert cmd[cmd.index("--kv-block-size") + 1] == "16"
    # the front renders prompts as the hosts do: their model and prompt settings
    for key in ("PREFIXGATE_MODEL", "PREFIXGATE_N_CTX", "PREFIXGATE_KV_BLOCK_SIZE",
                "PREFIXGATE_CHAT_TEMPLATE_FILE", "PREFIXGATE_STABLE_LAYOUT",
                "PREFIXGATE_VOLATILE_BLOCKS", "PREFIXGATE_REASONING"):
        assert front["environment"][key] == proxy["environment"][key], key
    assert "front" in front["command"] and any(v.endswith(":/models:ro")
                                               for v in front["volumes"])
    # and takes the proxy's keys (auth at the front as at the host: docs/security.md)
    for key in ("PREFIXGATE_API_KEYS", "PREFIXGATE_API_KEY"):
        assert key in front["environment"], key
        assert front["environment"][key] == proxy["environment"][key], key
    assert [v for v in front["volumes"] if "/run/secrets/api_keys" in str(v)] == [
        v for v in proxy["volumes"] if "/run/secrets/api_keys" in str(v)]
    # both meet in Dynamo's etcd and NATS, in an image that carries Dynamo's runtime
    for s in (worker, front):
        env = s["environment"]
        assert (env["DYN_DISCOVERY_BACKEND"], env["ETCD_ENDPOINTS"], env["NATS_SERVER"]) == (
            "etcd", "http://etcd:2379", "nats://nats:4222")
        assert s["build"]["args"]["EXTRAS"] == "dynamo"
    assert 'pip install -c deploy/constraints.txt ".${EXTRAS:+[$EXTRAS]}"' in (
        DEPLOY / "Dockerfile.cpu").read_text()


def test_prometheus_config_and_rules_pass_promtool() -> None:
    promtool = need("promtool", "prometheus")
    run(promtool, "check", "config", "prometheus.yml")
    run(promtool, "check", "rules", "rules.yml")
    # the alerts fire on the conditions they name, on synthetic series (deploy/rules_test.yml)
    assert "SUCCESS" in run(promtool, "test", "rules", "rules_test.yml")


def test_prometheus_reads_its_api_key_where_compose_mounts_it() -> None:
    """The key file prometheus.yml names (relative to itself) is the one compose mounts from
    PROMETHEUS_API_KEY_FILE; the proxy's --api-keys file is the one from API_KEYS_FILE. The
    defaults are the empty files in deploy/secrets (no key), which promtool also needs."""
    services = compose_config()["services"]
    prom_cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    auth = prom_cfg["scrape_configs"][0]["authorization"]
    assert auth.get("type", "Bearer") == "Bearer"
    mounts = {target: source for source, target, *_ in
              (v.split(":") for v in services["prometheus"]["volumes"])}
    config_dir = Path(next(a for a in services["prometheus"]["command"]
                           if a.startswith("--config.file=")).split("=", 1)[1]).parent
    key_file = DEPLOY / "secrets/prometheus_api_key"
    assert mounts[str(config_dir / auth["credentials_file"])] == str(key_file)
    proxy = services["proxy"]
    proxy_mounts = {target: source for source, target, *_ in
                    (v.split(":") for v in proxy["volumes"])}
    # auth is on where .env names the mounted file (a key file with no key stops the start)
    assert proxy["environment"]["PREFIXGATE_API_KEYS"] == ""
    assert proxy_mounts["/run/secrets/api_keys"] == str(DEPLOY / "secrets/api_keys")
    for default in ("prometheus_api_key", "api_keys"):
        assert (DEPLOY / "secrets" / default).read_text() == "", "the defaults hold no key"


def test_cuda_architectures_are_ggml_default_everywhere() -> None:
    """The Dockerfile's default, the compose file's and .env.example's are one list: ggml's
    default for CUDA 12.8 (llama.cpp's ggml/src/ggml-cuda/CMakeLists.txt, as the Dockerfile's
    comment says), Maxwell and Pascal included."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "ARG CUDA_VERSION=12.8." in dockerfile
    found = {
        "Dockerfile": re.search(r'^ARG CUDA_ARCHITECTURES="([^"]+)"$', dockerfile, re.M),
        "docker-compose.yml": re.search(r"\$\{CUDA_ARCHITECTURES:-([^}]+)\}",
                                        (DEPLOY / "docker-compose.yml").read_text()),
        ".env.example": re.search(r"^CUDA_ARCHITECTURES=(.+)$",
                                  (DEPLOY / ".env.example").read_text(), re.M)}
    ggml_12_8 = ("50-virtual;61-virtual;70-virtual;75-virtual;80-virtual;86-real;89-real;"
                 "90-virtual;120a-real")
    assert {name: m and m[1] for name, m in found.items()} == dict.fromkeys(found, ggml_12_8)


def test_grafana_provisioning_finds_the_dashboard_and_its_data_source() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"]
                  if v.startswith("./"))
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/prefixgate.yml").read_text())
    dash_dir = provider["providers"][0]["options"]["path"]
    assert mounts["./grafana/dashboards"] == dash_dir
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (GRAFANA / "dashboards" / Path(home).relative_to(dash_dir)).is_file()

    source = yaml.safe_load(
        (GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dashboard = json.loads((GRAFANA / "dashboards/prefixgate.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    for p in panels:
        assert p["datasource"]["uid"] == source["uid"], p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_images_hold_every_package_the_project_installs() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pkg in project["tool"]["setuptools"]["packages"]:
        for name in ("Dockerfile", "Dockerfile.cpu"):
            assert f"COPY {pkg} {pkg}\n" in (DEPLOY / name).read_text(), (name, pkg)
            assert f"!{pkg}/\n" in (DEPLOY / f"{name}.dockerignore").read_text(), (name, pkg)
    pins = (DEPLOY / "constraints.txt").read_text()
    for dep in project["project"]["dependencies"]:
        if "==" in dep:
            assert dep in pins, f"{dep} is pinned differently in deploy/constraints.txt"
