"""GET /: the status page, what a llama-server user opens first in a browser.

Plain HTML, no script: it refreshes itself every REFRESH_S seconds. Everything on it is what
/props, /slots and /health already hold, plus the proxy's last request log lines (kept by
proxy.metrics): the model and where it went (devices, weights, KV), the workers and their
slots (busy, live tokens, exact, how decode steps run), the hit ratio, the cache's size and
budget, and the recent requests, newest first. While the server loads, the phase and progress.

Rules: every value is escaped (`html.escape`): a model path or a log line is never markup.
With --api-keys the page needs a key, as /props does; without one it is a 401 page that says
how to send it. `render` is pure (data in, the page out), so it is tested by tables.
"""

from __future__ import annotations

import html
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from proxy.edge import BOOT, CONFIG, METRICS, check_auth
from proxy.errors import Unauthorized

REFRESH_S = 5  # the page reloads itself this often
STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .2em; } h2 { font-size: 1.1em; margin: 1.4em 0 .4em; }
table { border-collapse: collapse; } td, th { padding: .2em .8em .2em 0; text-align: left; }
th { color: #555; font-weight: 600; } tr.busy td { font-weight: 600; }
.ok { color: #176f2c; } .off { color: #a11; }
pre { background: #f4f4f4; padding: .6em; overflow-x: auto; font-size: 12px; }
footer { margin-top: 2em; color: #666; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _rows(pairs: Sequence[tuple[str, Any]]) -> str:
    return "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in pairs)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _loading(health: dict[str, Any]) -> str:
    workers = "".join(f"<tr><td>{_e(w['id'])}</td><td>{_e(w.get('loading', 'ready'))}</td></tr>"
                      for w in health.get("workers", []))
    return (f'<p class="off" id="state">loading: {_e(health.get("phase", ""))} '
            f'({float(health.get("progress", 0)):.0%})</p>'
            f'<table id="workers"><tr><th>worker</th><th>state</th></tr>{workers}</table>')


def _model(props: dict[str, Any]) -> str:
    pairs: list[tuple[str, Any]] = [
        ("model", props["model"]), ("file", props["model_path"]),
        ("context per slot", props["default_generation_settings"]["n_ctx"]),
        ("slots", f"{props['total_slots']} ({props['workers']} worker(s))"),
        ("prefill batch", props["ubatch_size"]), ("build", props["build_info"])]
    pairs += [(f"worker {w}", f"{note}; memory {props['memory'].get(w, '?')}")
              for w, note in props["placement"].items()]
    return f'<table id="model">{_rows(pairs)}</table>'


def _cache(props: dict[str, Any]) -> str:
    c = props["cache"]
    ram = props["cache_ram"]["workers"]
    pairs: list[tuple[str, Any]] = [
        ("hit ratio (since start)", f"{c['lifetime_hit_ratio']:.1%}"),
        ("policy", c["policy"]),
        ("disk", f"{c['entries']} entries, {_mib(c['bytes'])} of {_mib(c['max_bytes'])}"),
        ("directory", c["dir"])]
    pairs += [(f"RAM tier, worker {w}", f"{s.get('entries', 0)} states, "
               f"{_mib(s.get('used_bytes', 0))}") for w, s in ram.items()]
    if props["shared_tier"]["on"]:
        pairs.append(("shared tier", "on"))
    return f'<table id="cache">{_rows(pairs)}</table>'


def _slots(props: dict[str, Any], slots: list[dict[str, Any]]) -> str:
    exact = {e["worker"]: e for e in props["exact"]}
    head = ("<tr><th>worker</th><th>slot</th><th>state</th><th>live tokens</th>"
            "<th>exact</th><th>decode</th></tr>")
    rows = []
    for s in slots:
        e = exact.get(s["worker"], {})
        verdict = '<span class="ok">yes</span>' if e.get("ok") else \
            f'<span class="off">no: {_e(e.get("failure", ""))}</span>'
        state = "busy" if s["is_processing"] else "idle" if s["ready"] else "starting"
        rows.append(f'<tr class="{state}"><td>{_e(s["worker"])}</td><td>{_e(s["slot"])}</td>'
                    f'<td>{state}</td><td>{_e(s["live_tokens"])}</td><td>{verdict}</td>'
                    f'<td>{_e(e.get("decode", ""))}</td></tr>')
    return f'<table id="slots">{head}{"".join(rows)}</table>'


def _lines(lines: Sequence[tuple[float, str]]) -> str:
    if not lines:
        return '<pre id="requests">no requests yet</pre>'
    shown = "\n".join(f"{time.strftime('%H:%M:%S', time.localtime(t))} {_e(line)}"
                      for t, line in reversed(lines))
    return f'<pre id="requests">{shown}</pre>'


def render(props: dict[str, Any] | None, health: dict[str, Any],
           slots: list[dict[str, Any]], lines: Sequence[tuple[float, str]],
           prefix: str = "") -> str:
    """The page; `props` None while the server loads (then only `health` is known); its links
    under `prefix` (--api-prefix)."""
    title = f"prefixgate · {props['model']}" if props else "prefixgate · loading"
    if props is None:
        body = _loading(health)
    else:
        state = "asleep: the next request loads the workers again" if health.get("sleeping") \
            else "ready" if health.get("status") == "ok" else \
            f"a worker is (re)starting: {health.get('phase', '')}"
        body = (f'<p class="{"ok" if state == "ready" else "off"}" id="state">{_e(state)}</p>'
                f"{_model(props)}<h2>Workers and slots</h2>{_slots(props, slots)}"
                f"<h2>Cache</h2>{_cache(props)}"
                f"<h2>Recent requests</h2>{_lines(lines)}")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="refresh" content="{REFRESH_S}"><title>{_e(title)}</title>'
            f"<style>{STYLE}</style></head><body><h1>{_e(title)}</h1>{body}"
            "<footer>" + " · ".join(f'<a href="{_e(prefix)}{p}">{_e(prefix)}{p}</a>' for p in (
                "/health", "/props", "/slots", "/metrics")) +
            " · the log line: docs/reference.md</footer></body></html>")


UNAUTHORIZED = ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
                "<title>prefixgate · key needed</title></head><body><h1>prefixgate</h1>"
                "<p>This server takes API keys (--api-key / --api-keys): send one as "
                "<code>Authorization: Bearer KEY</code> to see its status, as for /props."
                "</p></body></html>")


def add_routes(app: web.Application,
               props: Callable[[web.Application], Awaitable[dict[str, Any]]],
               health: Callable[[web.Application], tuple[bool, dict[str, Any]]],
               slots: Callable[[web.Application], list[dict[str, Any]]]) -> None:
    """GET / from the builders of /props, /health and /slots (proxy.app, proxy.llama_api)."""

    async def page(request: web.Request) -> web.Response:
        try:
            check_auth(request)
        except Unauthorized:
            return web.Response(text=UNAUTHORIZED, status=401, content_type="text/html")
        app = request.app
        _, state = health(app)
        cfg = app.get(CONFIG)  # (an app of a test may have none)
        prefix = cfg.api_prefix if cfg is not None else ""
        if not app[BOOT]["ready"]:
            text = render(None, state, [], [], prefix)
        else:
            text = render(await props(app), state, slots(app), list(app[METRICS].recent_lines),
                          prefix)
        return web.Response(text=text, content_type="text/html",
                            headers={"Cache-Control": "no-store"})

    app.router.add_get("/", page)
