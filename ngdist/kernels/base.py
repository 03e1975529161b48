"""The kernel registry and the uniform kernel signature.

A kernel is ``kernel(group, node, inputs) -> outputs``: ``group`` the ProcessGroup it
communicates through (comm/group.py: rank, size, timeouts, byte counter), ``node`` the comm
node's name, attributes and kernel-private state, ``inputs`` arrays in the memory the kernel
declares (``host``: numpy views of the runtime's values, no copy; ``device``: device arrays),
and the result one array per output. An input whose ``node.facts.donated[i]`` is true is produced
within the step for this node alone: the kernel may work in place on it and return it, which
is how a gradient bucket is reduced without any copy. A kernel never imports the runtime.

A kernel that keeps communication in flight across steps (PushSum with overlap) registers a
``drain(group, node)`` that completes it and returns what it brings, one array per output
(or None), and a ``close(node)``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ngdist.errors import CommError
from ngdist.ir.domain import with_defaults

if TYPE_CHECKING:
    from ngdist.comm.group import ProcessGroup


@dataclass(frozen=True)
class CommFacts:
    """What the runtime tells a kernel about a comm node's memory (read-only; the plan makes
    it once, runtime/plan.py)."""

    donated: tuple[bool, ...] = ()  # input i is made in the step for this node alone
    outputs_die: bool = False  # no output outlives the step: the kernel may keep their buffer
    # the step returns the outputs only as values that the next step's results replace (plain
    # SGD's state is the reduced gradient): they live until the end of the next step
    replaced_next_step: bool = False
    stacked: bool = False  # each input is a stack of micro-batch values (kernels/exact.py)


@dataclass
class CommNode:
    """What a kernel sees of a comm node: its name and attributes (every one the op has,
    defaults filled in), the runtime's facts, and ``state``, the kernel's own (private,
    lives across steps)."""

    op_type: str
    name: str
    attributes: dict[str, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    facts: CommFacts = CommFacts()

    def __post_init__(self) -> None:  # every attribute the op has, at its default if left out
        self.attributes = with_defaults(self.op_type, self.attributes)


Kernel = Callable[["ProcessGroup", CommNode, Sequence[np.ndarray]], list[np.ndarray]]


@dataclass
class KernelSpec:
    """A registered kernel: the function, the memory it reads, and its optional hooks."""

    op_type: str
    fn: Kernel
    memory: str = "host"
    drain: Callable[[Any, CommNode], list[np.ndarray] | None] | None = None
    close: Callable[[CommNode], None] | None = None
    # whether the op is the identity on a group of one rank, given the node's attributes
    alone_identity: Callable[[dict[str, Any]], bool] = lambda attributes: False
    # several nodes of the op that run one after another, as one call:
    # batch(group, nodes, inputs of each) -> outputs of each, for the nodes whose attributes
    # ``batchable`` accepts
    batch: Callable[[Any, list[CommNode], list[Sequence[Any]]], list[list[Any]]] | None = None
    batchable: Callable[[dict[str, Any]], bool] = lambda attributes: False

    def __call__(self, group: ProcessGroup, node: CommNode, inputs: Sequence[Any]) -> list[Any]:
        return self.fn(group, node, inputs)


KERNELS: dict[str, KernelSpec] = {}


def register_kernel(op_type: str, memory: str = "host", drain: Any = None,
                    close: Any = None, alone_identity: Any = None, batch: Any = None,
                    batchable: Any = None) -> Callable[[Kernel], Kernel]:
    """``alone_identity``: True, or a predicate on the node's attributes, when the op is the
    identity on a group of one rank (the runtime then runs it as onnxruntime Identity nodes
    inside a segment, without cutting the step). ``batch``: the kernel of several nodes that
    run one after another (their outputs in the same results as one by one), for the nodes
    whose attributes ``batchable`` accepts."""
    def wrap(fn: Kernel) -> Kernel:
        spec = KernelSpec(op_type, fn, memory, drain, close)
        if batch is not None:  # (for every node of the op unless ``batchable`` says)
            spec.batch = batch
            spec.batchable = batchable or (lambda attributes: True)
        if alone_identity is not None:
            spec.alone_identity = alone_identity if callable(alone_identity) else \
                (lambda attributes: bool(alone_identity))
        KERNELS[op_type] = spec
        return fn

    return wrap


def get_kernel(op_type: str) -> KernelSpec:
    try:
        return KERNELS[op_type]
    except KeyError:
        raise CommError(f"no kernel for ngdist.{op_type}; kernels exist for "
                        f"{sorted(KERNELS)}") from None


def donated(node: CommNode, i: int) -> bool:
    """Whether input ``i`` is made in the step for this node alone (may be reused in place)."""
    return i < len(node.facts.donated) and node.facts.donated[i]


def flatten(arrays: Sequence[np.ndarray], node: CommNode | None = None) -> np.ndarray:
    """One contiguous buffer holding a copy of every array, for the kernels whose message
    carries several tensors (PushSum, PSPushPull, CentralReduce, AllReduce nodes that were
    not fused into one flat tensor by the bucketing pass).

    With ``node``, the buffer is kept in the node's state and reused at the next step when
    its outputs die within the step (``node.facts.outputs_die``): fresh
    multi-megabyte allocations page-fault on every call and cost as much as the copy.
    """
    size = sum(a.size for a in arrays)
    dtype = np.result_type(*arrays)
    buf = None
    if node is not None and node.facts.outputs_die:
        buf = node.state.get("buffer")
        if buf is None or buf.size != size or buf.dtype != dtype:
            buf = node.state["buffer"] = np.empty(size, dtype)
    if buf is None:
        buf = np.empty(size, dtype)
    offset = 0
    for a in arrays:
        buf[offset:offset + a.size] = a.reshape(-1)
        offset += a.size
    return buf


def unflatten(buffer: np.ndarray, like: Sequence[Any]) -> list[np.ndarray]:
    """Views into ``buffer`` with the shapes of ``like`` (arrays or shapes)."""
    out, offset = [], 0
    for a in like:
        shape = a.shape if hasattr(a, "shape") else tuple(a)
        n = int(np.prod(shape, dtype=np.int64))
        out.append(buffer[offset:offset + n].reshape(shape))
        offset += n
    return out


def private_group(group: ProcessGroup, key: Any, make: Callable[[ProcessGroup], Any]) -> Any:
    """A group derived from ``group`` by ``make`` (collective: created the first time every
    rank reaches this point, in program order), kept in ``group.derived`` under ``key``, so
    that one algorithm's messages never match another's. Kept on the group itself: a cache
    keyed by ``id(group)`` could hand a new group a dead one's derivative on some ranks."""
    if key not in group.derived:
        group.derived[key] = make(group)
    return group.derived[key]
