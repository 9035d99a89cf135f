"""Requests from browser pages of another origin, answered as llama-server answers them (its
`--cors-origins`, `--cors-methods`, `--cors-headers`, `--cors-credentials`), with a safer default.

A page a browser loaded from one origin may call this server only when the answer names that
origin (`Access-Control-Allow-Origin`); before a request with a key or a JSON body it asks
first (an `OPTIONS` preflight, which carries no key). Agents are not browsers and never ask.

- `origins`: `localhost` names a page's origin when its host is this machine (localhost,
  127.0.0.1, ::1: a web UI run beside the server); `*` names any origin (llama-server's
  default: every web page the user opens may call the server, and read its answers, where it
  has no API key); otherwise only the origins listed. "" names none.
- A preflight is answered (200, no body) on every path before the key and the start-up state
  are checked, as in llama-server, with the methods and headers allowed (`*` for the headers:
  those the page asks for, since a browser takes `*` literally from a server that allows
  credentials). The answers of every other request carry the origin where it is allowed.
- The default is `localhost`, where llama-server's is `*`: said at start and in /props.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

log = logging.getLogger("prefixgate")

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_REFUSALS_LOGGED = 64  # distinct refused origins said in the log (one line each)


def is_local(origin: str) -> bool:
    """Whether a page's origin is this machine (llama.cpp's `origin_is_localhost`)."""
    try:
        return urlsplit(origin).hostname in LOCAL_HOSTS
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Cors:
    origins: str = "localhost"
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    @classmethod
    def of(cls, cfg: Any) -> Cors:
        """The policy a Config's `cors_*` fields give (serve's and the front's)."""
        return cls(cfg.cors_origins, cfg.cors_methods, cfg.cors_headers, cfg.cors_credentials)

    @property
    def listed(self) -> frozenset[str]:
        return frozenset(o.strip().rstrip("/") for o in self.origins.split(",") if o.strip())

    def allow_origin(self, origin: str) -> str | None:
        """The `Access-Control-Allow-Origin` of an answer to a page of `origin` ("" when the
        request says none), or None: not allowed."""
        if not origin:
            return None
        if self.origins.strip() == "*":
            # with credentials a browser refuses `*`: the page's own origin is named
            return origin if self.credentials else "*"
        if self.origins.strip() == "localhost":
            return origin if is_local(origin) else None
        return origin if origin.rstrip("/") in self.listed else None

    def answer_headers(self, origin: str) -> dict[str, str]:
        """What an answer to a request from `origin` carries (none where it is not allowed)."""
        allowed = self.allow_origin(origin)
        if allowed is None:
            return {}
        out = {"Access-Control-Allow-Origin": allowed}
        if allowed != "*":
            out["Vary"] = "Origin"
        if self.credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        return out

    def preflight_headers(self, origin: str, asked_headers: str) -> dict[str, str]:
        out = self.answer_headers(origin)
        if out:
            out["Access-Control-Allow-Methods"] = self.methods
            out["Access-Control-Allow-Headers"] = (asked_headers or "*") \
                if self.headers.strip() == "*" else self.headers
        return out

    def describe(self) -> str:
        """One sentence for the start and /props."""
        o = self.origins.strip()
        if o == "*":
            return "any web page may call the API (--cors-origins *, llama-server's default)"
        if o == "localhost":
            return ("web pages from this machine may call the API (--cors-origins localhost; "
                    "llama-server's default is *, any page)")
        if not self.listed:
            return "no web page of another origin may call the API (--cors-origins '')"
        return f"web pages from {', '.join(sorted(self.listed))} may call the API"


def middleware(cors: Cors) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Answers preflights before anything else runs; the other answers get their headers
    from `on_prepare`."""
    refused: set[str] = set()

    @web.middleware
    async def cors_middleware(request: web.Request,
                              handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                              ) -> web.StreamResponse:
        origin = request.headers.get("Origin", "")
        if origin and cors.allow_origin(origin) is None and origin not in refused \
                and len(refused) < _REFUSALS_LOGGED and not same_origin(request, origin):
            refused.add(origin)
            log.warning("a web page from %r was not let call the API (CORS: %s)",
                        origin[:200], cors.describe())
        if request.method == "OPTIONS":
            return web.Response(status=200, headers=cors.preflight_headers(
                origin, request.headers.get("Access-Control-Request-Headers", "")))
        return await handler(request)

    return cors_middleware


def install(app: web.Application, cors: Cors) -> None:
    """The policy on an app: its preflights answered first, its answers' headers added."""
    app.middlewares.insert(0, middleware(cors))
    app.on_response_prepare.append(on_prepare(cors))


def same_origin(request: web.Request, origin: str) -> bool:
    """A page of this server itself (the status page): a browser needs no header for it."""
    try:
        return urlsplit(origin).netloc == request.host
    except ValueError:
        return False


def on_prepare(cors: Cors) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """Every answer but a preflight (streamed ones, errors), as it is sent."""

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        if request.method == "OPTIONS":
            return  # the preflight's headers are its own
        for name, value in cors.answer_headers(request.headers.get("Origin", "")).items():
            if name == "Vary" and "Vary" in response.headers:
                if "origin" not in response.headers["Vary"].lower():
                    response.headers["Vary"] += ", Origin"
                continue
            response.headers[name] = value

    return add_headers
