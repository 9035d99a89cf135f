"""The `prefixgate` command: serve, worker, cache."""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys

from proxy.config import Config, add_arguments, from_args


def _listen(host: str, port: int) -> socket.socket:
    """Bind the port first, before workers load: a taken port fails at once, clearly."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(f"prefixgate: port {port} on {host} is already in use; stop the "
                             "other server or pick another with --port") from None
        raise SystemExit(f"prefixgate: cannot listen on {host}:{port}: {e.strerror}") from None
    s.listen(128)
    s.setblocking(False)
    return s


def serve(cfg: Config) -> None:
    from aiohttp import web

    from proxy.app import make_app
    from proxy.workers import StartupError

    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sock = _listen(cfg.host, cfg.port)
    try:
        web.run_app(make_app(cfg), sock=sock, print=None, access_log=None)
    except StartupError as e:  # a worker that cannot serve this proxy: say why, no traceback
        raise SystemExit(f"prefixgate: {e}") from None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        from backend.worker import main as worker_main

        return worker_main(argv[1:])
    if argv[:1] == ["cache"]:
        from proxy.cache_cli import main as cache_main

        return cache_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from bench.simulate import main as simulate_main  # type: ignore[import-not-found]

        return simulate_main(argv[1:])
    p = argparse.ArgumentParser(prog="prefixgate",
                                description="Prompt-cache proxy for local LLM agents. "
                                "Commands: serve (default), worker, cache.")
    p.add_argument("command", nargs="?", default="serve", choices=["serve"])
    add_arguments(p)
    ns = p.parse_args(argv)
    serve(from_args(ns))


if __name__ == "__main__":
    main()
