"""``ngdist run``: launch N ranks with the bundled mpiexec and supervise them.

The supervisor (ngdist/comm/supervisor.py) is the one launcher of the CLI: ``ngdist demo`` and
``ngdist train -n N`` relaunch themselves through ``launch`` below. This module prints its
outcome on stderr: nothing when every rank exited 0; one line when the job was stopped by a
signal; else a headline (the rank that failed first) and a table of the ranks (status, first
error line; in a job of more than 16 ranks only those that did not exit 0).

``--max-restarts K`` relaunches a failed job (K times at most; one line on stderr each time,
the table only for the last attempt), ``--min-ranks M`` lets a relaunch run on fewer ranks
(see comm/supervisor.py ``supervise``), ``--checkpoint-dir`` / ``--checkpoint-every`` set
NGDIST_CHECKPOINT_DIR / NGDIST_CHECKPOINT_EVERY for ``ngdist.compile`` on the ranks.

``--log-dir DIR`` writes DIR/rank.N.log on the launcher's host (every rank's output, from every
host, reaches it through mpiexec), unprefixed, in addition to the terminal (as ``tee`` does:
rank 0's progress bar stays in view).
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from ngdist.comm.launch import slurm_allocation, slurm_env
from ngdist.comm.supervisor import JobResult, supervise
from ngdist.errors import NgdistError

logger = logging.getLogger(__name__)

DEFAULT_RANKS = 1  # ngdist run and ngdist train, as torchrun's --nproc-per-node
ALL_RANKS_UP_TO = 16  # a larger job's table leaves out the ranks that exited 0
_STOPPED_BY = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)",
               signal.SIGHUP: "hung up (SIGHUP)"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="launch N ranks with the bundled mpiexec",
                       description="Launch N ranks with the mpiexec of the mpich wheel and "
                       "supervise them: each line of output says its rank, a failed rank stops "
                       "the job after --grace seconds with a table of the ranks' exit statuses "
                       "and first error lines, and Ctrl-C / SIGTERM / SIGHUP stop every rank "
                       "(exit status 130 / 143 / 129). With --max-restarts K a failed job is "
                       "launched again, K times at most (never after a signal); each attempt's "
                       "ranks see NGDIST_RESTART_COUNT=0, 1, ..., and with --checkpoint-dir a "
                       "program built on ngdist.compile resumes from its newest complete "
                       "checkpoint. Across machines pass --hostfile (one host "
                       "per line, optionally host:slots) and make sure every host has the same "
                       "Python environment; inside a Slurm allocation (salloc, sbatch) the "
                       "ranks are started through srun on its nodes, -n defaulting to its "
                       "task count.")
    p.add_argument("-n", type=int,
                   help=f"number of ranks (default: the task count of the Slurm allocation "
                        f"it runs in, else {DEFAULT_RANKS})")
    p.add_argument("--hostfile", help="MPICH hostfile for several machines")
    p.add_argument("--hosts", help="comma-separated host list (alternative to --hostfile)")
    p.add_argument("--servers", type=int, default=0,
                   help="strategy ps: the last K of the N ranks are dedicated parameter "
                        "servers (sets NGDIST_PS_SERVERS; default 0 = co-located shards)")
    p.add_argument("--timeout", type=float,
                   help="seconds before a stuck collective fails (sets NGDIST_TIMEOUT)")
    add_timeline_argument(p, "sets NGDIST_TIMELINE for every rank")
    add_launch_arguments(p)
    add_checkpoint_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(func=run)


def add_launch_arguments(p: argparse.ArgumentParser,
                         log_dir_help: str = "also write each rank's output to DIR/rank.N.log"
                         ) -> None:
    """The supervisor's options (``ngdist run``; ``demo`` and ``train`` take them too)."""
    p.add_argument("--no-prefix", dest="prefix", action="store_false",
                   help="do not start each line of a rank's output with [rank N]")
    p.add_argument("--log-dir", metavar="DIR", help=log_dir_help)
    p.add_argument("--grace", type=float, default=3.0,
                   help="seconds the other ranks may still run after one failed (default 3)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="when the job fails (a rank exits non-zero or is killed), stop what is "
                        "left and launch the whole job again, at most K times (default 0); "
                        "Ctrl-C/SIGTERM/SIGHUP never restart. The ranks see "
                        "NGDIST_RESTART_COUNT (0 on the first attempt); the exit status is the "
                        "last attempt's")
    p.add_argument("--min-ranks", type=int, metavar="M",
                   help="a restart may run on fewer ranks: the failed attempt's count less the "
                        "rank that failed first and any other killed by a signal, never fewer "
                        "than M (default: every attempt runs on -n ranks). Train with "
                        "reproducible_micro_batch= to end bit-for-bit as on -n ranks")


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """Where ``ngdist.compile`` on the ranks checkpoints (``ngdist run`` and ``train``)."""
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="sets NGDIST_CHECKPOINT_DIR: ngdist.compile on the ranks resumes from "
                        "the newest complete checkpoint in DIR and writes its checkpoints there")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="sets NGDIST_CHECKPOINT_EVERY: a checkpoint every N steps (needs "
                        "--checkpoint-dir, or checkpoint_dir= in the program)")


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
    n = rank_count(args, env)
    if args.timeout is not None:
        env["NGDIST_TIMEOUT"] = str(args.timeout)
    if args.servers:
        if not 0 < args.servers < n:
            raise NgdistError(f"--servers {args.servers} needs more ranks than servers "
                              f"(-n {n}); e.g. `ngdist run -n {args.servers + 2} "
                              f"--servers {args.servers} -- ...`")
        env["NGDIST_PS_SERVERS"] = str(args.servers)
    timeline_env(args.timeline, env)
    command = own_interpreter(command, env)
    return launch(command, n, args, hostfile=args.hostfile, hosts=args.hosts, env=env)


def rank_count(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """``-n``, else the task count of the Slurm allocation ``env`` is in (without --hostfile
    or --hosts), else ``DEFAULT_RANKS``."""
    if args.n is not None:
        return int(args.n)
    slurm = slurm_allocation(env) if not (args.hostfile or args.hosts) else None
    return slurm.tasks if slurm is not None else DEFAULT_RANKS


PYTHON_NAMES = ("python", "python3")
_FINDS_NGDIST = "import importlib.util, sys; sys.exit(importlib.util.find_spec('ngdist') is None)"


def own_interpreter(command: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``python ...`` / ``python3 ...`` as the ranks would run it, unless the program of that
    name on the ranks' PATH cannot import ngdist: then this Python (as torchrun runs scripts
    with its own interpreter), said in one log line. Any other command, a path included, runs
    as given."""
    command = list(command)
    if command[0] not in PYTHON_NAMES:
        return command
    found = shutil.which(command[0], path=env.get("PATH", os.defpath))
    if found is not None and _imports_ngdist(found, env):
        return command
    why = (f"`{command[0]}` on PATH ({found}) cannot import ngdist" if found is not None
           else f"no `{command[0]}` on PATH")
    logger.warning("%s: the ranks run %s, the Python ngdist runs in", why, sys.executable)
    return [sys.executable, *command[1:]]


def _imports_ngdist(python: str, env: Mapping[str, str]) -> bool:
    """Whether ``python`` finds the ngdist package (without importing it)."""
    if python == sys.executable:
        return True
    try:
        return subprocess.run([python, "-c", _FINDS_NGDIST], env=dict(env), timeout=60,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def launch(command: Sequence[str], n: int, args: argparse.Namespace | None = None, *,
           hostfile: str | None = None, hosts: str | None = None,
           env: Mapping[str, str] | None = None) -> int:
    """Run ``command`` on ``n`` supervised ranks, print the outcome; the exit status.
    ``args``: the launch options of ``add_launch_arguments`` (defaults when None)."""
    if args is None:
        args = argparse.Namespace(prefix=True, log_dir=None, grace=3.0)
    if args.grace < 0:
        raise NgdistError(f"--grace must be at least 0, got {args.grace}")
    max_restarts = getattr(args, "max_restarts", 0)
    min_ranks = getattr(args, "min_ranks", None)
    if max_restarts < 0:
        raise NgdistError(f"--max-restarts must be at least 0, got {max_restarts}")
    if min_ranks is not None and not 1 <= min_ranks <= n:
        raise NgdistError(f"--min-ranks must be between 1 and the number of ranks (-n {n}), "
                          f"got {min_ranks}")
    env = dict(os.environ if env is None else env)
    slurm = slurm_allocation(env) if not (hostfile or hosts) else None
    if slurm is not None:
        env = slurm_env(env)
        logger.info("inside Slurm job %s: %s through srun on %s", slurm.job, _ranks(n),
                    slurm.nodes)
    servers = int(env.get("NGDIST_PS_SERVERS") or 0)
    if min_ranks is not None and min_ranks <= servers:
        raise NgdistError(f"--min-ranks {min_ranks} leaves no worker beside the {servers} "
                          f"parameter server(s); give --min-ranks {servers + 1} or more")
    for flag, var in (("checkpoint_dir", "NGDIST_CHECKPOINT_DIR"),
                      ("checkpoint_every", "NGDIST_CHECKPOINT_EVERY")):
        value = getattr(args, flag, None)
        if value is not None:
            env[var] = os.path.abspath(value) if flag == "checkpoint_dir" else str(value)
    if getattr(args, "checkpoint_every", None) is not None and args.checkpoint_every < 1:
        raise NgdistError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    total = max_restarts + 1

    def restarting(failed: JobResult, ranks: int) -> None:
        print(f"ngdist: attempt {failed.attempt + 1} of {total} failed: {headline(failed)}; "
              f"restarting on {_ranks(ranks)} (NGDIST_RESTART_COUNT={failed.attempt + 1})",
              file=sys.stderr, flush=True)

    result = supervise(command, n, max_restarts=max_restarts, min_ranks=min_ranks,
                       on_restart=restarting, hostfile=hostfile, hosts=hosts, env=env,
                       prefix=args.prefix, log_dir=args.log_dir, grace=args.grace)
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
    head = f"ngdist: {headline(result)}"
    if result.attempt:
        head += f" (attempt {result.attempt + 1} of {result.attempt + 1})"
    shown = [s for s in result.ranks
             if len(result.ranks) <= ALL_RANKS_UP_TO or s.failed or not s.known]
    rows = [("rank", "status", "first error line")]
    rows += [(str(s.rank), s.describe(), s.error or "-") for s in shown]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [head] + [f"  {r[0]:>{width[0]}}  {r[1]:<{width[1]}}  {_clip(r[2])}" for r in rows]
    if result.log_dir is not None:
        lines.append(f"each rank's output: {result.log_dir}/rank.N.log")
    return lines


def headline(result: JobResult) -> str:
    """Why a job failed, in one line: the rank that failed first, else mpiexec's status."""
    if result.first_failed is not None:
        first = result.ranks[result.first_failed]
        head = f"rank {first.rank} failed ({first.describe()})"
        if result.stopped:
            head += f"; stopped the other {_ranks(result.stopped)}"
        return head
    launcher = result.launcher_status
    return (f"the job failed (mpiexec exit status {launcher})" if launcher >= 0
            else f"the job failed (mpiexec killed by signal {-launcher})")


def _ranks(k: int) -> str:
    return f"{k} rank" if k == 1 else f"{k} ranks"


def _clip(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."
