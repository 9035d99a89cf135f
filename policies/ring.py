"""The recent-prompt ring: the token ids of the last prompts, most recent first, per tenant.

Rules:

- The ring holds at most ``capacity`` prompts (default 256) in total, across all tenants: memory
  is bounded by ``capacity`` times the longest prompt, however many tenants there are. Pushing
  into a full ring drops the oldest prompt of any tenant.
- ``recent(tenant, n)`` returns up to ``n`` of that tenant's prompts, most recent first; other
  tenants' prompts are never compared with (isolation), they only share the capacity.
- A pushed prompt is stored as a tuple or ``TokenIds`` (a list is copied, so later changes to it
  do not leak in; the others are kept as they are), so ``common_prefix_len`` compares it
  without converting.

``auto:N`` reads the first N entries of ``recent`` before the current prompt is pushed, so a
prompt is never compared with itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from policies.prefix import frozen

DEFAULT_CAPACITY = 256


class Ring:
    """Bounded, most-recent-first store of prompt token ids, shared by all tenants."""

    __slots__ = ("capacity", "_entries")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"ring capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        # Most recent at the left; the deque drops from the right when full.
        self._entries: deque[tuple[str, Sequence[int]]] = deque(maxlen=capacity)

    def push(self, tenant: str, ids: Sequence[int]) -> None:
        """Record ``ids`` as ``tenant``'s most recent prompt."""
        self._entries.appendleft((tenant, frozen(ids)))

    def recent(self, tenant: str, n: int) -> list[Sequence[int]]:
        """Up to ``n`` of ``tenant``'s prompts, most recent first."""
        out: list[Sequence[int]] = []
        if n <= 0:
            return out
        for owner, ids in self._entries:
            if owner == tenant:
                out.append(ids)
                if len(out) == n:
                    break
        return out

    def __len__(self) -> int:
        return len(self._entries)
