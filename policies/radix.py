"""A radix tree over stored entries' token ids: every stored prefix of a prompt, found by its ids.

After SGLang's early ``radix_cache.py``: nodes hold runs of token ids, not single tokens, as
``TokenIds`` (packed: an insert, a split or a merge copies bytes, never 32K Python ints); a node
that ends exactly where a stored entry ends carries that entry's key. Plain data, no I/O.

Rules:

- ``insert(ids, key)``: the entry holding KV for exactly ``len(ids)`` tokens. A run is split
  where a new entry ends inside it or where ids diverge from it, so every entry sits at a node's
  end. Inserting a key again (at any position) moves it.
- ``match(ids)``: every stored entry that is a prefix of ``ids``, as ``(n_tokens, key)``, longest
  first. Walking compares each node's packed run in place in the prompt's (``bytes.startswith``,
  ids not held as ``TokenIds`` packed once): about one Python step per node on the path.
- ``delete(key)``: the entry goes; a node left with no entry and no child is removed, and a node
  with no entry and one child merges with it, so the tree stays as small as its entries.
- ``ids_of(key)``: the full token ids of an entry (``TokenIds``); ``parent_of(key)``: the
  longest stored entry that is a proper prefix of it (None at the top); ``children_of(key)``:
  the nearest stored entries below it. The index persists each entry as its parent plus the
  ids past the parent, so the tree is rebuilt from LMDB at start.
- ``Forest``: one tree per tenant; tenants never see each other's entries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from policies.prefix import ID_BYTES, TokenIds, common_prefix_len, packed_of


@dataclass(eq=False, slots=True)
class _Node:
    run: TokenIds  # the ids from the parent's end to this node's end
    parent: _Node | None
    depth: int  # tokens from the root to this node's end
    key: bytes | None = None  # the entry stored for exactly `depth` tokens
    children: dict[int, _Node] = field(default_factory=dict)  # first id of the run -> child


class RadixTree:
    def __init__(self) -> None:
        self._root = _Node(TokenIds(), None, 0)
        self._nodes: dict[bytes, _Node] = {}  # key -> its node

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._nodes

    def insert(self, ids: Sequence[int], key: bytes) -> None:
        ids = TokenIds.from_packed(packed_of(ids))  # TokenIds' bytes not copied
        assert ids, "an entry holds at least one token"
        self.delete(key)
        node, pos = self._root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(ids[pos:], node, len(ids))
                node.children[ids[pos]] = leaf
                node = leaf
                break
            m = common_prefix_len(child.run, ids[pos : pos + len(child.run)])
            if m < len(child.run):
                child = self._split(child, m)
            node, pos = child, pos + m
        if node.key is not None and node.key != key:
            del self._nodes[node.key]  # another key for the same tokens: the newer wins
        node.key = key
        self._nodes[key] = node

    def match(self, ids: Sequence[int]) -> list[tuple[int, bytes]]:
        """Every stored prefix of ``ids``: ``(n_tokens, key)``, longest first."""
        packed = packed_of(ids)
        view = memoryview(packed).cast("i")  # ids read in C (a prompt's path: 80+ nodes)
        found: list[tuple[int, bytes]] = []
        node, pos, end = self._root, 0, len(view)
        while pos < end:
            child = node.children.get(view[pos])
            if child is None:
                break
            run = child.run.packed
            if not packed.startswith(run, pos * ID_BYTES):
                break  # the prompt ends or diverges inside this run: no entry there
            node, pos = child, pos + len(run) // ID_BYTES
            if node.key is not None:
                found.append((pos, node.key))
        found.reverse()
        return found

    def delete(self, key: bytes) -> bool:
        node = self._nodes.pop(key, None)
        if node is None:
            return False
        node.key = None
        self._prune(node)
        return True

    def ids_of(self, key: bytes) -> TokenIds:
        node: _Node | None = self._nodes[key]
        runs: list[bytes] = []
        while node is not None:
            runs.append(node.run.packed)
            node = node.parent
        return TokenIds.from_packed(b"".join(reversed(runs)))

    def parent_of(self, key: bytes) -> tuple[int, bytes] | None:
        """The longest stored entry that is a proper prefix of ``key``'s, as (n_tokens, key)."""
        node = self._nodes[key].parent
        while node is not None:
            if node.key is not None:
                return node.depth, node.key
            node = node.parent
        return None

    def children_of(self, key: bytes) -> list[tuple[int, bytes]]:
        """The nearest stored entries below ``key``'s (none stored between), by position."""
        out: list[tuple[int, bytes]] = []
        stack = list(self._nodes[key].children.values())
        while stack:
            node = stack.pop()
            if node.key is not None:
                out.append((node.depth, node.key))
            else:
                stack.extend(node.children.values())
        return sorted(out)

    def keys(self) -> Iterator[bytes]:
        return iter(self._nodes)

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut ``node``'s run after ``m`` ids; the new upper node is returned."""
        assert 0 < m < len(node.run)
        parent = node.parent
        assert parent is not None
        upper = _Node(node.run[:m], parent, node.depth - len(node.run) + m)
        parent.children[upper.run[0]] = upper
        node.run = node.run[m:]
        node.parent = upper
        upper.children[node.run[0]] = node
        return upper

    def _prune(self, node: _Node) -> None:
        while node is not self._root and node.key is None:
            parent = node.parent
            assert parent is not None
            if not node.children:
                del parent.children[node.run[0]]
                node = parent
                continue
            if len(node.children) == 1:  # merge with the only child
                (child,) = node.children.values()
                child.run = node.run + child.run
                child.parent = parent
                parent.children[child.run[0]] = child
            return


class Forest:
    """One RadixTree per tenant ("" when tenant isolation is off)."""

    def __init__(self) -> None:
        self._trees: dict[str, RadixTree] = {}

    def tree(self, tenant: str) -> RadixTree:
        t = self._trees.get(tenant)
        if t is None:
            t = self._trees[tenant] = RadixTree()
        return t

    def match(self, tenant: str, ids: Sequence[int]) -> list[tuple[int, bytes]]:
        t = self._trees.get(tenant)
        return t.match(ids) if t is not None else []

    def __len__(self) -> int:
        return sum(len(t) for t in self._trees.values())
