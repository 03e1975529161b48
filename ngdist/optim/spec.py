"""The CLI form of optimizers and schedules, ``NAME:key=value,...``: the name picks a class, each
value is parsed by its field's type (a number, a whole number, a boolean 1/0/true/false, a pair
BETA1/BETA2); a wrong name, key or value is an OptionError naming the valid ones."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ngdist.errors import OptionError

_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def parse_spec(spec: str, noun: str, kinds: Mapping[str, type],
               aliases: Mapping[str, str] | None = None) -> tuple[type, dict[str, object]]:
    """(the class ``spec`` names among ``kinds``, its keyword arguments); ``noun`` names the
    kind of thing in messages ("optimizer", "lr schedule"), ``aliases`` other libraries' names
    of keys, suggested when one is used."""
    from ngdist.passes.options import unknown_option

    name, _, rest = spec.partition(":")
    kind = name.strip().lower()
    if kind not in kinds:
        raise OptionError(f"unknown {noun} {name!r} in {spec!r}; choose one of {sorted(kinds)}")
    cls = kinds[kind]
    types = {f.name: str(f.type) for f in dataclasses.fields(cls) if f.name != "groups"}
    kwargs: dict[str, object] = {}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, eq, value = (p.strip() for p in item.partition("="))
        if key not in types:
            alias = (aliases or {}).get(key.lower())
            raise unknown_option(key, f"{noun} {kind!r} in {spec!r}", list(types), noun="key",
                                 guess=alias if alias in types else None,
                                 listed_as=f"Valid keys of {kind}")
        if not eq or not value:
            raise OptionError(f"{noun} spec {spec!r}: {key!r} has no value; write "
                              f"{key}=VALUE")
        kwargs[key] = _parse(spec, noun, key, types[key], value)
    return cls, kwargs


def _parse(spec: str, noun: str, key: str, kind: str, value: str) -> object:
    try:
        if kind == "bool":
            if value.lower() not in _BOOLS:
                raise ValueError(value)
            return _BOOLS[value.lower()]
        if kind.startswith("tuple"):
            pair = tuple(float(v) for v in value.split("/"))
            if len(pair) != 2:
                raise ValueError(value)
            return pair
        return int(value) if kind == "int" else float(value)
    except ValueError:
        expected = {"bool": "1, 0, true or false", "int": "a whole number"}.get(
            kind, "two numbers as BETA1/BETA2" if kind.startswith("tuple") else "a number")
        raise OptionError(f"{noun} spec {spec!r}: {key}={value!r} is not "
                          f"{expected}") from None
