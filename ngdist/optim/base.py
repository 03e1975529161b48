"""What every ``ngdist.optim`` optimizer shares: the checks of its hyper-parameters, its node
attributes and states, its parameter groups and its scheduled values."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import field
from typing import Any

from ngdist.errors import OptionError
from ngdist.optim.checks import Group, checked, checked_groups
from ngdist.passes.optimizers import (FORMULA_ATTR, KERAS_DECAY_ATTR, MAXIMIZE_ATTR,
                                      SCHEDULED_ATTR, state_kinds)


class _Optimizer:
    """What every optimizer shares: checks, state kinds, groups (the fields are the class's)."""

    op_type = ""
    formula: str | None = None
    step_offset = 0  # added to the step count: ONNX Momentum and Adagrad count from 0
    # the node attribute holding the momentum (beta1) that ``scheduled_momentum=True`` makes an
    # input of the step; None: the optimizer has none that torch's schedulers cycle
    momentum_attr: str | None = None
    # weight_decay is Keras' decoupled decay before the update (KERAS_DECAY_ATTR), not the
    # node's norm_coefficient
    keras_decay = False
    maximize: bool
    groups: tuple[Group, ...]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name != "groups":
                object.__setattr__(self, f.name, checked(self, f.name, f.type,
                                                          getattr(self, f.name)))
        object.__setattr__(self, "groups", checked_groups(self, self.groups))
        if getattr(self, "scheduled_momentum", False):
            self._check_scheduled()

    def _check_scheduled(self) -> None:
        name = type(self).__name__
        if self.momentum_attr is None:
            raise OptionError(f"{name}(scheduled_momentum=True): {name} has no momentum that "
                              "ngdist follows from a scheduler (SGD, TorchAdam, AdamW, Adamax, "
                              "NAdam, RAdam and RMSprop have)")
        if not self._momentum() > 0:
            raise OptionError(f"{name}(scheduled_momentum=True): a scheduled momentum (beta1) "
                              "starts above 0 (torch's schedulers start it at max_momentum)")

    def _momentum(self) -> float:
        """The momentum (beta1) that ``momentum_attr`` holds."""
        betas = getattr(self, "betas", None)
        return float(betas[0]) if betas is not None else float(getattr(self, "momentum"))

    def _attributes(self) -> dict[str, object]:
        raise NotImplementedError

    def attributes(self) -> dict[str, object]:
        """The optimizer node's attributes."""
        out = self._attributes()
        if self.keras_decay:
            out[KERAS_DECAY_ATTR] = out["norm_coefficient"]
            out["norm_coefficient"] = 0.0
        if self.formula is not None:
            out[FORMULA_ATTR] = self.formula
        if self.maximize:
            out[MAXIMIZE_ATTR] = 1
        if self.scheduled():
            out[SCHEDULED_ATTR] = list(self.scheduled())
        return out

    def scheduled(self) -> dict[str, float]:
        """{node attribute: its first value} of the hyper-parameters the node reads from
        inputs of the step: the momentum (beta1) with ``scheduled_momentum=True``."""
        if not getattr(self, "scheduled_momentum", False) or self.momentum_attr is None:
            return {}
        return {self.momentum_attr: self._momentum()}

    @property
    def state_suffixes(self) -> tuple[str, ...]:
        """The states of each parameter, as the suffixes of their names."""
        return state_kinds(self.op_type, self.attributes())

    def state_init(self, suffix: str) -> float:
        """The value a state starts at (0 unless the optimizer says otherwise)."""
        return 0.0

    def param_groups(self, params: Sequence[str]) -> list[tuple[int, Any, list[str]]]:
        """(group index, the group's optimizer without groups, its parameters of ``params``
        in their order) for each group that has some; the parameters no group names are
        group ``len(groups)``. A named parameter that is not in ``params`` is an OptionError."""
        known, owner = set(params), {}
        for i, g in enumerate(self.groups):
            for p in g["params"]:
                if p not in known:
                    raise OptionError(f"{type(self).__name__} group {i} names {p!r}, which is "
                                      f"not a trained parameter; the trained parameters are "
                                      f"{sorted(known)}")
                if p in owner:
                    raise OptionError(f"{type(self).__name__}: parameter {p!r} is in groups "
                                      f"{owner[p]} and {i}; a parameter belongs to one group")
                owner[p] = i
        out = []
        for i in range(len(self.groups) + 1):
            hyper = {k: v for k, v in self.groups[i].items() if k != "params"} \
                if i < len(self.groups) else {}
            mine = [p for p in params if owner.get(p, len(self.groups)) == i]
            if mine:
                out.append((i, dataclasses.replace(self, groups=(), **hyper), mine))  # type: ignore
        return out


def _groups_field() -> Any:
    return field(default=(), hash=False)
