"""Gradient fusion as a graph rewrite: AllReduce nodes of one tensor each are grouped into
buckets of at most ``bucket_bytes``, and each bucket is reduced as one flat tensor."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from ngdist.errors import GraphError
from ngdist.ir.domain import DOMAIN, is_comm_node
from ngdist.passes.analysis import nbytes
from ngdist.passes.autodiff.registry import attr

logger = logging.getLogger(__name__)

# AllReduce algorithms whose kernel takes a bucket as a list of tensors: the exact kernel
# (kernels/exact.py) gets each input stacked per micro-batch, so its inputs are not concatenated
LIST_ALGORITHMS = ("exact",)
# a tensor of at least this many bytes is reduced alone, in place: copying it into and out of
# a bucket costs more than the latency of its own message (about 0.1 ms a copy of 256 KiB,
# against tens of microseconds per MPI call), so fusion only gathers the small ones
ALONE_BYTES = 256 << 10
SPLIT_SIZES_INPUT_OPSET = 13  # Split reads its sizes from a second input from opset 13 on
RESHAPE_ALLOWZERO_OPSET = 14  # Reshape's allowzero: a 0 in the target is a zero-sized axis


class BucketingPass(ir.passes.InPlacePass):
    """Groups ``ngdist.AllReduce`` nodes of one input each into buckets, one AllReduce per
    bucket, named ``ngdist/allreduce/bucket<i>`` with the attribute ``bucket=i``.

    Gradients are taken in the order the backward pass produces them (last layer first, as in
    PyTorch DDP); a bucket closes when the next gradient would take it past ``bucket_bytes``
    or has another element type, reduction, algorithm or compression (passes/compression.py).
    A tensor of ``ALONE_BYTES`` or more (256 KiB) gets a bucket of its own and leaves the open
    bucket of small tensors open, so no large gradient is copied. ``bucket_bytes <= 0`` leaves one AllReduce per gradient
    (numbered buckets still).

    A bucket of several tensors becomes, right after the producer of its last gradient::

        Reshape(g_i, [-1]) ... -> Concat(axis=0) -> AllReduce (one flat input and output)
            -> Split(sizes) -> Reshape(piece_i, shape of g_i) ...

    so the copies into and out of the bucket's buffer run inside onnxruntime, as DDP's bucket
    views do, and the kernel reduces one contiguous tensor. The target shapes are constants
    where the shapes are static, ``Shape(g_i)`` otherwise. A bucket of one tensor is reduced
    as it is. Buckets of an algorithm in ``LIST_ALGORITHMS`` (``exact``) keep one AllReduce
    with an input and an output per tensor. Every consumer (the optimizer, the step outputs of
    averaged buffers) reads a value of the same name as before.
    """

    def __init__(self, bucket_bytes: int = 25 << 20) -> None:
        super().__init__()
        self.bucket_bytes = bucket_bytes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        order = {id(n): i for i, n in enumerate(graph)}
        singles = [n for n in graph if n.domain == DOMAIN and n.op_type == "AllReduce"
                   and len(n.inputs) == 1 and "bucket" not in n.attributes]
        if not singles:
            return ir.passes.PassResult(model, False)

        def ready(n: ir.Node) -> int:
            p = n.inputs[0].producer()
            return order[id(p)] if p is not None else -1

        singles.sort(key=ready)
        buckets = self._group(singles)
        opset = model.opset_imports.get("", model.graph.opset_imports.get("", 0))
        names = FreshNames(graph)
        first = 1 + max((attr(n, "bucket") for n in graph if n.domain == DOMAIN
                         and n.op_type == "AllReduce" and "bucket" in n.attributes), default=-1)
        for idx, bucket in enumerate(buckets, start=first):
            if len(bucket) == 1 or attr(bucket[0], "algorithm", "mpi") in LIST_ALGORITHMS:
                _fuse_list(graph, bucket, idx)
            else:
                _fuse_flat(graph, bucket, idx, names, opset)
        logger.info("bucketing: %d tensors in %d bucket(s) of at most %d bytes, %d flat",
                    len(singles), len(buckets), self.bucket_bytes,
                    sum(1 for b in buckets if len(b) > 1
                        and attr(b[0], "algorithm", "mpi") not in LIST_ALGORITHMS))
        return ir.passes.PassResult(model, True)

    def _group(self, singles: list[ir.Node]) -> list[list[ir.Node]]:
        buckets: list[list[ir.Node]] = []
        cur: list[ir.Node] | None = None  # the open bucket of small tensors
        size = 0
        for n in singles:
            g = n.inputs[0]
            b = nbytes(g)
            if b is None:
                logger.warning("size of gradient %s unknown; counted as 0 bytes", g.name)
                b = 0
            if b >= ALONE_BYTES and attr(n, "algorithm", "mpi") not in LIST_ALGORITHMS:
                buckets.append([n])
                continue
            fits = cur is not None and self.bucket_bytes > 0 and size + b <= self.bucket_bytes \
                and cur[0].inputs[0].dtype == g.dtype \
                and attr(cur[0], "reduction", "mean") == attr(n, "reduction", "mean") \
                and attr(cur[0], "algorithm", "mpi") == attr(n, "algorithm", "mpi") \
                and attr(cur[0], "compression", "none") == attr(n, "compression", "none")
            if fits:
                cur.append(n)
                size += b
            else:
                cur = [n]
                buckets.append(cur)
                size = b
        return buckets


def reduced_by(value: ir.Value) -> ir.Node | None:
    """The comm node whose result ``value`` is: its producer, or for a tensor of a flat
    bucket (``Reshape(Split(AllReduce(...))[i])``) the bucket's AllReduce, also through the
    ``Cast`` back to float32 of a compressed AllReduce (passes/compression.py); else None."""
    node = value.producer()
    if node is not None and node.domain == "" and node.op_type == "Reshape":
        split = _producer(node)
        if split is not None and split.domain == "" and split.op_type == "Split":
            node = _producer(split)
    if node is not None and node.domain == "" and node.op_type == "Cast":
        node = _producer(node)
    return node if node is not None and is_comm_node(node.domain, node.op_type) else None


def _producer(node: ir.Node) -> ir.Node | None:
    """The producer of ``node``'s first input."""
    return node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None


class FreshNames:
    """Fresh value names: ``base`` if the graph does not use it yet, else ``base.1``,
    ``base.2``... Derived only from the graph's own names, so every rank gets the same."""

    def __init__(self, graph: ir.Graph) -> None:
        self.taken = {v.name for v in graph.inputs} | set(graph.initializers)
        self.taken |= {o.name for n in ir.traversal.RecursiveGraphIterator(graph)
                       for o in n.outputs}

    def __call__(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}.{k}"
        self.taken.add(name)
        return name


def _bucket_attributes(bucket: list[ir.Node], idx: int) -> list[ir.Attr]:
    attrs = {k: v.value for k, v in bucket[0].attributes.items()}
    attrs["bucket"] = idx
    return ir.convenience.convert_attributes(attrs)


def take_over(olds: Sequence[ir.Value], news: Sequence[ir.Value]) -> None:
    """Every consumer (and step output) of ``olds[i]`` reads ``news[i]``, under the same name."""
    for old, new in zip(olds, news):
        name = old.name
        new.shape, new.type = old.shape, old.type
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = f"{name}.unfused"
        new.name = name


def _fuse_list(graph: ir.Graph, bucket: list[ir.Node], idx: int) -> None:
    """One AllReduce with the bucket's tensors as its inputs (one tensor, or ``exact``)."""
    fused = ir.Node(DOMAIN, "AllReduce", [n.inputs[0] for n in bucket],
                    _bucket_attributes(bucket, idx), num_outputs=len(bucket),
                    name=f"ngdist/allreduce/bucket{idx}")
    graph.insert_after(bucket[-1], fused)
    take_over([n.outputs[0] for n in bucket], fused.outputs)
    graph.remove(bucket, safe=True)


class Emitter:
    """Builds the nodes of one bucket in order, naming every value and node."""

    def __init__(self, names: FreshNames, prefix: str) -> None:
        self.names, self.prefix = names, prefix
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, inputs: Sequence[ir.Value], node: str, outputs: Sequence[str],
           shapes: Sequence[ir.Shape | None], dtype: ir.DataType | None, domain: str = "",
           **attributes: object) -> Sequence[ir.Value]:
        n = ir.Node(domain, op_type, inputs, ir.convenience.convert_attributes(attributes),
                    num_outputs=len(outputs), name=f"{self.prefix}/{node}")
        for value, name, shape in zip(n.outputs, outputs, shapes):
            value.name = self.names(name)
            value.shape = shape
            value.type = ir.TensorType(dtype) if dtype is not None else None
        self.nodes.append(n)
        return n.outputs

    def ints(self, node: str, values: Sequence[int]) -> ir.Value:
        arr = np.asarray(list(values), dtype=np.int64)
        return self.op("Constant", [], node, [f"{self.prefix}/{node}"], [ir.Shape([arr.size])],
                       ir.DataType.INT64, value=ir.tensor(arr))[0]

    def shape_of(self, node: str, value: ir.Value) -> ir.Value:
        rank = value.shape.rank() if value.shape is not None else None
        return self.op("Shape", [value], node, [f"{self.prefix}/{node}"],
                       [ir.Shape([rank]) if rank is not None else None], ir.DataType.INT64)[0]


def _static_dims(value: ir.Value) -> list[int] | None:
    if value.shape is None or not value.shape.is_static():
        return None
    return [int(d) for d in value.shape.dims]


def _fuse_flat(graph: ir.Graph, bucket: list[ir.Node], idx: int, names: FreshNames,
               opset: int) -> None:
    """Reshape+Concat -> one flat AllReduce -> Split+Reshape, after the bucket's last node."""
    grads = [n.inputs[0] for n in bucket]
    olds = [n.outputs[0] for n in bucket]
    dtype = grads[0].dtype
    dims = [_static_dims(g) for g in grads]
    counts = [int(np.prod(d, dtype=np.int64)) if d is not None else None for d in dims]
    known = all(c is not None for c in counts)
    sizes_input = opset >= SPLIT_SIZES_INPUT_OPSET
    if not known and not sizes_input:
        raise GraphError(f"bucket {idx}: gradients of dynamic shape need Split with its sizes "
                         f"as an input (opset >= {SPLIT_SIZES_INPUT_OPSET}); the step graph "
                         f"has opset {opset}")
    emit = Emitter(names, f"ngdist/bucket{idx}")

    flat_shape = emit.ints("flat_shape", [-1])
    flats = [emit.op("Reshape", [g, flat_shape], f"flatten{i}", [f"{g.name}.flat"],
                     [ir.Shape([c])], dtype)[0] for i, (g, c) in enumerate(zip(grads, counts))]
    total = sum(c for c in counts if c is not None) if known else None
    (flat,) = emit.op("Concat", flats, "concat", [f"ngdist/bucket{idx}/flat"],
                      [ir.Shape([total])], dtype, axis=0)
    static_sizes = [c for c in counts if c is not None]
    split: list[ir.Value] = []  # the sizes as Split's second input
    if sizes_input and known:
        split = [emit.ints("split_sizes", static_sizes)]
    elif sizes_input:
        parts = [emit.shape_of(f"flat_size{i}", f) for i, f in enumerate(flats)]
        split = list(emit.op("Concat", parts, "split_sizes", [f"ngdist/bucket{idx}/split_sizes"],
                             [ir.Shape([len(parts)])], ir.DataType.INT64, axis=0))
    targets = [emit.ints(f"shape{i}", d) if d is not None else emit.shape_of(f"shape{i}", g)
               for i, (g, d) in enumerate(zip(grads, dims))]

    (reduced,) = emit.op("AllReduce", [flat], "allreduce", [f"ngdist/bucket{idx}/flat.reduced"],
                         [ir.Shape([total])], dtype, domain=DOMAIN)
    fused = emit.nodes[-1]
    fused.name = f"ngdist/allreduce/bucket{idx}"
    for a in _bucket_attributes(bucket, idx):
        fused.attributes[a.name] = a

    piece_names = [f"{o.name}.flat" for o in olds]
    piece_shapes = [ir.Shape([c]) for c in counts]
    pieces = emit.op("Split", [reduced, *split], "split", piece_names, piece_shapes, dtype,
                     axis=0, **({} if sizes_input else {"split": static_sizes}))
    zero = {"allowzero": 1} if opset >= RESHAPE_ALLOWZERO_OPSET else {}
    news = [emit.op("Reshape", [p, t], f"unflatten{i}", [f"{o.name}.fused"], [o.shape],
                    dtype, **zero)[0]
            for i, (p, t, o) in enumerate(zip(pieces, targets, olds))]

    graph.insert_after(bucket[-1], emit.nodes)
    take_over(olds, news)
    graph.remove(bucket, safe=True)
