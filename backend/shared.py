"""The shared snapshot tier (issue 22): state files published to Redis or Valkey, where a
prefixgate on another host finds and pulls them.

    SharedTier(url, fingerprint)
      .publish(key, tenant_tag, path)        a durable local state file, chunked, then its entry
      .pull(key, tenant_tag, dest) -> bool   its chunks into a local state file (atomically)
      .longest(keys) -> (n, key, size)|None  which of these candidate keys the tier holds

Layout, under a namespace of the model and configuration (`pg:{fingerprint}`), so two models
never meet: `…:c:{key}:{i}` the file's chunks (`CHUNK_BYTES` each), then `…:e:{key}` its entry
(a hash: n_tokens, size, chunks, tenant tag, checksum). The entry is written last: an entry
whose chunks are not all there is a publish that did not finish, or chunks Redis evicted
(`maxmemory` with an LRU policy bounds the tier), and pulling it is a miss.

Rules:
- Keys are the local cache's keys (`backend.keys.prefix_keys`): the tenant's salt is in them,
  so a tenant can only ever name its own entries; the entry's tenant tag is checked too.
- A pulled file is written to a temp file next to its final path and renamed only once all its
  chunks came; the worker then reads it with `store.read_state_file`, which verifies magic,
  fingerprint, checksum and the prompt's token ids before anything is loaded. A bad chunk is a
  verified miss.
- The tier may lose anything at any time: every failure here (Redis down, killed mid-publish
  or mid-pull, an entry gone) is a `SharedFault`, counted and logged by the caller, and the
  request goes on as a miss. Nothing here ever fails a request.
- Only workers move state bytes (as for the local tier); the proxy asks `longest`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from backend.redact import redact_url

SHARED_PREFIX = "shared:"  # a plan's restore entry in the shared tier: "shared:<key hex>"
# what a worker reports of its shared tier (its /health "shared"; proxy metrics per stat)
STATS = ("published_bytes", "publish_failures", "pulls", "pulled_bytes", "pull_s",
         "verify_failures")
CHUNK_BYTES = 8 << 20  # Redis strings stay far below their 512 MB limit
TIMEOUT_S = 5.0


def redacted(url: str) -> str:
    """The URL without its secrets, in any form redis-py takes them (redis://:secret@host:6379
    -> redis://host:6379; ?password=secret -> ?password=***): `backend.redact`."""
    return redact_url(url)


class SharedFault(Exception):
    """The shared tier could not do it: a miss (or a lost publish), never an error."""


class SharedTier:
    def __init__(self, url: str, fingerprint: bytes) -> None:
        import redis

        self.url = redacted(url)  # for messages: a password in the URL is never shown
        self.ns = f"pg:{fingerprint.hex()}"
        self._redis: Any = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S,
                                               socket_connect_timeout=TIMEOUT_S)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)

    def _entry(self, key: bytes) -> str:
        return f"{self.ns}:e:{key.hex()}"

    def _chunk(self, key: bytes, i: int) -> str:
        return f"{self.ns}:c:{key.hex()}:{i}"

    def publish(self, key: bytes, tenant_tag: str, n_tokens: int, checksum: int,
                path: Path) -> int:
        """The file's bytes in chunks, then its entry; the bytes published."""
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                i = 0
                while chunk := f.read(CHUNK_BYTES):
                    self._redis.set(self._chunk(key, i), chunk)
                    i += 1
            self._redis.hset(self._entry(key), mapping={
                "n_tokens": n_tokens, "size": size, "chunks": i, "tenant": tenant_tag,
                "checksum": checksum, "published_s": int(time.time())})
        except self._errors as e:
            raise SharedFault(f"publish to {self.url}: {type(e).__name__}: {e}") from None
        return size

    def pull(self, key: bytes, tenant_tag: str, dest: Path) -> int:
        """The entry's file at `dest` (a temp file renamed once complete); its size."""
        try:
            entry = {k.decode(): v.decode() for k, v in
                     self._redis.hgetall(self._entry(key)).items()}
            if not entry:
                raise SharedFault("the entry is gone from the shared tier")
            if entry.get("tenant") != tenant_tag:
                raise SharedFault("the entry is another tenant's")
            chunks, size = int(entry["chunks"]), int(entry["size"])
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-shared-", dir=dest.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    for i in range(chunks):
                        data = self._redis.get(self._chunk(key, i))
                        if data is None:
                            raise SharedFault(f"chunk {i} of {chunks} is gone")
                        f.write(data)
                    if f.tell() != size:
                        raise SharedFault(f"pulled {f.tell()} bytes, the entry says {size}")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, dest)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except self._errors as e:
            raise SharedFault(f"pull from {self.url}: {type(e).__name__}: {e}") from None
        except (KeyError, ValueError) as e:
            raise SharedFault(f"a malformed shared entry: {e}") from None
        return size

    def longest(self, candidates: dict[int, bytes], tenant_tag: str
                ) -> tuple[int, bytes, int] | None:
        """Of `candidates` (tokens -> key), the longest the tier holds for this tenant:
        (tokens, key, size); one round trip."""
        if not candidates:
            return None
        order = sorted(candidates, reverse=True)
        try:
            pipe = self._redis.pipeline(transaction=False)
            for n in order:
                pipe.hmget(self._entry(candidates[n]), "size", "tenant")
            found = pipe.execute()
        except self._errors as e:
            raise SharedFault(f"lookup in {self.url}: {type(e).__name__}: {e}") from None
        for n, (size, tenant) in zip(order, found, strict=True):
            if size is not None and tenant is not None and tenant.decode() == tenant_tag:
                return n, candidates[n], int(size)
        return None

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self._redis.close()


def entries(url: str) -> list[dict[str, Any]]:
    """Every entry of the tier, all models (`prefixgate cache shared-ls`): its namespace (the
    model and configuration), key, tokens, size, chunks and age."""
    import redis

    r = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    try:
        out = []
        for name in r.scan_iter("pg:*:e:*", count=1000):
            ns, _, key = name.decode().rpartition(":e:")
            fields = {k.decode(): v.decode() for k, v in r.hgetall(name).items()}
            if fields:
                out.append({"namespace": ns, "key": key, **fields})
        return out
    except (redis.RedisError, OSError) as e:
        raise SharedFault(f"{redacted(url)}: {type(e).__name__}: {e}") from None
    finally:
        r.close()


def prune(url: str, older_than_s: float = 0.0, namespace: str = "") -> tuple[int, int]:
    """Delete entries published more than `older_than_s` ago (0: all), of one namespace or all,
    with their chunks (`prefixgate cache shared-prune`); (entries, chunks) deleted."""
    import redis

    r = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    now, n_entries, n_chunks = time.time(), 0, 0
    try:
        for e in entries(url):
            if namespace and e["namespace"] != namespace:
                continue
            if older_than_s and now - float(e.get("published_s", now)) < older_than_s:
                continue
            r.delete(f"{e['namespace']}:e:{e['key']}")  # the entry first: no half-pull after
            chunks = [f"{e['namespace']}:c:{e['key']}:{i}" for i in range(int(e["chunks"]))]
            n_chunks += int(r.delete(*chunks)) if chunks else 0
            n_entries += 1
        return n_entries, n_chunks
    except (redis.RedisError, OSError) as e:
        raise SharedFault(f"{redacted(url)}: {type(e).__name__}: {e}") from None
    finally:
        r.close()
