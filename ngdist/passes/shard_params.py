"""ZeRO-3 (``shard="parameters"``, FSDP): the parameters themselves held in shards between
steps, gathered where the step reads them (passes/shard.py's ShardingPass calls this).

For each bucket (``L`` elements, ``N`` ranks, ``S = ceil(L / N)``) the per-parameter inputs
give way to one flat input ``<bucket>.param`` of ``[1, S]``, this rank's slice of the
bucket's parameters in flat order (zero-padded), which the optimizer node updates with the
ReduceScatter'ed gradient slice and the state slices; nothing is gathered after the update.

Where the step reads a parameter, the pass inserts, before the first node that reads any
parameter of the bucket:

    <bucket>.param [1, S] -> AllGather -> each parameter

(the parameters are views of the gathered ``[N, S]`` buffer, padding dropped: no copy of the
bucket, and none in an onnxruntime arena; it is freed when the last of them dies)

once for the forward readers and once more for the backward readers (those that depend on
the loss), so the forward's gathered copy dies at its last forward reader (the executor drops
every value after its last use) and the backward's is gathered when the backward reaches the
bucket. Each gather but the first of its pass is tied to the first reader of the bucket before
it (an empty slice of that reader's output concatenated to the shard), so the partitioner
(runtime/partition.py) issues it once that bucket's compute has begun, one bucket ahead of its
own use (a prefetch of one bucket), not all at the start of the step; the backward's chain
starts at the loss.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ngdist.errors import GraphError
from ngdist.ir.model import StepMeta
from ngdist.passes.shard_values import gather_params, state_input


@dataclass
class Gathered:
    """What the gathers of one bucket need: its name, its flat shard input and its
    parameters (in flat order)."""

    prefix: str
    shard: ir.Value
    params: list[ir.Value]


def shard_input(graph: ir.Graph, prefix: str, size: int, dtype: ir.DataType | None,
                meta: StepMeta) -> ir.Value:
    """The flat parameter shard ``<prefix>.param`` of ``size`` elements (zeros in the graph;
    the runtime sets each rank's slice: runtime/sharding.py)."""
    return state_input(graph, f"{prefix}.param", size, dtype, meta, role="param")


def bind_update(graph: ir.Graph, shard: ir.Value, new: ir.Value, meta: StepMeta) -> None:
    """The updated shard a step output that replaces ``shard`` for the next step."""
    new.name = f"{shard.name}.new"
    new.shape, new.type = shard.shape, shard.type
    graph.outputs.append(new)
    meta.binding[shard.name] = new.name


def drop_parameter(graph: ir.Graph, x: ir.Value, updated: ir.Value, meta: StepMeta) -> None:
    """A parameter the flat shard replaces: its updated output and its binding dropped now,
    its input and initializer once its readers read gathered copies (``remove_inputs``)."""
    if updated in graph.outputs:
        graph.outputs.remove(updated)
    meta.binding.pop(x.name, None)


def insert_gathers(graph: ir.Graph, buckets: list[Gathered], loss: str, meta: StepMeta
                   ) -> int:
    """Gathers before the forward and the backward readers of every bucket (see the module
    docstring); the parameters' inputs removed. Returns the number of gathers inserted."""
    nodes = list(graph)
    position = {id(n): i for i, n in enumerate(nodes)}
    backward = _backward_nodes(nodes, loss)
    phases: dict[bool, list[tuple[int, Gathered, list[ir.Node]]]] = {False: [], True: []}
    for bucket in buckets:
        mine = {id(x) for x in bucket.params}
        readers = [n for n in nodes if any(id(v) in mine for v in n.inputs if v is not None)]
        for late in (False, True):
            chosen = [n for n in readers if (id(n) in backward) == late]
            if chosen:
                phases[late].append((position[id(chosen[0])], bucket, chosen))
    loss_value = next((o for o in graph.outputs if o.name == loss), None)
    count = 0
    for late, entries in phases.items():
        trigger = loss_value if late else None
        before, last = -1, trigger  # (buckets whose first reader is the same node share one)
        for first, bucket, readers in sorted(entries, key=lambda e: e[0]):
            if first != before:
                trigger, before = last, first
            _gather(graph, bucket, readers, trigger, "bwd" if late else "fwd")
            last = next(o for o in readers[0].outputs if o.name)
            count += 1
    remove_inputs(graph, [x for b in buckets for x in b.params], meta)
    return count


def remove_inputs(graph: ir.Graph, params: Iterable[ir.Value], meta: StepMeta) -> None:
    for x in params:
        if any(True for _ in x.uses()):
            raise GraphError(f"shard='parameters': {x.name!r} is still read whole after the "
                             "gathers were inserted (a reader outside the step's nodes)")
        graph.inputs.remove(x)
        graph.initializers.pop(x.name, None)
        meta.roles.pop(x.name, None)


def _backward_nodes(nodes: list[ir.Node], loss: str) -> set[int]:
    """Ids of the nodes that depend on the loss (the backward pass and the update)."""
    tainted = {loss}
    out: set[int] = set()
    for n in nodes:
        if any(v is not None and v.name in tainted for v in n.inputs):
            out.add(id(n))
            tainted.update(o.name for o in n.outputs if o.name)
    return out


def _gather(graph: ir.Graph, bucket: Gathered, readers: list[ir.Node],
            trigger: ir.Value | None, phase: str) -> None:
    """The bucket gathered before ``readers[0]`` into its parameters for ``readers``."""
    prefix = f"ngdist/gather/{bucket.prefix}/{phase}"
    k = [0]

    def add(op: str, *inputs: ir.Value, domain: str = "", outputs: int = 1,
            **attrs: object) -> list[ir.Value]:
        k[0] += 1
        node = ir.Node(domain, op, list(inputs), ir.convenience.convert_attributes(attrs),
                       num_outputs=outputs, name=f"{prefix}/{op.lower()}_{k[0]}")
        for i, out in enumerate(node.outputs):
            out.name = f"{prefix}/{k[0]}" + (f":{i}" if outputs > 1 else "")
        graph.insert_before(readers[0], node)
        return list(node.outputs)

    def ints(values: list[int]) -> ir.Value:
        return add("Constant", value=ir.tensor(np.array(values, np.int64)))[0]

    source = bucket.shard
    if trigger is not None:  # issued once the bucket before has begun (see module docstring)
        row = add("Reshape", trigger, ints([1, -1]))[0]
        empty = add("Slice", row, ints([0]), ints([0]), ints([1]))[0]
        source = add("Concat", bucket.shard, add("CastLike", empty, bucket.shard)[0],
                     axis=1)[0]
    params = gather_params(add, source, bucket.params,
                           f"ngdist/allgather/{bucket.prefix}/{phase}")
    for x, full in zip(bucket.params, params):
        for node in readers:
            for i, v in enumerate(node.inputs):
                if v is x:
                    node.replace_input_with(i, full)
