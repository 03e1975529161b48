"""The ``ngdist`` command line: rewrite, inspect, run, demo (and more as strategies land)."""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

from ngdist.errors import NgdistError
from ngdist.launch import mpiexec_cmd

logger = logging.getLogger("ngdist.cli")

EPILOG = """examples:
  ngdist demo                                   train an MLP on digits on 2 ranks
  ngdist rewrite mlp.onnx -o mlp.dist.onnx --loss softmax_cross_entropy --optimizer sgd:lr=0.05,momentum=0.9
  ngdist inspect mlp.dist.onnx                  parameters, gradients, comm nodes, buckets
  ngdist run -n 4 -- python train.py            launch 4 ranks with the bundled mpiexec
  ngdist train mlp.onnx --data digits.npz --optimizer sgd:lr=0.1 -n 2 --epochs 5 --save out.onnx
  ngdist run -n 6 --servers 2 -- python train.py   strategy ps: ranks 4, 5 are parameter servers
"""


def cmd_rewrite(args: argparse.Namespace) -> int:
    from ngdist import optim
    from ngdist.api import _UNSET, to_training_model
    from ngdist.ir.model import save_proto
    from ngdist.passes.pipeline import rewrite

    opts = {}
    if args.loss is not None:
        opts["loss"] = None if args.loss == "none" else args.loss
    if args.optimizer is not None:
        opts["optimizer"] = optim.from_spec(args.optimizer)
    model = to_training_model(args.input, labels=args.labels,
                              params=args.params.split(",") if args.params else None,
                              frozen=args.frozen.split(",") if args.frozen else None,
                              loss=opts.get("loss", _UNSET),
                              optimizer=opts.get("optimizer", _UNSET))
    extra = {k: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    out = rewrite(model, args.strategy, bucket_bytes=args.bucket_bytes,
                  **{k[4:]: v for k, v in extra.items()})
    save_proto(out, args.output)
    print(f"wrote {args.output} (strategy {args.strategy})")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ngdist.inspect import summarize
    from ngdist.ir.model import load_proto

    for line in summarize(load_proto(args.file)).lines():
        print(line)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise NgdistError("nothing to run: give a command after --, e.g. "
                          "`ngdist run -n 2 -- python train.py`")
    cmd = mpiexec_cmd(args.n, args.hostfile, args.hosts)
    env = dict(os.environ)
    if args.timeout is not None:
        env["NGDIST_TIMEOUT"] = str(args.timeout)
    if args.servers:
        if not 0 < args.servers < args.n:
            raise NgdistError(f"--servers {args.servers} needs more ranks than servers "
                              f"(-n {args.n}); e.g. `ngdist run -n {args.servers + 2} "
                              f"--servers {args.servers} -- ...`")
        env["NGDIST_PS_SERVERS"] = str(args.servers)
    logger.info("launching: %s", " ".join(cmd + command))
    return subprocess.call(cmd + command, env=env)


def cmd_train(args: argparse.Namespace) -> int:
    from ngdist import train_cli

    return train_cli.run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.n > 1 and "PMI_RANK" not in os.environ:
        cmd = [*mpiexec_cmd(args.n), sys.executable, "-m", "ngdist.demo",
               "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
               "--lr", str(args.lr)]
        if args.save:
            cmd += ["--save", args.save]
        return subprocess.call(cmd)
    from ngdist import demo

    return demo.main(["--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                      "--lr", str(args.lr)] + (["--save", args.save] if args.save else []))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ngdist", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compile single-process ONNX training graphs into data-parallel ones, "
                    "and run them on N MPI ranks.", epilog=EPILOG)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")

    p = sub.add_parser("rewrite", help="insert the strategy's comm ops into a training model",
                       description="Read a model, build the training step if it is forward-only "
                       "(needs --optimizer; --loss defaults to softmax_cross_entropy), insert "
                       "the strategy's communication ops and lower everything to ordinary ONNX "
                       "ops. The output is a standard ONNX training model.")
    p.add_argument("input", help="forward-only or training .onnx file")
    p.add_argument("-o", "--output", required=True, help="where to write the rewritten model")
    p.add_argument("--strategy", default="allreduce",
                   help="communication strategy (default allreduce)")
    p.add_argument("--bucket-bytes", type=int, default=25 << 20,
                   help="fuse gradients into AllReduce buckets of at most this many bytes "
                        "(default 25 MiB, as PyTorch DDP; 0 = one per gradient)")
    p.add_argument("--loss", help="softmax_cross_entropy | mse | none (output is the loss)")
    p.add_argument("--labels", default="y", help="name of the labels input (default y)")
    p.add_argument("--optimizer", help="e.g. sgd:lr=0.05,momentum=0.9,nesterov=1 or adam:lr=1e-3")
    p.add_argument("--params", help="comma-separated initializers to train (default: all float)")
    p.add_argument("--frozen", help="comma-separated initializers to keep fixed")
    p.add_argument("--graph", dest="opt_graph", choices=["exponential", "ring"],
                   help="pushsum: gossip graph (default exponential)")
    p.add_argument("--peers-per-itr", dest="opt_peers_per_itr", type=int,
                   help="pushsum: out-peers per iteration (default 1)")
    p.add_argument("--overlap", dest="opt_overlap", action="store_const", const=True,
                   help="pushsum: non-blocking gossip, messages added one iteration later")
    p.add_argument("--grad-shard-bytes", dest="opt_grad_shard_bytes", type=int,
                   help="ps: cut the gradients into shards of at most this many bytes "
                        "(default 10,000,000 as Ray SGD; 0 = one shard per owner)")
    p.add_argument("--all-reduce-alg", dest="opt_all_reduce_alg",
                   help="allreduce: mpi (default) | ring | recursive_doubling | hierarchical "
                        "| exact")
    p.add_argument("--reproducible-micro-batch", dest="opt_reproducible_micro_batch",
                   type=int, metavar="M",
                   help="allreduce: reproducible mode, gradients of micro-batches of M "
                        "samples summed exactly (the same bits on any number of ranks)")
    p.add_argument("--synch-freq", dest="opt_synch_freq", type=int,
                   help="pushsum with --overlap: iterations a message may lag (default 0)")
    p.set_defaults(func=cmd_rewrite)

    p = sub.add_parser("inspect", help="show parameters, gradients, comm nodes and buckets",
                       description="Summarize an ONNX model or training model.")
    p.add_argument("file")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("run", help="launch N ranks with the bundled mpiexec",
                       description="A thin launcher over the mpiexec of the mpich wheel. "
                       "Across machines pass --hostfile (one host per line, optionally "
                       "host:slots) and make sure every host has the same Python environment.")
    p.add_argument("-n", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--hostfile", help="MPICH hostfile for several machines")
    p.add_argument("--hosts", help="comma-separated host list (alternative to --hostfile)")
    p.add_argument("--servers", type=int, default=0,
                   help="strategy ps: the last K of the N ranks are dedicated parameter "
                        "servers (sets NGDIST_PS_SERVERS; default 0 = co-located shards)")
    p.add_argument("--timeout", type=float,
                   help="seconds before a stuck collective fails (sets NGDIST_TIMEOUT)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("demo", help="train an MLP on the bundled digits data on 2 ranks",
                       description="The README's first command: a real distributed training "
                       "run (scikit-learn's 8x8 digits, bundled) with a progress bar, then the "
                       "test accuracy.")
    p.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--save", help="write the trained model here")
    p.set_defaults(func=cmd_demo)

    from ngdist import train_cli
    p = sub.add_parser("train", help="train a saved model on arrays from an .npz file",
                       description=train_cli.__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    train_cli.add_arguments(p)
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except NgdistError as exc:
        print(f"ngdist: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, KeyError) as exc:
        print(f"ngdist: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
