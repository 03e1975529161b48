"""``ngdist train MODEL.onnx --data FILE.npz``: train a saved model on arrays from a file.

The .npz holds one array per data input of the model (named after it) plus the labels
(``--labels``, default ``y``), all with the same number of samples along axis 0. The data is
checked against the model before any rank starts: a missing array or a shape that does not fit
the model's input is an error that names both. With ``-n N > 1`` the command relaunches itself
under the bundled mpiexec; every rank trains on its slice of each global batch
(``--batch-size`` per rank, as ``ngdist demo``), rank 0 shows a tqdm progress bar and writes
``--save`` (a standard ONNX training model whose graph is the trained, deployable model).
With ``--checkpoint-dir DIR`` (and ``--checkpoint-every N``) training resumes from the newest
complete checkpoint in DIR and skips the steps it already holds (the shuffle of each epoch is
seeded, so the data order continues where it stopped); combined with ``--max-restarts K`` a
failed job picks up from its last checkpoint. ``--batch-size`` is per rank: a restart on fewer
ranks (``--min-ranks``) trains on smaller global batches from the checkpoint's step on.

Validation: ``--val-split F`` holds out round(F x samples) of the data (the first ones of a
fixed permutation, ``np.random.default_rng(0).permutation``, whatever ``--seed``), or
``--val-data FILE`` (an .npz like ``--data``) is used; after every epoch the validation loss
and accuracy of the whole set are computed on all ranks' shards and shown. ``--log-dir DIR``
writes the metrics there (``metrics.csv``; TensorBoard events and ``metrics.png`` with
``pip install 'ngdist[metrics]'``) beside each rank's output (``rank.N.log``).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ngdist.cli.rewrite import OptionParser, add_strategy_arguments, chosen_options
from ngdist.cli.run import (DEFAULT_RANKS, add_checkpoint_arguments, add_launch_arguments,
                            add_timeline_argument, timeline_env)
from ngdist.cli.rewrite import training_model as _training_model
from ngdist.errors import InputError
from ngdist.passes.options import cli_flag
from ngdist.runtime.metrics import CSV_NAME, DEFAULT_EVERY, existing_log

logger = logging.getLogger(__name__)

DEFAULT_LOSS = "softmax_cross_entropy"
DEFAULT_OPTIMIZER = "sgd:lr=0.01"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``ngdist train`` (shared by the CLI and the relaunched ranks)."""
    p.add_argument("model", help="forward-only or training .onnx file")
    p.add_argument("--data", required=True, help=".npz file: one array per model input, plus "
                   "the labels")
    p.add_argument("--loss", help=f"{DEFAULT_LOSS} (default) | mse | none (the output is the "
                   "loss); not for a training model")
    p.add_argument("--labels", default="y", help="name of the labels array/input (default y)")
    p.add_argument("--optimizer", help="e.g. sgd:lr=0.05,momentum=0.9 or adam:lr=1e-3 "
                   f"(default {DEFAULT_OPTIMIZER}); not for a training model")
    p.add_argument("--lr-schedule", metavar="SPEC", help="scale the learning rate at each "
                   "step: warmup_linear:warmup=100 | warmup_cosine:warmup=100 | "
                   "step_decay:step_size=1000,gamma=0.5 (total= defaults to the run's steps; "
                   "ngdist.optim.schedules)")
    p.add_argument("-n", type=int, default=DEFAULT_RANKS,
                   help=f"number of ranks (default {DEFAULT_RANKS})")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step "
                   "(default 32)")
    p.add_argument("--strategy", default="allreduce", help="communication strategy "
                   "(default allreduce); its options are the flags below")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-epoch shuffle")
    p.add_argument("--timeout", type=float, help="seconds before a stuck collective fails")
    p.add_argument("--save", help="write the trained training model here")
    add_timeline_argument(p, "rank 0 writes it when training ends")
    p.add_argument("--val-split", type=float, metavar="FRACTION", help="hold out this "
                   "fraction of --data (0 < FRACTION < 1, the same samples on every run) and "
                   "report its loss and accuracy after every epoch")
    p.add_argument("--val-data", metavar="FILE", help=".npz file of validation data (the "
                   "arrays of --data); its loss and accuracy are reported after every epoch")
    p.add_argument("--log-every", type=int, default=DEFAULT_EVERY, metavar="STEPS",
                   help="with --log-dir: steps between two reductions of the metrics over "
                   f"the ranks (default {DEFAULT_EVERY})")
    add_strategy_arguments(p)


LOG_DIR_HELP = ("write each rank's output to DIR/rank.N.log and the training metrics to "
                f"DIR/{CSV_NAME} (per step, and per epoch the validation; TensorBoard events "
                "and metrics.png with the metrics extra); DIR must not hold a metrics.csv")


def relaunch_argv(args: argparse.Namespace) -> list[str]:
    """The options again, for the ranks started by mpiexec."""
    argv = [args.model, "--data", args.data, "--labels", args.labels, "-n", str(args.n),
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
            "--strategy", args.strategy, "--seed", str(args.seed),
            "--log-every", str(args.log_every)]
    for flag, value in (("--loss", args.loss), ("--optimizer", args.optimizer),
                        ("--timeout", args.timeout), ("--save", args.save),
                        ("--timeline", args.timeline), ("--lr-schedule", args.lr_schedule),
                        ("--val-split", args.val_split), ("--val-data", args.val_data),
                        ("--log-dir", getattr(args, "log_dir", None))):  # a launch option
        if value is not None:
            argv += [flag, str(value)]
    for name, value in given_options(args).items():  # the strategy's flags, as given
        argv += [cli_flag(name)] if value is True else [cli_flag(name), str(value)]
    return argv


def lr_schedule(args: argparse.Namespace, total: int) -> Any:
    """The schedule of ``--lr-schedule`` over a run of ``total`` steps."""
    from ngdist.optim import schedules

    return schedules.from_spec(args.lr_schedule, total=total)


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy options given as flags, checked against the strategy (OptionError)."""
    chosen_options(args, "ngdist train")
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


# ----------------------------------------------------------------------------- data checks

def training_model(args: argparse.Namespace) -> onnx.ModelProto:
    """The model as a training model (--loss/--optimizer only for a forward-only one)."""
    return _training_model(args, DEFAULT_LOSS, DEFAULT_OPTIMIZER)


def data_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The step's data inputs (model inputs and labels), in order."""
    alg = model.training_info[0].algorithm
    inits = {t.name for t in alg.initializer} | {t.name for t in model.graph.initializer}
    return [i for i in alg.input if i.name not in inits]


def _spec(info: onnx.ValueInfoProto) -> str:
    tt = info.type.tensor_type
    if not tt.HasField("shape"):
        return "of any shape"
    dims = [d.dim_param or str(d.dim_value) if (d.dim_param or d.HasField("dim_value")) else "?"
            for d in tt.shape.dim]
    return "[" + ", ".join(dims) + "]"


def load_data(path: str | os.PathLike, inputs: list[onnx.ValueInfoProto], labels: str
              ) -> dict[str, np.ndarray]:
    """The arrays for ``inputs`` from the .npz, checked against the model and cast."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such data file")
    try:
        with np.load(path, allow_pickle=False) as npz:
            held = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable .npz file ({exc})") from None
    needed = [i.name for i in inputs]
    out: dict[str, np.ndarray] = {}
    for info in inputs:
        name = info.name
        role = "the labels" if name == labels else "the model input"
        if name not in held:
            raise InputError(f"{path.name}: no array '{name}' ({role}); the file holds "
                             f"{sorted(held)}, the model needs {needed}")
        arr = held[name]
        tt = info.type.tensor_type
        if tt.HasField("shape"):
            dims = tt.shape.dim
            bad = arr.ndim != len(dims) or any(
                d.HasField("dim_value") and arr.shape[axis] != d.dim_value
                for axis, d in enumerate(dims))
            if bad:
                raise InputError(f"{path.name}: array '{name}' has shape {arr.shape}, which "
                                 f"does not fit {role} '{name}' of shape {_spec(info)}")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise InputError(f"{path.name}: array '{name}' has dtype {arr.dtype}; "
                             f"{np.dtype(dtype)} is needed for {role} '{name}'")
        out[name] = np.ascontiguousarray(arr, dtype=dtype)
    counts = {n: (a.shape[0] if a.ndim else 1) for n, a in out.items()}
    if len(set(counts.values())) > 1:
        raise InputError(f"{path.name}: the arrays hold different numbers of samples "
                         f"(axis 0): {counts}")
    return out


def check_validation(args: argparse.Namespace) -> None:
    """Bad validation and logging options, refused before anything is loaded or run."""
    if args.val_split is not None and args.val_data is not None:
        raise InputError("--val-split and --val-data are both given: hold out a fraction of "
                         "--data with --val-split, or validate on another file with "
                         "--val-data, not both")
    if args.val_split is not None and not 0 < args.val_split < 1:
        raise InputError(f"--val-split {args.val_split:g} is not a fraction strictly between 0 "
                         "and 1; e.g. --val-split 0.2 holds out a fifth of the data")
    if args.log_every < 1:
        raise InputError(f"--log-every {args.log_every} must be at least 1 (steps)")


def split_validation(args: argparse.Namespace, data: dict[str, np.ndarray],
                     inputs: list[onnx.ValueInfoProto]
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """(training data, validation data or None) from --val-split / --val-data."""
    if args.val_data is not None:
        return data, load_data(args.val_data, inputs, args.labels)
    if args.val_split is None:
        return data, None
    samples = next(iter(data.values())).shape[0]
    held = int(round(args.val_split * samples))
    name = Path(args.data).name
    if held < 1:
        raise InputError(f"--val-split {args.val_split:g} of the {samples} samples of {name} "
                         "holds out no sample; give a larger fraction")
    if held >= samples:
        raise InputError(f"--val-split {args.val_split:g} of the {samples} samples of {name} "
                         "leaves no training data; give a smaller fraction")
    perm = np.random.default_rng(0).permutation(samples)
    val, train = np.sort(perm[:held]), np.sort(perm[held:])
    return ({k: v[train] for k, v in data.items()}, {k: v[val] for k, v in data.items()})


def prepare_data(args: argparse.Namespace, model: onnx.ModelProto
                 ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """The checked training and validation arrays."""
    inputs = data_inputs(model)
    return split_validation(args, load_data(args.data, inputs, args.labels), inputs)


# ----------------------------------------------------------------------------- training

def train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    import ngdist

    options = given_options(args)
    check_validation(args)
    model = training_model(args)
    data, val = prepare_data(args, model)
    trainer = ngdist.compile(model, strategy=args.strategy, timeout=args.timeout,
                             timeline=args.timeline,
                             checkpoint_every=getattr(args, "checkpoint_every", None),
                             checkpoint_dir=getattr(args, "checkpoint_dir", None),
                             log_dir=args.log_dir, log_every=args.log_every, **options)
    rank, size = trainer.rank, trainer.num_workers  # ps: dedicated servers get no batches
    samples = next(iter(data.values())).shape[0]
    global_batch = args.batch_size * size
    steps = samples // global_batch
    if steps == 0:
        raise InputError(f"{Path(args.data).name}: {samples} samples are fewer than one global "
                         f"batch ({args.batch_size} per rank x {size} ranks); lower "
                         "--batch-size")
    if args.lr_schedule:
        trainer.set_lr_schedule(lr_schedule(args, args.epochs * steps))
    bar = tqdm(total=args.epochs * steps, disable=rank != 0, unit="step",
               desc=f"train {Path(args.model).name} on {size} rank(s)")
    start, loss = time.perf_counter(), float("nan")
    done = min(trainer.resumed_from, args.epochs * steps)  # steps a checkpoint already holds
    bar.update(done)
    for epoch in range(done // steps, args.epochs):
        first = done - epoch * steps if epoch == done // steps else 0
        trainer.set_epoch(epoch + 1)  # the metrics rows' epoch, 1-based as shown
        perm = np.random.default_rng(args.seed + epoch).permutation(samples)  # same everywhere
        batches = ({k: v[perm[i:i + global_batch]] for k, v in data.items()}
                   for i in range(first * global_batch, steps * global_batch, global_batch))
        epoch_loss = np.zeros(2)  # this rank's sum of step losses, steps
        for batch in trainer.shard(batches):
            epoch_loss += (trainer.step(batch).loss, 1)
            bar.update(1)
        loss = epoch_mean_loss(trainer, epoch_loss)
        shown = {"epoch": epoch + 1, "loss": f"{loss:.4f}"}
        if val is not None:
            result = trainer.evaluate(val)
            shown["val_loss"] = f"{result.loss:.4f}"
            if result.accuracy is not None:
                shown["val_acc"] = f"{result.accuracy:.4f}"
            if rank == 0:
                bar.write(f"epoch {epoch + 1}: " + ", ".join(f"{k} {v}" for k, v in
                                                            list(shown.items())[1:]))
        bar.set_postfix(shown)
    bar.close()
    if args.save:
        trainer.save(args.save)
    trainer.close()  # with --log-dir: the last metrics rows and metrics.png
    if rank == 0:
        print(f"trained {args.epochs} epoch(s), {args.epochs * steps} steps of {global_batch} "
              f"samples on {size} rank(s) in {time.perf_counter() - start:.1f} s; "
              f"last epoch's loss (mean over ranks) {loss:.4f}")
        if trainer.resumed_from:
            print(f"resumed from the checkpoint of step {trainer.resumed_from}")
        if args.save:
            print(f"saved the trained model to {args.save}")
        if args.log_dir:
            print(f"metrics: {Path(args.log_dir) / CSV_NAME}")
    return 0


def epoch_mean_loss(trainer: Any, sums: np.ndarray) -> float:
    """The mean step loss of an epoch over every training rank (``sums``: this rank's sum of
    step losses and its step count); one small allreduce among the training ranks."""
    group = trainer.stats_group
    if group is not None and group.size > 1:
        group.allreduce(sums, "the epoch's mean loss").wait()
    return float(sums[0] / sums[1]) if sums[1] else float("nan")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a saved model on arrays from an .npz file",
                       description=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.__class__ = OptionParser  # unknown flags reach the command (cli/rewrite.py)
    add_arguments(p)
    add_launch_arguments(p, LOG_DIR_HELP)
    add_checkpoint_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The ``ngdist train`` command: check the data, then train here or on N ranks."""
    from ngdist.cli.run import launch
    from ngdist.comm import world_rank_size

    if args.n < 1 or args.epochs < 1 or args.batch_size < 1:
        raise InputError("-n, --epochs and --batch-size must be at least 1")
    given_options(args)  # a flag the strategy does not take: refused before anything runs
    # a timeline that cannot be written: refused here too; absolute for the ranks
    args.timeline = timeline_env(args.timeline, {})
    if args.checkpoint_every is not None and not (args.checkpoint_dir or
                                                  os.environ.get("NGDIST_CHECKPOINT_DIR")):
        raise InputError(f"--checkpoint-every {args.checkpoint_every} needs a folder: give "
                         "--checkpoint-dir DIR too")
    check_validation(args)
    if args.lr_schedule:  # a wrong spec: refused before anything runs
        lr_schedule(args, 1)
    if (args.n > 1 or args.max_restarts) and world_rank_size()[1] == 1:  # supervised
        if args.log_dir is not None and existing_log(args.log_dir):
            raise InputError(existing_log(args.log_dir))
        model = training_model(args)  # fail fast, once, before any rank starts
        prepare_data(args, model)
        env = dict(os.environ)
        if args.timeout is not None:
            env["NGDIST_TIMEOUT"] = str(args.timeout)
        return launch([sys.executable, "-m", "ngdist.cli.train", *relaunch_argv(args)], args.n,
                      args, env=env)
    return train(args)


def main(argv: list[str] | None = None) -> int:
    """Entry of the ranks relaunched under mpiexec (``python -m ngdist.cli.train``)."""
    from ngdist.errors import NgdistError

    p = OptionParser(prog="ngdist train")
    add_arguments(p)
    p.add_argument("--log-dir", help=LOG_DIR_HELP)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        return train(args)
    except (NgdistError, ValueError) as exc:
        from ngdist.comm import abort_world, world_rank_size

        rank, size = world_rank_size()
        if size > 1:  # no rank may be left waiting in a collective for this one
            abort_world(f"ngdist: error on rank {rank}: {exc}\n")
        print(f"ngdist: error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
