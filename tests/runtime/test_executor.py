"""The executor (runtime/executor.py): segments through IOBinding, comm nodes through kernels,
values as OrtValues that are handed on (never through a copy) and dropped after their last use.

Single process with LocalGroup, or with ``TwoRanks``: a ProcessGroup of size 2 whose other
rank is simulated (its allreduce adds ``OTHER`` to the buffer, in place, as MPI's in-place
allreduce would). The last test runs two real ranks under mpiexec.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ngdist.comm import LocalGroup
from ngdist.comm.group import DoneWork, ProcessGroup, describe, divide
from ngdist.errors import CommError, CommTimeoutError, ExecutionError
from ngdist.ir.domain import DOMAIN
from ngdist.ir.model import IR_VERSION
from ngdist.runtime.executor import Executor, StepTimes
from ngdist.runtime.partition import CommCall, Segment
from ngdist.runtime.sessions import CPU

OTHER = 10.0  # what the simulated rank 1 contributes to every allreduce


class TwoRanks(ProcessGroup):
    """Rank 0 of two; rank 1 holds OTHER everywhere. Only what the kernels under test use."""

    backend = "test"
    rank, size = 0, 2

    def __init__(self, fail: Exception | None = None) -> None:
        super().__init__(timeout=5)
        self.fail = fail
        self.calls: list[str] = []
        self.coalesced: list[list[str]] = []  # the nodes of each allreduce_coalesced call

    def allreduce_coalesced(self, bufs, what, op="sum", peers=None, placed=None):
        self.coalesced.append([w.name for w in what])
        assert len(bufs) == len(what)
        return super().allreduce_coalesced(bufs, what, op, peers, placed)

    def allreduce(self, buf, what, op="sum", peers=None, placed=None):
        self.calls.append(describe(what))
        if self.fail is not None:
            raise self.fail
        np.add(buf, buf.dtype.type(OTHER), out=buf)
        if op == "mean":
            divide(buf, self.size)
        return DoneWork(self, what, peers)

    def reduce_scatter(self, send, recv, what):
        raise AssertionError("not reached: the kernel checks the shape first")

    def broadcast(self, buf, root, what):
        raise NotImplementedError

    def reduce(self, send, recv, root, what):
        raise NotImplementedError

    def allgather(self, send, recv, what):
        raise NotImplementedError

    def gather(self, send, recv, root, what):
        raise NotImplementedError

    def exchange(self, sends, recvs, tag, what):
        raise NotImplementedError

    def barrier(self, what="barrier"):
        raise NotImplementedError

    def split(self, color, key, what):
        raise NotImplementedError

    def dup(self, what):
        raise NotImplementedError


def f32(name: str, shape=None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def model(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "step", [f32(n) for n in inputs], [f32(n) for n in outputs])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid(DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m


def allreduce(inp: str, out: str, name: str = "ngdist/allreduce/bucket0",
              reduction: str = "mean") -> onnx.NodeProto:
    return helper.make_node("AllReduce", [inp], [out], name=name, domain=DOMAIN,
                            reduction=reduction)


def step_model() -> onnx.ModelProto:
    """seg 0: g = x * w, b = -x; comm 1: gr = AllReduce(g); seg 2: y = gr + b."""
    return model([helper.make_node("Mul", ["x", "w"], ["g"], name="grad"),
                  helper.make_node("Neg", ["x"], ["b"], name="neg"),
                  allreduce("g", "gr"),
                  helper.make_node("Add", ["gr", "b"], ["y"], name="update")],
                 ["x", "w"], ["y"])


X = np.array([[1.0, -2.0, 3.0], [0.5, 4.0, -1.5]], np.float32)
W = np.array([[2.0, 0.25, -1.0], [3.0, -0.5, 2.0]], np.float32)


def feeds(**arrays: np.ndarray) -> dict[str, ort.OrtValue]:
    return {k: CPU.value(v) for k, v in arrays.items()}


def addr(value: ort.OrtValue) -> int:
    return value.numpy().__array_interface__["data"][0]


def spy_comm(ex: Executor) -> list[tuple[list[ort.OrtValue], list[ort.OrtValue]]]:
    """Record the values each comm node received and the values it produced."""
    seen = []
    original = ex.run_comm

    def run_comm(idx, values):
        outs, dt = original(idx, values)
        seen.append((list(values), list(outs)))
        return outs, dt

    ex.run_comm = run_comm
    return seen


def spy_env(ex: Executor) -> list[tuple[int, set[str]]]:
    """Record the environment's names each time a segment starts."""
    seen = []
    original = ex.run_segment

    def run_segment(seg, env):
        seen.append((seg.index, set(env)))
        return original(seg, env)

    ex.run_segment = run_segment
    return seen


# ---------------------------------------------------------------- one rank
@pytest.mark.parametrize("overlap", [True, False])
def test_comm_node_between_two_segments(overlap):
    ex = Executor(step_model(), LocalGroup(timeout=5), inline_alone=False, overlap=overlap)
    assert [type(it).__name__ for it in ex.items] == ["Segment", "CommCall", "Segment"]
    times = StepTimes()
    out = ex.run(feeds(x=X, w=W), times)
    assert list(out) == ["y"] and isinstance(out["y"], ort.OrtValue)
    np.testing.assert_array_equal(out["y"].numpy(), X * W - X)
    assert times.compute > 0 and times.comm >= 0 and times.wait >= 0
    ex.close()


def test_overlap_on_and_off_give_identical_results():
    rng = np.random.default_rng(0)
    results = {}
    for overlap in (True, False):
        ex = Executor(step_model(), TwoRanks(), overlap=overlap)
        outs = []
        for _ in range(3):
            x, w = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
            outs.append(ex.run(feeds(x=x, w=w))["y"].numpy().copy())
        ex.close()
        results[overlap] = outs
        rng = np.random.default_rng(0)
    for a, b in zip(results[True], results[False]):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("overlap", [True, False])
def test_values_are_dropped_after_their_last_use(overlap):
    ex = Executor(step_model(), LocalGroup(timeout=5), inline_alone=False, overlap=overlap)
    seen = spy_env(ex)
    given = feeds(x=X, w=W)
    for _ in range(3):
        ex.run(given)
    # segment 0 sees the feeds; segment 2 only what it reads: x, w (last read by segment 0)
    # and g (last read by the AllReduce) are gone
    assert seen == [(0, {"x", "w"}), (2, {"gr", "b"})] * 3
    assert set(given) == {"x", "w"}  # the caller's feeds are not consumed
    assert {k: sorted(v) for k, v in ex.plan.free_after.items()} == {0: ["w", "x"], 1: ["g"],
                                                                 2: ["b", "gr"]}
    ex.close()


def test_step_outputs_are_kept_until_the_end():
    m = model([helper.make_node("Mul", ["x", "w"], ["g"], name="grad"),
               allreduce("g", "gr"),
               helper.make_node("Neg", ["gr"], ["y"], name="neg")],
              ["x", "w"], ["g", "y"])
    out = Executor(m, LocalGroup(timeout=5), inline_alone=False, overlap=False).run(feeds(x=X, w=W))
    assert sorted(out) == ["g", "y"]
    np.testing.assert_array_equal(out["g"].numpy(), X * W)
    np.testing.assert_array_equal(out["y"].numpy(), -(X * W))


def test_a_segment_error_names_the_segment():
    m = model([helper.make_node("Mul", ["x", "w"], ["g"], name="grad"),
               allreduce("g", "gr"),
               helper.make_node("Add", ["gr", "z"], ["y"], name="add_z")],
              ["x", "w", "z"], ["y"])
    ex = Executor(m, LocalGroup(timeout=5), inline_alone=False, overlap=False)
    with pytest.raises(ExecutionError) as info:
        ex.run(feeds(x=X, w=W, z=np.ones((5, 7), np.float32)))  # does not broadcast with 2x3
    assert str(info.value).startswith("while executing segment 2 (1 nodes, add_z .. add_z): ")


def test_an_error_in_the_first_segment_names_its_nodes():
    m = model([helper.make_node("Mul", ["x", "w"], ["g"], name="grad"),
               helper.make_node("Neg", ["g"], ["h"], name="neg"),
               allreduce("h", "y")], ["x", "w"], ["y"])
    ex = Executor(m, LocalGroup(timeout=5), inline_alone=False)
    with pytest.raises(ExecutionError) as info:
        ex.run(feeds(x=X, w=np.ones(4, np.float32)))
    assert str(info.value).startswith("while executing segment 0 (2 nodes, grad .. neg): ")


@pytest.mark.parametrize("overlap", [True, False])
def test_a_kernel_error_names_the_comm_node(overlap):
    m = model([helper.make_node("Neg", ["x"], ["a"], name="neg"),
               helper.make_node("ReduceScatter", ["a"], ["s"], name="rs", domain=DOMAIN),
               helper.make_node("Neg", ["s"], ["y"], name="neg2")], ["x"], ["y"])
    ex = Executor(m, TwoRanks(), overlap=overlap)
    with pytest.raises(CommError) as info:
        ex.run(feeds(x=np.ones((3, 2), np.float32)))
    assert str(info.value) == ("while executing ngdist.ReduceScatter 'rs' on rank 0: "
                               "ReduceScatter needs axis 0 (3) divisible by 2")
    ex.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_comm_failure_reaches_the_caller_as_it_is(overlap):
    failure = CommTimeoutError("ngdist.AllReduce 'ngdist/allreduce/bucket0' did not complete")
    ex = Executor(step_model(), TwoRanks(fail=failure), overlap=overlap)
    with pytest.raises(CommTimeoutError) as info:
        ex.run(feeds(x=X, w=W))
    assert info.value is failure
    ex.close()


# ---------------------------------------------------------------- batches of comm nodes
def two_buckets(*between: onnx.NodeProto, second: str = "g2", algorithm: str | None = None,
                outputs: tuple[str, ...] = ()) -> onnx.ModelProto:
    """Two gradients, their AllReduce nodes (``between`` after the first), then a sum."""
    extra = {} if algorithm is None else {"algorithm": algorithm}
    return model([helper.make_node("Mul", ["x", "w"], ["g1"], name="grad1"),
                  helper.make_node("Neg", ["x"], ["g2"], name="grad2"),
                  allreduce("g1", "r1", name="bucket0"), *between,
                  helper.make_node("AllReduce", [second], ["r2"], name="bucket1",
                                   domain=DOMAIN, reduction="mean", **extra),
                  helper.make_node("Add", ["r1", "r2"], ["y"], name="update")],
                 ["x", "w"], ["y", *outputs])


def test_allreduce_nodes_one_after_another_run_as_one_call():
    group = TwoRanks()
    ex = Executor(two_buckets(), group, overlap=False)
    first = min(ex.comm_nodes)
    assert dict(ex.plan.batches) == {first: (first, first + 1)}
    seen = spy_comm(ex)
    for _ in range(2):  # (the second step: buffers bound as the first one left them)
        out = ex.run(feeds(x=X, w=W))
        np.testing.assert_array_equal(out["y"].numpy(), (X * W + OTHER) / 2 + (OTHER - X) / 2)
    assert group.coalesced == [["bucket0", "bucket1"]] * 2  # one call of the group a step
    assert len(seen) == 2  # one kernel call a step, both nodes' values in and out
    values, outs = seen[0]
    assert len(values) == len(outs) == 2 and all(o is v for o, v in zip(outs, values))
    ex.close()


def test_with_overlap_each_allreduce_node_is_a_call_of_its_own():
    group = TwoRanks()
    ex = Executor(two_buckets(), group, overlap=True)
    assert dict(ex.plan.batches) == {}
    out = ex.run(feeds(x=X, w=W))
    np.testing.assert_array_equal(out["y"].numpy(), (X * W + OTHER) / 2 + (OTHER - X) / 2)
    assert group.coalesced == [["bucket0"], ["bucket1"]]
    ex.close()


def test_a_batch_failure_names_every_node_of_it():
    ex = Executor(two_buckets(), TwoRanks(fail=ValueError("no route to rank 1")),
                  overlap=False)
    with pytest.raises(CommError) as info:
        ex.run(feeds(x=X, w=W))
    assert str(info.value) == ("while executing ngdist.AllReduce 'bucket0', 'bucket1' on rank "
                               "0: no route to rank 1")
    ex.close()


def test_an_allreduce_of_another_ones_result_is_not_in_its_batch():
    group = TwoRanks()
    ex = Executor(two_buckets(second="r1"), group, overlap=False)
    assert dict(ex.plan.batches) == {}
    out = ex.run(feeds(x=X, w=W))
    r1 = (X * W + OTHER) / 2
    np.testing.assert_array_equal(out["y"].numpy(), r1 + (r1 + OTHER) / 2)
    assert group.coalesced == [["bucket0"], ["bucket1"]]


def test_allreduce_nodes_with_an_algorithm_of_their_own_run_alone():
    group = TwoRanks()
    ex = Executor(two_buckets(algorithm="ring"), group, overlap=False)
    assert dict(ex.plan.batches) == {}
    first = min(ex.comm_nodes)
    assert [ex.comm_nodes[i].name for i in (first, first + 1)] == ["bucket0", "bucket1"]


def test_another_comm_op_between_two_allreduce_nodes_splits_them():
    group = TwoRanks()
    ex = Executor(two_buckets(helper.make_node("ReduceScatter", ["x"], ["s"], name="rs",
                                               domain=DOMAIN), outputs=("s",)),
                  group, overlap=False)
    assert dict(ex.plan.batches) == {}
    assert [n.op_type for n in ex.comm_nodes.values()] == ["AllReduce", "ReduceScatter",
                                                            "AllReduce"]


# ---------------------------------------------------------------- in place, or not
@pytest.mark.parametrize("overlap", [True, False])
def test_a_donated_input_is_reduced_in_place(overlap):
    ex = Executor(step_model(), TwoRanks(), overlap=overlap)
    node = next(n for n in ex.comm_nodes.values())
    assert node.facts.donated == (True,)
    seen = spy_comm(ex)
    out = ex.run(feeds(x=X, w=W))
    ((values, outs),) = seen
    assert outs[0] is values[0]  # the kernel handed its input back: the same OrtValue
    assert addr(outs[0]) == addr(values[0])
    np.testing.assert_array_equal(values[0].numpy(), (X * W + OTHER) / 2)  # reduced in place
    np.testing.assert_array_equal(out["y"].numpy(), (X * W + OTHER) / 2 - X)
    ex.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_an_input_read_by_another_node_is_not_modified(overlap):
    m = model([helper.make_node("Mul", ["x", "w"], ["g"], name="grad"),
               allreduce("g", "gr", reduction="sum"),
               helper.make_node("Sub", ["gr", "g"], ["y"], name="other_reader")],
              ["x", "w"], ["y"])
    ex = Executor(m, TwoRanks(), overlap=overlap)
    assert next(iter(ex.comm_nodes.values())).facts.donated == (False,)
    seen = spy_comm(ex)
    out = ex.run(feeds(x=X, w=W))
    ((values, outs),) = seen
    assert outs[0] is not values[0] and addr(outs[0]) != addr(values[0])
    np.testing.assert_array_equal(values[0].numpy(), X * W)  # untouched
    np.testing.assert_array_equal(outs[0].numpy(), X * W + OTHER)
    np.testing.assert_array_equal(out["y"].numpy(), np.full_like(X, OTHER))  # saw the original
    ex.close()


def test_a_fed_input_is_not_modified():
    m = model([allreduce("x", "xr", reduction="sum"),
               helper.make_node("Neg", ["xr"], ["y"], name="neg")], ["x"], ["y"])
    ex = Executor(m, TwoRanks(), overlap=False)
    assert next(iter(ex.comm_nodes.values())).facts.donated == (False,)
    x = X.copy()
    out = ex.run(feeds(x=x))
    np.testing.assert_array_equal(x, X)
    np.testing.assert_array_equal(out["y"].numpy(), -(X + OTHER))


def test_an_input_that_is_a_step_output_is_not_modified():
    m = model([helper.make_node("Mul", ["x", "w"], ["g"], name="grad"),
               allreduce("g", "gr", reduction="sum")], ["x", "w"], ["g", "gr"])
    ex = Executor(m, TwoRanks(), overlap=False)
    assert next(iter(ex.comm_nodes.values())).facts.donated == (False,)
    out = ex.run(feeds(x=X, w=W))
    np.testing.assert_array_equal(out["g"].numpy(), X * W)
    np.testing.assert_array_equal(out["gr"].numpy(), X * W + OTHER)


@pytest.mark.parametrize("overlap", [True, False])
def test_an_output_handed_back_keeps_its_ortvalue(overlap):
    """On one rank AllReduce returns its inputs: the runtime passes the same OrtValues on."""
    m = model([helper.make_node("Mul", ["x", "w"], ["g"], name="grad"),
               allreduce("g", "gr"),
               helper.make_node("Identity", ["gr"], ["y"], name="id")], ["x", "w"], ["y"])
    ex = Executor(m, LocalGroup(timeout=5), inline_alone=False, overlap=overlap)
    seen = spy_comm(ex)
    given = feeds(x=X, w=W)
    ex.run(given)
    ((values, outs),) = seen
    assert outs[0] is values[0]
    direct = Executor(model([allreduce("x", "y")], ["x"], ["y"]), LocalGroup(timeout=5), inline_alone=False,
                      overlap=overlap)
    assert direct.run(given)["y"] is given["x"]
    ex.close()
    direct.close()


def test_kernel_inputs_are_views_of_the_values():
    m = model([helper.make_node("Mul", ["x", "w"], ["g"], name="grad"),
               allreduce("g", "gr")], ["x", "w"], ["gr"])
    ex = Executor(m, LocalGroup(timeout=5), inline_alone=False, overlap=False)
    captured = []
    spec = ex.kernels[1]
    original = spec.fn

    def kernel(group, node, inputs):
        captured.append(inputs)
        return original(group, node, inputs)

    spec_copy = type(spec)(spec.op_type, kernel, spec.memory, spec.drain, spec.close)
    ex.kernels[1] = spec_copy
    seen = spy_comm(ex)
    ex.run(feeds(x=X, w=W))
    ((values, _),) = seen
    assert isinstance(captured[0][0], np.ndarray)
    assert captured[0][0].__array_interface__["data"][0] == addr(values[0])


def test_the_plan_the_executor_runs():
    ex = Executor(step_model(), LocalGroup(timeout=5), inline_alone=False)
    seg0, call, seg2 = ex.items
    assert isinstance(seg0, Segment) and isinstance(call, CommCall) and isinstance(seg2, Segment)
    assert (seg0.inputs, seg0.outputs, seg2.inputs, seg2.outputs) == \
        (["x", "w"], ["g", "b"], ["gr", "b"], ["y"])
    node = ex.comm_nodes[1]
    assert (node.op_type, node.name, node.inputs, node.outputs) == \
        ("AllReduce", "ngdist/allreduce/bucket0", ["g"], ["gr"])
    assert node.facts.outputs_die is True  # gr dies within the step
    ex.close()


# ---------------------------------------------------------------- two ranks
TWO_RANKS = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_executor import step_model, feeds
from ngdist.comm import world_group
from ngdist.runtime.executor import Executor

group = world_group(timeout=60)
rng = np.random.default_rng(100 + group.rank)
out = {}
for overlap in (True, False):
    ex = Executor(step_model(), group, overlap=overlap)
    for step in range(2):
        x = rng.standard_normal((2, 3)).astype(np.float32)
        w = rng.standard_normal((2, 3)).astype(np.float32)
        y = ex.run(feeds(x=x, w=w))["y"].numpy()
        out[f"x_{overlap}_{step}"], out[f"w_{overlap}_{step}"] = x, w
        out[f"y_{overlap}_{step}"] = y.copy()
    ex.close()
np.savez(f"rank{group.rank}.npz", **out)
"""


@pytest.mark.mpi
def test_two_ranks_average_their_gradients(ranks, tmp_path):
    from pathlib import Path

    ranks(2, TWO_RANKS, timeout=120, args=[str(Path(__file__).resolve().parent)])
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for overlap in (True, False):
        for step in range(2):
            k = f"{overlap}_{step}"
            g = [got[r][f"x_{k}"] * got[r][f"w_{k}"] for r in range(2)]
            assert not np.array_equal(g[0], g[1])
            for r in range(2):
                want = (g[0] + g[1]) * np.float32(0.5) - got[r][f"x_{k}"]
                np.testing.assert_array_equal(got[r][f"y_{k}"], want)


def test_a_comm_node_reading_a_constant():
    """A constant of the step graph (an initializer that is not an input) is a value like any
    other, whether a segment or a comm node reads it."""
    m = model([allreduce("c", "cr", reduction="sum"),
               helper.make_node("Add", ["cr", "x"], ["y"], name="add")], ["x"], ["y"])
    m.graph.initializer.append(helper.make_tensor("c", TensorProto.FLOAT, [2, 3], [1.0] * 6))
    out = Executor(m, LocalGroup(timeout=5), inline_alone=False, overlap=False).run(feeds(x=X))
    np.testing.assert_array_equal(out["y"].numpy(), X + 1)


def test_one_rank_runs_identity_comm_ops_inside_one_segment():
    # on one rank an AllReduce is the identity: it runs as onnxruntime Identity nodes and the
    # step is not cut into segments; the results are the same bits as through the kernel
    m = step_model()
    inlined = Executor(m, LocalGroup(timeout=5))
    through_kernel = Executor(m, LocalGroup(timeout=5), inline_alone=False)
    assert [type(i).__name__ for i in inlined.items] == ["Segment"]
    assert not inlined.comm_nodes
    assert any(type(i).__name__ == "CommCall" for i in through_kernel.items)
    a = inlined.run(feeds(x=X, w=W))
    b = through_kernel.run(feeds(x=X, w=W))
    assert {k: v.numpy().tobytes() for k, v in a.items()} == \
        {k: v.numpy().tobytes() for k, v in b.items()}


def test_nodes_no_step_output_depends_on_never_reach_a_session():
    # a second head nobody returns (and the comm node behind it) is left out on every rank
    m = model([helper.make_node("Mul", ["x", "w"], ["g"], name="grad"),
               helper.make_node("Neg", ["x"], ["dead1"], name="dead_head"),
               allreduce("dead1", "dead2", name="ngdist/allreduce/dead"),
               helper.make_node("Exp", ["dead2"], ["dead3"], name="dead_tail"),
               allreduce("g", "y")], ["x", "w"], ["y"])
    ex = Executor(m, TwoRanks(), overlap=False)
    planned = [n.name for it in ex.items
               for n in (it.nodes if hasattr(it, "nodes") else [it.node])]
    assert planned == ["grad", "ngdist/allreduce/bucket0"]
    out = ex.run(feeds(x=X, w=W))
    assert np.array_equal(out["y"].numpy(), (X * W + OTHER) / 2)
