"""The status page at `/`: rendered from /props, /slots and /health's data and the recent
request lines (tables, no server), served over HTTP by a plain aiohttp app with the real routes
(ready, loading, a key needed), then on the real server: what a browser gets after a request,
and the same page in a real headless browser (chromium) where one is installed."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.request
from html.parser import HTMLParser
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy import status
from proxy.edge import ALLOWED_KEYS, BOOT, METRICS
from proxy.metrics import Metrics
from tests.conftest import Server

PROPS: dict[str, Any] = {
    "model": "Qwen3-Coder<b>", "model_path": "/models/<script>alert(1)</script>.gguf",
    "default_generation_settings": {"n_ctx": 32768}, "total_slots": 3, "workers": 1,
    "ubatch_size": 512, "build_info": "prefixgate 0.1.0, llama-cpp-python 0.3.36",
    "placement": {"0": "CUDA0 (NVIDIA H100 80GB HBM3): 49/49 layers on the GPU"},
    "memory": {"0": "plain"},
    "exact": [{"worker": 0, "ok": True, "failure": "", "decode": "fixed"}],
    "cache": {"lifetime_hit_ratio": 0.923, "policy": "auto:30", "entries": 12,
              "bytes": 3 << 30, "max_bytes": 20 << 30, "dir": "/cache"},
    "cache_ram": {"workers": {"0": {"entries": 2, "used_bytes": 256 << 20}}},
    "shared_tier": {"on": False},
}
SLOTS = [{"worker": 0, "slot": i, "is_processing": i == 1, "ready": True,
          "live_tokens": 1000 * i} for i in range(3)]
HEALTH_OK = {"status": "ok", "workers": []}
HEALTH_LOADING = {"status": "loading", "phase": "loading the model", "progress": 0.42,
                  "workers": [{"id": 0, "loading": "loading the model 42%"}]}
LINES = [(1_700_000_000.0, "openai prompt=406 cached=398 source=live <i>"),
         (1_700_000_060.0, "anthropic prompt=9000 cached=8990 source=disk")]


class Page(HTMLParser):
    """The page's title, its tables' rows (by table id, cells as text) and its pre text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.title, self.tables, self.pre = "", {}, ""
        self._in: list[str] = []
        self._table = ""
        self._row: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._in.append(tag)
        if tag == "table":
            self._table = dict(attrs).get("id") or ""
            self.tables[self._table] = []
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._row.append("")

    def handle_endtag(self, tag: str) -> None:
        if self._in and self._in[-1] == tag:
            self._in.pop()
        if tag == "tr" and self._row is not None:
            self.tables[self._table].append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if "title" in self._in:
            self.title += data
        elif "pre" in self._in:
            self.pre += data
        elif self._row is not None and self._row and {"td", "th"} & set(self._in):
            self._row[-1] += data


def test_the_ready_page() -> None:
    text = status.render(PROPS, HEALTH_OK, SLOTS, LINES)
    page = Page(text)
    assert page.title == "prefixgate · Qwen3-Coder<b>"  # escaped in the source, text here
    assert "<script>" not in text and "&lt;script&gt;" in text and "<i>" not in text
    model = dict(page.tables["model"])
    assert model["file"] == PROPS["model_path"] and model["context per slot"] == "32768"
    assert model["worker 0"] == "CUDA0 (NVIDIA H100 80GB HBM3): 49/49 layers on the GPU; " \
                                "memory plain"
    assert page.tables["slots"][1:] == [["0", "0", "idle", "0", "yes", "fixed"],
                                        ["0", "1", "busy", "1000", "yes", "fixed"],
                                        ["0", "2", "idle", "2000", "yes", "fixed"]]
    cache = dict(page.tables["cache"])
    assert cache["hit ratio (since start)"] == "92.3%"
    assert cache["disk"] == "12 entries, 3,072.0 MiB of 20,480.0 MiB"
    assert cache["RAM tier, worker 0"] == "2 states, 256.0 MiB"
    # the newest request first
    assert [ln.split(" ", 1)[1] for ln in page.pre.splitlines()] == [LINES[1][1], LINES[0][1]]


def test_a_worker_without_exact_reuse_says_why() -> None:
    props = {**PROPS, "exact": [{"worker": 0, "ok": False, "failure": "restore@64 differs",
                                 "decode": "apart"}]}
    page = Page(status.render(props, HEALTH_OK, SLOTS[:1], []))
    assert page.tables["slots"][1] == ["0", "0", "idle", "0", "no: restore@64 differs", "apart"]
    assert page.pre == "no requests yet"


def test_the_loading_page() -> None:
    page = Page(status.render(None, HEALTH_LOADING, [], []))
    assert page.title == "prefixgate · loading"
    assert page.tables["workers"][1:] == [["0", "loading the model 42%"]]


def app_of(ready: bool, keys: frozenset[str] | None = None) -> web.Application:
    """A plain aiohttp app with the real page and fixed data in place of a running server's."""
    app = web.Application()
    app[BOOT] = {"phase": "loading the model", "ready": ready, "error": ""}
    app[METRICS] = Metrics()
    app[METRICS].recent_lines.extend(LINES)
    if keys is not None:
        app[ALLOWED_KEYS] = keys

    async def props(_: web.Application) -> dict[str, Any]:
        return PROPS

    status.add_routes(app, props,
                      lambda _: (ready, HEALTH_OK if ready else HEALTH_LOADING),
                      lambda _: SLOTS)
    return app


@pytest.mark.parametrize(("ready", "keys", "headers", "code", "title"), [
    (True, None, {}, 200, "prefixgate · Qwen3-Coder<b>"),
    (False, None, {}, 200, "prefixgate · loading"),
    # with API keys: as /props, a key is needed; without one a page that says how
    (True, frozenset({"sk-1"}), {}, 401, "prefixgate · key needed"),
    (True, frozenset({"sk-1"}), {"Authorization": "Bearer sk-1"}, 200,
     "prefixgate · Qwen3-Coder<b>"),
])
async def test_the_page_over_http(ready: bool, keys: frozenset[str] | None,
                                  headers: dict[str, str], code: int, title: str) -> None:
    async with TestClient(TestServer(app_of(ready, keys))) as client:
        resp = await client.get("/", headers=headers)
        assert (resp.status, resp.content_type) == (code, "text/html")
        assert Page(await resp.text()).title == title


# --- on the real server ----------------------------------------------------------------------


def _request(srv: Server) -> None:
    body = json.dumps({"model": "m", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "Status page check."}]})
    req = urllib.request.Request(srv.v1 + "/chat/completions", body.encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        assert resp.status == 200


def test_the_page_of_a_real_server(server: Server) -> None:
    _request(server)
    with urllib.request.urlopen(server.url + "/", timeout=60) as resp:
        assert resp.headers.get_content_type() == "text/html"
        page = Page(resp.read().decode())
    props = server.get_json("/props")
    assert page.title == f"prefixgate · {props['model']}"
    assert len(page.tables["slots"]) - 1 == props["total_slots"]
    assert dict(page.tables["model"])["worker 0"].startswith("CPU: no layers on a GPU")
    assert page.pre.splitlines()[0].split(" ", 1)[1].startswith("openai prompt=")


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="needs a headless browser: Debian's chromium (apt-get install "
                           "chromium), not installed here")
def test_the_page_in_a_headless_browser(server: Server) -> None:
    """What chromium builds of the page: its DOM, dumped after load."""
    _request(server)
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
         server.url + "/"], capture_output=True, text=True, timeout=120, check=True).stdout
    page = Page(dom)
    props = server.get_json("/props")
    assert page.title == f"prefixgate · {props['model']}"
    assert len(page.tables["slots"]) - 1 == props["total_slots"]
    assert "openai prompt=" in page.pre


def test_loading_progress_holds_once_the_workers_are_ready() -> None:
    """Between the last worker's ready and the server's (the cache index read, the gateway
    opened), /health still says loading: its progress is 1, not 0 (it read 0 there, and went
    backwards under a client polling every 50 ms)."""
    from proxy.app import POOL, health_json
    from proxy.config import Config
    from proxy.edge import CONFIG
    from proxy.worker_link import Worker
    from proxy.workers import Pool

    app = web.Application()
    cfg = Config()
    app[CONFIG] = cfg
    app[BOOT] = {"phase": "reading the cache index", "ready": False, "error": ""}
    pool = Pool(cfg)
    pool.workers = [Worker(0, "http://w0", ready=True), Worker(1, "http://w1")]
    app[POOL] = pool
    ok, body = health_json(app)
    assert not ok and body["progress"] == 0.5  # one loaded, one not begun
    pool.workers[1].ready = True
    ok, body = health_json(app)
    assert not ok and (body["status"], body["progress"]) == ("loading", 1.0)
    asyncio.run(pool.close())  # its temporary directory
