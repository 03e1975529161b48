"""Partitions a step graph into compute segments and comm nodes, in an overlap-friendly order.

Every node gets a *stage*: a compute node's stage is the largest stage among its inputs, where
the output of a comm node of stage s counts as s + 1. Nodes are ordered by (stage, original
position), which keeps the order topological, and the list is cut at each comm node. So a
gradient bucket's AllReduce is issued as soon as its last gradient exists, the rest of the
backward pass runs while it is in flight, and the updates that need its result come after.
With ``defer_comm`` (no overlap: communication runs on the calling thread) the comm nodes of a
stage come after all of its compute instead, so the step has as few segments (and as few
points where the ranks wait for each other) as the graph allows.

With ``updated`` (the step outputs that replace values, such as the new parameters and
optimizer state) the *update* nodes, the elementwise ops, views and constants that lead only
to those outputs, move to the stage of their earliest reader (the last stage when no node
reads them) and come after the other nodes of that stage, and a segment is cut where its
updates begin when a node before them reads one of ``donated`` (the values the step
replaces). So momentum's ``mu * v``, which needs no communicated value, runs with the rest of
the update after the AllReduce, not in a segment of its own before it. The update then runs
after every other reader of a parameter has finished, so it may write the new values into the
old ones' memory (runtime/inplace.py).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import onnx

from ngdist.ir.domain import is_comm_node
from ngdist.runtime.inplace import ELEMENTWISE, VIEWS

# what the update of a step may hold: it runs after every other reader of the parameters
MOVABLE = ELEMENTWISE | VIEWS | {"Constant"}


@dataclass
class Segment:
    """A maximal run of ordinary ONNX nodes, executed by one onnxruntime session."""

    index: int
    nodes: list[onnx.NodeProto]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


@dataclass
class CommCall:
    index: int
    node: onnx.NodeProto


Item = Segment | CommCall


def readers_of(nodes: Sequence[onnx.NodeProto]) -> dict[str, list[int]]:
    """{value: the indices of the nodes that read it} (a node that reads a value twice is
    listed twice): the one readers map of a graph, built once by whoever plans it."""
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for x in n.input:
            readers.setdefault(x, []).append(i)
    return readers


def _updates(nodes: list[onnx.NodeProto], readers: Mapping[str, list[int]],
             updated: frozenset[str], outputs: set[str]) -> list[bool]:
    """Whether each node belongs to the update: an elementwise op, a view or a constant whose
    results are read by update nodes only and are not step outputs, except ``updated`` ones
    (the new values of what the step replaces)."""
    out = [False] * len(nodes)

    def leads_to_update(o: str) -> bool:  # (a reader outside the update would come before it)
        return (o in updated or o not in outputs) and all(out[r] for r in readers.get(o, ()))

    for i in reversed(range(len(nodes))):  # readers come after their producers
        n = nodes[i]
        if n.domain not in ("", "ai.onnx") or n.op_type not in MOVABLE:
            continue
        results = [o for o in n.output if o]
        out[i] = all(leads_to_update(o) for o in results) and \
            any(o in updated or o in readers for o in results)
    return out


def _sink_updates(nodes: list[onnx.NodeProto], readers: Mapping[str, list[int]],
                  stage: list[int], update: list[bool]) -> None:
    """Move each update node to the earliest stage among its readers (all update nodes), or
    to the last stage when only the step's outputs read it (the step counter), so the part of
    the update that needs no communicated value (momentum's ``mu * v``) runs in the same
    segment as the rest of the update. Left in its stage, it came after the other nodes of
    that stage and, without overlap, before its deferred comm nodes: a segment of its own (the
    cut before the update), and a buffer written and read again per value crossing it."""
    last = max(stage, default=0)
    for i in reversed(range(len(nodes))):  # readers first: their stages are final
        if update[i]:
            later = [stage[r] for o in nodes[i].output if o for r in readers.get(o, ())]
            stage[i] = max(stage[i], min(later, default=last))


def plan(graph: onnx.GraphProto, defer_comm: bool = False, updated: frozenset[str] = frozenset(),
         donated: frozenset[str] = frozenset(),
         readers: Mapping[str, list[int]] | None = None) -> list[Item]:
    """The items of ``graph``'s step (see the module docstring); ``readers``: the graph's
    readers map (``readers_of``), when the caller has it."""
    nodes = list(graph.node)
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.output:
            producer[o] = i
    stage = [0] * len(nodes)
    for i, n in enumerate(nodes):
        s = 0
        for name in n.input:
            if name in producer:
                p = producer[name]
                s = max(s, stage[p] + (1 if is_comm_node(nodes[p].domain, nodes[p].op_type) else 0))
        stage[i] = s
    update = [False] * len(nodes)
    if updated:
        readers = readers_of(nodes) if readers is None else readers
        update = _updates(nodes, readers, updated, {o.name for o in graph.output})
        _sink_updates(nodes, readers, stage, update)

    def key(i: int) -> tuple[int, bool, bool, int]:
        late = defer_comm and is_comm_node(nodes[i].domain, nodes[i].op_type)
        return stage[i], late, update[i], i

    order = sorted(range(len(nodes)), key=key)
    items: list[Item] = []
    current: list[onnx.NodeProto] = []
    reads_donated = False  # a node of the current segment, not an update, reads a donated value
    for i in order:
        n = nodes[i]
        if is_comm_node(n.domain, n.op_type):
            if current:
                items.append(Segment(len(items), current))
                current = []
            items.append(CommCall(len(items), n))
            reads_donated = False
            continue
        if update[i] and reads_donated and current:  # the updates begin: cut
            items.append(Segment(len(items), current))
            current = []
        reads_donated = not update[i] and (reads_donated or any(x in donated for x in n.input))
        current.append(n)
    if current:
        items.append(Segment(len(items), current))
    _wire(items, graph)
    return items


def _wire(items: list[Item], graph: onnx.GraphProto) -> None:
    """Fill each segment's inputs (read from outside) and outputs (read later or returned)."""
    needed_later: set[str] = {o.name for o in graph.output}
    for item in reversed(items):
        node_list = item.nodes if isinstance(item, Segment) else [item.node]
        produced = {o for n in node_list for o in n.output if o}
        consumed: list[str] = []
        seen: set[str] = set()
        for n in node_list:
            for i in n.input:
                if i and i not in produced and i not in seen:
                    consumed.append(i)
                    seen.add(i)
        if isinstance(item, Segment):
            item.outputs = [o for n in node_list for o in n.output if o in needed_later]
            item.inputs = consumed
        needed_later |= set(consumed)
