"""Custom autograd Functions: a module's ``torch.autograd.Function`` may give its forward a
backward of its own, and the ONNX exporters keep only the forward. Where that backward is not
the forward's gradient (a straight-through estimator; Hugging Face YOSO's attention, whose
backward is the paper's approximation), ngdist, differentiating the exported forward, would
train another model than torch silently.

``check_module`` runs the module's forward once without gradients, noting the Functions it
applies. Where there are any, it compares the gradients of the module's parameters (a seeded
random projection of its outputs, same random state) through torch's autograd, which calls the
Functions' backward, with those through their forward bodies as the export differentiates
them (``no_grad`` inside a Function's forward is exported as if grad were on:
``torch_stop_gradient``), and refuses the module where they differ, naming the Functions and
parameters. Comparing whole-model gradients, not each Function's, accepts a backward that is
exact only where the model uses it (Reformer's reversible backward swaps its input halves,
which the model feeds the same tensor). A forward body that cannot run outside ``apply`` is
left unchecked (logged); torch's reentrant checkpoint recomputes its forward (exact).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ngdist.errors import GraphError

logger = logging.getLogger(__name__)

EXACT = {"torch.utils.checkpoint.CheckpointFunction"}
RTOL = 1e-3  # of the larger gradient's largest entry: float32 rounding passes, a surrogate not


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_module(module: Any, args: tuple[Any, ...]) -> None:
    """See the module's docstring. The caller restores the buffers the forwards move; the
    parameters' ``.grad`` are left as they were."""
    import torch

    with torch.no_grad(), _applied() as found:
        module(*args)
    if not found:
        return
    params = dict(module.named_parameters())
    kept = {n: p.grad for n, p in params.items()}
    try:
        own = _grads(module, args, params, inline=False)
        true = _grads(module, args, params, inline=True)
    except Exception as exc:  # noqa: BLE001 - a forward body that needs apply's machinery
        logger.info("custom autograd Functions %s left unchecked: %s", sorted(found), exc)
        return
    finally:
        for n, p in params.items():
            p.grad = kept[n]
    differ = [n for n in params if _off(own[n], true[n])]
    if differ:
        raise GraphError(
            f"{type(module).__name__} applies custom autograd Functions whose backward differs "
            f"from autograd through their forward: {', '.join(sorted(found))} (the gradients "
            f"of {differ[0]}{f' and {len(differ) - 1} more' if len(differ) > 1 else ''} "
            "differ). The ONNX export keeps only the forward, so ngdist would train with other "
            "gradients than torch; replace them with ordinary torch operations (for a "
            "straight-through estimator: x + (f(x) - x).detach())")


def _off(own: Any, true: Any) -> bool:
    scale = max(float(own.abs().max()), float(true.abs().max()), 1e-30)
    return float((own - true).abs().max()) > RTOL * scale


@contextlib.contextmanager
def _applied() -> Iterator[set[str]]:
    """The names of the Functions applied in the block (torch's checkpoint aside)."""
    seen: set[str] = set()

    def apply(original: Any, cls: type, *args: Any, **kwargs: Any) -> Any:
        if _name(cls) not in EXACT:
            seen.add(_name(cls))
        return original(cls, *args, **kwargs)

    with _apply_as(apply):
        yield seen


@contextlib.contextmanager
def _inlined() -> Iterator[None]:
    """Functions applied in the block run their forward body, gradients recorded through it
    (grad mode kept on, as the export has it)."""
    from torch.autograd import Function

    def apply(original: Any, cls: type, *args: Any, **kwargs: Any) -> Any:
        if _name(cls) in EXACT:
            return original(cls, *args, **kwargs)
        with _grad_kept_on():
            if cls.setup_context is not Function.setup_context:
                return cls.forward(*args, **kwargs)
            return cls.forward(_Context(args), *args, **kwargs)

    with _apply_as(apply):
        yield


@contextlib.contextmanager
def _apply_as(apply: Any) -> Iterator[None]:
    """``Function.apply`` is ``apply(original apply, cls, *args, **kwargs)`` in the block."""
    from torch.autograd import Function

    original = Function.__dict__["apply"]
    Function.apply = classmethod(lambda cls, *a, **k: apply(original.__func__, cls, *a, **k))
    try:
        yield
    finally:
        Function.apply = original


@contextlib.contextmanager
def _grad_kept_on() -> Iterator[None]:
    """Grad mode stays on in the block, whatever it asks."""
    import torch

    setter = torch._C._set_grad_enabled
    torch._C._set_grad_enabled = lambda mode: setter(True)
    try:
        yield
    finally:
        torch._C._set_grad_enabled = setter


class _Context:
    """What a Function's ``forward(ctx, ...)`` may call on ``ctx`` outside autograd."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        import torch
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad
                                      for a in args)

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *args: Any) -> None: ...
    def mark_non_differentiable(self, *args: Any) -> None: ...
    def set_materialize_grads(self, value: bool) -> None: ...


def _grads(module: Any, args: tuple[Any, ...], params: dict[str, Any], inline: bool
           ) -> dict[str, Any]:
    """Each parameter's gradient of a seeded random projection of ``module(*args)``'s float
    outputs, from one random state (dropout draws the same masks); accumulated in ``.grad``
    (a reversible backward writes its layers' gradients there itself)."""
    import torch

    for p in params.values():
        p.grad = None
    with torch.random.fork_rng(), torch.enable_grad():
        torch.manual_seed(0)
        with _inlined() if inline else contextlib.nullcontext():
            out = module(*args)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]
        gen = torch.Generator().manual_seed(0)
        if outs:
            sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
                for o in outs).backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in params.items()}
