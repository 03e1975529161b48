"""The symbolics ngdist lends the TorchScript exporter (frontends/torch_symbolics.py): values
against torch float64 in onnxruntime, gradients through ngdist's autodiff against torch
autograd in float64, and torch's registry as it was after every export."""
from __future__ import annotations

import io

import numpy as np
import onnxruntime as ort
import pytest
import torch
from step_probe import gradient_errors, run_step
from torch.onnx._internal.torchscript_exporter import registration

from ngdist.frontends import torch as tfront
from ngdist.frontends import torch_complex
from ngdist.frontends.torch_math import SYMBOLICS
from ngdist.frontends.torch_symbolics import lent_symbolics

OPSET = 18


def _ort(module: torch.nn.Module, *args: torch.Tensor) -> list[np.ndarray]:
    buf = io.BytesIO()
    with lent_symbolics(OPSET):
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=OPSET)
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})


def _agree(step: dict, ref: torch.nn.Module, loss: torch.Tensor) -> None:
    """ngdist's one-step loss and gradients (``step``) against torch float64 autograd."""
    loss.backward()
    assert abs(float(step["loss"]) - float(loss)) < 1e-6
    errors = gradient_errors(step, {n: p.grad.numpy() for n, p in ref.named_parameters()})
    assert max(errors.values()) < 1e-5, errors


def _one_step_agrees(module: torch.nn.Module, make: type, x: torch.Tensor, y: torch.Tensor,
                     loss: torch.nn.Module | None = None) -> object:
    """``module``'s training model (SGD, ``loss``: cross-entropy by default) on ``(x, y)``:
    its loss and gradients against torch float64 autograd of ``make()`` holding the same
    state; the model."""
    loss = loss or torch.nn.CrossEntropyLoss()
    model, _ = tfront.training_model(module, (x,), loss=loss, optimizer="sgd:lr=0.1")
    got = run_step(model, {"x": x.numpy(), "y": y.numpy()})
    ref = make().double()
    ref.load_state_dict(module.state_dict())
    _agree(got, ref, loss(ref(x.double()), y))
    return model


class Fn(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_expm1_is_relatively_precise_near_zero_and_exact_far_from_it():
    x = torch.tensor([1e-7, -3e-6, 1e-3, -0.4, 0.999, 1.0, 1.001, 3.0, 20.0, -30.0, 0.0])
    (got,) = _ort(Fn(torch.expm1), x)
    exact = torch.expm1(x.double()).numpy()
    rel = np.abs(got - exact) / np.maximum(np.abs(exact), 1e-30)
    assert rel.max() < 3e-7, rel  # exp(x) - 1 in float32 is 100% off at 1e-7
    assert got[-1] == 0.0


@pytest.mark.parametrize("kwargs", [{}, {"n": 2, "dim": 0}, {"dim": 1, "append": "a"},
                                    {"n": 3, "dim": -1, "prepend": "p", "append": "a"}])
def test_diff_matches_torch(kwargs):
    x = torch.randn(4, 6, dtype=torch.float64)
    extra = {"prepend": x[:, :2] * 2, "append": x[:, -1:] - 1}
    kw = {k: extra[k] if v in ("p", "a") else v for k, v in kwargs.items()}
    if kw.get("dim", -1) == 0:
        kw = {k: (v.T[:, :4] if k in ("prepend", "append") else v) for k, v in kw.items()}
    (got,) = _ort(Fn(lambda t: torch.diff(t, **kw)), x)
    np.testing.assert_array_equal(got, torch.diff(x, **kw).numpy())


@pytest.mark.parametrize("bins,low,high", [(4, 0, 0), (5, -1.0, 1.0), (3, 0.5, 0.5),
                                           (8, 0.0, 7.0)])
def test_histc_counts_like_torch(bins, low, high):
    x = torch.cat([torch.randn(40) * 2, torch.tensor([-1.0, 1.0, 0.5, 7.0, 0.0])])
    if (bins, low, high) == (8, 0.0, 7.0):  # a router's expert indices, as floats
        x = torch.randint(0, 8, (30,)).float()
    (got,) = _ort(Fn(lambda t: torch.histc(t, bins=bins, min=low, max=high)), x)
    np.testing.assert_array_equal(got, torch.histc(x, bins=bins, min=low, max=high).numpy())
    (one,) = _ort(Fn(lambda t: torch.histc(t, bins=3)), torch.full((5,), 2.5))
    np.testing.assert_array_equal(one, torch.histc(torch.full((5,), 2.5), bins=3).numpy())


def test_adaptive_avg_pool_to_a_non_factor_size_matches_torch_the_factor_case_is_torchs():
    x = torch.randn(2, 3, 7, 5)
    (got,) = _ort(Fn(lambda t: torch.nn.functional.adaptive_avg_pool2d(t, (3, 4))), x)
    exact = torch.nn.functional.adaptive_avg_pool2d(x.double(), (3, 4)).numpy()
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-6)
    up = torch.randn(2, 3, 1, 1)  # alexnet at 64x64: 1x1 maps pooled to 6x6
    (got,) = _ort(Fn(lambda t: torch.nn.functional.adaptive_avg_pool2d(t, 6)), up)
    np.testing.assert_array_equal(got, up.expand(2, 3, 6, 6).numpy())
    buf = io.BytesIO()
    with lent_symbolics(OPSET):
        torch.onnx.export(Fn(lambda t: torch.nn.functional.adaptive_avg_pool2d(t, (2, 2))),
                          (torch.randn(1, 2, 4, 6),), buf, dynamo=False, opset_version=OPSET)
    import onnx
    ops = {n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node}
    assert "AveragePool" in ops and "MatMul" not in ops


class Lent(torch.nn.Module):
    """Every lent symbolic on a path to the loss (histc's counts scale a feature)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3)
        self.fc = torch.nn.Linear(3 * 3 * 4 - 2, 4)

    def forward(self, x):
        h = torch.nn.functional.adaptive_avg_pool2d(self.conv(x), (3, 4))
        h = torch.expm1(h.flatten(1) * 0.5)
        counts = torch.histc(x.detach().flatten(), bins=3, min=-1.0, max=1.0)
        h = torch.diff(h, n=2, dim=1) * (1 + counts[0] / 100)
        return self.fc(h)


def test_gradients_through_the_lent_symbolics_match_torch_float64():
    torch.manual_seed(0)
    module = Lent()
    x, y = torch.randn(5, 2, 7, 8), torch.randint(0, 4, (5,))
    _one_step_agrees(module, Lent, x, y)


def _custom_groups() -> dict[str, object]:
    return {name: registration.registry.get_function_group(name).get(OPSET)
            if registration.registry.get_function_group(name) else None
            for name in ("aten::expm1", "aten::diff", "aten::histc",
                         "aten::adaptive_avg_pool2d", "aten::_grouped_mm", "aten::cumsum",
                         "aten::unfold", "aten::permute", "aten::movedim", "aten::avg_pool2d",
                         "aten::repeat_interleave", "aten::as_strided", "aten::col2im",
                         "aten::scatter_reduce", "aten::index_add", "aten::pow", "aten::sum",
                         "aten::detach",
                         *SYMBOLICS,
                         *torch_complex.SYMBOLICS,
                         *torch_complex.WRAPS)}


def test_the_registry_is_as_it_was_after_an_export_and_after_a_failed_one():
    from torch.onnx._internal.torchscript_exporter import utils

    utils._trigger_symbolic_function_registration()  # torch's own, as any export does first
    before = _custom_groups()
    with lent_symbolics(OPSET) as lent:
        assert sorted(lent) == sorted(before)
        assert registration.registry.is_registered_op("aten::histc", OPSET)
    assert _custom_groups() == before
    assert not registration.registry.is_registered_op("aten::histc", OPSET)
    with pytest.raises(ZeroDivisionError), lent_symbolics(OPSET):
        1 / 0
    assert _custom_groups() == before
    assert "aten::histc" not in registration.registry.all_functions()


def test_a_symbolic_the_user_registered_is_used_and_kept():
    def users(g, x):
        return g.op("Exp", x)  # deliberately not expm1: which one ran is visible

    torch.onnx.register_custom_op_symbolic("aten::expm1", users, OPSET)
    try:
        with lent_symbolics(OPSET) as lent:
            assert "aten::expm1" not in lent
        (got,) = _ort(Fn(torch.expm1), torch.zeros(3))
        np.testing.assert_array_equal(got, np.ones(3, np.float32))
        assert registration.registry.get_function_group("aten::expm1").get(OPSET) is users
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::expm1", OPSET)


class Grouped(torch.nn.Module):
    """A mixture of experts' grouped product (rows sorted by expert, cumulative offsets) as
    Hugging Face's MoE layers call it; ``loop`` computes it one expert at a time (float64)."""

    def __init__(self, loop: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 8)
        self.experts = torch.nn.Parameter(torch.randn(4, 8, 4) * 0.3)
        self.loop = loop

    def forward(self, x, offs):
        h = self.proj(x)
        if not self.loop:
            return torch._grouped_mm(h, self.experts, offs=offs)
        out, start = torch.zeros(h.shape[0], 4, dtype=h.dtype), 0
        for e, end in enumerate(offs.tolist()):
            out[start:end] = h[start:end] @ self.experts[e]
            start = end
        return out


def test_grouped_mm_values_and_gradients_match_a_float64_loop_over_experts():
    x = torch.randn(7, 4)
    offs = torch.tensor([2, 2, 5, 7], dtype=torch.int32)  # expert 1 gets no row
    (got,) = _ort(Grouped(), x, offs)
    exact = Grouped(loop=True).double()(x.double(), offs).detach().numpy()
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5)
    y = torch.randint(0, 4, (7,))
    model, _ = tfront.training_model(Grouped(), (x, offs), loss=torch.nn.CrossEntropyLoss(),
                                     optimizer="sgd:lr=0.1", input_names=["x", "offs"])
    step = run_step(model, {"x": x.numpy(), "offs": offs.numpy(), "y": y.numpy()})
    ref = Grouped(loop=True).double()
    _agree(step, ref, torch.nn.functional.cross_entropy(ref(x.double(), offs), y))


def test_a_bool_cumsum_counts_in_int64_like_torch():
    mask = torch.tensor([[True, False, True, True], [False, False, True, False]])
    (got,) = _ort(Fn(lambda m: torch.cumsum(~m, dim=1)), mask)
    expected = torch.cumsum(~mask, dim=1)
    assert got.dtype == np.int64 and expected.dtype == torch.int64
    np.testing.assert_array_equal(got, expected.numpy())
    x = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    (got,) = _ort(Fn(lambda t: torch.cumsum(t, 0)), x)
    np.testing.assert_array_equal(got, torch.cumsum(x, 0).numpy())


class Unfold(torch.nn.Module):
    """Tensor.unfold twice, as timm's halonet cuts blocks: the second along an axis whose
    extent the exporter cannot see (its symbolic's Loop hides the first's output sizes)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 3, 1)
        self.fc = torch.nn.Linear(3 * 2 * 3, 4)

    def forward(self, x):
        blocks = self.conv(x).unfold(2, 2, 1).unfold(3, 3, 2)  # [N, 3, H-1, (W-3)//2+1, 2, 3]
        return self.fc((blocks * blocks.flip(-1)).mean((2, 3)).flatten(1))


def test_unfold_along_axes_of_unknown_extent_matches_torch_at_every_size():
    """Exported with the spatial axes dynamic (their extents unknown, as the exporter sees
    halonet's), run at sizes other than the example's."""
    module = Unfold()
    dynamic = {"x": {0: "N", 2: "H", 3: "W"}}
    with pytest.raises(Exception, match="input size not accessible"):
        torch.onnx.export(module, (torch.randn(2, 2, 3, 6),), io.BytesIO(), dynamo=False,
                          opset_version=OPSET, input_names=["x"], dynamic_axes=dynamic)
    buf = io.BytesIO()
    with lent_symbolics(OPSET):
        torch.onnx.export(module, (torch.randn(2, 2, 3, 6),), buf, dynamo=False,
                          opset_version=OPSET, input_names=["x"], dynamic_axes=dynamic)
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    for shape in ((2, 2, 3, 6), (3, 2, 5, 9), (1, 2, 2, 3)):
        x = torch.randn(*shape)
        with torch.no_grad():
            exact = module.double()(x.double()).numpy()
        module.float()
        np.testing.assert_allclose(sess.run(None, {"x": x.numpy()})[0], exact, rtol=0,
                                   atol=1e-5)


class HFGrouped(Grouped):
    """The same product through transformers' own op, as its MoE layers call it under
    torch.export (the dynamo exporter)."""

    def forward(self, x, offs):
        import transformers.integrations.moe  # noqa: F401 - registers the op

        if self.loop:
            return super().forward(x, offs)
        return torch.ops.transformers.grouped_mm_fallback(self.proj(x), self.experts, offs)


def test_the_dynamo_exporter_translates_transformers_grouped_mm_gradients_match_float64():
    import transformers.integrations.moe  # noqa: F401

    x, y = torch.randn(7, 4), torch.randint(0, 4, (7,))
    offs = torch.tensor([2, 2, 5, 7], dtype=torch.int32)
    model, exp = tfront.training_model(HFGrouped(), (x, offs), loss=torch.nn.CrossEntropyLoss(),
                                       optimizer="sgd:lr=0.1", input_names=["x", "offs"],
                                       exporter="dynamo")
    assert exp.exporter == "dynamo"
    step = run_step(model, {"x": x.numpy(), "offs": offs.numpy(), "y": y.numpy()})
    ref = HFGrouped(loop=True).double()
    _agree(step, ref, torch.nn.functional.cross_entropy(ref(x.double(), offs), y))


_SPECIAL = [0.0, -0.0, 1.5, -2.0, float("inf"), float("-inf"), float("nan"), 1e-30, -88.0, 90.0]


@pytest.mark.parametrize("fn", [
    torch.logaddexp, torch.logaddexp2, torch.xlogy, torch.copysign,
    lambda a, b: torch.signbit(a) ^ torch.signbit(b)])
def test_binary_math_symbolics_match_torch_on_special_values(fn):
    """Every pair of zeros of both signs, infinities, NaN, tiny and huge values."""
    a, b = (torch.tensor(v, dtype=torch.float32) for v in zip(*[
        (x, y) for x in _SPECIAL for y in _SPECIAL]))
    (got,) = _ort(Fn2(fn), a, b)
    exact = fn(a.double(), b.double()).numpy()
    exact = exact.astype(np.float32) if exact.dtype == np.float64 else exact
    np.testing.assert_allclose(got, exact, rtol=4e-7, atol=0, equal_nan=True)
    if fn is torch.copysign:  # zeros' signs too (a NaN's sign is not asserted)
        real = ~np.isnan(exact)
        np.testing.assert_array_equal(np.signbit(got[real]), np.signbit(exact[real]))


@pytest.mark.parametrize("name,kw", [
    ("count_nonzero", {}), ("count_nonzero", {"dim": 1}), ("count_nonzero", {"dim": (0, 2)}),
    ("nansum", {}), ("nansum", {"dim": 1, "keepdim": True}), ("nanmean", {"dim": -1}),
    ("nanmean", {}), ("nanmean", {"dim": (0, 1), "dtype": torch.float64})])
def test_reduction_math_symbolics_match_torch(name, kw):
    x = torch.randn(3, 4, 5)
    x[x.abs() < 0.4] = 0.0
    x[0, 1, 2] = x[2, 3, 0] = float("nan")
    x[1, 1, :] = float("nan")  # a row of NaNs: nanmean's 0/0
    fn = getattr(torch, name)
    (got,) = _ort(Fn(lambda t: fn(t, **kw)), x)
    exact = fn(x, **kw).numpy()
    assert got.dtype == exact.dtype and got.shape == exact.shape
    np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-6, equal_nan=True)


class Fn2(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a, b):
        return self.fn(a, b)


class Math(torch.nn.Module):
    """logaddexp, xlogy, copysign and nanmean on a path to the loss; logaddexp of a parameter
    and a buffer tied in two entries (torch: a gradient of 1/2 there)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 3)
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -3.0]))
        self.register_buffer("c", torch.tensor([0.5, -1.0, 3.0, 0.1, -1.0, -2.0]))

    def forward(self, x):
        h = self.fc(x) * torch.logaddexp(self.w, self.c)
        h = torch.logaddexp(h, h.flip(1)) + torch.logaddexp2(h, 0.5 * h)
        h = h + torch.xlogy(torch.sigmoid(h), torch.sigmoid(-h)) + torch.copysign(h, x)
        return self.out(h - torch.nanmean(h, dim=1, keepdim=True))


def test_gradients_through_the_math_symbolics_match_torch_float64():
    torch.manual_seed(0)
    module = Math()
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    _one_step_agrees(module, Math, x, y)


def test_permute_with_negative_dims_is_valid_onnx_whose_shapes_infer():
    """torch's symbolic writes -2 into Transpose's perm: ONNX refuses it and shape inference
    gives every later value no rank (a Mamba-2 mixer's gradient then fails)."""
    import onnx

    x = torch.randn(2, 3, 4, 5)
    buf = io.BytesIO()
    with lent_symbolics(OPSET):
        torch.onnx.export(Fn(lambda t: t.permute(0, -2, -1, 1) * 2), (x,), buf, dynamo=False,
                          opset_version=OPSET, dynamic_axes={"x": {0: "n"}},
                          input_names=["x"])
    model = onnx.load_from_string(buf.getvalue())
    perms = [list(a.ints) for n in model.graph.node for a in n.attribute if a.name == "perm"]
    assert perms == [[0, 2, 3, 1]]
    out = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output[0]
    assert len(out.type.tensor_type.shape.dim) == 4
    (got,) = _ort(Fn(lambda t: t.permute(0, -2, -1, 1) * 2), x)
    np.testing.assert_array_equal(got, (x.permute(0, 2, 3, 1) * 2).numpy())


@pytest.mark.parametrize("source,destination", [(-1, 2), ([-1, 0], [1, -1]), (1, -2)])
def test_movedim_with_negative_dims_is_torchs_permutation(source, destination):
    """torch's symbolic writes -1 into Transpose's perm for ``movedim(-1, 2)`` (Hugging Face
    Gemma 3n's audio attention): onnxruntime refuses the graph."""
    import onnx

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t.movedim(source, destination) * 2

    x = torch.randn(2, 3, 4, 5, 6)
    buf = io.BytesIO()
    with lent_symbolics(OPSET):
        torch.onnx.export(Fn(fn), (x,), buf, dynamo=False, opset_version=OPSET,
                          dynamic_axes={"x": {0: "n"}}, input_names=["x"])
    model = onnx.load_from_string(buf.getvalue())
    perms = [list(a.ints) for n in model.graph.node for a in n.attribute if a.name == "perm"]
    assert len(perms) == 1 and sorted(perms[0]) == list(range(5))
    (got,) = _ort(Fn(fn), x)
    np.testing.assert_array_equal(got, fn(x).numpy())


def test_repeat_interleave_along_a_negative_dim_leaves_the_shared_constant_alone():
    """torch's symbolic turns the traced -1 into 2 in place (a 3-axis input); the tracer pools
    equal constants, so the later stack(dim=-1) of 4 axes stacked along axis 2 (Hugging Face
    Cohere's rotary embedding)."""
    def fn(t: torch.Tensor) -> torch.Tensor:
        u = t.repeat_interleave(2, dim=-1).unsqueeze(1)
        return torch.stack([u, -u], dim=-1).flatten(-2)

    x = torch.randn(2, 3, 4)
    (got,) = _ort(Fn(fn), x)
    np.testing.assert_array_equal(got, fn(x).numpy())


def test_a_wrapped_symbolic_is_the_opsets_own_in_a_fresh_process():
    """torch registers its symbolics above opset 9 at its first export: lent before that, the
    wrapped repeat_interleave was opset 9's, which refuses an axis of unknown extent (Hugging
    Face Qwen3.5's gated delta net)."""
    import subprocess
    import sys

    code = """if True:
        import io, numpy as np, onnxruntime as ort, torch
        from ngdist.frontends.torch_symbolics import lent_symbolics
        class Fn(torch.nn.Module):
            def forward(self, t):
                return t.reshape(t.shape[0], -1, 2).repeat_interleave(3, dim=1)
        x, buf = torch.randn(2, 8), io.BytesIO()
        with lent_symbolics(18):
            torch.onnx.export(Fn(), (x,), buf, dynamo=False, opset_version=18,
                              input_names=["x"], dynamic_axes={"x": {0: "n", 1: "m"}})
        sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
        x = torch.randn(3, 6)
        np.testing.assert_array_equal(sess.run(None, {"x": x.numpy()})[0], Fn()(x).numpy())
        print("same")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0 and out.stdout.strip() == "same", out.stderr[-2000:]


def test_an_avg_pool_window_larger_than_the_map_is_a_global_average_with_a_gradient():
    """Hugging Face's EfficientNet pools a 2x2 map with AvgPool2d(1280, ceil_mode=True)."""
    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, stride=2)
            self.pool = torch.nn.AvgPool2d(1280, ceil_mode=True)
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(self.pool(self.conv(x)).flatten(1))

    torch.manual_seed(0)
    module = Pooled()
    x, y = torch.randn(5, 3, 6, 6), torch.randint(0, 3, (5,))
    (got,) = _ort(module, x)
    np.testing.assert_allclose(got, module.double()(x.double()).detach().numpy(), atol=1e-6)
    module.float()
    model = _one_step_agrees(module, Pooled, x, y)
    assert "GlobalAveragePool" in {n.op_type for n in model.graph.node}


@pytest.mark.parametrize("kw", [{}, {"right": True}, {"side": "right"}, {"out_int32": True},
                                {"sorter": "argsort"}])
def test_searchsorted_matches_torch_on_ties_infinities_nan_and_batched_rows(kw):
    """A 1-D sequence with repeated entries against values between, on and beyond them
    (infinities, NaN: after every entry, as torch's binary search puts it), a batch of
    sorted rows, and integer run ends (MusicFlamingo's cumulative audio lengths)."""
    seq = torch.tensor([-1.5, 0.0, 2.0, 2.0, 3.0, float("inf")])
    values = torch.tensor([[float("nan"), -9.0, 2.0, 2.5], [0.0, 3.0, float("inf"), -1.5]])
    rows = torch.sort(torch.randn(3, 5), dim=-1).values
    ends, starts = torch.tensor([2, 5, 5, 9]), torch.tensor([0, 2, 5, 7, 9])
    for s, v in ((seq, values), (rows, torch.randn(3, 4)), (ends, starts)):
        args = dict(kw)
        if args.pop("sorter", None):  # the same sequence shuffled, with its sorting order
            s = s[..., torch.randperm(s.shape[-1])]
            args["sorter"] = torch.argsort(s, dim=-1)
        (got,) = _ort(Fn2(lambda a, b: torch.searchsorted(a, b, **args)), s, v)
        exact = torch.searchsorted(s, v, **args).numpy()
        assert got.dtype == exact.dtype
        np.testing.assert_array_equal(got, exact)


class TiledWindow(torch.nn.Module):
    """A windowed position table tiled to the feature map (timm's SAM2 Hiera): torch's
    ``tile`` with fewer repeats than axes exports as an If whose branches read the weight,
    which is none of the If's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.window = torch.nn.Parameter(torch.randn(1, 3, 2, 2))
        self.out = torch.nn.Linear(3, 4)

    def forward(self, x):
        reps = (x.shape[-2] // self.window.shape[-2], x.shape[-1] // self.window.shape[-1])
        return self.out((x + self.window.tile(reps)).mean((2, 3)))


def test_a_weight_read_only_inside_an_if_branch_is_trained_as_torch_trains_it():
    torch.manual_seed(0)
    module = TiledWindow()
    x, y = torch.randn(5, 3, 4, 6), torch.randint(0, 4, (5,))
    model = _one_step_agrees(module, TiledWindow, x, y)
    assert "window" in {t.name for t in model.graph.initializer}


class SqueezedRows(torch.nn.Module):
    """``squeeze`` of an axis whose extent depends on the data (the rows a mask keeps): torch
    exports it as an If (Squeeze where the extent is 1, Identity otherwise) that no shape
    folding can settle, and ngdist differentiates."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h[x[:, 0] > -10].squeeze(0))  # (every row kept)


def test_an_if_that_squeezes_an_axis_of_run_time_extent_trains_as_torch():
    torch.manual_seed(0)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    model = _one_step_agrees(SqueezedRows(), SqueezedRows, x, y)
    assert "If" in {n.op_type for n in model.graph.node}


def _half(h: torch.Tensor) -> torch.Tensor:
    """The first half of each row, through ``chunk`` and ``squeeze`` (Zamba splits its Mamba
    projection so): torch exports the squeeze as an If on an extent computed at run time."""
    return h.view(h.shape[0], -1, 2).chunk(2, dim=2)[0].squeeze(2)


class Halves(torch.nn.Module):
    """Two such Ifs, the second's condition computed from the first's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(4, 8)
        self.c = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.c(_half(torch.tanh(self.b(_half(torch.tanh(self.a(x)))))))


def test_ifs_decided_by_shapes_fold_in_turn_and_train_as_torch():
    """An If whose condition is computed from shapes, with views as branches, has output
    shapes that follow from shapes: the values after it fold too, and the next If's condition
    with them (it stayed a run-time value; in Zamba, whose Mamba layers each hold one, the
    rank of what followed was unknown and a broadcast gradient could not be reduced)."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    exp = tfront.export(Halves(), (x,))
    ifs = [n for n in exp.train.graph.node if n.op_type == "If"]
    consts = {t.name for t in exp.train.graph.initializer}
    assert len(ifs) == 2 and all(n.input[0] in consts for n in ifs)
    _one_step_agrees(Halves(), Halves, x, y)


def test_an_if_exported_with_the_loss_reads_the_models_values_by_their_names():
    """A loss without a built-in form is exported with the model, under a wrapper whose
    prefix the values' names then lose: the If's branches read the same names (they kept
    the prefix, and onnxruntime refused the graph: "Nodes in a graph must be topologically
    sorted")."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    model = _one_step_agrees(SqueezedRows(), SqueezedRows, x, y,
                             torch.nn.CrossEntropyLoss(label_smoothing=0.1))
    assert "If" in {n.op_type for n in model.graph.node}


def _branch_reading(value: str) -> object:
    """A model whose If's branches read ``value`` of the graph around them (no input of the
    If's): ``out = cond ? x + value : x - value``, ``value`` an initializer [2] or made by
    ``src = x * x`` with the graph output ``output = Identity(src)``."""
    from onnx import TensorProto, helper

    def branch(op: str) -> object:
        return helper.make_graph([helper.make_node(op, ["x", value], [f"{op}_out"])], op, [],
                                 [helper.make_tensor_value_info(f"{op}_out", TensorProto.FLOAT,
                                                                [2])])

    nodes = [helper.make_node("Mul", ["x", "x"], ["src"]),
             helper.make_node("Identity", ["src"], ["output"]),
             helper.make_node("If", ["cond"], ["out"], then_branch=branch("Add"),
                              else_branch=branch("Sub"))]
    inits = [helper.make_tensor("cond", TensorProto.BOOL, [], [True]),
             helper.make_tensor("onnx::W_1", TensorProto.FLOAT, [2], [0.5, 1.5])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("output", "out")],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("rename, read, renamed", [
    ("initializers", "onnx::W_1", "w"), ("aliases", "onnx::W_1", "w"),
    ("model_output", "src", "output"), ("keras_links", "src", "output"),
    ("keras_canonical", "onnx::W_1", "const/1")])
def test_a_value_renamed_after_export_is_renamed_where_if_branches_read_it(rename, read,
                                                                           renamed):
    """An exported initializer given its state_dict name, a tied weight's alias its tensor's
    name, the model output's source the output's name (torch), a value renamed or a
    constant named by first use (Keras, tf2onnx): If branches that read the old name read
    the new one (they kept the old, a value the graph no longer has)."""
    from onnx.reference import ReferenceEvaluator

    from ngdist.frontends import keras, torch_exporters, torch_loss, torch_state
    from ngdist.frontends.renames import rename_graph
    from ngdist.ir.copies import outer_reads

    model = _branch_reading(read)
    if rename == "initializers":
        torch_state.rename_initializers(model, {"w": np.array([0.5, 1.5], np.float32)})
    elif rename == "aliases":
        torch_exporters.rename_aliases(model, {"onnx::W_1": "w"})
    elif rename == "model_output":
        torch_loss._name_model_output(model, "output")
    elif rename == "keras_links":  # (Keras renames its variable links and outputs so)
        rename_graph(model.graph, {"src": "output"})
        model.graph.node.remove(model.graph.node[1])  # (the Identity that made "output")
    else:
        keras._canonical_names(model.graph, keep=set())
    (node,) = [n for n in model.graph.node if n.op_type == "If"]
    assert renamed in outer_reads(node) and read not in outer_reads(node)
    x = np.array([1.0, 2.0], np.float32)
    got = dict(zip(["output", "out"], ReferenceEvaluator(model).run(None, {"x": x})))
    assert got["out"].tolist() == (x + (x * x if read == "src" else [0.5, 1.5])).tolist()
