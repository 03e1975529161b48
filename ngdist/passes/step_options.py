"""What the training step does to its gradients whatever the strategy: clipping and
accumulation (``ngdist.compile(clip_grad_norm=, clip_grad_value=, accumulate=)``).

``clip_grad_norm``: the gradients are scaled by ``min(1, max_norm / (norm + 1e-6))``, where
``norm`` is the L2 norm of all the parameters' gradients together (torch's
``clip_grad_norm_``), computed after the gradients are averaged over the ranks, so every rank
clips alike (passes/clipping.py). ``clip_grad_value``: every gradient element clamped to
``[-v, v]`` (torch's ``clip_grad_value_``). ``accumulate=k``: gradients of k micro-steps are
averaged locally and the update runs on every k-th (passes/accumulate.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ngdist.errors import OptionError
from ngdist.passes.options import TypedOptions


@dataclass(frozen=True)
class StepOptions(TypedOptions):
    """Gradient clipping and accumulation (module docstring)."""

    owner: ClassVar[str] = "ngdist.compile"
    clip_grad_norm: float | None = None
    clip_grad_value: float | None = None
    accumulate: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("clip_grad_norm", "clip_grad_value"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise OptionError(f"{name} must be a positive number, got {value}; leave it "
                                  "out (None) not to clip")
        if self.clip_grad_norm is not None and self.clip_grad_value is not None:
            raise OptionError("clip_grad_norm and clip_grad_value are both given: torch applies "
                              "whichever the loop calls first, ngdist cannot tell which; pass "
                              "one of them")
        if self.accumulate < 1:
            raise OptionError(f"accumulate must be at least 1 (micro-steps per update), got "
                              f"{self.accumulate}")

    @property
    def clipping(self) -> bool:
        return self.clip_grad_norm is not None or self.clip_grad_value is not None
