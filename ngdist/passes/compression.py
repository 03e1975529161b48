"""Gradient compression as a graph rewrite: every AllReduce reduces a 16-bit copy of its
float32 input (Horovod's ``Compression.fp16``, PyTorch DDP's fp16/bf16 compress hooks).

Two passes. ``CompressionMarkingPass`` (before bucketing) sets ``compression`` on the
AllReduce of every gradient, so that the bucketing pass groups gradients only with gradients
of the same compression. Buffer averages (BatchNorm running statistics, passes/buffers.py)
stay float32 in a bucket of their own: they are values, not increments, and rounding a running
variance of 1.0 to bfloat16 (steps of 2^-7) each step would swallow the updates of a momentum
of 0.9 (0.1 x a small change). ``GradientCompressionPass`` (after bucketing) then casts each
marked flat bucket or lone tensor once::

    x (float32) -> Cast(to=FLOAT16|BFLOAT16) -> AllReduce(compression=fp16|bf16)
        -> Cast(to=FLOAT) -> every consumer of the old result, under its name

The casts run inside onnxruntime; the kernel (kernels/compressed.py) sums 16-bit values with
float32 accumulation and puts half the bytes of the float32 AllReduce on the wire.

With error feedback (``error_feedback=True``), each compressed input ``x`` gets a residual
``r`` (a ``state`` of the step, ``ngdist.residual.bucket<i>``, zeros at first, carried in the
file like optimizer state)::

    s = x + r;  c = Cast16(s);  r' = s - Cast32(c);  AllReduce(c) ...

so what the cast lost this step is sent with the next step's gradients (as in 1-bit SGD and
PowerSGD's error feedback).
"""
from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ngdist.errors import GraphError
from ngdist.ir.domain import COMPRESSIONS, DOMAIN
from ngdist.ir.model import StepMeta, get_meta, set_meta
from ngdist.passes.autodiff.registry import attr
from ngdist.passes.bucketing import Emitter, FreshNames, take_over

logger = logging.getLogger(__name__)

WIRE_TYPES = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}
assert set(WIRE_TYPES) == set(COMPRESSIONS)
RESIDUAL_PREFIX = "ngdist.residual"
# algorithms whose kernel sums 16-bit buffers itself (kernels/compressed.py); "mpi" means the
# default, which for 16-bit buffers is the ring (MPI has no float16/bfloat16 sum)
COMPRESSED_ALGORITHMS = ("mpi", "ring", "recursive_doubling")


def _check(compression: str) -> None:
    if compression not in WIRE_TYPES:
        raise GraphError(f"unknown compression {compression!r}; choose one of "
                         f"{list(WIRE_TYPES)}")


class CompressionMarkingPass(ir.passes.InPlacePass):
    """Sets ``compression`` on the single-tensor AllReduce of every float32 gradient (not on
    buffer averages, nor ``exact`` ones); run it before ``BucketingPass``."""

    def __init__(self, compression: str) -> None:
        super().__init__()
        _check(compression)
        self.compression = compression

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        meta = get_meta(model)
        averages = {meta.binding.get(b) for b in meta.names("buffer")}
        marked = 0
        for n in model.graph:
            if n.domain != DOMAIN or n.op_type != "AllReduce" or "bucket" in n.attributes \
                    or attr(n, "compression", "none") != "none" or len(n.inputs) != 1:
                continue
            if attr(n, "algorithm", "mpi") not in COMPRESSED_ALGORITHMS:
                raise GraphError(f"{n.name}: compression {self.compression!r} cannot run with "
                                 f"all_reduce_alg={attr(n, 'algorithm', 'mpi')!r}; choose one "
                                 f"of {list(COMPRESSED_ALGORITHMS)} ('mpi' sums 16-bit buffers "
                                 "on ngdist's ring)")
            if n.outputs[0].name in averages or n.inputs[0].dtype != ir.DataType.FLOAT:
                continue
            n.attributes["compression"] = ir.AttrString("compression", self.compression)
            marked += 1
        if not marked:  # e.g. a file rewritten before: its AllReduce nodes are as written
            logger.warning("compression=%r: no float32 gradient AllReduce left to compress "
                           "(a rewritten file keeps the compression it was rewritten with; "
                           "start from the model as it was before ngdist rewrite to change "
                           "it)",
                           self.compression)
        return ir.passes.PassResult(model, marked > 0)


class GradientCompressionPass(ir.passes.InPlacePass):
    """Casts the float32 input of every AllReduce marked with ``compression`` (``fp16``:
    float16, ``bf16``: bfloat16) to that format and its output back to float32; see the
    module docstring. Run it after ``BucketingPass``."""

    def __init__(self, error_feedback: bool = False) -> None:
        super().__init__()
        self.error_feedback = error_feedback

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = [n for n in graph if n.domain == DOMAIN and n.op_type == "AllReduce"
                 and attr(n, "compression", "none") != "none"
                 and all(x.dtype == ir.DataType.FLOAT for x in n.inputs)]
        if not nodes:
            return ir.passes.PassResult(model, False)
        names = FreshNames(graph)
        meta = get_meta(model)
        roles, binding = dict(meta.roles), dict(meta.binding)
        for node in nodes:
            self._compress(graph, node, names, roles, binding)
        set_meta(model, StepMeta(roles, binding, meta.loss))
        logger.info("compression: %d AllReduce node(s) reduce 16-bit values%s", len(nodes),
                    " with error feedback" if self.error_feedback else "")
        return ir.passes.PassResult(model, True)

    def _compress(self, graph: ir.Graph, node: ir.Node, names: FreshNames, roles: dict[str, str],
                  binding: dict[str, str]) -> None:
        tag = attr(node, "compression")
        _check(tag)
        wire = WIRE_TYPES[tag]
        idx = attr(node, "bucket", None)
        label = f"bucket{idx}" if idx is not None else node.name.rsplit("/", 1)[-1]
        emit = Emitter(names, f"ngdist/{label}/{tag}")
        after = Emitter(names, f"ngdist/{label}/{tag}")
        sends = []
        for i, x in enumerate(node.inputs):
            residual = None
            if self.error_feedback:
                x, residual = self._feedback(graph, x, label + (f".{i}" if i else ""), i,
                                             emit, roles)
            (sent,) = emit.op("Cast", [x], f"cast{i}", [f"{x.name}.{tag}"], [x.shape], wire,
                              to=wire)
            sends.append(sent)
            if residual is not None:  # r' = (x + r) - Cast32(Cast16(x + r))
                (back,) = emit.op("Cast", [sent], f"feedback/widen{i}", [f"{sent.name}.float"],
                                  [x.shape], ir.DataType.FLOAT, to=ir.DataType.FLOAT)
                (new,) = emit.op("Sub", [x, back], f"feedback/residual{i}",
                                 [f"{residual.name}.new"], [x.shape], ir.DataType.FLOAT)
                graph.outputs.append(new)
                binding[residual.name] = new.name
        attributes = {k: v.value for k, v in node.attributes.items()}
        reduced = ir.Node(DOMAIN, "AllReduce", sends,
                          ir.convenience.convert_attributes(attributes),
                          num_outputs=len(sends), name=node.name)
        for out, old in zip(reduced.outputs, node.outputs):
            out.name, out.shape, out.type = names(f"{old.name}.{tag}"), old.shape, \
                ir.TensorType(wire)
        news = [after.op("Cast", [r], f"uncast{i}", [f"{old.name}.float"], [old.shape],
                         ir.DataType.FLOAT, to=ir.DataType.FLOAT)[0]
                for i, (r, old) in enumerate(zip(reduced.outputs, node.outputs))]
        graph.insert_before(node, emit.nodes)
        graph.insert_after(node, [reduced, *after.nodes])
        take_over(list(node.outputs), news)
        graph.remove(node, safe=True)

    @staticmethod
    def _feedback(graph: ir.Graph, x: ir.Value, label: str, i: int, emit: Emitter,
                  roles: dict[str, str]) -> tuple[ir.Value, ir.Value]:
        """(``x + r``, ``r``): ``r`` a new float32 state input of ``x``'s (static) shape,
        zeros at first."""
        if x.shape is None or not x.shape.is_static():
            raise GraphError(f"compression_error_feedback needs gradients of static shape; "
                             f"{x.name} has shape {x.shape}. Leave error feedback out for "
                             "this model")
        dims = [int(d) for d in x.shape.dims]
        name = emit.names(f"{RESIDUAL_PREFIX}.{label}")
        residual = ir.Value(name=name, shape=ir.Shape(dims),
                            type=ir.TensorType(ir.DataType.FLOAT),
                            const_value=ir.tensor(np.zeros(dims, np.float32), name=name))
        graph.inputs.append(residual)
        graph.register_initializer(residual)
        roles[name] = "state"
        (total,) = emit.op("Add", [x, residual], f"feedback/add{i}", [f"{x.name}.feedback"],
                           [x.shape], ir.DataType.FLOAT)
        return total, residual
