"""The exactness suite on each kind of memory (issue 11), through the real server and the official
SDKs: the greedy output of a live hit, a disk hit, a hit after a restart and a hit with a
corrupted state file equals a cold run's, on plain attention (SmolLM2), a real sliding window
(Gemma 3 270M) and a hybrid recurrent state (a random-weight Qwen3.5). On the window and the
hybrid model a prompt that diverges far inside the live sequence restores the right snapshot."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import anthropic
import pytest

from tests.conftest import Server, running, start_server
from tests.models import MEMORY, MODELS, model_file, reusable
from tests.proxy.test_disk_cache import ask as ask_openai
from tests.proxy.test_disk_cache import entries

pytestmark = pytest.mark.model

# ~700 tokens of stable preamble (past Gemma 3's 512-token window)
SYSTEM = " ".join(f"Rule {i}: answer briefly, cite the file you read, never invent an API, and "
                  f"keep the build green." for i in range(1, 36))


def convo(question: str, turns: int = 1) -> list[dict]:
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
    for i in range(turns - 1):
        msgs += [{"role": "user", "content": f"Check file number {i} for rule {i + 2}."},
                 {"role": "assistant", "content": f"File {i} follows rule {i + 2}."}]
    return [*msgs, {"role": "user", "content": question}]


ask = partial(ask_openai, max_tokens=12)


def ask_anthropic(srv: Server, messages: list[dict]) -> str:
    c = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0, timeout=300)
    system, rest = messages[0]["content"], messages[1:]
    r = c.messages.create(model="m", system=system, messages=rest, max_tokens=12,
                          extra_body={"temperature": 0})  # the 2.x SDK has no temperature
    return "".join(b.text for b in r.content if b.type == "text")


@pytest.fixture(scope="module", params=MODELS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def cold(name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The reference: this model with no disk cache, every request from an emptied live KV."""
    with running(tmp_path_factory.mktemp(f"cold-{name}"), "--model", model_file(name),
                 "--workers", "1", "--disk-prefix-cache", "off") as srv:
        yield srv


def cold_answer(cold: Server, messages: list[dict]) -> str:
    ask(cold, [{"role": "user", "content": "flush"}])  # nothing of `messages` stays live
    out = ask(cold, messages)
    assert out["cached"] < 16
    return str(out["text"])


def test_every_hit_equals_a_cold_run(name: str, cold: Server, tmp_path: Path) -> None:
    first = convo("Which rule is about files?")
    second = [*first, {"role": "assistant", "content": "Rule 3."},
              {"role": "user", "content": "And which one is about the build?"}]
    want_first, want_second = cold_answer(cold, first), cold_answer(cold, second)
    cache = tmp_path / "cache"
    srv = start_server(tmp_path / "a", "--model", model_file(name), "--workers", "1",
                       cache_dir=cache)
    try:
        miss = ask(srv, first)
        assert (miss["source"], miss["text"]) == ("none", want_first)
        live = ask(srv, first)  # the same prompt: the live KV (or, hybrid: its snapshot)
        assert live["cached"] >= reusable(miss["prompt"]) and live["text"] == want_first
        assert live["source"] == ("disk" if MEMORY[name] == "recurrent" else "live")
        grown = ask(srv, second)  # the conversation grows: two turns appended
        assert grown["text"] == want_second and grown["cached"] >= reusable(miss["prompt"])
    finally:
        srv.stop()
    with running(tmp_path / "b", "--model", model_file(name), "--workers", "1",
                 cache_dir=cache) as srv:  # a restart: only the disk
        disk = ask(srv, second)
        assert disk["source"] == "disk" and disk["text"] == want_second
        assert disk["cached"] >= reusable(disk["prompt"])
        assert ask_anthropic(srv, second) == want_second
        # every state file corrupted: each is a clean miss, counted, and the answer unchanged
        for e in entries(cache):
            path = cache / e.file
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        ask(srv, [{"role": "user", "content": "Unrelated: name a prime number."}])
        broken = ask(srv, second)
        assert broken["source"] != "disk" and broken["text"] == want_second
        assert "prefixgate_cache_faults_total" in srv.get("/metrics")[1]


def test_a_prompt_diverging_far_inside_the_live_sequence(name: str, cold: Server,
                                                         tmp_path: Path) -> None:
    """The second prompt keeps the system prompt and changes everything after it: on the window
    and hybrid models the live state cannot be cut back there, so the snapshot at the shared
    prefix (the scope boundary `auto` finds) is restored; the answer equals a cold run's."""
    long_first = convo("Explain rule 3 and rule 9 together, then list every file you read.", 4)
    other = [long_first[0], {"role": "user", "content": "Name the rule about the build."}]
    want = cold_answer(cold, other)
    with running(tmp_path, "--model", model_file(name), "--workers", "1",
                 "--kv-cache-min-tokens", "64") as srv:
        ask(srv, long_first)
        ask(srv, [long_first[0], {"role": "user", "content": "Which rule is about files?"}])
        out = ask(srv, other)  # shares the system prompt with both before it
        assert out["text"] == want
        assert out["cached"] >= 600, out
        assert out["source"] == ("disk" if MEMORY[name] == "recurrent" else "live"), out
