"""The step plan: built once from the step graph by small pure functions, then run.

As torch.fx's Interpreter runs a graph and tinygrad's scheduler plans its buffers before
``run_linear``: :func:`build_plan` turns a step graph into an immutable :class:`StepPlan` (the
items in program order, where each value is read last, which comm items run as one call,
which inputs the step may write over, the facts each comm node's kernel is given), and the
Executor (runtime/executor.py) runs it. Nothing here runs a session or a kernel.

The graph is first rewritten by the runtime's own passes (runtime/rewrites.py): nodes no step
output depends on are left out, and on one rank comm ops that are the identity there become
Identity nodes inside a segment.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import onnx

from ngdist.errors import NgdistError
from ngdist.ir.domain import DOMAIN, PREVIEW_TRAINING, comm_attributes
from ngdist.kernels import CommNode, KernelSpec, get_kernel
from ngdist.kernels.base import CommFacts
from ngdist.runtime.inplace import MIN_ELEMENTS
from ngdist.runtime.partition import CommCall, Item, Segment, plan as partition, readers_of
from ngdist.runtime.rewrites import runtime_rewrites


@dataclass(frozen=True)
class StepPlan:
    """What one step runs, and what each item may do with memory (see the module docstring).

    ``last_use``: value -> the last item that reads it; ``free_after``: item -> the values
    dropped once it has run; ``donated``: inputs whose memory the update may write its results
    into; ``made_by_segment``: values a segment makes; ``comm_touched``: values a comm node
    reads or makes (it may hold them beyond its item); ``reduced``: AllReduce results on
    several ranks that die within the step (memory a later segment may write over);
    ``batches``: first item -> the comm items run as one call from it; ``comm_input``: value
    -> (comm item, input position) of a value made for that comm node alone."""

    items: tuple[Item, ...]
    outputs: tuple[str, ...]
    constants: Mapping[str, onnx.TensorProto]
    opsets: tuple[onnx.OperatorSetIdProto, ...]
    comm_nodes: Mapping[int, CommNode]
    kernels: Mapping[int, KernelSpec]
    donated: frozenset[str]
    last_use: Mapping[str, int]
    free_after: Mapping[int, tuple[str, ...]]
    made_by_segment: frozenset[str]
    comm_touched: frozenset[str]
    reduced: frozenset[str]
    batches: Mapping[int, tuple[int, ...]]
    comm_input: Mapping[str, tuple[int, int]]

    @property
    def in_batch(self) -> frozenset[int]:
        """The comm items a batch that starts before them runs."""
        return frozenset(i for run in self.batches.values() for i in run[1:])

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(item for item in self.items if isinstance(item, Segment))


def item_inputs(item: Item) -> list[str]:
    return item.inputs if isinstance(item, Segment) else list(item.node.input)


def last_uses(items: Iterable[Item]) -> tuple[dict[str, int], dict[str, int]]:
    """({value: how many items read it}, {value: the last item that reads it})."""
    uses: dict[str, int] = {}
    last: dict[str, int] = {}
    for item in items:
        for name in item_inputs(item):
            uses[name] = uses.get(name, 0) + 1
            last[name] = item.index
    return uses, last


def free_after(last: Mapping[str, int], keep: Iterable[str]) -> dict[int, tuple[str, ...]]:
    """{item: the values nothing reads after it}, but those of ``keep``."""
    kept = set(keep)
    out: dict[int, list[str]] = {}
    for name, idx in last.items():
        if name not in kept:
            out.setdefault(idx, []).append(name)
    return {k: tuple(v) for k, v in out.items()}


def worth_in_place(graph: onnx.GraphProto, donated: Iterable[str]) -> bool:
    """Whether the update is worth a segment of its own, written in place: when the donated
    values large enough to be written in place (``inplace.MIN_ELEMENTS``) hold at least half
    of the donated elements. The cut costs a segment's inputs and outputs; models of many
    small tensors lose more there than in place gains (benchmarks/inplace_ops.py)."""
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in graph.initializer}
    for v in graph.input:
        dims = v.type.tensor_type.shape.dim
        if v.name not in sizes and all(d.HasField("dim_value") for d in dims):
            sizes[v.name] = int(np.prod([d.dim_value for d in dims], dtype=np.int64))
    known = [sizes[x] for x in donated if x in sizes]
    large = sum(n for n in known if n >= MIN_ELEMENTS)
    return large > 0 and 2 * large >= sum(known)


def donation(graph: onnx.GraphProto, donate: Mapping[str, str]) -> frozenset[str]:
    """The inputs of ``donate`` ({input: the step output that replaces it}) whose memory the
    update may write into: none a comm node touches (it may hold them in flight), none when a
    kernel keeps communication in flight across steps, none when it is not worth it."""
    comm = [n for n in graph.node if n.domain == DOMAIN]
    if any(get_kernel(n.op_type).drain is not None for n in comm):
        return frozenset()
    outputs = {o.name for o in graph.output}
    touched = {x for n in comm for x in (*n.input, *n.output)}
    donated = frozenset(x for x, out in donate.items()
                        if x not in outputs and not touched.intersection((x, out)))
    return donated if worth_in_place(graph, donated) else frozenset()


def comm_facts(node: onnx.NodeProto, uses: Mapping[str, int], made: frozenset[str],
               outputs: frozenset[str], replacing: frozenset[str], memory: str = "host",
               stacked: frozenset[str] = frozenset()) -> CommFacts:
    """What the runtime tells the kernel of comm node ``node`` about its memory; ``stacked``:
    the values that arrive as a stack of micro-batch values (reproducible mode)."""
    return CommFacts(
        stacked=bool(node.input) and all(x in stacked for x in node.input),
        memory=memory,
        # an input made in this step for this node alone may be reused in place
        donated=tuple(x in made and uses.get(x) == 1 and x not in outputs for x in node.input),
        outputs_die=not outputs.intersection(node.output),
        # outputs the step returns only as values the next step's results replace
        # (plain SGD's state is the reduced gradient): they live one step longer
        replaced_next_step=bool(replacing) and outputs.intersection(node.output) <= replacing)


def comm_batches(items: Iterable[Item], nodes: Mapping[int, CommNode],
                 kernels: Mapping[int, KernelSpec]) -> dict[int, tuple[int, ...]]:
    """{the first item: the items} of every run of two or more comm items, one after another,
    whose kernel has a batch form that takes them, none reading another's result."""
    def batchable(item: Item | None) -> KernelSpec | None:
        if item is None or item.index not in nodes:
            return None
        spec = kernels[item.index]
        fits = spec.batch is not None and spec.batchable(nodes[item.index].attributes)
        return spec if fits else None

    batches: dict[int, tuple[int, ...]] = {}
    run: list[int] = []
    for item in [*items, None]:
        spec = batchable(item)
        if spec is not None and run and spec is kernels[run[0]] and not any(
                set(nodes[item.index].inputs).intersection(nodes[i].outputs) for i in run):
            run.append(item.index)
            continue
        if len(run) > 1:
            batches[run[0]] = tuple(run)
        run = [item.index] if spec is not None else []
    return batches


def reduced_values(nodes: Iterable[CommNode], group_size: int) -> frozenset[str]:
    """Results of AllReduce on several ranks that die within the step: the reduced bucket (its
    donated input, the node's reused buffer, or its symmetric memory, which no other rank
    touches once the call is over) may take results in place like a gradient."""
    return frozenset(x for node in nodes
                     if node.op_type == "AllReduce" and group_size > 1
                     and node.attributes["algorithm"] != "exact" and node.facts.outputs_die
                     for x in node.outputs)


def build_plan(model: onnx.ModelProto, group_size: int, *, overlap: bool = True,
               inline_alone: bool = True, donate: Mapping[str, str] | None = None,
               host_memory: bool = True, memory: str = "host",
               stacked: Iterable[str] = ()) -> StepPlan:
    """The plan of ``model``'s step on a group of ``group_size`` ranks (see the module
    docstring); ``host_memory``: values live in host memory (kernels may ask for their inputs
    to be written into memory of their own); ``memory``: where the kernels' inputs are
    (``CommFacts.memory``); ``stacked``: inputs fed as stacks of micro-batch values (a comm
    node that reads only such values is told so, ``CommFacts.stacked``)."""
    if any(n.domain == PREVIEW_TRAINING for n in model.graph.node):
        raise NgdistError("the step graph still holds ai.onnx.preview.training ops; run the "
                          "pass pipeline (ngdist.passes.pipeline.run_passes) first")
    graph = runtime_rewrites(model, group_size, inline_alone).graph
    donate = dict(donate or {})
    donated = donation(graph, donate)
    items = tuple(partition(graph, defer_comm=not overlap, donated=donated,
                            updated=frozenset(donate[x] for x in donated),
                            readers=readers_of(graph.node)))
    uses, last = last_uses(items)
    made = frozenset(o for s in items if isinstance(s, Segment) for o in s.outputs)
    outputs = tuple(o.name for o in graph.output)
    replacing = frozenset(donate.values())
    stacked = frozenset(stacked)
    nodes: dict[int, CommNode] = {}
    for item in items:
        if isinstance(item, CommCall):
            n = item.node
            nodes[item.index] = CommNode(
                n.op_type, n.name, comm_attributes(n), list(n.input), list(n.output),
                facts=comm_facts(n, uses, made, frozenset(outputs), replacing, memory,
                                 stacked))
    kernels = {i: get_kernel(node.op_type) for i, node in nodes.items()}
    comm_input = {name: (i, k) for i, node in nodes.items() if host_memory
                  for k, name in enumerate(node.inputs) if node.facts.donated[k]}
    inputs = {i.name for i in graph.input}
    return StepPlan(
        items=items, outputs=outputs,
        constants=MappingProxyType({t.name: t for t in graph.initializer
                                    if t.name not in inputs}),
        opsets=tuple(o for o in model.opset_import if o.domain != DOMAIN),
        comm_nodes=MappingProxyType(nodes), kernels=MappingProxyType(kernels),
        donated=donated, last_use=MappingProxyType(last),
        free_after=MappingProxyType(free_after(last, (*outputs, *donated))),
        made_by_segment=made,
        comm_touched=frozenset(x for node in nodes.values() for x in (*node.inputs,
                                                                        *node.outputs)),
        reduced=reduced_values(nodes.values(), group_size),
        batches=MappingProxyType({} if overlap else comm_batches(items, nodes, kernels)),
        comm_input=MappingProxyType(comm_input))
