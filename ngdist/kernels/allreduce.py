"""AllReduce: an ordered list of implementations, the first one enabled for a node runs it.

As Horovod's ``OperationManager``: each implementation is a class with ``enabled(request,
group)`` (``request``: the comm node, its attributes with defaults and the runtime's facts;
``group``: the ProcessGroup, or None when asked from the file alone by ``ngdist inspect
--explain``) and ``execute(group, nodes, inputs)``, which reduces the inputs of each node (one
node, or several that run one after another, for an implementation that is ``batchable``) and
returns the outputs of each. ``IMPLEMENTATIONS`` is today, in order:

* ``shared-memory``: a plain (``mpi``, uncompressed) gradient bucket made for this node alone,
  whose result dies within the step or is replaced by the next step's: reduced like ``mpi``,
  then it asks for the next step's bucket in symmetric memory (kernels/symmetric.py), where the
  group reduces it without a message (comm/shared.py);
* ``mpi``: the group's own AllReduce (``allreduce_coalesced``: one call for a batch);
* ``compressed``: 16-bit buffers (``compression`` fp16/bf16; kernels/compressed.py);
* ``algorithm``: ngdist's ring, recursive doubling or hierarchical AllReduce
  (kernels/allreduce_algs.py);
* ``exact``: the reproducible mode's exact sum (kernels/exact.py).

A new implementation is one class in a file of its own and one line that inserts it into the
list (``register_implementation``): kernels/host_staged.py, the AllReduce of device buffers
through host memory, goes first.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ngdist.comm.group import ReduceOp, divide
from ngdist.errors import CommError
from ngdist.ir.domain import NO_BUCKET
from ngdist.kernels.allreduce_algs import sum_inplace
from ngdist.kernels.base import CommNode, donated, flatten, unflatten
from ngdist.kernels.compressed import compressed_allreduce
from ngdist.kernels.exact import exact_allreduce
from ngdist.kernels.symmetric import offer_symmetric, placed_in

if TYPE_CHECKING:
    from ngdist.comm.group import ProcessGroup

Inputs = Sequence[Any]


class AllReduceImpl(abc.ABC):
    """One way to run an AllReduce node (see the module docstring)."""

    name: ClassVar[str]
    when: ClassVar[str]  # when it is taken, in words (``ngdist inspect --explain``)
    batchable: ClassVar[bool] = False  # several nodes in a row may run as one call

    @abc.abstractmethod
    def enabled(self, request: CommNode, group: ProcessGroup | None) -> bool:
        """Whether this implementation runs ``request``."""

    @abc.abstractmethod
    def execute(self, group: ProcessGroup, nodes: Sequence[CommNode],
                inputs: Sequence[Inputs]) -> list[list[Any]]:
        """The outputs of each node of ``nodes`` (each given ``inputs[i]``)."""


def plain(attributes: dict[str, Any]) -> bool:
    """Whether an AllReduce reduces with the group's own AllReduce (``mpi``, uncompressed)."""
    return attributes["algorithm"] == "mpi" and attributes["compression"] == "none"


def writable_in_place(node: CommNode, i: int, x: Any) -> bool:
    """Whether input ``i`` (array ``x``) may be written where it is: made for this node alone,
    contiguous, and writable (a device array's flags do not say: it is)."""
    return donated(node, i) and x.flags.c_contiguous and getattr(x.flags, "writeable", True)


def in_place(node: CommNode, inputs: Inputs) -> bool:
    """Whether the one input may be reduced where it is (made for this node alone)."""
    return len(inputs) == 1 and writable_in_place(node, 0, inputs[0])


def _bucket(node: CommNode, inputs: Inputs) -> tuple[bool, Any]:
    """(reduced in place, the one contiguous buffer that is reduced): the input itself, else a
    copy (in the node's reused buffer): never reduce into a value others still read."""
    where = in_place(node, inputs)
    return where, inputs[0] if where else flatten(inputs, node)


class MpiAllReduce(AllReduceImpl):
    name = "mpi"
    when = "algorithm 'mpi', no compression: the group's own AllReduce"
    batchable = True

    def enabled(self, request, group):
        return plain(request.attributes)

    def execute(self, group, nodes, inputs):
        if group.size == 1:
            return [list(x) for x in inputs]
        calls, by_op = [], {}
        for node, xs in zip(nodes, inputs):
            where, buf = _bucket(node, xs)
            calls.append((node, xs, where, buf))
            op = ReduceOp.MEAN if node.attributes["reduction"] == "mean" else ReduceOp.SUM
            bufs, placed = by_op.setdefault(op, ([], []))
            bufs.append(buf.reshape(-1))  # a view: the buffer is contiguous
            placed.append(placed_in(node, buf) if where else None)
        what = tuple(nodes)
        works = [group.allreduce_coalesced(bufs, what, op=op, placed=placed)
                 for op, (bufs, placed) in by_op.items()]
        for work in works:
            work.wait()
        outs = []
        for node, xs, where, buf in calls:
            if where:  # (a collective when it makes memory: every rank, in the same order)
                self.after(group, node, buf)
            outs.append([buf] if where else unflatten(buf, xs))
        return outs

    def after(self, group: ProcessGroup, node: CommNode, buf: Any) -> None:
        """What follows a call reduced in place (nothing here)."""


class SharedMemoryAllReduce(MpiAllReduce):
    name = "shared-memory"
    when = ("a plain bucket made for it alone, its result dead by the next step: written "
            "into symmetric memory, reduced there without a message (ranks on one host; "
            "else as mpi)")

    def enabled(self, request, group):
        facts = request.facts
        return plain(request.attributes) and request.attributes["bucket"] != NO_BUCKET \
            and donated(request, 0) and (facts.outputs_die or facts.replaced_next_step) \
            and (group is None or group.size > 1)

    def after(self, group, node, buf):
        offer_symmetric(group, node, buf)


class CompressedAllReduce(AllReduceImpl):
    name = "compressed"
    when = "compression fp16/bf16: 16-bit values on the wire, summed in float32"

    def enabled(self, request, group):
        return request.attributes["compression"] != "none"

    def execute(self, group, nodes, inputs):
        return [_one(group, node, xs, lambda g, n, flat: compressed_allreduce(
            g, n, flat, n.attributes["algorithm"])) for node, xs in zip(nodes, inputs)]


class AlgorithmAllReduce(AllReduceImpl):
    name = "algorithm"
    when = "algorithm ring, recursive_doubling or hierarchical: ngdist's own, on messages"

    def enabled(self, request, group):
        return request.attributes["algorithm"] in ("ring", "recursive_doubling",
                                                   "hierarchical")

    def execute(self, group, nodes, inputs):
        return [_one(group, node, xs, _summed) for node, xs in zip(nodes, inputs)]


class ExactAllReduce(AllReduceImpl):
    name = "exact"
    when = "algorithm 'exact' (reproducible mode): an exact, order-independent sum"

    def enabled(self, request, group):
        return request.attributes["algorithm"] == "exact"

    def execute(self, group, nodes, inputs):
        return [exact_allreduce(group, node, xs) for node, xs in zip(nodes, inputs)]


def _summed(group: ProcessGroup, node: CommNode, flat: Any) -> None:
    sum_inplace(node.attributes["algorithm"], group, node, flat)
    if node.attributes["reduction"] == "mean":
        divide(flat, group.size)


def _one(group: ProcessGroup, node: CommNode, inputs: Inputs, reduce: Any) -> list[Any]:
    """One node's inputs reduced by ``reduce(group, node, flat buffer)``, in place."""
    if group.size == 1:
        return list(inputs)
    where, buf = _bucket(node, inputs)
    reduce(group, node, buf.reshape(-1))
    return [buf] if where else unflatten(buf, inputs)


IMPLEMENTATIONS: list[AllReduceImpl] = [SharedMemoryAllReduce(), MpiAllReduce(),
                                        CompressedAllReduce(), AlgorithmAllReduce(),
                                        ExactAllReduce()]


def register_implementation(impl: AllReduceImpl, before: str | None = None) -> AllReduceImpl:
    """Adds ``impl`` to ``IMPLEMENTATIONS``: before the one named ``before``, else last."""
    names = [i.name for i in IMPLEMENTATIONS]
    if impl.name in names:
        raise CommError(f"an AllReduce implementation named {impl.name!r} is registered "
                        "already")
    IMPLEMENTATIONS.insert(names.index(before) if before in names else len(names), impl)
    return impl


def choose(request: CommNode, group: ProcessGroup | None) -> AllReduceImpl:
    """The first implementation of ``IMPLEMENTATIONS`` enabled for ``request``."""
    for impl in IMPLEMENTATIONS:
        if impl.enabled(request, group):
            return impl
    raise CommError(f"no AllReduce implementation takes ngdist.AllReduce '{request.name}' "
                    f"(attributes {request.attributes}); implementations: "
                    f"{[i.name for i in IMPLEMENTATIONS]}")


def _chosen(node: CommNode, group: ProcessGroup) -> AllReduceImpl:
    """The node's implementation, chosen at its first call (kept in the kernel's state)."""
    impl = node.state.get("implementation")
    if impl is None:
        impl = node.state["implementation"] = choose(node, group)
    return impl


def allreduce_batch(group: ProcessGroup, nodes: Sequence[CommNode],
                    inputs: Sequence[Inputs]) -> list[list[Any]]:
    """Nodes that run one after another: the batchable ones with one call of the group."""
    impls = [_chosen(node, group) for node in nodes]
    if all(i.batchable for i in impls):
        outs = MpiAllReduce().execute(group, nodes, inputs)
        for impl, node, xs, out in zip(impls, nodes, inputs, outs):
            if len(out) == 1 and in_place(node, xs):
                impl.after(group, node, out[0])
        return outs
    return [impl.execute(group, [node], [xs])[0] for impl, node, xs in zip(impls, nodes, inputs)]


def allreduce(group: ProcessGroup, node: CommNode, inputs: Inputs) -> list[Any]:
    """Sum (or mean) over the ranks by the node's implementation (see the module docstring)."""
    return _chosen(node, group).execute(group, [node], [inputs])[0]


def explain(node: CommNode, group: ProcessGroup | None) -> tuple[str, str]:
    """The implementation that takes ``node`` (on ``group``; None: from the file alone), and
    when it is taken."""
    impl = choose(node, group)
    return impl.name, impl.when


def alone_identity(attributes: dict[str, Any]) -> bool:
    """On one rank every AllReduce but the exact one is the identity."""
    return attributes["algorithm"] != "exact"


__all__ = ["AllReduceImpl", "IMPLEMENTATIONS", "allreduce", "allreduce_batch", "choose",
           "register_implementation"]
