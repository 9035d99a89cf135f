"""The shared snapshot tier (issue 22): state files published to Redis or Valkey, where a
prefixgate on another host finds and pulls them. Redis is a trust boundary (issue 46).

    SharedTier(url, fingerprint, secret=None)  (None: PREFIXGATE_SHARED_TIER_SECRET)
      .publish(key, tenant, n_tokens, checksum, path, published) -> int   queued, never waits
      .pull(key, tenant, dest) -> int        its parts into a verified local state file
      .longest(candidates, tenant) -> (n, key, size) | None    which keys the tier holds
      .stats() -> {STATS name: value}        what it did (a worker reports it in /health)

Layout, under a namespace of the model and configuration (`pg:{fingerprint}`), so two models
never meet: `…:p:{digest}` the file's parts, each named by a (keyed) hash of its bytes and
stored once however many files hold it, then `…:e:{name}` its entry (a hash: n_tokens, size,
chunks (how many parts), parts (their digests, in order), tenant tag, checksum, published_s,
mac). A file is cut where the snapshots of one prompt share their bytes
(`backend.shared_parts`: per layer, every 256 tokens), so a prompt's continued snapshots send
only what the last one did not hold. The entry is written last: an entry whose parts are not
all there is a publish that did not finish, or parts Redis evicted (`maxmemory` with an LRU
policy bounds the tier; a publish touches the parts it reuses), and pulling it is a miss.

What Redis sees and what it is trusted with:
- Redis holds every published prompt's token ids in clear (in each state file's header) and
  its KV state; whoever reads it reads the prompts. Nothing from it is trusted unverified.
- The team's secret (`--shared-tier-secret`, PREFIXGATE_SHARED_TIER_SECRET; every host and
  worker of the tier needs the same) keys three things: the entry names (`name`: a keyed hash of
  the local cache key, which itself is a hash of the tenant's salt and the token ids), the
  tenant tags (a keyed hash of the tenant id, itself an unkeyed hash of the API key), and each
  entry's `mac` (keyed BLAKE2b over the entry's fields and the file's bytes). So whoever can
  write to Redis but lacks the secret cannot plant a state a host will load (a verified miss),
  and whoever reads Redis cannot test API key guesses offline. Without a secret the same MAC,
  unkeyed, still catches damage, but not a forgery: said in one log line by the proxy.
- A pulled file is verified before it is renamed into the cache directory: the MAC, then the
  state file's own header (magic, version, this fingerprint, length, checksum, the entry's
  n_tokens and checksum). A file refused there never stays: its temp file is deleted. The
  worker then checks the token ids against the prompt (`store.read_state_file`) as for any file.
- Anything malformed in Redis (a size that is no integer, a tenant that is not UTF-8, a missing
  field) is a miss and one warning, never an exception out of `longest` or `pull`.

Faults:
- The tier may lose anything at any time: every failure (Redis down, killed mid-publish or
  mid-pull, an entry gone, a refused MAC) is a `SharedFault`, counted, and the request goes on
  as a miss. Nothing here ever fails a request.
- A Redis that does not answer costs at most `LOOKUP_TIMEOUT_S` (a lookup) or `TIMEOUT_S` (a
  chunk) once: the first connection failure or timeout opens a circuit breaker
  (`backend.breaker`), and for `BACKOFF_S` the tier is skipped without a round trip (a
  `SharedFault` at once, counted as `skipped`); then one call tries again. Opening and closing
  are one log line each.
- Publishing runs on the tier's own thread, from its own queue of at most `PUBLISH_QUEUE_MAX`
  files: when it is full the oldest waiting file is dropped (counted as `publish_dropped`): the
  newest snapshots are the likeliest to be asked for, and a file waiting long may be evicted
  locally anyway. So the caller (the worker's writer thread) never waits on Redis.
- Redis refusing a write (OOM: `maxmemory` reached under a policy that evicts nothing) is
  counted as `publish_refused` and said in one log line until a publish succeeds again; the
  chunks of that publish are removed.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from backend import shared_parts, store
from backend.breaker import Breaker
from backend.redact import redact_url, scrub, url_secrets

log = logging.getLogger("prefixgate.shared")

# what a worker reports of its shared tier (its /health "shared"; proxy metrics per stat)
STATS = ("published_bytes", "publish_failures", "pulls", "pulled_bytes", "pull_s",
         "verify_failures", "publish_queued", "publish_dropped", "publish_refused", "skipped",
         "malformed", "reused_bytes")
PULL_BATCH = 8  # parts fetched per round trip (each at most shared_parts.MAX_PART_BYTES)
SEND_BATCH_BYTES = 32 << 20  # bytes of parts sent per round trip
TIMEOUT_S = 5.0  # a chunk's round trip, at most
LOOKUP_TIMEOUT_S = 1.0  # a lookup's round trip (on a request's path), at most
BACKOFF_S = 30.0  # how long a tier that failed is skipped
PUBLISH_QUEUE_MAX = 64  # files waiting to be published
SECRET_ENV = "PREFIXGATE_SHARED_TIER_SECRET"
_HEX = frozenset("0123456789abcdef")
_FIELDS = ("n_tokens", "size", "chunks", "parts", "tenant", "checksum", "published_s")


def redacted(url: str) -> str:
    """The URL without its secrets, in any form redis-py takes them (redis://:secret@host:6379
    -> redis://host:6379; ?password=secret -> ?password=***): `backend.redact`."""
    return redact_url(url)


class SharedFault(Exception):
    """The shared tier could not do it: a miss (or a lost publish), never an error."""


class SharedSkipped(SharedFault):
    """Not tried: the tier failed moments ago (its breaker is open). Counted, not logged."""


def _keys(secret: str) -> tuple[bytes, bytes, bytes]:
    """(name key, tenant key, MAC key) derived from the secret; empty keys without one."""
    if not secret:
        return b"", b"", b""
    root = hashlib.blake2b(secret.encode(), person=b"pg-shared-tier").digest()
    return tuple(hashlib.blake2b(p, key=root).digest() for p in  # type: ignore[return-value]
                 (b"name", b"tenant", b"mac"))


class SharedTier:
    def __init__(self, url: str, fingerprint: bytes, secret: str | None = None,
                 backoff_s: float = BACKOFF_S) -> None:
        import redis

        self.url = redacted(url)  # for messages: a password in the URL is never shown
        self._secrets = url_secrets(url)  # scrubbed from any error text too
        self.fingerprint = bytes(fingerprint)
        self.ns = f"pg:{self.fingerprint.hex()}"
        secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
        self.authenticated = bool(secret)
        self._name_key, self._tenant_key, self._mac_key = _keys(secret)
        self._redis: Any = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S,
                                               socket_connect_timeout=TIMEOUT_S)
        self._lookups: Any = redis.Redis.from_url(url, socket_timeout=LOOKUP_TIMEOUT_S,
                                                 socket_connect_timeout=LOOKUP_TIMEOUT_S)
        # a connection that failed or timed out opens the breaker; a refused command does not
        self._down: tuple[type[BaseException], ...] = (redis.ConnectionError,
                                                       redis.TimeoutError)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._breaker = Breaker(f"shared tier {self.url}", backoff_s, log)
        self._stats: dict[str, float] = dict.fromkeys(STATS, 0)
        self._warned: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._refusing = False
        # files to publish, each with what to call once Redis holds it
        self._queue: collections.deque[tuple[tuple[bytes, str, int, int, Path],
                                             Callable[[], None] | None]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    # --- names, tags and the MAC -----------------------------------------------------------

    def _name(self, key: bytes) -> str:
        if not self._name_key:
            return key.hex()
        return hashlib.blake2b(key, key=self._name_key, digest_size=16).hexdigest()

    def _entry(self, key: bytes) -> str:
        return f"{self.ns}:e:{self._name(key)}"

    def _part(self, digest: str) -> str:
        return f"{self.ns}:p:{digest}"

    def _digest(self, data: bytes) -> str:
        return hashlib.blake2b(data, key=self._name_key, digest_size=16).hexdigest()

    def tag(self, tenant: str) -> str:
        """The tenant as Redis sees it: keyed with the secret (unkeyed without one)."""
        if not self._tenant_key:
            return tenant
        return hashlib.blake2b(tenant.encode(), key=self._tenant_key,
                               digest_size=16).hexdigest()

    def _mac(self, key: bytes, fields: dict[str, str], file_digest: bytes) -> str:
        h = hashlib.blake2b(key=self._mac_key, digest_size=32, person=b"pg-entry")
        h.update(self.ns.encode() + b"\0" + key + b"\0")
        for f in _FIELDS:
            h.update(f"{f}={fields[f]}\0".encode())
        h.update(file_digest)
        return h.hexdigest()

    def _fault(self, what: str, e: BaseException) -> SharedFault:
        """A SharedFault for a Redis error, its text scrubbed of the URL's secrets; a
        connection failure or timeout opens the breaker."""
        why = scrub(f"{type(e).__name__}: {e}", self._secrets)
        if isinstance(e, self._down):
            self._breaker.failed(why)
        else:  # it answered (refusing): the tier is there
            self._breaker.succeeded()
        return SharedFault(f"{what} {self.url}: {why}")

    def _allow(self, what: str) -> None:
        if not self._breaker.allow():
            self._stats["skipped"] += 1
            raise SharedSkipped(f"{what} skipped: the shared tier {self.url} failed moments ago")

    def _malformed(self, name: str, why: str) -> SharedFault:
        """A bad entry: a miss, and one warning per entry (the last few remembered)."""
        self._stats["malformed"] += 1
        if name not in self._warned:
            self._warned[name] = None
            while len(self._warned) > 1024:
                self._warned.popitem(last=False)
            log.warning("shared tier %s: a malformed entry %s is a miss: %s", self.url,
                        name.rpartition(":")[2], why)
        return SharedFault(f"a malformed shared entry: {why}")

    def _parse(self, name: str, raw: dict[Any, Any]) -> dict[str, str]:
        try:
            entry = {k.decode(): v.decode() for k, v in raw.items()}
            missing = [f for f in (*_FIELDS, "mac") if not entry.get(f) and f != "tenant"]
            if missing or "tenant" not in entry:
                raise ValueError(f"no {', '.join(missing) or 'tenant'}")
            for f in ("n_tokens", "size", "chunks", "checksum"):
                if int(entry[f]) < 0:
                    raise ValueError(f"{f} is negative")
            parts = entry["parts"].split(",")
            if len(parts) != int(entry["chunks"]) or not all(
                    len(p) == 32 and set(p) <= _HEX for p in parts):
                raise ValueError("its parts are not its chunks' digests")
        except (ValueError, AttributeError) as e:  # UnicodeDecodeError is a ValueError
            raise self._malformed(name, f"{type(e).__name__}: {e}") from None
        return entry

    # --- lookups ---------------------------------------------------------------------------

    def longest(self, candidates: dict[int, bytes], tenant: str
                ) -> tuple[int, bytes, int] | None:
        """Of `candidates` (tokens -> key), the longest the tier holds for this tenant:
        (tokens, key, size); one round trip, on the short lookup timeout. A malformed entry
        is passed over (a miss, one warning)."""
        if not candidates:
            return None
        self._allow("lookup")
        order = sorted(candidates, reverse=True)
        try:
            pipe = self._lookups.pipeline(transaction=False)
            for n in order:
                pipe.hmget(self._entry(candidates[n]), "size", "tenant", "mac")
            found = pipe.execute()
        except self._errors as e:
            raise self._fault("lookup in", e) from None
        self._breaker.succeeded()
        tag = self.tag(tenant)
        for n, (size, their_tag, mac) in zip(order, found, strict=True):
            if size is None and their_tag is None:
                continue
            try:
                if their_tag is None or mac is None or their_tag.decode() != tag:
                    continue
                if int(size) < 0:
                    raise ValueError(f"size {int(size)}")
                return n, candidates[n], int(size)
            except (ValueError, TypeError, AttributeError) as e:
                self._malformed(self._entry(candidates[n]), f"{type(e).__name__}: {e}")
        return None

    # --- pulling -----------------------------------------------------------------------------

    def pull(self, key: bytes, tenant: str, dest: Path) -> int:
        """The entry's file at `dest`, verified (the module's rules) before it is renamed
        there; its size. A file that fails leaves nothing behind."""
        self._allow("pull")
        name = self._entry(key)
        try:
            raw = self._redis.hgetall(name)
        except self._errors as e:
            raise self._fault("pull from", e) from None
        self._breaker.succeeded()
        if not raw:
            raise SharedFault("the entry is gone from the shared tier")
        entry = self._parse(name, raw)
        if entry["tenant"] != self.tag(tenant):
            raise SharedFault("the entry is another tenant's")
        parts, size = entry["parts"].split(","), int(entry["size"])
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=".tmp-shared-", dir=dest.parent)
        except OSError as e:
            raise SharedFault(f"cannot write a pulled file in {dest.parent}: {e}") from None
        tmp = Path(tmp_name)
        try:
            digest = hashlib.blake2b(digest_size=32)
            with os.fdopen(fd, "wb") as f:
                for i in range(0, len(parts), PULL_BATCH):
                    try:
                        got = self._redis.mget([self._part(p) for p in parts[i:i + PULL_BATCH]])
                    except self._errors as e:
                        raise self._fault("pull from", e) from None
                    for j, data in enumerate(got, i):
                        if data is None:
                            raise SharedFault(f"chunk {j} of {len(parts)} is gone")
                        if f.tell() + len(data) > size:
                            raise self._refused(f"parts past the entry's {size} bytes")
                        digest.update(data)
                        f.write(data)
                if f.tell() != size:
                    raise SharedFault(f"pulled {f.tell()} bytes, the entry says {size}")
                f.flush()
                os.fsync(f.fileno())
            if not hmac.compare_digest(self._mac(key, entry, digest.digest()), entry["mac"]):
                raise self._refused("its MAC does not verify (altered, or published with "
                                    "another --shared-tier-secret)")
            self._check_file(tmp, entry)
            os.replace(tmp, dest)
        except OSError as e:  # the local disk's (Redis errors are SharedFaults by now)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise SharedFault(f"cannot write the pulled file {dest}: {e}") from None
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return size

    def _refused(self, why: str) -> SharedFault:
        self._stats["verify_failures"] += 1
        return SharedFault(f"a pulled file refused: {why}")

    def _check_file(self, path: Path, entry: dict[str, str]) -> None:
        """The state file's own checks, and that it is the file the entry describes."""
        try:
            store.verify_file(path)
            header = store.read_header(path)
        except store.CacheFault as e:
            raise self._refused(str(e)) from None
        if header.fingerprint != self.fingerprint:
            raise self._refused("its header names another model or configuration")
        if header.n_tokens != int(entry["n_tokens"]) or \
                header.checksum != int(entry["checksum"]):
            raise self._refused("its header is not the entry's (tokens or checksum)")

    # --- publishing ----------------------------------------------------------------------------

    def publish(self, key: bytes, tenant: str, n_tokens: int, checksum: int,
                path: Path, published: Callable[[], None] | None = None) -> int:
        """Queue a durable local state file for publishing (the tier's own thread sends it:
        chunks, then its entry); the bytes queued. Never waits on Redis; when the queue is
        full the oldest waiting file is dropped. `published` is called on the tier's thread
        once Redis holds the entry (never for a file dropped, skipped or failed)."""
        with self._cond:
            if self._closed:
                return 0
            if len(self._queue) >= PUBLISH_QUEUE_MAX:
                self._queue.popleft()
                self._stats["publish_dropped"] += 1
            self._queue.append(((key, tenant, n_tokens, checksum, path), published))
            self._stats["publish_queued"] = len(self._queue)
            if self._thread is None:
                self._thread = threading.Thread(target=self._publisher, name="shared-publish",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            return path.stat().st_size
        except OSError:
            return 0

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued file was published (or failed); False on the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _publisher(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                item, published = self._queue.popleft()
                self._stats["publish_queued"] = len(self._queue)
                self._busy = True
            try:
                self._stats["published_bytes"] += self._send(*item)
                if published is not None:
                    published()
            except SharedSkipped:  # counted as skipped
                pass
            except SharedFault as e:
                self._stats["publish_failures"] += 1
                log.debug("shared tier: a snapshot of %d tokens not published: %s", item[2], e)
            except Exception as e:  # never lose the thread
                self._stats["publish_failures"] += 1
                log.warning("shared tier: a snapshot of %d tokens not published: %s: %s",
                            item[2], type(e).__name__, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, key: bytes, tenant: str, n_tokens: int, checksum: int, path: Path) -> int:
        """The file's parts Redis lacks, then its entry (with its MAC); the bytes sent."""
        import redis

        self._allow("publish")
        written: list[str] = []
        try:
            with open(path, "rb") as f, _mapped(f) as m:
                # the model's state: a draft model's twin after it stays local
                end = min(store.model_state_end(m), len(m))
                offsets = shared_parts.cuts(m, end)
                spans = list(zip(offsets, [*offsets[1:], end], strict=True))
                names = [self._digest(m[a:b]) for a, b in spans]
                pipe = self._redis.pipeline(transaction=False)
                unique = list(dict.fromkeys(names))
                for n in unique:  # TOUCH: which it has, and keep those fresh for its LRU
                    pipe.touch(self._part(n))
                have = {n for n, held in zip(unique, pipe.execute(), strict=True) if held}
                sent, batch = 0, 0
                for (a, b), n in zip(spans, names, strict=True):
                    if n in have:
                        self._stats["reused_bytes"] += b - a
                        continue
                    pipe.set(self._part(n), m[a:b])
                    have.add(n)
                    written.append(n)
                    batch += b - a
                    if batch >= SEND_BATCH_BYTES:
                        pipe.execute()
                        sent, batch = sent + batch, 0
                pipe.execute()
                with memoryview(m) as whole, whole[:end] as part:
                    size, file_digest = end, hashlib.blake2b(part, digest_size=32).digest()
            fields = {"n_tokens": str(n_tokens), "size": str(size), "chunks": str(len(names)),
                      "parts": ",".join(names), "tenant": self.tag(tenant),
                      "checksum": str(checksum), "published_s": str(int(time.time()))}
            self._redis.hset(self._entry(key), mapping={
                **fields, "mac": self._mac(key, fields, file_digest)})
        except (OSError, ValueError, struct.error) as e:  # evicted locally first, likely
            raise SharedFault(f"the file cannot be read: {e}") from None
        except redis.ResponseError as e:  # refused: OOM under maxmemory, most likely
            self._on_refused(written, e)
            raise self._fault("publish to", e) from None
        except self._errors as e:
            raise self._fault("publish to", e) from None
        self._breaker.succeeded()
        self._refusing = False
        return sent + batch + len(",".join(names))

    def _on_refused(self, written: list[str], e: BaseException) -> None:
        """Said once until a publish succeeds again; the parts this publish added go (those
        it shares with other entries stay)."""
        self._stats["publish_refused"] += 1
        if not self._refusing:
            self._refusing = True
            log.warning("shared tier %s refuses writes (%s): snapshots are not published "
                        "until it takes them again (give it room, or a maxmemory-policy that "
                        "evicts, e.g. allkeys-lru)", self.url,
                        scrub(f"{type(e).__name__}: {e}", self._secrets).splitlines()[0][:200])
        with contextlib.suppress(*self._errors):
            if written:
                self._redis.delete(*(self._part(n) for n in written))

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def close(self) -> None:
        """Stop: what waits to be published is dropped (the files stay local)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        for client in (self._redis, self._lookups):
            with contextlib.suppress(*self._errors):
                client.close()



@contextlib.contextmanager
def _mapped(f: Any) -> Iterator[mmap.mmap]:
    """The file mapped for reading; closed after (or, while a view of it lives, when it goes)."""
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield m
    finally:
        with contextlib.suppress(BufferError):
            m.close()
