"""``scaled_dot_product_attention`` through the PyTorch frontend: grouped key/value heads
(``enable_gqa=True``), ``is_causal``, boolean masks (a row masked entirely included), a
trained float mask, an explicit scale, dropout, and float64. Loss and every parameter
gradient of the ngdist step (autodiff pass, onnxruntime) against torch autograd in float64,
within 1e-4 relative (ngdist in float32) and 1e-7 (ngdist in float64: onnxruntime's default graph
optimizations fuse MatMul with the scale's Mul into a FusedMatMul whose ``alpha`` attribute
is a float32, 1.7e-8 relative off for 1/sqrt(8); with only basic optimizations the gradients
agree to 3e-16)."""
from __future__ import annotations

import numpy as np
import pytest

import torch  # noqa: E402
nn = torch.nn
F = nn.functional

from ngdist.frontends import torch as tfront  # noqa: E402
from step_probe import gradient_errors, run_step  # noqa: E402

HEADS, KV_HEADS, DIM, LENGTH = 4, 2, 8, 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Attention(nn.Module):
    """Projections to 4 query and ``kv_heads`` key/value heads, sdpa, a mean-pooled head."""

    def __init__(self, kv_heads: int, variant: str) -> None:
        super().__init__()
        self.kv_heads, self.variant = kv_heads, variant
        self.q = nn.Linear(16, HEADS * DIM)
        self.kv = nn.Linear(16, 2 * kv_heads * DIM)
        self.out = nn.Linear(HEADS * DIM, 3)
        self.bias = nn.Parameter(torch.randn(HEADS, LENGTH, LENGTH) * 0.5)  # trained mask

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HEADS, DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, DIM).permute(2, 0, 3, 1, 4)
        gqa = self.kv_heads != HEADS
        kw = {"enable_gqa": gqa}
        if self.variant == "causal":
            kw["is_causal"] = True
        elif self.variant == "bool_mask":  # rows 0 of sample 0 masked entirely: output 0
            keep = torch.ones(b, 1, n, n, dtype=torch.bool).tril()
            keep[0, :, 0] = False
            kw["attn_mask"] = keep
        elif self.variant == "float_mask":
            kw["attn_mask"] = self.bias
        elif self.variant == "scale":
            kw["scale"] = 0.3
        y = F.scaled_dot_product_attention(q, k, v, **kw)
        return self.out(y.transpose(1, 2).reshape(b, n, HEADS * DIM).mean(1))


VARIANTS = ["plain", "causal", "bool_mask", "float_mask", "scale"]


def _reference(module, x, y):
    ref = Attention(module.kv_heads, module.variant).double()
    ref.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    loss = F.cross_entropy(ref(torch.from_numpy(x.astype(np.float64))), torch.from_numpy(y))
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy() for n, p in ref.named_parameters()
                         if p.grad is not None}


@pytest.mark.parametrize("kv_heads", [KV_HEADS, HEADS], ids=["grouped_kv", "full_kv"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_sdpa_gradients_match_torch_autograd(variant, kv_heads, dtype):
    torch.manual_seed(0)
    module = Attention(kv_heads, variant)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, LENGTH, 16)).astype(dtype)
    y = rng.integers(0, 3, 3).astype(np.int64)
    if dtype == np.float64:
        module.double()
    model, exp = tfront.training_model(module, torch.from_numpy(x[:2]),
                                       loss=nn.CrossEntropyLoss(), optimizer="sgd:lr=0.01")
    got = run_step(model, {exp.input_names[0]: x, "y": y})
    loss, grads = _reference(module, x, y)
    tol = 1e-4 if dtype == np.float32 else 1e-7
    assert abs(float(got["loss"]) - loss) <= tol * abs(loss)
    assert set(grads) == set(exp.params)  # the mask parameter only where it is used
    errors = gradient_errors(got, grads)
    assert max(errors.values()) <= tol, errors
    if variant == "float_mask":  # the trained mask really gets a gradient
        assert np.abs(grads["bias"]).max() > 1e-3


class AttentionDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 3 * HEADS * DIM)
        self.out = nn.Linear(HEADS * DIM, 3)

    def heads(self, x):
        b, n, _ = x.shape
        return self.qkv(x).view(b, n, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)

    def pool(self, y):
        b, _, n, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(b, n, HEADS * DIM).mean(1))

    def forward(self, x):
        q, k, v = self.heads(x)
        return self.pool(F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.4 if self.training else 0.0))


def test_sdpa_dropout_is_a_training_mode_dropout_with_torchs_math():
    """dropout_p: a fresh mask per step on the attention weights, scaled by 1 / (1 - p); the
    reference is torch's math formula in float64 with the mask ngdist drew."""
    torch.manual_seed(0)
    module = AttentionDropout()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, LENGTH, 16)).astype(np.float32)
    y = rng.integers(0, 3, 3).astype(np.int64)
    model, exp = tfront.training_model(module, torch.from_numpy(x[:2]),
                                       loss=nn.CrossEntropyLoss(), optimizer="sgd:lr=0.01")
    (drop,) = [n for n in model.training_info[0].algorithm.node if n.op_type == "Dropout"]
    assert not [n for n in model.graph.node if n.op_type == "Dropout"]  # eval: no dropout
    got = run_step(model, {exp.input_names[0]: x, "y": y}, extra=[drop.output[1]])
    mask = got[drop.output[1]]
    assert mask.shape == (3, HEADS, LENGTH, LENGTH) and 0.45 < mask.mean() < 0.75

    ref = AttentionDropout().double()
    ref.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    q, k, v = ref.heads(torch.from_numpy(x.astype(np.float64)))
    weights = torch.softmax(q @ k.transpose(-1, -2) / DIM ** 0.5, -1)
    weights = weights * torch.from_numpy(mask.astype(np.float64)) / 0.6
    loss = F.cross_entropy(ref.pool(weights @ v), torch.from_numpy(y))
    loss.backward()
    assert abs(float(got["loss"]) - float(loss.detach())) <= 1e-4 * float(loss.detach())
    grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    errors = gradient_errors(got, grads)
    assert max(errors.values()) <= 1e-4, errors


def test_sdpa_export_leaves_torch_symbolic_registry_as_it_was():
    from torch.onnx._internal.torchscript_exporter import registration

    op = "aten::scaled_dot_product_attention"
    before = registration.registry.get_function_group(op).get(tfront.OPSET)
    tfront.export(Attention(KV_HEADS, "plain"), torch.zeros(2, LENGTH, 16))
    assert registration.registry.get_function_group(op).get(tfront.OPSET) is before
