"""Speculative decoding through a real server (issue 47), llama-server's command line: the
drafts a request verified are in its `timings` (draft_n, draft_n_accepted) and its log line,
per source in the metrics and /props; a repeated request, a cache hit, answers as the first;
with the stop rule on, the worker says at start what a verify costs here."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import running

pytestmark = pytest.mark.model

FILE = "\n".join(f"def step_{i}(state, value):\n    total = state.count + value * {i}\n"
                 f"    return total if total > {i * 3} else state.count" for i in range(14))
PROMPT = f"File app.py:\n{FILE}\n\nThe same file, copied exactly:\n{FILE[:60]}"


def complete(url: str, prompt: str) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": 24, "temperature": 0, "cache_prompt": True}
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


def test_drafts_are_verified_counted_and_a_hit_answers_as_the_first(tmp_path: Path) -> None:
    with running(tmp_path, "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                 "--spec-ngram-simple-size-m", "8", "--spec-stop", "off") as srv:
        first = complete(srv.url, PROMPT)
        again = complete(srv.url, PROMPT)
        props = srv.get_json("/props")
        _, metrics = srv.get("/metrics")
        log = srv.log()
    t = first["timings"]
    assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"], t
    assert first["generation_settings"]["speculative.types"] == "ngram-simple"
    assert again["timings"]["cache_n"] > 0, "the second is a cache hit"
    assert again["content"] == first["content"], "the hit answers as the first"
    assert (again["timings"]["draft_n"], again["timings"]["draft_n_accepted"]) == \
        (t["draft_n"], t["draft_n_accepted"]), "the hit drafts as the first"
    worker = props["speculation"]["workers"]["0"]
    assert props["speculation"]["type"] == "ngram-simple" and worker["drafts"]
    assert worker["sources"]["ngram-simple"]["drafted"] == 2 * t["draft_n"]
    assert props["default_generation_settings"]["params"]["speculative.types"] == \
        "ngram-simple"
    drafted = re.search(r'^prefixgate_draft_tokens_total\{source="ngram-simple"\} (\S+)$',
                        metrics, re.M)
    assert drafted and float(drafted.group(1)) == 2 * t["draft_n"]
    lines = [ln for ln in log.splitlines() if " drafted=" in ln]
    assert len(lines) == 2 and f"drafted={t['draft_n']} accepted={t['draft_n_accepted']}" \
        in lines[0], lines
    assert "every draft verified" in log, "the ready line says how it speculates"


def test_the_stop_rule_measures_a_verify_at_start(tmp_path: Path) -> None:
    """`--spec-stop auto` (the default): the worker measures what a verify of each size costs
    over one step, says it in one line and in /props, and drafts only where that can pay."""
    with running(tmp_path, "--spec-type", "ngram-mod") as srv:
        worker = srv.get_json("/props")["speculation"]["workers"]["0"]
        log = srv.log()
    cost = worker["cost_at_start"]
    assert cost["rows"][0] == 1 and cost["ratios"][0] == 1.0 and len(cost["rows"]) >= 5
    assert worker["stop"] == "auto" and "a verify of 8 drafts costs" in worker["note"]
    assert worker["note"] in log


def test_a_draft_model_drafts_and_a_hit_answers_as_the_first(tmp_path: Path) -> None:
    """`-md` (the default model drafting for itself, the same vocabulary): -md alone means
    draft-simple; its greedy drafts are verified and accepted, and the cache hit makes the same
    drafts and answers as the first."""
    from proxy.config import default_model

    with running(tmp_path, "-md", default_model(), "--spec-draft-n-max", "4",
                 "--spec-stop", "off") as srv:
        first = complete(srv.url, PROMPT)
        again = complete(srv.url, PROMPT)
        worker = srv.get_json("/props")["speculation"]["workers"]["0"]
        log = srv.log()
    t = first["timings"]
    assert first["generation_settings"]["speculative.types"] == "draft-simple"
    assert t["draft_n"] > 0 and t["draft_n_accepted"] > t["draft_n"] // 2, t
    assert again["timings"]["cache_n"] > 0, "the second is a cache hit"
    assert (again["content"], again["timings"]["draft_n"], again["timings"]["draft_n_accepted"]) \
        == (first["content"], t["draft_n"], t["draft_n_accepted"]), "the hit answers as the first"
    assert worker["sources"]["draft-simple"]["drafted"] == 2 * t["draft_n"]
    assert "with the draft model" in worker["note"] and worker["note"] in log
