"""The `prefixgate` command: serve, worker, cache, simulate, doctor, front, dynamo-worker."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import gc
import importlib.metadata
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from proxy import limits, rope, samplers
from proxy.config import (
    WORKER_FIELDS,
    Config,
    add_arguments,
    cache_identity,
    configure_logging,
    from_args,
)
from proxy.flags import LLAMA_SERVER

if TYPE_CHECKING:
    from backend.worker import WorkerSpec


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


GC_GEN0_THRESHOLD = 10_000


def serve(cfg: Config) -> None:
    from aiohttp import web

    from proxy.app import make_app
    from proxy.edge import BOOT
    from proxy.worker_link import StartupError

    configure_logging(cfg, "%(asctime)s %(name)s %(levelname)s %(message)s")
    for note in cfg.llama_notes:  # llama-server's flags and variables that do nothing here
        logging.getLogger("prefixgate").warning("%s", note)
    try:
        limits.with_overrides(cfg.limits)
        samplers.from_items(cfg.sampling)
    except ValueError as e:  # said before anything starts
        raise SystemExit(f"prefixgate: {e}") from None
    _check_model(cfg.model_path)
    if cfg.spec_draft_model:
        _check_model(cfg.spec_draft_model)
    if cfg.api_keys:  # auth never fails open: a file that yields no key stops the start
        from proxy.app import api_keys_of

        api_keys_of(cfg)
    share_secrets(cfg)
    sock = _listen(cfg.host, cfg.port)
    # the render thread parses and renders big requests; let it hand the GIL to the event
    # loop every millisecond (5 by default), so other clients' latency stays low meanwhile
    sys.setswitchinterval(0.001)
    # each request makes and drops big containers (a 32K prompt's ids, its render records);
    # CPython's default (a young collection every 700 net allocations) walks them every few
    # requests: 5-15 ms pauses, a 32K request's p99 11.2 ms against a median of 2.3
    # (`python -m bench.gc_pauses`, bench/results/issue23/gc.md). Most of it is freed by
    # reference counting anyway.
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    app = make_app(cfg)
    root = app
    if cfg.api_prefix:  # llama-server's --api-prefix: every path below it, nothing else
        root = web.Application(client_max_size=limits.with_overrides(cfg.limits).max_body_bytes)
        root.add_subapp(cfg.api_prefix, app)
    try:
        web.run_app(root, sock=sock, print=None, access_log=None)
    except StartupError as e:  # a template that cannot be used: say why, no traceback
        raise SystemExit(f"prefixgate: {e}") from None
    if app[BOOT]["error"]:  # a worker that cannot serve this proxy, found after listening
        raise SystemExit(f"prefixgate: {app[BOOT]['error']}")


def _check_model(path: str) -> None:
    """A model path that is not a readable, whole GGUF file (a FIFO, a file cut short, damaged
    metadata) is said at once in one line naming it, before anything loads it
    (proxy.gguf.check_file), not as a traceback or a hang."""
    from proxy.gguf import GGUFError, check_file

    try:
        check_file(path)
    except OSError as e:
        raise SystemExit(f"prefixgate: cannot read the model {path}: "
                         f"{e.strerror or type(e).__name__}") from None
    except GGUFError as e:
        raise SystemExit(f"prefixgate: the model {e}") from None


def parse_listen(value: str) -> tuple[str, int]:
    """HOST:PORT, [IPv6]:PORT or :PORT (all interfaces) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def worker_config(argv: list[str], environ: dict[str, str] | None = None
                  ) -> tuple[Config, argparse.Namespace]:
    """The Config of `prefixgate worker ARGV`, and its own flags (--listen, --socket, --worker-id)
    as parsed."""
    p = argparse.ArgumentParser(
        prog="prefixgate worker", allow_abbrev=False,
        description="One llama.cpp context behind the worker API. The proxy spawns these itself "
        "on Unix sockets; for separate containers start one with --listen HOST:PORT and give the "
        "proxy --worker-url http://HOST:PORT. Proxy and worker must use the same model file, "
        "--n-ctx, --flash-attn, --cache-type-k/-v and --swa-full, and share --cache-dir (one "
        "volume). Flags default to the "
        "PREFIXGATE_* environment variables the proxy reads.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", help="Unix socket path (how the proxy runs local workers)")
    where.add_argument("--listen", type=parse_listen, metavar="HOST:PORT",
                       help="listen on TCP, e.g. 0.0.0.0:9000 in a container")
    p.add_argument("--worker-id", type=int, default=0, help="its number in logs")
    add_arguments(p, only=WORKER_FIELDS)
    ns = p.parse_args(argv)
    if not ns.listen and not ns.socket:
        p.error("give --listen HOST:PORT (or --socket PATH)")
    return from_args(ns, environ), ns


def worker(argv: list[str]) -> None:
    """`prefixgate worker`: one llama.cpp context behind the worker API, configured from the
    same Config (flags and PREFIXGATE_* variables) as the proxy."""
    from backend.worker import serve

    cfg, ns = worker_config(argv)
    _check_model(cfg.model_path)
    if cfg.spec_draft_model:
        _check_model(cfg.spec_draft_model)
    share_secrets(cfg)
    configure_logging(cfg, f"%(asctime)s worker{ns.worker_id} %(levelname)s %(message)s")
    try:
        serve(worker_spec(cfg, ns.worker_id, ns.socket, ns.listen))
    except ValueError as e:  # a placement flag llama.cpp cannot take: one line
        raise SystemExit(f"prefixgate worker: {e}") from None


def share_secrets(cfg: Config) -> None:
    """The shared tier's secret into this process's environment, where the workers it spawns
    and `backend.shared.SharedTier` read it (a flag's value would show in their argv)."""
    if cfg.shared_tier_secret:
        os.environ["PREFIXGATE_SHARED_TIER_SECRET"] = cfg.shared_tier_secret


def worker_spec(cfg: Config, worker_id: int = 0, socket_path: str | None = None,
                listen: tuple[str, int] | None = None) -> WorkerSpec:
    """How a worker of this Config runs (`prefixgate worker` and `prefixgate doctor`)."""
    from pathlib import Path

    from backend.worker import WorkerSpec
    from proxy.speculation import draft_gpu_layers, spec_config

    placement = {"split_mode": cfg.split_mode, "tensor_split": cfg.tensor_split,
                 "device": cfg.device, "main_gpu": cfg.main_gpu,
                 "override_tensor": cfg.override_tensor, "n_cpu_moe": cfg.n_cpu_moe,
                 "load_mode": cfg.load_mode, "lazy_mode": cfg.lazy_mode, "repack": cfg.repack,
                 "kv_offload": cfg.kv_offload, "override_kv": cfg.override_kv}  # placement.py
    return WorkerSpec(cfg.model_path, cfg.n_ctx, cfg.threads, cfg.n_gpu_layers, cfg.flash_attn,
                      cfg.cache_type_k, cfg.cache_type_v, cfg.swa_full, cfg.worker_batch,
                      cfg.exact_check, Path(cfg.cache_path), cache_identity(cfg), worker_id,
                      socket_path, listen, cfg.threads_batch, placement, cfg.parallel,
                      cfg.cache_ram, cfg.shared_tier, cfg.deterministic, spec_config(cfg),
                      cfg.spec_draft_model, draft_gpu_layers(cfg), rope.settings(cfg),
                      cfg.numa)


def doctor(argv: list[str]) -> None:
    """`prefixgate doctor`: the workers' start-up self-check (backend/selfcheck.py) for this
    configuration, printed as a table; exit status 1 when a check fails."""
    import llama_cpp

    from backend import selfcheck
    from backend.worker import load_engine
    from policies.schedule import choose_decode
    from proxy.cache_cli import out

    p = argparse.ArgumentParser(
        prog="prefixgate doctor", allow_abbrev=False,
        description="Prove on this machine that a cache hit computes exactly what a cold run "
        "does, for the model and settings given (the same flags as serve): a probe prompt "
        "prefilled cold, then restored from snapshots and cut back, compared bit for bit.")
    add_arguments(p, only=WORKER_FIELDS)
    cfg = from_args(p.parse_args(argv))
    _check_model(cfg.model_path)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s %(message)s")
    try:
        eng = load_engine(dataclasses.replace(worker_spec(cfg), n_ctx=min(cfg.n_ctx, 8192)))
    except ValueError as e:
        raise SystemExit(f"prefixgate doctor: {e}") from None
    report = selfcheck.run(eng)
    offload = "GPU offload" if cfg.n_gpu_layers and llama_cpp.llama_supports_gpu_offload() \
        else "CPU"
    memory = eng.memory.kind + (
        f" (window {eng.memory.n_swa}, {'full-size' if eng.memory.full else 'real'})"
        if eng.memory.kind == "window" else "")
    out(f"model {cfg.model_path}\nmemory {memory}; KV {cfg.cache_type_k}/{cfg.cache_type_v}; "
        f"flash attention {eng.flash_attn}"
        f"{f' ({cfg.flash_attn})' if eng.flash_attn != cfg.flash_attn else ''}; "
        f"batch {eng.batching.size}; {offload}; llama-cpp-python "
        f"{importlib.metadata.version('llama-cpp-python')}\n"
        f"{llama_cpp.llama_print_system_info().decode().strip()}\n")
    out("| check | result | where the states differ |\n|---|---|---|")
    for r in report.rows:
        out(f"| {r.check} | {'exact' if r.ok else 'DIFFERS'} | {r.detail or '-'} |")
    if report.decode is not None:  # --parallel 2 or more: how decode steps of slots run
        proof = report.decode
        shapes = choose_decode(cfg.deterministic, proof, cfg.parallel)
        out(f"| decode 2-{cfg.parallel} slots, batched as they come | "
            f"{'exact' if not proof.batched else 'DIFFERS'} | {proof.batched or '-'} |")
        if proof.fixed is not None:
            out(f"| decode in a fixed shape, a row per slot | "
                f"{'exact' if not proof.fixed else 'DIFFERS'} | {proof.fixed or '-'} "
                f"(a lone slot's step {proof.fixed_cost:.2f}x) |")
        out(f"| decode apart | exact | all slots' steps {proof.apart_cost:.2f}x one batched "
            "step |")
        out(f"\n--deterministic {cfg.deterministic}: {shapes.note}")
    out(f"\n{'exact' if report.ok else 'NOT EXACT: serve reuses nothing'} "
        f"({report.probe_tokens} probe tokens, {report.seconds:.2f} s)")
    eng.close()
    if not report.ok:
        raise SystemExit(1)


# `-np -1`: llama-server's auto is 4 slots in one KV pool that any of them may fill
AUTO_SLOTS = ("-np -1: 1 slot with the whole context; llama-server's auto runs 4 slots that "
              "share one KV pool, where a session's cells would change another's bits. Here each "
              "slot has a KV of its own, -c divided by -np: give -np N (and a -c for N sessions) "
              "to serve an agent, its subagents and its background calls at once")


def serve_config(argv: list[str], environ: dict[str, str] | None = None) -> Config:
    """`prefixgate [serve] FLAGS`: prefixgate's flags and llama-server's, read as llama-server
    reads them (proxy/llama_cli.py: its spellings exactly, never abbreviated nor glued, its
    LLAMA_ARG_* variables); what stops the start is one line per flag that names it and shows
    no value (a value may be a key)."""
    from proxy.llama_cli import scan, scan_env

    if argv[:1] == ["serve"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="prefixgate serve", allow_abbrev=False,
                                description="Prompt-cache proxy for local LLM agents. "
                                "Commands: serve (default), worker, cache, simulate, doctor, "
                                "front, dynamo-worker. "
                                "llama-server's flags and LLAMA_ARG_* variables work too "
                                "(docs/llama-server.md).")
    add_arguments(p)
    p.add_argument("--version", action="version",
                   version=f"prefixgate {importlib.metadata.version('prefixgate')}, llama-cpp-"
                   f"python {importlib.metadata.version('llama-cpp-python')}")
    read = scan(argv, p)
    if read.errors:
        raise SystemExit("\n".join(f"prefixgate: {e}" for e in read.errors))
    reads = {env for _, env in LLAMA_SERVER.values() if env} | {"LLAMA_ARG_MMAP",
                                                                "LLAMA_ARG_MLOCK"}
    environ, env_notes = scan_env(dict(os.environ) if environ is None else environ, reads)
    ns = p.parse_args(read.argv)
    notes = read.notes + env_notes
    # the flag, else its variables, in from_args's order
    if str(ns.parallel or environ.get("PREFIXGATE_PARALLEL") or
           environ.get("LLAMA_ARG_N_PARALLEL") or "").strip() == "-1":
        ns.parallel = "1"  # llama-server's auto: what it means here, said
        notes.append(AUTO_SLOTS)
    cfg = from_args(ns, environ)
    if cfg.n_gpu_layers and not cfg.worker_url:  # remote workers have GPUs of their own
        from backend.placement import offload_devices

        if not offload_devices():  # as llama-server runs it, on the CPU, but said
            notes.append(f"-ngl {'all' if cfg.n_gpu_layers < 0 else cfg.n_gpu_layers}: this "
                         "llama-cpp-python has no GPU backend (a CPU-only build), so every "
                         "layer runs on the CPU; for GPU layers install the CUDA build (`make "
                         "serve GPU=cuda`, or deploy/Dockerfile)")
            cfg = dataclasses.replace(cfg, n_gpu_layers=0)
    if not cfg.worker_url and (cfg.device or cfg.split_mode == "none"):
        from backend.placement import chosen

        try:  # a device the workers would not find: one line now, not a worker's failure
            gpus = chosen(cfg.device, cfg.split_mode, cfg.main_gpu)
        except ValueError as e:
            raise SystemExit(f"prefixgate: {e}") from None
        if not gpus and cfg.n_gpu_layers:
            notes.append(f"-dev {cfg.device}: no device to offload to, so every layer runs on "
                         "the CPU" if cfg.device else f"-sm none -mg {cfg.main_gpu}: no GPU "
                         "holds the model, so every layer runs on the CPU")
            cfg = dataclasses.replace(cfg, n_gpu_layers=0)
    return dataclasses.replace(cfg, llama_notes=tuple(notes))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    if argv[:1] == ["doctor"]:
        return doctor(argv[1:])
    if argv[:1] == ["cache"]:
        from proxy.cache_cli import main as cache_main

        return cache_main(argv[1:])
    if argv[:1] == ["front"]:
        from proxy.front import main as front_main

        return front_main(argv[1:])
    if argv[:1] == ["dynamo-worker"]:
        from proxy.dynamo import worker_main

        return worker_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from bench.simulate import main as simulate_main

        return simulate_main(argv[1:])
    serve(serve_config(argv))


if __name__ == "__main__":
    main()
