"""Stop strings: the text of a stream of generated token pieces, held back while it could still
become a stop string, never splitting a UTF-8 character. Pure: no I/O.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class StopMatcher:
    """Holds back text that could still become a stop string; never splits a UTF-8 character."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string that matched or None). Of several
        matches the earliest wins, the longest among those starting there."""
        buf = self.pending + self.decoder.decode(piece)
        found = [(i, -len(s), s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            cut, _, matched = min(found)
            self.pending = ""
            return buf[:cut], matched
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        out = self.pending + self.decoder.decode(b"", final=True)
        self.pending = ""
        return out
