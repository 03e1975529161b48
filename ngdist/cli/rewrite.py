"""``ngdist rewrite``: insert a strategy's communication ops into a saved model.

The strategy options are command-line flags made from the option dataclasses
(passes/options.py), shared with ``ngdist train``: a flag that the chosen strategy does not take,
or one that does not exist, is an error (exit 1) naming the strategy's options.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

import onnx

from ngdist.passes.options import (STRATEGY_OPTIONS, OptionError, StrategyOptions, cli_flag,
                                   owners, strategy_options, unknown_option)


class OptionParser(argparse.ArgumentParser):
    """An ArgumentParser that leaves the arguments it does not know to the command
    (``args.unknown_args``) instead of exiting, so that the command refuses them the way it
    refuses every option: one ``ngdist: error:`` line naming the closest flag, exit 1."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.unknown_args = [*getattr(namespace, "unknown_args", []), *extras]
        namespace.known_flags = sorted(s for s in self._option_string_actions
                                       if s.startswith("--"))
        return namespace, []


def add_strategy_arguments(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` per strategy option (``opt_<name>``, None unless given)."""
    seen: set[str] = set()
    for strategy, cls in STRATEGY_OPTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            kinds = " | ".join(owners(f.name))
            kw: dict[str, Any] = {"dest": f"opt_{f.name}", "default": None,
                                  "help": f"{kinds}: {f.metadata.get('help', '')}"}
            if hints[f.name] is bool:
                kw.update(action="store_const", const=True)
            else:
                kw.update(type=hints[f.name], metavar=f.metadata.get("metavar") or
                          ("N" if hints[f.name] is int else "VALUE"))
            p.add_argument(cli_flag(f.name), **kw)


def chosen_options(args: argparse.Namespace, command: str) -> StrategyOptions:
    """The strategy's typed options from the flags given; unknown arguments or a flag of
    another strategy raise OptionError (spelled as flags)."""
    strategy = args.strategy
    unknown = list(getattr(args, "unknown_args", []))
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-") and len(a) > 1]
    if flags:
        valid = STRATEGY_OPTIONS[strategy].names() if strategy in STRATEGY_OPTIONS else []
        known = [f[2:].replace("-", "_") for f in getattr(args, "known_flags", [])]
        raise unknown_option(flags[0].lstrip("-").replace("-", "_"), command, valid,
                             also=known, spell=cli_flag,
                             listed_as=f"Options of strategy {strategy!r}",
                             note=f" ({command} -h lists every option)")
    if unknown:
        raise OptionError(f"unrecognized arguments: {' '.join(unknown)}")
    given = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    return strategy_options(strategy, given, spell=cli_flag)


def training_model(args: argparse.Namespace, default_loss: str | None = None,
                   default_optimizer: str | None = None) -> onnx.ModelProto:
    """The training model of ``args.model``/``args.input`` with --loss, --optimizer,
    --labels, --params, --frozen; a forward-only model needs --optimizer unless a default is
    given, a training model takes none of these flags."""
    from ngdist import optim
    from ngdist.api import to_training_model
    from ngdist.ir.model import load_proto

    path = getattr(args, "input", None) or args.model
    proto = load_proto(path)
    params = getattr(args, "params", None)
    frozen = getattr(args, "frozen", None)
    if proto.training_info:
        given = [flag for flag, v in (("--loss", args.loss), ("--optimizer", args.optimizer),
                                      ("--params", params), ("--frozen", frozen)) if v]
        if given:
            raise OptionError(f"{path} is already a training model (it has training_info); "
                              f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for "
                              "forward-only models")
        return proto
    spec = args.optimizer or default_optimizer
    if spec is None:
        raise OptionError(f"{path} is a forward-only model: pass --optimizer (e.g. "
                          "sgd:lr=0.05,momentum=0.9 or adam:lr=1e-3) to build its training step")
    loss = args.loss or default_loss or "softmax_cross_entropy"
    return to_training_model(proto, labels=args.labels, optimizer=optim.from_spec(spec),
                             loss=None if loss == "none" else loss,
                             params=params.split(",") if params else None,
                             frozen=frozen.split(",") if frozen else None)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rewrite", help="insert the strategy's comm ops into a training model",
                       description="Read a model, build the training step if it is forward-only "
                       "(needs --optimizer; --loss defaults to softmax_cross_entropy), insert "
                       "the strategy's communication ops and lower everything to ordinary ONNX "
                       "ops. The output is a standard ONNX training model. Each strategy flag "
                       "below names the strategies that take it; any other is refused.")
    p.__class__ = OptionParser  # subparsers are made by the top-level parser's class
    p.add_argument("input", help="forward-only or training .onnx file")
    p.add_argument("-o", "--output", required=True, help="where to write the rewritten model")
    p.add_argument("--strategy", default="allreduce", help="communication strategy: "
                   f"{' | '.join(STRATEGY_OPTIONS)} (default allreduce)")
    p.add_argument("--loss", help="softmax_cross_entropy (default) | mse | none (output is the "
                   "loss); forward-only models only")
    p.add_argument("--labels", default="y", help="name of the labels input (default y)")
    p.add_argument("--optimizer", help="needed for a forward-only model, e.g. "
                   "sgd:lr=0.05,momentum=0.9,nesterov=1 or adam:lr=1e-3")
    p.add_argument("--params", help="comma-separated initializers to train (default: all float)")
    p.add_argument("--frozen", help="comma-separated initializers to keep fixed")
    add_strategy_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ngdist.ir.model import check_training_model, save_proto
    from ngdist.passes.pipeline import rewrite

    options = chosen_options(args, "ngdist rewrite")  # before any model is read
    out = rewrite(training_model(args), options)
    check_training_model(out)  # what is written loads back: the same checks as on reading
    save_proto(out, args.output)
    print(f"wrote {args.output} (strategy {args.strategy})")
    return 0
