"""Tensors of more dimensions than numpy and onnxruntime hold (64) are refused when a model file
is loaded, with one line, by every command; ``rewrite`` writes nothing then."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

import ngdist.zoo as zoo
from ngdist.errors import ModelLoadError
from ngdist.ir.modelfile import MAX_DIMS, check_nodes, check_tensor_data


def reshaped(model: onnx.ModelProto, rank: int) -> onnx.ModelProto:
    """``model`` with its first initializer given ``rank`` dims (same element count)."""
    t = model.graph.initializer[0]
    count = int(np.prod(t.dims))
    del t.dims[:]
    t.dims.extend([1] * (rank - 1) + [count])
    return model


def declared(model: onnx.ModelProto, rank: int) -> onnx.ModelProto:
    dims = model.graph.input[0].type.tensor_type.shape.dim
    while len(dims) < rank:
        dims.add().dim_value = 1
    return model


def ngdist(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ngdist", *args], capture_output=True,
                          text=True, cwd=tmp_path, timeout=240)


@pytest.mark.parametrize("rank", [MAX_DIMS, MAX_DIMS + 1, 100])
def test_the_limit_is_64_dimensions(rank):
    for model, what in ((reshaped(zoo.mlp((8, 4, 3)), rank), "tensor 'fc0.weight'"),
                        (declared(zoo.mlp((8, 4, 3)), rank), "value 'x' of graph 'mlp'")):
        if rank <= MAX_DIMS:
            check_nodes(model, "m.onnx")
            check_tensor_data(model, "m.onnx")
            continue
        with pytest.raises(ModelLoadError) as err:
            check_nodes(model, "m.onnx")
            check_tensor_data(model, "m.onnx")
        assert str(err.value) == (f"m.onnx: {what} has {rank} dimensions; numpy and "
                                  "onnxruntime hold at most 64: re-export the model with "
                                  "tensors of at most 64")


def test_every_command_refuses_a_100_dimension_tensor_in_one_line(tmp_path):
    forward = zoo.mlp((64, 16, 10))
    onnx.save(forward, tmp_path / "mlp.onnx")
    rc = ngdist(tmp_path, "rewrite", "mlp.onnx", "-o", "mlp.dist.onnx", "--optimizer", "sgd:lr=0.1")
    assert rc.returncode == 0, rc.stderr
    onnx.save(reshaped(onnx.load(tmp_path / "mlp.dist.onnx"), 100), tmp_path / "dist100.onnx")
    onnx.save(reshaped(forward, 100), tmp_path / "fwd100.onnx")
    onnx.save(declared(zoo.mlp((64, 16, 10)), 100), tmp_path / "in100.onnx")
    np.savez(tmp_path / "d.npz", x=np.zeros((64, 64), np.float32), y=np.zeros(64, np.int64))
    for name, what in (("fwd100", "tensor 'fc0.weight'"), ("dist100", "tensor 'fc0.weight'"),
                       ("in100", "value 'x' of graph 'mlp'")):
        line = (f"ngdist: error: {name}.onnx: {what} has 100 dimensions; numpy and onnxruntime "
                "hold at most 64: re-export the model with tensors of at most 64\n")
        for cmd in (["rewrite", f"{name}.onnx", "-o", "out.onnx", "--optimizer", "sgd:lr=0.1"],
                    ["train", f"{name}.onnx", "--data", "d.npz", "--optimizer", "sgd:lr=0.1"],
                    ["inspect", f"{name}.onnx"]):
            proc = ngdist(tmp_path, *cmd)
            assert (proc.returncode, proc.stderr) == (1, line), cmd
            assert not (tmp_path / "out.onnx").exists()
