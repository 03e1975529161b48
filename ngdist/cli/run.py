"""``ngdist run``: launch N ranks with the bundled mpiexec and supervise them.

The supervisor (ngdist/comm/supervisor.py) is the one launcher of the CLI: ``ngdist demo`` and
``ngdist train -n N`` relaunch themselves through ``launch`` below. This module prints its
outcome on stderr: nothing when every rank exited 0; one line when the job was stopped by a
signal; else a headline (the rank that failed first) and a table of the ranks (status, first
error line; in a job of more than 16 ranks only those that did not exit 0).

``--log-dir DIR`` writes DIR/rank.N.log on the launcher's host (every rank's output, from every
host, reaches it through mpiexec), unprefixed, in addition to the terminal (as ``tee`` does:
rank 0's progress bar stays in view).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from ngdist.comm.supervisor import JobResult, Supervisor
from ngdist.errors import NgdistError

logger = logging.getLogger(__name__)

ALL_RANKS_UP_TO = 16  # a larger job's table leaves out the ranks that exited 0
_STOPPED_BY = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)",
               signal.SIGHUP: "hung up (SIGHUP)"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="launch N ranks with the bundled mpiexec",
                       description="Launch N ranks with the mpiexec of the mpich wheel and "
                       "supervise them: each line of output says its rank, a failed rank stops "
                       "the job after --grace seconds with a table of the ranks' exit statuses "
                       "and first error lines, and Ctrl-C / SIGTERM / SIGHUP stop every rank "
                       "(exit status 130 / 143 / 129). Across machines pass --hostfile (one host "
                       "per line, optionally host:slots) and make sure every host has the same "
                       "Python environment.")
    p.add_argument("-n", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--hostfile", help="MPICH hostfile for several machines")
    p.add_argument("--hosts", help="comma-separated host list (alternative to --hostfile)")
    p.add_argument("--servers", type=int, default=0,
                   help="strategy ps: the last K of the N ranks are dedicated parameter "
                        "servers (sets NGDIST_PS_SERVERS; default 0 = co-located shards)")
    p.add_argument("--timeout", type=float,
                   help="seconds before a stuck collective fails (sets NGDIST_TIMEOUT)")
    add_timeline_argument(p, "sets NGDIST_TIMELINE for every rank")
    add_launch_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(func=run)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """The supervisor's options (``ngdist run``; ``demo`` and ``train`` take them too)."""
    p.add_argument("--no-prefix", dest="prefix", action="store_false",
                   help="do not start each line of a rank's output with [rank N]")
    p.add_argument("--log-dir", metavar="DIR",
                   help="also write each rank's output to DIR/rank.N.log")
    p.add_argument("--grace", type=float, default=3.0,
                   help="seconds the other ranks may still run after one failed (default 3)")


def add_timeline_argument(p: argparse.ArgumentParser, how: str) -> None:
    p.add_argument("--timeline", metavar="FILE",
                   help="write a Chrome trace of the job (every rank's steps, compute, comm "
                        f"and waits; open it in Perfetto or chrome://tracing) to FILE ({how})")


def timeline_env(path: str | None, env: dict[str, str]) -> str | None:
    """``--timeline FILE``: checked here, before any rank starts, and passed to every rank as
    ``NGDIST_TIMELINE``; the absolute path (a rank may run in another directory)."""
    from ngdist.runtime.timeline import ENV, check_path, timeline_path

    if path is None:
        return None
    trace = timeline_path(path)
    check_path(trace)
    env[ENV] = str(trace)
    return env[ENV]


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise NgdistError("nothing to run: give a command after --, e.g. "
                          "`ngdist run -n 2 -- python train.py`")
    env = dict(os.environ)
    if args.timeout is not None:
        env["NGDIST_TIMEOUT"] = str(args.timeout)
    if args.servers:
        if not 0 < args.servers < args.n:
            raise NgdistError(f"--servers {args.servers} needs more ranks than servers "
                              f"(-n {args.n}); e.g. `ngdist run -n {args.servers + 2} "
                              f"--servers {args.servers} -- ...`")
        env["NGDIST_PS_SERVERS"] = str(args.servers)
    timeline_env(args.timeline, env)
    return launch(command, args.n, args, hostfile=args.hostfile, hosts=args.hosts, env=env)


def launch(command: Sequence[str], n: int, args: argparse.Namespace | None = None, *,
           hostfile: str | None = None, hosts: str | None = None,
           env: Mapping[str, str] | None = None) -> int:
    """Run ``command`` on ``n`` supervised ranks, print the outcome; the exit status.
    ``args``: the launch options of ``add_launch_arguments`` (defaults when None)."""
    if args is None:
        args = argparse.Namespace(prefix=True, log_dir=None, grace=3.0)
    if args.grace < 0:
        raise NgdistError(f"--grace must be at least 0, got {args.grace}")
    result = Supervisor(command, n, hostfile=hostfile, hosts=hosts, env=env,
                        prefix=args.prefix, log_dir=args.log_dir, grace=args.grace).run()
    for line in report(result):
        print(line, file=sys.stderr)
    return result.status


def report(result: JobResult) -> list[str]:
    """What ``ngdist run`` says about a job that did not succeed (nothing when it did)."""
    if result.received is not None:
        what = _STOPPED_BY.get(result.received, signal.Signals(result.received).name)
        killed = (f" ({result.killed} killed: still running {result.kill_after:g} s after "
                  "SIGTERM)" if result.killed else "")
        return [f"ngdist: {what}; stopped {_ranks(result.stopped)}{killed}"]
    if result.status == 0:
        return []
    if result.first_failed is not None:
        first = result.ranks[result.first_failed]
        head = f"ngdist: rank {first.rank} failed ({first.describe()})"
        if result.stopped:
            head += f"; stopped the other {_ranks(result.stopped)}"
    else:
        launcher = result.launcher_status
        head = (f"ngdist: the job failed (mpiexec exit status {launcher})" if launcher >= 0
                else f"ngdist: the job failed (mpiexec killed by signal {-launcher})")
    shown = [s for s in result.ranks
             if len(result.ranks) <= ALL_RANKS_UP_TO or s.failed or not s.known]
    rows = [("rank", "status", "first error line")]
    rows += [(str(s.rank), s.describe(), s.error or "-") for s in shown]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [head] + [f"  {r[0]:>{width[0]}}  {r[1]:<{width[1]}}  {_clip(r[2])}" for r in rows]
    if result.log_dir is not None:
        lines.append(f"each rank's output: {result.log_dir}/rank.N.log")
    return lines


def _ranks(k: int) -> str:
    return f"{k} rank" if k == 1 else f"{k} ranks"


def _clip(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."
