"""Kernels of the plain collectives: AllReduce, Broadcast, AllGather, ReduceScatter.

Written against ProcessGroup only. AllReduce reduces its bucket in place: the bucketing pass
hands it one flat tensor (Concat in the graph), produced for it alone, so in a steady-state
step no byte of a gradient is copied by Python; ``reduction="mean"`` divides once, here.
"""
from __future__ import annotations

import numpy as np

from ngdist.comm.group import divide
from ngdist.ir.domain import NO_BUCKET
from ngdist.kernels.allreduce_algs import sum_inplace
from ngdist.kernels.base import donated, flatten, register_kernel, unflatten
from ngdist.kernels.compressed import compressed_allreduce
from ngdist.kernels.exact import exact_allreduce


def _in_place(node, inputs) -> bool:
    """Whether the one input may be reduced where it is (made for this node alone)."""
    if len(inputs) != 1:
        return False
    x = inputs[0]
    return donated(node, 0) and x.flags.c_contiguous and x.flags.writeable


def _offer_symmetric(group, node, buf) -> None:
    """Ask for the next call's input in symmetric memory (``node.state["write_to"]``, which
    the runtime binds its producer's output to), where the group has it: a gradient bucket of
    floats, made in the step for this node alone, on ranks that share one host. The group's
    ``allreduce`` then reduces it there without a message (comm/shared.py).

    Outputs that die within the step take one memory. Outputs the step returns as values that
    the next step's results replace (plain SGD's state is the reduced gradient) live until the
    end of the next step: they take two memories in turn, so the next step's input is never
    written over the value that step reads. Each memory is made at a call that every rank
    reaches (a collective): the first one at the first call, which goes through MPI."""
    node.state.pop("write_to", None)
    if node.attributes["bucket"] == NO_BUCKET or buf.dtype not in (np.float32, np.float64):
        return
    turns = 1 if node.facts.outputs_die else 2 if node.facts.replaced_next_step else 0
    mems = node.state.setdefault("symmetric", [])
    if not turns or None in mems:  # (None: the group has no symmetric memory)
        return
    # with one memory, that one; with two, the one that does not hold this call's result
    # (a new one while there is only that)
    mem = next((m for m in mems if turns == 1 or m.offset_of(buf) is None), None)
    if mem is None:
        mem = group.symmetric(buf.nbytes, node)
        mems.append(mem)
        if mem is None:
            return
    if buf.nbytes > mem.nbytes:
        return
    targets = node.state.setdefault("write_targets", {})
    target = targets.get(id(mem))
    if target is None or target.shape != buf.shape or target.dtype != buf.dtype:
        target = targets[id(mem)] = \
            mem.view(group.rank)[:buf.nbytes].view(buf.dtype).reshape(buf.shape)
    node.state["write_to"] = {0: target}


def _plain(attributes) -> bool:
    """Whether an AllReduce node reduces with the group's own AllReduce (algorithm ``mpi``,
    no compression): such nodes that run one after another are reduced in one call."""
    return attributes["algorithm"] == "mpi" and attributes["compression"] == "none"


def allreduce_batch(group, nodes, inputs_list):
    """Plain AllReduce nodes (see ``_plain``) that the runtime runs one after another, as one
    call of the group (``allreduce_coalesced``: buffers in symmetric memory share one pair of
    barriers), the group dividing for ``reduction="mean"``; the outputs of each node."""
    if group.size == 1:
        return [list(inputs) for inputs in inputs_list]
    calls, by_op = [], {}
    for node, inputs in zip(nodes, inputs_list):
        in_place = _in_place(node, inputs)
        # else a copy (in the node's reused buffer): never reduce into a value others still read
        buf = inputs[0] if in_place else flatten(inputs, node)
        calls.append((node, inputs, in_place, buf))
        op = "mean" if node.attributes["reduction"] == "mean" else "sum"
        by_op.setdefault(op, []).append(buf.reshape(-1))  # a view: the buffer is contiguous
    what = tuple(nodes)
    works = [group.allreduce_coalesced(bufs, what, op=op) for op, bufs in by_op.items()]
    for work in works:
        work.wait()
    outs = []
    for node, inputs, in_place, buf in calls:
        if in_place:  # (a collective when it makes memory: every rank, in the same order)
            _offer_symmetric(group, node, buf)
        outs.append([buf] if in_place else unflatten(buf, inputs))
    return outs


@register_kernel("AllReduce",
                 alone_identity=lambda attributes: attributes["algorithm"] != "exact",
                 batch=allreduce_batch, batchable=_plain)
def allreduce(group, node, inputs):
    """Sum (or mean) over the ranks, with MPI's own algorithm or the one named by the
    ``algorithm`` attribute (kernels/allreduce_algs.py, kernels/exact.py); 16-bit buffers
    (``compression`` fp16/bf16) by kernels/compressed.py."""
    if _plain(node.attributes):
        return allreduce_batch(group, [node], [inputs])[0]
    algorithm = node.attributes["algorithm"]
    if algorithm == "exact":  # reproducible mode
        return exact_allreduce(group, node, inputs)
    if group.size == 1:
        return list(inputs)
    in_place = _in_place(node, inputs)
    buf = inputs[0] if in_place else flatten(inputs, node)
    flat = buf.reshape(-1)
    if node.attributes["compression"] != "none":
        compressed_allreduce(group, node, flat, algorithm)  # the mean too
    else:
        sum_inplace(algorithm, group, node, flat)
        if node.attributes["reduction"] == "mean":
            divide(flat, group.size)
    return [buf] if in_place else unflatten(buf, inputs)


@register_kernel("Broadcast", alone_identity=True)
def broadcast(group, node, inputs):
    root = int(node.attributes["root"])
    outs = []
    for i, x in enumerate(inputs):
        buf = x if donated(node, i) and x.flags.writeable and x.flags.c_contiguous \
            else np.array(x, order="C")  # one copy, contiguous
        outs.append(buf)
    works = [group.broadcast(b, root, node) for b in outs]
    for w in works:
        w.wait()
    return outs


@register_kernel("AllGather", alone_identity=True)
def allgather(group, node, inputs):
    (x,) = inputs
    x = np.ascontiguousarray(x)
    out = np.empty((group.size * x.shape[0], *x.shape[1:]), x.dtype)
    group.allgather(x, out, node).wait()
    return [out]


@register_kernel("ReduceScatter", alone_identity=True)
def reduce_scatter(group, node, inputs):
    (x,) = inputs
    x = np.ascontiguousarray(x)
    if x.shape[0] % group.size:
        raise ValueError(f"ReduceScatter needs axis 0 ({x.shape[0]}) divisible by {group.size}")
    out = np.empty((x.shape[0] // group.size, *x.shape[1:]), x.dtype)
    group.reduce_scatter(x, out, node).wait()
    return [out]
