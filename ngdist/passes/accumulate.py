"""Gradient accumulation: ``accumulate=k`` averages the gradients of k micro-steps locally and
communicates and updates once per k (DDP's ``no_sync``, Horovod's ``backward_passes_per_step``).

Right after autodiff, before any comm pass, every gradient ``g`` of a parameter gets a
zero-initialised accumulator ``ngdist.acc/<param>`` (a state, saved and checkpointed):

* the *micro-step* graph (``model.meta[MICRO_STEP]``, run by runtime/accumulate.py) is the
  forward and backward pass with ``acc <- acc + g`` and nothing else: no comm node, no update
  (BatchNorm running statistics still move, as torch's forward moves them);
* the step graph itself reads ``(acc + g) * ngdist.accumulate_scale`` wherever it read ``g``
  (the AllReduce, then the optimizer) and resets ``acc`` to zeros. The runtime sets the scale
  to 1 / (micro-steps in the window): the update is that of the mean of the micro-batches'
  gradients, i.e. of one step on their concatenation when the loss is a mean over equal
  micro-batches. Clipping (passes/clipping.py) clips that mean.

A loss that is a mean over counted tokens (ignore_index, class weights, a mask;
passes/losscount.py) is, on every micro-step, that micro-step's global batch's mean: the
micro-step graph keeps the one-scalar AllReduce of the count (its only communication), and the
update is that of the mean of the micro-steps' losses, what torch computes with ``loss / k``
on each combined micro-batch (Hugging Face's accumulation); with the same count in every
micro-step, one step on the concatenation.

The optimizer's step count ``ngdist.step`` moves once per update. Refused: reproducible mode
(it already cuts the batch into micro-batches: give it the whole batch), and the ``ps`` and
``pushsum`` strategies, whose per-step exchanges (shard pushes and pulls, the gossip of
parameters) are not built around accumulators yet.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ngdist.errors import GraphError, OptionError
from ngdist.ir.domain import ACCUMULATE_SCALE as SCALE, MICRO_STEP
from ngdist.ir.model import get_meta, set_meta
from ngdist.passes.allreduce import insert_after_producer, reroute
from ngdist.passes.analysis import GradPair, find_grad_pairs
from ngdist.passes.losscount import MARK, GlobalCountPass

logger = logging.getLogger(__name__)

PREFIX = "ngdist.acc/"
UNSUPPORTED = {
    "ps": "its shard owners push and pull every step, with no accumulators in the exchange",
    "pushsum": "its gossip mixes the parameters every step, with no accumulators in it"}


def check_strategy(strategy: str, accumulate: int, reproducible: bool) -> None:
    """The strategies and modes accumulation cannot run with (module docstring)."""
    if accumulate == 1:
        return
    if strategy in UNSUPPORTED:
        raise OptionError(f"accumulate={accumulate} is not supported under strategy "
                          f"{strategy!r}: {UNSUPPORTED[strategy]}; train with 'allreduce', "
                          "'simple' or 'local', or pass a k times larger batch")
    if reproducible:
        raise OptionError(f"accumulate={accumulate} cannot be combined with "
                          "reproducible_micro_batch, which already cuts each batch into "
                          "micro-batches: give it the whole (k times larger) batch instead")


def _accumulator(graph: ir.Graph, pair: GradPair) -> ir.Value:
    """The zero-initialised accumulator of ``pair``'s gradient, a new graph input."""
    param = graph.initializers[pair.param].const_value
    dtype = pair.grad.dtype.numpy() if pair.grad.dtype is not None else param.dtype.numpy()
    shape = tuple(param.shape.numpy())
    acc = ir.Value(name=f"{PREFIX}{pair.param}", shape=ir.Shape(shape),
                   type=ir.TensorType(ir.DataType.from_numpy(np.dtype(dtype))),
                   const_value=ir.tensor(np.zeros(shape, dtype)))
    graph.inputs.append(acc)
    graph.register_initializer(acc)
    return acc


def _node(graph: ir.Graph, after: ir.Value, op: str, inputs: list[ir.Value], name: str,
          **attrs: object) -> ir.Value:
    node = ir.Node("", op, inputs, ir.convenience.convert_attributes(attrs),
                   name=f"ngdist/accumulate/{name}/{op.lower()}")
    node.outputs[0].name = name
    insert_after_producer(graph, after, node)
    return node.outputs[0]


def _micro_step(model: ir.Model) -> ir.Model:
    """The micro-step graph of a copy of ``model`` (module docstring)."""
    micro = ir.from_proto(ir.to_proto(model))
    graph, meta = micro.graph, get_meta(micro)
    values = {v.name: v for n in graph for v in n.outputs}
    values.update((v.name, v) for v in graph.inputs)
    outputs = [values[meta.loss]]
    binding = {b: meta.binding[b] for b in meta.names("buffer") if b in meta.binding}
    outputs += [values[v] for v in binding.values()]
    for pair in find_grad_pairs(micro):
        acc = _accumulator(graph, pair)
        new = _node(graph, pair.grad, "Add", [acc, pair.grad], f"{acc.name}.new")
        new.shape, new.type = acc.shape, acc.type
        outputs.append(new)
        binding[acc.name] = new.name
        meta.roles[acc.name] = "state"
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    meta.binding = binding
    set_meta(micro, meta)
    RemoveUnusedNodesPass()(micro)
    if any(n.metadata_props.get(MARK) for n in graph):  # each micro-step: the global count
        GlobalCountPass()(micro)
    return micro


class GradientAccumulationPass(ir.passes.InPlacePass):
    """Accumulators on every gradient, and the micro-step graph (module docstring). Runs right
    after autodiff."""

    def __init__(self, accumulate: int) -> None:
        super().__init__()
        self.k = accumulate

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.k == 1:
            return ir.passes.PassResult(model, False)
        graph = model.graph
        model.meta[MICRO_STEP] = _micro_step(model)
        meta = get_meta(model)
        pairs = find_grad_pairs(model)
        if not pairs:
            raise GraphError("accumulate needs the step's gradients; this graph has none")
        first = pairs[0].grad
        dtype = first.dtype.numpy() if first.dtype is not None else np.float32
        scale = ir.Value(name=SCALE, shape=ir.Shape([]), type=first.type,
                         const_value=ir.tensor(np.array(1.0 / self.k, dtype)))
        graph.inputs.append(scale)
        graph.register_initializer(scale)
        meta.roles[SCALE] = "hyper"
        for pair in pairs:
            acc = _accumulator(graph, pair)
            total = _node(graph, pair.grad, "Add", [acc, pair.grad], f"{acc.name}.sum")
            mean = _node(graph, total, "Mul", [total, _cast(graph, scale, total)],
                         f"{acc.name}.mean")
            for v in (total, mean):
                v.shape, v.type = pair.grad.shape, pair.grad.type
            reroute(pair.grad, mean, total.producer())
            shape = _node(graph, mean, "Shape", [acc], f"{acc.name}.shape")
            zeros = _node(graph, shape, "ConstantOfShape", [shape], f"{acc.name}.zero",
                          value=ir.tensor(np.zeros(1, acc.dtype.numpy())))
            zeros.shape, zeros.type = acc.shape, acc.type
            graph.outputs.append(zeros)
            meta.binding[acc.name] = zeros.name
            meta.roles[acc.name] = "state"
        set_meta(model, meta)
        logger.info("gradients of %d parameters accumulated over %d micro-steps", len(pairs),
                    self.k)
        return ir.passes.PassResult(model, True)


def _cast(graph: ir.Graph, scale: ir.Value, like: ir.Value) -> ir.Value:
    """``scale`` in ``like``'s dtype (itself when they match)."""
    if like.dtype is None or like.dtype == scale.dtype:
        return scale
    out = _node(graph, like, "CastLike", [scale, like], f"{scale.name}.{like.dtype.name}")
    out.shape = ir.Shape([])
    return out
