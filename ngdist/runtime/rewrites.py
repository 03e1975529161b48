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
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

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
        subs = [sub for n in graph.node for a in n.attribute
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]
        subgraphs += subs
        graphs += subs
    used = {i for n in nodes for i in n.input} | {o.name for o in model.graph.output}
    used.update(o.name for sub in subgraphs for o in sub.output)
    used.discard("")  # (an optional input left out)
    inputs = {i.name for i in model.graph.input}
    return bool(model.functions) or any(not used.intersection(n.output) for n in nodes) or \
        any(t.name not in used and t.name not in inputs for t in model.graph.initializer)


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
