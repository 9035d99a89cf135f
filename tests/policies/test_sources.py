"""policies.sources.choose_start: which state a prompt starts from, for the proxy's decide() and
the worker alike. Exact tables."""

from __future__ import annotations

import pytest

from policies.costs import Costs
from policies.sources import Candidate, Start, choose_start


def costs(prefill_s_per_token: float, **per_byte: float) -> Costs:
    """Costs measured as: a flat prefill rate, and each source's restore rate (s per byte)."""
    c = Costs()
    for _ in range(3):
        c = c.add_prefill(0, 1000, 1000 * prefill_s_per_token)
        c = c.add_prefill(0, 2000, 2000 * prefill_s_per_token)
        for source, rate in per_byte.items():
            c = c.add_restore(source, 1_000_000, 1_000_000 * rate)  # type: ignore[arg-type]
            c = c.add_restore(source, 2_000_000, 2_000_000 * rate)  # type: ignore[arg-type]
    return c


RAM = Candidate("ram", 512, True, 1_000_000, ref=7)
DISK = Candidate("disk", 512, True, 1_000_000, ref=-1)
CUT = Candidate("queued", 512, False, 1_000_000, ref=3)  # goes on past 512: cut back
SLOT = Candidate("slot", 768, False, 1_000_000, ref=2)
SHARED = Candidate("shared", 1024, True, 1_000_000, ref=-2)
# 1 ms a token; RAM 1 ns a byte, disk 1 us a byte (1 s for a 1 MB state), shared 0.5 us
MEASURED = costs(0.001, ram=1e-9, disk=1e-6, shared=5e-7)

CASES: list[tuple[str, int, list[Candidate], int, bool, Costs | None, Start]] = [
    # (why, keep, candidates, limit, cuts, costs) -> Start
    ("nothing beyond what the live KV keeps", 512, [RAM, DISK], 1000, True, None, Start(())),
    ("the most tokens first", 0, [RAM, SLOT, SHARED], 1000, True, None,
     Start((SHARED, SLOT, RAM))),
    ("a tie: memory before the disk, then a whole state before one cut back", 0,
     [DISK, CUT, RAM], 1000, True, None, Start((RAM, CUT, DISK))),
    ("a tie in memory and whole: the nearer tier", 0,
     [Candidate("ram", 512, True, 10, 1), Candidate("queued", 512, True, 10, 2)], 1000, True,
     None, Start((Candidate("queued", 512, True, 10, 2), Candidate("ram", 512, True, 10, 1)))),
    ("a tie in memory and whole: a held state before another slot's, whose bytes move twice",
     0, [Candidate("slot", 512, True, 10, 1), Candidate("ram", 512, True, 10, 2)], 1000, False,
     None, Start((Candidate("ram", 512, True, 10, 2), Candidate("slot", 512, True, 10, 1)))),
    ("the same tier and length: a whole state before one cut back", 0,
     [Candidate("ram", 512, False, 10, 1), Candidate("ram", 512, True, 10, 2)], 1000, True,
     None, Start((Candidate("ram", 512, True, 10, 2), Candidate("ram", 512, False, 10, 1)))),
    ("held to the limit: an entry past it counts as the limit", 0, [SHARED, SLOT], 700, True,
     None, Start((SLOT, SHARED))),
    ("a memory that cannot be cut back: no state cut back, none past the limit", 0,
     [CUT, SLOT, SHARED, RAM], 700, False, None, Start((RAM,))),
    ("a state no longer than the live KV keeps gives nothing", 768, [SLOT, RAM], 1000, True,
     None, Start(())),
    # rule 3: only where loading beats prefilling the tokens it saves
    ("measured: RAM pays, the disk does not (1 s for 512 tokens of 0.5 s)", 0, [DISK, RAM],
     1000, True, MEASURED, Start((RAM,))),
    ("the longest that does not pay is named", 0, [SHARED, RAM], 1000, True,
     costs(0.001, ram=1e-9, shared=2e-6), Start((RAM,), SHARED)),
    ("a shared pull at its own cost: it pays where the disk's would not", 0, [SHARED, DISK],
     1000, True, MEASURED, Start((SHARED,))),
]


@pytest.mark.parametrize(("why", "keep", "cands", "limit", "cuts", "c", "want"), CASES,
                         ids=[c[0] for c in CASES])
def test_choose_start(why: str, keep: int, cands: list[Candidate], limit: int, cuts: bool,
                      c: Costs | None, want: Start) -> None:
    assert choose_start(keep, cands, limit, cuts, c) == want


def test_another_slots_state_moves_twice() -> None:
    """Copied out of its slot, then into this one: it pays only where twice its bytes load
    faster than the tokens prefill (a RAM-tier entry of the same size pays there)."""
    c = costs(0.001, ram=3e-7)  # 0.3 s per MB loaded; 512 tokens prefill in 0.512 s
    slot = Candidate("slot", 512, False, 1_000_000, ref=1)
    ram = Candidate("ram", 512, True, 1_000_000, ref=2)
    assert choose_start(0, [slot], 1000, True, c) == Start((), slot)
    assert choose_start(0, [ram], 1000, True, c) == Start((ram,))
