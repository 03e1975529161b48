"""Integer ``pow`` and ``sum`` through ngdist's symbolics (frontends/torch_math.py): exact and
wrapping at 64 bits as torch's, where onnxruntime's integer Pow and int64 ReduceSum round
through doubles; a hashed embedding (Hugging Face BLT's rolling hash of byte groups) trains
as torch does (float64 oracle)."""
from __future__ import annotations

import io

import numpy as np
import onnxruntime as ort
import pytest
import torch
from step_probe import gradient_errors, run_step

from ngdist.frontends import torch as tfront
from ngdist.frontends.torch_symbolics import lent_symbolics

OPSET = 18
PRIME = 1000000007
IDS = torch.tensor([[3, 0, 1, 7], [4, 1, 2, 9], [250, 255, 0, 17]])


class Fn(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _ort(fn, *args: torch.Tensor) -> np.ndarray:
    buf = io.BytesIO()
    with lent_symbolics(OPSET):
        torch.onnx.export(Fn(fn), args, buf, dynamo=False, opset_version=OPSET)
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})[0]


@pytest.mark.parametrize("fn", [
    lambda t: torch.tensor(PRIME) ** torch.arange(t.shape[-1]),  # past 2 ** 63: wraps
    lambda t: t ** 3, lambda t: t.int() ** 2, lambda t: t ** t.remainder(5),
    lambda t: (t * 4377642754154037417).sum(-1), lambda t: t.sum(),
    lambda t: t.int().sum((0, 1)), lambda t: t.sum(0, keepdim=True), lambda t: (t > 1).sum(1),
    lambda t: t.sum(1, dtype=torch.int32), lambda t: t[:, :0].sum(1),
    lambda t: t.float().sum(-1), lambda t: t.float() ** 2,
], ids=["prime-powers", "cube", "int32-square", "tensor-exponent", "wrapping-sum", "sum-all",
        "int32-sum-axes", "keepdim", "bool-count", "dtype", "empty-axis", "float-sum",
        "float-pow"])
def test_integer_pow_and_sum_are_exact_like_torch(fn):
    got, exact = _ort(fn, IDS), fn(IDS).numpy()
    assert got.dtype == exact.dtype and got.shape == exact.shape
    np.testing.assert_array_equal(got, exact)


class HashedEmbedding(torch.nn.Module):
    """BLT's hash of each token with its 3 predecessors (``prime ** arange`` weights summed:
    past 2 ** 63, wrapping), modulo the table's size, looked up in an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(97, 4)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        windows = torch.cat([torch.zeros_like(ids[:, :3]), ids], 1).unfold(1, 4, 1)
        hashes = (windows * torch.tensor(PRIME) ** torch.arange(4)).sum(-1) % 97
        return self.out(self.table(hashes)).mean(1)


def test_a_hashed_embedding_trains_like_torch_float64():
    module, y = HashedEmbedding(), torch.tensor([0, 2, 1])
    model, exp = tfront.training_model(module, (IDS,), loss=torch.nn.CrossEntropyLoss(),
                                       input_names=["ids"], optimizer="sgd:lr=0.1")
    step = run_step(model, {"ids": IDS.numpy(), "y": y.numpy()})
    exact = module.double()
    loss = torch.nn.functional.cross_entropy(exact(IDS), y)
    loss.backward()
    assert abs(float(step["loss"]) - loss.item()) < 1e-6
    errors = gradient_errors(step, {n: p.grad.numpy() for n, p in exact.named_parameters()})
    assert max(errors.values()) < 1e-5, errors
