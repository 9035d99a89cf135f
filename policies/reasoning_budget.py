"""A reasoning budget: at most N tokens inside a reasoning block, then its end is forced, as
llama.cpp's reasoning-budget sampler does it (common/reasoning-budget.cpp; llama-server's
`--reasoning-budget N`, a request's `reasoning_budget_tokens`, Anthropic's
`thinking.budget_tokens`).

    Budget.of(tokens, start, ends, forced) -> a machine
    b.prefill(token, complete)  each token of the generation prompt, first
    b.forced_token -> the token the next draw must take, or None
    b.accept(token, complete)   each token drawn (`complete`: its text ends a UTF-8 character,
                                `utf8_complete(piece)`)

States, as llama.cpp's:
- **idle** until `start` (the tokens of the opening tag, `<think>`) is generated;
- **counting** the reasoning's tokens: an end sequence (`</think>`) generated ends it (**done**);
  the `tokens`-th token since the start exhausts it: then **forcing** at once, or first
  **waiting** for a token that completes a UTF-8 character (a token may hold part of one);
- **forcing** `forced` (the budget message's tokens, if any, then the closing tag's), one draw
  each, whatever the logits say; then **done**;
- **done**: passthrough; a new `start` re-arms it with a fresh budget (models that reason in
  several blocks).

The generation prompt's tokens are fed first, as llama.cpp's sampler is fed them: a template
that opens the block there (`<think>\n`) starts it counting, and its tokens after the tag count
against the budget. One deliberate difference: a prompt token never stands for a forced one.
llama.cpp advances the forced sequence on the prompt's tokens too, so where the budget is spent
inside the generation prompt (0, with `\n` after the tag) it forces the closing tag's tail, or
nothing where the tag is one token (Qwen3.5: the model then reasons without a limit); here the
closing tag is forced whole. Sequences are matched on the tokens seen, each match starting
afresh after the last (llama.cpp's matcher resets on a match).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

IDLE, COUNTING, WAITING, FORCING, DONE = "idle", "counting", "waiting", "forcing", "done"


@dataclass(slots=True)
class _Matcher:
    """Which of `seqs` the tokens since the last match end with (the longest)."""

    seqs: tuple[tuple[int, ...], ...]
    tail: list[int] = field(default_factory=list)
    longest: int = field(init=False)

    def __post_init__(self) -> None:
        self.longest = max((len(s) for s in self.seqs), default=0)

    def advance(self, token: int) -> int:
        """The index of the longest sequence the tokens seen now end with, else -1."""
        self.tail.append(token)
        del self.tail[:-self.longest or len(self.tail)]
        best = -1
        for i, s in enumerate(self.seqs):
            if s and len(s) <= len(self.tail) and tuple(self.tail[-len(s):]) == s and (
                    best < 0 or len(s) > len(self.seqs[best])):
                best = i
        if best >= 0:
            self.tail.clear()
        return best

    def reset(self) -> None:
        self.tail.clear()


@dataclass(slots=True)
class Budget:
    tokens: int  # the most reasoning tokens (0: end at once)
    start: tuple[int, ...]  # the opening tag's tokens
    ends: tuple[tuple[int, ...], ...]  # sequences that end the block (the closing tag's)
    forced: tuple[int, ...]  # what is forced when the budget is spent
    state: str = IDLE
    remaining: int = 0
    pos: int = 0  # the next of `forced`
    _starts: _Matcher = field(init=False)
    _ends: _Matcher = field(init=False)

    def __post_init__(self) -> None:
        self._starts = _Matcher((self.start,))
        self._ends = _Matcher(self.ends)

    @classmethod
    def of(cls, tokens: int, start: Sequence[int], ends: Sequence[Sequence[int]],
           forced: Sequence[int]) -> Budget:
        return cls(tokens, tuple(start), tuple(tuple(e) for e in ends if e), tuple(forced))

    def prefill(self, token: int, complete: bool = True) -> None:
        """A token of the generation prompt: as a drawn one, except that it never stands for a
        forced one (the module docstring)."""
        if self.state != FORCING:
            self.accept(token, complete)

    def _arm(self) -> None:
        self.remaining = self.tokens
        self._ends.reset()
        self.state = COUNTING
        if self.remaining <= 0:
            self._force()

    def _force(self) -> None:
        self.state, self.pos = FORCING, 0
        self._ends.reset()
        if not self.forced:
            self.state = DONE

    @property
    def forced_token(self) -> int | None:
        """The token the next draw must take (while forcing), else None."""
        return self.forced[self.pos] if self.state == FORCING else None

    def accept(self, token: int, complete: bool = True) -> None:
        """`token` was generated; `complete`: its text does not end inside a UTF-8 character."""
        if self.state in (IDLE, DONE):
            if self._starts.advance(token) >= 0:
                self._arm()
        elif self.state in (COUNTING, WAITING):
            if self._ends.advance(token) >= 0:
                self.state = DONE
            elif self.state == WAITING:
                if complete:
                    self._force()
            else:
                self.remaining -= 1
                if self.remaining <= 0:
                    if complete:
                        self._force()
                    else:
                        self.state = WAITING
                        self._ends.reset()
        elif self.state == FORCING:
            self.pos += 1
            if self.pos >= len(self.forced):
                self.state = DONE


def utf8_complete(piece: bytes) -> bool:
    """Whether `piece` does not end inside a UTF-8 character (llama.cpp's
    common_utf8_is_complete)."""
    for i in range(1, min(4, len(piece)) + 1):
        c = piece[-i]
        if c & 0xC0 != 0x80:
            return i >= (4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1)
    return not piece
