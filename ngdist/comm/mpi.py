"""MpiGroup: the ProcessGroup on MPI (mpi4py's buffer API on host arrays).

The only module of ngdist that imports mpi4py. Every call is non-blocking (``I*`` calls) and
returns a Work whose wait is bounded by the group's timeout (comm/group.py). At start-up the
ranks all-gather their process ids with a hash of (host name, boot id, PID namespace), so a
wait on a rank whose process on this host has exited fails within seconds, naming it.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import ngdist.comm.shared as shared
import ngdist.comm.exits as exits
from ngdist.comm.abort import abort_job, install_abort_hook
from ngdist.comm.backoff import wait_until
from ngdist.comm.group import (DoneWork, ProcessGroup, ReduceOp, Work, WorkList, alive,
                               default_timeout, describe, divide)
from ngdist.errors import CommError

logger = logging.getLogger(__name__)


def _mpi():
    """mpi4py's MPI module; the first import turns off mpi4py's own MPI_Finalize at exit (it
    waits for every rank with no limit) in favour of :func:`_finalize_at_exit`."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.finalize = False
        exits.starting_mpi()
        from mpi4py import MPI  # noqa: F401  (initialises MPI)

        exits.track()
        atexit.register(_finalize_at_exit)
    return sys.modules["mpi4py.MPI"]


FINALIZE_WHAT = "the end of the job (every rank reaching MPI_Finalize)"


def _finalize_at_exit() -> None:
    """The end of this rank's program in a multi-rank job, never blocking for ever (see
    comm/exits.py and ARCHITECTURE.md "How a rank ends").

    Status 0 (a return, ``sys.exit(0)``): the rank says so to its peers on this host
    (``exits.mark_at_exit``: a peer that waits for it in a collective fails within seconds),
    then waits for every rank in a non-blocking barrier polled against the job's timeout and
    the dead-peer check, then MPI_Finalize. A rank that never made a world group takes part
    in the start-up exchange of process ids first (a peer may be waiting in it).
    Another status (``sys.exit(3)``, ``SystemExit("msg")``): one error line; under
    ``ngdist run`` the process exits with that status without MPI_Finalize (the supervisor
    stops the others), under a bare mpiexec the job ends with MPI_Abort(status)."""
    MPI = sys.modules["mpi4py.MPI"]
    if MPI.Is_finalized() or not MPI.Is_initialized():
        return
    world = MPI.COMM_WORLD
    if world.Get_size() > 1:
        exits.forget()
        rank = world.Get_rank()
        status, how = exits.exit_status()
        if status != 0:
            message = f"ngdist: error on rank {rank}: {how} (exit status {status})\n"
            if exits.supervised():
                sys.stderr.write(message)
                sys.stderr.flush()
                return  # the interpreter exits with ``status``
            abort_job(world, message, status)
            return
        exits.mark_at_exit()
        try:
            if not _WORLD_JOB:
                MpiGroup()  # the start-up exchange a peer may be waiting in
            job = _WORLD_JOB[0]
            group = MpiGroup(job.timeout or default_timeout(), comm=job.exit_comm, job=job)
            group.at_exit = True  # (a barrier of its own: it never meets another collective)
            MpiWork(group, [job.exit_comm.Ibarrier()], FINALIZE_WHAT, None)._poll(0.005)
        except Exception as exc:  # CommTimeoutError / CommError: end the job, do not block
            abort_job(world, f"ngdist: error on rank {rank} at exit: {exc}\n")
            return
    MPI.Finalize()


def world_rank_size() -> tuple[int, int]:
    """(rank, size) of this process; (0, 1) when not launched by mpiexec."""
    if not launched_by_mpi():
        return 0, 1
    world = _mpi().COMM_WORLD
    return world.Get_rank(), world.Get_size()


def launched_by_mpi() -> bool:
    keys = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
            "HYDI_CONTROL_FD", "PMI_FD")
    return any(k in os.environ for k in keys)


class MpiWork(Work):
    """MPI requests; ``then`` (if given) runs once, on the thread that sees them complete."""

    def __init__(self, group: MpiGroup, requests: list[Any], what: Any,
                 peers: Sequence[int] | None, then: Callable[[], None] | None = None) -> None:
        super().__init__(group, what, peers)
        self.requests = requests
        self.then = then

    def test(self) -> bool:
        if self.requests and not _mpi().Request.Testall(self.requests):
            return False
        self._then()
        return True

    def _block(self) -> None:  # (not MPI's Waitall, which spins a core for as long as it waits)
        wait_until(self.test)

    def _then(self) -> None:
        then, self.then = self.then, None
        if then is not None:
            then()


class _Job:
    """What every group of one job shares: the world communicator and the pids of the ranks
    whose process this one can see (world rank -> pid)."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self.local_pids: dict[int, int] = {}
        self.local_size = 1
        self.local_rank = 0
        self.timeout: float | None = None  # the largest timeout its groups were given
        self.exit_comm: Any = world  # the end of the job's barrier: a dup of the world


_WORLD_JOB: list[_Job] = []  # the job of this process's world groups, once known


class MpiGroup(ProcessGroup):
    """A ProcessGroup over an MPI communicator (COMM_WORLD, or a split/dup of it)."""

    backend = "mpi"

    def __init__(self, timeout: float | None = None, *, comm: Any = None, job: _Job | None = None,
                 world_ranks: list[int] | None = None) -> None:
        super().__init__(timeout)
        MPI = _mpi()
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self._one_host: bool | None = None  # every rank on this host (known once asked)
        # the flags the AllReduce through symmetric memory synchronises with (made with the
        # first memory; False where they cannot be made)
        self._signals: shared.Signals | bool | None = None
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        if job is None and _WORLD_JOB:  # another world group of this process: share its job
            job = _WORLD_JOB[0]
            self._job, self._world_ranks = job, list(range(self.size))
            self.local_size, self.local_rank = job.local_size, job.local_rank
        elif job is None:  # the first world group: start-up exchanges, bounded by the timeout
            job = _Job(self.comm)
            install_abort_hook(self.comm)
            self._job = job
            self._world_ranks = list(range(self.size))
            self._exchange_pids()
            job.exit_comm, request = self.comm.Idup()  # the end of the job's own messages
            self._work([request], "start-up: the communicator of the end of the job").wait()
            job.local_size, job.local_rank = self.local_size, self.local_rank
            _WORLD_JOB.append(job)
        else:
            self._job = job
            self._world_ranks = world_ranks or list(range(self.size))
        if timeout is not None:  # the end of the job waits as long as its longest wait
            job.timeout = max(job.timeout or 0.0, self.timeout)

    def world_ranks(self) -> list[int]:
        return self._world_ranks

    def _work(self, requests: list[Any], what: Any, peers: Sequence[int] | None = None) -> MpiWork:
        return MpiWork(self, requests, what, peers)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, buf, what, op="sum", peers=None, placed=None):
        return self.allreduce_coalesced((buf,), what, op, peers, placed=(placed,))

    def allreduce_coalesced(self, bufs, what, op="sum", peers=None, placed=None):
        """Buffers placed in this group's symmetric memory (``placed``) share one pair of
        barriers (comm/shared.py); the others go to MPI's ``Iallreduce``, all started before
        any is waited for."""
        MPI = _mpi()
        op = ReduceOp(op)
        mpi_op = getattr(MPI, "SUM" if op.summed else op.name)
        entries, requests, on_mpi = [], [], []
        for buf, where in zip(bufs, placed or [None] * len(bufs)):
            self.bytes_sent += buf.nbytes
            if where is not None and where.mem.group is self:
                entries.append((where.mem, buf, where.offset))
                continue
            requests.append(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=mpi_op))
            on_mpi.append(buf)
        works: list[Work] = []
        if requests:
            then = None
            if op is ReduceOp.MEAN:
                def then() -> None:
                    for b in on_mpi:
                        divide(b, self.size)
            works.append(MpiWork(self, requests, what, peers, then=then))
        if entries:  # (after MPI's requests: its barriers are collectives too, started later)
            works.append(shared.SharedAllreduceWork(self, entries, what, op, peers,
                                                    self._signals or None))
        if len(works) == 1:
            return works[0]
        return WorkList(self, works, what) if works else DoneWork(self, what, peers)

    def broadcast(self, buf, root, what):
        if self.rank == root:
            self.bytes_sent += buf.nbytes
        return self._work([self.comm.Ibcast(buf, root=root)], what,
                          None if self.rank == root else [root])

    def reduce(self, send, recv, root, what):
        MPI = _mpi()
        self.bytes_sent += 0 if self.rank == root else send.nbytes
        if self.rank == root and send is recv:
            send = MPI.IN_PLACE
        return self._work([self.comm.Ireduce(send, recv, op=MPI.SUM, root=root)], what)

    def allgather(self, send, recv, what):
        self.bytes_sent += recv.nbytes // 2  # half an AllReduce (comm/group.py)
        return self._work([self.comm.Iallgather(send, recv)], what)

    def gather(self, send, recv, root, what):
        self.bytes_sent += 0 if self.rank == root else send.nbytes
        return self._work([self.comm.Igather(send, recv, root=root)], what,
                          None if self.rank == root else [root])

    def reduce_scatter(self, send, recv, what):
        MPI = _mpi()
        self.bytes_sent += send.nbytes // 2  # half an AllReduce (comm/group.py)
        return self._work([self.comm.Ireduce_scatter_block(send, recv, op=MPI.SUM)], what)

    def exchange(self, sends, recvs, tag, what):
        reqs = [self.comm.Irecv(buf, source=src, tag=tag) for buf, src in recvs]
        reqs += [self.comm.Isend(buf, dest=dst, tag=tag) for buf, dst in sends]
        self.bytes_sent += sum(buf.nbytes for buf, _ in sends)
        peers = sorted({p for _, p in sends} | {p for _, p in recvs})
        return self._work(reqs, what, peers)

    def barrier(self, what="barrier"):
        return self._work([self.comm.Ibarrier()], what)

    def _all_present(self, what: Any) -> None:
        """A bounded barrier before a blocking MPI call (Split has no non-blocking form):
        once every rank has reached it, the call that follows completes."""
        self.barrier(what).wait()

    def split(self, color, key, what):
        MPI = _mpi()
        self._all_present(what)
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        return self._wrap(sub)

    def dup(self, what):
        new, req = self.comm.Idup()
        self._work([req], what).wait()
        return self._wrap(new)

    def symmetric(self, nbytes, what):
        if self.size == 1 or nbytes <= 0:
            return None
        sent = self.bytes_sent  # set-up messages are not the step's traffic
        try:
            if self._one_host is None:
                self._one_host = self._shared_memory_usable(what)
            if not self._one_host:
                return None
            mem = shared.SymmetricMemory.create(self, nbytes, what)
            if mem is not None and self._signals is None:  # (collective: every rank made mem)
                self._signals = shared.Signals.create(self, what) or False
        finally:
            self.bytes_sent = sent
        return mem

    def _shared_memory_usable(self, what) -> bool:
        """Collective: every rank asks for shared memory (``NGDIST_SHM_ALLREDUCE``; ranks that
        disagree are an error) and MPI puts every rank on this host (its own view: ranks in
        separate network namespaces are separate hosts)."""
        MPI = _mpi()
        wanted = np.array([shared.requested()], np.int64)
        table = np.empty(self.size, np.int64)
        self.allgather(wanted, table, what).wait()
        if len(set(table.tolist())) > 1:
            on = [self._world_ranks[r] for r in range(self.size) if table[r]]
            raise CommError(f"NGDIST_SHM_ALLREDUCE is 0 on some ranks and not on ranks {on}; "
                            "set it the same on every rank (mpiexec -genv "
                            "NGDIST_SHM_ALLREDUCE=0, or not at all)")
        if not table[0]:
            return False
        self._all_present(what)
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        one_host = local.Get_size() == self.size
        local.Free()
        return one_host

    def host_groups(self, what, ranks_per_host=0):
        MPI = _mpi()
        self._all_present(what)
        if ranks_per_host > 0:
            local = self.comm.Split(self.rank // ranks_per_host, self.rank)
        else:
            local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self._all_present(what)
        leaders = self.comm.Split(0 if local.Get_rank() == 0 else MPI.UNDEFINED, self.rank)
        return self._wrap(local), self._wrap(leaders)

    def _wrap(self, sub: Any) -> MpiGroup | None:
        MPI = _mpi()
        if sub == MPI.COMM_NULL:
            return None
        mine = self.comm.Get_group()
        ranks = sub.Get_group().Translate_ranks(list(range(sub.Get_size())), mine)
        group = MpiGroup(self.timeout, comm=sub, job=self._job,
                         world_ranks=[self._world_ranks[r] for r in ranks])
        group.local_size, group.local_rank = self.local_size, self.local_rank
        group.timeline = self.timeline
        return group

    # ------------------------------------------------------------------ failures
    def _exchange_pids(self) -> None:
        """Learn the process id of every rank that runs under this kernel and in this PID
        namespace, so that a wait on a rank whose process has gone fails at once."""
        mine = np.zeros(3, np.int64)
        mine[0] = os.getpid()
        mine[1:] = np.frombuffer(_process_space(), np.int64)
        table = np.empty((self.size, 3), np.int64)
        self.allgather(mine, table, "start-up exchange of process ids").wait()
        self.bytes_sent = 0
        same = [r for r in range(self.size) if np.array_equal(table[r, 1:], mine[1:])]
        self._job.local_pids = {r: int(table[r, 0]) for r in same if r != self.rank}
        self.local_size = len(same)
        self.local_rank = same.index(self.rank)

    at_exit = False  # this group's wait is the end of the job (peers at exit are not gone)

    def gone(self, peers):
        """Peers on this host whose process has exited, or (except at the end of the job)
        whose program has ended and that wait at exit, or that wait outside the step this
        rank waits in (comm/exits.py). Called for a wait that has been pending a while."""
        if not self.at_exit:
            exits.publish_blocked()
        ranks = range(self.size) if peers is None else peers
        pids = self._job.local_pids
        return [r for r in ranks if self._world_ranks[r] in pids and (
            not alive(pids[self._world_ranks[r]])
            or not self.at_exit and (exits.at_exit(pids[self._world_ranks[r]])
                                     or exits.astray(pids[self._world_ranks[r]])))]

    def gone_message(self, what, dead):
        pids = [self._job.local_pids[self._world_ranks[r]] for r in dead]
        if not all(alive(pid) for pid in pids):
            return super().gone_message(what, dead)
        who = [f"rank {self._world_ranks[r]} (pid {pid})" for r, pid in zip(dead, pids)]
        ended = [w for w, pid in zip(who, pids) if exits.at_exit(pid)]
        if ended:
            return exits.at_exit_message(describe(what), self._world_ranks[self.rank], ended)
        return exits.astray_message(describe(what), self._world_ranks[self.rank], who, pids)

    def pid_of(self, world_rank):
        return self._job.local_pids.get(world_rank)

    def abort(self, message, code=1):
        abort_job(self._job.world, message, code)


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
