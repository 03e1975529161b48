"""The newer gradient rules on what torch exports, against torch autograd in float64.

Each tiny module uses one op family that ngdist's torch frontend exports to an op with a
newer rule (Einsum, InstanceNormalization for nn.GroupNorm / nn.InstanceNorm2d, Resize for
F.interpolate, ReduceL2 for F.normalize, CumSum, ScatterElements, TopK, Trilu, Tile,
DepthToSpace, Col2Im for F.fold, the activations, LSTM, GRU and RNN); it is compiled into a
training model, differentiated by ngdist's autodiff pass and run once in onnxruntime
(float32). Loss and every parameter
gradient must match torch autograd in float64 (max error <= 1e-4 of the largest entry), and
the step graph must pass onnx.checker's full check with unique node names.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch comparisons need the torch extra: "
                            "pip install 'ngdist[torch]'")
nn = torch.nn
F = torch.nn.functional

from ngdist.frontends import torch as tfront  # noqa: E402
from ngdist.ir.model import split_training_model  # noqa: E402
from ngdist.passes.pipeline import run_passes  # noqa: E402
from step_probe import check_step_graph, gradient_errors, run_step, torch_step  # noqa: E402

TOL = 1e-4
CLASSES = 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Head(nn.Module):
    """features(x) [N, C, H, W] -> mean over space -> Linear to CLASSES."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, CLASSES)

    def forward(self, x):
        return self.fc(x.flatten(2).mean(-1))


class EinsumAttention(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, CLASSES)

    def forward(self, x):  # x [N, T, d]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = torch.einsum("bid,bjd->bij", q, k).softmax(-1)
        return self.out(torch.einsum("bij,bjd->bid", attn, v).mean(1))


class Norms(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4) if kind == "group" else nn.InstanceNorm2d(4, affine=True)
        self.head = Head(4)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))))


class Interpolate(nn.Module):
    def __init__(self, mode: str, align_corners: bool | None, scale: float) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), Head(4)
        self.mode, self.align, self.scale = mode, align_corners, scale

    def forward(self, x):
        up = F.interpolate(self.conv(x), scale_factor=self.scale, mode=self.mode,
                           align_corners=self.align)
        return self.head(up * up)  # squared: a linear head would hide the spatial weights


class Normalize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, CLASSES)

    def forward(self, x):
        return self.b(F.normalize(self.a(x), dim=-1) * 3)


class Scan(nn.Module):
    """cumsum (forward and reversed), scatter, scatter_add, topk values, tril, repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(15, CLASSES)

    def forward(self, x):  # x [N, 6]
        h = torch.tanh(self.a(x))
        n = h.shape[0]
        c = torch.cumsum(h, dim=1) + torch.flip(torch.cumsum(torch.flip(h, [1]), 1), [1])
        s = c.scatter(1, torch.tensor([[4, 1]]).expand(n, 2), h[:, :2])
        s = s.scatter_add(1, torch.tensor([[2, 0, 2]]).expand(n, 3), h[:, 3:] * 2)
        top = torch.topk(s, 3, dim=1).values
        square = torch.tril(h[:, :3].unsqueeze(2) * s[:, :3].unsqueeze(1)).flatten(1)
        return self.b(torch.cat([top.repeat(1, 2), square], 1))


class PixelShuffleActs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.prelu = nn.Conv2d(3, 8, 3, padding=1), nn.PReLU(2)
        self.head = Head(2)

    def forward(self, x):
        y = F.pixel_shuffle(self.conv(x), 2)  # [N, 2, 2H, 2W]
        y = F.elu(y) + F.selu(y) + F.softplus(y) + F.mish(y) + F.softsign(y)
        return self.head(self.prelu(y) + torch.atan(y) + torch.sin(y))


class Recurrent(nn.Module):
    """A bidirectional batch-first LSTM, then a GRU whose last state joins the head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(10, 3, batch_first=True)
        self.head = nn.Linear(3, CLASSES)

    def forward(self, x):
        y, _ = self.lstm(x)
        z, h = self.gru(y)
        return self.head(z.mean(1) + h[-1])


class ReluRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(4, 5, nonlinearity="relu", batch_first=True, bidirectional=True)
        self.head = nn.Linear(10, CLASSES)

    def forward(self, x):
        return self.head(self.rnn(x)[0].mean(1))


class Fold(nn.Module):
    """Per-patch features folded back into an image (F.fold: Col2Im), overlapping patches."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(6, 2 * 4), Head(2)

    def forward(self, x):  # x [N, 9, 6]: 3x3 patches of 2x2 over a 4x4 image, stride 1
        cols = self.proj(x).transpose(1, 2)
        return self.head(F.fold(cols, output_size=(4, 4), kernel_size=2) ** 2)


MODELS = {
    "einsum_attention": (EinsumAttention, (8, 5, 8)),
    "group_norm": (lambda: Norms("group"), (8, 3, 5, 5)),
    "instance_norm": (lambda: Norms("instance"), (8, 3, 5, 5)),
    "interpolate_bilinear": (lambda: Interpolate("bilinear", False, 2), (8, 3, 4, 4)),
    "interpolate_bilinear_align": (lambda: Interpolate("bilinear", True, 1.5), (8, 3, 4, 4)),
    "interpolate_nearest": (lambda: Interpolate("nearest", None, 2), (8, 3, 4, 4)),
    "interpolate_bicubic": (lambda: Interpolate("bicubic", False, 2), (8, 3, 4, 4)),
    "interpolate_bilinear_down": (lambda: Interpolate("bilinear", False, 0.5), (8, 3, 6, 6)),
    "normalize": (Normalize, (8, 6)),
    "cumsum_scatter_topk_tril": (Scan, (8, 6)),
    "pixel_shuffle_activations": (PixelShuffleActs, (8, 3, 3, 3)),
    "lstm_gru": (Recurrent, (8, 5, 4)),
    "rnn_relu": (ReluRNN, (8, 4, 4)),
    "fold": (Fold, (8, 9, 6)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_match_torch_autograd_float64(name: str) -> None:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    module = make()
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    y = rng.integers(0, CLASSES, shape[0]).astype(np.int64)
    loss_fn = nn.CrossEntropyLoss()
    model, exp = tfront.training_model(module, torch.from_numpy(x[:2]), loss=loss_fn,
                                       optimizer="sgd:lr=0.01")
    _, step = split_training_model(model)
    check_step_graph(run_passes(step, "local", lower=False))
    got = run_step(model, {exp.input_names[0]: x, "y": y})
    loss, grads, _ = torch_step(module, x, y, loss_fn, float64=True)
    assert abs(float(got["loss"]) - loss) <= TOL * abs(loss)
    assert set(grads) == set(exp.params)
    errors = gradient_errors(got, grads)
    assert max(errors.values()) <= TOL, errors


class RMSNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 8), nn.RMSNorm(8, eps=1e-5), nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


class SDPA(nn.Module):
    """Causal grouped-query attention, then attention with a trained additive bias (T5's
    relative positions are such a float mask): F.scaled_dot_product_attention."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, d)
        self.bias = nn.Parameter(torch.randn(2, 5, 5) * 0.5)
        self.out = nn.Linear(d, CLASSES)

    def forward(self, x):  # x [N, 5, 8]: 4 query heads, 2 key/value heads of size 2
        n = x.shape[0]
        q = self.q(x).view(n, 5, 4, 2).transpose(1, 2)
        k, v = self.kv(x).view(n, 5, 2, 4).transpose(1, 2).chunk(2, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        qq, kk = q[:, :2], a[:, 2:]
        b = F.scaled_dot_product_attention(qq, kk, kk, attn_mask=self.bias)
        return self.out(torch.cat([a, b], 1).transpose(1, 2).reshape(n, 5, -1)[..., :8]
                        .mean(1))


# the dynamo exporter at opset 23: nn.GroupNorm becomes GroupNormalization-21, nn.RMSNorm
# RMSNormalization-23 and F.scaled_dot_product_attention Attention-23
DYNAMO = {
    "group_norm": (lambda: Norms("group"), (8, 3, 5, 5)),
    "rms_norm": (RMSNormed, (8, 6)),
    "interpolate_bicubic": (lambda: Interpolate("bicubic", False, 2), (8, 3, 4, 4)),
    "cumsum_scatter_topk_tril": (Scan, (8, 6)),
    "lstm_gru": (Recurrent, (8, 5, 4)),
    "attention": (SDPA, (8, 5, 8)),
}


@pytest.mark.parametrize("name", list(DYNAMO))
def test_dynamo_exports_match_torch_autograd_float64(name: str) -> None:
    """The dynamo exporter's graphs (other decompositions, opset 23), through ngdist's ONNX
    frontend, unoptimized as the torch frontend exports (optimize=True folds the LSTM's weights
    into constants): every parameter keeps its state_dict name and its gradient matches
    torch's."""
    from ngdist.frontends.onnx import build_training_model

    make, shape = DYNAMO[name]
    torch.manual_seed(0)
    module = make()
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    y = rng.integers(0, CLASSES, shape[0]).astype(np.int64)
    forward = torch.onnx.export(
        module, (torch.from_numpy(x[:2]),), dynamo=True, opset_version=23, optimize=False,
        verbose=False, input_names=["x"], output_names=["output"],
        dynamic_shapes=({0: torch.export.Dim("batch")},)).model_proto
    ops = {n.op_type for n in forward.graph.node}
    if name in ("group_norm", "rms_norm", "attention"):
        assert {"GroupNormalization", "RMSNormalization", "Attention"} & ops
    names = [n for n, _ in module.named_parameters()]
    model = build_training_model(forward, params=names, optimizer="sgd:lr=0.01")
    _, step = split_training_model(model)
    check_step_graph(run_passes(step, "local", lower=False))
    got = run_step(model, {"x": x, "y": y})
    loss, grads, _ = torch_step(module, x, y, nn.CrossEntropyLoss(), float64=True)
    assert abs(float(got["loss"]) - loss) <= TOL * abs(loss)
    errors = gradient_errors(got, grads)
    assert max(errors.values()) <= TOL, errors
