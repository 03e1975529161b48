"""``ngdist run``: launch N ranks with the bundled mpiexec."""
from __future__ import annotations

import argparse
import logging
import os
import subprocess

from ngdist.comm.launch import mpiexec_cmd
from ngdist.errors import NgdistError

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
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
