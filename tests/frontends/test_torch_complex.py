"""Complex tensors through the TorchScript export (frontends/torch_complex.py): a rotary
embedding written with complex numbers, as Hugging Face DeepSeek-V2 and Llama 4 write it,
against torch in values and in one-step gradients (float64); any other complex op refused."""
from __future__ import annotations

import io

import numpy as np
import onnxruntime as ort
import pytest
import torch
from step_probe import gradient_errors, run_step
from torch.onnx._internal.torchscript_exporter import utils

from ngdist.errors import GraphError
from ngdist.frontends import torch as tfront
from ngdist.frontends.torch_symbolics import lent_symbolics

OPSET = 18


class Rotary(torch.nn.Module):
    """q = Linear(x) per head, rotated by complex frequencies (DeepSeek-V2's
    apply_rotary_emb: view_as_complex, a product with polar(1, angle) * scale moved to q's
    device, view_as_real, flatten), then a linear head."""

    def __init__(self, heads: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.q = torch.nn.Linear(heads * dim, heads * dim)
        self.out = torch.nn.Linear(heads * dim, 3)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim),
                             persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        pos = torch.arange(t, dtype=x.dtype)
        freqs = pos[:, None] * self.inv_freq.to(x.dtype)[None, :]  # (t, dim / 2)
        cis = torch.polar(torch.ones_like(freqs), freqs) * 0.5
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        cis = cis.unsqueeze(0)[:, None].to(q.device)  # traced as aten::to
        rotated = torch.view_as_real(qc * cis).flatten(3).type_as(q)
        return self.out(rotated.transpose(1, 2).reshape(b, t, -1)).mean(1)


def test_a_complex_rotary_embedding_matches_torch_in_values_and_float64_gradients():
    torch.manual_seed(0)
    module = Rotary()
    x, y = torch.randn(4, 5, 16), torch.randint(0, 3, (4,))
    buf = io.BytesIO()
    with lent_symbolics(OPSET):
        torch.onnx.export(module, (x,), buf, dynamo=False, opset_version=OPSET,
                          input_names=["x"], dynamic_axes={"x": {0: "n", 1: "t"}})
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    ref = Rotary().double()
    ref.load_state_dict(module.state_dict())
    for t in (5, 7):  # the sequence length is dynamic: the frequencies follow it
        xt = torch.randn(2, t, 16)
        (got,) = sess.run(None, {"x": xt.numpy()})
        np.testing.assert_allclose(got, ref(xt.double()).detach().numpy(), atol=2e-6)
    model, exp = tfront.training_model(module, (x,), loss=torch.nn.CrossEntropyLoss(),
                                       optimizer="sgd:lr=0.1")
    assert exp.exporter == "torchscript"
    step = run_step(model, {"x": x.numpy(), "y": y.numpy()})
    loss = torch.nn.functional.cross_entropy(ref(x.double()), y)
    loss.backward()
    assert abs(float(step["loss"]) - float(loss)) < 1e-6
    errors = gradient_errors(step, {n: p.grad.numpy() for n, p in ref.named_parameters()})
    assert set(errors) == {"q.weight", "q.bias", "out.weight", "out.bias"}
    assert max(errors.values()) < 1e-5, errors


class Exp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        z = torch.view_as_complex(self.fc(x).reshape(*x.shape[:-1], 2, 2))
        return torch.view_as_real(torch.exp(z)).flatten(-2)


def test_another_op_of_a_complex_tensor_is_refused_by_name_and_the_exporter_restored():
    builtin = utils._run_symbolic_function
    with pytest.raises(GraphError, match=r"cannot export aten::exp of a complex tensor: ngdist "
                                         r"writes complex tensors as \(real, imaginary\) pairs"):
        with lent_symbolics(OPSET):
            torch.onnx.export(Exp(), (torch.randn(3, 4),), io.BytesIO(), dynamo=False,
                              opset_version=OPSET)
    assert utils._run_symbolic_function is builtin
