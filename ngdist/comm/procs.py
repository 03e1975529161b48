"""The supervisor's view of processes on this host: signals, the parent-death signal of
mpiexec, which processes are this job's rank wrappers (from ``/proc``, through
``group.proc_stat``)."""
from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ngdist.comm.group import proc_stat

_PR_SET_PDEATHSIG = 1


def send_signal(pid: int, sig: int) -> int:
    try:
        os.kill(pid, sig)
    except OSError:
        return 0
    return 1


@contextmanager
def handling(signals: Sequence[int], record: Callable[[int], Any]) -> Iterator[None]:
    """Record ``signals`` instead of dying of them (main thread only: elsewhere Python cannot
    install handlers, and the caller keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda s, _f: record(s)) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def die_with_parent() -> Callable[[], None] | None:
    """mpiexec gets SIGTERM when the supervisor's thread dies (Linux). Only for a
    single-threaded launcher: Python code between fork and exec is unsafe with threads."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
    return setup


def local_wrapper(pid: int, mpiexec: int) -> int | None:
    """The start time of ``pid`` if it is a rank wrapper of this job on this host (its parent,
    the hydra proxy, is a child of our mpiexec), else None."""
    fields = proc_stat(pid)
    if fields is None:
        return None
    proxy = proc_stat(int(fields[1]))
    if proxy is None or int(proxy[1]) != mpiexec:
        return None
    return int(fields[19])


def processes() -> Iterator[tuple[int, int, int]]:
    """(pid, process group, start time) of every live process this host shows."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if name.isdigit():
            fields = proc_stat(int(name))
            if fields is not None and fields[0] not in ("Z", "X"):
                yield int(name), int(fields[2]), int(fields[19])
