"""Placement and the one session factory (runtime/sessions.py)."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ngdist.errors import NgdistError
from ngdist.runtime import sessions
from ngdist.runtime.sessions import CPU, Placement, make_session, placement_for, session_options

PACKAGE = Path(__file__).resolve().parents[2] / "ngdist"
FACTORY = PACKAGE / "runtime" / "sessions.py"


def tiny_model() -> onnx.ModelProto:
    """y = relu(x) * 2 + 1, with an Identity that the optimiser may remove."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Identity", ["r"], ["i"], name="identity"),
             helper.make_node("Mul", ["i", "two"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "one"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
                              initializer=[two, one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def cuda_usable() -> bool:
    """onnxruntime can put a value on a GPU (the CUDA provider loads and a device exists)."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    try:
        ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", 0)
    except Exception:
        return False
    return True


# ---------------------------------------------------------------- Placement
def test_placement_defaults_to_cpu():
    assert CPU == Placement() == Placement("cpu", 0)
    assert CPU.providers == ["CPUExecutionProvider"]
    assert CPU.ort_device == "cpu"


def test_cuda_placement_providers():
    p = Placement("cuda", 3)
    assert p.providers == [("CUDAExecutionProvider", {"device_id": "3"}), "CPUExecutionProvider"]
    assert p.ort_device == "cuda"


def test_device_value_keeps_shape_and_makes_strided_arrays_contiguous(monkeypatch):
    """A device value is made from a C-contiguous array of the same shape: a 0-d value stays
    0-d (a scalar parameter), a transposed one is copied contiguous."""
    import ngdist.runtime.sessions as sessions

    made = []
    monkeypatch.setattr(sessions.ort.OrtValue, "ortvalue_from_numpy",
                        lambda a, device="cpu", device_id=0: made.append((a, device)))
    p = Placement("cuda", 0)
    p.value(np.array(3.0, np.float32))
    p.value(np.arange(6, dtype=np.float32).reshape(2, 3).T)
    assert [(a.shape, d) for a, d in made] == [((), "cuda"), ((3, 2), "cuda")]
    assert made[1][0].flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(made[1][0], np.arange(6).reshape(2, 3).T)


@pytest.mark.parametrize("device", ["tpu", "CPU", "gpu", ""])
def test_unknown_device(device):
    with pytest.raises(NgdistError) as info:
        Placement(device)
    assert str(info.value) == f"unknown device {device!r}; choose one of ['cpu', 'cuda']"


def test_placement_is_frozen():
    with pytest.raises(AttributeError):
        CPU.device = "cuda"  # type: ignore[misc]


def test_cpu_value_is_the_array_itself():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = CPU.value(a)
    assert v.device_name().lower() == "cpu"
    assert v.shape() == [2, 3]
    assert v.numpy().__array_interface__["data"][0] == a.__array_interface__["data"][0]
    a[0, 0] = 42.0
    assert v.numpy()[0, 0] == 42.0


# ---------------------------------------------------------------- placement_for
@pytest.mark.parametrize("device", [None, "cpu"])
def test_placement_for_cpu(device):
    assert placement_for(device) is CPU
    assert placement_for(device, local_rank=3) is CPU


def test_placement_for_unknown_device():
    with pytest.raises(NgdistError) as info:
        placement_for("tpu")
    assert str(info.value) == "unknown device 'tpu'; choose one of ['cpu', 'cuda', 'auto']"


def test_placement_for_cuda_without_the_cuda_provider(monkeypatch):
    monkeypatch.setattr(sessions.ort, "get_available_providers",
                        lambda: ["CPUExecutionProvider"])
    with pytest.raises(NgdistError) as info:
        placement_for("cuda")
    assert str(info.value) == (
        "device='cuda' needs onnxruntime with the CUDA execution provider: pip install "
        "onnxruntime-gpu (a CUDA 13 build from 1.27 on); this onnxruntime has "
        "['CPUExecutionProvider']")


@pytest.mark.skipif(not cuda_usable(), reason="needs a GPU onnxruntime can use")
def test_placement_for_cuda_on_a_gpu():
    assert placement_for("cuda") == Placement("cuda", 0)


@pytest.mark.skipif(cuda_usable(), reason="onnxruntime can use a GPU here")
def test_placement_for_cuda_without_a_usable_gpu():
    """onnxruntime-gpu lists CUDAExecutionProvider among the available providers even when
    the provider library cannot load (no CUDA runtime) or there is no GPU; a session then
    falls back to the CPU without a word. placement_for must say what is missing instead
    of returning a cuda placement nothing can use."""
    with pytest.raises(NgdistError) as info:
        placement_for("cuda")
    assert str(info.value).startswith("device='cuda': "), str(info.value)
    assert "use device='cpu'" in str(info.value) or "Check the CUDA runtime" in str(info.value)


# ---------------------------------------------------------------- session options
def test_session_options_defaults(monkeypatch):
    monkeypatch.delenv("NGDIST_CPU_ARENA", raising=False)
    opts = session_options()
    assert opts.enable_cpu_mem_arena is True
    assert opts.log_severity_level == 3
    default = ort.SessionOptions()
    assert (opts.intra_op_num_threads, opts.inter_op_num_threads) == \
        (default.intra_op_num_threads, default.inter_op_num_threads)


@pytest.mark.parametrize("raw, on", [("0", False), (" 0 ", False), ("1", True), ("", True)])
def test_cpu_arena_switch(monkeypatch, raw, on):
    monkeypatch.setenv("NGDIST_CPU_ARENA", raw)
    assert session_options().enable_cpu_mem_arena is on
    sess = make_session(tiny_model())
    assert sess.get_session_options().enable_cpu_mem_arena is on


def test_intra_op_threads_are_applied():
    opts = session_options(intra_op_threads=3)
    assert (opts.intra_op_num_threads, opts.inter_op_num_threads) == (3, 1)
    sess = make_session(tiny_model(), intra_op_threads=2)
    got = sess.get_session_options()
    assert (got.intra_op_num_threads, got.inter_op_num_threads) == (2, 1)


def test_optimize_false_disables_graph_rewrites():
    on = make_session(tiny_model()).get_session_options()
    off = make_session(tiny_model(), optimize=False).get_session_options()
    assert on.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert off.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL


@pytest.mark.parametrize("optimize", [True, False])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_make_session_runs_a_tiny_model(as_bytes, optimize):
    model = tiny_model()
    sess = make_session(model.SerializeToString() if as_bytes else model, CPU,
                        optimize=optimize)
    assert sess.get_providers() == ["CPUExecutionProvider"]
    x = np.array([[-1.0, 0.5, 2.0], [3.0, -4.0, 0.0]], np.float32)
    (y,) = sess.run(["y"], {"x": x})
    np.testing.assert_array_equal(y, np.maximum(x, 0) * 2 + 1)


def test_make_session_rejects_a_broken_model():
    model = tiny_model()
    model.graph.node[2].input[1] = "missing"
    with pytest.raises(Exception, match="missing"):
        make_session(model)


# ---------------------------------------------------------------- the one factory
def _constructions(path: Path) -> list[int]:
    """Lines of ``path`` that call ``InferenceSession(...)`` (by any spelling of the name)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name == "InferenceSession":
                lines.append(node.lineno)
    return lines


def test_the_scan_sees_a_construction(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("import onnxruntime as ort\nfrom onnxruntime import InferenceSession\n"
                      "a: ort.InferenceSession\n"
                      "s = ort.InferenceSession(b'', providers=[])\nt = InferenceSession(b'')\n")
    assert _constructions(sample) == [4, 5]
    assert _constructions(FACTORY), "sessions.py no longer builds sessions?"


def test_only_the_factory_constructs_sessions():
    offenders = {str(p.relative_to(PACKAGE.parent)): _constructions(p)
                 for p in sorted(PACKAGE.rglob("*.py")) if p != FACTORY}
    assert {k: v for k, v in offenders.items() if v} == {}
