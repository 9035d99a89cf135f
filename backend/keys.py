"""Cache keys: what a KV snapshot is stored under.

Rules:

- ``key(n) = xxh3_128(salt || int32-LE(ids[0:n]))``. A key names exactly the first n tokens of a
  prompt under one salt; an entry stored under it holds KV for exactly n tokens (the exactness
  invariant, enforced where entries are written).
- The salt fingerprints everything that makes a saved state incompatible with the running one:
  the model file's identity (its size and the xxh3_128 of all its bytes, of every part of a
  split model: any changed weight changes it; not its name, path or mtime, so a copied, renamed
  or re-downloaded identical file still hits), n_ctx, the K and V cache types, flash attention
  (on/off/auto), a full-size or real sliding window, the llama-cpp-python version, the devices
  that compute the KV (their kind and model, and the CPU's kernel features where it computes
  layers: another GPU or CPU computes other bits, so its state is not what a cold run here
  computes), and the tenant when isolation is on.
  Changing any of them makes every key different: a clean miss,
  never a bad load.
- The whole file is hashed once (measured 2.4-3.9 GB/s: the 98 MB default model in 26-41 ms,
  so a 20 GB model in 5-8 s, or its disk's read time: 40 s at 500 MB/s); the digest is
  remembered in ``$XDG_CACHE_HOME/prefixgate/model-hashes.json`` (``~/.cache/prefixgate``),
  keyed by the file's (device, inode, size, mtime_ns, ctime_ns), so a restart re-hashes
  nothing. The model's directory is never written (it may be read-only). Any write to the file
  changes its mtime or ctime (ctime cannot be set back), so a changed file is hashed again; a
  file changed in the last 2 s is hashed every time (its times may not have ticked yet); an
  unwritable sidecar only costs a re-hash per start (one warning). A lock file makes
  concurrent starters (the proxy and its workers) hash once between them.
- Keys persist across restarts, so everything here is a fixed byte encoding hashed with xxh3;
  never Python's ``hash()`` or pickle.
- :func:`prefix_keys` walks one streaming xxh3_128 state along the prompt and takes a digest at
  each candidate position, so each extra position costs O(1) beyond hashing the prompt once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

import xxhash

from policies.prefix import BATCHING_RULE, CPU_BATCH, packed_le

log = logging.getLogger(__name__)

CacheKey = NewType("CacheKey", bytes)
"""16 bytes: the xxh3_128 digest of salt and token ids."""

KEY_SIZE_BYTES = 16
_HASH_CHUNK_BYTES = 16 << 20  # the model file is read in chunks of this size
_HASHES_FILE = "model-hashes.json"
_HASH_NOTE_S = 5.0  # a long first hash says how far it got this often
_HASHES_KEPT = 32  # model files remembered in it, the most recently hashed
_SETTLED_NS = 2_000_000_000  # a file changed more recently than this is hashed, not remembered
# v2: workers load models without llama.cpp's CPU extra buffer types (backend/engine.py), which
# changes the KV a prefill computes on CPUs that used them: snapshots of v1 are a clean miss
_SALT_DOMAIN = b"prefixgate-salt-v2\0"
_FINGERPRINT_DOMAIN = b"prefixgate-fingerprint-v1\0"


_hashed: dict[str, str] = {}  # file stamp -> digest, this process's memory of the sidecar
_hashing = threading.Lock()


_SPLIT_NAME = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})\.gguf$")  # llama.cpp's split names


def model_files(model_path: str | os.PathLike[str]) -> list[Path]:
    """The files a model is: every part of a split GGUF (``NAME-0000I-of-0000N.gguf``, as
    llama.cpp names them and loads the others from beside the first), else the file alone."""
    path = Path(model_path)
    m = _SPLIT_NAME.match(path.name)
    if m is None or int(m.group(3)) <= 1:
        return [path]
    n = int(m.group(3))
    return [path.with_name(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def model_identity(model_path: str | os.PathLike[str]) -> dict[str, object]:
    """Size and xxh3_128 of every byte of the model file (not its name, path or mtime); of a
    split model, of every part, in order (a missing part is a FileNotFoundError)."""
    files = model_files(model_path)
    if len(files) == 1:
        st = files[0].stat()
        return {"size_bytes": st.st_size, "xxh3_128": file_digest(model_path)}
    return {"size_bytes": sum(f.stat().st_size for f in files),
            "parts": [{"size_bytes": f.stat().st_size, "xxh3_128": file_digest(f)}
                      for f in files]}


def file_digest(path: str | os.PathLike[str], hashes_dir: Path | None = None) -> str:
    """The xxh3_128 hex digest of the file, remembered in ``hashes_dir`` (default
    ``$XDG_CACHE_HOME/prefixgate``) under the file's stamp: computed once per file version."""
    directory = user_dir() if hashes_dir is None else Path(hashes_dir)
    with _hashing:
        stamp = _stamp(path)
        if stamp is None:
            return _hash_file(path)
        if stamp not in _hashed:
            _hashed[stamp] = _digest_once(path, stamp, directory)
        return _hashed[stamp]


def _digest_once(path: str | os.PathLike[str], stamp: str, directory: Path) -> str:
    """The sidecar's digest for ``stamp``, or the file hashed and the digest added to it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / f"{_HASHES_FILE}.lock", "a")  # closed by the with below
    except OSError as e:
        log.warning("cannot remember model file hashes in %s (%s): the model file is hashed "
                    "at every start", directory, e)
        return _hash_file(path)
    with lock:
        with contextlib.suppress(OSError):  # no flock on this filesystem: hash without it
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be hashing it right now
        record = _remembered(directory).get(stamp)
        if record is not None:
            return str(record["xxh3_128"])
        digest = _hash_file(path)
        if _stamp(path) == stamp:  # unchanged while it was read
            try:
                _remember(directory, stamp, path, digest)
            except OSError as e:
                log.warning("cannot remember the model file hash in %s: %s", directory, e)
        return digest


def user_dir() -> Path:
    """prefixgate's directory of what one start remembers for the next (model file hashes,
    the self-check's verdicts): ``$XDG_CACHE_HOME/prefixgate``, else ``~/.cache/prefixgate``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefixgate"


def _stamp(path: str | os.PathLike[str]) -> str | None:
    """What changes whenever the file's bytes may have: (device, inode, size, mtime, ctime).
    None for a file changed in the last ``_SETTLED_NS``: file times tick coarsely (a jiffy),
    so a second write in the same tick would keep the stamp."""
    st = os.stat(path)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < _SETTLED_NS:
        return None
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _hash_file(path: str | os.PathLike[str]) -> str:
    started = time.perf_counter()
    note = started + _HASH_NOTE_S
    hasher = xxhash.xxh3_128()
    buf = memoryview(bytearray(_HASH_CHUNK_BYTES))
    size, done = os.path.getsize(path), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(buf[:n])
            done += n
            if time.perf_counter() >= note:  # a 60 GB file from a slow disk: say how far
                log.info("hashing the model file %s (once per file version): %.0f%% of %.1f GB",
                         path, 100 * done / max(size, 1), size / 1e9)
                note += _HASH_NOTE_S
    log.info("hashed the model file %s in %.1f s", path, time.perf_counter() - started)
    return hasher.hexdigest()


def _remembered(directory: Path) -> dict[str, dict[str, object]]:
    """The sidecar's stamp -> {xxh3_128, path, hashed_s}; what is missing or malformed is left
    out (and dropped at the next write)."""
    try:
        files = json.loads((directory / _HASHES_FILE).read_text())["files"]
        return {stamp: record for stamp, record in files.items()
                if isinstance(record.get("xxh3_128"), str)
                and isinstance(record.get("hashed_s"), (int, float))}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _remember(directory: Path, stamp: str, path: str | os.PathLike[str], digest: str) -> None:
    """Add one file to the sidecar (atomically: a temp file renamed over it)."""
    files = _remembered(directory)
    files[stamp] = {"xxh3_128": digest, "path": str(Path(path).resolve()), "hashed_s": time.time()}
    newest = sorted(files.items(), key=lambda kv: float(kv[1]["hashed_s"]))[-_HASHES_KEPT:]
    tmp = directory / f".{_HASHES_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"version": 1, "files": dict(newest)}, indent=1))
        os.replace(tmp, directory / _HASHES_FILE)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def make_salt(
    model_path: str,
    n_ctx: int,
    type_k: str,
    type_v: str,
    flash_attn: str,
    lib_version: str,
    tenant: str = "",
    swa_full: bool = True,
    batch: int = CPU_BATCH,
    compute: str = "",
) -> bytes:
    """The 16-byte salt of every key for this model, configuration and tenant.

    Deterministic: the same file and settings give the same salt in any process. ``tenant=""``
    is the salt without tenant isolation, which is also what :func:`fingerprint` takes.
    """
    fields = {
        "model": model_identity(model_path),
        "n_ctx": int(n_ctx),
        "type_k": str(type_k),
        "type_v": str(type_v),
        "flash_attn": str(flash_attn),
        "swa_full": bool(swa_full),
        "batch": int(batch),  # a hit replays the cold run's batches: their size must match,
        "batching": BATCHING_RULE,  # and the rule that cuts them (policies.prefix.Batching)
        "lib_version": str(lib_version),
        "compute": str(compute),  # backend.placement.compute_identity
        "tenant": str(tenant),
    }
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return xxhash.xxh3_128_digest(_SALT_DOMAIN + canonical.encode("ascii"))


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """Everything that makes a saved state incompatible with a running one: the salt's fields
    (the tenant aside). Proxy, workers, benchmarks and tests build it in one place
    (``proxy.config.cache_identity``) and key everything through it."""

    model_path: str
    n_ctx: int  # as configured (llama.cpp pads it; the same setting pads the same)
    type_k: str  # KV cache types
    type_v: str
    flash_attn: str  # on | off | auto
    lib_version: str  # llama-cpp-python's version
    swa_full: bool = True  # a full-size cache for sliding-window layers (else a real window)
    batch: int = CPU_BATCH  # tokens per prefill batch (a snapshot's KV depends on it)
    # the devices that compute the KV, as the workers report them (backend.placement
    # .compute_identity); the proxy learns it from its first worker
    compute: str = ""

    def salt(self, tenant: str = "") -> bytes:
        return make_salt(self.model_path, self.n_ctx, self.type_k, self.type_v, self.flash_attn,
                         self.lib_version, tenant, self.swa_full, self.batch, self.compute)

    def fingerprint(self) -> bytes:
        return fingerprint(self.salt())


def fingerprint(salt_without_tenant: bytes) -> bytes:
    """16 bytes naming the model and configuration; written into every state file header."""
    return xxhash.xxh3_128_digest(_FINGERPRINT_DOMAIN + bytes(salt_without_tenant))


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes (the byte string keys are computed over)."""
    if hasattr(ids, "astype"):  # a numpy array: convert without a per-element Python loop
        return bytes(ids.astype("<i4", copy=False).tobytes())
    return packed_le(ids)


def prefix_keys(salt: bytes, ids: Sequence[int], positions: Sequence[int]) -> dict[int, CacheKey]:
    """The key of the first n ids for every n in positions with 1 <= n <= len(ids).

    One streaming hash runs along the prompt: each sorted position feeds it the ids since the
    previous one and takes a digest, so the cost is one pass over the ids plus O(1) per position.
    """
    wanted = sorted({n for n in positions if 1 <= n <= len(ids)})
    if not wanted:
        return {}
    view = memoryview(pack_ids(ids[: wanted[-1]]))
    state = xxhash.xxh3_128(salt)
    keys: dict[int, CacheKey] = {}
    done = 0
    for n in wanted:
        state.update(view[4 * done : 4 * n])
        keys[n] = CacheKey(state.digest())
        done = n
    return keys
