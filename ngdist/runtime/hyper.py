"""The learning rates of a step: set by the program (``trainer.set_lr``) or followed from the
framework optimizer the trainer was compiled from (a torch scheduler stepping it).

Every parameter group's learning rate is a ``hyper`` value of the step (``ngdist.ir.hyper``);
the trainer feeds it to every step, so a new value takes effect on the next step with no
recompilation. When the trainer came from a torch optimizer, each ``step()`` first reads the
learning rate of every ``param_groups`` entry (``WriteBack.hypers``; and the momentum or beta1
OneCycleLR/CyclicLR cycle, ``ngdist.ir.hyper.momentum_name``) and feeds the ones that changed:
whatever ``torch.optim.lr_scheduler`` steps that optimizer is followed. Without one,
``trainer.set_lr_schedule`` (``ngdist.optim.schedules``) sets them the same way before each step.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np

from ngdist.errors import OptionError
from ngdist.ir.hyper import lr_groups

logger = logging.getLogger(__name__)


class Hypers:
    """Trainer mixin: ``set_lr``, ``lr`` and the following of a framework optimizer."""

    values: dict
    placement: object
    _write_back: object

    def _lr_names(self) -> dict[int, str]:
        return lr_groups(self.values)

    def set_lr(self, lr: float | Mapping[int, float], group: int | None = None) -> None:
        """Sets the learning rate from the next step on: ``set_lr(0.01)`` for every parameter
        group, ``set_lr(0.01, group=1)`` for group 1 only, ``set_lr({0: 0.01, 1: 0.001})``
        per group. Groups are numbered as torch's ``param_groups`` or ``ngdist.optim``'s
        ``groups=`` (those no group names: the last). A trainer compiled from a torch
        optimizer also follows its ``param_groups[i]["lr"]`` at every step (any
        ``torch.optim.lr_scheduler``), which overrides a value set here once torch's changes."""
        names = self._lr_names()
        if not names:
            raise OptionError("this step has no learning rate to set (no ngdist.lr value: "
                              "its optimizer was lowered or saved without one)")
        if isinstance(lr, Mapping):
            if group is not None:
                raise OptionError("set_lr({group: lr, ...}) names its groups; pass no group=")
            wanted = dict(lr)
        else:
            wanted = {g: lr for g in names} if group is None else {group: lr}
        unknown = sorted(g for g in wanted if g not in names)
        if unknown:
            raise OptionError(f"set_lr: no parameter group {unknown} in this step; its groups "
                              f"are {sorted(names)}")
        for g, value in wanted.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
                raise OptionError(f"set_lr: the learning rate takes a number, not a "
                                  f"{type(value).__name__} ({value!r})")
            if not value >= 0:
                raise OptionError(f"set_lr: the learning rate must be >= 0, got {value}")
            self._set_value(names[g], value)

    def _set_value(self, name: str, value: float) -> None:
        """The hyper value ``name`` from the next step on, in its type (float64 in a float64
        group)."""
        held = self.values[name].numpy().dtype
        self.values[name] = self.placement.value(  # type: ignore[attr-defined]
            np.array(value, held))

    def set_lr_schedule(self, schedule: Callable[[int], float] | None,
                        base: Mapping[int, float] | None = None) -> None:
        """From the next step on, every group's learning rate is its ``base`` rate times
        ``schedule(steps)``, ``steps`` the steps done before that step (``steps_done``, which a
        resumed checkpoint restores); e.g. ``ngdist.optim.schedules.warmup_cosine(100, 10_000)``
        or any function of the step. ``base`` ({group: lr}) defaults to the rates the step was
        compiled with (the optimizer's, or the model file's), not the current ones, so that a
        job resumed from a checkpoint scales the same rates. ``None`` ends the schedule (the
        rates stay as they are). Not with a trainer that follows a torch optimizer: step a
        torch scheduler instead."""
        if schedule is not None and not callable(schedule):
            raise OptionError(f"set_lr_schedule takes a function of the step (e.g. "
                              f"ngdist.optim.schedules.warmup_linear(100, 1000)), not a "
                              f"{type(schedule).__name__}")
        if schedule is not None and getattr(self._write_back, "hypers", None) is not None:
            raise OptionError("this trainer follows its torch optimizer's learning rates; "
                              "schedule them with a torch.optim.lr_scheduler on that optimizer")
        if base is None:
            inits = self.step_model.graph.initializers  # type: ignore[attr-defined]
            base = {g: float(inits[n].const_value.numpy())  # type: ignore[union-attr]
                    for g, n in self._lr_names().items()}
        self._lr_schedule = None if schedule is None else (schedule, dict(base))

    @property
    def lr(self) -> dict[int, float]:
        """The learning rate of every parameter group, {group: lr}, as the next step uses it."""
        return {g: float(self.values[n].numpy()) for g, n in self._lr_names().items()}

    def _first_lr(self) -> float | None:
        """The learning rate of the first group (the step stats' ``lr``), None without one."""
        names = self._lr_names()
        return float(self.values[next(iter(names.values()))].numpy()) if names else None

    def _follow_hypers(self) -> None:
        """Before a step: the learning rates of the framework optimizer, where they changed."""
        scheduled = getattr(self, "_lr_schedule", None)
        if scheduled is not None:
            schedule, base = scheduled
            factor = float(schedule(self.steps_done))  # type: ignore[attr-defined]
            self.set_lr({g: lr * factor for g, lr in base.items()})
        source: Callable[[], Mapping[str, float]] | None = \
            getattr(self._write_back, "hypers", None)
        if source is None:
            return
        seen = getattr(self, "_followed", None)
        now = {n: v for n, v in source().items() if n in self.values}  # (groups it trains)
        if now != seen:
            changed = {n: v for n, v in now.items() if seen is None or seen.get(n) != v}
            for name, value in changed.items():
                self._set_value(name, value)
            if seen is not None:
                logger.debug("values followed from the framework optimizer: %s", changed)
            self._followed = now
