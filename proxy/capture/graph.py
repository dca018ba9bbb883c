"""The per-session capture graph: which turn continues which, found by exact token prefix.

Every turn's prompt+completion is inserted into a radix tree over its token ids, and the turn is a
mark at the point where its sequence ends. Ids are kept as the engine sent them, as JSON digits
each followed by a comma (`151644,8948,`): that text is sliced straight out of the engine's reply,
so the proxy never turns thousands of prompt ids into Python ints, and byte prefixes ending at a
comma are exactly token prefixes. A linear conversation stays one edge that grows in place, so
adding turn 400 costs what adding turn 2 did: one C-level prefix comparison and an append. Shared
prefixes are held once, which keeps memory per turn proportional to its new tokens.

Parents are not stored but derived from the tree when a trace is built: a turn's parent is the
deepest mark on its path at or above the end of its prompt. That is a function of the set of turns
only, so the order in which turns arrived never matters.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Collection
from dataclasses import dataclass, field

from proxy.tokens import SEP


@dataclass(eq=False, slots=True)
class Node:
    """What the graph needs to know about one captured turn."""

    node_id: str
    prompt_len: int  # bytes of token text
    completion_len: int
    has_tools: bool
    started_at: float
    request_key: bytes = b""  # equal for calls with the same messages and tools (retries)
    tokens: int = 0  # prompt + completion tokens
    arrival: int = 0
    edge: _Edge | None = None
    end: int = 0  # byte offset of the sequence's end inside `edge.seg`

    @property
    def order(self) -> tuple[float, int]:
        return (self.started_at, self.arrival)


def _mark_key(node: Node) -> tuple[int, bool, float, int]:
    # At one point, turns with a completion sort first: they may parent an empty-completion turn there.
    return (node.end, node.completion_len == 0, node.started_at, node.arrival)


@dataclass(eq=False, slots=True)
class _Edge:
    seg: bytes | bytearray
    parent: _Edge | None
    children: dict[bytes, _Edge] = field(default_factory=dict)
    marks: list[Node] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Base:
    """The already-captured turn sharing the longest token prefix with a new one (for delta storage)."""

    node_id: str | None
    shared: int  # bytes of token text the two sequences share, ending at a token boundary


class CaptureGraph:
    """All turns of one session, indexed by their exact token sequences."""

    def __init__(self) -> None:
        self._root = _Edge(b"", None)
        self.nodes: dict[str, Node] = {}

    def add(self, node: Node, sequence: bytes) -> Base:
        """Insert a turn whose prompt+completion token text is `sequence`; return its delta base."""
        if node.node_id in self.nodes:
            raise ValueError(f"node {node.node_id} is already in the graph")
        node.arrival = len(self.nodes)
        self.nodes[node.node_id] = node
        edge, depth = self._root, 0
        while True:
            if depth == len(sequence):
                base = self._mark_below(edge, len(edge.seg)) if edge is not self._root else None
                self._mark(edge, len(edge.seg), node)
                return _base(base, sequence, depth)
            key = sequence[depth:depth + 1]
            child = edge.children.get(key)
            if child is None:
                base = self._mark_below(edge, len(edge.seg)) if edge is not self._root else None
                if edge.children or edge is self._root:
                    child = _Edge(bytearray(sequence[depth:]), edge)
                    edge.children[key] = child
                    self._mark(child, len(child.seg), node)
                else:
                    edge.seg += sequence[depth:]  # a leaf grows in place
                    self._mark(edge, len(edge.seg), node)
                return _base(base, sequence, depth)
            if sequence.startswith(child.seg, depth):
                edge, depth = child, depth + len(child.seg)
                continue
            k = _common_prefix(child.seg, sequence, depth)
            base = self._mark_below(child, k)
            if depth + k == len(sequence):
                self._mark(child, k, node)
            else:
                upper = self._split(child, k)
                leaf = _Edge(bytearray(sequence[depth + k:]), upper)
                upper.children[sequence[depth + k:depth + k + 1]] = leaf
                self._mark(leaf, len(leaf.seg), node)
            return _base(base, sequence, depth + k)

    def sequence(self, node_id: str) -> bytes:
        """The turn's prompt+completion token text, rebuilt from the tree."""
        node = self.nodes[node_id]
        assert node.edge is not None
        parts = [bytes(node.edge.seg[:node.end])]
        edge = node.edge.parent
        while edge is not None:
            parts.append(bytes(edge.seg))
            edge = edge.parent
        return b"".join(reversed(parts))

    def parents(self) -> tuple[dict[str, str | None], list[str]]:
        """Each turn's parent (the deepest turn whose sequence prefixes its prompt), and a parents-first order."""
        parents: dict[str, str | None] = {}
        order: list[str] = []
        depths: list[int] = []
        owners: list[str] = []
        todo = [(child, 0, 0) for child in self._root.children.values()]
        while todo:
            edge, start, keep = todo.pop()
            del depths[keep:], owners[keep:]
            for node in edge.marks:
                i = bisect_right(depths, node.prompt_len)
                parents[node.node_id] = owners[i - 1] if i else None
                order.append(node.node_id)
                depths.append(start + node.end)
                owners.append(node.node_id)
            todo.extend((child, start + len(edge.seg), len(depths)) for child in edge.children.values())
        return parents, order

    def roles(self, continued: Collection[str] = ()) -> tuple[dict[str, str | None], dict[str, str]]:
        """Parents and roles: agent, auxiliary (tool-less side paths) or discarded (abandoned retries). (The second
        pass over the texts, `proxy.capture.branches`, marks compaction summaries and gives each turn its branch.)

        A retry is a call whose messages and tools equal an earlier call's. Of a group of retries,
        the ones the agent went on from (a later turn extends them, or was rendered after their
        reply: `continued`) stay agent turns; when the agent went on from none, the newest does.
        A turn the agent continued from is never discarded.
        """
        parents, order = self.parents()
        nodes = self.nodes
        children: dict[str | None, list[str]] = {}
        for node_id in order:
            children.setdefault(parents[node_id], []).append(node_id)
        tools_above: dict[str, bool] = {}
        for node_id in order:
            parent = parents[node_id]
            tools_above[node_id] = nodes[node_id].has_tools or (parent is not None and tools_above[parent])
        tools_below: dict[str, bool] = {}
        for node_id in reversed(order):
            tools_below[node_id] = nodes[node_id].has_tools or any(
                tools_below[c] for c in children.get(node_id, ()))
        uses_tools = any(node.has_tools for node in nodes.values())
        roles = {node_id: "agent" if not uses_tools or tools_above[node_id] or tools_below[node_id]
                 else "auxiliary" for node_id in order}
        retries: dict[bytes, list[str]] = {}
        for node_id in order:
            if roles[node_id] == "agent" and nodes[node_id].request_key:
                retries.setdefault(nodes[node_id].request_key, []).append(node_id)
        for group in retries.values():
            if len(group) < 2:
                continue
            went_on = {n for n in group if n in children or n in continued}
            keep = went_on or {max(group, key=lambda n: nodes[n].order)}
            for node_id in group:
                if node_id not in keep:
                    roles[node_id] = "discarded"
        return parents, roles

    def _mark(self, edge: _Edge, end: int, node: Node) -> None:
        node.edge, node.end = edge, end
        insort(edge.marks, node, key=_mark_key)

    def _mark_below(self, edge: _Edge, offset: int) -> Node:
        """Some turn whose sequence runs through byte `offset` of `edge`."""
        while True:
            i = bisect_right(edge.marks, offset - 1, key=lambda n: n.end)
            if i < len(edge.marks):
                return edge.marks[i]
            edge, offset = next(iter(edge.children.values())), 0

    def _split(self, edge: _Edge, k: int) -> _Edge:
        """Cut `edge` after byte k; the upper part takes the marks that end within it."""
        parent = edge.parent
        assert parent is not None, "the root is never split"
        upper = _Edge(bytes(edge.seg[:k]), parent)
        parent.children[bytes(edge.seg[:1])] = upper
        i = bisect_right(edge.marks, k, key=lambda n: n.end)
        upper.marks, edge.marks = edge.marks[:i], edge.marks[i:]
        for node in upper.marks:
            node.edge = upper
        for node in edge.marks:
            node.end -= k
        edge.seg = edge.seg[k:]
        edge.parent = upper
        upper.children[bytes(edge.seg[:1])] = edge
        return upper


def _base(node: Node | None, sequence: bytes, shared: int) -> Base:
    """The delta base, its shared prefix cut back to the last whole token."""
    return Base(node.node_id if node else None, sequence.rfind(SEP, 0, shared) + 1)


def _common_prefix(seg: bytes | bytearray, sequence: bytes, start: int) -> int:
    """Bytes `seg` shares with `sequence[start:]` (at least one), by bisection over C comparisons."""
    lo, hi = 1, min(len(seg), len(sequence) - start)
    with memoryview(seg) as view:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sequence.startswith(view[:mid], start):
                lo = mid
            else:
                hi = mid - 1
    return lo
