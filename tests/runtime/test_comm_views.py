"""How a CPU kernel sees its inputs: views of the values' own memory, never copies; read-only
DLPack views for inputs the kernel must not write, writable views for donated inputs (made in
the step for the node alone), which it may reduce in place."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ngdist.comm.local import LocalGroup
from ngdist.ir.domain import DOMAIN
from ngdist.ir.model import IR_VERSION
from ngdist.kernels import KERNELS
from ngdist.runtime.comm_runner import CommRunner
from ngdist.runtime.plan import build_plan
from ngdist.runtime.sessions import CPU


def test_onnxruntime_dlpack_arrays_are_read_only_in_numpy():
    """Why a donated input goes through ``OrtValue.numpy()``: onnxruntime's ``__dlpack__``
    takes no ``max_version``, so numpy falls back to the unversioned capsule and marks the
    array read-only (numpy's own versioned capsule gives a writable one). When this fails,
    onnxruntime exports writable versioned capsules and DLPack can serve donated inputs."""
    a = np.arange(8, dtype=np.float32)
    value = ort.OrtValue.ortvalue_from_numpy(a)
    with pytest.raises(TypeError, match="max_version"):
        value.__dlpack__(max_version=(1, 0))
    view = np.from_dlpack(value)
    assert not view.flags.writeable and view.ctypes.data == value.data_ptr()
    with pytest.raises(ValueError, match="WRITEABLE"):
        view.flags.writeable = True
    assert np.from_dlpack(a).flags.writeable
    same = value.numpy()  # on the CPU the same memory, writable: no copy either
    assert same.flags.writeable and same.ctypes.data == value.data_ptr()


def _plan():
    """g = x * w (made for its AllReduce alone: donated); w (a step input) reduced too."""
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [4])  # noqa: E731
    nodes = [helper.make_node("Mul", ["x", "w"], ["g"], name="mul"),
             helper.make_node("AllReduce", ["g"], ["gr"], name="grads", domain=DOMAIN),
             helper.make_node("AllReduce", ["w"], ["wr"], name="weights", domain=DOMAIN)]
    graph = helper.make_graph(nodes, "g", [vi("x"), vi("w")], [vi("gr"), vi("wr")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(DOMAIN, 1)],
                              ir_version=IR_VERSION)
    return build_plan(model, 2, overlap=True)


def test_a_kernel_gets_read_only_views_but_of_donated_inputs():
    plan = _plan()
    seen: dict[str, tuple[bool, bool]] = {}
    values = {}

    def spy(group, node, inputs):
        (x,) = inputs
        value = values[node.name]
        seen[node.name] = (x.flags.writeable, x.ctypes.data == value.data_ptr())
        return [x]

    runner = CommRunner(plan, LocalGroup(30.0), CPU)
    for idx, node in plan.comm_nodes.items():
        runner.kernels[idx] = dataclasses.replace(KERNELS["AllReduce"], fn=spy)
        values[node.name] = ort.OrtValue.ortvalue_from_numpy(np.ones(4, np.float32))
        outs, _ = runner.run([idx], [values[node.name]])
        assert outs[0] is values[node.name]  # handed back: the value itself, no copy
    assert {n.name: n.facts.donated for n in plan.comm_nodes.values()} == \
        {"grads": (True,), "weights": (False,)}
    # (writable, the value's own memory)
    assert seen == {"grads": (True, True), "weights": (False, True)}
