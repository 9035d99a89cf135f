"""Incremental detokenization: token pieces are bytes; text comes out whole characters only, and
stop strings are held back until they are ruled out or matched."""

from __future__ import annotations

import pytest

from backend.engine import StopMatcher


def run(pieces: list[bytes], stops: list[str]) -> tuple[list[str], bool, str]:
    m = StopMatcher(stops)
    out, hit = [], False
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            break
    return out, hit, m.flush() if not hit else ""


CASES = [
    # a 2-byte character split across two tokens: nothing, then the whole character
    ([b"caf", b"\xc3", b"\xa9!"], [], ["caf", "", "é!"], False, ""),
    # a 4-byte emoji split in three pieces
    ([b"\xf0\x9f", b"\x98", b"\x80 ok"], [], ["", "", "😀 ok"], False, ""),
    # a stop string inside one piece: text before it, then stop
    ([b"Hello\nUser: hi"], ["\nUser:"], ["Hello"], True, ""),
    # a stop string across pieces: its prefix is held back, then dropped on the match
    ([b"Hello\nUs", b"er: hi"], ["\nUser:"], ["Hello", ""], True, ""),
    # a held-back prefix that turns out not to be a stop string is released
    ([b"Hello\nUs", b"ually"], ["\nUser:"], ["Hello", "\nUsually"], False, ""),
    # held back at the end of generation: flushed
    ([b"end\nUs"], ["\nUser:"], ["end"], False, "\nUs"),
    # a truncated character at the very end becomes U+FFFD rather than vanishing
    ([b"x\xc3"], [], ["x"], False, "\ufffd"),
]


@pytest.mark.parametrize("pieces,stops,texts,hit,tail", CASES)
def test_stop_matcher(pieces: list[bytes], stops: list[str], texts: list[str], hit: bool,
                      tail: str) -> None:
    assert run(pieces, stops) == (texts, hit, tail)
