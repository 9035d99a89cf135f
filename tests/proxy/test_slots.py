"""Slots through the real server (issue 20): sessions served at once from one model copy
(`--parallel`), each answering exactly as a cold run, on every kind of memory; a background
request that never evicts a session's live KV while another slot can take it; the RAM tier
restoring a session that had to give way; a request cancelled in one slot while another
generates."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import Server, running
from tests.models import MEMORY, MODELS, model_file, reusable
from tests.proxy.test_models import ask, cold_answer, convo

pytestmark = pytest.mark.model

TITLE = [{"role": "user", "content": "Write a five-word title for a chat about build rules."}]


def at_once(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls concurrently, as an agent and its subagents send; their results in order."""
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def go(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("name", MODELS)
def test_concurrent_sessions_in_slots_answer_as_cold_runs(name: str, tmp_path: Path) -> None:
    a1 = convo("Which rule is about files?")
    b1 = convo("Which rule is about the build?", 2)
    a2 = [*a1, {"role": "assistant", "content": "Rule 3."},
          {"role": "user", "content": "And which one is about APIs?"}]
    b2 = [*b1, {"role": "assistant", "content": "Rule 5."},
          {"role": "user", "content": "Quote it."}]
    with running(tmp_path / "cold", "--model", model_file(name), "--disk-prefix-cache",
                 "off") as cold:
        want = {k: cold_answer(cold, m) for k, m in
                (("a1", a1), ("b1", b1), ("a2", a2), ("b2", b2))}
    with running(tmp_path / "slots", "--model", model_file(name), "--parallel", "2",
                 "--cache-ram", "256") as srv:
        first = at_once(lambda: ask(srv, a1), lambda: ask(srv, b1))
        second = at_once(lambda: ask(srv, a2), lambda: ask(srv, b2))
        log = srv.log()
        assert [r["text"] for r in (*first, *second)] == [want[k] for k in
                                                         ("a1", "b1", "a2", "b2")]
        for grown, before in zip(second, first, strict=True):
            if MEMORY[name] != "recurrent":  # each session kept its own slot
                assert grown["source"] == "live", log
                assert grown["cached"] >= reusable(before["prompt"]), (grown, log)
            else:  # a recurrent state after generating: the snapshots (the shared system
                # prompt at least; the prompt's end where `auto` saved it)
                assert grown["cached"] >= 512, (grown, log)
        assert "worker=0.0" in log and "worker=0.1" in log, "both slots served"
        assert "2 slot(s)" in log and "exact reuse proven" in log and "slot 1 restore" in log
        assert ("slot 1 verify" in log) == (MEMORY[name] != "recurrent"), log
        slots = json.loads(srv.get("/slots")[1])
        assert [s["slot"] for s in slots] == [0, 1]
        assert json.loads(srv.get("/props")[1])["total_slots"] == 2


@pytest.mark.parametrize("name", MODELS)
def test_a_subagent_starts_from_the_sessions_kv_cut_back(name: str, tmp_path: Path) -> None:
    """A subagent shares the system prompt with the session in the other slot. Where the memory
    can be cut back (plain attention), it starts from a copy of that slot's KV cut back to the
    end of what both share, with no disk cache (no slot gives way, so the RAM tier holds
    nothing), and leaves the session its slot; elsewhere it may take that slot. Either
    way both answer as cold runs, the session's next turn sent at the same time."""
    session = convo("Which rule is about files?", 3)
    grown = [*session, {"role": "assistant", "content": "Rule 3."},
             {"role": "user", "content": "And the build?"}]
    sub = convo("Which rule is about the build?")
    with running(tmp_path / "cold", "--model", model_file(name), "--disk-prefix-cache",
                 "off") as cold:
        want = [cold_answer(cold, m) for m in (grown, sub)]
    with running(tmp_path / "slots", "--model", model_file(name), "--parallel", "2",
                 "--cache-ram", "64", "--disk-prefix-cache", "off") as srv:
        ask(srv, session)
        after = at_once(lambda: ask(srv, grown), lambda: ask(srv, sub))
        log = srv.log()
        assert [r["text"] for r in after] == want, log
        if MEMORY[name] == "plain":  # whichever came first, the session's slot kept it
            assert after[0]["source"] == "live", log
            assert after[1]["source"] == "ram" and 0 < after[1]["cached"] < after[1]["prompt"], log


def test_a_background_request_takes_the_free_slot_not_the_session(tmp_path: Path) -> None:
    session = convo("Which rule is about files?", 3)
    grown = [*session, {"role": "assistant", "content": "Rule 3."},
             {"role": "user", "content": "And the build?"}]
    with running(tmp_path, "--parallel", "2") as srv:
        first = ask(srv, session)
        ask(srv, TITLE)
        ask(srv, [{"role": "user", "content": "Summarize: the build is green."}])
        second = ask(srv, grown)
        assert second["source"] == "live", srv.log()
        assert second["cached"] >= reusable(first["prompt"])
        served = [line.rsplit("worker=", 1)[1].split()[0] for line in srv.log().splitlines()
                  if " prompt=" in line and "worker=" in line]
        assert served == ["0.0", "0.1", "0.1", "0.0"], "the session's slot ran only the session"


def test_the_ram_tier_restores_a_session_that_gave_way(tmp_path: Path,
                                                        cold_server: Server) -> None:
    session = convo("Which rule is about files?", 3)
    grown = [*session, {"role": "assistant", "content": "Rule 3."},
             {"role": "user", "content": "And the build?"}]
    want = cold_answer(cold_server, grown)
    with running(tmp_path, "--parallel", "1", "--cache-ram", "64") as srv:
        first = ask(srv, session)
        ask(srv, TITLE)  # the one slot: the session's live KV gives way, to RAM
        second = ask(srv, grown)
        assert (second["source"], second["text"]) == ("ram", want), srv.log()
        assert second["cached"] >= reusable(first["prompt"])
        ram = json.loads(srv.get("/props")[1])["cache_ram"]
        # the slot's state went to the tier (the source and the metric below say it came back
        # from there). Taken whole it counts a hit; where the slot gave way past the session's
        # last edge (944 tokens, of which the next prompt reuses 939) the entry stays and a copy
        # cut back is restored: which one depends on where the slot stood when it gave way
        assert ram["mib"] == 64 and ram["workers"]["0"]["put"] >= 1
        metrics = srv.get("/metrics")[1]
        assert 'prefixgate_cache_ram_budget_bytes{worker="0"} 6.7108864e+07' in metrics
        ram_tokens = re.search(r'^prefixgate_cached_tokens_total\{source="ram"\} (\S+)$',
                               metrics, re.M)
        assert ram_tokens and float(ram_tokens.group(1)) >= reusable(first["prompt"])


def test_a_cancelled_slot_leaves_the_other_generating(tmp_path: Path,
                                                      cold_server: Server) -> None:
    long_one = convo("List every rule, one per line, with its number.")
    want = cold_answer(cold_server, long_one)
    with running(tmp_path, "--parallel", "2") as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=120)
        started = threading.Event()

        def cancelled() -> None:
            started.wait(60)
            stream = c.chat.completions.create(model="m", messages=convo("Name a rule.", 2),
                                               temperature=0, max_tokens=64, stream=True)
            for _ in stream:
                break  # the client goes away after its first chunk
            stream.close()

        def kept() -> str:
            out = ""
            for chunk in c.chat.completions.create(model="m", messages=long_one, temperature=0,
                                                   max_tokens=12, stream=True):
                started.set()
                if chunk.choices and chunk.choices[0].delta.content:
                    out += chunk.choices[0].delta.content
            return out

        text, _ = at_once(kept, cancelled)
        assert text == want
        after = ask(srv, TITLE)  # both slots take requests again
        assert after["text"]
        assert "cancelled" in srv.log() or "abandoned" in srv.log(), srv.log()
