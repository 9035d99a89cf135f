"""Where a prompt is looked up and where it is snapshotted: anchor, scope boundary, save points.

Positions are token counts: a position ``p`` names the KV state of the prompt's first ``p`` ids,
and an entry stored at ``p`` holds KV for exactly ``p`` tokens (the exactness invariant).

Rules:

- **Anchor** (``anchor_position``): the start of the last user message before the first assistant
  message, i.e. the end of the stable preamble (system prompt, tool schemas, first context). With
  no assistant message yet, the last user message of the prompt. ``None`` when there is no such
  user message or it starts at position 0 (nothing before it worth keeping).
- **Scope boundary** (``choose_scope_boundary``), by scope kind:

  - ``off``: none.
  - ``full``: the whole prompt, ``len(ids)`` (none for an empty prompt).
  - ``fixed`` N: exactly N if ``min_tokens <= N <= len(ids)``, else none.
  - ``auto:N``: exactly ``L`` = the longest ``common_prefix_len(ids, r)`` over the first N prompts
    of ``recent`` (which excludes this prompt); none if that is below ``min_tokens``. Not aligned
    to a message start: sessions often share a prefix that ends inside a message (a system
    prompt up to its per-session block), and the KV of any token prefix is exact. A wider window
    finds older shared prefixes (an agent switching between sessions) at the cost of more
    comparisons.

- **Save points** (``plan_saves``), with ``cached_n`` the tokens not prefilled (the longer of the
  live reuse and the disk restore). A save point ``p`` needs ``0 < p <= n_prompt`` and ``p`` not
  already stored; it may lie behind ``cached_n``: the worker then snapshots it from the KV it
  holds (cut back to ``p``, copied, and put back), which is exact and costs no prefill.
  ``off``: none. Otherwise:

  - the scope boundary (reason ``scoped``); for ``full`` the prompt end (reason ``full``);
  - the cold anchor: a cold prefill (``cached_n == 0``) of at most ``cold_max_tokens`` saves the
    anchor (``cold``); a cold prompt longer than that saves no anchor and ``anchor_skipped`` says
    why; a partial hit short of the anchor (``0 < cached_n < anchor``) means the stored anchor is
    stale, so the new one is saved in the same prefill (``anchor-refresh``); a hit at or past the
    anchor saves nothing;
  - continued checkpoints: every ``k * interval`` with ``cached_n < k * interval <= n_prompt``
    (``continued``), waypoints for a long conversation whose scope moves; an interval <= 0
    disables them;
  - the growing turn (``auto`` only, ``growing``): the prompt end, whenever the prompt is a
    chat turn (``awaits_reply``: messages located) or extends a recent prompt in the window
    (``extends_recent``: a raw prompt growing append-only). The client's next turn of the same
    conversation extends the prompt it sends now, whatever came before it: a session's first
    turn, the next turn of the usual agent loop, a turn whose history the client re-rendered (a
    ``gitStatus:`` line that changed after an edit, a compacted history, an edited message) and
    a turn whose previous one has left the window (more sessions taking turns than ``N``). The
    scope boundary alone is one turn behind there: it is where the *previous* prompt ended, or,
    after a re-render, the short prefix the sessions share, so every turn after a restart would
    prefill the last two turns, or the whole history again (issue 46: four sessions taking
    turns, two of them with a changed status line, paid 1.16x what any exact cache must prefill
    with a restart before every request, against 1.00x with this rule). It is what ``full``
    stores, and bounded the same way: by the cache's byte budget, where a turn end that a newer
    entry contains goes first (``policies.eviction``). A conversation's last turn stores an end
    no one extends; that is the price of not knowing the future. (A client that changes its
    history on every turn, a timestamp in its first message, stores an end per turn that no
    turn extends; no cache reuses its history either: a volatile pattern strips it.)

  One reason per position, the strongest: ``full`` > ``scoped``/``growing`` >
  ``cold``/``anchor-refresh`` > ``continued``. Save points come out ascending, so the worker
  prefills in segments that stop exactly at each one.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from policies.prefix import common_prefix_len, frozen
from policies.scope import Scope

Reason = Literal["cold", "anchor-refresh", "scoped", "growing", "continued", "full"]

# Which reason a position keeps when several rules pick it: higher wins.
REASON_RANK: dict[Reason, int] = {
    "full": 4,
    "scoped": 3,
    "growing": 3,
    "cold": 2,
    "anchor-refresh": 2,
    "continued": 1,
}


@dataclass(frozen=True, slots=True)
class SavePoint:
    n_tokens: int
    reason: Reason


class MessageStart(NamedTuple):
    """Where a located message starts (a tuple: the proxy makes one per message per request)."""

    pos: int  # token position where the message starts
    role: str  # "system" | "user" | "assistant" | "tool" ...


@dataclass(frozen=True, slots=True)
class CacheKnobs:
    min_tokens: int = 256  # --kv-cache-min-tokens: shortest auto/fixed scope boundary, tokens
    cold_max_tokens: int = 30000  # --kv-cache-cold-max-tokens: longest prompt given a cold anchor
    continued_interval_tokens: int = 10000  # --kv-cache-continued-interval-tokens; <= 0: none


@dataclass(frozen=True, slots=True)
class SavePlan:
    saves: tuple[SavePoint, ...]  # ascending n_tokens, one per position
    anchor_skipped: str | None  # why the cold anchor was skipped, else None


def anchor_position(starts: Sequence[MessageStart]) -> int | None:
    """Start of the last user message before the first assistant message, or ``None``."""
    anchor: int | None = None
    for start in starts:
        if start.role == "assistant":
            break
        if start.role == "user":
            anchor = start.pos
    return anchor or None


def _longest_recent_prefix(ids: Sequence[int], recent: Sequence[Sequence[int]]) -> int:
    ids = frozen(ids)  # converted once, not per ring entry
    best = 0
    for other in recent:
        if len(other) <= best:
            continue  # cannot beat the best match so far (append-only sessions: most of them)
        best = max(best, common_prefix_len(ids, other))
        if best == len(ids):
            break
    return best


def choose_scope_boundary(
    ids: Sequence[int],
    scope: Scope,
    recent: Sequence[Sequence[int]],
    knobs: CacheKnobs,
) -> int | None:
    """The position the scope snapshots exactly, or ``None`` when it snapshots nothing."""
    if scope.kind == "off":
        return None
    if scope.kind == "full":
        return len(ids) or None
    if scope.kind == "fixed":
        n = scope.n_tokens
        return n if knobs.min_tokens <= n <= len(ids) and n > 0 else None
    shared = _longest_recent_prefix(ids, recent[: scope.window])
    return shared if shared > 0 and shared >= knobs.min_tokens else None


def awaits_reply(starts: Sequence[MessageStart]) -> bool:
    """Whether the prompt is a chat turn (its messages located): the client waits for the reply,
    and its next turn of the conversation, if any, extends this prompt."""
    return bool(starts)


# decide() calls it by the name of the rule it replaced (a conversation's first turn only)


def extends_recent(ids: Sequence[int], recent: Sequence[Sequence[int]]) -> bool:
    """Whether some prompt of ``recent`` (the auto window) is a whole, shorter prefix of ``ids``:
    the conversation grows append-only."""
    n = len(ids)
    return any(0 < len(r) < n and common_prefix_len(ids, r) == len(r) for r in recent)


def _continued(start_after: int, n_prompt: int, interval: int) -> range:
    """Multiples of ``interval`` in ``(start_after, n_prompt]``; empty when interval <= 0."""
    if interval <= 0:
        return range(0)
    first = (max(start_after, 0) // interval + 1) * interval
    return range(first, n_prompt + 1, interval)


def _anchor_reason(
    n_prompt: int, cached_n: int, anchor: int, knobs: CacheKnobs
) -> tuple[Reason | None, str | None]:
    """(reason to save the anchor or None, why a cold anchor was skipped or None)."""
    if cached_n == 0 and n_prompt > knobs.cold_max_tokens:
        return None, f"prompt of {n_prompt} tokens exceeds cold max {knobs.cold_max_tokens}"
    if cached_n == 0:
        return "cold", None
    if cached_n < anchor:
        return "anchor-refresh", None
    return None, None


def plan_saves(
    n_prompt: int,
    cached_n: int,
    scope: Scope,
    scope_boundary: int | None,
    anchor: int | None,
    stored: Collection[int],
    knobs: CacheKnobs,
    growing: bool = False,
) -> SavePlan:
    """Save points for one prefill of ``n_prompt`` tokens of which ``cached_n`` are reused;
    ``growing``: the prompt extends a recent one (``extends_recent``)."""
    if scope.kind == "off":
        return SavePlan((), None)

    def savable(p: int) -> bool:
        return 0 < p <= n_prompt and p not in stored

    wanted: list[tuple[int, Reason]] = [
        (p, "continued") for p in _continued(cached_n, n_prompt, knobs.continued_interval_tokens)
    ]
    skipped: str | None = None
    if anchor is not None and savable(anchor):
        reason, skipped = _anchor_reason(n_prompt, cached_n, anchor, knobs)
        if reason is not None:
            wanted.append((anchor, reason))
    if scope.kind == "full":
        wanted.append((n_prompt, "full"))
    elif scope_boundary is not None:
        wanted.append((scope_boundary, "scoped"))
    if scope.kind == "auto" and growing:
        wanted.append((n_prompt, "growing"))

    return SavePlan(strongest((p, reason) for p, reason in wanted if savable(p)), skipped)


def strongest(points: Iterable[tuple[int, Reason]]) -> tuple[SavePoint, ...]:
    """One save point per position, with its strongest reason (``REASON_RANK``), ascending."""
    best: dict[int, Reason] = {}
    for p, reason in points:
        if p not in best or REASON_RANK[reason] > REASON_RANK[best[p]]:
            best[p] = reason
    return tuple(SavePoint(p, best[p]) for p in sorted(best))
