"""How ngdist launches ranks: the mpiexec of the mpich wheel, with ngdist's flags.

``-disable-auto-cleanup``: by default MPICH's hydra kills every rank as soon as one exits
without finalizing MPI, and if that rank's status was 0 the whole job "succeeds" silently.
With the flag, the survivors keep running until ngdist's collective timeout fires, and they
exit with an error that names the op that could not complete (then MPI_Abort ends the job).
``ngdist run`` does not leave them waiting that long: its supervisor (comm/supervisor.py) stops
the job a few seconds after a rank failed.

Slurm: inside an allocation (``salloc``, ``sbatch``: ``SLURM_JOB_ID`` is set) hydra starts its
proxies with ``srun``, one per node of the allocation, and takes the nodes and their task
counts from Slurm (``HYDRA_LAUNCHER=slurm``, ``HYDRA_RMK=slurm``: ``slurm_env``); the ranks are
still MPICH's, so nothing depends on the PMI Slurm was built with.
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


SLURM_LAUNCH = {"HYDRA_LAUNCHER": "slurm", "HYDRA_RMK": "slurm"}


@dataclass(frozen=True)
class SlurmAllocation:
    """The Slurm job ``ngdist run`` was started in."""

    job: str
    tasks: int   # SLURM_NTASKS (salloc/sbatch -n), else one per node
    nodes: str   # SLURM_JOB_NODELIST, in Slurm's compressed form (node[1-4])


def slurm_allocation(env: Mapping[str, str]) -> SlurmAllocation | None:
    """The allocation ``env`` is inside, or None when it is not a Slurm job."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        return None
    raw = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or env.get("SLURM_JOB_NUM_NODES")
    try:
        tasks = int(raw or 1)
    except ValueError:
        raise NgdistError(f"inside Slurm job {job}, SLURM_NTASKS={raw!r} is not a number; "
                          "give the rank count with -n") from None
    return SlurmAllocation(job, tasks, env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                           or "?")


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for an mpiexec that launches through Slurm (see the module docstring)."""
    if shutil.which("srun", path=env.get("PATH", os.defpath)) is None:
        raise NgdistError("inside a Slurm job (SLURM_JOB_ID is set) but no srun on PATH: add "
                          "Slurm's bin folder to PATH, or give --hostfile/--hosts to launch "
                          "over ssh instead")
    return {**env, **SLURM_LAUNCH}
