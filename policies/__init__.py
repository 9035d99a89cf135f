"""Pure cache and routing decisions: plain data in, a decision out, no I/O, no clock.

- ``scope``: parse and format ``off | full | auto | auto:N | N``.
- ``prefix``: common token prefix length.
- ``radix``: every stored prefix of a prompt, by its token ids.
- ``decide``: the whole decision for one request, as one Plan.
- ``ring``: the recent-prompt ring that ``auto:N`` compares with.
- ``plan``: anchor, scope boundary, save points.
- ``eviction``: keep-value key functions and the deletion order under a byte budget.
- ``router``: which worker runs (or queues) a prompt.
"""
