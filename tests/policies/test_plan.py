"""Plan: the anchor, the scope boundary (auto over the ring), save points."""

from __future__ import annotations

import pytest

from policies.plan import (
    CacheKnobs,
    MessageStart,
    Reason,
    SavePlan,
    SavePoint,
    anchor_position,
    choose_scope_boundary,
    plan_saves,
)
from policies.scope import Scope, parse_scope

S, U, A, T = "system", "user", "assistant", "tool"


@pytest.mark.parametrize(
    ("starts", "expected"),
    [
        # First turn, no assistant yet: the user message starts after the preamble.
        ([(0, S), (120, U)], 120),
        # Later turns: still the first user message, before the first assistant reply.
        ([(0, S), (120, U), (400, A), (900, U)], 120),
        # Several user messages before the first reply: the last of them.
        ([(0, S), (120, U), (300, U), (400, A), (900, U)], 300),
        # Tool schemas rendered as their own message before the user.
        ([(0, S), (80, T), (150, U), (300, A)], 150),
        # The user message opens the prompt: nothing before it worth anchoring.
        ([(0, U), (50, A)], None),
        # No user message before the first assistant one.
        ([(0, S), (50, A), (90, U)], None),
        # No user message at all, or no messages.
        ([(0, S)], None),
        ([], None),
    ],
)
def test_anchor_position(starts: list[tuple[int, str]], expected: int | None) -> None:
    assert anchor_position([MessageStart(pos, role) for pos, role in starts]) == expected


# A 3000-token prompt (think of messages starting at 0, 300, 700, 1500 and 2400; the boundary
# never looks at them). Every id is >= 1000, so the filler 9 never matches: diverge(at) shares
# exactly `at` tokens with PROMPT.
PROMPT = list(range(1000, 4000))
KNOBS = CacheKnobs(min_tokens=256)


def diverge(at: int) -> tuple[int, ...]:
    return tuple(PROMPT[:at]) + (9,) * (len(PROMPT) - at)


@pytest.mark.parametrize(
    ("spec", "recent", "knobs", "expected"),
    [
        # off: never a boundary, however much the ring shares.
        ("off", [diverge(3000)], KNOBS, None),
        # full: the whole prompt, ring or not.
        ("full", [], KNOBS, 3000),
        # fixed N: exactly N, even inside a message.
        ("1000", [], KNOBS, 1000),
        ("256", [], KNOBS, 256),
        ("3000", [], KNOBS, 3000),
        # fixed N longer than the prompt: nothing to snapshot.
        ("3001", [], KNOBS, None),
        # fixed N below min tokens: too small to be worth a file.
        ("255", [], KNOBS, None),
        # auto, empty ring (first prompt of a tenant): nothing shared.
        ("auto", [], KNOBS, None),
        # auto: exactly the 1600 shared tokens, inside the message starting at 1500 (not aligned).
        ("auto", [diverge(1600)], KNOBS, 1600),
        # auto: one token short of a message start: exactly that, not a whole message back.
        ("auto", [diverge(1499)], KNOBS, 1499),
        # auto: 350 shared clears min tokens 256...
        ("auto", [diverge(350)], KNOBS, 350),
        # ...but not min tokens 400.
        ("auto", [diverge(350)], CacheKnobs(min_tokens=400), None),
        # (a) a shared prefix inside the first message (a system prompt up to its
        # per-session block): exactly 290, not 0.
        ("auto", [diverge(290)], KNOBS, 290),
        # NEW: auto's min tokens edge: 256 shared is enough, 255 is not.
        ("auto", [diverge(256)], KNOBS, 256),
        ("auto", [diverge(255)], KNOBS, None),
        # auto: the best of several ring entries wins.
        ("auto", [diverge(800), diverge(2500), diverge(100)], KNOBS, 2500),
        # auto: an identical earlier prompt shares everything: the whole prompt.
        ("auto", [tuple(PROMPT)], KNOBS, 3000),
        # auto: an earlier, longer prompt that contains this one.
        ("auto", [(*PROMPT, 5, 6, 7)], KNOBS, 3000),
        # auto: an earlier prompt that is a prefix of this one (previous turn of the session).
        ("auto", [tuple(PROMPT[:1800])], KNOBS, 1800),
    ],
)
def test_choose_scope_boundary(
    spec: str, recent: list[tuple[int, ...]], knobs: CacheKnobs, expected: int | None
) -> None:
    scope = parse_scope(spec)
    assert choose_scope_boundary(PROMPT, scope, recent, knobs) == expected


# The window trade-off: this prompt's best match is the 5th most recent one (the same agent
# session, interleaved with four prompts from other sessions that share only a short prefix).
RING_5TH_BEST = [diverge(100), diverge(350), diverge(120), diverge(90), diverge(2500), diverge(50)]


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        # auto:1 sees only a 100-token match: below min tokens, no boundary.
        (1, None),
        # auto:2 also sees the 350-token match: a short boundary.
        (2, 350),
        # auto:4 still misses the session's own previous prompt.
        (4, 350),
        # auto:5 reaches it: the long boundary.
        (5, 2500),
        # auto:8 (window longer than the ring) and the default auto:30 find it too.
        (8, 2500),
        (30, 2500),
    ],
)
def test_auto_window_trade_off(window: int, expected: int | None) -> None:
    scope = parse_scope("auto", window=window)
    assert choose_scope_boundary(PROMPT, scope, RING_5TH_BEST, KNOBS) == expected


def test_full_of_an_empty_prompt_is_none() -> None:
    assert choose_scope_boundary([], Scope("full"), [], KNOBS) is None


INTERVAL_1000 = CacheKnobs(continued_interval_tokens=1000)


AUTO, FULL, OFF = Scope("auto"), Scope("full"), Scope("off")
FIXED_4000 = Scope("fixed", n_tokens=4000)
COLD_MAX_SKIP = "prompt of 41000 tokens exceeds cold max 30000"


def saves(*points: tuple[int, Reason]) -> tuple[SavePoint, ...]:
    return tuple(SavePoint(n, reason) for n, reason in points)


# Defaults: min 256, cold max 30000, continued every 10000. A 25000-token agent prompt whose
# preamble (anchor) ends at 4000 and whose auto scope boundary is 21000, unless a case says.
@pytest.mark.parametrize(
    ("n_prompt", "cached_n", "scope", "boundary", "anchor", "stored", "expected"),
    [
        # off: nothing, whatever else is true.
        (25000, 0, OFF, None, 4000, set(), SavePlan((), None)),
        # Cold prefill: the anchor, the continued frontiers, the scope boundary, in order.
        (
            25000, 0, AUTO, 21000, 4000, set(),
            SavePlan(
                saves((4000, "cold"), (10000, "continued"), (20000, "continued"),
                      (21000, "scoped")),
                None,
            ),
        ),
        # Cold, nothing shared with the ring yet: anchor and frontiers only.
        (
            25000, 0, AUTO, None, 4000, set(),
            SavePlan(saves((4000, "cold"), (10000, "continued"), (20000, "continued")), None),
        ),
        # Cold, no anchor in this prompt (no user message before the first reply).
        (
            25000, 0, AUTO, 21000, None, set(),
            SavePlan(
                saves((10000, "continued"), (20000, "continued"), (21000, "scoped")), None
            ),
        ),
        # Cold and exactly at cold max: the anchor is still saved.
        (
            30000, 0, AUTO, 28000, 4000, set(),
            SavePlan(
                saves((4000, "cold"), (10000, "continued"), (20000, "continued"),
                      (28000, "scoped"), (30000, "continued")),
                None,
            ),
        ),
        # Cold and over cold max: no anchor, and the plan says why. The scope boundary at 40000
        # is also a frontier; it is saved once, as scoped.
        (
            41000, 0, AUTO, 40000, 4000, set(),
            SavePlan(
                saves((10000, "continued"), (20000, "continued"), (30000, "continued"),
                      (40000, "scoped")),
                COLD_MAX_SKIP,
            ),
        ),
        # Over cold max but no anchor to skip: nothing to explain.
        (
            41000, 0, AUTO, None, None, set(),
            SavePlan(
                saves((10000, "continued"), (20000, "continued"), (30000, "continued"),
                      (40000, "continued")),
                None,
            ),
        ),
        # Partial hit short of the anchor: the stored anchor is stale, refresh it.
        (
            25000, 2000, AUTO, 21000, 4000, set(),
            SavePlan(
                saves((4000, "anchor-refresh"), (10000, "continued"), (20000, "continued"),
                      (21000, "scoped")),
                None,
            ),
        ),
        # Refresh is not bound by cold max (only fully cold prefills are).
        (
            41000, 2000, AUTO, None, 4000, set(),
            SavePlan(
                saves((4000, "anchor-refresh"), (10000, "continued"), (20000, "continued"),
                      (30000, "continued"), (40000, "continued")),
                None,
            ),
        ),
        # Hit exactly at the anchor: the anchor is fresh, nothing to save there.
        (
            25000, 4000, AUTO, 21000, 4000, set(),
            SavePlan(
                saves((10000, "continued"), (20000, "continued"), (21000, "scoped")), None
            ),
        ),
        # Hit past the anchor and the first frontier: only what lies ahead.
        (
            25000, 12000, AUTO, 21000, 4000, set(),
            SavePlan(saves((20000, "continued"), (21000, "scoped")), None),
        ),
        # Hit exactly on a frontier: that frontier is behind us (needs cached < k*interval).
        (
            25000, 10000, AUTO, None, 4000, set(),
            SavePlan(saves((20000, "continued"),), None),
        ),
        # Live reuse up to exactly the scope boundary, not yet on disk: snapshot it at once.
        (25000, 21000, AUTO, 21000, 4000, set(), SavePlan(saves((21000, "scoped"),), None)),
        # ...and if it is on disk already, nothing.
        (25000, 21000, AUTO, 21000, 4000, {21000}, SavePlan((), None)),
        # Reuse past the unstored scope boundary: it is saved behind the reuse (the worker
        # snapshots it from the KV it holds).
        (25000, 22000, AUTO, 21000, 4000, set(), SavePlan(saves((21000, "scoped"),), None)),
        # NEW (d): reuse past the scope boundary, which is stored already: nothing to save.
        (25000, 22000, AUTO, 21000, 4000, {21000}, SavePlan((), None)),
        # NEW (b): reuse 14000 tokens past the unstored boundary 21000: still saved behind it,
        # plus the frontier ahead (40000); the frontiers behind the reuse (10000 to 30000) and
        # the anchor are not saved, and a prompt over cold max that is not cold skips nothing.
        (
            41000, 35000, AUTO, 21000, 4000, set(),
            SavePlan(saves((21000, "scoped"), (40000, "continued")), None),
        ),
        # NEW (e): fixed N (4000) behind the reuse, not stored: saved, scoped; the anchor on the
        # same position gives no reason of its own (the hit is past it).
        (
            25000, 12000, FIXED_4000, 4000, 4000, set(),
            SavePlan(saves((4000, "scoped"), (20000, "continued")), None),
        ),
        # Cold, but the anchor and a frontier are on disk already: skipped.
        (
            25000, 0, AUTO, 21000, 4000, {4000, 20000},
            SavePlan(saves((10000, "continued"), (21000, "scoped")), None),
        ),
        # full: the prompt end, reason full, plus anchor and frontiers.
        (
            25000, 0, FULL, 25000, 4000, set(),
            SavePlan(
                saves((4000, "cold"), (10000, "continued"), (20000, "continued"),
                      (25000, "full")),
                None,
            ),
        ),
        # full ending on a frontier: one save there, reason full.
        (
            20000, 0, FULL, 20000, 4000, set(),
            SavePlan(saves((4000, "cold"), (10000, "continued"), (20000, "full")), None),
        ),
        # fixed N on the anchor: one save there, scoped outranks cold.
        (
            25000, 0, FIXED_4000, 4000, 4000, set(),
            SavePlan(
                saves((4000, "scoped"), (10000, "continued"), (20000, "continued")), None
            ),
        ),
    ],
)
def test_plan_saves(
    n_prompt: int,
    cached_n: int,
    scope: Scope,
    boundary: int | None,
    anchor: int | None,
    stored: set[int],
    expected: SavePlan,
) -> None:
    assert plan_saves(n_prompt, cached_n, scope, boundary, anchor, stored, CacheKnobs()) == expected


def test_continued_interval_zero_disables_frontiers() -> None:
    knobs = CacheKnobs(continued_interval_tokens=0)
    plan = plan_saves(25000, 0, AUTO, 21000, 4000, set(), knobs)
    assert plan == SavePlan(saves((4000, "cold"), (21000, "scoped")), None)


# --- the growing turn: auto on an append-only conversation ---------------------------------
from policies.plan import extends_recent  # noqa: E402


@pytest.mark.parametrize(
    "ids,recent,expected",
    [
        ([1, 2, 3, 4, 5], [[1, 2, 3]], True),  # the previous turn, then a reply and a question
        ([1, 2, 3, 4, 5], [[9], [1, 2, 3, 4]], True),  # any prompt in the window
        ([1, 2, 3, 4, 5], [[1, 2, 3, 4, 5]], False),  # the same prompt again: not growing
        ([1, 2, 3, 4, 5], [[1, 2, 7]], False),  # re-rendered or edited history
        ([1, 2, 3], [[1, 2, 3, 4]], False),  # a longer recent prompt
        ([1, 2, 3], [[]], False),
        ([1, 2, 3], [], False),
    ],
)
def test_extends_recent(ids: list[int], recent: list[list[int]], expected: bool) -> None:
    assert extends_recent(ids, recent) is expected


def test_a_growing_auto_prompt_also_snapshots_its_end() -> None:
    # restored the previous turn's end (21000, also this prompt's scope boundary, stored)
    plan = plan_saves(21500, 21000, AUTO, 21000, 4000, {4000, 21000}, CacheKnobs(),
                      growing=True)
    assert plan == SavePlan(saves((21500, "growing"),), None)
    # a turn that did not grow from a recent one: only what the scope says
    assert plan_saves(21500, 21000, AUTO, 21000, 4000, {4000, 21000}, CacheKnobs()) == \
        SavePlan((), None)
    # other scopes do not use it: full snapshots the end anyway, fixed N never
    assert plan_saves(21500, 21000, FULL, 21500, 4000, {4000}, CacheKnobs(),
                      growing=True) == SavePlan(saves((21500, "full"),), None)
    assert plan_saves(21500, 21000, FIXED_4000, 4000, 4000, {4000}, CacheKnobs(),
                      growing=True) == SavePlan((), None)


# --- awaits_reply: a chat turn, whose end auto saves (growing): the next turn extends it -------
from policies.plan import awaits_reply  # noqa: E402


@pytest.mark.parametrize("starts,expected", [
    # system and user, no reply yet: a session's first request
    ((MessageStart(0, "system"), MessageStart(40, "user")), True),
    # one user message alone
    ((MessageStart(0, "user"),), True),
    # a reply in the history: a later turn, also one whose history the client re-rendered (a
    # changed gitStatus line, a compaction) and so extends no recent prompt (issue 46)
    ((MessageStart(0, "system"), MessageStart(40, "user"), MessageStart(60, "assistant"),
      MessageStart(80, "user")), True),
    # no messages located (a raw /v1/completions prompt): not a chat turn (extends_recent
    # covers one that grows)
    ((), False),
])
def test_awaits_reply(starts: tuple[MessageStart, ...], expected: bool) -> None:
    assert awaits_reply(starts) is expected
