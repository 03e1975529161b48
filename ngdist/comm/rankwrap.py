"""The process mpiexec starts for each rank under ``ngdist run``: it runs the rank's command
and tells the supervisor (comm/supervisor.py) how that command ended.

``python -I .../ngdist/comm/rankwrap.py -- CMD ARGS...``

- Markers. Before the command starts, the wrapper writes ``MARKER {"pid": P}`` on its
  stderr; after the command ended, ``MARKER {"code": C}`` (exit status) or
  ``MARKER {"signal": S}`` (killed by a signal), each as one line. mpiexec forwards them with
  the rank's output, labelled with the rank, so the supervisor learns of a failed rank at once,
  on every host, without shared files. The supervisor takes them out of the output.
- The command inherits every file descriptor (the PMI socket of MPI's start-up among them),
  stdin, stdout and stderr: its output reaches mpiexec as if there were no wrapper.
- Signals. The command runs in the wrapper's process group, so what hydra sends to a rank
  reaches the command and its children directly: hydra signals the whole group (SIGTERM
  forwarded from ``mpiexec``, SIGUSR1 when a peer failed under ``-disable-auto-cleanup``,
  SIGKILL on MPI_Abort). The wrapper never dies of a catchable signal (SIGUSR1's default action
  would end it): SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 from its parent, the
  hydra proxy, are left to the command, which has them already; from anyone else (``kill`` on
  the wrapper's pid) they are forwarded to the command, once. (A signal sent to the wrapper's
  whole process group by someone else reaches the command twice.) The command dies with the
  wrapper (Linux parent-death signal), so a killed wrapper leaves no orphan.
- Exit status: the command's own, or 128 + the signal that killed it (as a shell reports it).
- Environment: torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``
  from hydra's ``PMI_RANK``, ``MPI_LOCALRANKID``, ``PMI_SIZE`` and ``MPI_LOCALNRANKS``
  (``TORCHRUN_VARIABLES``), replacing any inherited value; ``NGDIST_SUPERVISED=1``;
  ``PYTHONFAULTHANDLER=1`` unless set: a rank killed by SIGSEGV, SIGFPE, SIGBUS or SIGILL
  inside a native library (an onnxruntime kernel) prints its Python stack before it dies.

Standard library only, run as a file (``-I``): a rank pays no import of ngdist for it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable

MARKER = b"\x07ngdist-rankwrap "
# "1" in the command's environment: a supervisor stops the job when a rank fails, so a rank
# that ends with a non-zero status exits with it (comm/exits.py) instead of MPI_Abort
SUPERVISED_ENV = "NGDIST_SUPERVISED"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1
TORCHRUN_VARIABLES = {"RANK": "PMI_RANK", "LOCAL_RANK": "MPI_LOCALRANKID",
                      "WORLD_SIZE": "PMI_SIZE", "LOCAL_WORLD_SIZE": "MPI_LOCALNRANKS"}


def marker(**fields: int) -> bytes:
    """One marker line (see the module docstring)."""
    return MARKER + json.dumps(fields, separators=(",", ":")).encode() + b"\n"


def parse_marker(line: bytes) -> dict[str, int] | None:
    """The fields of a marker line (the marker may follow other text), else None."""
    at = line.find(MARKER)
    if at < 0:
        return None
    try:
        fields = json.loads(line[at + len(MARKER):].decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(fields, dict) or not all(isinstance(v, int) for v in fields.values()):
        return None
    return fields


def torchrun_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with torchrun's variables set from hydra's (see the module docstring)."""
    return {**env, **{name: env[pmi] for name, pmi in TORCHRUN_VARIABLES.items() if pmi in env}}


def _write(data: bytes) -> None:
    try:
        os.write(2, data)
    except OSError:
        pass


def _child_setup(parent: int, mask: set[signal.Signals]) -> Callable[[], None]:
    """What the command runs before exec: the signal mask the wrapper had, and SIGKILL when
    the wrapper dies."""
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the wrapper died before the line above
                os._exit(1)
    return setup


def run(command: list[str]) -> int:
    """Run ``command`` as described in the module docstring; its exit status."""
    waited = {*FORWARDED, signal.SIGCHLD}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    _write(marker(pid=os.getpid()))
    try:
        child = subprocess.Popen(command, close_fds=False,
                                 env={"PYTHONFAULTHANDLER": "1", **torchrun_env(
                                     dict(os.environ)), SUPERVISED_ENV: "1"},
                                 preexec_fn=_child_setup(os.getpid(), mask))
    except OSError as exc:
        code = 126 if isinstance(exc, PermissionError) else 127
        _write(f"ngdist: error: cannot run {command[0]}: {exc.strerror or exc}\n".encode())
        _write(marker(code=code))
        return code
    while child.poll() is None:
        info = signal.sigtimedwait(waited, 0.5)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        # hydra signals the whole process group, so the command has it already
        if info.si_pid != os.getppid():
            try:
                child.send_signal(info.si_signo)
            except OSError:
                pass
    status = child.returncode
    if status < 0:
        _write(marker(signal=-status))
        return 128 - status
    _write(marker(code=status))
    return status


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        _write(b"usage: rankwrap.py -- CMD ARGS...\n")
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
