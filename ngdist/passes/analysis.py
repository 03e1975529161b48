"""Finds the (parameter, gradient) pairs of a step graph.

Two forms are recognised: an optimizer node of ``ai.onnx.preview.training`` (its X and G inputs
pair up by position), and, for graphs whose backward pass is already explicit, a value named
``<param>.grad`` (the name ngdist's autodiff gives, and the convention for hand-written graphs).
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from ngdist.errors import GraphError
from ngdist.ir.domain import PREVIEW_TRAINING, is_comm_node
from ngdist.ir.model import get_meta
from ngdist.passes.optimizers import OPTIMIZER_OPS, split_optimizer_inputs


@dataclass
class GradPair:
    param: str
    grad: ir.Value


def find_grad_pairs(model: ir.Model) -> list[GradPair]:
    graph = model.graph
    meta = get_meta(model)
    pairs: dict[str, GradPair] = {}
    for node in graph:
        if node.domain == PREVIEW_TRAINING and node.op_type in OPTIMIZER_OPS:
            _, _, groups = split_optimizer_inputs(node)
            for x, g in zip(groups[0], groups[1]):
                pairs[x.name] = GradPair(x.name, g)
    by_name = {o.name: o for n in graph for o in n.outputs}
    for p in meta.names("param"):
        if p not in pairs and f"{p}.grad" in by_name:
            pairs[p] = GradPair(p, by_name[f"{p}.grad"])
    missing = [p for p in meta.names("param") if p not in pairs]
    if missing:
        raise GraphError(f"cannot find the gradients of parameters {missing}: the step graph has "
                         "no optimizer op consuming them and no value named '<param>.grad'")
    return list(pairs.values())


def comm_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if is_comm_node(n.domain, n.op_type)]


def nbytes(value: ir.Value) -> int | None:
    if value.shape is None or value.dtype is None or not value.shape.is_static():
        return None
    size = 1
    for d in value.shape.dims:
        size *= int(d)
    return size * value.dtype.itemsize
