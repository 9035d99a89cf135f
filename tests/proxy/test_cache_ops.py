"""Operating the cache: eviction under the byte budget, the miss trace, `prefixgate cache`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from backend.index import Index
from tests.conftest import ROOT, running
from tests.proxy.test_disk_cache import ask, convo, entries

pytestmark = pytest.mark.model  # real worker processes (see tests/conftest.py)


def cache_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "cache", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_eviction_keeps_the_budget_and_the_debug_trace_shows_the_mismatch(tmp_path: Path
                                                                          ) -> None:
    budget = 16 << 20  # about two snapshots of these ~330-token prompts (22 KB per token)
    with running(tmp_path, "--workers", "1", "--cache-max-bytes", str(budget),
                 "--kv-cache-min-tokens", "32", "--debug-trace") as srv:
        for i, q in enumerate(("First: rule 1?", "Second: rule 2?", "Third: rule 3?")):
            # a different project each time: a new cold anchor, then its scoped boundary
            msgs = convo(q, history=1)
            msgs[0] = {"role": "system", "content": f"Project {i}. {msgs[0]['content']}"}
            ask(srv, msgs)
            ask(srv, msgs)
        metrics = srv.get("/metrics")[1]
        log = srv.log()
    with Index(srv.cache_dir) as index:
        total = index.total_bytes()
    evicted = [ln for ln in metrics.splitlines()
               if ln.startswith("prefixgate_cache_evictions_total ")]
    assert evicted and float(evicted[0].split()[1]) > 0, metrics
    assert 0 < total <= budget
    # a new project is a miss; the trace shows where it parted from the closest earlier prompt
    assert "trace: miss; first mismatch at token" in log


def test_cache_cli_stats_ls_verify_clear(tmp_path: Path) -> None:
    with running(tmp_path, "--workers", "1") as srv:
        ask(srv, convo("What is rule 8?"))
        ask(srv, convo("What is rule 8?"))
    found = entries(srv.cache_dir, until=lambda f: len(f) >= 2)
    d = str(srv.cache_dir)
    stats = cache_cli("stats", "--cache-dir", d)
    assert stats.returncode == 0 and f"entries    {len(found)}" in stats.stdout
    ls = cache_cli("ls", "--cache-dir", d)
    assert ls.returncode == 0 and len(ls.stdout.strip().splitlines()) == len(found) + 1
    assert cache_cli("verify", "--cache-dir", d).stdout.strip() == f"{len(found)} ok, 0 bad"
    victim = srv.cache_dir / found[0].file
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = cache_cli("verify", "--cache-dir", d)
    assert bad.returncode == 1 and "1 bad" in bad.stdout
    assert "1 bad (dropped)" in cache_cli("verify", "--fix", "--cache-dir", d).stdout
    assert cache_cli("clear", "--cache-dir", d).stdout.strip() == \
        f"cleared {len(found) - 1} entries"
    assert not list((srv.cache_dir / "kv").rglob("*.kv"))
