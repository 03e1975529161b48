"""The runtime's own graph rewrites, as onnx_ir passes under a PassManager of their own.

The compiler's passes (ngdist/passes) make the step graph; these adapt it to how this process
runs it, and never change what it computes. Every rank holds the same graph and runs the same
rewrites, so every rank keeps the same comm nodes:

* ``RemoveUnusedNodesPass`` (onnx_ir's): nodes no step output depends on (a second head, a
  metric nobody returns) would only cost time in a segment;
* :class:`InlineAloneIdentities`: on a group of one rank, comm ops that are the identity
  there become ``Identity`` nodes (one per output), so a one-rank step is not cut into
  segments at them.

A second PassManager runs on the model of every CPU session (:func:`session_rewrites`, from
``make_session``), where the inputs' shapes are known: :class:`~ngdist.runtime.blocked_conv.
BlockConvs` moves convolutions to onnxruntime's blocked-channel kernels. A model given as
bytes (the replicas' towers) is rewritten exactly as the same model given as a proto.

:func:`shapes_first` orders a large session graph's shape computations (``Shape``, ``Size``,
``Constant`` and what is computed from them and integer constants alone) right after what they
read. onnxruntime sorts a graph's nodes at every stage of a session's initialisation with a
priority list that takes ``Shape`` first and keeps each ready node in a linked list, so a shape
computation placed far after its inputs (an exporter's, or a gradient rule's) waits in that
list through the whole graph; the sessions of large graphs are made in about half the time
with their shape computations first (docs/benchmarks.md, "Compile time"). Only deterministic
nodes whose outputs are no larger than their inputs move (not ``ConstantOfShape``, ``Expand``,
``Range``, ..., which would hold a tensor of a data size longer), and only in graphs without
random ops, so every value and every draw is the same.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ngdist.ir.copies import node_subgraphs
from ngdist.ir.domain import DOMAIN, comm_attributes
from ngdist.kernels import get_kernel
from ngdist.runtime import blocked_conv

logger = logging.getLogger(__name__)


class InlineAloneIdentities(ir.passes.InPlacePass):
    """Comm nodes whose kernel is the identity on one rank (``alone_identity``) become one
    ``Identity`` node per output, with the output's name."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        alone = [n for n in graph if n.domain == DOMAIN and
                 get_kernel(n.op_type).alone_identity(comm_attributes(n))]
        for n in alone:
            nodes = [ir.node("Identity", [x], name=f"{n.name}/{k}")
                     for k, x in enumerate(n.inputs)]
            ir.convenience.replace_nodes_and_values(
                graph, n, [n], nodes, list(n.outputs), [m.outputs[0] for m in nodes])
        return ir.passes.PassResult(model, modified=bool(alone))


def _run(passes: Sequence[ir.passes.PassBase], model: onnx.ModelProto
         ) -> onnx.ModelProto | None:
    """``model`` through a PassManager of ``passes``; None when no pass changes it."""
    step = ir.from_proto(model)
    before = len(step.graph)
    result = ir.passes.PassManager(passes)(step)
    if not result.modified:
        return None
    logger.info("runtime rewrites %s: %d -> %d nodes", [type(p).__name__ for p in passes],
                before, len(result.model.graph))
    return ir.to_proto(result.model)


def runtime_rewrites(model: onnx.ModelProto, group_size: int,
                     inline_alone: bool = True) -> onnx.ModelProto:
    """``model`` rewritten for running on a group of ``group_size`` ranks (see the module
    docstring); ``model`` itself when no pass changes it."""
    inline = group_size == 1 and inline_alone
    if not _has_unused(model) and not (inline and any(n.domain == DOMAIN
                                                      for n in model.graph.node)):
        return model  # (no onnx_ir round trip: seconds on a graph of thousands of nodes)
    passes: list[ir.passes.PassBase] = [RemoveUnusedNodesPass()]
    if inline:
        passes.append(InlineAloneIdentities())
    return _run(passes, model) or model


def _has_unused(model: onnx.ModelProto) -> bool:
    """Whether ``RemoveUnusedNodesPass`` finds something to remove, read from the proto: a
    node (also in a subgraph) none of whose outputs is read or a graph's output, an
    initializer nothing reads, or a model-local function."""
    graphs, nodes, subgraphs = [model.graph], [], []
    while graphs:
        graph = graphs.pop()
        nodes += graph.node
        subs = [sub for n in graph.node for sub in node_subgraphs(n)]
        subgraphs += subs
        graphs += subs
    used = {i for n in nodes for i in n.input} | {o.name for o in model.graph.output}
    used.update(o.name for sub in subgraphs for o in sub.output)
    used.discard("")  # (an optional input left out)
    inputs = {i.name for i in model.graph.input}
    return bool(model.functions) or any(not used.intersection(n.output) for n in nodes) or \
        any(t.name not in used and t.name not in inputs for t in model.graph.initializer)


SHAPES_FIRST_MIN_NODES = 4000  # smaller graphs go to sessions in their own order
# a graph holding one of these keeps its order (draws follow the order of execution)
_RANDOM = {"RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike",
           "Multinomial", "Bernoulli", "Dropout"}
# outputs sized by an input's values, not its size: these stay where they are
_GROWS = {"ConstantOfShape", "Expand", "Range", "Tile", "OneHot", "Pad", "Resize", "Upsample",
          "EyeLike", "CenterCropPad", "Col2Im", "Loop", "Scan", "If"}


def shapes_first(graph: onnx.GraphProto) -> list[int] | None:
    """The order (indices into ``graph.node``) that puts each shape computation right after the
    last node it reads (see the module docstring); None where nothing moves: a graph of at
    most ``SHAPES_FIRST_MIN_NODES`` nodes, or one with a random op (also in a subgraph)."""
    nodes = graph.node
    if len(nodes) <= SHAPES_FIRST_MIN_NODES or _has_random(graph):
        return None
    inputs = {i.name for i in graph.input}
    shapes = {t.name for t in graph.initializer if t.name not in inputs
              and t.data_type not in _FLOATS}
    producer: dict[str, int] = {}
    place: list[int] = []
    for k, node in enumerate(nodes):
        read = [x for x in node.input if x]
        moves = node.domain in ("", "ai.onnx") and node.op_type not in _RANDOM | _GROWS and \
            not any(a.type in _SUBGRAPHS for a in node.attribute) and \
            (node.op_type in ("Shape", "Size", "Constant") or all(x in shapes for x in read))
        if moves:
            shapes.update(o for o in node.output if o)
        place.append(max((place[producer[x]] for x in read if x in producer), default=-1)
                     if moves else k)
        producer.update((o, k) for o in node.output if o)
    order = sorted(range(len(nodes)), key=lambda k: (place[k], k))
    return None if order == list(range(len(nodes))) else order


_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
           onnx.TensorProto.BFLOAT16}
_SUBGRAPHS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _has_random(graph: onnx.GraphProto) -> bool:
    for node in graph.node:
        if node.op_type in _RANDOM:
            return True
        if any(_has_random(g) for g in node_subgraphs(node)):
            return True
    return False


def session_bytes(model: onnx.ModelProto) -> bytes:
    """``model``'s bytes for a session, its nodes in :func:`shapes_first` order (``model``
    itself is left as it was)."""
    order = shapes_first(model.graph)
    if order is None:
        return model.SerializeToString()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes[k] for k in order)
    try:
        return model.SerializeToString()
    finally:
        del model.graph.node[:]
        model.graph.node.extend(nodes)


def session_rewrites(model: onnx.ModelProto | bytes, block: Callable[[], int],
                     shapes: Mapping[str, Sequence[int]] | None = None
                     ) -> onnx.ModelProto | bytes:
    """``model`` rewritten for a CPU session (see the module docstring), a proto or bytes
    alike; ``model`` itself when no pass changes it. ``block``: the CPU's NCHWc block size
    (asked only for a model with convolutions); ``shapes``: static shapes of inputs the model
    leaves open."""
    proto = onnx.load_from_string(model) if isinstance(model, bytes) else model
    if not any(n.op_type in ("Conv", "ConvTranspose") for n in proto.graph.node) or \
            not blocked_conv.applies(proto, size := block(), shapes):
        return model
    return _run([blocked_conv.BlockConvs(size, shapes)], proto) or model
