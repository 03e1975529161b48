"""The model sweep's Hugging Face models made to run in float64, the sweep's oracle: models
that mix float64's lowest value into float32 tensors (its masks overflow to -inf, and torch's
float64 gradients are NaN) or keep a part in float32 whatever the model's type. Each fix
leaves the float32 model (what ngdist exports) as it was.
"""
from __future__ import annotations

from typing import Any

from ngdist.zoo_sweep import _torch


def before_build(model_type: str) -> None:
    """The fixes to a model's module, made before the model is built."""
    if model_type == "fsmt":
        _fsmt_masks()
    if model_type == "canine":
        _canine_masks()
    if model_type in _FLOAT32_LOWEST:
        _float32_lowest(model_type)
    if model_type == "led":
        _led_float64()
    if model_type == "mra":
        _mra_attention_in_its_layers_dtype()
    if model_type in _FLOAT32_ROUTERS:
        _router_in_its_weights_dtype_of(*_FLOAT32_ROUTERS[model_type])


def after_build(model_type: str, model: Any) -> None:
    """The fixes to a built model."""
    if model_type == "switch_transformers":
        _router_in_its_weights_dtype(model)


def _router_in_its_weights_dtype(model: Any) -> None:
    """Switch Transformers' router keeps a dtype of its own (``router_dtype``, float32) and
    casts its classifier to it on every forward: in the float64 oracle (``module.double()``)
    the classifier went back to float32 mid-run, so the router was not computed in float64
    and torch's AdamW met float32 gradients for float64 state ("expected dtype double for
    `end`"). The router's dtype is its classifier's: float32 as configured in the float32
    model (what ngdist exports), float64 in the oracle."""
    torch = _torch()
    for sub in model.modules():
        if isinstance(sub.__dict__.get("dtype"), torch.dtype) and hasattr(sub, "classifier"):
            del sub.__dict__["dtype"]
            sub.__class__ = type(type(sub).__name__, (type(sub),), {
                "dtype": property(lambda self: self.classifier.weight.dtype)})


def _fsmt_masks() -> None:
    """FSMT fills its causal mask by ``t.float().fill_(torch.finfo(t.dtype).min)``: in float64
    that puts float64's lowest value into a float32 tensor, which overflows, so the model has
    no float64 oracle. The mask filled in its own type instead: the same values in float32
    (what ngdist exports), float64's lowest value in float64."""
    torch = _torch()
    from transformers.models.fsmt import modeling_fsmt

    modeling_fsmt.fill_with_neg_inf = lambda t: torch.full_like(t, torch.finfo(t.dtype).min)


def _canine_masks() -> None:
    """Canine builds its character mask by ``(1.0 - mask.float()) * torch.finfo(dtype).min``:
    in float64 float64's lowest value times a float32 tensor is -inf, and 0 * -inf NaN, so the
    model has no float64 oracle. Its module sees float32's lowest value for a float64 dtype
    instead: the same mask in float32, and one softmax zeroes the same in float64."""
    from transformers.models.canine import modeling_canine

    modeling_canine.torch = _Float32Lowest()


def _led_float64() -> None:
    """LED's windowed attention masks with ``torch.finfo(dtype).min`` and adds such a mask to
    scores already masked so, then takes ``softmax(..., dtype=torch.float32)`` ("fp32 for
    numerical stability"): in float64 the sums round to -inf in float32, a padding query's
    window is all -inf, and its NaN softmax makes torch's float64 gradients NaN. The float64
    model masks with float32's lowest value (what torch float32 computes with) and keeps its
    softmax in float64 (at least float32, as the model asks); float32 is unchanged."""
    torch = _torch()
    from transformers.models.led import modeling_led

    class Functional:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.nn.functional, name)

        @staticmethod
        def softmax(x: Any, dim: Any = None, dtype: Any = None, **kw: Any) -> Any:
            keep = x.dtype == torch.float64
            return torch.nn.functional.softmax(x, dim=dim, dtype=None if keep else dtype, **kw)

    class Nn:
        functional = Functional()

        def __getattr__(self, name: str) -> Any:
            return getattr(torch.nn, name)

    modeling_led.torch, modeling_led.nn = _Float32Lowest(), Nn()


def _mra_attention_in_its_layers_dtype() -> None:
    """MRA computes its attention in float32 whatever the model's type (``.float()`` of the
    queries, keys, values and mask, its CUDA kernel's type; without that kernel, on the CPU,
    transformers' attention output is zeros of the queries' type), so the float64 oracle's
    next layer met a float32 input ("mat1 and mat2 must have the same dtype"). The attention's
    output is cast to its projections' dtype: float32 unchanged, float64 in the oracle."""
    from transformers.models.mra import modeling_mra

    cls = modeling_mra.MraSelfAttention
    if "_in_layers_dtype" in vars(cls):
        return
    forward = cls.forward

    def _in_layers_dtype(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, *args, **kwargs)
        return (out[0].to(self.query.weight.dtype), *out[1:])

    cls.forward = cls._in_layers_dtype = _in_layers_dtype


# routers that cast their input to float32 (``hidden_states.float()``) before a linear layer of
# float32 weights: module and class, for model types
_FLOAT32_ROUTERS = {"inkling2": ("inkling2", "Inkling2TopKRouter"),
                    "inkling2_text": ("inkling2", "Inkling2TopKRouter"),
                    "inkling2_loop": ("inkling2_loop", "Inkling2LoopTopKRouter"),
                    "inkling2_loop_text": ("inkling2_loop", "Inkling2LoopTopKRouter")}


def _router_in_its_weights_dtype_of(module: str, name: str) -> None:
    """Inkling 2's routers compute in float32 whatever the model's type (``.float()`` of their
    input, then ``F.linear`` with their weight): in the float64 oracle the weight is float64
    and the product refused the float32 input. While a router runs, ``Tensor.float`` gives
    its weight's dtype: float32 unchanged in the float32 model, float64 in the oracle."""
    import importlib

    torch = _torch()
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                  name)
    if "_in_weights_dtype" in vars(cls):
        return
    forward, to_float32 = cls.forward, torch.Tensor.float

    def _in_weights_dtype(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.weight.dtype == torch.float32:
            return forward(self, *args, **kwargs)
        dtype = self.weight.dtype
        torch.Tensor.float = lambda t, *a, **k: t.to(dtype)  # type: ignore[method-assign]
        try:
            return forward(self, *args, **kwargs)
        finally:
            torch.Tensor.float = to_float32  # type: ignore[method-assign]

    cls.forward = cls._in_weights_dtype = _in_weights_dtype


# models that mix ``torch.finfo(dtype).min`` of float64 into float32 tensors (no float64
# oracle: the value overflows to -inf): XGLM clamps its masked scores at
# ``torch.full((), torch.finfo(dtype).min)``, a float32 tensor; ProphetNet fills its main and
# n-gram stream masks so, and its float64 gradients were NaN. Their modules see float32's
# lowest value in float64 too (what float32 computes)
_FLOAT32_LOWEST = ("xglm", "prophetnet")


def _float32_lowest(model_type: str) -> None:
    import importlib

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    module.torch = _Float32Lowest()


class _Float32Lowest:
    """``torch`` for a model module, but ``finfo(torch.float64)`` is float32's: its masks
    fill float32's lowest value in float64 too."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_torch(), name)

    @staticmethod
    def finfo(dtype: Any = None) -> Any:
        torch = _torch()
        return torch.finfo(torch.float32 if dtype == torch.float64 else dtype)
