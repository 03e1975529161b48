"""The values of a sharded step (passes/shard.py, passes/shard_params.py): the rank
hyper-parameter, the flat per-bucket inputs (optimizer state, ZeRO-3 parameters), each with an
initializer of zeros that the runtime replaces with this rank's slice, and the gather of a
bucket into its parameters, and the (16-bit, with compression) ReduceScatter of a gradient
bucket.

A bucket's flat values are 2-D: ``[N, S]`` whole (row r is rank r's slice) and ``[1, S]`` per
rank, so that ReduceScatter and AllGather split and join axis 0, and so that ONNX shape
inference with data propagation (the in-place planner's, runtime/inplace.py), which treats a
1-D tensor as shape data and spends time and memory linear in its length on each Add, Mul,
Slice or Concat of it (2 s and GBs for a 2 M-element bucket), leaves them alone."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from ngdist.ir.domain import DOMAIN, SHARD_RANK
from ngdist.ir.model import StepMeta
from ngdist.passes.autodiff.registry import GradContext, attr
from ngdist.passes.compression import WIRE_TYPES


def rank_input(graph: ir.Graph, meta: StepMeta) -> ir.Value:
    """The int64 hyper-parameter ``ngdist.shard_rank`` (0 in the graph; the runtime sets it)."""
    if SHARD_RANK in graph.initializers:
        return graph.initializers[SHARD_RANK]
    value = ir.Value(name=SHARD_RANK, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64),
                     const_value=ir.tensor(np.zeros(1, np.int64), name=SHARD_RANK))
    graph.inputs.append(value)
    graph.register_initializer(value)
    meta.roles[SHARD_RANK] = "hyper"
    return value


def state_input(graph: ir.Graph, name: str, size: int, dtype: ir.DataType | None,
                meta: StepMeta, role: str = "state") -> ir.Value:
    """A flat input ``name`` of ``[1, size]`` zeros with ``role``."""
    dtype = dtype or ir.DataType.FLOAT
    value = ir.Value(name=name, shape=ir.Shape([1, size]), type=ir.TensorType(dtype),
                     const_value=ir.tensor(np.zeros((1, size), dtype.numpy()), name=name))
    graph.inputs.append(value)
    graph.register_initializer(value)
    meta.roles[name] = role
    return value


def drop_state(graph: ir.Graph, old: ir.Value, output: ir.Value, meta: StepMeta) -> None:
    """A per-parameter state the flat state replaces: no input, no initializer, no binding."""
    meta.roles.pop(old.name, None)
    meta.binding.pop(old.name, None)
    if output in graph.outputs:
        graph.outputs.remove(output)
    if old in graph.inputs:
        graph.inputs.remove(old)
    graph.initializers.pop(old.name, None)


def typed(value: ir.Value, dims: list[int], dtype: ir.DataType | None) -> None:
    value.shape = ir.Shape(dims)
    value.type = ir.TensorType(dtype) if dtype is not None else None


Emit = Callable[..., list[ir.Value]]  # emit(op, *inputs, outputs=1, domain="", **attributes)


def gather_params(emit: Emit, source: ir.Value, params: list[ir.Value], name: str
                  ) -> list[ir.Value]:
    """An AllGather of a bucket's slices ``source`` ([1, S] on each rank) straight into its
    parameters ``params`` (in flat order; the padding dropped): the outputs, each typed as its
    parameter, are views of the gathered buffer (kernels/collectives.py), so no copy of the
    bucket is made and none lies in an onnxruntime arena."""
    shapes = [[int(d) for d in x.shape.dims] for x in params]  # type: ignore[union-attr]
    outs = emit("AllGather", source, domain=DOMAIN, outputs=len(params),
                dims=ir.AttrInt64s("dims", [d for dims in shapes for d in dims]),
                ndims=ir.AttrInt64s("ndims", [len(dims) for dims in shapes]))
    node = outs[0].producer()
    assert node is not None
    node.name = name
    for x, out in zip(params, outs):
        out.shape, out.type = x.shape, x.type
    return outs


def bucket_input(bucket: ir.Node) -> ir.Value:
    """What the bucket reduces, before the 16-bit ``Cast`` of compression (passes/compression.py)
    where it has one: the float32 flat buffer or lone gradient."""
    x = bucket.inputs[0]
    if attr(bucket, "compression", "none") != "none":
        cast = x.producer()  # type: ignore[union-attr]
        assert cast is not None and cast.op_type == "Cast", bucket.name
        return cast.inputs[0]  # type: ignore[return-value]
    return x  # type: ignore[return-value]


def bucket_result(bucket: ir.Node) -> ir.Value:
    """The bucket's result as its tensors read it: after the ``Cast`` back to float32 of
    compression where it has one."""
    out = bucket.outputs[0]
    if attr(bucket, "compression", "none") != "none":
        (use,) = list(out.uses())
        return use.node.outputs[0]
    return out


def scatter_sum(ctx: GradContext, g_flat: ir.Value, compression: str, name: str) -> ir.Value:
    """The ReduceScatter'ed sum ``[1, S]`` of the padded ``[N, S]`` gradient bucket; with
    ``compression``, of its 16-bit cast (kernels/compressed_rs.py), cast back to its type."""
    ranks, size = (int(d) for d in g_flat.shape.dims)  # type: ignore[union-attr]
    dtype = g_flat.dtype
    if compression != "none":  # cast to 16 bits as the compressed AllReduce's input is
        g_flat = ctx.op("Cast", g_flat, to=WIRE_TYPES[compression])
        typed(g_flat, [ranks, size], WIRE_TYPES[compression])
    (g_shard,) = ctx.op_multi("ReduceScatter", g_flat, num_outputs=1, domain=DOMAIN,
                              reduction="sum", compression=compression)
    typed(g_shard, [1, size], g_flat.dtype)
    g_shard.producer().name = name  # type: ignore[union-attr]
    if compression != "none":  # and the sum back to float32
        g_shard = ctx.op("Cast", g_shard, to=dtype)
        typed(g_shard, [1, size], dtype)
    return g_shard
