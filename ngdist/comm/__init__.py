"""Communication: the process groups every collective goes through, and the launcher.

``world_group()`` is this process's group over every rank of the job: an ``MpiGroup`` when the
process was started by mpiexec (``ngdist run``), else a ``LocalGroup`` of one rank. Only this
package imports mpi4py.
"""
from __future__ import annotations

from ngdist.comm.group import DoneWork, ProcessGroup, Work, default_timeout, describe
from ngdist.comm.local import LocalGroup


def world_rank_size() -> tuple[int, int]:
    """(rank, size) of this process in its job; (0, 1) when not launched by mpiexec."""
    from ngdist.comm.mpi import launched_by_mpi, world_rank_size as mpi_rank_size

    return mpi_rank_size() if launched_by_mpi() else (0, 1)


def world_group(timeout: float | None = None) -> ProcessGroup:
    """The group of every rank of this job (see the module docstring)."""
    if world_rank_size()[1] > 1:
        from ngdist.comm.mpi import MpiGroup

        return MpiGroup(timeout)
    return LocalGroup(timeout)


def abort_world(message: str, code: int = 1) -> None:
    """Print ``message`` and end the whole job (MPI_Abort); for errors outside any Work."""
    from ngdist.comm.abort import abort_job
    from ngdist.comm.mpi import _mpi, launched_by_mpi

    if not launched_by_mpi():
        raise SystemExit(code)
    abort_job(_mpi().COMM_WORLD, message, code)


__all__ = ["DoneWork", "LocalGroup", "ProcessGroup", "Work", "abort_world", "default_timeout",
           "describe", "world_group", "world_rank_size"]
