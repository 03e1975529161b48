"""The launcher as a supervisor of its job (what torchrun's agent and horovodrun do).

``Supervisor(command, n).run()`` starts ``n`` ranks of ``command`` under the bundled mpiexec
(comm/launch.py), each through the rank wrapper (comm/rankwrap.py), and owns the job until no
process of it is left:

- The job runs in its own session (mpiexec's ``start_new_session``; hydra puts each rank in a
  session of its own as well). SIGINT, SIGTERM and SIGHUP received by the supervisor stop the
  job: mpiexec gets SIGTERM, which hydra sends to every rank's process group on every host
  (SIGINT would show the user one KeyboardInterrupt traceback per rank; SIGTERM ends a Python
  rank without one, and a rank that handles SIGTERM gets to clean up). Whatever is still alive
  ``kill_after`` seconds later is killed (SIGKILL: mpiexec, and on this host every process of
  each rank's process group). A signal received while the job is being stopped kills at once.
  When the supervisor dies itself, mpiexec gets SIGTERM from the kernel (Linux parent-death
  signal; set when the supervisor is single-threaded, as the CLI is), so the ranks never
  outlive their launcher.
- Ranks' output: see comm/rank_output.py (whole lines, ``[rank N] `` prefix, per-rank logs).
- A rank that fails (non-zero exit status or a signal) while the job is not being stopped:
  the other ranks get ``grace`` seconds to end on their own (ngdist's collectives notice a
  gone peer, and their messages say why), then the job is stopped as above. mpiexec runs with
  ``-disable-auto-cleanup``, so it would otherwise let them wait for their collective timeout.
- When the job has ended, the shared-memory files in ``/dev/shm`` that its ranks made and
  could not remove (a rank killed, MPI_Abort) are removed (comm/leftovers.py).

Restarts (``supervise``, torchrun's ``--max-restarts``): when a job fails (a rank exits
non-zero or is killed, or mpiexec fails) and it was not stopped by a signal, the whole job is
launched again, at most ``max_restarts`` times; each attempt's ranks see
``NGDIST_RESTART_COUNT`` (0, 1, ...). SIGINT, SIGTERM and SIGHUP never lead to a restart, also
when they arrive between two attempts (the handlers stay installed across attempts). The rank
count of the next attempt: the same ``n`` by default; with ``min_ranks`` the failed attempt's
count less its failed ranks, never fewer than ``min_ranks``. The failed ranks are the one that
failed first and any other killed by a signal the supervisor did not send (the OOM killer, a
crash); a rank that merely exited non-zero after the first failure most likely reported the
gone peer, and the ranks the supervisor stopped count as healthy.

The result (``JobResult``) holds every rank's exit status, its first error line and the
launcher's own exit status; the CLI (cli/run.py) prints it. The supervisor logs, it never
prints: what it writes to stdout/stderr is the ranks' output.
"""
from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ngdist.comm import leftovers, rankwrap
from ngdist.comm.launch import mpiexec_cmd
from ngdist.comm.procs import die_with_parent, handling, local_wrapper, processes, send_signal
from ngdist.comm.rank_output import LABEL_PATTERN, OutputRouter

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class RankStatus:
    """How one rank ended: as its wrapper reported it, or the MPI_Abort it called (hydra then
    kills every rank with its wrapper, which reports nothing). All None: unknown (it was killed
    with the job)."""

    rank: int
    code: int | None = None
    signal: int | None = None
    aborted: int | None = None  # the code it called MPI_Abort with
    error: str | None = None    # first error line of its output
    stopped: bool = False       # it was still running when the supervisor stopped the job
    started_mpi: bool = False   # it started MPI through ngdist (its "mpi" marker)
    # it exited 0 without starting MPI while other ranks did: they wait for it in MPI's
    # start-up, which has no time limit, so it failed the job
    never_started: bool = False

    @property
    def known(self) -> bool:
        return self.code is not None or self.signal is not None or self.aborted is not None

    @property
    def failed(self) -> bool:
        return self.signal is not None or self.aborted is not None or self.never_started \
            or self.code not in (None, 0)

    @property
    def exit_status(self) -> int | None:
        """As a shell reports it: the code, or 128 + the signal."""
        if self.signal is not None:
            return 128 + self.signal
        return self.code if self.code is not None else self.aborted

    def describe(self) -> str:
        if self.signal is not None:
            what = f"{signal.strsignal(self.signal) or 'signal'} (signal {self.signal})"
        elif self.code is not None:
            what = f"exit {self.code}" + (" without starting MPI" if self.never_started else "")
        elif self.aborted is not None:
            what = f"MPI_Abort({self.aborted})"
        else:
            what = "ended with the job"
        return f"stopped: {what}" if self.stopped else what


@dataclass
class JobResult:
    status: int                       # what the launcher exits with
    ranks: list[RankStatus]
    launcher_status: int              # mpiexec's own (negative: the signal that killed it)
    first_failed: int | None = None   # the rank that failed first, if one did
    received: int | None = None       # the signal that stopped the job, if one did
    stopped: int = 0                  # ranks still running when the job was stopped
    killed: int = 0                   # processes that needed SIGKILL
    kill_after: float = 5.0           # seconds between SIGTERM and SIGKILL
    log_dir: Path | None = None
    attempt: int = 0                  # NGDIST_RESTART_COUNT of the job this result is of


RESTART_COUNT = "NGDIST_RESTART_COUNT"


class Supervisor:
    """One job of ``n`` ranks of ``command``; see the module docstring."""

    def __init__(self, command: Sequence[str], n: int, *, hostfile: str | None = None,
                 hosts: str | None = None, env: Mapping[str, str] | None = None,
                 prefix: bool = True, log_dir: str | os.PathLike[str] | None = None,
                 grace: float = 3.0, kill_after: float = 5.0,
                 stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 received: list[int] | None = None, append_logs: bool = False) -> None:
        self.cmd = [*mpiexec_cmd(n, hostfile, hosts, flags=["-prepend-pattern", LABEL_PATTERN]),
                    sys.executable, "-I", rankwrap.__file__, "--", *command]
        self.n = n
        self.env = dict(os.environ if env is None else env)
        self.grace = grace
        self.kill_after = kill_after
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.ranks = [RankStatus(r) for r in range(n)]
        self.router = OutputRouter({"stdout": stdout or sys.stdout.buffer,
                                    "stderr": stderr or sys.stderr.buffer},
                                   prefix=prefix, log_dir=self.log_dir, on_marker=self._marker,
                                   append=append_logs)
        self._proc: subprocess.Popen[bytes] | None = None
        self._local: dict[int, int] = {}   # wrapper pid (its process group) -> start time
        # the stop signals received; shared across the attempts of ``supervise``
        self._received: list[int] = [] if received is None else received
        self._first_failed: int | None = None
        self._stop_at: float | None = None   # when to stop the others after a failure
        self._kill_at: float | None = None   # set once the job is being stopped
        self._killing = False
        self._signals_at_stop = 0
        self._stopped = 0
        self._killed = 0

    # ------------------------------------------------------------------ the job
    def run(self) -> JobResult:
        logger.info("launching: %s", " ".join(self.cmd))
        shm_before = leftovers.snapshot()
        with handling(STOP_SIGNALS, self._received.append):
            proc = self._proc = subprocess.Popen(
                self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
                start_new_session=True, preexec_fn=die_with_parent())
            try:
                self._supervise(proc)
            finally:
                if proc.poll() is None:
                    self._kill()
                proc.wait()
                left = self._sweep()
                if left and not self._killing:
                    logger.warning("killed %d process(es) the ranks left behind", left)
                self._killed += left
                leftovers.remove(shm_before)  # MPICH's segments of ranks that did not finalize
                self.router.close()
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
        for status in self.ranks:
            scan = self.router.scan(status.rank)
            status.error = scan.first
            if status.error is None and status.code not in (None, 0):
                status.error = scan.last_stderr  # e.g. the text of a SystemExit("msg")
            if not status.known:
                status.aborted = scan.abort_code
        if self._first_failed is None and self.router.aborted and not self._received:
            self._first_failed = self.router.aborted[0]
        return JobResult(self._status(proc.returncode), self.ranks, proc.returncode,
                         self._first_failed, self._received[0] if self._received else None,
                         self._stopped, self._killed, self.kill_after, self.log_dir)

    def _supervise(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
            sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
            ended_at: float | None = None
            while True:
                for key, _ in sel.select(0.1):
                    data = os.read(key.fd, 65536)
                    if data:
                        self.router.feed(key.data, data)
                    else:
                        sel.unregister(key.fileobj)
                now = time.monotonic()
                self.router.flush_idle(now)
                self._act(proc, now)
                if proc.poll() is not None:
                    ended_at = now if ended_at is None else ended_at
                    # mpiexec is gone; its output ends with EOF (a stray holder: 2 s at most)
                    if not sel.get_map() or now - ended_at > 2.0:
                        return

    def _act(self, proc: subprocess.Popen[bytes], now: float) -> None:
        if proc.poll() is not None:
            return
        if self._kill_at is None:
            if self._received:
                logger.info("received %s: stopping the job", signal.Signals(self._received[0]).name)
                self._stop(now)
            elif self._stop_at is not None and now >= self._stop_at:
                logger.info("rank %d failed %.1f s ago: stopping the job", self._first_failed,
                            self.grace)
                self._stop(now)
        elif not self._killing and (len(self._received) > self._signals_at_stop
                                    or now >= self._kill_at):
            self._kill()

    def _stop(self, now: float) -> None:
        """SIGTERM to the job (hydra forwards it to every rank); SIGKILL ``kill_after`` later."""
        self._kill_at = now + self.kill_after
        for status in self.ranks:
            if not status.known:
                status.stopped = True
                self._stopped += 1
        self._signals_at_stop = len(self._received)  # one more from now on: kill at once
        assert self._proc is not None
        send_signal(self._proc.pid, signal.SIGTERM)

    def _kill(self) -> None:
        assert self._proc is not None
        logger.info("killing what is left of the job")
        self._killing = True
        if self._proc.poll() is None:
            self._killed += send_signal(self._proc.pid, signal.SIGKILL)
        self._killed += self._sweep()

    # ------------------------------------------------------------------ the ranks
    def _marker(self, rank: int, fields: dict[str, int]) -> None:
        if not 0 <= rank < self.n:
            return
        if "pid" in fields:
            assert self._proc is not None
            start = local_wrapper(fields["pid"], self._proc.pid)
            if start is not None:
                self._local[fields["pid"]] = start
            return
        status = self.ranks[rank]
        if "mpi" in fields:
            status.started_mpi = True
        else:
            status.code, status.signal = fields.get("code"), fields.get("signal")
        if any(s.started_mpi for s in self.ranks):  # an MPI job: every rank must start MPI
            for other in self.ranks:
                other.never_started = other.code == 0 and not other.started_mpi
        for other in (status, *self.ranks):
            if other.failed and not other.stopped and self._first_failed is None \
                    and self._kill_at is None and not self._received:
                logger.info("rank %d ended: %s", other.rank, other.describe())
                self._first_failed = other.rank
                self._stop_at = time.monotonic() + self.grace

    def _sweep(self) -> int:
        """SIGKILL every process left in a rank's process group on this host."""
        if not self._local:
            return 0
        killed = 0
        for pid, pgrp, start in processes():
            if pgrp in self._local and start >= self._local[pgrp] and pid != os.getpid():
                killed += send_signal(pid, signal.SIGKILL)
        return killed

    def _status(self, launcher: int) -> int:
        if self._received:
            return 128 + self._received[0]
        if self._first_failed is not None:
            return self.ranks[self._first_failed].exit_status or 1
        failed = [s for s in self.ranks if s.failed and not s.stopped]
        if failed:
            return failed[0].exit_status or 1
        if launcher:
            return launcher if launcher > 0 else 128 - launcher
        return 0


def supervise(command: Sequence[str], n: int, *, max_restarts: int = 0,
              min_ranks: int | None = None, env: Mapping[str, str] | None = None,
              on_restart: Callable[[JobResult, int], Any] | None = None,
              **options: Any) -> JobResult:
    """Run ``command`` on ``n`` ranks, relaunching the whole job after a failure at most
    ``max_restarts`` times (see the module docstring); the result of the last attempt.
    ``on_restart(result, ranks)`` is called before each relaunch with the failed attempt's
    result and the next attempt's rank count. ``options``: those of :class:`Supervisor`."""
    base = dict(os.environ if env is None else env)
    received: list[int] = []
    with handling(STOP_SIGNALS, received.append):
        attempt = 0
        while True:
            result = Supervisor(command, n, env={**base, RESTART_COUNT: str(attempt)},
                                received=received, append_logs=attempt > 0, **options).run()
            result.attempt = attempt
            if received and result.received is None:  # arrived as the job ended
                result.received, result.status = received[0], 128 + received[0]
            if result.status == 0 or result.received is not None or attempt >= max_restarts:
                return result
            n = next_ranks(result, min_ranks)
            if on_restart is not None:
                on_restart(result, n)
            attempt += 1
            if received:  # a stop signal while the failed job's outcome was handled
                result.received, result.status = received[0], 128 + received[0]
                return result


def next_ranks(result: JobResult, min_ranks: int | None) -> int:
    """The rank count after ``result`` failed: the same without ``min_ranks``; else less the
    failed ranks (see the module docstring), at least ``min_ranks``."""
    n = len(result.ranks)
    if min_ranks is None:
        return n
    failed = {s.rank for s in result.ranks if s.signal is not None and not s.stopped}
    if result.first_failed is not None:
        failed.add(result.first_failed)
    return max(min_ranks, n - len(failed))


__all__ = ["JobResult", "RESTART_COUNT", "RankStatus", "STOP_SIGNALS", "Supervisor",
           "next_ranks", "supervise"]
