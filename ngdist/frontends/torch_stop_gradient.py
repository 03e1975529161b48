"""Values torch keeps out of autograd (``.detach()``, ``torch.no_grad()``) in the TorchScript
export: the ONNX exporter drops both (ONNX has no mark for them), and ngdist then gave
gradients where torch gives none (a parameter read only under ``no_grad`` was trained, a
straight-through estimator ``x + (q(x) - x).detach()`` got ``q``'s derivative).

* ``aten::detach`` (``Tensor.detach()``, ``detach_()``) is exported as a custom
  ``ngdist::StopGradient`` node of the input's type (:func:`stop_gradient`), lent for the
  export by ``torch_symbolics.lent_symbolics``;
* ``torch.no_grad()`` (``set_grad_enabled(False)``, ...) regions: while torch traces, every
  switch of grad mode is noted with the traced graph's length (the tracer's own
  ``requires_grad`` of a value is not reliable: ``_convolution``'s output is recorded without
  it); each output of a node traced with grad off that a node traced with grad on reads gets
  an ``aten::detach`` before the exporter's passes run (:func:`no_grad_detached`, around
  torch's ``_create_jit_graph``). Not covered: regions inside an ``autograd.Function``'s
  forward (a reentrant ``torch.utils.checkpoint`` differentiates its no_grad forward again:
  left as is), and in-place ops under ``no_grad`` (their output is the tensor itself);
* after the export, :func:`mark_stop_gradients` turns each ``StopGradient`` into an
  ``Identity`` carrying ``metadata_props[STOP_GRADIENT]``, which the autodiff pass treats as
  a node without gradient (onnxruntime runs it as a plain Identity).

The dynamo exporter (a fallback) marks ``aten.detach`` the same way
(:func:`dynamo_translations`); its graphs keep no trace of ``no_grad``: not covered there.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import onnx

from ngdist.ir.copies import outer_reads
from ngdist.passes.autodiff.driver import STOP_GRADIENT

logger = logging.getLogger(__name__)

DOMAIN = "ngdist"
_MARK = "ngdist_no_grad"  # attribute of the nodes traced under no_grad, while exporting


def stop_gradient(g: Any, x: Any) -> Any:
    """Symbolic of ``aten::detach``: an ``ngdist::StopGradient`` of ``x``'s type."""
    out = g.op(f"{DOMAIN}::StopGradient", x)
    out.setType(x.type())
    return out


def _traced_graph() -> Any:
    """The graph torch's tracer is recording, or None."""
    import torch

    state = torch._C._get_tracing_state()
    return None if state is None else state.graph()


def _in_autograd_function() -> bool:
    """Whether an ``autograd.Function``'s forward is running (a reentrant checkpoint runs its
    forward under no_grad and differentiates it again: its values do carry gradients)."""
    import torch

    code = torch.autograd.Function.__dict__["apply"].__func__.__code__
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _preorder(nodes: Any) -> list[Any]:
    """``nodes`` and, after each, the nodes of its blocks (a traced submodule's forward is one
    node whose block the tracer fills): the order in which the tracer made them."""
    out = []
    for node in nodes:
        out.append(node)
        for block in node.blocks():
            out += _preorder(block.nodes())
    return out


@contextlib.contextmanager
def _no_grad_marked() -> Iterator[None]:
    """While the block runs, each node that torch traces with grad mode off gets the attribute
    ``_MARK`` (every way of turning it off goes through ``torch._C._set_grad_enabled``; node
    attributes, unlike value names, survive the inlining of the traced submodules)."""
    import torch

    setter = torch._C._set_grad_enabled
    start: list[int] = []

    def set_grad(mode: bool) -> None:
        graph = _traced_graph()
        if graph is not None and mode != torch.is_grad_enabled():
            nodes = _preorder(graph.nodes())
            if not mode and not _in_autograd_function():
                start[:] = [len(nodes)]
            elif mode and start:
                for node in nodes[start.pop():]:
                    node.s_(_MARK, "1")
        setter(mode)

    torch._C._set_grad_enabled = set_grad
    try:
        yield
    finally:
        torch._C._set_grad_enabled = setter


def _detach_no_grad_outputs(graph: Any) -> int:
    """Inserts ``aten::detach`` after every tensor output of a node traced under no_grad
    (marked ``_MARK``, the mark then removed) that a node traced with grad reads; returns how
    many. In-place ops (whose output is their input's storage, a parameter's too) are left
    alone."""
    marked = [n for n in _preorder(graph.nodes()) if n.hasAttribute(_MARK)]
    inside = {o.unique() for n in marked for o in n.outputs()}
    added = 0
    for node in marked:
        node.removeAttribute(_MARK)
        if node.kind().endswith("_"):
            continue
        for out in node.outputs():
            if out.type().kind() != "TensorType" or all(
                    any(o.unique() in inside for o in u.user.outputs()) for u in out.uses()):
                continue
            detach = graph.create("aten::detach", [out], 1)
            detach.insertAfter(node)
            detach.output().setType(out.type())
            out.replaceAllUsesAfterNodeWith(detach, detach.output())
            added += 1
    return added


@contextlib.contextmanager
def no_grad_detached() -> Iterator[None]:
    """For the block, torch's TorchScript exporter detaches the values that the traced
    forward computed under ``no_grad`` where a value computed with grad reads them."""
    from torch.onnx._internal.torchscript_exporter import utils

    original = utils._create_jit_graph

    def create(model: Any, args: Any) -> Any:
        with _no_grad_marked():
            made = original(model, args)
        added = _detach_no_grad_outputs(made[0])
        if added:
            logger.info("%d value(s) computed under no_grad read by values computed with "
                        "grad: no gradient through them, as in torch", added)
        return made

    utils._create_jit_graph = create
    try:
        yield
    finally:
        utils._create_jit_graph = original


def _dynamo_detach(x: Any) -> Any:
    """``aten.detach`` for the dynamo exporter (an ONNX Script function it traces)."""
    from onnxscript.values import Opset

    return Opset(DOMAIN, 1).StopGradient(x)


def dynamo_translations() -> dict[Any, Any]:
    """The dynamo exporter's translation of ``aten.detach``: the same ``StopGradient``; its
    schema is registered with onnx once (the exporter checks every op against one)."""
    import torch
    from onnx.defs import OpSchema

    if not onnx.defs.has("StopGradient", DOMAIN):
        types = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"]
        onnx.defs.register_schema(OpSchema(
            "StopGradient", DOMAIN, 1, inputs=[OpSchema.FormalParameter("x", "T")],
            outputs=[OpSchema.FormalParameter("y", "T")], type_constraints=[("T", types, "")]))
    return {torch.ops.aten.detach.default: _dynamo_detach}


def mark_stop_gradients(model: onnx.ModelProto) -> int:
    """Turns every ``ngdist::StopGradient`` node of ``model`` into an Identity marked
    ``STOP_GRADIENT``; returns how many."""
    marked = 0
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == "StopGradient":
            node.domain, node.op_type = "", "Identity"
            entry = node.metadata_props.add()
            entry.key, entry.value = STOP_GRADIENT, "1"
            marked += 1
    if not any(n.domain == DOMAIN for n in model.graph.node):
        kept = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return marked


def gradient_free(model: onnx.ModelProto) -> set[str]:
    """The float initializers of ``model`` from which no differentiable path leads to its first
    output but through marked stop-gradients (every use detached or under no_grad): torch
    leaves their ``.grad`` None, and its optimizers skip them (no weight decay, no momentum).
    Paths through ops without a gradient (Shape, Equal, ...) count as paths: such a parameter
    keeps the zero gradient and the optimizer's own terms, as before."""
    reach = {model.graph.output[0].name}
    for node in reversed(model.graph.node):
        blocked = node.op_type == "Identity" and any(p.key == STOP_GRADIENT
                                                     for p in node.metadata_props)
        if not blocked and any(o in reach for o in node.output):
            reach |= outer_reads(node)
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
              onnx.TensorProto.BFLOAT16}
    free = {t.name for t in model.graph.initializer
            if t.data_type in floats and t.name not in reach}
    if free:
        logger.info("parameters without gradient in torch (read under no_grad or detached "
                    "only), not trained: %s", ", ".join(sorted(free)))
    return free
