"""The self-check's remembered verdicts (backend.verdicts: `verdict_key`, `recall`,
`remember`): a passing verdict comes back as it was kept; anything else in its place (a
truncated file, a failing verdict, fields of another shape) is ignored, so the worker checks
again; a directory that cannot be written costs a check per start, never the start; only the
most recent are kept; the key changes with any setting."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from backend import verdicts

PASS = {"ok": True, "probe_tokens": 449, "seconds": 33.1, "failure": "",
        "checks": [{"check": "live@196", "ok": True, "detail": ""},
                   {"check": "restore@34", "ok": True, "detail": ""}],
        "decode": {"batched": "", "fixed": None, "fixed_cost": 0.0, "apart_cost": 2.5}}


def test_a_kept_verdict_comes_back(tmp_path: Path) -> None:
    assert verdicts.recall("k", tmp_path) is None
    verdicts.remember("k", PASS, tmp_path)
    got = verdicts.recall("k", tmp_path)
    assert got is not None and got["checked_at"] > 0
    assert {k: v for k, v in got.items() if k not in ("checked_at", "mac")} == PASS
    assert sorted(p.name for p in tmp_path.iterdir()) == [".key", "k.json"], \
        "no temporary file left"


@pytest.mark.parametrize("edit", [
    # a hand edit of any field (a cheaper decode shape made to look proven among them)
    lambda v: {**v, "probe_tokens": 1},
    lambda v: {**v, "decode": {**v["decode"], "batched": ""}},
    lambda v: {**v, "checked_at": v["checked_at"] + 1},
    lambda v: {k: x for k, x in v.items() if k != "mac"},
])
def test_a_verdict_edited_by_hand_costs_a_check(tmp_path: Path, edit: Any,
                                               caplog: pytest.LogCaptureFixture) -> None:
    # issue 46: a hand-edited verdict file was taken; now it does not verify and the worker
    # checks again (the same holds for one copied from another machine: another key)
    verdicts.remember("k", {**PASS, "decode": {**PASS["decode"], "batched": "differs"}},
                       tmp_path)
    path = tmp_path / "k.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with caplog.at_level(logging.WARNING):
        assert verdicts.recall("k", tmp_path) is None
    assert "does not verify" in caplog.text


def test_a_verdict_from_another_machine_costs_a_check(tmp_path: Path) -> None:
    verdicts.remember("k", PASS, tmp_path / "a")
    (tmp_path / "b").mkdir()
    verdicts.remember("other", PASS, tmp_path / "b")  # b has a key of its own
    (tmp_path / "b" / "k.json").write_text((tmp_path / "a" / "k.json").read_text())
    assert verdicts.recall("k", tmp_path / "a") is not None
    assert verdicts.recall("k", tmp_path / "b") is None


@pytest.mark.parametrize("text", [
    json.dumps(PASS)[:40],  # cut short
    json.dumps({**PASS, "ok": False, "checked_at": 1.0}),  # a failure is never kept
    json.dumps({**PASS, "checks": "live@196", "checked_at": 1.0}),
    json.dumps({**PASS, "checked_at": "yesterday"}),
    json.dumps({**PASS, "decode": {**PASS["decode"], "fixed_cost": "cheap"},  # type: ignore[dict-item]
                "checked_at": 1.0}),
    json.dumps([PASS]),
])
def test_anything_else_is_ignored_and_said_once(tmp_path: Path, text: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    verdicts.remember("other", PASS, tmp_path)  # the key exists: a file of its MAC is wanted
    (tmp_path / "k.json").write_text(text)
    with caplog.at_level(logging.WARNING):
        assert verdicts.recall("k", tmp_path) is None
    assert len(caplog.records) == 1 and "ignoring the remembered" in caplog.text


def test_an_unwritable_directory_costs_a_check_not_the_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory should be
    with caplog.at_level(logging.WARNING):
        verdicts.remember("k", PASS, blocked / "selfcheck")
    assert "every start checks" in caplog.text
    assert verdicts.recall("k", blocked / "selfcheck") is None


def test_only_the_most_recent_are_kept(tmp_path: Path) -> None:
    for i in range(verdicts.VERDICTS_KEPT + 3):
        verdicts.remember(f"k{i}", PASS, tmp_path)
        os.utime(tmp_path / f"k{i}.json", (i, i))  # in the order written
    kept = {p.stem for p in tmp_path.glob("*.json")}
    assert len(kept) == verdicts.VERDICTS_KEPT
    assert {"k0", "k1", "k2"}.isdisjoint(kept) and f"k{verdicts.VERDICTS_KEPT + 2}" in kept


def test_the_key_names_the_fingerprint_and_every_setting() -> None:
    base = {"n_ctx": 4096, "slots": 3, "threads": 2, "flash_attn": "off", "placement": {}}
    key = verdicts.verdict_key(b"\x01" * 16, base)
    assert key == verdicts.verdict_key(b"\x01" * 16, dict(reversed(base.items())))
    others = [verdicts.verdict_key(b"\x02" * 16, base)] + [
        verdicts.verdict_key(b"\x01" * 16, {**base, name: value}) for name, value in
        [("n_ctx", 8192), ("slots", 1), ("threads", 4), ("flash_attn", "on"),
         ("placement", {"n_cpu_moe": 4})]]
    assert len({key, *others}) == len(others) + 1


def test_the_key_names_the_kernels_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    key = verdicts.verdict_key(b"\x01" * 16, {})
    monkeypatch.setenv("GGML_CUDA_FORCE_CUBLAS", "1")
    assert verdicts.verdict_key(b"\x01" * 16, {}) != key
    monkeypatch.delenv("GGML_CUDA_FORCE_CUBLAS")
    monkeypatch.setenv("PREFIXGATE_LOG_LEVEL", "debug")  # not read by a kernel
    assert verdicts.verdict_key(b"\x01" * 16, {}) == key
