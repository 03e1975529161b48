"""The step plan (runtime/plan.py) and the runtime's rewrites (runtime/rewrites.py): what the
small functions decide, checked on graphs whose answer is known by hand."""
from __future__ import annotations

import dataclasses

import onnx
import pytest
from onnx import TensorProto, helper

from ngdist.ir.domain import DOMAIN
from ngdist.ir.model import IR_VERSION
from ngdist.runtime.partition import CommCall, Segment
from ngdist.runtime.plan import build_plan, free_after, last_uses
from ngdist.runtime.rewrites import runtime_rewrites


def model(nodes, inputs, outputs) -> onnx.ModelProto:
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [4])  # noqa: E731
    graph = helper.make_graph(nodes, "g", [vi(x) for x in inputs], [vi(x) for x in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(DOMAIN, 1)],
                             ir_version=IR_VERSION)


def allreduce(inp, out, name, **attrs):
    return helper.make_node("AllReduce", [inp], [out], name=name, domain=DOMAIN, **attrs)


def two_buckets(second_input: str = "h") -> onnx.ModelProto:
    return model([helper.make_node("Mul", ["x", "w"], ["g"], name="mul"),
                  helper.make_node("Add", ["x", "w"], ["h"], name="add"),
                  allreduce("g", "gr", "b0", bucket=0), allreduce(second_input, "hr", "b1", bucket=1),
                  helper.make_node("Sub", ["gr", "hr"], ["y"], name="sub")],
                 ["x", "w"], ["y"])


def test_nodes_no_output_needs_are_left_out_comm_nodes_too():
    m = model([helper.make_node("Mul", ["x", "w"], ["y"], name="live"),
               helper.make_node("Neg", ["x"], ["dead"], name="dead"),
               allreduce("dead", "dead_r", "dead_comm"),
               helper.make_node("Abs", ["dead_r"], ["dead2"], name="dead2")], ["x", "w"], ["y"])
    for size in (1, 2):
        out = runtime_rewrites(m, size)
        assert [n.name for n in out.graph.node] == ["live"]
    kept = runtime_rewrites(m := two_buckets(), 2)
    assert kept is m  # nothing changed: the graph is handed back as it is


def _with_if(then_nodes, then_outputs, outer_nodes, outputs) -> onnx.ModelProto:
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [4])  # noqa: E731
    branch = helper.make_graph(then_nodes, "then", [], [vi(o) for o in then_outputs])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [vi("e")])
    cond = helper.make_node("If", ["c"], ["r"], name="if", then_branch=branch, else_branch=other)
    m = model([*outer_nodes, cond], ["x", "w"], outputs)
    m.graph.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    return m


def test_whether_anything_is_unused_is_read_from_the_proto_as_the_pass_finds_it(monkeypatch):
    """The proto check agrees with onnx_ir's RemoveUnusedNodesPass (dead nodes in the graph
    or a subgraph, values read only from a subgraph, unused initializers, outputs left
    out); a graph with nothing to remove is handed back without an onnx_ir round trip."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from ngdist.runtime.rewrites import _has_unused

    mul, neg = helper.make_node("Mul", ["x", "w"], ["y"]), helper.make_node("Neg", ["x"], ["n"])
    unused_init = model([mul], ["x", "w"], ["y"])
    unused_init.graph.initializer.append(helper.make_tensor("k", TensorProto.FLOAT, [1], [1.0]))
    cases = {
        "live": model([mul], ["x", "w"], ["y"]),
        "dead node": model([mul, neg], ["x", "w"], ["y"]),
        "unused initializer": unused_init,
        "output left out": model([mul, helper.make_node("Split", ["n"], ["", ""], axis=0,
                                                        num_outputs=2), neg], ["x", "w"], ["y"]),
        "read by a subgraph": _with_if([helper.make_node("Abs", ["n"], ["t"])], ["t"],
                                       [neg], ["r"]),
        "dead in a subgraph": _with_if([helper.make_node("Abs", ["x"], ["t"]),
                                        helper.make_node("Neg", ["x"], ["d"])], ["t"], [], ["r"]),
    }
    for name, m in cases.items():
        expected = RemoveUnusedNodesPass()(ir.from_proto(m)).modified
        assert _has_unused(m) == expected, name
        assert expected == (name not in ("live", "read by a subgraph")), name
    monkeypatch.setattr(ir, "from_proto", lambda *a: pytest.fail("converted to onnx_ir"))
    for name in ("live", "read by a subgraph"):
        assert runtime_rewrites(cases[name], 2) is cases[name]


def test_on_one_rank_identity_comm_nodes_become_identity_nodes():
    m = two_buckets()
    one = runtime_rewrites(m, 1)
    assert [(n.op_type, n.name) for n in one.graph.node] == [
        ("Mul", "mul"), ("Add", "add"), ("Identity", "b0/0"), ("Identity", "b1/0"),
        ("Sub", "sub")]
    assert [list(n.output) for n in one.graph.node][2:4] == [["gr"], ["hr"]]
    assert runtime_rewrites(m, 1, inline_alone=False).graph.node[2].op_type == "AllReduce"
    exact = model([allreduce("x", "y", "e", algorithm="exact")], ["x"], ["y"])
    assert runtime_rewrites(exact, 1).graph.node[0].op_type == "AllReduce"  # never the identity


def test_last_uses_and_what_is_freed_after_each_item():
    plan = build_plan(two_buckets(), 2, overlap=False)
    assert [type(i).__name__ for i in plan.items] == ["Segment", "CommCall", "CommCall",
                                                      "Segment"]
    uses, last = last_uses(plan.items)
    assert uses == {"x": 1, "w": 1, "g": 1, "h": 1, "gr": 1, "hr": 1}
    assert last == {"x": 0, "w": 0, "g": 1, "h": 2, "gr": 3, "hr": 3}
    assert free_after(last, ["gr"]) == {0: ("x", "w"), 1: ("g",), 2: ("h",), 3: ("hr",)}
    assert {k: sorted(v) for k, v in plan.free_after.items()} == \
        {0: ["w", "x"], 1: ["g"], 2: ["h"], 3: ["gr", "hr"]}


def test_facts_of_each_comm_node():
    plan = build_plan(two_buckets(), 2, overlap=False)
    facts = [plan.comm_nodes[i].facts for i in (1, 2)]
    assert [f.donated for f in facts] == [(True,), (True,)]  # made for it alone
    assert [f.outputs_die for f in facts] == [True, True]
    assert dict(plan.comm_input) == {"g": (1, 0), "h": (2, 0)}
    assert plan.reduced == {"gr", "hr"}
    assert build_plan(two_buckets(), 1, overlap=False, inline_alone=False).reduced == set()
    # a step output replaced next step (plain SGD's state): lives one step longer
    m = model([helper.make_node("Mul", ["x", "w"], ["g"]), allreduce("g", "v", "b0")],
              ["x", "w"], ["v"])
    (node,) = build_plan(m, 2, donate={"w": "v"}).comm_nodes.values()
    assert (node.facts.outputs_die, node.facts.replaced_next_step) == (False, True)
    (node,) = build_plan(m, 2).comm_nodes.values()
    assert (node.facts.outputs_die, node.facts.replaced_next_step) == (False, False)


def test_comm_items_in_a_row_are_one_call_unless_one_reads_another():
    plan = build_plan(two_buckets(), 2, overlap=False)
    assert dict(plan.batches) == {1: (1, 2)} and plan.in_batch == {2}
    assert dict(build_plan(two_buckets(), 2, overlap=True).batches) == {}
    chained = model([helper.make_node("Mul", ["x", "w"], ["g"]),
                     allreduce("g", "gr", "b0", bucket=0), allreduce("gr", "hr", "b1", bucket=1)],
                    ["x", "w"], ["hr"])
    assert dict(build_plan(chained, 2, overlap=False).batches) == {}


def test_the_plan_cannot_be_changed():
    plan = build_plan(two_buckets(), 2, overlap=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.donated = frozenset({"x"})
    with pytest.raises(TypeError):
        plan.comm_nodes[1] = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.comm_nodes[1].facts.donated = (False,)
    assert isinstance(plan.items[0], Segment) and isinstance(plan.items[1], CommCall)


def test_stacked_micro_batches_are_a_fact_of_the_plan_set_once():
    m = model([helper.make_node("Mul", ["x", "w"], ["g"], name="mul"),
               allreduce("g", "gr", "exact", algorithm="exact", micro_batch=2),
               allreduce("w", "wr", "plain")], ["x", "w"], ["gr", "wr"])
    plan = build_plan(m, 2, stacked={"g"})
    stacked = {n.name: n.facts.stacked for n in plan.comm_nodes.values()}
    assert stacked == {"exact": True, "plain": False}
    assert not any(n.facts.stacked for n in build_plan(m, 2).comm_nodes.values())
    node = next(n for n in plan.comm_nodes.values() if n.name == "exact")
    with pytest.raises(dataclasses.FrozenInstanceError,
                       match=r"^comm node 'exact': its facts are the step plan's, set once "
                             r"when the plan is made"):
        node.facts = dataclasses.replace(node.facts, stacked=False)
    assert node.facts.stacked
