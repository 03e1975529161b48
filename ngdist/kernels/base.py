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

import math
from collections.abc import Callable, Sequence
from dataclasses import FrozenInstanceError, dataclass, field
from typing import TYPE_CHECKING, Any


from ngdist.comm.group import array_module
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
    # where the inputs live: "host" (numpy arrays), or "device" (arrays of the placement's
    # array module, which a host group cannot read: kernels/host_staged.py)
    memory: str = "host"


@dataclass(frozen=True)
class WriteInto:
    """A kernel's request to the runtime: write input ``index`` of the node's next call into
    ``array`` (memory the kernel owns, such as its symmetric memory)."""

    index: int
    array: Any


@dataclass
class CommNode:
    """What a kernel sees of a comm node: its name and attributes (every one the op has,
    defaults filled in), the runtime's facts (read-only), ``state``, the kernel's own
    (private, lives across steps), and ``requests``, what the kernel asks of the runtime
    (read by the runtime only)."""

    op_type: str
    name: str
    attributes: dict[str, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    facts: CommFacts = CommFacts()
    requests: tuple[WriteInto, ...] = ()  # the kernel's, for its next call (runtime reads)

    def __post_init__(self) -> None:  # every attribute the op has, at its default if left out
        self.attributes = with_defaults(self.op_type, self.attributes)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "facts" and "facts" in self.__dict__:
            raise FrozenInstanceError(f"comm node '{self.name}': its facts are the step plan's, "
                                      "set once when the plan is made (runtime/plan.py "
                                      "build_plan)")
        super().__setattr__(name, value)


# kernel(group, node, inputs) -> one array per output
Kernel = Callable[["ProcessGroup", CommNode, Sequence[Any]], list[Any]]
# drain(group, node) -> what communication in flight brings, one array per output, or None
Drain = Callable[["ProcessGroup", CommNode], "list[Any] | None"]
Close = Callable[[CommNode], None]
Predicate = Callable[[dict[str, Any]], bool]  # on a node's attributes
# batch(group, nodes, inputs of each) -> outputs of each
Batch = Callable[["ProcessGroup", Sequence[CommNode], Sequence[Sequence[Any]]], list[list[Any]]]
# explain(node, group or None) -> (the implementation that runs the node, when it is taken)
Explain = Callable[[CommNode, "ProcessGroup | None"], tuple[str, str]]


def _never(attributes: dict[str, Any]) -> bool:
    return False


@dataclass
class KernelSpec:
    """A registered kernel: the function, the memory it reads (``host``: numpy arrays;
    ``any``: arrays of the placement's array module, comm/group.py's ``array_module``), and
    its optional hooks."""

    op_type: str
    fn: Kernel
    memory: str = "host"
    drain: Drain | None = None
    close: Close | None = None
    # whether the op is the identity on a group of one rank, given the node's attributes
    alone_identity: Predicate = _never
    # several nodes of the op that run one after another, as one call, for the nodes whose
    # attributes ``batchable`` accepts
    batch: Batch | None = None
    batchable: Predicate = _never
    # which implementation runs a node, and why (an op with several; ngdist inspect --explain)
    explain: Explain | None = None

    def __call__(self, group: ProcessGroup, node: CommNode, inputs: Sequence[Any]) -> list[Any]:
        return self.fn(group, node, inputs)


KERNELS: dict[str, KernelSpec] = {}


def register_kernel(op_type: str, memory: str = "host", drain: Drain | None = None,
                    close: Close | None = None, alone_identity: bool | Predicate | None = None,
                    batch: Batch | None = None, batchable: Predicate | None = None,
                    explain: Explain | None = None) -> Callable[[Kernel], Kernel]:
    """``alone_identity``: True, or a predicate on the node's attributes, when the op is the
    identity on a group of one rank (the runtime then runs it as onnxruntime Identity nodes
    inside a segment, without cutting the step). ``batch``: the kernel of several nodes that
    run one after another (their outputs in the same results as one by one), for the nodes
    whose attributes ``batchable`` accepts."""
    def wrap(fn: Kernel) -> Kernel:
        spec = KernelSpec(op_type, fn, memory, drain, close, explain=explain)
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


def flatten(arrays: Sequence[Any], node: CommNode | None = None) -> Any:
    """One contiguous buffer holding a copy of every array, for the kernels whose message
    carries several tensors (PushSum, PSPushPull, CentralReduce, AllReduce nodes that were
    not fused into one flat tensor by the bucketing pass).

    With ``node``, the buffer is kept in the node's state and reused at the next step when
    its outputs die within the step (``node.facts.outputs_die``): fresh
    multi-megabyte allocations page-fault on every call and cost as much as the copy.
    """
    xp = array_module(arrays[0])
    size = sum(a.size for a in arrays)
    dtype = xp.result_type(*arrays)
    buf = None
    if node is not None and node.facts.outputs_die:
        buf = node.state.get("buffer")
        if buf is None or buf.size != size or buf.dtype != dtype or array_module(buf) is not xp:
            buf = node.state["buffer"] = xp.empty(size, dtype)
    if buf is None:
        buf = xp.empty(size, dtype)
    offset = 0
    for a in arrays:
        buf[offset:offset + a.size] = a.reshape(-1)
        offset += a.size
    return buf


def unflatten(buffer: Any, like: Sequence[Any]) -> list[Any]:
    """Views into ``buffer`` with the shapes of ``like`` (arrays or shapes)."""
    out, offset = [], 0
    for a in like:
        shape = a.shape if hasattr(a, "shape") else tuple(a)
        n = math.prod(shape)
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
