"""Whole-model gradients of ngdist's autodiff against PyTorch autograd.

Each model is exported by ``torch.onnx.export`` in training mode (through
``ngdist.frontends.torch``), differentiated by ngdist's autodiff pass and run once in
onnxruntime; loss and every parameter gradient must match torch autograd on the same batch
(ngdist in float32; max relative error <= 1e-4, relative to the largest entry of torch's
tensor; the reference is torch's autograd in float64, so that torch's own float32 rounding
does not count against ngdist).

Dropout: ngdist draws its mask inside onnxruntime. The test reads that mask from the
Dropout node's own mask output in the same step and gives it to torch as a fixed mask
(x * mask / (1 - p)), so both sides compute the same function; with p = 0.5 and 0.3 the
comparison stays sensitive to the mask being reused in the backward pass and to the scale.
(Seeding both sides alike is not possible: torch's and onnxruntime's generators differ.)
BatchNorm: batch statistics in the step, and after 5 SGD steps the running mean and
(unbiased) running variance equal torch's.
"""
from __future__ import annotations

import numpy as np
import pytest

import torch  # noqa: E402
nn = torch.nn

import ngdist  # noqa: E402
from ngdist.data import load_digits  # noqa: E402
from ngdist.frontends import torch as tfront  # noqa: E402
from step_probe import (dropout_mask_outputs, gradient_errors, max_rel_err, run_step,
                        torch_step)  # noqa: E402

TOL = 1e-4


class MLPDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 48), nn.Linear(48, 32), nn.Linear(32, 10)
        self.drop1, self.drop2 = nn.Dropout(0.5), nn.Dropout(0.3)

    def forward(self, x):
        x = self.drop1(torch.relu(self.fc1(x)))
        return self.fc3(self.drop2(torch.tanh(self.fc2(x))))


class LeNetBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AvgPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32),
                                  nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.features(x))


class ResidualNet(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(self.pool(torch.relu(x + y)).flatten(1))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 16, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=32, dropout=0.0,
                                                activation="gelu", batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        return self.head(self.layer(self.emb(tokens)).mean(1))


def _batch(kind: str, n: int = 32, offset: int = 0):
    if kind == "tokens":
        rng = np.random.default_rng(offset)
        tokens = rng.integers(0, 20, (n, 6)).astype(np.int64)
        return tokens, (tokens.sum(1) % 3).astype(np.int64)
    x, y, _, _ = load_digits(images=kind == "images")
    return x[offset:offset + n], y[offset:offset + n]


MODELS = {"mlp_dropout": (MLPDropout, "flat"), "lenet_bn": (LeNetBN, "images"),
          "residual": (ResidualNet, "images"), "transformer": (TinyTransformer, "tokens")}


@pytest.mark.parametrize("name", list(MODELS))
def test_whole_model_gradients_match_torch_autograd(name):
    cls, kind = MODELS[name]
    torch.manual_seed(0)
    module = cls()
    x, y = _batch(kind)
    loss_fn = nn.CrossEntropyLoss()
    model, exp = tfront.training_model(module, torch.from_numpy(x[:2]), loss=loss_fn,
                                       optimizer="sgd:lr=0.01")
    masks = dropout_mask_outputs(model, module)
    inp = exp.input_names[0]
    got = run_step(model, {inp: x, "y": y}, extra=list(masks.values()))
    fixed = {path: got[out] for path, out in masks.items()}
    if name == "mlp_dropout":  # the masks really drop something
        assert all(0.2 < 1 - m.mean() < 0.7 for m in fixed.values())
    # reference: torch autograd in float64 (torch in float32 carries its own rounding noise)
    loss, grads, _ = torch_step(module, x, y, loss_fn, fixed, float64=True)
    assert abs(float(got["loss"]) - loss) <= TOL * abs(loss)
    assert set(grads) == set(exp.params)
    errors = gradient_errors(got, grads)  # a zero-in-theory gradient: vs the largest one
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("name", ["lenet_bn", "residual"])
def test_batchnorm_running_statistics_match_torch_after_5_steps(name):
    cls, kind = MODELS[name]
    torch.manual_seed(1)
    module = cls()
    ref = cls()
    ref.load_state_dict(module.state_dict())
    ref.train()
    x0, _ = _batch(kind, 2)
    trainer = ngdist.compile(module, torch.from_numpy(x0), loss=nn.CrossEntropyLoss(),
                             optimizer=torch.optim.SGD(module.parameters(), lr=0.1,
                                                       momentum=0.9), strategy="local")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    inp = trainer.inference_model().graph.input[0].name  # the module's forward argument
    for step in range(5):
        x, y = _batch(kind, 32, offset=32 * step)
        trainer.step({inp: x, "y": y})
        opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    trainer.to_torch()
    mine, theirs = module.state_dict(), ref.state_dict()
    stats = [k for k in theirs if k.endswith(("running_mean", "running_var"))]
    assert len(stats) >= 6
    for key in stats:
        assert max_rel_err(mine[key].numpy(), theirs[key].numpy()) <= TOL, key
    for key in [k for k in theirs if k.endswith("num_batches_tracked")]:
        assert int(mine[key]) == int(theirs[key]) == 5
    for key, _ in ref.named_parameters():
        assert max_rel_err(mine[key].numpy(), theirs[key].numpy()) <= 1e-3, key
