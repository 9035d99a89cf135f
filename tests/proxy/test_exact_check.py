"""The self-check through the real server (issue 19): a worker whose restores are inexact (one
bit of every loaded state flipped, PREFIXGATE_FAULT=restore-bit, a fault no real part produces
on demand) is caught at start, before it answers anything: it serves without reuse and says so
in /health, /props, /metrics and its log; its answers equal a cold run's. A healthy server
says the opposite in the same places."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import http_get, running
from tests.proxy.test_disk_cache import ask, convo, entries, flush_live

pytestmark = pytest.mark.model


def test_an_inexact_worker_is_caught_at_start_and_reuses_nothing(tmp_path: Path) -> None:
    msgs = convo("Which rule is about files?")
    with running(tmp_path / "cold") as cold:  # the reference
        want = ask(cold, msgs)["text"]
        _, health = http_get(cold.url + "/health")
        assert json.loads(health)["workers"][0]["exact"] is True
        assert "exact reuse proven" in cold.log()
    with running(tmp_path / "bad", env={"PREFIXGATE_FAULT": "restore-bit"}) as srv:
        log = srv.log()
        assert re.search(r"exactness self-check FAILED \(restore@\d+: cache: layer 0 K differs",
                         log), log
        assert "REUSE OFF" in log, "the ready line says it"
        _, health = http_get(srv.url + "/health")
        assert json.loads(health)["workers"][0]["exact"] is False
        _, props = http_get(srv.url + "/props")
        exact = json.loads(props)["exact"][0]
        assert exact["ok"] is False and exact["failure"].startswith("restore@")
        _, metrics = http_get(srv.url + "/metrics")
        assert 'prefixgate_worker_exact{worker="0"} 0.0' in metrics
        first = ask(srv, msgs)
        again = ask(srv, msgs)
        flush_live(srv)
        third = ask(srv, msgs)
        assert [r["cached"] for r in (first, again, third)] == [0, 0, 0]
        assert first["text"] == again["text"] == third["text"] == want
        assert entries(srv.cache_dir) == [], "no snapshot is written either"


def test_a_passing_verdict_is_remembered_for_the_next_start(tmp_path: Path) -> None:
    """A restart with the same model, settings, build and code takes the verdict it proved
    before (backend.selfcheck: remembered verdicts) instead of checking again; another setting
    checks again; a hit still equals the cold run's answer; an injected fault is never
    answered from memory."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    verdicts = tmp_path / "xdg" / "prefixgate" / "selfcheck"
    msgs = convo("Which rule is about files?")
    with running(tmp_path / "first", env=env) as srv:
        assert "exact reuse proven" in srv.log() and "remembered from" not in srv.log()
        want = ask(srv, msgs)["text"]
    assert len(list(verdicts.glob("*.json"))) == 1
    with running(tmp_path / "again", cache_dir=tmp_path / "first" / "cache", env=env) as srv:
        assert re.search(r"exact reuse proven in [\d.]+ s \(live@\d+, restore@\d+.*\); "
                         r"remembered from ", srv.log()), srv.log()
        hit = ask(srv, msgs)
        assert hit["cached"] > 0 and hit["text"] == want
    with running(tmp_path / "other", "--parallel", "2", env=env) as srv:
        assert "exact reuse proven" in srv.log() and "remembered from" not in srv.log()
        assert "slot 1 restore" in srv.log()
    assert len(list(verdicts.glob("*.json"))) == 2
    with running(tmp_path / "bad", env={**env, "PREFIXGATE_FAULT": "restore-bit"}) as srv:
        assert "exactness self-check FAILED" in srv.log()
    assert len(list(verdicts.glob("*.json"))) == 2, "a failing verdict is never remembered"
