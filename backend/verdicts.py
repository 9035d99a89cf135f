"""The self-check's verdicts, remembered (`backend.selfcheck`): a restart that would compute
exactly what the check proved skips it.

    verdict_key(fingerprint, settings) -> str     recall(key) -> verdict | None
    remember(key, verdict)                        verdicts_dir() -> Path

A passing verdict is remembered (`recall`, `remember`: one file per verdict in
``$XDG_CACHE_HOME/prefixgate/selfcheck``, the 64 most recent) under `verdict_key`: the cache
identity (model file bytes, n_ctx, KV types, flash attention, batch, library version, the
devices that compute), the worker's other settings (slots, threads, layers and placement), the
llama.cpp and GPU libraries it runs (path, size and mtime of each), ggml's system info, the
GGML_/CUDA_/HIP_ environment variables its kernels read and the source of the code the check
exercises, with the thread counts the engine resolved (not as given: `-t 0` is one thread on 2
cores, two on 4). The same key is the same computation, so a restart with nothing changed skips
the check (33 s on a 1.1B Q4_K_M model on 2 CPU cores); anything changed checks again. A verdict
file carries a MAC under a key of this user's (`_secret`): one edited by hand or brought from
another machine does not verify and costs a check, never a wrong answer. A failing verdict is
not remembered (every start checks it again), nor is one under a test's injected fault;
`prefixgate doctor` always checks.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import llama_cpp
import xxhash

from backend.keys import user_dir
from backend.selfcheck import proof_from_wire, proof_to_wire

log = logging.getLogger(__name__)

VERDICTS_KEPT = 64
_VERDICT_DOMAIN = "prefixgate-selfcheck-v2"
# the code a verdict proves besides llama.cpp's: the check, the engine and what they rest on
_CHECKED_CODE = ("backend.selfcheck", "backend.engine", "backend.layout", "policies.prefix")
# shared libraries whose kernels compute the states: llama.cpp's, and the GPU and BLAS
# libraries it may load
_LIBRARIES = ("libggml", "libllama", "libcu", "libnv", "libhip", "libamdhip", "librocblas",
              "libvulkan", "libOpenCL", "libmkl", "libopenblas", "libblas")
# environment variables whose switches the kernels read at run time (GGML_CUDA_FORCE_CUBLAS, ...)
_KERNEL_ENV = ("GGML_", "CUDA_", "HIP_", "HSA_", "ROCR_")


def verdict_key(fingerprint: bytes, settings: Mapping[str, Any]) -> str:
    """The name of a verdict: the cache identity's fingerprint (backend.keys), the worker's
    other settings, the libraries, ggml's system info and the checked code (module docstring)."""
    code = xxhash.xxh3_128()
    for name in _CHECKED_CODE:
        try:
            code.update(Path(str(importlib.import_module(name).__file__)).read_bytes())
        except OSError:  # no source to read (a zipped install): the version stands for it
            code.update(f"{name} {importlib.metadata.version('prefixgate')}".encode())
    fields = {"domain": _VERDICT_DOMAIN, "fingerprint": fingerprint.hex(),
              "settings": dict(settings), "code": code.hexdigest(), "libraries": _libraries(),
              "system": llama_cpp.llama_print_system_info().decode(errors="replace"),
              "environment": {k: v for k, v in os.environ.items() if k.startswith(_KERNEL_ENV)}}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(canonical.encode())


def _libraries() -> list[str]:
    """Path, size and mtime of each compute library this process has mapped (Linux); elsewhere
    of the files in llama-cpp-python's library directory."""
    paths: set[str] = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:  # address, perms, offset, device, inode, path
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/") and os.path.basename(path).startswith(_LIBRARIES):
                    paths.add(path)
    except OSError:
        pass
    if not paths:
        lib = Path(llama_cpp.__file__).parent / "lib"
        paths = {str(p) for p in lib.glob("*")} if lib.is_dir() else set()
    stamps = []
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            st = os.stat(path)
            stamps.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return stamps


def verdicts_dir() -> Path:
    return user_dir() / "selfcheck"


def _secret(directory: Path, create: bool) -> bytes | None:
    """This user's key for the verdicts' MACs (32 random bytes, mode 0600, made once): a file
    edited by hand, or copied from another machine, does not verify and is checked again."""
    path = directory / ".key"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        if not create:
            return None
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, os.urandom(32))
    finally:
        os.close(fd)
    return path.read_bytes()


def _mac(secret: bytes, key: str, verdict: Mapping[str, Any]) -> str:
    body = json.dumps({k: v for k, v in verdict.items() if k != "mac"}, sort_keys=True,
                      separators=(",", ":"), default=str)
    return hmac.new(secret, f"{key}\n{body}".encode(), hashlib.sha256).hexdigest()


def recall(key: str, directory: Path | None = None) -> dict[str, Any] | None:
    """The verdict remembered under `key` (`Report.to_wire` and when it was checked), or None:
    one that is not a pass, is malformed, or whose MAC (`_secret`) does not verify is never
    taken (the check runs again)."""
    directory = directory or verdicts_dir()
    path = directory / f"{key}.json"
    try:
        verdict = json.loads(path.read_text())
        secret = _secret(directory, create=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the remembered self-check verdict %s: %s", path, e)
        return None
    try:
        if not isinstance(verdict, dict) or secret is None or not hmac.compare_digest(
                str(verdict.get("mac", "")), _mac(secret, key, verdict)):
            raise ValueError("it does not verify")
        if verdict["ok"] is not True:
            raise ValueError("not a pass")
        checks = [{"check": str(c["check"]), "ok": bool(c["ok"]), "detail": str(c["detail"])}
                  for c in verdict["checks"]]
        decode = verdict["decode"]
        return {**verdict, "checks": checks, "seconds": float(verdict["seconds"]),
                "probe_tokens": int(verdict["probe_tokens"]),
                "checked_at": float(verdict["checked_at"]),
                "decode": None if decode is None else proof_to_wire(proof_from_wire(decode))}
    except (KeyError, TypeError, ValueError) as e:
        log.warning("ignoring the remembered self-check verdict %s (%s): checking again", path,
                    e)
        return None


def remember(key: str, verdict: Mapping[str, Any], directory: Path | None = None) -> None:
    """Keep a passing verdict for the next start (atomically: a reader sees all or nothing),
    and only the VERDICTS_KEPT most recent. A directory that cannot be written costs a check
    per start, said once here."""
    directory = directory or verdicts_dir()
    tmp = directory / f".{key}.{os.getpid()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        secret = _secret(directory, create=True)
        assert secret is not None
        body = {**verdict, "checked_at": time.time()}
        tmp.write_text(json.dumps({**body, "mac": _mac(secret, key, body)}))
        os.replace(tmp, directory / f"{key}.json")
    except OSError as e:
        log.warning("cannot remember the self-check verdict in %s (%s): every start checks",
                    directory, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
        return
    with contextlib.suppress(OSError):  # another start may be pruning at the same time
        kept = sorted(((p.stat().st_mtime, p) for p in directory.glob("*.json")), reverse=True)
        for _, old in kept[VERDICTS_KEPT:]:
            old.unlink(missing_ok=True)
