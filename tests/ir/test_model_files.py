"""Reading model files: regular files only, a size limit, external data confined to the model's
folder, and training models validated on load (messages checked exactly)."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ngdist
from ngdist import zoo
from ngdist.cli import main
from ngdist.errors import GraphError, ModelLoadError
from ngdist.ir.model import load_proto, save_proto

FILE_HINT = "not a regular file; give the path of an .onnx file"


@pytest.fixture
def training() -> onnx.ModelProto:
    return ngdist.to_training_model(zoo.mlp((64, 16, 10)),
                                    optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))


def refused(path, message: str, capsys=None) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_proto(path)
    assert str(info.value) == message


# --------------------------------------------------------------------------- special files

@pytest.mark.timeout(20)
def test_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)  # nobody writes: an open() for reading would block for ever
    refused(fifo, f"{fifo}: is a FIFO (named pipe), {FILE_HINT}")
    assert main(["inspect", str(fifo)]) == 1
    assert capsys.readouterr().err == f"ngdist: error: {fifo}: is a FIFO (named pipe), {FILE_HINT}\n"
    with pytest.raises(ModelLoadError, match="FIFO"):
        ngdist.compile(str(fifo))


def test_directory_and_devices_are_refused(tmp_path):
    refused(tmp_path, f"{tmp_path}: is a directory, {FILE_HINT}")
    refused("/dev/zero", f"/dev/zero: is a character device, {FILE_HINT}")
    link = tmp_path / "zero.onnx"
    link.symlink_to("/dev/zero")  # the path the user gives may be a link; what it names counts
    refused(link, f"{link}: is a character device, {FILE_HINT}")


def test_size_limit(tmp_path, monkeypatch, training):
    path = tmp_path / "m.onnx"
    save_proto(training, path)
    size = path.stat().st_size
    monkeypatch.setenv("NGDIST_MAX_MODEL_BYTES", str(size - 1))
    refused(path, f"{path}: {size:,} bytes, more than the limit of {size - 1:,} bytes; store "
                  "large weights as external data (onnx.save(..., save_as_external_data=True)) "
                  "or raise the limit with NGDIST_MAX_MODEL_BYTES")
    monkeypatch.setenv("NGDIST_MAX_MODEL_BYTES", str(size))
    assert load_proto(path) == training
    monkeypatch.setenv("NGDIST_MAX_MODEL_BYTES", "2G")
    refused(path, "NGDIST_MAX_MODEL_BYTES='2G' is not a positive number of bytes; set it to "
                  "e.g. 2147483648 or unset it")
    monkeypatch.delenv("NGDIST_MAX_MODEL_BYTES")
    from ngdist.ir.modelfile import max_model_bytes
    assert max_model_bytes() == 2 ** 31


# --------------------------------------------------------------------------- external data

def save_external(model: onnx.ModelProto, folder: Path, location: str = "weights.bin") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    # a copy: onnx.save moves the data out of the model it is given
    onnx.save(copy.deepcopy(model), path, save_as_external_data=True,
              all_tensors_to_one_file=True, location=location, size_threshold=0)
    return path


def retarget(path: Path, tensor: str, **fields: str) -> None:
    """Rewrite the external-data fields of one tensor of the model file ``path``."""
    model = onnx.load(path, load_external_data=False)
    t = next(t for t in model.graph.initializer if t.name == tensor)
    for e in t.external_data:
        if e.key in fields:
            e.value = fields.pop(e.key)
    for k, v in fields.items():
        t.external_data.add(key=k, value=v)
    onnx.save(model, path)


def test_external_data_is_read_from_the_models_folder(tmp_path, monkeypatch, training):
    path = save_external(training, tmp_path / "models")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(b"\0" * (tmp_path / "models/weights.bin").stat().st_size)
    monkeypatch.chdir(elsewhere)  # a weights.bin of zeros here must not be the one read
    loaded = load_proto(path)
    for got, want in zip(loaded.graph.initializer, training.graph.initializer):
        np.testing.assert_array_equal(numpy_helper.to_array(got), numpy_helper.to_array(want))
        assert got.data_location == TensorProto.DEFAULT and not got.external_data


def test_external_data_in_a_subfolder(tmp_path, training):
    (tmp_path / "m" / "data").mkdir(parents=True)
    path = save_external(training, tmp_path / "m", "data/weights.bin")
    assert load_proto(path).graph.initializer[0] == training.graph.initializer[0]


@pytest.mark.parametrize("location, reason", [
    ("../secret.bin", "the external data location '../secret.bin' leads out of the model's "
                      "folder ('..'); keep the data file next to the model"),
    ("sub/../../secret.bin", "the external data location 'sub/../../secret.bin' leads out of "
                             "the model's folder ('..'); keep the data file next to the model"),
    ("ABS", "the external data location 'ABS' is an absolute path; ngdist reads external data "
            "only from files inside the model's folder, named relative to it"),
    ("link.bin", "the external data location 'link.bin' passes through the symbolic link "
                 "'link.bin'; ngdist follows no links out of the model's folder: copy the data "
                 "file next to the model"),
    ("up/secret.bin", "the external data location 'up/secret.bin' passes through the symbolic "
                      "link 'up'; ngdist follows no links out of the model's folder: copy the "
                      "data file next to the model"),
    ("absent.bin", "its external data file 'absent.bin' does not exist in the model's folder "
                   "MODELDIR"),
])
def test_external_data_outside_the_folder_is_refused(tmp_path, training, location, reason):
    folder = tmp_path / "models"
    path = save_external(training, folder)
    secret = tmp_path / "secret.bin"
    secret.write_bytes((folder / "weights.bin").read_bytes())  # same size: only the path is wrong
    (folder / "link.bin").symlink_to(secret)
    (folder / "up").symlink_to(tmp_path)
    location = location.replace("ABS", str(secret))
    retarget(path, "fc0.weight", location=location)
    reason = reason.replace("ABS", str(secret)).replace("MODELDIR", str(folder))
    refused(path, f"{path}: tensor 'fc0.weight': {reason}")


def test_truncated_or_short_external_data(tmp_path, training):
    folder = tmp_path / "models"
    path = save_external(training, folder)
    data = folder / "weights.bin"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:size - 10])  # the last tensor (fc1.bias) lost 10 bytes
    last = training.graph.initializer[-1].name
    model = onnx.load(path, load_external_data=False)
    offset = next(int(e.value) for e in model.graph.initializer[-1].external_data
                  if e.key == "offset")
    refused(path, f"{path}: tensor {last!r}: external data at offset {offset:,} + length 40 "
                  f"lies beyond the end of 'weights.bin' ({size - 10:,} bytes); the data file "
                  "is truncated or belongs to another model")
    path = save_external(training, tmp_path / "b")
    retarget(path, "fc0.weight", offset=str(10 ** 9))
    refused(path, f"{path}: tensor 'fc0.weight': external data at offset 1,000,000,000 + length "
                  "4,096 lies beyond the end of 'weights.bin' (4,840 bytes); the data file is "
                  "truncated or belongs to another model")
    retarget(path, "fc0.weight", offset="0", length="12")
    refused(path, f"{path}: tensor 'fc0.weight': external data of 12 bytes, but its type and "
                  "shape [16, 64] need 4,096 bytes")
    retarget(path, "fc0.weight", offset="-8", length="4096")
    refused(path, f"{path}: tensor 'fc0.weight': external data offset='-8' is not a "
                  "non-negative integer")


def test_external_data_that_is_a_fifo_is_refused(tmp_path, training):
    folder = tmp_path / "models"
    path = save_external(training, folder)
    (folder / "weights.bin").unlink()
    os.mkfifo(folder / "weights.bin")
    refused(path, f"{path}: tensor 'fc0.weight': its external data file 'weights.bin': is a "
                  "FIFO (named pipe), not a regular file; external data must be a regular file")


def test_saving_holds_its_own_bytes(tmp_path, training):
    """A model read with external data and saved again (trainer.save, ngdist train --save,
    ngdist rewrite) holds its bytes itself: it runs with the data file gone."""
    folder = tmp_path / "models"
    path = save_external(training, folder)
    trainer = ngdist.compile(str(path))
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    y = np.arange(8) % 10
    trainer.step({"x": x, "y": y})
    trainer.save(tmp_path / "saved.onnx")
    assert main(["rewrite", str(path), "-o", str(tmp_path / "rewritten.onnx")]) == 0
    (folder / "weights.bin").unlink()
    for name in ("saved.onnx", "rewritten.onnx"):
        saved = onnx.load(tmp_path / name, load_external_data=False)
        assert all(t.data_location == TensorProto.DEFAULT for t in saved.graph.initializer)
    oracle = ngdist.compile(training)  # the same model given in memory
    oracle.step({"x": x, "y": y})
    again = ngdist.compile(str(tmp_path / "saved.onnx"))
    assert again.step({"x": x, "y": y}).loss == oracle.step({"x": x, "y": y}).loss


def test_unread_external_data_in_memory_is_refused(tmp_path, training):
    path = save_external(training, tmp_path)
    model = onnx.load(path, load_external_data=False)
    with pytest.raises(ModelLoadError) as info:
        ngdist.compile(model)
    assert str(info.value) == (
        "tensors ['fc0.weight', 'fc0.bias', 'fc1.weight', 'fc1.bias'] of the model are stored "
        "in external data files that were not read; pass the model's path (ngdist reads the "
        "external data from the model's folder) or load it with onnx.load(path) first")


# --------------------------------------------------------------------------- training models

def tamper(model: onnx.ModelProto, how: str) -> onnx.ModelProto:
    model = copy.deepcopy(model)
    info = model.training_info[0]
    props = {p.key: p.value for p in model.metadata_props}
    if how == "missing value":
        node = next(n for n in info.algorithm.node if n.op_type == "Gradient")
        node.input[0] = "fc9.weight"
    elif how == "unknown role":
        helper.set_model_props(model, {**props, "ngdist.roles": json.dumps(
            {**json.loads(props["ngdist.roles"]), "fc0.bias": "weights"})})
    elif how == "bad roles json":
        helper.set_model_props(model, {**props, "ngdist.roles": '{"fc0.weight": "param"'})
    elif how == "roles nested too deep":
        helper.set_model_props(model, {**props, "ngdist.roles": "[" * 100_000})
    elif how == "roles not a mapping":
        helper.set_model_props(model, {**props, "ngdist.roles": '["param"]'})
    elif how == "role of a missing name":
        helper.set_model_props(model, {**props, "ngdist.roles": json.dumps(
            {**json.loads(props["ngdist.roles"]), "fc9.weight": "param"})})
    elif how == "binding to a missing output":
        info.update_binding[0].value = "fc0.weight.newer"
    elif how == "binding to a data input":  # the labels, returned as an output too
        info.algorithm.output.add().CopyFrom(helper.make_tensor_value_info("y", 0, None))
        info.update_binding[1].value = "y"
    elif how in ("optimizer without alpha", "optimizer mode unknown"):
        node = next(n for n in info.algorithm.node if n.op_type == "Momentum")
        kept = [a for a in node.attribute if a.name != ("alpha" if "alpha" in how else "mode")]
        del node.attribute[:]
        node.attribute.extend(kept)
        if "mode" in how:
            node.attribute.append(helper.make_attribute("mode", "heavy"))
    elif how == "optimizer input empty":  # a gradient renamed to '' (an omitted input)
        for node in info.algorithm.node:
            node.input[:] = ["" if i == "fc1.bias.grad" else i for i in node.input]
            node.output[:] = ["" if o == "fc1.bias.grad" else o for o in node.output]
    elif how == "binding of a missing name":
        info.update_binding[0].key = "fc9.weight"
    elif how == "binding twice":
        info.update_binding.add(key=info.update_binding[0].key, value=info.update_binding[0].value)
    elif how == "no binding":
        del info.update_binding[:]
    elif how == "empty training info":
        del model.training_info[:]
        model.training_info.add()
    elif how == "two training infos":
        model.training_info.add().CopyFrom(info)
    elif how == "loss not an output":
        helper.set_model_props(model, {**props, "ngdist.loss": "logits"})
    elif how == "string parameter":
        t = model.graph.initializer[0]
        t.CopyFrom(helper.make_tensor(t.name, TensorProto.STRING, list(t.dims),
                                      [b"w"] * int(np.prod(t.dims))))
    elif how in ("string hyper-parameter", "string with raw bytes"):
        for coll in (model.graph.initializer, info.algorithm.initializer):
            for t in coll:
                if t.name == "ngdist.lr":
                    if "raw" in how:  # a type changed under raw float bytes
                        t.data_type = TensorProto.STRING
                    else:
                        t.CopyFrom(helper.make_tensor("ngdist.lr", TensorProto.STRING, [],
                                                      [b"0.1"]))
    elif how == "string data input":
        info.algorithm.input[0].type.tensor_type.elem_type = TensorProto.STRING
    elif how == "initialization graph":
        info.initialization.node.add().CopyFrom(helper.make_node("Identity", ["a"], ["b"]))
    return model


TAMPERED = {
    "missing value": "algorithm node 'ngdist/gradient' (Gradient) reads ['fc9.weight'], which "
                     "no input, initializer or node of the training step defines",
    "unknown role": "metadata ngdist.roles gives unknown roles {'fc0.bias': 'weights'}; roles "
                    "are data, param, buffer, state, hyper",
    "bad roles json": "metadata ngdist.roles is not valid JSON (Expecting ',' delimiter: line 1 "
                      "column 23 (char 22))",
    "roles not a mapping": "metadata ngdist.roles must be a JSON object of name -> role",
    "roles nested too deep": "metadata ngdist.roles is not valid JSON (maximum recursion depth "
                             "exceeded while decoding a JSON array from a unicode string)",
    "role of a missing name": "metadata ngdist.roles names ['fc9.weight'], which are not "
                              "values of the training step",
    "binding to a missing output": "update_binding maps {'fc0.weight': 'fc0.weight.newer'} to "
                                   "values that are not outputs of the algorithm graph (its "
                                   "outputs: ['ngdist.loss', 'fc0.weight.new', 'fc0.bias.new', "
                                   "'fc1.weight.new', 'fc1.bias.new', 'fc0.weight.momentum.new',"
                                   " 'fc0.bias.momentum.new', 'fc1.weight.momentum.new'] ...)",
    "binding to a data input": "update_binding maps {'fc0.bias': 'y'} to data inputs of the "
                               "step, which a batch feeds, not values the step computes; bind "
                               "each to the output of its update",
    "optimizer input empty": "algorithm node 'ngdist/momentum' (Momentum) has empty inputs at "
                             "positions [9]; every input of ai.onnx.preview.training.Momentum "
                             "is required",
    "binding of a missing name": "update_binding names ['fc9.weight'], which are initializers "
                                 "of neither the main graph nor the algorithm graph",
    "binding twice": "update_binding binds ['fc0.weight'] more than once",
    "no binding": "training_info[0].update_binding is empty: the step updates nothing",
    "empty training info": "training_info[0].algorithm has no nodes: the training step is empty",
    "two training infos": "the model holds 2 training_info entries; ngdist trains with exactly "
                          "one",
    "loss not an output": "metadata ngdist.loss names 'logits', which is not an output of the "
                          "algorithm graph (its outputs: ['ngdist.loss', 'fc0.weight.new', "
                          "'fc0.bias.new', 'fc1.weight.new', 'fc1.bias.new', "
                          "'fc0.weight.momentum.new', 'fc0.bias.momentum.new', "
                          "'fc1.weight.momentum.new'] ...)",
    "string parameter": "update_binding names {'fc0.weight': 'STRING'}: ngdist updates tensors "
                        "of the types BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, INT16, INT32, "
                        "INT64, INT8, UINT16, UINT32, UINT64, UINT8",
    "string hyper-parameter": "the training step holds the initializers {'ngdist.lr': "
                              "'STRING'}; ngdist holds tensors of the types BFLOAT16, BOOL, "
                              "DOUBLE, FLOAT, FLOAT16, INT16, INT32, INT64, INT8, UINT16, "
                              "UINT32, UINT64, UINT8",
    "string data input": "the training step's data input 'x' has element type STRING; ngdist "
                         "feeds tensors of the types BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, "
                         "INT16, INT32, INT64, INT8, UINT16, UINT32, UINT64, UINT8",
    "initialization graph": "training_info[0] has an initialization graph, which ngdist does "
                            "not run; initialize the state as initializers of the algorithm "
                            "graph",
}


@pytest.mark.parametrize("how", sorted(TAMPERED))
def test_invalid_training_model_is_refused(tmp_path, training, how, capsys):
    bad = tamper(training, how)
    path = tmp_path / "bad.onnx"
    save_proto(bad, path)
    refused(path, f"{path}: {TAMPERED[how]}")
    with pytest.raises(GraphError) as info:  # the same model given in memory
        ngdist.compile(bad)
    assert str(info.value) == TAMPERED[how]
    out = tmp_path / "out.onnx"
    assert main(["rewrite", str(path), "-o", str(out)]) == 1
    assert capsys.readouterr().err == f"ngdist: error: {path}: {TAMPERED[how]}\n"
    assert not out.exists()


BAD_OPTIMIZER = {  # refused when the optimizer is lowered, before anything trains
    "optimizer without alpha": "optimizer node 'ngdist/momentum' (Momentum) lacks its required "
                               "attribute 'alpha'; ai.onnx.preview.training.Momentum needs "
                               "['alpha', 'beta', 'mode', 'norm_coefficient']",
    "optimizer mode unknown": "optimizer node 'ngdist/momentum' (Momentum): mode is 'heavy'; "
                              "the modes are 'standard' and 'nesterov'",
}


@pytest.mark.parametrize("how", sorted(BAD_OPTIMIZER))
def test_optimizer_node_with_bad_attributes_is_refused(tmp_path, training, how, capsys):
    bad = tamper(training, how)
    with pytest.raises(GraphError) as info:
        ngdist.compile(bad)
    assert str(info.value) == BAD_OPTIMIZER[how]
    path, out = tmp_path / "bad.onnx", tmp_path / "out.onnx"
    save_proto(bad, path)
    assert main(["rewrite", str(path), "-o", str(out)]) == 1
    assert capsys.readouterr().err == f"ngdist: error: {BAD_OPTIMIZER[how]}\n"
    assert not out.exists()


def test_rewrite_checks_what_it_writes(tmp_path, training, monkeypatch, capsys):
    """ngdist rewrite validates its output as a load would, and writes nothing it would refuse."""
    import ngdist.passes.pipeline as pipeline

    real = pipeline.rewrite
    monkeypatch.setattr(pipeline, "rewrite",
                        lambda *a, **k: tamper(real(*a, **k), "binding to a missing output"))
    path, out = tmp_path / "t.onnx", tmp_path / "out.onnx"
    save_proto(training, path)
    assert main(["rewrite", str(path), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ngdist: error: update_binding maps {'fc0.weight': "
                          "'fc0.weight.newer'} to values that are not outputs")
    assert not out.exists()


@pytest.mark.parametrize("strategy", ["allreduce", "pushsum", "simple", "local"])
def test_what_rewrite_writes_loads_back_and_runs(tmp_path, strategy):
    """Every file ngdist writes, ngdist loads back and runs: one step of the rewritten CNN
    file on one rank gives the loss of the model compiled from memory."""
    forward = zoo.cnn((4, 4))
    path, out = tmp_path / "cnn.onnx", tmp_path / "cnn.dist.onnx"
    save_proto(forward, path)
    assert main(["rewrite", str(path), "-o", str(out), "--strategy", strategy,
                 "--optimizer", "sgd:lr=0.1,momentum=0.9"]) == 0
    rng = np.random.default_rng(1)
    batch = {"x": rng.standard_normal((6, 1, 8, 8)).astype(np.float32), "y": np.arange(6) % 10}
    loaded = ngdist.compile(str(out), strategy=strategy)
    oracle = ngdist.compile(forward, optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                            strategy=strategy)
    for _ in range(2):
        assert loaded.step(batch).loss == pytest.approx(oracle.step(batch).loss, rel=1e-6)


def test_damaged_nodes_are_refused(tmp_path, training):
    """A node without op type or with an untyped attribute: onnx's checker lets them through
    in the training step (they made onnx_ir fail to serialize the step)."""
    bad = copy.deepcopy(training)
    node = next(n for n in bad.training_info[0].algorithm.node if n.op_type == "Momentum")
    node.op_type = ""
    path = tmp_path / "no_op.onnx"
    save_proto(bad, path)
    refused(path, f"{path}: node 'ngdist/momentum' of graph 'ngdist_step' has no op type; the "
                  "file is damaged")
    bad = copy.deepcopy(training)
    bad.graph.node[0].attribute.add(name="alpha")  # no type
    path = tmp_path / "untyped.onnx"
    save_proto(bad, path)
    refused(path, f"{path}: node 'fc0' of graph 'mlp' (Gemm) has an attribute without a type "
                  "('alpha'); the file is damaged")


def test_string_tensor_with_raw_bytes_is_refused(tmp_path, training):
    """A float's element type flipped to STRING over its raw bytes: ONNX keeps strings in
    string_data, so the data cannot be read (it reached the trainer as a numpy reshape error)."""
    path = tmp_path / "string_raw.onnx"
    save_proto(tamper(training, "string with raw bytes"), path)
    refused(path, f"{path}: tensor 'ngdist.lr' of type STRING holds raw bytes, which ONNX "
                  "allows only for fixed-size types; the file is damaged")


def test_value_of_an_unknown_element_type_is_refused(tmp_path, training):
    """A bit flip in a declared element type of the step (onnx's checker lets it through; it
    made onnx_ir fail to read the step)."""
    bad = copy.deepcopy(training)
    bad.training_info[0].algorithm.value_info.append(
        helper.make_tensor_value_info("fc0.weight.grad", 65, [16, 64]))
    path = tmp_path / "elem65.onnx"
    save_proto(bad, path)
    refused(path, f"{path}: value 'fc0.weight.grad' of graph 'ngdist_step' has the unknown "
                  "element type 65; the file is damaged")
    with pytest.raises(GraphError) as info:  # the same model in memory, as onnx_ir reads it
        ngdist.compile(bad)
    assert str(info.value) == ("the training step cannot be read (ValueError: 65 is not a valid "
                               "DataType); the file is damaged or was not written by an ONNX "
                               "exporter")
