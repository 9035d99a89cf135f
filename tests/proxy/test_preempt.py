"""Preemption through the real server (policies/preempt.py), on every kind of memory: one slot, a
long prompt prefilling, and a title request that comes meanwhile. The title runs at once in the
long run's slot; the long run stops at a batch edge, its prefix gives way to the RAM tier, and
it runs again from there, answering as a cold run does; the log and the metric say so."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import Server, running
from tests.models import GPU_LAYERS, MODELS, draft_file, model_file
from tests.proxy.test_disk_cache import ask

pytestmark = pytest.mark.model

# about 1,900 tokens: seconds of prefill on two cores (but the random Qwen3.5's fraction of one)
LONG = [{"role": "system", "content": "You review build notes."},
        {"role": "user", "content": " ".join(
            f"Note {i}: step {i} of the build writes out_{i}.o from src_{i}.c and links it."
            for i in range(64)) + " Which note links out_7.o?"}]
TITLE = [{"role": "user", "content": "Write a five-word title for a chat about build notes."}]


def cold(srv: Server, messages: list[dict], max_tokens: int) -> str:
    ask(srv, [{"role": "user", "content": "flush"}], max_tokens=1)
    out = ask(srv, messages, max_tokens=max_tokens)
    assert out["cached"] <= 32, "at most the chat template's header stays live"
    return str(out["text"])


ON_CPU = pytest.mark.skipif(GPU_LAYERS > 0, reason="on a GPU the long prefill ends before a "
                            "request's round trip: there is nothing to preempt")


def title_during_long_prefill(srv: Server) -> tuple[dict[str, Any], dict, float]:
    """The long request in a thread; the title once a few batches of it are in. (The long
    answer and when it came, the title's answer, when it came.)"""
    done: dict[str, Any] = {}

    def long_call() -> None:
        done["long"] = ask(srv, LONG, max_tokens=12)
        done["long_s"] = time.monotonic()

    t = threading.Thread(target=long_call)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            s.get("prompt_progress", {}).get("processed", 0) >= 256
            for s in json.loads(srv.get("/slots")[1])):
        time.sleep(0.01)
    title = ask(srv, TITLE, max_tokens=8)
    title_s = time.monotonic()
    t.join()
    return done, title, title_s


@ON_CPU
@pytest.mark.parametrize("name", MODELS)
def test_a_title_takes_the_slot_of_a_long_prefill(name: str, tmp_path: Path) -> None:
    with running(tmp_path / "cold", "--model", model_file(name), "--disk-prefix-cache",
                 "off") as ref:
        want_long, want_title = cold(ref, LONG, 12), cold(ref, TITLE, 8)
    with running(tmp_path / "srv", "--model", model_file(name), "--cache-ram", "256") as srv:
        done, title, title_s = title_during_long_prefill(srv)
        log = srv.log()
        long = done["long"]
        assert title["text"] == want_title and long["text"] == want_long, log
        assert title_s < done["long_s"], "the title did not wait for the long answer"
        assert "preempt: a request of" in log and "preempted=1" in log, log
        assert "keeps it" not in log
        assert long["source"] == "ram" and long["cached"] >= 256, (long, log)
        assert "prefixgate_preemptions_total 1.0" in srv.get("/metrics")[1]


@ON_CPU
def test_a_prefill_whose_state_would_not_fit_the_ram_tier_keeps_its_slot(tmp_path: Path) -> None:
    """A 1 MiB RAM tier cannot hold the long prompt's prefix: the worker does not stop it
    (its progress would be lost), says so, and the title waits for its slot as before."""
    with running(tmp_path / "srv", "--cache-ram", "1") as srv:
        done, _, title_s = title_during_long_prefill(srv)
        log = srv.log()
        assert "keeps it: its state would not fit the RAM tier" in log, log
        assert "preempted=1" not in log and done["long_s"] < title_s
        assert "prefixgate_preemptions_total 0.0" in srv.get("/metrics")[1]


STORY = [{"role": "user", "content": "Tell a long story about a build server that never sleeps."}]


@pytest.mark.parametrize(("name", "draft"), [(m, False) for m in MODELS]
                         + [("smollm2", True), ("qwen35", True)])
def test_a_title_runs_nested_on_a_slot_whose_run_generates(name: str, draft: bool,
                                                            tmp_path: Path) -> None:
    """Rule 4 of policies.preempt: one slot, its run generating a long answer, and a title
    request that comes meanwhile. The run is parked (its state in host RAM), the title runs on
    its slot and answers first, then the run goes on: both answers are word for word their
    cold runs' (the run's every token after the park included), and the log says so; with a
    draft model too (the title drafts nothing, the run's draft sequence waits with it)."""
    # a few seconds of answer (the random qwen35 decodes a token in 5 ms on two cores)
    gen = 600 if name == "qwen35" else 160
    story = {"max_tokens": gen, "extra_body": {"ignore_eos": True}}
    md = ("-md", draft_file(name)) if draft else ()
    with running(tmp_path / "cold", "--model", model_file(name), "--disk-prefix-cache",
                 "off") as ref:
        want_story = ask(ref, STORY, **story)["text"]
        want_title = cold(ref, TITLE, 4)
    with running(tmp_path / "srv", "--model", model_file(name), "--cache-ram", "256",
                 *md) as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=300)
        ask(srv, TITLE, max_tokens=1)  # the worker measures its prefill and decode steps
        chunks: list[str] = []
        done: dict[str, float] = {}

        def story_call() -> None:
            for ch in c.chat.completions.create(model="m", messages=STORY, temperature=0,
                                                stream=True, **story):  # type: ignore[arg-type]
                chunks.append(ch.choices[0].delta.content or "" if ch.choices else "")
            done["story_s"] = time.monotonic()

        t = threading.Thread(target=story_call)
        t.start()
        deadline = time.monotonic() + 120
        while len(chunks) < 24 and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.005)
        title = ask(srv, TITLE, max_tokens=4)
        title_s = time.monotonic()
        t.join()
        log, metrics = srv.log(), srv.get("/metrics")[1]
    assert title["text"] == want_title and "".join(chunks) == want_story, log
    assert title_s < done["story_s"], f"the title waited for the story's end: {log}"
    assert "park: a request of" in log and "+nested" in log, log
    assert "prefixgate_parks_total 1.0" in metrics
