"""Partitions a step graph into compute segments and comm nodes, in an overlap-friendly order.

Every node gets a *stage*: a compute node's stage is the largest stage among its inputs, where
the output of a comm node of stage s counts as s + 1. Nodes are ordered by (stage, original
position), which keeps the order topological, and the list is cut at each comm node. So a
gradient bucket's AllReduce is issued as soon as its last gradient exists, the rest of the
backward pass runs while it is in flight, and the updates that need its result come after.
With ``defer_comm`` (no overlap: communication runs on the calling thread) the comm nodes of a
stage come after all of its compute instead, so the step has as few segments (and as few
points where the ranks wait for each other) as the graph allows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from ngdist.ir.domain import is_comm_node


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


def plan(graph: onnx.GraphProto, defer_comm: bool = False) -> list[Item]:
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
    def key(i: int) -> tuple[int, bool, int]:
        late = defer_comm and is_comm_node(nodes[i].domain, nodes[i].op_type)
        return stage[i], late, i

    order = sorted(range(len(nodes)), key=key)
    items: list[Item] = []
    current: list[onnx.NodeProto] = []
    for i in order:
        n = nodes[i]
        if is_comm_node(n.domain, n.op_type):
            if current:
                items.append(Segment(len(items), current))
                current = []
            items.append(CommCall(len(items), n))
        else:
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
