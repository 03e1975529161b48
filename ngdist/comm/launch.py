"""How ngdist launches ranks: the mpiexec of the mpich wheel, with ngdist's flags.

``-disable-auto-cleanup``: by default MPICH's hydra kills every rank as soon as one exits
without finalizing MPI, and if that rank's status was 0 the whole job "succeeds" silently.
With the flag, the survivors keep running until ngdist's collective timeout fires, and they
exit with an error that names the op that could not complete (then MPI_Abort ends the job).
``ngdist run`` does not leave them waiting that long: its supervisor (comm/supervisor.py) stops
the job a few seconds after a rank failed.
"""
from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from ngdist.errors import NgdistError

MPIEXEC_FLAGS = ["-disable-auto-cleanup"]


def mpiexec_path() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise NgdistError("no mpiexec found: install the MPI wheel with `pip install mpich` "
                          "(it puts mpiexec next to this Python)")
    return found


def mpiexec_cmd(n: int, hostfile: str | None = None, hosts: str | None = None, *,
                flags: Sequence[str] = ()) -> list[str]:
    """The command prefix that starts ``n`` ranks; ``flags``: more hydra options (the
    supervisor's ``-prepend-pattern``)."""
    if n < 1:
        raise NgdistError(f"the number of ranks must be at least 1, got {n}")
    cmd = [mpiexec_path(), *MPIEXEC_FLAGS, *flags, "-n", str(n)]
    if hostfile:
        cmd += ["-f", hostfile]
    if hosts:
        cmd += ["-hosts", hosts]
    return cmd
