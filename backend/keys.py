"""Cache keys: what a KV snapshot is stored under.

Rules:

- ``key(n) = xxh3_128(salt || int32-LE(ids[0:n]))``. A key names exactly the first n tokens of a
  prompt under one salt; an entry stored under it holds KV for exactly n tokens (the exactness
  invariant, enforced where entries are written).
- The salt fingerprints everything that makes a saved state incompatible with the running one:
  the model file's identity (basename, size, xxh3_64 of its first and last MiB; never its mtime,
  so a copied or re-downloaded identical file still hits), n_ctx, the K and V cache types,
  flash-attn, the llama-cpp-python version, and the tenant when isolation is on. Changing any of
  them makes every key different: a clean miss, never a bad load.
- Keys persist across restarts, so everything here is a fixed byte encoding hashed with xxh3;
  never Python's ``hash()`` or pickle.
- :func:`prefix_keys` walks one streaming xxh3_128 state along the prompt and takes a digest at
  each candidate position, so each extra position costs O(1) beyond hashing the prompt once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

import xxhash

log = logging.getLogger(__name__)

CacheKey = NewType("CacheKey", bytes)
"""16 bytes: the xxh3_128 digest of salt and token ids."""

KEY_SIZE_BYTES = 16
_EDGE_BYTES = 1 << 20  # how much of each end of the model file goes into its identity
# v2: workers load models without llama.cpp's CPU extra buffer types (backend/engine.py), which
# changes the KV a prefill computes on CPUs that used them: snapshots of v1 are a clean miss
_SALT_DOMAIN = b"prefixgate-salt-v2\0"
_FINGERPRINT_DOMAIN = b"prefixgate-fingerprint-v1\0"


def model_identity(model_path: str | os.PathLike[str]) -> dict[str, object]:
    """Basename, size and xxh3_64 of the first and last MiB of the model file (not its mtime)."""
    path = Path(model_path)
    size_bytes = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_EDGE_BYTES)
        f.seek(max(0, size_bytes - _EDGE_BYTES))
        tail = f.read(_EDGE_BYTES)
    return {
        "name": path.name,
        "size_bytes": size_bytes,
        "head_xxh3_64": xxhash.xxh3_64_hexdigest(head),
        "tail_xxh3_64": xxhash.xxh3_64_hexdigest(tail),
    }


def make_salt(
    model_path: str,
    n_ctx: int,
    type_k: str,
    type_v: str,
    flash_attn: bool,
    lib_version: str,
    tenant: str = "",
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
        "flash_attn": bool(flash_attn),
        "lib_version": str(lib_version),
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
    flash_attn: bool
    lib_version: str  # llama-cpp-python's version

    def salt(self, tenant: str = "") -> bytes:
        return make_salt(self.model_path, self.n_ctx, self.type_k, self.type_v, self.flash_attn,
                         self.lib_version, tenant)

    def fingerprint(self) -> bytes:
        return fingerprint(self.salt())


def fingerprint(salt_without_tenant: bytes) -> bytes:
    """16 bytes naming the model and configuration; written into every state file header."""
    return xxhash.xxh3_128_digest(_FINGERPRINT_DOMAIN + bytes(salt_without_tenant))


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes (the byte string keys are computed over)."""
    if hasattr(ids, "astype"):  # a numpy array: convert without a per-element Python loop
        return bytes(ids.astype("<i4", copy=False).tobytes())
    packed = ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
    assert packed.itemsize == 4, "this platform's C int is not 32 bits"
    if sys.byteorder == "big":
        packed = array("i", packed)
        packed.byteswap()
    return packed.tobytes()


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
