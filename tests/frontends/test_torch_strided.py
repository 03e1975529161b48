"""``as_strided`` through the TorchScript exporter: a view whose memory is a permuted dense
block (Longformer's and LED's overlapping attention chunks, cut from a transposed tensor) is
read in memory order, not logical order; a view with gaps is refused."""
from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from step_probe import gradient_errors, run_step

from ngdist.errors import GraphError
from ngdist.frontends import torch as tfront
from ngdist.frontends.torch_strided import memory_order
from ngdist.frontends.torch_symbolics import lent_symbolics


class Chunked(torch.nn.Module):
    """Overlapping chunks of a projection, as LED's ``_chunk``: transposed and reshaped (a
    view, not a copy), cut into chunks of 2w that overlap by w with ``as_strided``."""

    def __init__(self, w: int = 2, heads: int = 2, dim: int = 3) -> None:
        super().__init__()
        self.w, self.n_heads, self.dim = w, heads, dim
        self.proj = torch.nn.Linear(heads * dim, heads * dim)

    def heads(self, x):
        """[B * H, T, D] as LED reshapes it: a view of the projection laid out [T, B, H, D]."""
        b, t, _ = x.shape
        h = self.proj(x.transpose(0, 1)).view(t, b, self.n_heads, self.dim).transpose(0, 1)
        return h.transpose(1, 2).reshape(b * self.n_heads, t, self.dim)

    def forward(self, x):
        h = self.heads(x)
        h = h.view(h.size(0), x.shape[1] // (2 * self.w), 2 * self.w, self.dim)
        size, stride = list(h.size()), list(h.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        chunks = h.as_strided(size=size, stride=stride)
        return torch.einsum("bcxd,bcyd->bcxy", chunks, chunks)


def test_as_strided_of_a_transposed_view_matches_torch_and_float64_gradients():
    torch.manual_seed(0)
    module = Chunked()
    x = torch.randn(2, 8, 6)
    assert not module.heads(x).is_contiguous()  # the view the chunks are cut from
    _trains_like_float64(module, x)


class Loss(torch.nn.Module):
    """The module's output weighted by a fixed random tensor, summed."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, w):
        return (self.inner(x) * w).sum()


def _trains_like_float64(module: torch.nn.Module, x: torch.Tensor) -> tuple[tfront.TorchExport, object]:
    """The compiled step's loss and gradients of ``Loss(module)`` against torch float64."""
    weights = torch.randn(module(x).shape)
    model, exp = tfront.training_model(Loss(copy.deepcopy(module)), (x, weights), loss=None,
                                       input_names=["x", "w"], optimizer="sgd:lr=0.1")
    step = run_step(model, {"x": x.numpy(), "w": weights.numpy()})
    ref = Loss(copy.deepcopy(module)).double()
    loss = ref(x.double(), weights.double())
    loss.backward()
    assert abs(float(step["loss"]) - loss.item()) <= 1e-5 * abs(loss.item())
    errors = gradient_errors(step, {n: p.grad.numpy() for n, p in ref.named_parameters()})
    assert max(errors.values()) < 1e-5, errors
    return exp, model


@pytest.mark.parametrize("sizes, strides, order", [
    ([4, 2, 8, 3], [48, 24, 3, 1], [0, 1, 2, 3]),  # contiguous: logical order
    ([4, 2, 8, 3], [3, 96, 12, 1], [1, 2, 0, 3]),  # LED's chunks of a transposed tensor
    ([None, None, None, None], [3, 96, 12, 1], [1, 2, 0, 3]),  # sizes unknown at export
    ([2, 1, 3], [3, 7, 1], [0, 1, 2]),  # a size-1 axis has any stride
    ([None, None, None, None], [16, 8, 1, 1], [0, 1, 2, 3]),  # equal strides: a size 1
    ([4, 5], [10, 1], None),  # x[:, :5] of a [4, 10] tensor: gaps
    ([4, 3], [1, 2], None),  # overlapping
])
def test_memory_order(sizes, strides, order):
    assert memory_order(sizes, strides) == order


def test_as_strided_of_a_view_with_gaps_is_refused():
    class Gappy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(10, 10)

        def forward(self, x):
            h = self.proj(x)[:, :4]  # [2, 4] of a [2, 10] tensor
            return h.as_strided((3, 2), (1, 10)).sum()

    with pytest.raises(GraphError) as info, lent_symbolics(18):
        torch.onnx.export(Gappy(), (torch.randn(2, 10),), io.BytesIO(), dynamo=False,
                          opset_version=18)
    assert str(info.value) == "as_strided of a view with gaps in its memory (sizes [2, 4], " \
        "strides [10, 1]) has no ONNX form: call .contiguous() on its input and compute the " \
        "strides from that"


class Outlook(torch.nn.Module):
    """VOLO's outlook attention in small: per-position weights over each 3x3 neighbourhood,
    the weighted windows folded back (``F.fold``) to a map whose size is read from the input
    (traced, not a constant) with ``stride`` and padding 1."""

    def __init__(self, channels: int = 4, stride: int = 1) -> None:
        super().__init__()
        self.stride = stride
        self.v = torch.nn.Linear(channels, channels)
        self.attn = torch.nn.Linear(channels, 9 * 9)

    def forward(self, x):
        b, h, w, c = x.shape
        v = self.v(x).permute(0, 3, 1, 2)
        v = torch.nn.functional.unfold(v, 3, padding=1, stride=self.stride)  # [B, C*9, L]
        hs, ws = (h + 2 - 3) // self.stride + 1, (w + 2 - 3) // self.stride + 1
        v = v.reshape(b, c, 9, hs * ws).permute(0, 3, 2, 1)  # [B, L, 9, C]
        pooled = torch.nn.functional.avg_pool2d(x.permute(0, 3, 1, 2), self.stride,
                                                self.stride, ceil_mode=True)
        a = self.attn(pooled.permute(0, 2, 3, 1)).reshape(b, hs * ws, 9, 9).softmax(-1)
        out = (a @ v).permute(0, 3, 2, 1).reshape(b, c * 9, hs * ws)
        return torch.nn.functional.fold(out, output_size=(h, w), kernel_size=3, padding=1,
                                        stride=self.stride)


@pytest.mark.parametrize("stride", [1, 2])
def test_fold_with_traced_output_size_matches_float64_gradients(stride):
    """torch's own col2im symbolic raises a TypeError on a traced ``output_size`` (the dynamo
    exporter, the fallback, does not take VOLO: it keeps BatchNorm running statistics)."""
    torch.manual_seed(0)
    module = Outlook(stride=stride)
    x = torch.randn(2, 6, 6, 4)
    exp, model = _trains_like_float64(module, x)
    assert exp.exporter == "torchscript"
    assert "Col2Im" in {n.op_type for t in model.training_info for n in t.algorithm.node}
