"""The policy simulator on a tiny hand-built conversation, with exact expected numbers.

The conversation (token ids are made up; only their equality matters):

    system  10 tokens               positions 0..9
    user 1   4 tokens               10..13     <- the anchor: last user message before an assistant
    assistant k: 2 header + 3 content + 1 end = 6 tokens, then user k+1: 4 tokens
    generation prompt: the 2 header tokens

so prompt k has 16 + 10 (k - 1) tokens (16, 26, 36, 46) and each prompt is a token prefix of the
next (it ends in the assistant header that the next prompt continues). Knobs: min 4 tokens, no
continued checkpoints, so every number below follows from the rules in policies/plan.py.
"""

from __future__ import annotations

import json

import pytest

from bench.oracle import compute_oracle
from bench.simulate import SimPrompt, main, simulate
from policies.plan import CacheKnobs

SYSTEM = tuple(range(1, 11))
HEADER = (90, 91)  # "<|im_start|>assistant\n"
KNOBS = CacheKnobs(min_tokens=4, cold_max_tokens=1000, continued_interval_tokens=0)


def user(k: int) -> tuple[int, ...]:
    return tuple(100 + 10 * k + i for i in range(4))


def assistant(k: int) -> tuple[int, ...]:
    return HEADER + tuple(500 + 10 * k + i for i in range(3)) + (99,)


def prompt(turns: int) -> SimPrompt:
    ids: list[int] = list(SYSTEM)
    starts = [(0, "system")]
    bounds = {0}
    for k in range(1, turns + 1):
        if k > 1:
            starts.append((len(ids), "assistant"))
            bounds |= {len(ids), len(ids) + 2}  # message start, role header end
            ids += assistant(k - 1)
        starts.append((len(ids), "user"))
        bounds.add(len(ids))
        ids += user(k)
    bounds |= {len(ids), len(ids) + 2}  # generation prompt start, prompt end
    ids += HEADER
    return SimPrompt(tuple(ids), tuple(sorted(bounds)), tuple(starts))


PROMPTS = [prompt(k) for k in range(1, 5)]


def test_the_conversation_is_append_only() -> None:
    assert [len(p.ids) for p in PROMPTS] == [16, 26, 36, 46]
    for a, b in zip(PROMPTS, PROMPTS[1:], strict=False):
        assert b.ids[: len(a.ids)] == a.ids
        assert len(a.ids) in b.boundaries  # the old end is the new assistant header's end


CASES = [
    # mode, policy, cached per turn, sources, saves per turn
    # restart, auto:30: the ring is read back from the index after each restart. Turn 1 opens
    # the conversation (no assistant message yet), so its end is stored (growing) besides the
    # cold anchor; every later turn extends the one before, stores its own end and restores the
    # whole previous prompt, as full does
    ("restart", "auto:30", [0, 16, 26, 36], "nddd",
     [((10, "cold"), (16, "growing")), ((26, "growing"),), ((36, "growing"),),
      ((46, "growing"),)]),
    # restart, full: the whole prompt is saved each turn and is the next prompt's header end
    ("restart", "full", [0, 16, 26, 36], "nddd",
     [((10, "cold"), (16, "full")), ((26, "full"),), ((36, "full"),), ((46, "full"),)]),
    # restart, fixed 20: too long for prompt 1; saved by prompt 2 (after restoring the anchor),
    # restored from then on
    ("restart", "20", [0, 10, 20, 20], "nddd",
     [((10, "cold"),), ((20, "scoped"),), (), ()]),
    # restart, off: nothing survives
    ("restart", "off", [0, 0, 0, 0], "nnnn", [(), (), (), ()]),
    # live, auto:30: the live KV holds the previous prompt; auto's boundary is that prompt's end
    # (shared with the ring's last prompt), stored already as that turn's growing end
    ("live", "auto:30", [0, 16, 26, 36], "nlll",
     [((10, "cold"), (16, "growing")), ((26, "growing"),), ((36, "growing"),),
      ((46, "growing"),)]),
    # live, off: live reuse only
    ("live", "off", [0, 16, 26, 36], "nlll", [(), (), (), ()]),
]


@pytest.mark.parametrize(("mode", "policy", "cached", "sources", "saves"), CASES)
def test_simulate_table(mode: str, policy: str, cached: list[int], sources: str,
                        saves: list[tuple[tuple[int, str], ...]]) -> None:
    res = simulate(PROMPTS, policy, mode, KNOBS)
    assert [t.cached for t in res.turns] == cached
    assert "".join(t.source[0] for t in res.turns) == sources
    assert [t.saves for t in res.turns] == saves


def test_summary_numbers() -> None:
    oracle = compute_oracle([p.ids for p in PROMPTS])
    assert oracle.fresh_tokens == (16, 10, 10, 10)
    auto = simulate(PROMPTS, "auto:30", "restart", KNOBS).summary(oracle)
    assert auto | {"mean_hit_ratio": 0, "oracle_mean_hit_ratio": 0} == {
        "policy": "auto:30", "mode": "restart", "requests": 4, "hits": 3, "disk_hits": 3,
        "hit_rate": 0.75, "tokens_cached_per_hit": 78 / 3, "prompt_tokens": 124,
        "cached_tokens": 78, "fresh_tokens": 46, "token_hit_ratio": 78 / 124,
        "mean_hit_ratio": 0, "saves": 5, "snapshot_tokens": 10 + 16 + 26 + 36 + 46,
        "oracle_fresh_tokens": 46, "excess_over_oracle_tokens": 0, "fresh_over_oracle": 1.0,
        "oracle_mean_hit_ratio": 0}
    assert auto["mean_hit_ratio"] == pytest.approx((0 + 16 / 26 + 26 / 36 + 36 / 46) / 4)
    assert auto["oracle_mean_hit_ratio"] == pytest.approx((0 + 16 / 26 + 26 / 36 + 36 / 46) / 4)
    full = simulate(PROMPTS, "full", "restart", KNOBS).summary(oracle)
    assert (full["fresh_tokens"], full["excess_over_oracle_tokens"]) == (46, 0)
    assert (full["saves"], full["snapshot_tokens"]) == (5, 10 + 16 + 26 + 36 + 46)
    assert full["tokens_cached_per_hit"] == pytest.approx((16 + 26 + 36) / 3)


def test_a_rewritten_early_block_misses() -> None:
    # prompt 3 with one system token changed: only tokens before it could match, and no
    # boundary lies there, so even full restores nothing
    changed = PROMPTS[2].ids[:3] + (777,) + PROMPTS[2].ids[4:]
    p3 = SimPrompt(changed, PROMPTS[2].boundaries, PROMPTS[2].message_starts)
    res = simulate([PROMPTS[0], PROMPTS[1], p3], "full", "restart", KNOBS)
    assert [t.cached for t in res.turns] == [0, 16, 0]
    assert compute_oracle([PROMPTS[0].ids, PROMPTS[1].ids, changed]).fresh_tokens == (16, 10, 33)


def test_unknown_mode_is_refused() -> None:
    for mode in ("sometimes", "live:0", "live:", "restart:2"):
        with pytest.raises(ValueError, match="unknown mode"):
            simulate(PROMPTS, "full", mode, KNOBS)


def test_command_on_a_tiny_trace(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # through the real tokenizer and template: exact relations, whatever the token counts
    rows = []
    messages: list[dict[str, object]] = []
    for k in range(3):
        if k:
            messages.append({"role": "assistant", "content": f"Placeholder answer {k}."})
        messages.append({"role": "user", "content": f"Question number {k}: what is in src?"})
        rows.append({"system": "You are terse. " * 100, "messages": list(messages),
                     "max_tokens": 8})
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # batch 1: reuse at any token, so the relations to the oracle are exact
    main(["--trace", str(trace), "--policies", "auto:30,full", "--modes", "restart",
          "--ubatch-size", "1", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "simulate-tiny.json").read_text())
    by = {r["policy"]: r for r in out["results"]}
    assert out["requests"] == 3
    # append-only: the oracle prefills the first prompt and each turn's growth; full matches it
    assert by["full"]["fresh_tokens"] == out["oracle"]["fresh_tokens"]
    assert by["full"]["excess_over_oracle_tokens"] == 0
    # auto after every restart: turn 1 opens the conversation and stores its end, so each later
    # turn restores the whole previous prompt (its growing end), as the oracle does
    assert by["auto:30"]["disk_hits"] == 2
    assert by["auto:30"]["saves"] == 4  # cold anchor and growing; growing; growing
    assert by["auto:30"]["excess_over_oracle_tokens"] == 0
    assert "| auto:30 | restart |" in capsys.readouterr().out
    assert (tmp_path / "simulate-tiny.md").exists()
    # the default CPU batch (64): each hit starts at a batch edge, so it prefills at most 63
    # tokens more than the oracle
    main(["--trace", str(trace), "--policies", "auto:30,full", "--modes", "restart",
          "--out", str(tmp_path)])
    out = json.loads((tmp_path / "simulate-tiny.json").read_text())
    for r in out["results"]:
        assert 0 <= r["excess_over_oracle_tokens"] <= 63 * r["disk_hits"], r


# --- issue 46: four sessions taking turns, two with a status line that changes ---------------
# The shape of bench/traces/interleaved-gitstatus.jsonl in made-up ids, as the stable-first
# layout renders it: the shared tools and system text (30 tokens), then each session's first
# user message, which opens with its own git status line (3 tokens, moved there from the end of
# the system prompt), then the turns. Sessions 0 and 1 change their status line at turn 4, so
# that prompt extends none of the session's earlier ones.
SHARED = tuple(range(1, 31))
SESSIONS, TURNS, CHANGE_AT = 4, 6, 4


def session_prompt(s: int, turns: int) -> SimPrompt:
    version = 1 if s < 2 and turns >= CHANGE_AT else 0
    status = (1000 + 10 * s + version, 1100, 1101)
    ids = list(SHARED)
    starts = [(0, "system"), (len(ids), "user")]
    ids += status + tuple(2000 + 100 * s + i for i in range(4))  # the task
    for k in range(1, turns):
        starts.append((len(ids), "assistant"))
        ids += HEADER + tuple(3000 + 100 * s + 10 * k + i for i in range(3)) + (99,)
        starts.append((len(ids), "user"))
        ids += tuple(4000 + 100 * s + 10 * k + i for i in range(4))  # a tool result
    ids += HEADER
    return SimPrompt(tuple(ids), tuple(sorted({p for p, _ in starts} | {len(ids)})),
                     tuple(starts))


INTERLEAVED = [session_prompt(s, t) for t in range(1, TURNS + 1) for s in range(SESSIONS)]


@pytest.mark.parametrize("mode", ["restart", "live"])
def test_interleaved_sessions_with_a_changed_status_line(mode: str) -> None:
    oracle = compute_oracle([p.ids for p in INTERLEAVED])
    auto = simulate(INTERLEAVED, "auto:30", mode, KNOBS)
    full = simulate(INTERLEAVED, "full", mode, KNOBS)
    # every turn of every session restores what any cache could: auto as full, as the oracle
    assert [t.fresh for t in auto.turns] == list(oracle.fresh_tokens)
    assert auto.fresh == full.fresh == oracle.total_fresh
    # the turn with the changed status line extends no earlier prompt; its end is saved, and
    # the session's next turn (4 sessions later) restores all of it
    i = SESSIONS * (CHANGE_AT - 1)
    assert (len(INTERLEAVED[i].ids), auto.turns[i].saves[-1]) == (69, (69, "growing"))
    assert auto.turns[i + SESSIONS].cached == 69
    # auto:2 does not see the session's previous turn (3 others came between): the ends it
    # saves as chat turns still give every turn its whole previous prompt
    assert simulate(INTERLEAVED, "auto:2", mode, KNOBS).fresh == oracle.total_fresh


def test_sessions_taking_turns_keep_their_slots() -> None:
    # live:4, a worker of four slots, as the proxy's router places the requests: each session's
    # first turn restores the shared prefix from disk into a free slot (cheaper than taking
    # another session's: policies.router's score), and from then on every turn extends its own
    # slot's live KV. A restart before every request prefills no more.
    oracle = compute_oracle([p.ids for p in INTERLEAVED])
    res = simulate(INTERLEAVED, "auto:30", "live:4", KNOBS)
    assert "".join(t.source[0] for t in res.turns) == "n" + "d" * 3 + "l" * 20
    assert res.fresh == oracle.total_fresh
    assert simulate(INTERLEAVED, "auto:30", "restart", KNOBS).fresh == oracle.total_fresh
