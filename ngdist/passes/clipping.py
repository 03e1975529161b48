"""Gradient clipping in the step graph, after every comm pass and before the optimizer.

``clip_grad_norm=m``: ``norm = sqrt(sum over every gradient of sum(g * g))``; every gradient is
multiplied by ``min(1, m / (norm + 1e-6))``, torch's ``clip_grad_norm_`` (its ``1e-6`` too).
The gradients clipped are those the optimizer nodes read: under ``allreduce`` and ``simple`` the
averaged ones, the same bytes on every rank, so the norm is the global batch's and every rank
clips alike (as DDP followed by ``clip_grad_norm_``); sharded (``shard=``) each rank's slices,
whose sums of squares an AllReduce adds up; under ``local`` this process's. The norm
before clipping is a step output (``ngdist.grad_norm``), which the step's stats report.

``clip_grad_value=v``: every gradient element clamped to ``[-v, v]`` (``clip_grad_value_``),
wherever the optimizer runs.

Refused: ``clip_grad_norm`` under ``ps`` (each shard owner updates its own shard with the
gradients of that shard only, so no rank holds all the gradients whose norm torch clips by) and
under ``pushsum`` (there is no averaged gradient: each rank steps with its own gradient, and a
norm of it would be a different quantity on every rank).
"""
from __future__ import annotations

import logging

import onnx_ir as ir

from ngdist.errors import GraphError, OptionError
from ngdist.ir.domain import DOMAIN, GRAD_NORM, PREVIEW_TRAINING, SHARD_LAYOUT
from ngdist.passes.emit import Emitter
from ngdist.passes.optimizers import OPTIMIZER_OPS, split_optimizer_inputs

logger = logging.getLogger(__name__)

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
NO_GLOBAL_NORM = {
    "ps": "each shard owner updates its own shard with that shard's gradients, so no rank "
          "holds all the gradients whose norm clip_grad_norm_ takes",
    "pushsum": "there is no averaged gradient: every rank steps with its own gradient, whose "
               "norm differs from rank to rank"}


def check_strategy(strategy: str, clip_grad_norm: float | None) -> None:
    """clip_grad_norm under a strategy without an averaged gradient is refused (docstring)."""
    if clip_grad_norm is not None and strategy in NO_GLOBAL_NORM:
        raise OptionError(f"clip_grad_norm cannot run under strategy {strategy!r}: "
                          f"{NO_GLOBAL_NORM[strategy]}; train with strategy='allreduce' or "
                          "'simple', or use clip_grad_value (element-wise)")


def _gradient_uses(graph: ir.Graph) -> tuple[list[ir.Node], list[ir.Value]]:
    """The optimizer nodes and the gradients they read (each once, in order)."""
    nodes = [n for n in graph if n.domain == PREVIEW_TRAINING and n.op_type in OPTIMIZER_OPS]
    grads: dict[int, ir.Value] = {}
    for node in nodes:
        for g in split_optimizer_inputs(node)[2][1]:
            grads.setdefault(id(g), g)
    return nodes, list(grads.values())


def _anchor(graph: ir.Graph, grads: list[ir.Value], optimizers: list[ir.Node]) -> ir.Node:
    """The node after which every gradient exists; optimizer nodes before it move after it."""
    order = {id(n): i for i, n in enumerate(graph)}
    producers = [g.producer() for g in grads if g.producer() is not None]
    if not producers:
        raise GraphError("gradient clipping: the optimizer reads no computed gradient")
    anchor = max(producers, key=lambda n: order[id(n)])
    early = [n for n in optimizers if order[id(n)] < order[id(anchor)]]
    for node in early:  # they read gradients and states only: later is as good
        if any(u.node is not None and order[id(u.node)] <= order[id(anchor)]
               for o in node.outputs for u in o.uses()):
            raise GraphError(f"gradient clipping: optimizer node {node.name!r} runs before the "
                             "last gradient exists and its result is read before that")
    for node in reversed(early):
        graph.remove(node)
        graph.insert_after(anchor, node)
    return anchor


def _over_ranks(graph: ir.Graph, emit: Emitter, total: ir.Value) -> ir.Value:
    """The sum of every rank's ``total`` (an AllReduce after the emitter's last node)."""
    node = ir.Node(DOMAIN, "AllReduce", [total], ir.convenience.convert_attributes(
        {"reduction": "sum", "algorithm": "mpi"}), num_outputs=1, name="ngdist/clip/allreduce")
    graph.insert_after(emit.anchor, node)
    emit.anchor = node
    out = node.outputs[0]
    out.name, out.shape, out.type = "ngdist/clip/squares", total.shape, total.type
    return out


def _replace(optimizers: list[ir.Node], old: ir.Value, new: ir.Value) -> None:
    for node in optimizers:
        for i, value in enumerate(node.inputs):
            if value is old:
                node.replace_input_with(i, new)


class GradientClippingPass(ir.passes.InPlacePass):
    """Clips the gradients every optimizer node reads (module docstring)."""

    def __init__(self, clip_grad_norm: float | None = None,
                 clip_grad_value: float | None = None) -> None:
        super().__init__()
        self.max_norm, self.max_value = clip_grad_norm, clip_grad_value

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.max_norm is None and self.max_value is None:
            return ir.passes.PassResult(model, False)
        graph = model.graph
        optimizers, grads = _gradient_uses(graph)
        if not grads:
            raise GraphError("gradient clipping needs the step's optimizer nodes; this step "
                             "graph has none (an explicit update cannot be clipped here)")
        emit = Emitter(graph, _anchor(graph, grads, optimizers), "ngdist/clip", after=True)
        if self.max_value is not None:
            for g in grads:
                bound = self.max_value
                clipped = emit("Clip", g, emit.scalar(-bound, g), emit.scalar(bound, g))
                clipped.shape, clipped.type = g.shape, g.type
                _replace(optimizers, g, clipped)
        else:
            self._by_norm(graph, emit, optimizers, grads)
        return ir.passes.PassResult(model, True)

    def _by_norm(self, graph: ir.Graph, emit: Emitter, optimizers: list[ir.Node],
                 grads: list[ir.Value]) -> None:
        first = grads[0]
        squares = [emit("CastLike", emit("ReduceSumSquare", g, keepdims=0), first)
                   for g in grads]
        total = squares[0] if len(squares) == 1 else emit("Sum", *squares)
        if SHARD_LAYOUT in graph.metadata_props:  # shard=: each rank holds a slice of each
            total = _over_ranks(graph, emit, total)  # reduced gradient (passes/shard.py)
        norm = emit("Sqrt", total)
        norm.name, norm.shape, norm.type = GRAD_NORM, ir.Shape([]), first.type
        ratio = emit("Div", emit.scalar(self.max_norm, first),
                     emit("Add", norm, emit.scalar(EPS, first)))
        coef = emit("Min", ratio, emit.scalar(1.0, first))
        for g in grads:
            scaled = emit("Mul", g, emit("CastLike", coef, g))
            scaled.shape, scaled.type = g.shape, g.type
            _replace(optimizers, g, scaled)
        graph.outputs.append(norm)
        logger.info("gradients clipped to a global norm of %g over %d gradients",
                    self.max_norm, len(grads))
