"""The DFT's gradient rule (torch.fft.fft / ifft / fftn, FNet's token mixing): against central
differences (the harness of ``grad_harness``: complex and real inputs, forward and inverse, the
axis as an attribute and, from opset 20, as an input), and on what both torch exporters emit
against torch autograd in float64 (loss and every parameter gradient within 1e-4 of the
largest entry, the step graph passing onnx.checker with unique node names); the one-sided
form refused by name."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch comparisons need the torch extra: "
                            "pip install 'ngdist[torch]'")
nn = torch.nn

from grad_harness import case, check_case, lowering_error  # noqa: E402
from onnx import helper  # noqa: E402

from ngdist.frontends import torch as tfront  # noqa: E402
from ngdist.ir.model import split_training_model  # noqa: E402
from ngdist.passes.pipeline import run_passes  # noqa: E402
from step_probe import check_step_graph, gradient_errors, run_step, torch_step  # noqa: E402

TOL = 1e-4
CLASSES = 3


CASES = [
    case("DFT-complex-axis1", "DFT", lambda g: [g.n(2, 5, 2)], axis=1),
    case("DFT-real-axis1", "DFT", lambda g: [g.n(3, 4, 1)], axis=1),
    case("DFT-inverse-axis0", "DFT", lambda g: [g.n(4, 3, 2)], axis=0, inverse=1),
    case("DFT-length-given", "DFT", lambda g: [g.n(2, 6, 2), np.array(6)], axis=1),
    case("DFT-opset20-axis-input", "DFT", lambda g: [g.n(3, 4, 2), None, np.array(-3)],
         opset=20),
    case("DFT-opset20-default-axis", "DFT", lambda g: [g.n(2, 3, 4, 1)], opset=20, inverse=1),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)


def test_a_one_sided_dft_is_refused_with_its_node():
    nodes = [helper.make_node("DFT", ["x"], ["y"], name="rfft0", axis=1, onesided=1)]
    assert lowering_error(nodes, [2, 6, 1]) == (
        "gradient rule of DFT failed on node 'rfft0': DFT node 'rfft0': a one-sided DFT "
        "(torch.fft.rfft) has no gradient rule; use torch.fft.fft and keep half the spectrum")


class Fourier(nn.Module):
    """FNet's mixing (the real part of a 2-D FFT over tokens and features), then an inverse
    FFT over the tokens of a complex signal (both parts kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(12, CLASSES)

    def forward(self, x):  # x [N, 5, 6]
        h = torch.fft.fftn(self.a(x), dim=(1, 2)).real + x
        z = torch.fft.ifft(torch.fft.fft(torch.tanh(h), dim=-1), dim=1)
        return self.b(torch.cat([z.real, z.imag], -1).mean(1))


def _check(model, exp_input: str, module) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 5, 6)).astype(np.float32)
    y = rng.integers(0, CLASSES, 8).astype(np.int64)
    _, step = split_training_model(model)
    check_step_graph(run_passes(step, "local", lower=False))
    got = run_step(model, {exp_input: x, "y": y})
    loss, grads, _ = torch_step(module, x, y, nn.CrossEntropyLoss(), float64=True)
    assert abs(float(got["loss"]) - loss) <= TOL * abs(loss)
    errors = gradient_errors(got, grads)
    assert set(errors) == {n for n, _ in module.named_parameters()}
    assert max(errors.values()) <= TOL, errors


def test_fft_gradients_match_torch_autograd_float64():
    torch.manual_seed(0)
    module = Fourier()
    model, exp = tfront.training_model(module, torch.zeros(2, 5, 6), loss=nn.CrossEntropyLoss(),
                                       optimizer="sgd:lr=0.01")
    _check(model, exp.input_names[0], module)


def test_dynamo_fft_gradients_match_torch_autograd_float64():
    """The dynamo exporter at opset 20 and above gives the DFT's axis as an input."""
    from ngdist.frontends.onnx import build_training_model

    torch.manual_seed(0)
    module = Fourier()
    forward = torch.onnx.export(
        module, (torch.zeros(2, 5, 6),), dynamo=True, opset_version=23, optimize=False,
        verbose=False, input_names=["x"], output_names=["output"],
        dynamic_shapes=({0: torch.export.Dim("batch")},)).model_proto
    assert "DFT" in {n.op_type for n in forward.graph.node}
    model = build_training_model(forward, params=[n for n, _ in module.named_parameters()],
                                 optimizer="sgd:lr=0.01")
    _check(model, "x", module)
