"""A graph's values renamed by a map wherever they are named: node inputs (with what the
nodes' If/Loop/Scan branches read of the outer graph), node outputs, initializers, and the
graph's inputs, outputs and value_info. The frontends rename after export (state_dict names,
tied weights' aliases, a loss wrapper's prefix, Keras' rank-independent constant names)."""
from __future__ import annotations

from collections.abc import Mapping

import onnx

from ngdist.ir.copies import node_subgraphs


def rename_inputs(node: onnx.NodeProto, names: Mapping[str, str]) -> None:
    """``node``'s inputs, and those of nodes in its subgraphs (which may read outer values),
    renamed by ``names``."""
    for k, name in enumerate(node.input):
        node.input[k] = names.get(name, name)
    for sub in node_subgraphs(node):
        for inner in sub.node:
            rename_inputs(inner, names)


def rename_values(node: onnx.NodeProto, names: Mapping[str, str]) -> None:
    """``rename_inputs``, and ``node``'s outputs renamed by ``names`` too."""
    rename_inputs(node, names)
    node.output[:] = [names.get(o, o) for o in node.output]


def rename_graph(graph: onnx.GraphProto, names: Mapping[str, str]) -> None:
    """Every value of ``graph`` that ``names`` maps, renamed where it is produced, declared or
    read (``rename_values`` for the nodes)."""
    if not names:
        return
    for node in graph.node:
        rename_values(node, names)
    for t in graph.initializer:
        t.name = names.get(t.name, t.name)
    for info in [*graph.input, *graph.output, *graph.value_info]:
        info.name = names.get(info.name, info.name)
