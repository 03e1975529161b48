"""How a rank's program ends, as its peers and the launcher see it.

A multi-rank job must end within seconds however one rank's program ends (comm/mpi.py's
``_finalize_at_exit`` and excepthook; ARCHITECTURE.md "How a rank ends"). Two facts are
needed there that Python does not offer, and this module (standard library only) provides:

- The status the interpreter exits with. An uncaught ``SystemExit`` never reaches
  ``sys.excepthook``: Python reads its ``code`` and runs the ``atexit`` handlers without
  saying why it exits. :func:`track` replaces ``sys.exit`` and ``builtins.SystemExit`` by
  a subclass of ``SystemExit`` (same name, caught by every ``except SystemExit``) whose
  ``code``, when the interpreter reads it with no Python frame above (its way out), is
  recorded (and an uncaught exception, by an excepthook that calls the previous one);
  :func:`exit_status` then says how the program ends: 0 for a return or ``sys.exit(0)``,
  the code of ``sys.exit(3)``, 1 and the text of ``SystemExit("msg")`` or of the exception.
- Which peers have ended their program and only wait at the end of the job. A rank whose
  program ended with status 0 names its main thread :data:`AT_EXIT_NAME`
  (``/proc/self/comm``) while it waits for the others to finish; a peer on this host that
  waits in any other collective sees that name (:func:`at_exit`) and fails within seconds,
  naming it, instead of waiting for the timeout. Ranks on other hosts are not visible: there
  the collective timeout bounds the wait.

:func:`note_step` lets the trainer say which step this rank is in, so that such a failure
in a step can say "rank 1 ran out of data after 7 steps" and point to ``trainer.join()``.

A rank that runs out of data may also go on to another collective (an evaluation, a barrier)
instead of ending: then it and the ranks still stepping wait for each other. A rank whose wait
has been pending for a while (the dead-peer check) writes a wait record,
``/dev/shm/ngdist-wait-PID`` (when, its step, its steps done, lockstep; mapped by its rank, so
the launcher's sweep of left-over files spares it), refreshed every 0.4 s;
a rank waiting in a step of a lockstep trainer (allreduce: every rank takes every step) that
finds a peer's fresh record outside that step counts the peer as gone (:func:`astray`), and
the job fails within seconds with a message naming it. Ranks between two waits have no fresh
record, so a rank that is merely slow (loading data, saving) is never counted.
"""
from __future__ import annotations

import builtins
import mmap
import os
import sys
import threading
import time
from typing import Any, NoReturn

from ngdist.comm.rankwrap import SUPERVISED_ENV, marker

AT_EXIT_NAME = "ngdist-at-exit"  # the main thread's name while its rank waits at the end
JOIN_HINT = ("When the ranks have different numbers of batches, step inside "
             "`with trainer.join():` (a rank that runs out answers the others' steps until "
             "every rank is done)")

_lock = threading.Lock()
_tracked = False
_exit_code: list[Any] = []  # the SystemExit code the interpreter read on its way out
# this rank's multi-rank trainer: the step it is in (0: none), the steps done, lockstep
_step: list[Any] = [0, 0, False]
_published = [0.0]  # when this rank last wrote its wait record
_record: list[mmap.mmap] = []  # the wait record, mapped (once written)
RECORD_BYTES = 64
WAIT_DIR = "/dev/shm"  # wait records ngdist-wait-PID (the launcher sweeps ngdist-* files)
FRESH_S = 1.5  # a wait record older than this is of a wait that has completed
_CODE = SystemExit.__dict__["code"]  # the built-in exception's own member


class _TrackedSystemExit(SystemExit):
    """``SystemExit`` that records its code when the interpreter reads it as it exits."""

    @property  # type: ignore[override]
    def code(self) -> Any:
        code = _CODE.__get__(self)
        try:
            sys._getframe(1)
        except ValueError:  # no Python caller: the interpreter's own exit handling
            _exit_code[:] = [code]
        return code

    @code.setter
    def code(self, value: Any) -> None:
        _CODE.__set__(self, value)


_TrackedSystemExit.__name__ = _TrackedSystemExit.__qualname__ = "SystemExit"
_TrackedSystemExit.__module__ = "builtins"


class _Uncaught(str):
    """The text of the uncaught exception the program ends with (status 1)."""


def _exit(*args: Any) -> NoReturn:
    """``sys.exit``, raising the tracked ``SystemExit``."""
    raise _TrackedSystemExit(*args[:1])


def track() -> None:
    """Record the code of the ``SystemExit`` the interpreter ends with (idempotent)."""
    global _tracked
    with _lock:
        if _tracked:
            return
        _tracked = True
        sys.exit = _exit
        builtins.SystemExit = _TrackedSystemExit  # type: ignore[misc]
        previous = sys.excepthook

        def hook(exc_type: Any, exc: Any, tb: Any) -> None:  # an uncaught exception: status 1
            _exit_code[:] = [_Uncaught(f"{exc_type.__name__}: {exc}")]
            previous(exc_type, exc, tb)

        sys.excepthook = hook


def exit_status() -> tuple[int, str]:
    """(status, how) of the program's end as the interpreter exits: ``(0, "returned")``,
    ``(3, "SystemExit(3)")``, ``(1, "SystemExit: msg")``, as Python computes the status."""
    if not _exit_code:
        return 0, "its program returned"
    code = _exit_code[0]
    if isinstance(code, _Uncaught):
        return 1, str(code)
    if code is None:
        return 0, "SystemExit(None)"
    if isinstance(code, int):
        return int(code) & 0xFF, f"SystemExit({code!r})"
    return 1, f"SystemExit: {code}"


def starting_mpi() -> None:
    """Tell the supervisor that this rank starts MPI (a marker line, comm/rankwrap.py): a
    rank that exits 0 without starting MPI while others did fails the job, which would
    otherwise wait in MPI's start-up for ever."""
    if supervised():
        try:
            os.write(2, marker(mpi=1))
        except OSError:
            pass


def supervised() -> bool:
    """Whether this rank runs under ``ngdist run``'s supervisor (comm/supervisor.py)."""
    return os.environ.get(SUPERVISED_ENV) == "1"


def mark_at_exit() -> None:
    """Say to the peers on this host that this rank's program has ended (status 0)."""
    try:
        with open("/proc/self/comm", "w") as fh:
            fh.write(AT_EXIT_NAME)
    except OSError:  # no /proc: the peers' waits are bounded by the timeout
        pass


def at_exit(pid: int) -> bool:
    """Whether process ``pid`` is a rank whose program has ended and that waits at exit."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return False
    name, _, rest = text.partition("(")[2].rpartition(")")
    return name == AT_EXIT_NAME and rest.split()[:1] not in (["Z"], ["X"])


def note_step(step: int, done: int = 0, lockstep: bool = False) -> None:
    """What this rank's (multi-rank) trainer is doing: in step ``step`` (0: between steps),
    ``done`` steps taken, ``lockstep`` when every rank takes every step (allreduce)."""
    _step[:] = [step, done, lockstep]


def _wait_path(pid: int) -> str:
    return os.path.join(WAIT_DIR, f"ngdist-wait-{pid}")


def publish_blocked() -> None:
    """Called while a wait of this rank has been pending for a while (the dead-peer check):
    tell the peers on this host what this rank is doing (:func:`astray`); refreshed at most
    every 0.4 s, stale after ``FRESH_S``."""
    now = time.time()
    if now - _published[0] < 0.4:
        return
    _published[0] = now
    step, done, lockstep = _step
    record = f"{now:.3f} {step} {done} {int(lockstep)}".encode().ljust(RECORD_BYTES)
    try:
        if not _record:  # mapped for as long as this process lives: the launcher's sweep of
            # /dev/shm (comm/leftovers.py) leaves a live rank's record alone
            fd = os.open(_wait_path(os.getpid()), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, RECORD_BYTES)
                _record.append(mmap.mmap(fd, RECORD_BYTES))
            finally:
                os.close(fd)
        _record[0][:RECORD_BYTES] = record[:RECORD_BYTES]
    except (OSError, ValueError):
        pass


def _blocked(pid: int) -> tuple[int, int, bool] | None:
    """(step, done, lockstep) of a peer that has been waiting within the last ``FRESH_S``."""
    try:
        with open(_wait_path(pid), "rb") as fh:
            when, step, done, lockstep = fh.read().split()
        if time.time() - float(when) > FRESH_S:
            return None
        return int(step), int(done), lockstep == b"1"
    except (OSError, ValueError):
        return None


def astray(pid: int) -> bool:
    """Whether a peer that this rank waits for in a lockstep step is itself blocked in a
    collective outside that step: it stopped stepping (ran out of data) and the two wait for
    each other until the timeout."""
    step, _, lockstep = _step
    if not (step and lockstep):
        return False
    peer = _blocked(pid)
    return peer is not None and peer[2] and peer[0] != step


def forget() -> None:
    """Remove this rank's wait record (at exit)."""
    try:
        os.unlink(_wait_path(os.getpid()))
    except OSError:
        pass


def astray_message(what: str, rank: int, who: list[str], pids: list[int]) -> str:
    """Why a wait of rank ``rank`` in a step cannot complete: ranks ``who`` wait elsewhere."""
    step = _step[0]
    states = [_blocked(pid) for pid in pids]
    done = sorted({s[1] for s in states if s is not None and s[0] == 0})
    where = (f"ran out of data after {', '.join(map(str, done))} step(s): it waits in a "
             "collective outside any step" if done else "is in another step")
    return (f"{', '.join(who)} {where} while rank {rank} waits for it in step {step} "
            f"({what}); the two would wait for each other until the timeout. {JOIN_HINT}")


def at_exit_message(what: str, rank: int, who: list[str]) -> str:
    """Why a wait of rank ``rank`` cannot complete: ranks ``who`` have ended their program."""
    names = ", ".join(who)
    step, done = _step[0], _step[1]
    if step:
        return (f"{names} ran out of data after {done} step(s): it ended its program (exit "
                f"status 0) while rank {rank} waits for it in step {step} ({what}). "
                + JOIN_HINT)
    return (f"{names} ended its program (exit status 0: it returned or called sys.exit(0)) "
            f"while rank {rank} waits for it in {what}; every rank must make the same "
            "collective calls in the same order (look at that rank's program and output for "
            "why it ended early)")
