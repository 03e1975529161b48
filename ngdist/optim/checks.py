"""The checks of an optimizer's hyper-parameters (``ngdist.optim``): each value in its type and
torch's range, and the groups' shape, each mistake an OptionError naming the parameter."""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from ngdist.errors import OptionError

Group = Mapping[str, Any]

# the range torch.optim accepts for a hyper-parameter: (low, high, low included, high included)
_RANGES = {"lr": (0.0, math.inf, True, False), "eps": (0.0, math.inf, True, False),
           "weight_decay": (0.0, math.inf, True, False), "momentum": (0.0, math.inf, True, False),
           "betas": (0.0, 1.0, True, False), "alpha": (0.0, math.inf, True, False),
           "rho": (0.0, 1.0, True, True), "lr_decay": (0.0, math.inf, True, False),
           "initial_accumulator_value": (0.0, math.inf, True, False),
           "momentum_decay": (0.0, math.inf, True, False)}
_EXPECTED = {"float": "a number", "bool": "True or False",
             "tuple[float, float]": "two numbers (BETA1, BETA2)"}


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def checked(opt: object, name: str, kind: str, value: object) -> object:
    """``value`` of hyper-parameter ``name`` in its type (float, bool, pair of floats); a value
    of another type or out of torch's range is an OptionError naming both."""
    cls = type(opt).__name__
    if kind == "float" and _real(value):
        out: object = float(value)  # type: ignore[arg-type]
    elif kind == "bool" and (isinstance(value, bool) or type(value).__name__ == "bool_"):
        out = bool(value)
    elif kind.startswith("tuple") and isinstance(value, (tuple, list)) and len(value) == 2 \
            and all(_real(v) for v in value):
        out = (float(value[0]), float(value[1]))
    else:
        raise OptionError(f"{cls}({name}={value!r}): {name} takes {_EXPECTED.get(kind, kind)}, "
                          f"not a {type(value).__name__}")
    low, high, low_in, high_in = _RANGES.get(name, (-math.inf, math.inf, True, True))
    for v in (out if isinstance(out, tuple) else (out,)):
        if isinstance(v, float) and not ((low <= v if low_in else low < v) and
                                         (v <= high if high_in else v < high)):
            span = f"{'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"
            raise OptionError(f"{cls}({name}={value!r}): {name} must be in {span}")
    return out


def checked_groups(opt: object, groups: object) -> tuple[Group, ...]:
    """``groups`` as a tuple of dicts whose ``params`` is a tuple of names; a group that is not
    a mapping with ``params``, or names a key the optimizer does not take, is an OptionError
    (the values are checked when the group's optimizer is made, ``param_groups``)."""
    from ngdist.passes.options import unknown_option

    cls = type(opt).__name__
    if isinstance(groups, Mapping) or not isinstance(groups, Sequence) or isinstance(groups, str):
        raise OptionError(f"{cls}(groups=...) takes a list of dicts like "
                          "{'params': [names], 'lr': 0.01}, not a "
                          f"{type(groups).__name__}")
    valid = [f.name for f in dataclasses.fields(opt) if f.name != "groups"]  # type: ignore
    out = []
    for i, g in enumerate(groups):
        params = g.get("params") if isinstance(g, Mapping) else None
        if isinstance(params, str) or not isinstance(params, Sequence) or \
                not all(isinstance(p, str) for p in params):
            raise OptionError(f"{cls} group {i} needs 'params': a list of parameter names, "
                              f"e.g. {{'params': ['fc.bias'], 'weight_decay': 0.0}}")
        for key in g:
            if key != "params" and key not in valid:
                raise unknown_option(key, f"{cls} group {i}", ["params", *valid], noun="key",
                                     listed_as=f"Valid keys of a {cls} group")
        dataclasses.replace(opt, groups=(), **{k: v for k, v in g.items() if k != "params"})
        out.append({**g, "params": tuple(params)})
    return tuple(out)


