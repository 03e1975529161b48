"""Gradient fusion (passes/bucketing.py): buckets reduced as one flat tensor built in the graph
(Reshape+Concat before the AllReduce, Split+Reshape after it)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

import ngdist
from ngdist import zoo
from ngdist.cli.inspect import summarize
from ngdist.errors import GraphError
from ngdist.ir.domain import DOMAIN
from ngdist.ir.model import load_proto, save_proto, split_training_model
from ngdist.passes.bucketing import BucketingPass
from ngdist.passes.pipeline import rewrite
from ngdist.runtime.partition import CommCall, Segment, plan

SIZES = (64, 32, 16, 10)  # fc0.weight 8192 B, fc0.bias 128, fc1 2048 + 64, fc2 640 + 40
BUCKET_BYTES = 2200
# backward order: last layer first; a bucket closes before it would exceed BUCKET_BYTES
EXPECTED = [["fc2.weight.grad", "fc2.bias.grad"], ["fc1.weight.grad", "fc1.bias.grad"],
            ["fc0.weight.grad"], ["fc0.bias.grad"]]


def mlp_training(seed: int = 0) -> onnx.ModelProto:
    return ngdist.to_training_model(zoo.mlp(SIZES, seed=seed),
                                    optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))


def algorithm(model: onnx.ModelProto) -> onnx.GraphProto:
    return model.training_info[0].algorithm


def buckets(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, list[str], bool]]:
    """(AllReduce node, the tensors it reduces, whether through one flat Concat buffer)."""
    producer = {o: n for n in graph.node for o in n.output}
    out = []
    for n in graph.node:
        if n.domain != DOMAIN or n.op_type != "AllReduce":
            continue
        concat = producer.get(n.input[0])
        if len(n.input) == 1 and concat is not None and concat.op_type == "Concat":
            reshapes = [producer[i] for i in concat.input]
            assert all(r.op_type == "Reshape" for r in reshapes)
            out.append((n, [r.input[0] for r in reshapes], True))
        else:
            out.append((n, list(n.input), False))
    return out


def attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def collective_as_local(model: onnx.ModelProto, ranks: int) -> bytes:
    """The step graph with each AllReduce replaced by what it computes when ``ranks`` ranks
    hold the same values: Identity for a mean over 1 rank, x + x for a sum over 2."""
    _, step = split_training_model(model)
    proto = ir.to_proto(step)
    nodes = []
    for n in proto.graph.node:
        if n.domain != DOMAIN:
            nodes.append(n)
            continue
        assert n.op_type == "AllReduce" and len(n.input) == len(n.output)
        for i, o in zip(n.input, n.output):
            nodes.append(helper.make_node("Identity", [i], [o]) if ranks == 1
                         else helper.make_node("Add", [i, i], [o]))
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    opsets = [o for o in proto.opset_import if o.domain != DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(opsets)
    return proto.SerializeToString()


def run_step(model: onnx.ModelProto, feeds: dict[str, np.ndarray], ranks: int
             ) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(collective_as_local(model, ranks),
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def batch(model: onnx.ModelProto, n: int = 16, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim][1:]
    return {"x": rng.standard_normal((n, *shape)).astype(np.float32),
            "y": rng.integers(0, 10, n).astype(np.int64)}


def test_buckets_are_flat_and_follow_backward_order_and_size():
    model = rewrite(mlp_training(), "allreduce", bucket_bytes=BUCKET_BYTES)
    onnx.checker.check_model(model)
    graph = algorithm(model)
    found = buckets(graph)
    assert [members for _, members, _ in found] == EXPECTED
    assert [flat for _, _, flat in found] == [True, True, False, False]
    sizes = {v.name: np.prod([d.dim_value for d in v.type.tensor_type.shape.dim]) * 4
             for v in graph.value_info}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    for idx, (node, members, flat) in enumerate(found):
        assert node.name == f"ngdist/allreduce/bucket{idx}"
        # gradients leave the backward pass prescaled by 1/N: their mean is a sum
        assert attrs(node) == {"reduction": b"sum", "algorithm": b"mpi", "bucket": idx}
        assert len(node.input) == len(node.output) == 1
        if len(members) > 1:
            assert sum(sizes[m] for m in members) <= BUCKET_BYTES
        if not flat:
            assert node.output[0] == f"{members[0]}.reduced"
            continue
        # the flat result is cut by one Split, each piece reshaped to its gradient's name
        (split,) = consumers[node.output[0]]
        assert split.op_type == "Split" and len(split.input) == 2
        assert [consumers[p][0].op_type for p in split.output] == ["Reshape"] * len(members)
        assert [consumers[p][0].output[0] for p in split.output] == \
            [f"{m}.reduced" for m in members]
    # greedy: the first tensor of the next bucket would not have fitted
    assert sizes["fc2.weight.grad"] + sizes["fc2.bias.grad"] + sizes["fc1.weight.grad"] \
        > BUCKET_BYTES
    names = [o for n in graph.node for o in n.output]
    assert len(names) == len(set(names))


def test_fused_allreduce_sits_after_its_last_gradient_and_overlaps():
    graph = algorithm(rewrite(mlp_training(), "allreduce", bucket_bytes=BUCKET_BYTES))
    position = {o: i for i, n in enumerate(graph.node) for o in n.output}
    nodes = list(graph.node)
    for idx, (node, members, _) in enumerate(buckets(graph)):
        start = max(position[m] for m in members)
        between = nodes[start + 1:nodes.index(node)]
        assert all(n.name.startswith(f"ngdist/bucket{idx}/") for n in between), \
            [n.name for n in between]
    # the partitioner issues bucket 0 before the backward pass of fc0 runs
    items = plan(graph)
    first = next(i for i, it in enumerate(items)
                 if isinstance(it, CommCall) and it.node.name == "ngdist/allreduce/bucket0")
    fc0 = next(i for i, it in enumerate(items) if isinstance(it, Segment)
               and any("fc0.weight.grad" in n.output for n in it.nodes))
    assert first < fc0


def test_no_fusion_with_zero_bucket_bytes():
    graph = algorithm(rewrite(mlp_training(), "allreduce", bucket_bytes=0))
    found = buckets(graph)
    assert [members for _, members, _ in found] == [[m] for b in EXPECTED for m in b]
    assert not any(n.op_type in ("Concat", "Split") for n in graph.node)


def test_rewrite_is_deterministic_and_round_trips_through_a_file(tmp_path):
    a = rewrite(mlp_training(), "allreduce", bucket_bytes=BUCKET_BYTES)
    b = rewrite(mlp_training(), "allreduce", bucket_bytes=BUCKET_BYTES)
    assert algorithm(a).SerializeToString() == algorithm(b).SerializeToString()
    save_proto(a, tmp_path / "dist.onnx")
    again = load_proto(tmp_path / "dist.onnx")  # runs the onnx checker
    assert [(n.name, list(n.input), list(n.output)) for n in algorithm(again).node] == \
        [(n.name, list(n.input), list(n.output)) for n in algorithm(a).node]
    # rewriting a rewritten model leaves its buckets as they are
    twice = rewrite(again, "allreduce", bucket_bytes=BUCKET_BYTES)
    assert [(n.name, list(n.input)) for n, _, _ in buckets(algorithm(twice))] == \
        [(n.name, list(n.input)) for n, _, _ in buckets(algorithm(a))]


@pytest.mark.parametrize("ranks", [1, 2])
def test_flat_buckets_give_the_same_bits_as_one_allreduce_per_gradient(ranks, tmp_path):
    """Concat -> collective -> Split -> Reshape hands every gradient back exactly: one step
    of the fused graph and of the unfused one give bit-identical parameters and state."""
    training = mlp_training(seed=3)
    fused = rewrite(training, "allreduce", bucket_bytes=BUCKET_BYTES)
    unfused = rewrite(training, "allreduce", bucket_bytes=0)
    save_proto(fused, tmp_path / "fused.onnx")
    feeds = batch(training)
    a = run_step(load_proto(tmp_path / "fused.onnx"), feeds, ranks)
    b = run_step(unfused, feeds, ranks)
    assert a.keys() == b.keys() and "fc0.weight.new" in a
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    start = {t.name: onnx.numpy_helper.to_array(t) for t in training.graph.initializer}
    assert not np.array_equal(a["fc2.weight.new"], start["fc2.weight"])  # the step did move


def test_buffer_averages_ride_in_the_first_flat_bucket():
    training = ngdist.to_training_model(zoo.cnn((4, 4)), optimizer=ngdist.optim.SGD(lr=0.1))
    fused = rewrite(training, "allreduce", bucket_bytes=1 << 30)
    _, step = split_training_model(fused)
    meta = ngdist.ir.model.get_meta(step)
    graph = algorithm(fused)
    ((node, members, flat),) = buckets(graph)
    assert flat and node.name == "ngdist/allreduce/bucket0"
    producer = {o: n for n in graph.node for o in n.output}
    for name in meta.names("buffer"):
        target = meta.binding[name]
        # prescaled by ngdist.grad_scale like the gradients, so that a sum is their mean
        assert f"{target}.scaled" in members
        assert producer[f"{target}.scaled"].input[0] == f"{target}.local"
        assert producer[target].op_type == "Reshape"  # the step output keeps its name
    assert members.index(f"{meta.binding[meta.names('buffer')[0]]}.scaled") < \
        members.index("fc.weight.grad")  # buffers are ready first (forward pass)
    unfused = rewrite(training, "allreduce", bucket_bytes=0)
    feeds = batch(training, n=8)
    a, b = run_step(fused, feeds, 1), run_step(unfused, feeds, 1)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    # rewriting the rewritten model does not average the buffers a second time
    again = algorithm(rewrite(fused, "allreduce", bucket_bytes=1 << 30))
    assert [(n.name, list(n.input)) for n, _, _ in buckets(again)] == \
        [(node.name, list(node.input))]


def test_exact_allreduce_keeps_one_input_per_tensor():
    model = rewrite(mlp_training(), "allreduce", bucket_bytes=1 << 30,
                    reproducible_micro_batch=4)
    loss = ngdist.ir.model.get_meta(split_training_model(model)[1]).loss
    graph = algorithm(model)
    ((node, members, flat),) = buckets(graph)
    assert not flat and len(node.input) == len(node.output) == 7  # 6 gradients and the loss
    assert attrs(node)["algorithm"] == b"exact" and attrs(node)["micro_batch"] == 4
    assert f"{loss}.local" in members
    assert not any(n.op_type in ("Concat", "Split") for n in graph.node)


def comm_model(tensors: Sequence[tuple[str, int, list[int | str], str, str]],
               opset: int = 18) -> ir.Model:
    """A graph of ``Identity(t) -> AllReduce`` per tensor (name, element type, shape,
    reduction, algorithm), the reduced values as outputs."""
    nodes, inputs, outputs, infos = [], [], [], []
    for name, elem, shape, reduction, algorithm in tensors:
        inputs.append(helper.make_tensor_value_info(name, elem, shape))
        infos.append(helper.make_tensor_value_info(f"{name}.grad", elem, shape))
        outputs.append(helper.make_tensor_value_info(f"{name}.reduced", elem, shape))
        nodes += [helper.make_node("Identity", [name], [f"{name}.grad"]),
                  helper.make_node("AllReduce", [f"{name}.grad"], [f"{name}.reduced"],
                                   domain=DOMAIN, reduction=reduction, algorithm=algorithm)]
    graph = helper.make_graph(nodes, "comm", inputs, outputs, value_info=infos)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    return ir.from_proto(proto)


def fused_model(tensors: Sequence[tuple[str, int, list[int | str], str, str]],
                bucket_bytes: int, opset: int = 18) -> onnx.ModelProto:
    model = comm_model(tensors, opset)
    assert BucketingPass(bucket_bytes)(model).modified
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    return proto


def test_bucket_boundaries_at_element_type_reduction_and_algorithm():
    f32, f64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE
    proto = fused_model([("a", f32, [4], "mean", "mpi"), ("b", f32, [2, 2], "mean", "mpi"),
                         ("c", f64, [4], "mean", "mpi"), ("d", f64, [4], "sum", "mpi"),
                         ("e", f64, [4], "sum", "ring"), ("f", f64, [3], "sum", "ring")], 1 << 20)
    found = buckets(proto.graph)
    assert [m for _, m, _ in found] == [["a.grad", "b.grad"], ["c.grad"], ["d.grad"],
                                        ["e.grad", "f.grad"]]
    assert [(attrs(n)["reduction"], attrs(n)["algorithm"]) for n, _, _ in found] == \
        [(b"mean", b"mpi"), (b"mean", b"mpi"), (b"sum", b"mpi"), (b"sum", b"ring")]


def test_new_buckets_are_numbered_after_existing_ones():
    f32 = onnx.TensorProto.FLOAT
    model = comm_model([("a", f32, [4], "mean", "mpi"), ("b", f32, [4], "mean", "mpi"),
                        ("c", f32, [4], "mean", "mpi")])
    done = next(n for n in model.graph if n.domain == DOMAIN)
    done.attributes["bucket"] = ir.AttrInt64("bucket", 0)
    assert BucketingPass(1 << 20)(model).modified
    found = buckets(ir.to_proto(model).graph)
    assert [(n.name, m) for n, m, _ in found] == [
        ("", ["a.grad"]), ("ngdist/allreduce/bucket1", ["b.grad", "c.grad"])]
    nodes = [n.name for n in ir.to_proto(model).graph.node if n.name]
    assert len(nodes) == len(set(nodes))


def test_dynamic_shapes_are_restored_from_the_gradients():
    f32 = onnx.TensorProto.FLOAT
    proto = fused_model([("a", f32, ["n", 3], "mean", "mpi"), ("b", f32, [4], "mean", "mpi"),
                         ("c", f32, [2, "m"], "mean", "mpi")], 1 << 20)
    ((node, members, flat),) = buckets(proto.graph)
    assert flat and members == ["a.grad", "b.grad", "c.grad"]
    producer = {o: n for n in proto.graph.node for o in n.output}
    targets = [producer[producer[f"{t}.reduced"].input[1]] for t in "abc"]
    assert [t.op_type for t in targets] == ["Shape", "Constant", "Shape"]
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((5, 3)).astype(np.float32),
             "b": rng.standard_normal(4).astype(np.float32),
             "c": rng.standard_normal((2, 7)).astype(np.float32)}
    out = run_as_identity(proto, feeds)
    for t in "abc":
        assert out[f"{t}.reduced"].shape == feeds[t].shape
        assert out[f"{t}.reduced"].tobytes() == feeds[t].tobytes()


def run_as_identity(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]
                    ) -> dict[str, np.ndarray]:
    """Run a graph whose AllReduce nodes have one input each, as Identity (one rank)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    for n in model.graph.node:
        if n.domain == DOMAIN:
            n.domain, n.op_type = "", "Identity"
            del n.attribute[:]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def test_opsets_before_13_split_by_attribute():
    f32 = onnx.TensorProto.FLOAT
    proto = fused_model([("a", f32, [2, 3], "mean", "mpi"), ("b", f32, [4], "mean", "mpi")],
                        1 << 20, opset=12)
    (split,) = [n for n in proto.graph.node if n.op_type == "Split"]
    assert len(split.input) == 1 and attrs(split)["split"] == [6, 4]
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((2, 3)).astype(np.float32),
             "b": rng.standard_normal(4).astype(np.float32)}
    out = run_as_identity(proto, feeds)
    assert all(out[f"{t}.reduced"].tobytes() == feeds[t].tobytes() for t in "ab")
    dynamic = comm_model([("a", f32, ["n"], "mean", "mpi"), ("b", f32, [4], "mean", "mpi")],
                         opset=12)
    with pytest.raises(GraphError, match="gradients of dynamic shape need Split with its sizes"):
        BucketingPass(1 << 20)(dynamic)


def test_inspect_reports_each_bucket_with_its_tensors_and_bytes():
    summary = summarize(rewrite(mlp_training(), "allreduce", bucket_bytes=BUCKET_BYTES))
    assert [[m for m, _ in c["inputs"]] for c in summary.comm] == EXPECTED
    assert [c["bytes"] for c in summary.comm] == [680, 2112, 8192, 128]
    assert [c["flat"] for c in summary.comm] == [1, 1, 0, 0]
    text = "\n".join(summary.lines())
    assert "ngdist/allreduce/bucket1" in text and "2 tensor(s) in one flat buffer, 2,112 B" in text


def test_compiled_single_rank_training_is_the_same_with_and_without_fusion(same_trajectory):
    from ngdist.data import load_digits

    x, y, _, _ = load_digits()
    a = ngdist.compile(zoo.mlp(SIZES, seed=2), optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                       bucket_bytes=0)
    b = ngdist.compile(zoo.mlp(SIZES, seed=2), optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                       bucket_bytes=1 << 30)
    same_trajectory(a, b, x, y, steps=3, batch=32)


def test_a_large_gradient_travels_alone_and_small_ones_stay_fused():
    # fc0.weight is 64 x 1024 floats = 256 KiB (ALONE_BYTES): its own bucket, reduced in
    # place with no Concat; the small gradients around it share one flat bucket
    from ngdist.passes.bucketing import ALONE_BYTES

    training = ngdist.to_training_model(zoo.mlp((64, 1024, 10), seed=0),
                                        optimizer=ngdist.optim.SGD(lr=0.1))
    graph = algorithm(rewrite(training, "allreduce", bucket_bytes=1 << 30))
    found = {tuple(members): flat for _, members, flat in buckets(graph)}
    assert found == {("fc1.weight.grad", "fc1.bias.grad", "fc0.bias.grad"): True,
                     ("fc0.weight.grad",): False}
    assert ALONE_BYTES == 64 * 1024 * 4
    concat_inputs = {i for n in graph.node if n.op_type == "Concat" for i in n.input}
    assert not any(i.startswith("fc0.weight.grad") for i in concat_inputs)
