"""Shared fixtures: a real prefixgate server (real worker processes, the real default model).

The suite runs in two layers (`make test`): first the exact tables that need no model process
(policies, parsing, the run state machine, the cache on real LMDB, keys, files), in seconds;
then the `model` layer: real worker processes on the real model, driven by the official SDKs.
A test is in the model layer when it uses a server fixture below or its module is marked
`pytestmark = pytest.mark.model` (modules that start their own servers or workers).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.worker_link import child_env

ROOT = Path(__file__).resolve().parent.parent
N_CTX = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout_s: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


@dataclass
class Server:
    url: str
    port: int
    cache_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        return http_get(self.url + path)

    def get_json(self, path: str) -> dict:
        status, body = self.get(path)
        assert status == 200, body
        return dict(json.loads(body))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(tmp: Path, *args: str, cache_dir: Path | None = None,
                 env: dict[str, str] | None = None, timeout_s: float = 120,
                 while_loading: Callable[[Server], None] | None = None) -> Server:
    """The server, once /health says ok; `while_loading` is called between polls before."""
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    cache_dir = cache_dir or tmp / "cache"
    log_path = tmp / f"server-{port}.log"
    # the RAM tier is off unless a test turns it on: the cache tests are about the disk, and a
    # request that replaces the live KV must leave only the disk to restore from
    ram = () if {"--cache-ram", "-cram"} & set(args) else ("--cache-ram", "0")
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port),
           "--n-ctx", str(N_CTX), "--cache-dir", str(cache_dir), "--threads", "2", *ram, *args]
    logf = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
                            env={**child_env(ROOT), **(env or {})})
    # with --api-prefix every path is below it, /health too
    prefix = args[args.index("--api-prefix") + 1] if "--api-prefix" in args else ""
    srv = Server(f"http://127.0.0.1:{port}{prefix}", port, cache_dir, proc, log_path)
    deadline = time.time() + timeout_s
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}:\n{srv.log()}")
            if http_get(srv.url + "/health", timeout_s=2)[0] == 200:
                return srv
            if while_loading is not None:
                while_loading(srv)  # a failed check stops the server below, never leaks it
            time.sleep(0.05)
        raise RuntimeError(f"server not ready in {timeout_s} s:\n{srv.log()}")
    except BaseException:
        srv.stop()
        raise


@contextlib.contextmanager
def running(tmp: Path, *args: str, **kw: object) -> Iterator[Server]:
    srv = start_server(tmp, *args, **kw)  # type: ignore[arg-type]
    try:
        yield srv
    finally:
        srv.stop()


MODEL_FIXTURES = {"server", "cold_server"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two workers, the default disk cache policy; shared by every test that does not need a
    server of its own."""
    with running(tmp_path_factory.mktemp("srv"), "--workers", "2") as srv:
        yield srv


@pytest.fixture(scope="session")
def cold_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One worker, no disk cache: the reference for cold runs."""
    with running(tmp_path_factory.mktemp("cold"), "--workers", "1",
                 "--disk-prefix-cache", "off") as srv:
        yield srv


@pytest.fixture
def model_path() -> str:
    from proxy.config import default_model

    return default_model()


# --- the shared tier's Redis (tests/proxy/test_shared_tier.py, tests/deploy/test_haproxy.py)

PASSWORD = "redis-pw-never-logged"


class Redis:
    """A real redis-server on loopback, with a password (a secret no log may show)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"  # a secret, never logged
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--requirepass", PASSWORD,
             "--appendonly", "no", "--dir", str(tmp), "--maxmemory", "512mb",
             "--maxmemory-policy", "allkeys-lru", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(port=self.port, password=PASSWORD)
        deadline = time.time() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)

    def entries(self) -> list[bytes]:
        return list(self.client.scan_iter("pg:*:e:*"))

    def wait_entries(self, at_least: int) -> list[bytes]:
        deadline = time.time() + 15
        while len(found := self.entries()) < at_least and time.time() < deadline:
            time.sleep(0.1)
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Redis]:
    r = Redis(tmp_path)
    try:
        yield r
    finally:
        r.stop()
