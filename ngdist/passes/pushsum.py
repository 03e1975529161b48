"""The ``pushsum`` strategy: Stochastic Gradient Push (Assran et al., ICML 2019)."""
from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ngdist.errors import ArgumentError, GraphError
from ngdist.ir.domain import DOMAIN, PREVIEW_TRAINING
from ngdist.ir.model import StepMeta, ensure_opset, get_meta, set_meta
from ngdist.passes.optimizers import OPTIMIZER_OPS
from ngdist.passes.manager import CommInsertionPass

logger = logging.getLogger(__name__)

PS_WEIGHT = "ngdist.ps_weight"
GRAPHS = ("exponential", "ring")


class PushSumPass(CommInsertionPass):
    """Rewrites a data-parallel step into one step of Stochastic Gradient Push.

    Each rank holds a push-sum numerator ``x`` (the parameters, unchanged names) and a scalar
    push-sum weight ``w`` (new state input ``ngdist.ps_weight``, initial value 1). The pass

    * adds ``w`` as a ``state`` input with its initializer, bound to its mixed value;
    * inserts ``z = Div(x, w)`` for every parameter and makes every consumer of ``x`` except the
      optimizer read ``z``: forward and backward (autodiff already ran, so the backward nodes
      that read the weight now read ``z`` too) compute the local gradient at the de-biased
      parameters, ``grad f(z)``, while the optimizer updates the numerator ``x`` with it
      (x <- x - lr * grad f(z), momentum and other optimizer state stay local);
    * puts one ``ngdist.PushSum`` node after the optimizer: inputs are the updated parameters
      then ``w``, outputs the mixed parameters then the mixed ``w``; the graph outputs and
      ``update_binding`` now point at the mixed values. No gradient is averaged.

    It must run before OptimizerLoweringPass (the optimizer is still one
    ``ai.onnx.preview.training`` node, which tells the update apart from the forward uses of
    ``x``). Requires a graph without comm ops (passes/manager.py).
    """

    def __init__(self, graph: str = "exponential", peers_per_itr: int = 1,
                 overlap: bool = False, synch_freq: int = 0) -> None:
        super().__init__()
        if graph not in GRAPHS:
            raise ArgumentError(f"unknown gossip graph {graph!r} for pushsum; choose one of "
                             f"{list(GRAPHS)}")
        if int(peers_per_itr) < 1:
            raise ArgumentError(f"peers_per_itr must be at least 1, got {peers_per_itr}")
        if int(synch_freq) < 0:
            raise ArgumentError(f"synch_freq must be >= 0, got {synch_freq}")
        self.graph = graph
        self.peers_per_itr = int(peers_per_itr)
        self.overlap = bool(overlap)
        self.synch_freq = int(synch_freq)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        meta = get_meta(model)
        params = meta.names("param")
        if PS_WEIGHT in meta.roles:
            raise GraphError(f"the step graph already has a value named {PS_WEIGHT!r}")
        optimizers = [n for n in graph
                      if n.domain == PREVIEW_TRAINING and n.op_type in OPTIMIZER_OPS]
        if not optimizers:
            raise GraphError("pushsum needs the optimizer as an ai.onnx.preview.training op "
                             "(Momentum/Adam/Adagrad), i.e. a step graph before optimizer "
                             "lowering; build the training model with ngdist.compile or "
                             "`ngdist rewrite` from the forward model")
        inputs = {v.name: v for v in graph.inputs}
        outputs = {v.name: v for v in graph.outputs}
        missing = [p for p in params if p not in inputs or meta.binding.get(p) not in outputs]
        if missing:
            raise GraphError(f"parameters {missing} are not step inputs bound to step outputs")
        xs = [inputs[p] for p in params]
        news = [outputs[meta.binding[p]] for p in params]
        order = {id(n): i for i, n in enumerate(graph)}
        producers = [v.producer() for v in news]
        if any(p is None for p in producers):
            raise GraphError("pushsum: a parameter's new value is not computed by the step")

        w = self._add_weight(graph, xs[0])
        self._debias(graph, xs, w, {id(n) for n in optimizers})

        attrs = {"graph": self.graph, "peers_per_itr": self.peers_per_itr,
                 "overlap": int(self.overlap), "synch_freq": self.synch_freq}
        node = ir.Node(DOMAIN, "PushSum", [*news, w], ir.convenience.convert_attributes(attrs),
                       num_outputs=len(news) + 1, name="ngdist/pushsum")
        last = max(producers, key=lambda n: order[id(n)])
        graph.insert_after(last, node)
        binding = dict(meta.binding)
        for p, x, old, new in zip(params, xs, news, node.outputs):
            new.name, new.shape, new.type = f"{p}.mixed", x.shape, x.type
            for i, out in enumerate(graph.outputs):
                if out is old:
                    graph.outputs[i] = new
            binding[p] = new.name
        w_mixed = node.outputs[-1]
        w_mixed.name, w_mixed.shape, w_mixed.type = f"{PS_WEIGHT}.mixed", w.shape, w.type
        graph.outputs.append(w_mixed)
        binding[PS_WEIGHT] = w_mixed.name
        set_meta(model, StepMeta({**meta.roles, PS_WEIGHT: "state"}, binding, meta.loss))
        ensure_opset(model, DOMAIN)
        logger.info("pushsum: %d parameters gossiped (%s graph, %d peer(s)/iteration, "
                    "overlap=%s, synch_freq=%d)", len(params), self.graph, self.peers_per_itr,
                    self.overlap, self.synch_freq)
        return ir.passes.PassResult(model, True)

    @staticmethod
    def _debias(graph: ir.Graph, xs: list[ir.Value], w: ir.Value, opt_ids: set[int]) -> None:
        """Every reader of a parameter but its optimizer reads it divided by the push-sum
        weight (cast to the parameter's type), computed before the step's first node."""
        first = next(iter(graph))  # new nodes go before it, in the order they are made
        casts: dict[object, ir.Value] = {}
        for x in xs:
            w_like = w
            if x.dtype is not None and x.dtype != w.dtype:
                if x.dtype not in casts:
                    cast = ir.Node("", "CastLike", [w, x], name=f"ngdist/pushsum/cast/{x.name}")
                    graph.insert_before(first, cast)
                    casts[x.dtype] = cast.outputs[0]
                    cast.outputs[0].name = f"{PS_WEIGHT}.{x.dtype.name.lower()}"
                w_like = casts[x.dtype]
            div = ir.Node("", "Div", [x, w_like], name=f"ngdist/pushsum/debias/{x.name}")
            z = div.outputs[0]
            z.name, z.shape, z.type = f"{x.name}.debiased", x.shape, x.type
            graph.insert_before(first, div)
            for use in list(x.uses()):
                if use.node is not div and id(use.node) not in opt_ids:
                    use.node.replace_input_with(use.idx, z)

    @staticmethod
    def _add_weight(graph: ir.Graph, like: ir.Value) -> ir.Value:
        dtype = like.dtype or ir.DataType.FLOAT
        value = ir.Value(name=PS_WEIGHT, shape=ir.Shape([]), type=ir.TensorType(dtype),
                         const_value=ir.tensor(np.array(1, dtype=dtype.numpy())))
        graph.inputs.append(value)
        graph.register_initializer(value)
        return value
