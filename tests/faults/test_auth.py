"""Auth never fails open, and a shared box shows a tenant nothing of another's (issue 46,
section 2).

A key option that yields no key (`--api-key ''` from an unset shell variable, only commas, an
--api-keys file of comments, an empty LLAMA_API_KEY) stops `prefixgate serve` before anything
loads, in one line naming the option; the ready line says whether auth is on and with how many
keys. With --tenant-isolation, /slots gives a caller the details of its own tenant's slots only
and /health (no key) shows no slot's tokens; the per-tenant salts are bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.conftest import ROOT, running
from tests.proxy.test_disk_cache import convo

KEY_OPTIONS = [
    # (flags, environment, what the line must name)
    (["--api-key", ""], {}, "--api-key"),  # `--api-key "$KEY"` with KEY unset
    (["--api-key", ","], {}, "--api-key"),
    (["--api-key", " , ,"], {}, "--api-key"),
    ([], {"LLAMA_API_KEY": ","}, "LLAMA_API_KEY"),  # an empty variable is not set (compose)
    ([], {"PREFIXGATE_API_KEY": " "}, "PREFIXGATE_API_KEY"),
    (["--api-keys", ""], {}, "--api-keys"),
    (["--api-keys", "{comments}"], {}, "--api-keys file"),
    (["--api-key-file", "{blank}"], {}, "--api-keys file"),
]


@pytest.mark.parametrize(("flags", "env", "named"), KEY_OPTIONS)
def test_a_key_option_that_yields_no_key_stops_the_start(tmp_path: Path, flags: list[str],
                                                         env: dict[str, str],
                                                         named: str) -> None:
    (tmp_path / "comments").write_text("# the team's keys\n\n   # none yet\n")
    (tmp_path / "blank").write_text("\n   \n\t\n")
    flags = [f.format(comments=tmp_path / "comments", blank=tmp_path / "blank") for f in flags]
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LLAMA_API_KEY", "PREFIXGATE_API_KEY", "PREFIXGATE_API_KEYS",
                          "LLAMA_ARG_API_KEY_FILE")}
    out = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--port", "0",
                          "--cache-dir", str(tmp_path / "cache"), *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={**clean, "PYTHONPATH": str(ROOT), **env})
    assert out.returncode != 0, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefixgate: "), out.stderr[-2000:]
    assert named in lines[0] and ("no API key" in lines[0] or "names no file" in lines[0]), lines
    assert "Traceback" not in out.stderr


def chat(url: str, key: str) -> None:
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    c.chat.completions.create(model="m", messages=convo("Which rule is about files?"),
                              temperature=0, max_tokens=4)


def get(url: str, path: str, key: str = "") -> tuple[int, object]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.model
def test_slots_and_health_show_a_tenant_only_its_own(tmp_path: Path) -> None:
    with running(tmp_path, "--workers", "2", "--tenant-isolation",
                 "--api-key", "alice-key,bob-key") as srv:
        ready = next(line for line in srv.log().splitlines() if "prefixgate ready on" in line)
        assert "auth on (2 API keys)" in ready, ready
        chat(srv.url, "alice-key")
        status, mine = get(srv.url, "/slots", "alice-key")
        assert status == 200 and isinstance(mine, list) and [s["id"] for s in mine] == [0, 1]
        held = [s for s in mine if s.get("live_tokens")]
        assert len(held) == 1 and held[0]["tenant"], mine  # alice's own slot, in full
        status, theirs = get(srv.url, "/slots", "bob-key")
        assert status == 200 and isinstance(theirs, list) and len(theirs) == 2
        other = theirs[held[0]["id"]]
        assert "live_tokens" not in other and "tenant" not in other, other  # alice's: no detail
        assert {"id", "is_processing", "ready", "n_ctx"} <= set(other)
        assert get(srv.url, "/slots")[0] == 401
        status, health = get(srv.url, "/health")  # no key: nothing tenant-specific
        assert status == 200 and "live_tokens" not in json.dumps(health), health
        assert all("slots" not in w for w in health["workers"])  # type: ignore[index]


@pytest.mark.model
def test_the_ready_line_says_auth_is_off(tmp_path: Path) -> None:
    with running(tmp_path, "--workers", "1", "--disk-prefix-cache", "off") as srv:
        ready = next(line for line in srv.log().splitlines() if "prefixgate ready on" in line)
        assert "auth OFF" in ready, ready
        status, health = get(srv.url, "/health")  # no isolation: slots as before
        assert status == 200 and "live_tokens" in json.dumps(health)


def test_per_tenant_salts_are_bounded(tmp_path: Path) -> None:
    """A client sending a fresh random key with every request grows no per-tenant memo."""
    from backend.index import Index
    from backend.keys import CacheIdentity
    from policies.plan import CacheKnobs
    from proxy.cache import SALTS_KEPT, DiskCache
    from proxy.metrics import Metrics

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF fake weights")
    cache = DiskCache(Index(tmp_path / "cache"), CacheIdentity(str(model), 4096, "f16", "f16",
                                                               "off", "test"),
                      CacheKnobs(), 1 << 30, Metrics())
    try:
        first = cache.salt("tenant-0")
        for i in range(SALTS_KEPT * 3):
            cache.salt(f"random-key-{i}")
        assert len(cache._salts) <= SALTS_KEPT
        assert cache.salt("tenant-0") == first  # forgotten, made again the same
    finally:
        cache.close()
        cache.index.close()
