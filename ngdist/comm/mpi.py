"""The communicator: MPI world (or one local rank), timeouts, start-up agreement checks."""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

from ngdist.errors import CommError, CommTimeoutError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = float(os.environ.get("NGDIST_TIMEOUT", "300"))
WAIT_MODE = os.environ.get("NGDIST_WAIT", "watchdog")
# a wait pending this long whose peer process on this host has been gone this long fails
DEAD_CHECK_AFTER_S = 1.0
DEAD_GRACE_S = 2.0


def _mpi():
    from mpi4py import MPI

    return MPI


def world_rank_size() -> tuple[int, int]:
    """(rank, size) of this process; (0, 1) when not launched by mpiexec."""
    if not _launched_by_mpi():
        return 0, 1
    world = _mpi().COMM_WORLD
    return world.Get_rank(), world.Get_size()


def _launched_by_mpi() -> bool:
    keys = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
            "HYDI_CONTROL_FD", "PMI_FD")
    return any(k in os.environ for k in keys)


class Communicator:
    """Rank, size and the waits of every collective, each bounded by ``timeout`` seconds."""

    def __init__(self, timeout: float | None = None, backend: str | None = None) -> None:
        self.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        rank, size = world_rank_size()
        self.world: Any = _mpi().COMM_WORLD if size > 1 else None
        self.rank, self.size = rank, size
        self.backend = backend or ("mpi" if size > 1 else "local")
        self.bytes_sent = 0
        self.local_size = 1
        self._watchdog = _Watchdog()
        self.local_pids: dict[int, int] = {}  # rank -> pid, for ranks whose pids we can see
        if self.world is not None:
            MPI = _mpi()
            self.local_size = self.world.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
            install_abort_hook(self.world)
            self._exchange_pids()

    def _exchange_pids(self) -> None:
        """Learn the process id of every rank that runs under this kernel and in this PID
        namespace, so that a wait on a rank whose process has gone fails at once."""
        mine = np.zeros(3, np.int64)
        mine[0] = os.getpid()
        mine[1:] = np.frombuffer(_process_space(), np.int64)
        table = np.empty((self.size, 3), np.int64)
        self.wait(self.world.Iallgather(mine, table), "start-up exchange of process ids")
        self.local_pids = {r: int(table[r, 0]) for r in range(self.size)
                           if r != self.rank and np.array_equal(table[r, 1:], mine[1:])}

    def gone(self, peers: list[int] | None) -> list[int]:
        """The ranks among ``peers`` (all ranks when None) whose process is known to have
        exited (only ranks on this host can be checked)."""
        ranks = range(self.size) if peers is None else peers
        return [r for r in ranks if r in self.local_pids and not _alive(self.local_pids[r])]

    def gone_message(self, what: Any, dead: list[int]) -> str:
        pids = ", ".join(f"rank {r} (pid {self.local_pids[r]})" for r in dead)
        return (f"{_describe(what)} cannot complete on rank {self.rank}: the process of {pids} "
                "has exited. Look at that rank's output for why it stopped")

    # ------------------------------------------------------------------ waits
    def timeout_message(self, what: Any, peers: list[int] | None = None) -> str:
        who = f"peers {peers}" if peers is not None else f"ranks 0..{self.size - 1}"
        return (f"{_describe(what)} did not complete within {self.timeout:g} s on rank {self.rank} (waiting for {who}); a rank has "
                "probably died or is running a different program. Check the other ranks' "
                "output; raise the limit with timeout= or NGDIST_TIMEOUT")

    def wait(self, request: Any, what: Any, peers: list[int] | None = None) -> None:
        """Wait for an MPI request, bounded by the timeout.

        Default ("watchdog"): a blocking MPI Wait (MPI's own progress engine, much faster than
        polling) while a watchdog thread watches the deadline; past it, the watchdog prints the
        CommTimeoutError message and aborts the MPI job, since a blocked MPI call cannot be
        interrupted. With NGDIST_WAIT=poll the request is polled instead and CommTimeoutError is
        raised in this thread (slower for large messages).
        """
        if request.Test():
            return
        if WAIT_MODE == "poll":
            self._poll(request, what, peers)
            return
        token = self._watchdog.arm(self, what, peers)
        try:
            request.Wait()
        finally:
            self._watchdog.disarm(token)

    def _poll(self, request: Any, what: Any, peers: list[int] | None) -> None:
        start = time.monotonic()
        deadline = start + self.timeout
        spin_until = start + 0.002
        next_check, dead_since = start + DEAD_CHECK_AFTER_S, None
        while not request.Test():
            now = time.monotonic()
            if now > deadline:
                raise CommTimeoutError(self.timeout_message(what, peers))
            if now > next_check:
                next_check = now + 0.5
                dead = self.gone(peers)
                dead_since = (dead_since or now) if dead else None
                if dead and now - dead_since >= DEAD_GRACE_S:
                    raise CommError(self.gone_message(what, dead))
            time.sleep(0 if now < spin_until else 0.0002)

    # ------------------------------------------------------------------ start-up checks
    def check_same(self, payload: bytes, what: str) -> None:
        """Every rank must hold the same ``payload`` (compared by SHA-256), else CommError."""
        if self.world is None:
            return
        digest = np.frombuffer(hashlib.sha256(payload).digest(), dtype=np.uint8).copy()
        table = np.empty((self.size, digest.size), np.uint8)
        self.wait(self.world.Iallgather(digest, table), f"start-up check of the {what}")
        differ = [r for r in range(self.size) if not np.array_equal(table[r], table[0])]
        if differ:
            raise CommError(
                f"ranks {differ} hold a different {what} than rank 0 (sha256 "
                f"{table[0].tobytes().hex()[:12]} on rank 0, {table[differ[0]].tobytes().hex()[:12]}"
                f" on rank {differ[0]}); start every rank with the same model and options")

    def broadcast_(self, arrays: list[np.ndarray], root: int = 0,
                   what: str = "initial broadcast of parameters") -> None:
        """In-place broadcast of every array from ``root`` (one message per dtype)."""
        if self.world is None or not arrays:
            return
        by_dtype: dict[np.dtype, list[np.ndarray]] = {}
        for a in arrays:
            by_dtype.setdefault(a.dtype, []).append(a)
        for dtype, group in by_dtype.items():
            buf = np.concatenate([a.reshape(-1) for a in group])
            self.wait(self.world.Ibcast(buf, root=root), what)
            if self.rank == root:
                continue
            offset = 0
            for a in group:
                a.reshape(-1)[...] = buf[offset:offset + a.size]
                offset += a.size

    def barrier(self) -> None:
        if self.world is not None:
            self.wait(self.world.Ibarrier(), "barrier")


def _describe(what: Any) -> str:
    """``ngdist.AllReduce 'name'`` for a comm node, ``'label'`` for anything else."""
    op = getattr(what, "op_type", "")
    return f"{('ngdist.' + op + ' ') if op else ''}'{getattr(what, 'name', str(what))}'"


def _process_space() -> bytes:
    """16 bytes that are equal for two processes exactly when each can see the other's pid:
    same kernel boot, same PID namespace, same host name."""
    import socket

    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            parts.append(fh.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append(f"no-proc-{os.getpid()}")  # nothing to compare: never "same host"
    return hashlib.sha256("|".join(parts).encode()).digest()[:16]


def _alive(pid: int) -> bool:
    """False once the process has exited (gone, or a zombie its launcher has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _unread_bytes(fd: int) -> int:
    """Bytes written to ``fd`` that its reader has not taken yet (pipes and sockets), else 0."""
    import fcntl
    import stat
    import struct
    import termios

    try:
        if not (stat.S_ISFIFO(os.fstat(fd).st_mode) or stat.S_ISSOCK(os.fstat(fd).st_mode)):
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ImportError):
        return 0


def abort_job(world: Any, message: str, code: int = 1, drain_s: float = 3.0) -> None:
    """Print ``message`` on stderr, then end the whole MPI job with MPI_Abort.

    mpiexec (hydra) exits as soon as it handles the abort and drops whatever output of this
    rank it has not forwarded yet, so the message could vanish. Before aborting, wait (at most
    ``drain_s``) until the launcher has read everything from this process's stdout and stderr
    pipes; what it has read it forwards ahead of the abort request.
    """
    sys.stderr.write(message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + drain_s
    while time.monotonic() < deadline and (_unread_bytes(1) or _unread_bytes(2)):
        time.sleep(0.01)
    time.sleep(0.05)
    world.Abort(code)


class _Watchdog:
    """One daemon thread that aborts the MPI job when an armed wait passes its deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, Communicator, Any, list[int] | None, float]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def arm(self, comm: Communicator, what: Any, peers: list[int] | None) -> int:
        with self._lock:
            self._next += 1
            now = time.monotonic()
            self._armed[self._next] = (now + comm.timeout, comm, what, peers, now)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ngdist-watchdog",
                                                daemon=True)
                self._thread.start()
            return self._next

    def disarm(self, token: int) -> None:
        with self._lock:
            self._armed.pop(token, None)

    def _run(self) -> None:  # pragma: no cover - exercised in multi-rank tests
        next_check = 0.0
        gone_since: dict[int, float] = {}  # token -> when a peer of that wait was seen gone
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            with self._lock:
                armed = dict(self._armed)
            expired = next((v for v in armed.values() if v[0] < now), None)
            if expired is not None:  # aborts the job: this thread goes no further
                _, comm, what, peers, _ = expired
                _abort(comm, "CommTimeoutError", comm.timeout_message(what, peers))
            if now < next_check:
                continue
            next_check = now + 0.5
            for token in set(gone_since) - set(armed):
                del gone_since[token]
            for token, (_, comm, what, peers, start) in armed.items():
                dead = comm.gone(peers) if now - start >= DEAD_CHECK_AFTER_S else []
                if not dead:
                    gone_since.pop(token, None)
                    continue
                with self._lock:
                    pending = token in self._armed  # not completed meanwhile
                if pending and now - gone_since.setdefault(token, now) >= DEAD_GRACE_S:
                    _abort(comm, "CommError", comm.gone_message(what, dead))


def _abort(comm: Communicator, kind: str, message: str) -> None:
    abort_job(comm.world, f"ngdist: error on rank {comm.rank}: {kind}: {message}\n"
                          f"ngdist: rank {comm.rank} aborts the MPI job\n")


_hook_lock = threading.Lock()
_hook_installed = False


def install_abort_hook(world: Any) -> None:
    """An uncaught exception on one rank aborts the whole MPI job instead of leaving the
    other ranks blocked; the message is printed first, with the rank."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # pragma: no cover - runs at interpreter exit
        from ngdist.errors import NgdistError

        rank = world.Get_rank()
        if isinstance(exc, NgdistError):
            text = f"ngdist: error on rank {rank}: {exc_type.__name__}: {exc}\n"
        else:
            text = (f"ngdist: uncaught exception on rank {rank}:\n"
                    + "".join(traceback.format_exception(exc_type, exc, tb)))
        abort_job(world, text + f"ngdist: rank {rank} aborts the MPI job\n")

    sys.excepthook = hook
    del previous
