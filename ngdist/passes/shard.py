"""Sharded data parallelism (ZeRO stages 1 and 2) as a rewrite of the bucketed step graph."""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ngdist.errors import GraphError, OptionError
from ngdist.ir.domain import DOMAIN, PREVIEW_TRAINING, SHARD_LAYOUT
from ngdist.ir.model import StepMeta, ensure_opset, get_meta, set_meta
from ngdist.passes.autodiff.registry import GradContext, attr
from ngdist.passes.bucketing import reduced_by
from ngdist.passes.optimizers import (OPTIMIZER_OPS, node_state_kinds,
                                      split_optimizer_inputs)
from ngdist.passes.shard_params import (Gathered, bind_update, drop_parameter, insert_gathers,
                                        shard_input)
from ngdist.passes.shard_values import bucket_input, bucket_result, drop_state as _drop_state, \
    gather_params, rank_input as _rank_input, scatter_sum, state_input as _state_input, \
    typed as _typed

if TYPE_CHECKING:
    from ngdist.passes.step_options import StepOptions
    from ngdist.passes.options import AllReduceOptions

logger = logging.getLogger(__name__)

@dataclass
class _Member:
    """One parameter of a shard group: where it sits in its optimizer node."""

    index: int  # position among the node's parameters
    order: int  # position in its bucket's flat buffer
    x: ir.Value
    g: ir.Value
    states: list[ir.Value]


@dataclass
class _Shard:
    """One bucket's rewrite: its parameters in flat order, ``length`` elements padded to
    ranks * ``size``, the ReduceScatter'ed gradient slice, the updated parameter slice and the
    flat states by kind."""

    prefix: str
    members: list[_Member]
    counts: list[int]
    length: int
    size: int
    g_shard: ir.Value
    x_new: ir.Value | None = None
    states: dict[str, str] = field(default_factory=dict)


@dataclass
class _Group:
    """The parameters of one optimizer node whose gradients share one bucket."""

    bucket: ir.Node
    members: list[_Member] = field(default_factory=list)


class ShardingPass(ir.passes.InPlacePass):
    """Rewrites each bucket's ``AllReduce`` and the update of its parameters as ZeRO does.

    Runs after bucketing, before optimizer lowering. For every bucket of gradients (a flat
    buffer of the bucketing pass, or a tensor reduced alone), with ``L`` elements and ``N``
    ranks, ``S = ceil(L / N)``:

        flat g (zero-padded, [N, S]) -> ReduceScatter -> g shard [1, S]
        flat x ([N, S]) -> Slice row r -> x shard                  (r: ``ngdist.shard_rank``)
        optimizer node (x shard, g shard, state shards [1, S]) -> new x shard, new states
        -> AllGather -> each parameter (views of the gathered [N, S], padding dropped)

    (2-D flats: passes/shard_values.py says why.) A bucket with ``compression`` pads its
    float32 gradients, casts them to 16 bits and ReduceScatters those (``scatter_sum``).

    One optimizer node per bucket replaces the original node, with the same attributes (every
    supported update is elementwise, so a slice of the flat buffer updates exactly as its
    elements would in place; padding stays zero). The per-parameter state inputs give way to
    one flat state per bucket and state kind (``<bucket>.<kind>``, ``S`` elements): each rank
    holds 1/N of the optimizer state. ``ngdist.shard_rank`` is a hyper-parameter the runtime
    sets to the rank, so every rank runs the same graph. The layout (which parameter and state
    lies where in which flat state) goes to the graph's ``ngdist.shard_layout`` metadata,
    for the runtime to scatter a full state at start-up and gather it for ``trainer.save``.

    ``level="gradients"`` (ZeRO-2) builds the same graph: the padded bucket's only reader is
    the ReduceScatter, so the executor drops it there (it frees every value after its last
    use), and a rank keeps only the gradient shard from then on; ``"optimizer"`` (ZeRO-1) is
    named for what it promises, and gets this for free. ``level="parameters"`` (ZeRO-3) keeps
    the parameters in flat shards too and gathers them where the step reads them
    (passes/shard_params.py).
    """

    def __init__(self, level: str, ranks: int) -> None:
        super().__init__()
        self.level, self.ranks = level, ranks

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = [n for n in graph if n.domain == PREVIEW_TRAINING and n.op_type in OPTIMIZER_OPS]
        if not nodes:
            raise OptionError("shard= needs the optimizer node of the step graph, which this "
                              "model no longer has (a file written by ngdist rewrite or "
                              "trainer.save is already lowered); compile the forward model "
                              "with loss= and optimizer=")
        meta = get_meta(model)
        rank = _rank_input(graph, meta)
        opset = model.opset_imports.get("", 18)
        layout: list[dict[str, object]] = []
        claimed: dict[int, tuple[ir.Node, set[int]]] = {}  # bucket -> positions now sharded
        taken: set[str] | None = None
        gathered: list[Gathered] = []  # ZeRO-3: the buckets whose parameters stay sharded
        for node in nodes:
            ctx = GradContext(graph, node, opset, taken=taken)
            taken, ctx.current = ctx.taken, node
            groups = _groups(node)
            for group in groups:
                claimed.setdefault(id(group.bucket), (group.bucket, set()))[1].update(
                    m.order for m in group.members)
            shards = [self._scatter(ctx, group, f"{node.name}/shard{i}")
                      for i, group in enumerate(groups)]
            for shard in shards:  # the updates together, then the gathers together
                self._update(ctx, node, shard, self._x_shard(ctx, shard, rank, meta), meta)
            for shard in shards:
                if self.level == "parameters":
                    gathered.append(self._keep_sharded(ctx, node, shard, meta))
                else:
                    self._gather(ctx, node, shard)
                layout.append(self._layout(ctx, node, shard, meta))
            graph.remove(node, safe=True)
        for bucket, orders in claimed.values():
            _keep_the_rest(GradContext(graph, bucket, opset, taken=taken), bucket, orders)
        if gathered:
            count = insert_gathers(graph, gathered, meta.loss, meta)
            logger.info("shard=parameters: %d gathers of %d buckets", count, len(gathered))
        RemoveUnusedNodesPass()(model)  # the buckets' AllReduce, Split and Reshapes
        ensure_opset(model, DOMAIN)
        set_meta(model, meta)
        graph.metadata_props[SHARD_LAYOUT] = json.dumps(
            {"level": self.level, "ranks": self.ranks, "groups": layout})
        logger.info("shard=%s: %d bucket(s) over %d ranks", self.level, len(layout), self.ranks)
        return ir.passes.PassResult(model, True)

    def _scatter(self, ctx: GradContext, group: _Group, prefix: str) -> _Shard:
        """The bucket's flat gradient padded and ReduceScatter'ed where its AllReduce was (as
        soon as its last gradient is ready, overlapping the rest of the backward pass)."""
        members = sorted(group.members, key=lambda m: m.order)
        counts = [_count(m.x) for m in members]
        length = sum(counts)
        size = -(-length // self.ranks)  # shard elements, the bucket padded to ranks * size
        at = GradContext(ctx.graph, group.bucket, ctx.opset, taken=ctx.taken)
        at.current = ctx.current
        g_flat = _padded(at, _flat_gradients(group.bucket, members), length, self.ranks,
                         size)
        g_shard = scatter_sum(at, g_flat, attr(group.bucket, "compression", "none"),
                              f"ngdist/reducescatter/{prefix}")
        return _Shard(prefix, members, counts, length, size, g_shard)

    def _x_shard(self, ctx: GradContext, shard: _Shard, rank: ir.Value, meta: StepMeta
                 ) -> ir.Value:
        """This rank's slice of the bucket's flat parameters: sliced from the whole ones, or
        (ZeRO-3) the flat shard input that holds it between steps."""
        size = shard.size
        if self.level == "parameters":
            return shard_input(ctx.graph, shard.prefix, size, shard.members[0].x.dtype, meta)
        x_full = _padded(ctx, [m.x for m in shard.members], shard.length, self.ranks, size)
        return ctx.op("Slice", x_full, rank, ctx.op("Add", rank, ctx.ints([1])),
                      ctx.ints([0]))

    def _update(self, ctx: GradContext, node: ir.Node, shard: _Shard, x_shard: ir.Value,
                meta: StepMeta) -> None:
        """The optimizer node on this rank's slice of the flat parameters and flat states."""
        size = shard.size
        kinds = node_state_kinds(node)
        shard.states = {k: f"{shard.prefix}.{k}" for k in kinds}
        states = [_state_input(ctx.graph, shard.states[k], size,
                               shard.members[0].states[j].dtype, meta)
                  for j, k in enumerate(kinds)]
        attrs = {k: a.value for k, a in node.attributes.items()}
        outs = ctx.op_multi(node.op_type, node.inputs[0], node.inputs[1], x_shard,
                            shard.g_shard, *states, num_outputs=1 + len(kinds),
                            domain=PREVIEW_TRAINING, **attrs)
        for j, k in enumerate(kinds):
            _typed(outs[1 + j], [1, size], states[j].dtype)
            outs[1 + j].name = f"{shard.states[k]}.new"
            meta.binding[shard.states[k]] = outs[1 + j].name
            ctx.graph.outputs.append(outs[1 + j])
        shard.x_new = outs[0]

    def _keep_sharded(self, ctx: GradContext, node: ir.Node, shard: _Shard, meta: StepMeta
                      ) -> Gathered:
        """ZeRO-3: the updated slice replaces the flat shard input; the parameters' own
        updated outputs dropped (they are gathered where the step reads them)."""
        x_shard = shard.x_new.producer().inputs[2]  # type: ignore[union-attr]
        bind_update(ctx.graph, x_shard, shard.x_new, meta)  # type: ignore[arg-type]
        for m in shard.members:
            drop_parameter(ctx.graph, m.x, node.outputs[m.index], meta)
        params = [m.x for m in shard.members]
        return Gathered(shard.prefix, x_shard, params)  # type: ignore[arg-type]

    def _gather(self, ctx: GradContext, node: ir.Node, shard: _Shard) -> None:
        """AllGather of the updated slices into the parameters (views of its buffer)."""
        def emit(op: str, *inputs: ir.Value, outputs: int = 1, **attrs: object
                 ) -> list[ir.Value]:
            return list(ctx.op_multi(op, *inputs, num_outputs=outputs, **attrs))

        params = gather_params(emit, shard.x_new, [m.x for m in shard.members],
                               f"ngdist/allgather/{shard.prefix}")
        for m, param in zip(shard.members, params):
            _take_over(node.outputs[m.index], param)

    def _layout(self, ctx: GradContext, node: ir.Node, shard: _Shard, meta: StepMeta
                ) -> dict[str, object]:
        """The bucket's layout (which parameter and state lies where); the per-parameter
        states the flat ones replace dropped."""
        n = len(split_optimizer_inputs(node)[2][0])
        params = []
        for m, count in zip(shard.members, shard.counts):
            old_states = {}
            for j, k in enumerate(shard.states):
                old = m.states[j]
                old_states[k] = old.name
                _drop_state(ctx.graph, old, node.outputs[n * (1 + j) + m.index], meta)
            params.append({"param": m.x.name, "count": count, "shape": _dims(m.x),
                           "states": old_states})
        out = {"states": shard.states, "size": shard.size, "length": shard.length,
               "params": params}
        if self.level == "parameters":
            out["param"] = f"{shard.prefix}.param"
        return out


def _groups(node: ir.Node) -> list[_Group]:
    """The node's parameters grouped by the bucket that reduces their gradients."""
    _, _, groups = split_optimizer_inputs(node)
    xs, gs, states = groups[0], groups[1], groups[2:]
    by_bucket: dict[int, _Group] = {}
    for i, (x, g) in enumerate(zip(xs, gs)):
        bucket = reduced_by(g)
        if bucket is None or bucket.op_type != "AllReduce" or len(bucket.inputs) != 1:
            raise GraphError(f"shard=: the gradient of {x.name!r} is not reduced by a bucket's "
                             "AllReduce of one input (all_reduce_alg='exact' keeps lists)")
        if attr(bucket, "reduction", "mean") != "sum" or \
                bucket_input(bucket).dtype != x.dtype:
            raise GraphError(f"shard=: bucket {bucket.name!r} is not a plain sum of prescaled "
                             "float gradients")
        if x.shape is None or not x.shape.is_static():
            raise GraphError(f"shard=: parameter {x.name!r} has no static shape")
        group = by_bucket.setdefault(id(bucket), _Group(bucket))
        group.members.append(_Member(i, _order(g), x, g, [s[i] for s in states]))
    return list(by_bucket.values())


def _bucket_size(bucket: ir.Node) -> int:
    """Tensors in a bucket: the Split's outputs of a flat bucket, else 1."""
    uses = list(bucket_result(bucket).uses())
    if len(uses) == 1 and uses[0].node.op_type == "Split":
        return len(uses[0].node.outputs)
    return 1


def _flat_gradients(bucket: ir.Node, members: list[_Member]) -> list[ir.Value]:
    """What the members' ReduceScatter reads: the bucket's flat buffer where they are all of
    it, else their own flattened gradients (a bucket shared with another optimizer node, e.g.
    a parameter group, or with buffer averages, whose AllReduce then stays for the rest)."""
    if len(members) == _bucket_size(bucket):
        return [bucket_input(bucket)]
    concat = bucket_input(bucket).producer()
    assert concat is not None and concat.op_type == "Concat"
    return [concat.inputs[m.order] for m in members]  # type: ignore[misc]


def _keep_the_rest(ctx: GradContext, bucket: ir.Node, orders: set[int]) -> None:
    """A flat bucket whose other tensors (buffer averages) stay averaged: a new AllReduce of
    those alone replaces it, so no sharded gradient is also sent whole."""
    size = _bucket_size(bucket)
    if len(orders) == size:
        return  # wholly sharded: RemoveUnusedNodesPass drops it
    if attr(bucket, "compression", "none") != "none":  # only gradients are compressed
        raise GraphError(f"shard=: compressed bucket {bucket.name!r} holds gradients of no "
                         "optimizer node; leave compression= out for this model")
    concat = bucket.inputs[0].producer()
    split = next(iter(bucket.outputs[0].uses())).node
    keep = [i for i in range(size) if i not in orders]
    flats = [concat.inputs[i] for i in keep]  # type: ignore[union-attr]
    counts = [v.shape[0] if v.shape is not None else None for v in flats]
    if any(not isinstance(c, int) for c in counts):
        logger.warning("shard=: bucket %s keeps its sharded gradients too (sizes unknown)",
                       bucket.name)
        return
    flat = flats[0] if len(flats) == 1 else ctx.op("Concat", *flats, axis=0)
    attrs = {k: a.value for k, a in bucket.attributes.items()}
    (reduced,) = ctx.op_multi("AllReduce", flat, num_outputs=1, domain=DOMAIN, **attrs)
    _typed(reduced, [sum(counts)], bucket.outputs[0].dtype)  # type: ignore[arg-type]
    reduced.producer().name = f"{bucket.name}/rest"  # type: ignore[union-attr]
    pieces = [reduced] if len(keep) == 1 else ctx.op_multi(
        "Split", reduced, ctx.ints(counts), num_outputs=len(keep), axis=0)  # type: ignore[arg-type]
    for i, piece in zip(keep, pieces):
        old = split.outputs[i]
        piece.shape, piece.type = old.shape, old.type
        old.replace_all_uses_with(piece, replace_graph_outputs=True)


def _order(g: ir.Value) -> int:
    """Position of reduced gradient ``g`` in its flat bucket (0 for a bucket of one)."""
    producer = g.producer()
    if producer is not None and producer.op_type == "Reshape":
        split_out = producer.inputs[0]
        split = split_out.producer() if split_out is not None else None
        if split is not None and split.op_type == "Split":
            return list(split.outputs).index(split_out)
    return 0


def _padded(ctx: GradContext, values: Sequence[ir.Value], length: int, ranks: int,
            size: int) -> ir.Value:
    """The values flattened into one row, padded with zeros to ``ranks * size`` elements and
    cut into ``[ranks, size]`` (row r: rank r's slice)."""
    row = ctx.ints([1, -1])
    parts = [ctx.op("Reshape", v, row) for v in values]
    if ranks * size > length:
        dtype = values[0].dtype
        zeros = np.zeros((1, ranks * size - length),
                         dtype.numpy() if dtype is not None else np.float32)
        parts.append(ctx.op("Constant", value=ir.tensor(zeros)))
    out = parts[0] if len(parts) == 1 else ctx.op("Concat", *parts, axis=1)
    out = ctx.op("Reshape", out, ctx.ints([ranks, size]))
    _typed(out, [ranks, size], values[0].dtype)
    return out


def _take_over(old: ir.Value, new: ir.Value) -> None:
    name = old.name
    new.shape, new.type = old.shape, old.type
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = f"{name}.replaced"
    new.name = name


def _dims(x: ir.Value) -> list[int]:
    return [int(d) for d in x.shape.dims]  # type: ignore[union-attr]


def _count(x: ir.Value) -> int:
    return int(np.prod(_dims(x), dtype=np.int64))


def passes(o: AllReduceOptions) -> list[ir.passes.PassBase]:
    """The sharding pass of the allreduce strategy's options (none for ``shard="none"``);
    an OptionError where shard= cannot run with the other options."""
    if o.shard == "none":
        return []
    if o.reproducible_micro_batch:
        raise OptionError(f"shard={o.shard!r} cannot be combined with reproducible_micro_batch "
                          "(the exact AllReduce sums lists of micro-batch gradients; there is "
                          "no exact ReduceScatter); leave one of the two out")
    if o.compression_error_feedback:
        raise OptionError(f"shard={o.shard!r} cannot be combined with "
                          "compression_error_feedback yet (the residual of what the 16-bit "
                          "cast lost is kept for the whole bucket's AllReduce, which the "
                          "ReduceScatter replaces); leave compression_error_feedback out")
    if o.shard_ranks < 1:
        raise OptionError(f"shard={o.shard!r} needs the rank count to size the shards: "
                          "ngdist.compile sets shard_ranks to the job's; pass shard_ranks=N "
                          "(ngdist rewrite --shard-ranks N)")
    return [ShardingPass(o.shard, o.shard_ranks)]


def check_gradients(o: object, gradients: StepOptions | None) -> None:
    """ZeRO-3 with accumulation is refused: the micro-step graph (passes/accumulate.py, split
    off before the comm passes) reads whole parameters, which a rank no longer holds."""
    if getattr(o, "shard", "none") == "parameters" and gradients is not None and \
            gradients.accumulate > 1:
        raise OptionError("shard='parameters' cannot be combined with accumulate= yet (the "
                          "micro-steps run forward and backward on whole parameters, which "
                          "each rank holds only 1/N of); use shard='gradients' with "
                          "accumulate=, or leave accumulate= out")


def initial_values(step: ir.Model, level: object) -> dict[str, np.ndarray]:
    """What ``ngdist rewrite --shard`` packs into the sharded file's whole flats: the step's
    parameters and optimizer state before the pass (none without ``shard``)."""
    if level in (None, "none"):
        return {}
    meta = get_meta(step)
    return {n: step.graph.initializers[n].const_value.numpy()  # type: ignore[union-attr]
            for n in (*meta.names("param"), *meta.names("state"))
            if n in step.graph.initializers}
