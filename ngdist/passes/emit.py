"""Emitter: ordinary ONNX nodes a pass adds at one place of a graph, in the order it makes
them, each named ``<prefix>/<op>_<k>`` (value ``<prefix>/<k>``)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir


class Emitter:
    """Nodes inserted before ``anchor`` (``after=True``: after it, each new node after the
    previous one), in the order they are made."""

    def __init__(self, graph: ir.Graph, anchor: ir.Node, prefix: str, *,
                 after: bool = False) -> None:
        self.graph, self.anchor, self.prefix, self.after, self.k = \
            graph, anchor, prefix, after, 0

    def __call__(self, op: str, *inputs: ir.Value, **attrs: object) -> ir.Value:
        self.k += 1
        node = ir.Node("", op, list(inputs), ir.convenience.convert_attributes(attrs),
                       name=f"{self.prefix}/{op.lower()}_{self.k}")
        node.outputs[0].name = f"{self.prefix}/{self.k}"
        if self.after:
            self.graph.insert_after(self.anchor, node)
            self.anchor = node
        else:
            self.graph.insert_before(self.anchor, node)
        return node.outputs[0]

    def scalar(self, value: float, like: ir.Value) -> ir.Value:
        """A scalar Constant of ``like``'s type (float32 where it has none)."""
        dtype = like.dtype.numpy() if like.dtype is not None else np.float32
        return self("Constant", value=ir.tensor(np.array(value, dtype)))

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self("Constant", value=ir.tensor(np.array(list(values), np.int64)))
