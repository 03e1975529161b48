"""Gradient compression (passes/compression.py): the graph (a Cast to 16 bits before each
gradient AllReduce, one back to float32 after it, buffer averages left in float32), the
error-feedback residual, what one step computes against numpy / ml_dtypes roundings, and the
options' errors."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.errors import OptionError
from ngdist.frontends.onnx import build_training_model
from ngdist.passes.pipeline import rewrite

WIRE = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
ROUND = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _cnn_training(**options: object) -> onnx.ModelProto:
    model = build_training_model(zoo.cnn(seed=0), loss="softmax_cross_entropy", labels="y",
                                 optimizer="sgd")
    return rewrite(model, "allreduce", **options)


def _parts(model: onnx.ModelProto):
    alg = model.training_info[0].algorithm
    producers = {o: n for n in alg.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in alg.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*alg.input, *alg.value_info, *alg.output]}
    attrs = {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute}
             for n in alg.node}
    reduces = [n for n in alg.node if n.domain == "ngdist" and n.op_type == "AllReduce"]
    return alg, producers, consumers, types, attrs, reduces


def _to(attrs: dict) -> int:
    return attrs["to"]


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@pytest.mark.parametrize("bucket_bytes", [25 << 20, 0])
def test_casts_around_each_gradient_allreduce(compression, bucket_bytes):
    model = _cnn_training(compression=compression, bucket_bytes=bucket_bytes)
    onnx.checker.check_model(model)
    alg, producers, consumers, types, attrs, reduces = _parts(model)
    inferred = onnx.shape_inference.infer_shapes(helper.make_model(
        alg, opset_imports=model.opset_import), strict_mode=False).graph
    types.update({v.name: v.type.tensor_type.elem_type for v in inferred.value_info})
    compressed = [n for n in reduces if attrs[n.name].get("compression") == compression.encode()]
    plain = [n for n in reduces if "compression" not in attrs[n.name]]
    # every gradient is reduced compressed: one flat bucket, or one AllReduce each
    assert len(compressed) == (1 if bucket_bytes else 8)
    for n in compressed:
        for x, y in zip(n.input, n.output):
            cast = producers[x]
            assert cast.op_type == "Cast" and _to(attrs[cast.name]) == WIRE[compression]
            assert types[cast.input[0]] == TensorProto.FLOAT
            (back,) = consumers[y]  # read by the Cast back alone
            assert back.op_type == "Cast" and _to(attrs[back.name]) == TensorProto.FLOAT
            for reader in consumers[back.output[0]]:  # Split of the bucket, or the optimizer
                assert reader.op_type in ("Split", "Momentum", "Mul", "Sub", "Add"), \
                    reader.op_type
    # the BatchNorm running statistics are averaged in float32, in a bucket of their own
    assert len(plain) == (1 if bucket_bytes else 2)
    for n in plain:
        assert all(producers[x].op_type != "Cast" for x in n.input)
    assert sum(n.op_type == "Cast" and n.name.startswith("ngdist/") and "/grad/" not in n.name
               for n in alg.node) == 2 * len(compressed)


def test_error_feedback_adds_a_residual_state_per_bucket():
    model = _cnn_training(compression="fp16", compression_error_feedback=True)
    onnx.checker.check_model(model)
    alg, producers, consumers, types, attrs, reduces = _parts(model)
    binding = {kv.key: kv.value for kv in model.training_info[0].update_binding}
    roles = json.loads({p.key: p.value for p in model.metadata_props}["ngdist.roles"])
    residuals = [n for n in binding if n.startswith("ngdist.residual.")]
    assert residuals == ["ngdist.residual.bucket1"] and roles[residuals[0]] == "state"
    init = {t.name: numpy_helper.to_array(t) for t in alg.initializer}[residuals[0]]
    grads = sum(numpy_helper.to_array(t).size for t in model.graph.initializer
                if roles.get(t.name) == "param")
    assert init.dtype == np.float32 and init.shape == (grads,) and not init.any()
    (bucket,) = [n for n in reduces if "compression" in attrs[n.name]]
    cast = producers[bucket.input[0]]
    add = producers[cast.input[0]]
    assert add.op_type == "Add" and add.input[1] == residuals[0]
    assert producers[add.input[0]].op_type == "Concat"
    sub = producers[binding[residuals[0]]]  # r' = (g + r) - Cast32(Cast16(g + r))
    assert sub.op_type == "Sub" and sub.input[0] == add.output[0]
    widen = producers[sub.input[1]]
    assert widen.op_type == "Cast" and widen.input == cast.output
    assert binding[residuals[0]] in {o.name for o in alg.output}


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_one_step_reduces_the_rounded_gradients(compression):
    """On one rank the AllReduce is the identity, so SGD's first momentum (v = g at T = 0)
    is the gradient after the round trip through 16 bits: numpy / ml_dtypes round the
    uncompressed run's gradient the same way; error feedback keeps g - round16(g)."""
    x, y, _, _ = load_digits(images=True)
    batch = {"x": x[:64], "y": y[:64]}

    def one_step(**options):
        trainer = ngdist.compile(zoo.cnn(seed=0), loss="softmax_cross_entropy", labels="y",
                                 optimizer=ngdist.optim.SGD(lr=0.05, momentum=0.9),
                                 strategy="allreduce", **options)
        trainer.step(batch)
        state = trainer.state_dict()
        trainer.close()
        return state

    plain = one_step()
    rounded = one_step(compression=compression)
    fed = one_step(compression=compression, compression_error_feedback=True)
    moments = sorted(k for k in plain if k.endswith(".momentum"))
    assert len(moments) == 8
    changed = 0
    for k in moments:
        want = plain[k].astype(ROUND[compression]).astype(np.float32)
        np.testing.assert_array_equal(rounded[k], want, err_msg=k)
        np.testing.assert_array_equal(fed[k], want, err_msg=k)  # residual was 0
        changed += int(np.sum(want != plain[k]))
    assert changed > 1000  # the rounding did change the gradients
    # the residual holds what the rounding lost, in the bucket's order (last layer first)
    order = ["fc.weight", "fc.bias", "conv2.weight", "conv2.bias", "bn1.weight", "bn1.bias",
             "conv1.weight", "conv1.bias"]
    grads = np.concatenate([plain[f"{p}.momentum"].reshape(-1) for p in order])
    lost = grads - grads.astype(ROUND[compression]).astype(np.float32)
    np.testing.assert_array_equal(fed["ngdist.residual.bucket1"], lost)
    assert "ngdist.residual.bucket1" not in rounded


def test_unknown_compression_names_the_valid_ones():
    with pytest.raises(OptionError, match=r"^unknown compression 'fp8'; choose one of "
                                          r"\['none', 'fp16', 'bf16'\]$"):
        ngdist.compile(zoo.mlp(), optimizer=ngdist.optim.SGD(lr=0.1), compression="fp8")


@pytest.mark.parametrize("options, message", [
    ({"strategy": "pushsum", "compression": "fp16"},
     r"^compression is an option of the allreduce strategy, not of 'pushsum'"),
    ({"strategy": "ps", "compression": "bf16"},
     r"^compression is an option of the allreduce strategy, not of 'ps'"),
    ({"reproducible_micro_batch": 4, "compression": "fp16"},
     r"^compression='fp16' cannot be combined with reproducible_micro_batch: .* leave one of "
     r"the two out$"),
    ({"all_reduce_alg": "hierarchical", "compression": "fp16"},
     r"^compression='fp16' cannot run with all_reduce_alg='hierarchical' .*choose one of "
     r"\['mpi', 'ring', 'recursive_doubling'\]$"),
    ({"compression_error_feedback": True},
     r"^compression_error_feedback needs a compression \(fp16 or bf16\)"),
    ({"compression": 16}, r"^option 'compression' of strategy 'allreduce' takes a string"),
])
def test_compression_is_refused_where_it_makes_no_sense(options, message):
    with pytest.raises(OptionError, match=message):
        ngdist.compile(zoo.mlp(), optimizer=ngdist.optim.SGD(lr=0.1), **options)


def test_cli_unknown_compression(cli, tmp_path):
    onnx.save(zoo.mlp(seed=0), tmp_path / "mlp.onnx")
    proc = cli("rewrite", "mlp.onnx", "-o", "out.onnx", "--optimizer", "sgd:lr=0.1",
               "--compression", "fp8", cwd=tmp_path)
    assert proc.returncode != 0
    assert "fp8" in proc.stderr and "fp16" in proc.stderr and "bf16" in proc.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_a_rewritten_file_keeps_its_compression(tmp_path, caplog):
    from ngdist.cli.inspect import summarize
    from ngdist.ir.model import save_proto

    save_proto(_cnn_training(compression="fp16"), tmp_path / "fp16.onnx")
    trainer = ngdist.compile(str(tmp_path / "fp16.onnx"), compression="bf16")
    assert "compression='bf16': no float32 gradient AllReduce left to compress" in caplog.text
    assert [c["compression"] for c in summarize(trainer.to_onnx()).comm] == ["none", "fp16"]
    trainer.close()
