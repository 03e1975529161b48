"""Learning-rate schedules for trainers that have no torch optimizer to follow (ONNX files,
``ngdist train``): ``trainer.set_lr_schedule(schedules.warmup_cosine(100, 10_000))``.

A schedule is a factor of the step count (the steps done before the step it applies to, 0 on
the first): before every step the trainer sets each group's learning rate to the one it had
when the schedule was set, times the factor (as ``torch.optim.lr_scheduler.LambdaLR`` does).
``warmup_linear`` and ``warmup_cosine`` are Hugging Face's ``get_linear_schedule_with_warmup``
and ``get_cosine_schedule_with_warmup``; ``step_decay`` is ``StepLR``. The CLI form is
``NAME:key=value,...`` (``from_spec``, ``ngdist train --lr-schedule``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ngdist.errors import OptionError
from ngdist.optim.spec import parse_spec


def _whole(owner: str, name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OptionError(f"{owner}({name}={value!r}): {name} takes a whole number of steps "
                          f">= {low}")
    return value


def _number(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise OptionError(f"{owner}({name}={value!r}): {name} takes a number >= 0")
    return float(value)


@dataclass(frozen=True)
class WarmupLinear:
    """step / warmup during the warm-up, then linear decay to 0 at ``total`` steps."""

    warmup: int
    total: int

    def __post_init__(self) -> None:
        _whole("warmup_linear", "warmup", self.warmup, 0)
        _whole("warmup_linear", "total", self.total, max(1, self.warmup))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))


@dataclass(frozen=True)
class WarmupCosine:
    """step / warmup during the warm-up, then half a cosine from 1 to 0 at ``total`` steps."""

    warmup: int
    total: int

    def __post_init__(self) -> None:
        _whole("warmup_cosine", "warmup", self.warmup, 0)
        _whole("warmup_cosine", "total", self.total, max(1, self.warmup))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class StepDecay:
    """gamma ** (step // step_size), torch's StepLR."""

    step_size: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _whole("step_decay", "step_size", self.step_size, 1)
        object.__setattr__(self, "gamma", _number("step_decay", "gamma", self.gamma))

    def __call__(self, step: int) -> float:
        return self.gamma ** (step // self.step_size)


warmup_linear, warmup_cosine, step_decay = WarmupLinear, WarmupCosine, StepDecay
Schedule = WarmupLinear | WarmupCosine | StepDecay
KINDS = {"warmup_linear": WarmupLinear, "warmup_cosine": WarmupCosine, "step_decay": StepDecay}


def from_spec(spec: str, total: int | None = None) -> Schedule:
    """``"warmup_cosine:warmup=100,total=1000"`` -> schedule; ``total`` (the steps of the run)
    fills a ``total`` the spec leaves out. A wrong name, key or value is an OptionError."""
    cls, kwargs = parse_spec(spec, "lr schedule", KINDS)
    fields = [f.name for f in dataclasses.fields(cls)]
    if "total" in fields and "total" not in kwargs and total is not None:
        kwargs["total"] = total
    missing = [f for f in fields if f not in kwargs and
               cls.__dataclass_fields__[f].default is dataclasses.MISSING]
    if missing:
        raise OptionError(f"lr schedule {spec!r} needs {missing}, e.g. "
                          f"{spec.partition(':')[0]}:{','.join(f'{m}=100' for m in missing)}")
    return cls(**kwargs)  # type: ignore[arg-type]
