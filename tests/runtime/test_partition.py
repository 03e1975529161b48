"""The partitioner (runtime/partition.py) on small hand-built graphs with ngdist comm nodes."""
from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from ngdist.ir.domain import DOMAIN
from ngdist.runtime.partition import CommCall, Segment, plan


def node(op: str, inputs: list[str], outputs: list[str], name: str, **attrs) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, name=name, **attrs)


def comm(op: str, inputs: list[str], outputs: list[str], name: str) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, name=name, domain=DOMAIN)


def graph(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str],
          initializers: tuple[str, ...] = ()) -> onnx.GraphProto:
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2])  # noqa: E731
    inits = [helper.make_tensor(n, TensorProto.FLOAT, [2], [1.0, 2.0]) for n in initializers]
    return helper.make_graph(nodes, "g", [vi(n) for n in inputs], [vi(n) for n in outputs],
                             initializer=inits)


def layout(items) -> list:
    """Each item as ('seg', [node names]) or ('comm', node name)."""
    return [("seg", [n.name for n in it.nodes]) if isinstance(it, Segment)
            else ("comm", it.node.name) for it in items]


def assert_topological(g: onnx.GraphProto, items) -> None:
    """Every value a node reads is a graph input/initializer or was made earlier in the plan,
    and every node of the graph is planned exactly once."""
    available = {i.name for i in g.input} | {t.name for t in g.initializer}
    seen = []
    for it in items:
        for n in (it.nodes if isinstance(it, Segment) else [it.node]):
            missing = [i for i in n.input if i and i not in available]
            assert not missing, (n.name, missing)
            available.update(n.output)
            seen.append(n.name)
    assert sorted(seen) == sorted(n.name for n in g.node)


def backward_with_two_buckets() -> onnx.GraphProto:
    """A backward pass as the bucketing pass leaves it: each bucket's AllReduce right after
    its last gradient, the updates at the end, and one update placed (badly) early."""
    nodes = [
        node("Mul", ["x", "w2"], ["g2"], "grad2"),              # last layer's gradient first
        comm("AllReduce", ["g2"], ["g2r"], "bucket0"),
        node("Sub", ["w2", "g2r"], ["w2new"], "update2"),        # needs bucket 0's result
        node("Mul", ["x", "w1"], ["h"], "backward1a"),           # the rest of the backward
        node("Mul", ["h", "w1"], ["g1"], "grad1"),
        comm("AllReduce", ["g1"], ["g1r"], "bucket1"),
        node("Sub", ["w1", "g1r"], ["w1new"], "update1"),
        node("Add", ["w1new", "w2new"], ["total"], "sum_params"),
    ]
    return graph(nodes, ["x", "w1", "w2"], ["w1new", "w2new", "total"])


def test_a_graph_without_comm_is_one_segment():
    g = graph([node("Relu", ["x"], ["a"], "relu"), node("Neg", ["a"], ["y"], "neg")],
              ["x"], ["y"])
    items = plan(g)
    assert layout(items) == [("seg", ["relu", "neg"])]
    assert (items[0].index, items[0].inputs, items[0].outputs) == (0, ["x"], ["y"])


def test_an_empty_graph_has_no_items():
    assert plan(graph([], ["x"], ["x"])) == []


def test_a_bucket_is_issued_before_the_rest_of_the_backward_pass():
    g = backward_with_two_buckets()
    items = plan(g)
    assert layout(items) == [
        ("seg", ["grad2"]),
        ("comm", "bucket0"),                   # in flight while ...
        ("seg", ["backward1a", "grad1"]),      # ... the rest of the backward pass runs
        ("comm", "bucket1"),
        ("seg", ["update2", "update1", "sum_params"]),  # the updates wait for the results
    ]
    assert [it.index for it in items] == [0, 1, 2, 3, 4]
    assert all(isinstance(it, CommCall) == (i in (1, 3)) for i, it in enumerate(items))
    assert_topological(g, items)


def test_segments_are_wired():
    items = plan(backward_with_two_buckets())
    seg0, seg2, seg4 = items[0], items[2], items[4]
    assert (seg0.inputs, seg0.outputs) == (["x", "w2"], ["g2"])
    assert (seg2.inputs, seg2.outputs) == (["x", "w1"], ["g1"])  # h stays inside
    assert (seg4.inputs, seg4.outputs) == (["w2", "g2r", "w1", "g1r"],
                                           ["w2new", "w1new", "total"])
    assert list(items[1].node.input) == ["g2"] and list(items[1].node.output) == ["g2r"]


def test_a_comm_nodes_consumers_come_after_it():
    g = backward_with_two_buckets()
    items = plan(g)
    position = {}
    for it in items:
        for n in (it.nodes if isinstance(it, Segment) else [it.node]):
            position[n.name] = it.index
    for it in items:
        if isinstance(it, CommCall):
            for other in g.node:
                if set(other.input) & set(it.node.output):
                    assert position[other.name] > it.index, (other.name, it.node.name)


def test_chained_comm_nodes_raise_the_stage_each_time():
    nodes = [
        node("Relu", ["x"], ["a"], "a"),
        comm("AllReduce", ["a"], ["ar"], "c1"),
        node("Neg", ["ar"], ["b"], "b"),
        node("Relu", ["x"], ["z"], "independent"),   # stage 0: moves before c1's consumer b
        comm("Broadcast", ["b"], ["br"], "c2"),
        node("Add", ["br", "z"], ["y"], "y"),
        node("Add", ["ar", "z"], ["y2"], "y2"),      # stage 1, but after b in the graph
    ]
    g = graph(nodes, ["x"], ["y", "y2"])
    items = plan(g)
    # stages: a, c1, independent 0; b, c2, y2 1; y 2
    assert layout(items) == [("seg", ["a"]), ("comm", "c1"), ("seg", ["independent", "b"]),
                             ("comm", "c2"), ("seg", ["y2", "y"])]
    assert (items[2].inputs, items[2].outputs) == (["x", "ar"], ["z", "b"])
    assert (items[4].inputs, items[4].outputs) == (["ar", "z", "br"], ["y2", "y"])
    assert_topological(g, items)


def test_stage_order_keeps_independent_work_before_the_comm_result_is_needed():
    nodes = [
        node("Relu", ["x"], ["a"], "a"),
        comm("AllReduce", ["a"], ["ar"], "c1"),
        node("Neg", ["ar"], ["b"], "b"),
        node("Relu", ["x"], ["z"], "independent"),
        node("Add", ["b", "z"], ["y"], "y"),
    ]
    g = graph(nodes, ["x"], ["y"])
    items = plan(g)
    assert layout(items) == [("seg", ["a"]), ("comm", "c1"), ("seg", ["independent", "b", "y"])]
    assert_topological(g, items)
    assert (items[2].inputs, items[2].outputs) == (["x", "ar"], ["y"])


def test_initializers_and_graph_inputs_feed_segments():
    nodes = [node("Add", ["x", "bias"], ["a"], "add"),
             comm("AllReduce", ["a"], ["ar"], "c"),
             node("Mul", ["ar", "scale"], ["y"], "mul")]
    g = graph(nodes, ["x"], ["y"], initializers=("bias", "scale"))
    items = plan(g)
    assert layout(items) == [("seg", ["add"]), ("comm", "c"), ("seg", ["mul"])]
    assert (items[0].inputs, items[0].outputs) == (["x", "bias"], ["a"])
    assert (items[2].inputs, items[2].outputs) == (["ar", "scale"], ["y"])


def test_a_value_read_by_a_later_segment_and_the_comm_node_is_an_output():
    nodes = [node("Relu", ["x"], ["a"], "relu"),
             comm("AllReduce", ["a"], ["ar"], "c"),
             node("Add", ["ar", "a"], ["y"], "add")]
    items = plan(graph(nodes, ["x"], ["y"]))
    assert items[0].outputs == ["a"]
    assert items[2].inputs == ["ar", "a"]


def test_a_value_used_inside_its_segment_only_is_not_an_output():
    nodes = [node("Relu", ["x"], ["a"], "relu"),
             node("Neg", ["a"], ["b"], "neg"),
             comm("AllReduce", ["b"], ["br"], "c")]
    items = plan(graph(nodes, ["x"], ["br"]))
    assert layout(items) == [("seg", ["relu", "neg"]), ("comm", "c")]
    assert (items[0].inputs, items[0].outputs) == (["x"], ["b"])


def test_a_step_output_made_early_is_an_output_of_its_segment():
    nodes = [node("Relu", ["x"], ["loss"], "loss"),
             node("Neg", ["x"], ["g"], "grad"),
             comm("AllReduce", ["g"], ["gr"], "c"),
             node("Add", ["gr", "x"], ["w"], "update")]
    items = plan(graph(nodes, ["x"], ["loss", "w"]))
    assert items[0].outputs == ["loss", "g"]
    assert items[2].outputs == ["w"]


def test_optional_empty_inputs_are_ignored():
    clip = node("Clip", ["x", "", "hi"], ["y"], "clip")
    items = plan(graph([clip], ["x", "hi"], ["y"]))
    assert items[0].inputs == ["x", "hi"]


def test_comm_op_of_another_domain_is_compute():
    """Only ops of the ngdist domain cut the graph."""
    nodes = [node("Identity", ["x"], ["a"], "plain_identity"),
             helper.make_node("AllReduce", ["a"], ["y"], name="foreign", domain="com.other")]
    assert layout(plan(graph(nodes, ["x"], ["y"]))) == [("seg", ["plain_identity", "foreign"])]


@pytest.mark.parametrize("first", ["AllGather", "ReduceScatter", "Broadcast", "PushSum"])
def test_every_comm_op_cuts(first):
    nodes = [node("Relu", ["x"], ["a"], "relu"), comm(first, ["a"], ["b"], "c"),
             node("Neg", ["b"], ["y"], "neg")]
    assert layout(plan(graph(nodes, ["x"], ["y"]))) == [("seg", ["relu"]), ("comm", "c"),
                                                        ("seg", ["neg"])]


def test_a_comm_node_on_a_graph_input_comes_first():
    nodes = [comm("Broadcast", ["w"], ["w0"], "initial"),
             node("Mul", ["x", "w0"], ["y"], "mul")]
    items = plan(graph(nodes, ["x", "w"], ["y"]))
    assert layout(items) == [("comm", "initial"), ("seg", ["mul"])]
    assert (items[1].index, items[1].inputs, items[1].outputs) == (1, ["x", "w0"], ["y"])


def test_without_overlap_the_comm_nodes_of_a_stage_come_after_its_compute():
    # communication on the calling thread gains nothing from cutting the backward pass:
    # one compute segment, the buckets in their order, then the updates
    g = backward_with_two_buckets()
    items = plan(g, defer_comm=True)
    assert layout(items) == [
        ("seg", ["grad2", "backward1a", "grad1"]),
        ("comm", "bucket0"),
        ("comm", "bucket1"),
        ("seg", ["update2", "update1", "sum_params"]),
    ]
    assert_topological(g, items)


def momentum_step() -> onnx.GraphProto:
    """One parameter w with momentum v and a step counter t: the gradient's AllReduce, the
    update of v and w after it, ``mu * v`` (no communicated input) and the counter among it."""
    nodes = [
        node("Mul", ["x", "w"], ["g"], "grad"),
        comm("AllReduce", ["g"], ["gr"], "bucket0"),
        node("Mul", ["v", "mu"], ["vm"], "decay"),             # needs no communicated value
        node("Add", ["vm", "gr"], ["v.new"], "momentum"),
        node("Mul", ["v.new", "lr"], ["delta"], "scale"),
        node("Sub", ["w", "delta"], ["w.new"], "update"),
        node("Add", ["t", "one"], ["t.new"], "counter"),        # read by no node at all
    ]
    return graph(nodes, ["x", "w", "v", "t"], ["w.new", "v.new", "t.new"],
                 initializers=("mu", "lr", "one"))


UPDATED = frozenset({"w.new", "v.new", "t.new"})
DONATED = frozenset({"w", "v", "t"})


@pytest.mark.parametrize("defer_comm", [True, False])
def test_the_whole_update_follows_the_comm_nodes(defer_comm):
    # mu * v and the counter need no communicated value; they still join the update after
    # the AllReduce instead of a segment of their own before it
    g = momentum_step()
    items = plan(g, defer_comm=defer_comm, updated=UPDATED, donated=DONATED)
    assert layout(items) == [
        ("seg", ["grad"]),
        ("comm", "bucket0"),
        ("seg", ["decay", "momentum", "scale", "update", "counter"]),
    ]
    assert_topological(g, items)
