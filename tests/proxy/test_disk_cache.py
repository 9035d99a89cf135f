"""The persistent prefix cache end to end: real workers, real LMDB, real state files, the
official `openai` SDK as the client."""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import openai
import pytest

from backend import store
from backend.engine import Engine
from backend.index import Index
from backend.worker.tiers import WRITE_REST_S
from tests.conftest import N_CTX, Server, running
from tests.models import BATCH, reusable

pytestmark = pytest.mark.model  # real worker processes (see tests/conftest.py)

# ~300 tokens of stable preamble, like an agent's system prompt.
SYSTEM = " ".join(
    f"Rule {i}: keep answers short, cite the file you read, and never invent an API." for i in
    range(1, 16))


def ask(srv: Server, messages: list[dict], key: str = "k", **extra: object) -> dict:
    c = openai.OpenAI(base_url=srv.v1, api_key=key, max_retries=0, timeout=120)
    extra.setdefault("max_tokens", 10)
    raw = c.chat.completions.with_raw_response.create(
        model="m", messages=messages, temperature=0, **extra)
    r = raw.parse()
    return {"text": r.choices[0].message.content, "prompt": r.usage.prompt_tokens,
            "cached": r.usage.prompt_tokens_details.cached_tokens,
            "source": raw.headers["x-prefixgate-cache-source"]}


def convo(question: str, history: int = 0) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Summarize the rules in one line."}]
    for i in range(history):
        msgs += [{"role": "assistant", "content": f"Noted, step {i} done: short answers."},
                 {"role": "user", "content": f"Now check file number {i} for the API rule."}]
    msgs.append({"role": "assistant", "content": "Understood."}) if history == 0 else None
    return [*msgs, {"role": "user", "content": question}]


def entries(cache_dir: Path, until: Callable[[list], bool] = lambda found: True) -> list:
    """The index's entries; waits for `until`, since saves commit in the background once each
    file is durable, possibly after the response: on a CPU a file waits up to WRITE_REST_S for
    the compute thread to rest before it is written (CI saw a commit come past 10 s)."""
    deadline = time.time() + WRITE_REST_S + 10
    while True:
        with Index(cache_dir) as index:
            found = [e for _, e in index.entries()]
        if until(found) or time.time() > deadline:
            return found
        time.sleep(0.05)


def flush_live(srv: Server) -> None:
    """An unrelated request replaces the single worker's live KV: only the disk can help."""
    ask(srv, [{"role": "user", "content": "Unrelated: name a prime number."}])


def ttft_by_source(srv: Server) -> dict[str, int]:
    """Requests in /metrics' time to first token, by cache source."""
    found = re.findall(r'^prefixgate_time_to_first_token_seconds_count\{api="\w+",source="(\w+)"\}'
                       r' (\S+)$', srv.get("/metrics")[1], re.M)
    return {source: int(float(n)) for source, n in found}


def test_miss_save_hit_restart_disk_hit_same_output(tmp_path: Path) -> None:
    msgs = convo("Which rule is about files?")
    with running(tmp_path, "--workers", "1") as srv:
        miss = ask(srv, msgs)
        assert (miss["cached"], miss["source"]) == (0, "none")
        # a cold prefill snapshots the anchor, and the turn's end, which the next turn extends
        assert {e.reason for e in entries(srv.cache_dir, until=lambda f: len(f) >= 2)} == \
            {"cold", "growing"}
        hit = ask(srv, msgs)
        assert hit["source"] == "live" and hit["cached"] >= reusable(miss["prompt"])
        assert ttft_by_source(srv) == {"cold": 1, "live": 1}  # source "none" is counted cold
    with running(tmp_path, "--workers", "1", cache_dir=srv.cache_dir) as srv2:
        disk = ask(srv2, msgs)
        assert disk["source"] == "disk", srv2.log()
        assert disk["cached"] >= reusable(miss["prompt"]), "the entry covers the whole prompt"
        flush_live(srv2)
        again = ask(srv2, msgs)
        assert again["source"] == "disk"
        assert ttft_by_source(srv2)["disk"] == 2
        assert "lookup=hit" in srv2.log()
    assert miss["text"] == hit["text"] == disk["text"] == again["text"]


def test_every_entry_holds_exactly_its_token_count(tmp_path: Path, model_path: str) -> None:
    with running(tmp_path, "--workers", "1", "--kv-cache-min-tokens", "16") as srv:
        for q in ("What is rule 3?", "What is rule 7?", "What is rule 9?"):
            ask(srv, convo(q, history=2))
    found = entries(srv.cache_dir, until=lambda f: len(f) >= 2)
    assert {"cold", "scoped"} <= {e.reason for e in found}
    eng = Engine(model_path, N_CTX, 2, 0)
    mem = llama_cpp.llama_get_memory(eng.ctx)
    for e in found:
        header = store.read_header(srv.cache_dir / e.file)
        assert header.n_tokens == e.n_tokens
        with open(srv.cache_dir / e.file, "rb") as f:
            f.seek(header.state_offset)
            state = f.read(header.state_len)
        llama_cpp.llama_memory_clear(mem, True)
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        assert llama_cpp.llama_state_seq_set_data(eng.ctx, buf, len(state), 0) > 0
        # positions 0..n-1 are in the KV, none beyond
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == e.n_tokens - 1


def test_auto_hits_the_stable_boundary_where_full_misses(tmp_path: Path) -> None:
    """A conversation whose last user turn changes every request: `full` stores whole prompts
    that never recur (and the cold anchor, far back); `auto` stores what consecutive prompts
    shared, the prefix up to the changing turn, and hits it."""
    results = {}
    for policy in ("full", "auto:30"):
        with running(tmp_path / policy, "--workers", "1", "--disk-prefix-cache", policy,
                     "--kv-cache-min-tokens", "32") as srv:
            seen = []

            def saves() -> float:
                metrics = srv.get("/metrics")[1]
                return sum(float(n) for n in re.findall(
                    r'_cache_saves_total\{outcome="ok",reason="[\w-]+"\} (\S+)', metrics))

            def settled() -> list:
                """The index once every save so far has committed (in the background, maybe
                after the response): a request sent before then may write a position again
                that a save in flight was writing, which is not what this test is about."""
                return entries(srv.cache_dir, until=lambda f: len(f) == saves())

            # tails longer than a batch, so `full`'s end snapshot (at its last batch edge) lies
            # inside the tail that changes
            for q in (f"Tail {k}: what is rule {r}? " + "Cite the file and the line. " * 12
                      for k, r in (("one", 2), ("two", 4), ("three", 6))):
                flush_live(srv)
                settled()
                seen.append(ask(srv, convo(q, history=2)))
                settled()
            results[policy] = seen
        # one snapshot per saved position: `full` saves at the prompt's very end, which is also
        # where the prefill ends, and that position is written once. Counted once the server
        # stopped, which waits for its pending commits (in the suite one came past 20 s, after
        # the metrics had counted it or before): the saves each request's line planned, all
        # committed, each its own entry
        planned = [p for line in re.findall(r" saves=(\S+)", srv.log()) if line != "-"
                   for p in line.split(",")]
        found = entries(tmp_path / policy / "cache")
        assert "cache save failed" not in srv.log()
        assert len(found) >= 3 and len(planned) == len(found), (planned, found)
    full, auto = results["full"], results["auto:30"]
    stable = auto[2]["cached"]
    assert auto[2]["source"] == "disk"
    # everything but the changing last user turn (its header, text and the generation prompt)
    assert stable >= auto[2]["prompt"] - 120 - BATCH
    assert full[2]["cached"] < stable, "full only has the cold anchor to offer"
    assert full[2]["text"] == auto[2]["text"]


def test_tenant_isolation(tmp_path: Path) -> None:
    msgs = convo("Which rule mentions the API?")
    with running(tmp_path, "--workers", "1", "--tenant-isolation") as srv:
        a1 = ask(srv, msgs, key="alice")
        b1 = ask(srv, msgs, key="bob")
        assert b1["cached"] == 0, "bob shares neither alice's live KV nor her entries"
        flush_live(srv)
        a2 = ask(srv, msgs, key="alice")
        assert a2["source"] == "disk"
        tenants = {e.tenant for e in entries(srv.cache_dir,
                                             until=lambda f: len({e.tenant for e in f}) >= 2)}
    assert len(tenants) >= 2
    assert a1["text"] == b1["text"] == a2["text"]


@pytest.mark.parametrize("fault", ["corrupt", "missing", "truncated"])
def test_a_broken_state_file_is_a_clean_miss(tmp_path: Path, fault: str) -> None:
    msgs = convo("Which rule is about inventing?")
    with running(tmp_path, "--workers", "1") as srv:
        first = ask(srv, msgs)
        ask(srv, msgs)  # stores the scoped entry for the whole prompt
        broken = entries(srv.cache_dir, until=lambda f: len(f) >= 2)
        for e in broken:
            path = srv.cache_dir / e.file
            if fault == "missing":
                path.unlink()
            elif fault == "truncated":
                path.write_bytes(path.read_bytes()[: e.size_bytes // 2])
            else:
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
        flush_live(srv)
        after = ask(srv, msgs)
        # nothing restored: only the few template tokens the unrelated request left live
        assert after["source"] != "disk" and after["cached"] < 16
        assert after["text"] == first["text"]
        metrics = srv.get("/metrics")[1]
        assert "prefixgate_cache_faults_total" in metrics
        fault_lines = [ln for ln in srv.log().splitlines() if "cache fault" in ln]
        # the worker tried each entry, longest first: one log line per fault
        assert len(fault_lines) == len(broken) == 2, fault_lines
        again = ask(srv, msgs)  # the bad entry was dropped and a new one written
        assert again["text"] == first["text"]


def test_per_request_scope_override_and_invalid_scope(tmp_path: Path) -> None:
    msgs = convo("What does rule 5 say?")
    with running(tmp_path, "--workers", "1") as srv:
        ask(srv, msgs, extra_body={"prefix_cache": {"scope": "off"}})
        assert entries(srv.cache_dir) == [], "scope off stores nothing"
        ask(srv, msgs, extra_body={"prefix_cache": {"scope": "280"}})  # at its batch edge
        found = entries(srv.cache_dir, until=lambda f: 256 in {e.n_tokens for e in f})
        assert 256 in {e.n_tokens for e in found}
        with pytest.raises(openai.BadRequestError) as exc:
            ask(srv, msgs, extra_body={"prefix_cache": {"scope": "half"}})
        assert "auto:N" in str(exc.value)


def test_auto_survives_a_restart_every_turn(tmp_path: Path) -> None:
    """Only the disk helps when proxy and workers restart between turns; the ring is persisted
    too, so `auto` still finds the stable prefix the turns share."""
    cache = tmp_path / "cache"
    seen = []
    for i, q in enumerate(("Tail one: rule 2?", "Tail two: rule 4?", "Tail three: rule 6?")):
        with running(tmp_path / f"run{i}", "--workers", "1", "--kv-cache-min-tokens", "32",
                     cache_dir=cache) as srv:
            seen.append(ask(srv, convo(q, history=2)))
    assert seen[0]["cached"] == 0
    assert seen[2]["source"] == "disk"
    assert seen[2]["cached"] >= seen[2]["prompt"] - 40, "the whole stable prefix, not the anchor"


def test_a_save_still_being_written_at_shutdown_is_committed(tmp_path: Path) -> None:
    """A snapshot of the prompt's end (its last batch edge) is written while the reply goes out;
    a proxy stopped right after the response waits for it to commit instead of dropping it (it
    would be an orphan file, deleted at the next start)."""
    msgs = convo("Which rule is about files?", history=12)
    with running(tmp_path, "--workers", "1", "--disk-prefix-cache", "full") as srv:
        first = ask(srv, msgs, max_tokens=1)
        srv.stop()  # SIGINT at once: the write has only just started
    with Index(srv.cache_dir) as index:
        end = max((e.n_tokens for _, e in index.entries()), default=0)
    assert reusable(first["prompt"]) <= end < first["prompt"], srv.log()
    with running(tmp_path, "--workers", "1", "--disk-prefix-cache", "full",
                 cache_dir=srv.cache_dir) as srv2:
        again = ask(srv2, msgs, max_tokens=1)
    assert again["source"] == "disk" and again["cached"] == end


def test_a_cancelled_runs_snapshots_are_still_committed(tmp_path: Path) -> None:
    """The client leaves right after the first token, while the snapshot of the prompt's end
    (taken just before decoding) is still being written: the worker is told to stop, and its
    stream goes on until that snapshot is committed."""
    msgs = convo("Which rule is about files?", history=12)
    with running(tmp_path, "--workers", "1", "--disk-prefix-cache", "full") as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=120)
        stream = c.chat.completions.create(model="m", messages=msgs, temperature=0.8,
                                           max_tokens=400, stream=True)
        for chunk in stream:  # the first chunk (the role) comes before the prefill
            if chunk.choices and chunk.choices[0].delta.content:
                break
        stream.close()
        deadline = time.time() + 30
        while not (m := re.search(r"openai prompt=(\d+) cached=0 source=none cancelled "
                                  r"live=(\d+)", srv.log())) and time.time() < deadline:
            time.sleep(0.1)
        assert m, srv.log()
        n = int(m[1])
        assert int(m[2]) == n  # the whole prompt was prefilled before the first token
        # the prompt's end, at its last batch edge (less than a batch before it)
        found = entries(srv.cache_dir, until=lambda f: any(e.n_tokens >= reusable(n) for e in f))
        end = max(e.n_tokens for e in found)
        assert reusable(n) <= end < n, srv.log()
        again = ask(srv, msgs, max_tokens=1)  # live: the worker kept the prompt's KV
        assert (again["source"], again["cached"]) == ("live", end)


def test_a_broken_entry_falls_back_to_the_next_shorter_one(tmp_path: Path) -> None:
    msgs = convo("Which rule is about citing?")
    with running(tmp_path, "--workers", "1") as srv:
        first = ask(srv, msgs)  # a cold prefill: the anchor
        ask(srv, msgs)  # live: the scoped entry for the whole prompt
        found = entries(srv.cache_dir, until=lambda f: len(f) >= 2)
        anchor = min(found, key=lambda e: e.n_tokens)
        longest = max(found, key=lambda e: e.n_tokens)
        assert anchor.reason == "cold" and longest.n_tokens > anchor.n_tokens
        data = bytearray((srv.cache_dir / longest.file).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (srv.cache_dir / longest.file).write_bytes(bytes(data))
        flush_live(srv)
        after = ask(srv, msgs)
        assert (after["source"], after["cached"]) == ("disk", anchor.n_tokens), srv.log()
        assert after["text"] == first["text"]
        assert len([ln for ln in srv.log().splitlines() if "cache fault" in ln]) == 1
        assert longest.n_tokens not in [e.n_tokens for e in entries(srv.cache_dir)]


def child_pids(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_a_killed_proxy_loses_no_snapshot_and_leaves_no_worker(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, a docker kill): the worker notices its proxy is gone, finishes
    writing the snapshot it took and exits; the next proxy adopts the file it finds without an
    index entry."""
    msgs = convo("Which rule is about files?", history=12)
    with running(tmp_path, "--workers", "1", "--disk-prefix-cache", "full") as srv:
        workers = child_pids(srv.proc.pid)
        assert workers
        first = ask(srv, msgs, max_tokens=1)
        srv.proc.kill()
        srv.proc.wait()
        deadline = time.time() + 60
        while any(Path(f"/proc/{p}").exists() for p in workers) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(Path(f"/proc/{p}").exists() for p in workers), "a worker outlived it"
    with running(tmp_path, "--workers", "1", "--disk-prefix-cache", "full",
                 cache_dir=srv.cache_dir) as srv2:
        assert "orphans_adopted=" in srv2.log()
        end = max((e.n_tokens for e in entries(srv2.cache_dir)), default=0)
        again = ask(srv2, msgs, max_tokens=1)
    assert reusable(first["prompt"]) <= end < first["prompt"]
    assert (again["source"], again["cached"]) == ("disk", end), srv2.log()


def test_a_restore_slower_than_prefill_is_skipped(tmp_path: Path) -> None:
    """The worker measures its prefill and its disk restores as it runs; once a restore is
    known to be slower than prefilling its tokens (here a disk made slow by an injected fault,
    PREFIXGATE_FAULT=slow-disk: each state file read takes 3 s longer), decide prefills instead:
    the log line names it, a metric counts it, /props shows the estimates, the answer is the
    cold one."""
    msgs = convo("Which rule is about files?")
    with running(tmp_path, "--workers", "1", env={"PREFIXGATE_FAULT": "slow-disk"}) as srv:
        cold = ask(srv, msgs)
        entries(srv.cache_dir, until=bool)
        flush_live(srv)
        slow = ask(srv, msgs)  # nothing measured yet: a restore pays until it is measured
        assert slow["source"] == "disk", srv.log()
        costs = srv.get_json("/props")["costs"]["0"]
        assert costs["samples"]["disk"] == 1 and costs["samples"]["prefill"] >= 2, costs
        assert costs["disk_restore"]["bytes_per_s"] > 0
        flush_live(srv)
        skipped = ask(srv, msgs)
        assert (skipped["source"], skipped["cached"]) == ("none", 0), srv.log()
        # one line per skipped restore (the unrelated prompt's own snapshot, at the end of its
        # system message, may be skipped too), the last one this prompt's, each counted
        line = [x for x in srv.log().splitlines() if "restore_skipped=" in x]
        assert f"prompt={skipped['prompt']} " in line[-1] and "lookup=hit" in line[-1], line
        assert re.search(rf"^prefixgate_restores_skipped_total {len(line)}\.0$",
                         srv.get("/metrics")[1], re.M)
    assert cold["text"] == slow["text"] == skipped["text"]
