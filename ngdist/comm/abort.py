"""Ending the whole MPI job from one rank: :func:`abort_job` (the message, the line that names
the aborting rank, then MPI_Abort once the launcher has read this rank's output) and the
``sys.excepthook`` that turns an uncaught exception on one rank into that abort."""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

from ngdist.comm.rank_output import ABORT_LINE


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
    """Print ``message`` and the line that announces the abort (``ABORT_LINE``) on stderr,
    then end the whole MPI job with MPI_Abort.

    mpiexec (hydra) exits as soon as it handles the abort and drops whatever output of this
    rank it has not forwarded yet, so the message could vanish. Before aborting, wait (at most
    ``drain_s``) until the launcher has read everything from this process's stdout and stderr
    pipes; what it has read it forwards ahead of the abort request. MPICH's own line about
    the abort is printed inside MPI_Abort, after that wait, and a loaded machine sometimes
    loses it; the announcement is what tells the launcher which rank aborted, with what code.
    """
    sys.stderr.write(message + ABORT_LINE.format(rank=world.Get_rank(), code=code))
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

    def hook(exc_type, exc, tb):  # pragma: no cover - runs at interpreter exit
        from ngdist.errors import NgdistError

        rank = world.Get_rank()
        if isinstance(exc, NgdistError):
            text = f"ngdist: error on rank {rank}: {exc_type.__name__}: {exc}\n"
        else:
            text = (f"ngdist: uncaught exception on rank {rank}:\n"
                    + "".join(traceback.format_exception(exc_type, exc, tb)))
        abort_job(world, text)

    sys.excepthook = hook
