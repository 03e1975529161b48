"""The graph inputs of a sharded step (passes/shard.py, passes/shard_params.py): the rank
hyper-parameter and the flat per-bucket inputs (optimizer state, ZeRO-3 parameters), each
with an initializer of zeros that the runtime replaces with this rank's slice."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.ir.domain import SHARD_RANK
from ngdist.ir.model import StepMeta


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
    """A flat input ``name`` of ``size`` zeros with ``role``."""
    dtype = dtype or ir.DataType.FLOAT
    value = ir.Value(name=name, shape=ir.Shape([size]), type=ir.TensorType(dtype),
                     const_value=ir.tensor(np.zeros(size, dtype.numpy()), name=name))
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
