"""The ``ngdist`` command line: rewrite, inspect, run, demo (and more as strategies land)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ngdist.errors import NgdistError

logger = logging.getLogger("ngdist.cli")

EPILOG = """examples:
  ngdist demo                                   train an MLP on digits on 2 ranks
  ngdist rewrite mlp.onnx -o mlp.dist.onnx --loss softmax_cross_entropy --optimizer sgd:lr=0.05,momentum=0.9
  ngdist inspect mlp.dist.onnx                  parameters, gradients, comm nodes, buckets
  ngdist run -n 4 -- python train.py            launch 4 ranks with the bundled mpiexec
  ngdist train mlp.onnx --data digits.npz --optimizer sgd:lr=0.1 -n 2 --epochs 5 --save out.onnx
  ngdist run -n 6 --servers 2 -- python train.py   strategy ps: ranks 4, 5 are parameter servers
  ngdist run -n 4 --max-restarts 3 --checkpoint-dir ckpt -- python train.py
                                                relaunch a failed job, resume from checkpoints
"""



def build_parser() -> argparse.ArgumentParser:
    from ngdist.cli import demo, inspect, rewrite, run, train

    parser = argparse.ArgumentParser(
        prog="ngdist", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compile single-process ONNX training graphs into data-parallel ones, "
                    "and run them on N MPI ranks.", epilog=EPILOG)
    from ngdist import __version__

    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-v info, -vv debug)")
    parser.add_argument("--version", action="version", version=f"ngdist {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an error (also NGDIST_DEBUG=1)")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    for module in (rewrite, inspect, run, demo, train):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get("NGDIST_DEBUG", "").strip() not in ("", "0")
    try:
        if getattr(args, "timeout", None) is None:
            # a malformed NGDIST_TIMEOUT fails here, before any work or launch, not on the ranks
            from ngdist.comm.group import default_timeout
            default_timeout()
        return args.func(args)
    except (NgdistError, ValueError, KeyError, OSError) as exc:
        if debug:
            raise
        print(f"ngdist: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    """The error as the message line: an OSError names its path (``out.onnx: Is a directory``)."""
    if isinstance(exc, OSError) and exc.strerror:
        names = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
        return f"{' -> '.join(names)}: {exc.strerror}" if names else exc.strerror
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
