"""Cache scope: how much of a prompt is snapshotted to disk, parsed from one short string.

Accepted specs (``--disk-prefix-cache`` and the per-request ``prefix_cache.scope``), case and
surrounding blanks ignored:

- ``off``: no disk cache for this request (no lookup, no save).
- ``full``: the whole prompt, plus the cold anchor and continued checkpoints.
- ``auto`` (same as ``auto:30``): exactly the longest common token prefix between this prompt and
  each of the last N prompts in the ring, at least min tokens; and the end of a chat turn, which
  the client's next turn extends (``policies.plan``'s growing turn).
- ``auto:N`` (N >= 1): as ``auto`` with a window of the last N prompts.
- ``N`` (N >= 1): exactly the first N tokens.

``window`` (the per-request ``prefix_cache.window``), when given, replaces auto's N and is only
valid with ``auto``/``auto:N``. Anything else raises ``ValueError`` with a message that lists what
is allowed. ``format_scope`` is the inverse: ``format_scope(parse_scope(s))`` is canonical
(``auto`` reads back as ``auto:30``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ScopeKind = Literal["off", "full", "auto", "fixed"]

DEFAULT_WINDOW = 30


@dataclass(frozen=True, slots=True)
class Scope:
    kind: ScopeKind
    window: int = DEFAULT_WINDOW  # auto: how many recent prompts of the ring to compare with
    n_tokens: int = 0  # fixed: the first N tokens


def _invalid(spec: str) -> ValueError:
    return ValueError(
        f"invalid prefix cache scope {spec!r}: use off, full, auto, auto:N or N "
        "(N a positive integer)"
    )


def _positive(text: str) -> int | None:
    # ASCII digits only: int() would also take "+5", " 5", "1_000" and non-ASCII digits.
    if not (text.isascii() and text.isdigit()):
        return None
    n = int(text)
    return n if n >= 1 else None


def _auto(arg: str) -> Scope | None:
    if not arg:
        return Scope("auto")
    n = _positive(arg)
    return Scope("auto", window=n) if n is not None else None


# Scope names without a number; "auto" takes an optional ":N" suffix; a bare N is "fixed".
_PARSERS: dict[str, Callable[[str], Scope | None]] = {
    "off": lambda arg: None if arg else Scope("off"),
    "full": lambda arg: None if arg else Scope("full"),
    "auto": _auto,
}


def _parse(spec: str) -> Scope | None:
    name, colon, arg = spec.strip().lower().partition(":")
    parser = _PARSERS.get(name)
    if parser is not None:
        return None if colon and not arg else parser(arg)
    n = _positive(name)
    return Scope("fixed", n_tokens=n) if n is not None and not colon else None


def parse_scope(spec: str, window: int | None = None) -> Scope:
    """Parse a scope spec; ``window`` overrides auto's N. Raises ``ValueError`` when invalid."""
    scope = _parse(spec)
    if scope is None:
        raise _invalid(spec)
    if window is None:
        return scope
    if scope.kind != "auto":
        raise ValueError(
            f"prefix cache window {window} given with scope {spec!r}: a window only applies to "
            "auto or auto:N"
        )
    if isinstance(window, bool) or window < 1:
        raise ValueError(f"invalid prefix cache window {window!r}: use a positive integer")
    return Scope("auto", window=window)


_FORMATTERS: dict[ScopeKind, Callable[[Scope], str]] = {
    "off": lambda s: "off",
    "full": lambda s: "full",
    "auto": lambda s: f"auto:{s.window}",
    "fixed": lambda s: str(s.n_tokens),
}


def format_scope(scope: Scope) -> str:
    """The canonical spec string of ``scope``, e.g. ``"auto:30"`` or ``"4096"``."""
    return _FORMATTERS[scope.kind](scope)
