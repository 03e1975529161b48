"""The ``ngdist`` op domain: every communication op, in one table.

Each entry says what the passes and the runtime need to know about an op: its inputs and
outputs, its attributes with defaults, and whether the op's outputs alias its inputs in
shape and type (true for every op here except AllGather/ReduceScatter). The table is
registered with ``onnx.defs`` so that ``onnx.checker`` accepts rewritten files.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir
from onnx import defs

logger = logging.getLogger(__name__)

DOMAIN = "ngdist"
# values of AllReduce's "algorithm" attribute (kernels in ngdist/kernels/collectives.py,
# allreduce_algs.py, exact.py)
ALLREDUCE_ALGORITHMS = ("mpi", "ring", "recursive_doubling", "hierarchical", "exact")
# values of AllReduce's "compression" attribute: the 16-bit format its input and output are in
# (the compression pass casts around it, passes/compression.py; the kernel sums 16-bit values
# with float32 accumulation, kernels/compressed.py); "none" is the default
COMPRESSIONS = ("fp16", "bf16")
# AllReduce's "bucket" attribute: the index of the flat bucket the bucketing pass fused
# (0, 1, ...); left out (this default) on a node that reduces tensors as they are
NO_BUCKET = -1
DOMAIN_VERSION = 1
PREVIEW_TRAINING = "ai.onnx.preview.training"
# A hyper-parameter the runtime sets to 1 / (ranks that train): the loss is scaled by it before
# differentiation, so that summing the gradients over the ranks gives their mean with no
# division pass over the buffers (passes/gradscale.py). Saved files hold 1.
GRAD_SCALE = "ngdist.grad_scale"
# The step output holding the gradients' L2 norm before clipping (passes/clipping.py).
GRAD_NORM = "ngdist.grad_norm"
# Sharded data parallelism (passes/shard.py): the int64 hyper-parameter the runtime sets to the
# rank (which shard of each bucket it updates), and the step graph's metadata key holding the
# layout of the flat optimizer-state shards (runtime/sharding.py).
SHARD_RANK = "ngdist.shard_rank"
SHARD_LAYOUT = "ngdist.shard_layout"
# Gradient accumulation (passes/accumulate.py): the key of the micro-step graph in the step
# model's ``meta``, and the hyper-parameter 1 / (micro-steps of the window) the update reads.
MICRO_STEP = "ngdist.micro_step"
ACCUMULATE_SCALE = "ngdist.accumulate_scale"


@dataclass(frozen=True)
class CommOpSpec:
    """What one communication op is."""

    name: str
    doc: str
    inputs: str  # "variadic" or "single"
    attributes: dict[str, object] = field(default_factory=dict)
    same_shape: bool = True  # output i has the shape and type of input i
    collective: bool = True  # every rank takes part


COMM_OPS: dict[str, CommOpSpec] = {
    spec.name: spec
    for spec in [
        CommOpSpec(
            "AllReduce",
            "Reduces every input over all ranks (sum or mean); several inputs form one fused "
            "bucket sent as one message. Output i has the shape of input i. With algorithm "
            "'exact' the sum is exact and order-independent; micro_batch > 0 (reproducible "
            "mode) means the runtime computes the inputs per micro-batch of that many "
            "samples and the reduction is over all micro-batches of all ranks. compression "
            "'fp16' or 'bf16': the inputs are 16-bit casts of float32 gradients (float16, or "
            "bfloat16), summed with float32 accumulation and rounded back to 16 bits at each "
            "hop of the ring.",
            "variadic",
            {"reduction": "mean", "bucket": NO_BUCKET, "algorithm": "mpi", "micro_batch": 0,
             "compression": "none"},
        ),
        CommOpSpec(
            "Broadcast",
            "Every rank receives the root's value of each input.",
            "variadic",
            {"root": 0},
        ),
        CommOpSpec(
            "AllGather",
            "Concatenates every rank's input along axis 0, in rank order. With ndims: the "
            "result flattened and cut into one output per entry, each of the next ndims[i] "
            "extents of dims, in order (views of the gathered buffer); elements past the "
            "last output (padding) are dropped.",
            "single",
            {"dims": [], "ndims": []},
            same_shape=False,
        ),
        CommOpSpec(
            "ReduceScatter",
            "Sums the inputs over ranks and gives rank r the r-th slice along axis 0. "
            "compression 'fp16' or 'bf16': the input is a 16-bit cast of a float32 gradient "
            "bucket, summed with float32 accumulation and rounded to 16 bits at each hop of "
            "the ring (as AllReduce's).",
            "single",
            {"reduction": "sum", "compression": "none"},
            same_shape=False,
        ),
        CommOpSpec(
            "PushSum",
            "Stochastic Gradient Push gossip: inputs are parameters then the push-sum weight; "
            "each rank keeps a share and pushes shares to its out-peers of the iteration.",
            "variadic",
            {"graph": "exponential", "peers_per_itr": 1, "overlap": 0, "synch_freq": 0},
        ),
        CommOpSpec(
            "PSPushPull",
            "Parameter-server step. Inputs: learning rate, step count, the n parameters, their "
            "n gradients, then the optimizer state (n per state kind); outputs: the n updated "
            "parameters. The flattened gradients are cut into shards of at most "
            "grad_shard_bytes; each shard's owner (a dedicated server rank when servers > 0 or "
            "chosen at launch, else a co-located worker) sums what every worker pushes, runs "
            "the 'update' graph (the lowered optimizer, on 1-D slices) on its shard and serves "
            "the updated shard back. The optimizer state inputs are read once, by the owners.",
            "variadic",
            {"grad_shard_bytes": 0, "servers": 0, "update": onnx.GraphProto()},
            same_shape=False,
        ),
        CommOpSpec(
            "CentralReduce",
            "Ray SGD's 'simple' aggregation: every rank's inputs are gathered at the root, "
            "reduced there in rank order (sum or mean) and the result is broadcast back.",
            "variadic",
            {"root": 0, "reduction": "mean"},
        ),
    ]
}


def is_comm_node(domain: str, op_type: str) -> bool:
    return domain == DOMAIN and op_type in COMM_OPS


def with_defaults(op_type: str, attributes: Mapping[str, Any]) -> dict[str, Any]:
    """``attributes`` of a comm node of ``op_type`` with every attribute it leaves out at the
    op's default (the one place defaults are read; an op not in the table keeps its own)."""
    spec = COMM_OPS.get(op_type)
    return {**(spec.attributes if spec is not None else {}), **attributes}


def comm_attributes(node: onnx.NodeProto | ir.Node) -> dict[str, Any]:
    """A comm node's attributes (of a NodeProto or an onnx_ir node) as Python values, strings
    decoded, defaults filled in."""
    if isinstance(node, ir.Node):
        return with_defaults(node.op_type, {k: a.value for k, a in node.attributes.items()})
    given = {}
    for a in node.attribute:
        value = onnx.helper.get_attribute_value(a)
        given[a.name] = value.decode() if isinstance(value, bytes) else value
    return with_defaults(node.op_type, given)


def _schema(spec: CommOpSpec) -> defs.OpSchema:
    variadic = defs.OpSchema.FormalParameterOption.Variadic
    single = defs.OpSchema.FormalParameterOption.Single
    option = variadic if spec.inputs == "variadic" else single
    attr_type = {
        str: defs.OpSchema.AttrType.STRING,
        int: defs.OpSchema.AttrType.INT,
        float: defs.OpSchema.AttrType.FLOAT,
        onnx.GraphProto: defs.OpSchema.AttrType.GRAPH,
        list: defs.OpSchema.AttrType.INTS,
    }
    attributes = [
        defs.OpSchema.Attribute(name, attr_type[type(default)], f"{name} (default {default!r})",
                                required=False)
        for name, default in spec.attributes.items()
    ]
    return defs.OpSchema(
        spec.name,
        DOMAIN,
        DOMAIN_VERSION,
        spec.doc,
        inputs=[defs.OpSchema.FormalParameter("inputs", "T", param_option=option,
                                              is_homogeneous=False, min_arity=1)],
        outputs=[defs.OpSchema.FormalParameter("outputs", "T", param_option=option,
                                               is_homogeneous=False, min_arity=1)],
        type_constraints=[("T", ["tensor(float)", "tensor(double)", "tensor(float16)",
                                 "tensor(bfloat16)", "tensor(int64)", "tensor(int32)"],
                           "numeric tensors")],
        attributes=attributes,
    )


def register_domain() -> None:
    """Register every comm op with onnx.defs (idempotent)."""
    for spec in COMM_OPS.values():
        if defs.has(spec.name, DOMAIN):
            continue
        try:
            defs.register_schema(_schema(spec))
        except Exception as exc:  # pragma: no cover - depends on the onnx build
            logger.warning("could not register ngdist.%s with onnx.defs: %s", spec.name, exc)


register_domain()
