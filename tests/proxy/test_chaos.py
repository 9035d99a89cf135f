"""Crash loops (issue 14), short: kill -9 the worker or the proxy at each phase of a save; every
answer equals a cold run's and `prefixgate cache verify` is clean after every restart. The long
run, 100 kills, is `make chaos` (bench/chaos.py, which this drives)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import chaos

pytestmark = pytest.mark.model  # real proxies and worker processes (see tests/conftest.py)


def test_kills_at_every_phase_of_a_save_change_no_answer(tmp_path: Path) -> None:
    # ~350-token prompts (state files of ~8 MiB), two conversations of two turns; six kills:
    # the plan alternates worker and proxy and covers every phase once
    opts = chaos.Options(kills=6, seed=3, words=180, convs=2, turns=2, max_tokens=4,
                         cache_max_mb=40, checks=1)
    lines: list[str] = []
    tally = chaos.run(opts, tmp_path, lines.append)
    summary = "\n".join([*lines, chaos.report(tally, opts)])
    assert {(t, p) for t, p, _ in tally.kills} == set(chaos.plan(6, 3)), summary
    assert tally.differing == [], summary
    assert tally.verify_failures == [], summary
    assert tally.failures == [], summary
    # every kill is followed by at least one checked answer
    assert sum(tally.answers.values()) >= opts.kills + len(chaos.prompts(opts)), summary
    assert tally.verifies == 6 + 3  # once per worker kill, twice per proxy kill
