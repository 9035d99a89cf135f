"""The shared tier's housekeeping: `prefixgate cache shared-ls|shared-prune` (proxy/cache_cli.py).

    entries(url) -> [entry]                  every entry of every model and configuration
    prune(url, older_than_s, namespace)      entries published long ago, and the parts only
                                             they held; -> (entries, parts) deleted

Parts are shared between entries (backend/shared.py's layout): a pruned entry's part that an
entry kept still names stays. An entry of the older layout (`…:c:{name}:{i}` chunks, no parts)
is pruned with its chunks. A malformed entry is listed as far as it reads and pruned whole.
"""

from __future__ import annotations

import time
from typing import Any

from backend.redact import scrub, url_secrets
from backend.shared import TIMEOUT_S, SharedFault, redacted


def _client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)


def _fault(url: str, e: BaseException) -> SharedFault:
    return SharedFault(f"{redacted(url)}: {type(e).__name__}: {scrub(str(e), url_secrets(url))}")


def entries(url: str) -> list[dict[str, Any]]:
    """Every entry of the tier, all models: its namespace (the model and configuration), name,
    tokens, size, chunks, parts and age; fields that do not read are left out."""
    import redis

    r = _client(url)
    try:
        out = []
        for name in r.scan_iter("pg:*:e:*", count=1000):
            ns, _, key = name.decode(errors="replace").rpartition(":e:")
            fields: dict[str, Any] = {}
            for k, v in r.hgetall(name).items():
                try:
                    fields[k.decode()] = v.decode()
                except UnicodeDecodeError:
                    continue
            for f in ("n_tokens", "size", "chunks"):
                try:
                    fields[f] = int(fields.get(f, 0))
                except ValueError:
                    fields[f] = 0
            out.append({"namespace": ns, "key": key, **fields})
        return out
    except (redis.RedisError, OSError) as e:
        raise _fault(url, e) from None
    finally:
        r.close()


def prune(url: str, older_than_s: float = 0.0, namespace: str = "") -> tuple[int, int]:
    """Delete entries published more than `older_than_s` ago (0: all), of one namespace or all,
    and the parts no remaining entry names; (entries, parts or chunks) deleted."""
    import redis

    r = _client(url)
    now, gone, kept = time.time(), [], []
    try:
        for e in entries(url):
            try:
                published = float(e.get("published_s", 0))
            except ValueError:
                published = 0.0
            old = not older_than_s or now - published >= older_than_s
            (gone if old and (not namespace or e["namespace"] == namespace) else kept).append(e)
        held = {f"{e['namespace']}:p:{p}" for e in kept for p in e.get("parts", "").split(",")}
        n_parts = 0
        for e in gone:
            ns = e["namespace"]
            r.delete(f"{ns}:e:{e['key']}")  # the entry first: no half-pull after
            if "parts" in e:
                names = {f"{ns}:p:{p}" for p in e["parts"].split(",") if p} - held
            else:
                names = {f"{ns}:c:{e['key']}:{i}" for i in range(int(e["chunks"]))}
            held |= names  # deleted once
            n_parts += int(r.delete(*names)) if names else 0
        return len(gone), n_parts
    except (redis.RedisError, OSError) as e:
        raise _fault(url, e) from None
    finally:
        r.close()
