"""The ``ps`` strategy: the optimizer update moves into a ``ngdist.PSPushPull`` node."""
from __future__ import annotations

import logging

import onnx_ir as ir

from ngdist.errors import GraphError
from ngdist.ir.domain import DOMAIN, PREVIEW_TRAINING
from ngdist.ir.model import IR_VERSION, StepMeta, ensure_opset, get_meta, set_meta
from ngdist.passes.manager import CommInsertionPass
from ngdist.passes.optimizers import (OPTIMIZER_OPS, OptimizerLoweringPass,
                                      split_optimizer_inputs)

logger = logging.getLogger(__name__)

UPDATE_PREFIX = "ngdist.ps."  # names inside the update graph (kept apart from the step's names)


def shard_update_graph(opt: ir.Node, opset: int) -> ir.Graph:
    """The optimizer ``opt`` applied to one flat shard, lowered to ordinary ONNX ops.

    Inputs: ``lr`` (scalar), ``t`` (int64 scalar), ``x``, ``g`` and one tensor per state kind,
    all 1-D of any length ``n``; outputs: the new ``x`` and new states. Every preview optimizer
    is elementwise given ``lr`` and ``t``, so this graph updates any slice of the flattened
    parameters exactly as the whole-model update would.
    """
    r, t, groups = split_optimizer_inputs(opt)
    x0, kinds = groups[0][0], len(groups) - 2

    def value(name: str, like: ir.Value, shape: list) -> ir.Value:
        return ir.Value(name=UPDATE_PREFIX + name, type=ir.TensorType(like.dtype),
                        shape=ir.Shape(shape))

    lr, step = value("lr", r, []), value("t", t, [])
    x, g = value("x", x0, ["n"]), value("g", x0, ["n"])
    states = [value(f"state{i}", x0, ["n"]) for i in range(kinds)]
    attrs = ir.convenience.convert_attributes({k: a.value for k, a in opt.attributes.items()})
    node = ir.Node(PREVIEW_TRAINING, opt.op_type, [lr, step, x, g, *states], attrs,
                   num_outputs=1 + kinds, name="ngdist/ps/update")
    for out, inp in zip(node.outputs, [x, *states]):
        out.name, out.type, out.shape = f"{inp.name}.new", inp.type, inp.shape
    graph = ir.Graph([lr, step, x, g, *states], list(node.outputs), nodes=[node],
                     opset_imports={"": opset, PREVIEW_TRAINING: 1}, name="ngdist_ps_update")
    OptimizerLoweringPass()(ir.Model(graph, ir_version=IR_VERSION))
    return graph


class PSPushPullPass(CommInsertionPass):
    """Replaces the optimizer node (``Momentum`` / ``Adam`` / ``Adagrad`` of
    ai.onnx.preview.training) by one ``ngdist.PSPushPull`` node: Ray SGD's sharded parameter
    servers (and MXNet's ``dist_sync`` KVStore) as a graph rewrite.

    The node takes the learning rate, the step count, the parameters, their gradients and the
    optimizer state, and gives the updated parameters under the optimizer's output names, so
    ``update_binding`` of the parameters is unchanged. The optimizer itself becomes the node's
    ``update`` attribute: a graph that applies it to one flat shard (``shard_update_graph``).
    At run time each shard's owner sums the workers' gradient shards, averages them, runs that
    graph on its slice and serves the result (kernels/ps.py). The optimizer state is read only
    by the owners, once, as the initial value of their slices: its binding is removed, because
    the workers no longer update it. ``grad_shard_bytes`` bounds a shard; ``servers`` > 0 fixes
    the number of dedicated server ranks (0: decided at launch, ``ngdist run --servers K``).
    Requires a graph without comm ops (passes/manager.py).
    """

    def __init__(self, grad_shard_bytes: int = 10_000_000, servers: int = 0) -> None:
        super().__init__()
        if servers < 0:
            raise GraphError(f"servers must be >= 0, got {servers}")
        self.grad_shard_bytes = int(grad_shard_bytes)
        self.servers = int(servers)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opts = [n for n in graph if n.domain == PREVIEW_TRAINING and n.op_type in OPTIMIZER_OPS]
        if not opts:
            raise GraphError("the ps strategy moves the optimizer to the parameter servers, but "
                             "the step graph has no ai.onnx.preview.training optimizer node "
                             "(Momentum, Adam, Adagrad); build it with ngdist.compile(..., "
                             "optimizer=...)")
        if len(opts) > 1:
            raise GraphError(f"the ps strategy supports one optimizer node; the step graph has "
                             f"{len(opts)}: {[n.name for n in opts]}")
        (opt,) = opts
        r, t, groups = split_optimizer_inputs(opt)
        xs, gs, states = groups[0], groups[1], [s for group in groups[2:] for s in group]
        dtypes = sorted({str(x.dtype) for x in xs})
        if len(dtypes) != 1:
            raise GraphError(f"the ps strategy shards one flat buffer, so all parameters need one "
                             f"element type; they have {dtypes}")
        update = shard_update_graph(opt, model.opset_imports.get("", 18))
        attrs = {"grad_shard_bytes": self.grad_shard_bytes, "servers": self.servers,
                 "update": update}
        node = ir.Node(DOMAIN, "PSPushPull", [r, t, *xs, *gs, *states],
                       ir.convenience.convert_attributes(attrs), num_outputs=len(xs),
                       name="ngdist/ps")
        graph.insert_before(opt, node)
        n = len(xs)
        for old, new in zip(opt.outputs[:n], node.outputs):
            name = old.name
            new.shape, new.type = old.shape, old.type
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            old.name = f"{name}.replaced"
            new.name = name
        dropped = {o.name for o in opt.outputs[n:]}
        users = [o.name for o in opt.outputs[n:] if o.uses()]
        if users:
            raise GraphError(f"optimizer state outputs {users} are read inside the step graph; "
                             "the ps strategy keeps optimizer state on the shard owners only")
        for i in reversed(range(len(graph.outputs))):
            if graph.outputs[i].name in dropped:
                graph.outputs.pop(i)
        graph.remove(opt, safe=True)
        meta = get_meta(model)
        binding = {k: v for k, v in meta.binding.items() if v not in dropped}
        set_meta(model, StepMeta(meta.roles, binding, meta.loss))
        if not any(nd.domain == PREVIEW_TRAINING for nd in graph):
            model.opset_imports.pop(PREVIEW_TRAINING, None)
            graph.opset_imports.pop(PREVIEW_TRAINING, None)
        ensure_opset(model, DOMAIN)
        logger.info("ps: %s over %d parameter(s) -> ngdist.PSPushPull (grad_shard_bytes=%d, "
                    "servers=%s)", opt.op_type, n, self.grad_shard_bytes,
                    self.servers or "at launch")
        return ir.passes.PassResult(model, True)
