"""onnxruntime's memory pattern is off on the CPU: with it, the second run of a session takes
the first run's allocations as one block, which the arena cannot carve from the chunks the
first run left free, so a step's resident size grew by its activations at step 2 and kept
them (sessions.py, session_options)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

import ngdist
from ngdist.runtime.sessions import make_session, session_options

MIB = 1 << 20


def _resident() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) << 10  # type: ignore[union-attr]


def test_the_memory_pattern_is_off_on_the_cpu_and_left_to_other_devices() -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                              ir_version=8)
    assert make_session(model).get_session_options().enable_mem_pattern is False
    assert session_options(device="cuda").enable_mem_pattern is True


def test_a_steps_resident_size_does_not_grow_after_its_first_step() -> None:
    """An MLP on a batch of 2048 x 512 (each activation 4 MiB): with the memory pattern, the
    second step held 63 MiB more than the first, for good; now steps 2-5 hold what step 1
    did, within a few MiB."""
    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    x, y = torch.randn(2048, 512), torch.randint(0, 10, (2048,))
    trainer = ngdist.compile(model, [x], loss=torch.nn.CrossEntropyLoss(),
                             optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                             strategy="local", intra_op_threads=1)
    feeds = {"input": x.numpy(), "y": y.numpy()}
    sizes = []
    for _ in range(5):
        trainer.step(feeds, fetch_stats=False)
        sizes.append(_resident())
    growth = (max(sizes[1:]) - sizes[0]) / MIB
    assert growth < 12, f"resident MiB after each step: {[s // MIB for s in sizes]}"
    assert np.isfinite(trainer.step(feeds).loss)
