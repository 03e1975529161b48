"""Typed options: one dataclass of knobs per strategy, and the checks every surface shares.

Each strategy's knobs are the fields of one frozen dataclass (``AllReduceOptions``,
``PushSumOptions``, ``PSOptions``, ``SimpleOptions``, ``LocalOptions``), found by name in
``STRATEGY_OPTIONS``. Every surface that takes options (``ngdist.compile``,
``ngdist.DistributedSGD``, ``ngdist.kvstore.create``, ``ngdist rewrite`` / ``ngdist train``)
builds them here, so they fail alike:

* an unknown or misspelt name is an :class:`OptionError` that suggests the closest valid name
  (``difflib``) and lists the valid ones;
* a name that belongs to another strategy says which strategy takes it;
* a value of the wrong type (``peers_per_itr="two"``) names the expected type.

Value ranges are checked where the value is used (the passes' constructors), except the
AllReduce algorithm, whose domain is the kernels' (``ir.domain.ALLREDUCE_ALGORITHMS``).
Field metadata carries the help text the command line shows (``cli/rewrite.py`` makes one
``--flag`` per field).
"""
from __future__ import annotations

import dataclasses
import difflib
import numbers
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ngdist.errors import OptionError
from ngdist.ir.domain import ALLREDUCE_ALGORITHMS, COMPRESSIONS
from ngdist.passes.pushsum import GRAPHS

Spell = Callable[[str], str]


def python_name(name: str) -> str:
    """How a Python call spells an option: ``peers_per_itr``."""
    return name


def cli_flag(name: str) -> str:
    """How the command line spells an option: ``--peers-per-itr``."""
    return "--" + name.replace("_", "-")


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (difflib's ratio >= 0.6), or None."""
    match = difflib.get_close_matches(name, sorted(set(candidates)), n=1)
    return match[0] if match else None


def unknown_option(name: str, owner: str, valid: Iterable[str], *, also: Iterable[str] = (),
                   note: str = "", spell: Spell = python_name,
                   listed_as: str = "Valid options",
                   remarks: Mapping[str, str] | None = None, guess: str | None = None,
                   noun: str = "option") -> OptionError:
    """The error for ``name``, which ``owner`` does not take.

    The suggestion is ``guess`` or else the closest of ``valid`` and ``also`` (names the same
    call accepts elsewhere, e.g. ``compile``'s own keywords), followed by its entry in
    ``remarks`` if any; the list shows ``valid``, then ``note``.
    """
    shown = sorted(valid)
    listed = ", ".join(spell(v) for v in shown) or "none"
    guess = guess or closest(name, [*shown, *also])
    head = f"unknown {noun} {spell(name)!r} for {owner}"
    if guess:
        remark = (remarks or {}).get(guess, "")
        head += f"; did you mean {spell(guess)!r}{remark}? "
    else:
        head += ". "
    return OptionError(f"{head}{listed_as}: {listed}{note}")


def refuse_unknown(given: Mapping[str, object], owner: str, valid: Iterable[str]) -> None:
    """Raises for the first name of ``given`` (a call's leftover keywords), if any."""
    if given:
        raise unknown_option(next(iter(given)), owner, valid)


# --------------------------------------------------------------------------- typed fields

def _describe(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if _is_union(hint):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        (item, *_) = typing.get_args(hint) or (Any,)
        return f"a list of {_describe(item)}"
    return {bool: "True or False", int: "an int", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _fits(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if _is_union(hint):
        return any(_fits(value, a) for a in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        (item, *_) = typing.get_args(hint) or (Any,)
        return isinstance(value, (list, tuple)) and all(_fits(v, item) for v in value)
    if hint is bool:
        return isinstance(value, (bool, np.bool_))
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, hint)


def _plain(value: Any) -> Any:
    """numpy scalars as Python ones (the passes write them into graph attributes)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


@dataclass(frozen=True)
class TypedOptions:
    """Base of the option dataclasses: every field's value is checked against its annotation.

    ``owner`` names the options in messages ("strategy 'pushsum'", "ngdist.compile").
    """

    owner: ClassVar[str] = "options"

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _fits(value, hints[f.name]):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise OptionError(f"option {f.name!r} of {self.owner} takes "
                                  f"{_describe(hints[f.name])}, got {shown} "
                                  f"({type(value).__name__})")
            object.__setattr__(self, f.name, _plain(value))

    @classmethod
    def names(cls) -> list[str]:
        """The option names, sorted."""
        return sorted(f.name for f in dataclasses.fields(cls))


def _knob(default: Any, help: str, metavar: str | None = None) -> Any:  # noqa: A002
    return field(default=default, metadata={"help": help, "metavar": metavar})


# --------------------------------------------------------------------------- strategies

@dataclass(frozen=True)
class StrategyOptions(TypedOptions):
    """The knobs of one strategy; ``strategy`` is its name in ``STRATEGY_OPTIONS``."""

    strategy: ClassVar[str] = ""


# values of the allreduce strategy's ``shard`` option (passes/shard.py): none, ZeRO-1/2/3
SHARD_LEVELS = ("none", "optimizer", "gradients", "parameters")


@dataclass(frozen=True)
class AllReduceOptions(StrategyOptions):
    """``allreduce``: gradients averaged by (bucketed) AllReduce before the update."""

    strategy: ClassVar[str] = "allreduce"
    owner: ClassVar[str] = "strategy 'allreduce'"
    bucket_bytes: int = _knob(25 << 20, "fuse gradients into AllReduce buckets of at most this "
                              "many bytes (default 25 MiB, as PyTorch DDP; 0 = one per "
                              "gradient)")
    all_reduce_alg: str = _knob("mpi", "mpi (default) | ring | recursive_doubling | "
                                "hierarchical | exact", metavar="ALG")
    reproducible_micro_batch: int = _knob(0, "reproducible mode, gradients of micro-batches of M "
                                          "samples summed exactly (the same bits on any "
                                          "number of ranks)", metavar="M")
    compression: str = _knob("none", "gradient compression on the wire: none (default) | fp16 "
                             "| bf16 (each AllReduce's input cast to 16 bits and back, half the "
                             "bytes)", metavar="{none," + ",".join(COMPRESSIONS) + "}")
    compression_error_feedback: bool = _knob(False, "with compression: keep what the cast to "
                                             "16 bits lost in a per-bucket residual and add "
                                             "it to the next step's gradients")
    shard: str = _knob("none", "sharded data parallelism: none (default) | optimizer (ZeRO-1: "
                       "each rank updates 1/N of every bucket with 1/N of the optimizer "
                       "state) | gradients (ZeRO-2: and keeps 1/N of each gradient bucket) "
                       "| parameters (ZeRO-3: and holds 1/N of the parameters, gathered where "
                       "the step reads them)",
                       metavar="{" + ",".join(SHARD_LEVELS) + "}")
    shard_ranks: int = _knob(0, "with shard: the rank count the shards are sized for "
                             "(ngdist.compile sets the job's)", metavar="N")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shard not in SHARD_LEVELS:
            raise OptionError(f"unknown shard {self.shard!r}; choose one of "
                              f"{list(SHARD_LEVELS)}")
        if self.all_reduce_alg not in ALLREDUCE_ALGORITHMS:
            raise OptionError(f"unknown all_reduce_alg {self.all_reduce_alg!r}; choose one of "
                              f"{list(ALLREDUCE_ALGORITHMS)}")
        if self.compression not in ("none", *COMPRESSIONS):
            raise OptionError(f"unknown compression {self.compression!r}; choose one of "
                              f"{['none', *COMPRESSIONS]}")
        if self.compression_error_feedback and self.compression == "none":
            raise OptionError("compression_error_feedback needs a compression (fp16 or bf16); "
                              "pass compression='fp16' or 'bf16' too, or leave it out")


@dataclass(frozen=True)
class PushSumOptions(StrategyOptions):
    """``pushsum``: Stochastic Gradient Push (passes/pushsum.py)."""

    strategy: ClassVar[str] = "pushsum"
    owner: ClassVar[str] = "strategy 'pushsum'"
    graph: str = _knob("exponential", "gossip graph (default exponential)",
                       metavar="{" + ",".join(GRAPHS) + "}")
    peers_per_itr: int = _knob(1, "out-peers per iteration (default 1)")
    overlap: bool = _knob(False, "non-blocking gossip, messages added one iteration later")
    synch_freq: int = _knob(0, "with overlap: iterations a message may lag (default 0)")


@dataclass(frozen=True)
class PSOptions(StrategyOptions):
    """``ps``: sharded parameter servers (passes/ps.py)."""

    strategy: ClassVar[str] = "ps"
    owner: ClassVar[str] = "strategy 'ps'"
    grad_shard_bytes: int = _knob(10_000_000, "cut the gradients into shards of at most this "
                                  "many bytes (default 10,000,000 as Ray SGD; 0 = one shard per "
                                  "owner)")
    servers: int = _knob(0, "dedicated parameter servers, the last K ranks (default 0: every "
                         "rank owns shards)", metavar="K")


@dataclass(frozen=True)
class SimpleOptions(StrategyOptions):
    """``simple``: gradients averaged at rank 0 and broadcast back (no knobs)."""

    strategy: ClassVar[str] = "simple"
    owner: ClassVar[str] = "strategy 'simple'"


@dataclass(frozen=True)
class LocalOptions(StrategyOptions):
    """``local``: one process, no communication (no knobs)."""

    strategy: ClassVar[str] = "local"
    owner: ClassVar[str] = "strategy 'local'"


STRATEGY_OPTIONS: dict[str, type[StrategyOptions]] = {
    c.strategy: c for c in (AllReduceOptions, PushSumOptions, PSOptions, SimpleOptions,
                            LocalOptions)}


def unknown_strategy(strategy: str, known: Iterable[str]) -> OptionError:
    """The error for a strategy name that is not one of ``known``."""
    names = sorted(known)
    guess = closest(strategy, names)
    hint = f"did you mean {guess!r}? Choose" if guess else "choose"
    return OptionError(f"unknown strategy {strategy!r}; {hint} one of {names}")


def owners(name: str) -> list[str]:
    """The strategies that take the option ``name``."""
    return [s for s, c in STRATEGY_OPTIONS.items() if name in c.names()]


def strategy_options(strategy: str, given: Mapping[str, object], *, also: Iterable[str] = (),
                     note: str = "", spell: Spell = python_name) -> StrategyOptions:
    """The typed options of ``strategy`` from the given ones (only what the user chose).

    An option of another strategy is refused naming that strategy; an unknown one suggests the
    closest of the strategy's options and ``also`` (other names the caller accepts).
    """
    if strategy not in STRATEGY_OPTIONS:
        raise unknown_strategy(strategy, STRATEGY_OPTIONS)
    cls = STRATEGY_OPTIONS[strategy]
    valid = cls.names()
    for name in given:
        if name in valid:
            continue
        elsewhere = owners(name)
        if elsewhere:
            listed = ", ".join(spell(v) for v in valid)
            tail = f"options of {strategy!r}: {listed}" if valid else \
                f"{strategy!r} takes no options"
            raise OptionError(f"{spell(name)} is an option of the {' and '.join(elsewhere)} "
                              f"strategy, not of {strategy!r}; {tail}{note}")
        others = {o: f" (an option of the {' and '.join(owners(o))} strategy)"
                  for c in STRATEGY_OPTIONS.values() for o in c.names() if o not in valid}
        raise unknown_option(name, cls.owner, valid, also=[*also, *others], note=note,
                             spell=spell, remarks=others)
    return cls(**given)
