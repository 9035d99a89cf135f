"""`prefixgate cache stats|ls|verify|clear --cache-dir DIR`: look into a cache without a server;
`prefixgate cache shared-ls|shared-prune --shared-tier URL [--older-than S]`: the shared tier.

Run it while no prefixgate writes the same cache directory (`clear` and `verify --fix` change it).
A damaged index is reported, not opened (exit status 1); `verify --fix` moves it aside and
rebuilds it from the state files, as a starting prefixgate does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from backend import store
from backend.index import Index
from backend.index_damage import find_damage

log = logging.getLogger("prefixgate.cache")


def out(line: str) -> None:
    """CLI output (a report for the user, not a log line)."""
    sys.stdout.write(line + "\n")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="prefixgate cache", description=__doc__)
    p.add_argument("action", choices=["stats", "ls", "verify", "clear", "shared-ls",
                                      "shared-prune"])
    p.add_argument("--shared-tier", default=os.environ.get("PREFIXGATE_SHARED_TIER", ""),
                   help="redis://... of the shared tier (shared-ls, shared-prune)")
    p.add_argument("--older-than", type=float, default=0.0, metavar="SECONDS",
                   help="shared-prune: only entries published longer ago (default: all)")
    p.add_argument("--cache-dir", default=os.environ.get("PREFIXGATE_CACHE_DIR",
                                                         "~/.cache/prefixgate"))
    p.add_argument("--fix", action="store_true", help="verify: drop entries that fail")
    args = p.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(message)s")
    if args.action.startswith("shared-"):
        return shared(args.action, args.shared_tier, args.older_than)
    cache_dir = Path(os.path.expanduser(args.cache_dir))
    if not (cache_dir / "index.lmdb").exists():
        raise SystemExit(f"no prefixgate cache in {cache_dir}")
    damage = find_damage(cache_dir)
    if damage is not None and not (args.action == "verify" and args.fix):
        out(f"DAMAGED index {cache_dir / 'index.lmdb'}: {damage}")
        out("The state files are not affected. prefixgate moves the damaged index aside and "
            "rebuilds it from them when it starts; `prefixgate cache verify --fix` does it now.")
        raise SystemExit(1)
    with Index(cache_dir) as index:
        if index.damaged is not None:
            out(f"index was damaged ({damage}): moved to {index.damaged.name}; rebuilt from the "
                f"state files: {index.reconcile()}")
        entries = sorted(index.entries(), key=lambda ke: ke[1].created_s)
        if args.action == "stats":
            by_reason: dict[str, int] = {}
            for _, e in entries:
                by_reason[e.reason] = by_reason.get(e.reason, 0) + 1
            hits = sum(e.hits for _, e in entries)
            out(f"cache dir  {cache_dir}")
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(by_reason.items())) or "none"
            out(f"entries    {len(entries)}  ({reasons})")
            out(f"bytes      {index.total_bytes()} ({_human(index.total_bytes())})")
            out(f"tokens     {sum(e.n_tokens for _, e in entries)} stored, largest "
                  f"{max((e.n_tokens for _, e in entries), default=0)}")
            out(f"hits       {hits}")
        elif args.action == "ls":
            out(f"{'key':32}  {'tokens':>7}  {'size':>10}  {'reason':14}  {'hits':>4}  "
                  f"{'age':>8}  tenant")
            now = time.time()
            for k, e in entries:
                out(f"{k.hex():32}  {e.n_tokens:7d}  {_human(e.size_bytes):>10}  "
                      f"{e.reason:14}  {e.hits:4d}  {now - e.created_s:7.0f}s  "
                      f"{'(key)' if e.tenant else '-'}")
        elif args.action == "verify":
            bad = 0
            for k, e in entries:
                try:
                    store.verify_file(cache_dir / e.file)
                    h = store.read_header(cache_dir / e.file)
                    if h.n_tokens != e.n_tokens:
                        raise store.CacheFault("tokens", f"header says {h.n_tokens} tokens, "
                                                         f"index {e.n_tokens}")
                except store.CacheFault as err:
                    bad += 1
                    out(f"BAD {k.hex()} {err.reason}: {err}")
                    if args.fix:
                        index.delete(k)
            out(f"{len(entries) - bad} ok, {bad} bad" + (" (dropped)" if bad and args.fix
                                                           else ""))
            if bad and not args.fix:
                raise SystemExit(1)
        else:
            n = index.clear()
            out(f"cleared {n} entries")


def shared(action: str, url: str, older_than_s: float) -> None:
    from backend.shared import SharedFault
    from backend.shared_admin import entries, prune

    if not url:
        raise SystemExit("give --shared-tier redis://HOST:PORT/DB (or PREFIXGATE_SHARED_TIER)")
    try:
        if action == "shared-ls":
            found = entries(url)
            out(f"{'model':16}  {'key':32}  {'tokens':>7}  {'size':>10}  {'age':>8}")
            now = time.time()
            for e in sorted(found, key=lambda e: float(e.get("published_s", 0))):
                age = now - float(e.get("published_s", now))
                out(f"{e['namespace'][3:19]:16}  {e['key']:32}  {int(e['n_tokens']):7d}  "
                    f"{_human(int(e['size'])):>10}  {age:7.0f}s")
            out(f"{len(found)} entries, {_human(sum(int(e['size']) for e in found))}")
        else:
            n, chunks = prune(url, older_than_s)
            out(f"pruned {n} entries ({chunks} chunks)")
    except SharedFault as e:
        raise SystemExit(f"prefixgate cache: {e}") from None
