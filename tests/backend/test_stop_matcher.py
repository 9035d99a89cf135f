"""Incremental detokenization: token pieces are bytes; text comes out whole characters only, and
stop strings are held back until they are ruled out or matched."""

from __future__ import annotations

import pytest

from backend.stops import StopMatcher


def run(pieces: list[bytes], stops: list[str]) -> tuple[list[str], str | None, str]:
    m = StopMatcher(stops)
    out: list[str] = []
    hit: str | None = None
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit is not None:
            break
    return out, hit, m.flush() if hit is None else ""


CASES = [
    # a 2-byte character split across two tokens: nothing, then the whole character
    ([b"caf", b"\xc3", b"\xa9!"], [], ["caf", "", "é!"], None, ""),
    # a 4-byte emoji split in three pieces
    ([b"\xf0\x9f", b"\x98", b"\x80 ok"], [], ["", "", "😀 ok"], None, ""),
    # a stop string inside one piece: text before it, then stop
    ([b"Hello\nUser: hi"], ["\nUser:"], ["Hello"], "\nUser:", ""),
    # a stop string across pieces: its prefix is held back, then dropped on the match
    ([b"Hello\nUs", b"er: hi"], ["\nUser:"], ["Hello", ""], "\nUser:", ""),
    # a held-back prefix that turns out not to be a stop string is released
    ([b"Hello\nUs", b"ually"], ["\nUser:"], ["Hello", "\nUsually"], None, ""),
    # held back at the end of generation: flushed
    ([b"end\nUs"], ["\nUser:"], ["end"], None, "\nUs"),
    # a truncated character at the very end becomes U+FFFD rather than vanishing
    ([b"x\xc3"], [], ["x"], None, "\ufffd"),
    # several stops match: the earliest wins, and of two starting there the longest
    ([b"a. b!"], ["!", "."], ["a"], ".", ""),
    ([b"ab\n\nc"], ["\n", "\n\n"], ["ab"], "\n\n", ""),
]


@pytest.mark.parametrize("pieces,stops,texts,hit,tail", CASES)
def test_stop_matcher(pieces: list[bytes], stops: list[str], texts: list[str], hit: str | None,
                      tail: str) -> None:
    assert run(pieces, stops) == (texts, hit, tail)
