"""In-place results (runtime/inplace.py, the update segment of runtime/partition.py): which
results go into dead memory, and a step that writes in place equals one that does not, bit for
bit."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import ngdist
from ngdist.data import load_digits
from ngdist.runtime import executor as executor_module
from ngdist.runtime import step_executor
from ngdist.runtime.inplace import Buffer
from ngdist.runtime.inplace import plan_segment as plan_all
from ngdist.runtime.partition import Segment, plan

F = TensorProto.FLOAT


def plan_segment(*args, **kw):
    return plan_all(*args, min_elements=1, **kw)  # these graphs' tensors are tiny
SHAPES = {n: ((4, 3), F) for n in ("a", "b", "c", "d", "e", "v", "w", "y", "z")}


def node(op: str, inputs: list[str], output: str) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=output)


def test_a_chain_over_dead_memory_is_written_into_it():
    nodes = [node("Mul", ["x", "s"], "a"), node("Mul", ["a", "s"], "b"),
             node("Add", ["b", "g"], "c")]
    got = plan_segment(nodes, [Buffer("x", (4, 3), F), Buffer("g", (4, 3), F)], SHAPES,
                       keep={"c"})
    assert got == {"a": "x", "b": "x", "c": "x"}  # c reads g too: x is its operand either way


def test_memory_whose_value_another_node_still_reads_is_left_alone():
    # x is read by two nodes of which neither is the other's ancestor: neither writes into x
    nodes = [node("Mul", ["x", "s"], "a"), node("Mul", ["x", "t"], "b"),
             node("Add", ["a", "b"], "c")]
    got = plan_segment(nodes, [Buffer("x", (4, 3), F)], SHAPES, keep={"c"})
    assert got == {"c": "x"}  # c descends from both readers of x


def test_a_view_reads_the_memory_of_its_input():
    # v = Reshape(g) shares g's memory; a may not overwrite g while d still reads v
    nodes = [node("Reshape", ["g", "shape"], "v"), node("Mul", ["v", "s"], "a"),
             node("Mul", ["v", "t"], "d"), node("Add", ["a", "d"], "e")]
    got = plan_segment(nodes, [Buffer("g", (4, 3), F)], SHAPES, keep={"e"})
    assert got == {"e": "g"}


def test_a_kept_result_keeps_its_memory():
    nodes = [node("Mul", ["x", "s"], "y"), node("Mul", ["y", "s"], "z")]
    got = plan_segment(nodes, [Buffer("x", (4, 3), F)], SHAPES, keep={"y", "z"})
    assert got == {"y": "x"}  # z may not overwrite y, which the step returns


def test_shapes_and_types_must_fit():
    nodes = [node("Mul", ["x", "s"], "a"), node("Mul", ["a", "s"], "b")]
    shapes = {"a": ((12,), F), "b": ((12,), TensorProto.DOUBLE)}
    assert plan_segment(nodes, [Buffer("x", (4, 3), F)], shapes, keep=set()) == {}
    # onnxruntime's own memory may be viewed in another shape with as many elements
    assert plan_segment(nodes, [Buffer("x", (4, 3), F, any_shape=True)], shapes,
                        keep=set()) == {"a": "x"}


def test_only_elementwise_ops_write_in_place_and_type_readers_do_not_count():
    # CastLike reads only x's type: Mul may overwrite x although CastLike is no ancestor
    nodes = [node("CastLike", ["r", "x"], "rc"), node("Mul", ["x", "s"], "a"),
             node("Transpose", ["a"], "b")]
    shapes = {"a": ((4, 3), F), "b": ((4, 3), F)}
    got = plan_segment(nodes, [Buffer("x", (4, 3), F)], shapes, keep={"b"})
    assert got == {"a": "x"}


def _graph(nodes, inputs, outputs):
    vi = lambda n: helper.make_tensor_value_info(n, F, [2])  # noqa: E731
    return helper.make_graph(nodes, "g", [vi(n) for n in inputs], [vi(n) for n in outputs])


def test_the_update_gets_a_segment_after_every_other_reader_of_the_parameters():
    g = _graph([node("Mul", ["x", "w"], "h"),             # forward: reads w
                node("MatMul", ["h", "x"], "gw"),         # gradient
                node("Mul", ["gw", "lr"], "step"),        # update
                node("Sub", ["w", "step"], "w.new"),
                node("Mul", ["h", "w"], "loss")],         # another reader of w, placed last
               ["x", "w", "lr"], ["loss", "w.new"])
    items = plan(g, updated=frozenset({"w.new"}), donated=frozenset({"w"}))
    assert [[n.name for n in it.nodes] for it in items] == [["h", "gw", "loss"],
                                                            ["step", "w.new"]]
    assert all(isinstance(it, Segment) for it in items)
    # nothing but the update reads w: one segment
    g2 = _graph([node("Mul", ["x", "x"], "gw"), node("Sub", ["w", "gw"], "w.new")],
                ["x", "w"], ["w.new"])
    assert len(plan(g2, updated=frozenset({"w.new"}), donated=frozenset({"w"}))) == 1


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
}


def _digits_cnn_step(monkeypatch, in_place: bool, batches: list[int], optimizer: str):
    if not in_place:  # the executor as it runs without donated values
        real = executor_module.Executor

        def plain(*args, donate=None, **kw):
            return real(*args, **kw)
        monkeypatch.setattr(step_executor, "Executor", plain)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    x, y, _, _ = load_digits()
    x = x.reshape(-1, 1, 8, 8).astype(np.float32)
    tr = ngdist.compile(net, torch.from_numpy(x[:2]), loss=torch.nn.CrossEntropyLoss(),
                        optimizer=OPTIMIZERS[optimizer](net.parameters()),
                        strategy="local", intra_op_threads=1)
    start = 0
    for b in batches:
        tr.step({"input": x[start:start + b], "y": y[start:start + b].astype(np.int64)})
        start += b
    monkeypatch.undo()
    return tr


@pytest.mark.parametrize("optimizer, batches", [("adamw", [16, 16, 16]),
                                                ("adamw", [16, 5, 16]), ("sgd", [16, 5, 16])])
def test_a_step_written_in_place_equals_one_that_is_not(monkeypatch, optimizer, batches):
    """A CNN with BatchNorm and a 512x512 layer, three steps (a smaller batch in the middle
    plans the update again for its shapes): every parameter, buffer and state bit for bit."""
    fast = _digits_cnn_step(monkeypatch, True, batches, optimizer)
    plain = _digits_cnn_step(monkeypatch, False, batches, optimizer)
    update = [it for it in fast.executor.items if isinstance(it, Segment)][-1]
    planned = next(iter(fast.executor.planner.assigned[update.index].values()))
    # the large layer's update ops (smaller tensors stay in onnxruntime's memory)
    assert len(planned) >= {"adamw": 12, "sgd": 4}[optimizer], planned
    assert not plain.executor.donated
    a, b = fast.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_new_value_that_another_node_reads_stays_before_its_reader():
    # w.new is also read by a node outside the update (a norm): the plan stays topological
    g = _graph([node("Mul", ["x", "w"], "loss"), node("Sub", ["w", "x"], "w.new"),
                node("ReduceSum", ["w.new"], "norm")],
               ["x", "w"], ["loss", "w.new", "norm"])
    items = plan(g, updated=frozenset({"w.new"}), donated=frozenset({"w"}))
    order = [n.name for it in items for n in it.nodes]
    assert order.index("w.new") < order.index("norm")


def test_batchnorm_running_statistics_share_the_memory_of_their_inputs():
    # onnxruntime writes BatchNormalization's running-mean output over the running-mean input:
    # overwriting that memory must wait for the output's readers
    bn = helper.make_node("BatchNormalization", ["x", "s", "b", "mean", "var"],
                          ["y", "mean.out", "var.out"], name="bn", training_mode=1)
    nodes = [bn, node("Mul", ["var.out", "k"], "var.scaled"),
             node("Mul", ["mean.out", "k"], "mean.scaled")]
    shapes = {"var.scaled": ((4,), F), "mean.scaled": ((4,), F)}
    got = plan_segment(nodes, [Buffer("mean", (4,), F), Buffer("var", (4,), F)], shapes,
                       keep={"var.scaled", "mean.scaled"})
    assert got == {"var.scaled": "var", "mean.scaled": "mean"}


def test_a_no_op_that_onnxruntime_may_remove_counts_as_a_view():
    def graph(c: float):
        k = helper.make_node("Constant", [], ["c"], name="c",
                             value=helper.make_tensor("v", F, [1], [c]))
        return [k, node("Mul", ["x", "c"], "z"), node("Mul", ["z", "s"], "a"),
                node("Mul", ["z", "t"], "d"), node("Add", ["a", "d"], "e")]
    # z = x * 2 is a result of its own, written over x (its only reader)
    assert plan_segment(graph(2.0), [Buffer("x", (4, 3), F)], SHAPES, keep={"e"}) == \
        {"z": "x", "e": "x"}
    # z = x * 1 may be removed by onnxruntime's optimizer (z is then x's memory): a may not
    # overwrite x while d still reads z
    assert plan_segment(graph(1.0), [Buffer("x", (4, 3), F)], SHAPES, keep={"e"}) == {"e": "x"}


def test_static_shapes_give_a_max_unpool_the_shape_its_shape_input_reads():
    """ONNX infers no shape for MaxUnpool's result; MaxPool's gradient unpools to Shape(x), so
    the result (and what follows from it) gets x's shape."""
    from ngdist.ir.model import IR_VERSION
    from ngdist.runtime.inplace import static_shapes

    nodes = [helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Shape", ["x"], ["sx"]),
             helper.make_node("MaxUnpool", ["y", "i", "sx"], ["u"], kernel_shape=[1, 1],
                              strides=[1, 1]),
             helper.make_node("Relu", ["u"], ["r"])]
    shapes = static_shapes(nodes, {"x": ((4, 3, 6, 8), TensorProto.FLOAT)}, {},
                           [helper.make_opsetid("", 18)], IR_VERSION)
    assert shapes["y"] == ((4, 3, 3, 4), TensorProto.FLOAT)
    assert shapes["u"] == ((4, 3, 6, 8), TensorProto.FLOAT)
    assert shapes["r"] == ((4, 3, 6, 8), TensorProto.FLOAT)
