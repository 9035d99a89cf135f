"""A slot's live KV as a tier event (`tiers.Tiers.said_live`): what a next request could keep
of it, said when the slot is cut back or replaced (a job starts from what it keeps) and when a
job ends.

The state is the slot's exact tokens (`reusable`: the prompt's, never generated ones) cut back
to the last batch edge of the cold run, since only there can a next prompt keep it; none
("removed") where the slot holds nothing a next request could keep.
"""

from __future__ import annotations

from backend.engine import Engine
from backend.protocol import TierEvent
from backend.worker.core import reusable
from backend.worker.messages import Live


def live_event(engine: Engine, slot: int, owner: tuple[str, bytes]) -> TierEvent:
    q = engine.seqs[slot]
    n, _ = reusable(Live(q.ids, q.n_live, q.exact_n, engine.floor(slot)))
    ids = q.ids[:n].tolist()
    n = engine.batching.edges(ids).floor(n) if n else 0
    tenant, salt = owner
    if n == 0:
        return TierEvent("removed", "live", slot, salt.hex(), tenant, 0)
    return TierEvent("stored", "live", slot, salt.hex(), tenant, n, tuple(ids[:n]))
