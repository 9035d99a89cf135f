"""parse_scope / format_scope: every accepted spelling, the window override, and bad specs."""

from __future__ import annotations

import pytest

from policies.scope import Scope, format_scope, parse_scope


@pytest.mark.parametrize(
    ("spec", "window", "expected", "canonical"),
    [
        # No disk cache.
        ("off", None, Scope("off"), "off"),
        # The whole prompt.
        ("full", None, Scope("full"), "full"),
        # auto is auto:30.
        ("auto", None, Scope("auto", window=30), "auto:30"),
        # auto with an explicit window.
        ("auto:8", None, Scope("auto", window=8), "auto:8"),
        ("auto:1", None, Scope("auto", window=1), "auto:1"),
        # The per-request window overrides auto's N, written or default.
        ("auto", 5, Scope("auto", window=5), "auto:5"),
        ("auto:8", 2, Scope("auto", window=2), "auto:2"),
        # A bare number is the fixed first N tokens.
        ("4096", None, Scope("fixed", n_tokens=4096), "4096"),
        ("1", None, Scope("fixed", n_tokens=1), "1"),
        # Case and surrounding blanks are forgiven.
        (" AUTO:12 ", None, Scope("auto", window=12), "auto:12"),
        ("Full", None, Scope("full"), "full"),
    ],
)
def test_parse_and_format(spec: str, window: int | None, expected: Scope, canonical: str) -> None:
    scope = parse_scope(spec, window)
    assert scope == expected
    assert format_scope(scope) == canonical
    assert parse_scope(canonical) == scope


@pytest.mark.parametrize(
    "spec",
    [
        "",  # nothing
        "x",  # unknown word
        "on",  # not a scope
        "0",  # N must be positive
        "-5",  # no sign
        "+5",  # no sign either
        "1.5",  # not an integer
        "1_000",  # no digit separators
        "auto:",  # auto: needs its N
        "auto:0",  # window must be positive
        "auto:x",  # window must be an integer
        "auto:-3",  # no sign
        "full:3",  # only auto takes :N
        "off:1",
        "5:3",  # a fixed N takes no suffix
        "auto:3:4",  # one suffix only
        "auto 3",  # colon, not blank
    ],
)
def test_invalid_spec_says_what_is_allowed(spec: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_scope(spec)
    assert str(err.value) == (
        f"invalid prefix cache scope {spec!r}: use off, full, auto, auto:N or N "
        "(N a positive integer)"
    )


@pytest.mark.parametrize(
    ("spec", "window", "message"),
    [
        # A window only makes sense for auto.
        ("full", 5, "only applies to auto"),
        ("off", 5, "only applies to auto"),
        ("4096", 5, "only applies to auto"),
        # And it must be positive.
        ("auto", 0, "invalid prefix cache window 0: use a positive integer"),
        ("auto:8", -1, "invalid prefix cache window -1: use a positive integer"),
    ],
)
def test_invalid_window(spec: str, window: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_scope(spec, window)
