"""The ProcessGroup protocol and its Work: the one seam every collective goes through.

As PyTorch's c10d: a group (``MpiGroup``, ``LocalGroup``, later ``NcclGroup``) is the only place
where backends differ. Every call is non-blocking and returns a :class:`Work`; ``Work.wait()``
owns the deadline (the group's ``timeout``), the watchdog that aborts the job when a blocked
wait passes it, and the dead-peer check (a peer process on this host that has exited makes the
wait fail within ``DEAD_CHECK_AFTER_S + DEAD_GRACE_S`` seconds, naming it).

Buffers are arrays in the memory the group declares (``memory = "host"``: numpy arrays;
``"device"``: device arrays); collectives work in place where MPI does (``allreduce``,
``broadcast``), and every call names what it is for (``what``: a comm node, whose op and name
the error messages quote, or a label).
"""
from __future__ import annotations

import abc
import enum
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ngdist.comm.watchdog import DEAD_CHECK_AFTER_S, DEAD_GRACE_S, WATCHDOG
from ngdist.errors import CommError, CommTimeoutError

logger = logging.getLogger(__name__)



def default_timeout() -> float:
    """``NGDIST_TIMEOUT`` (seconds) or 300; a malformed value is an error that says so."""
    raw = os.environ.get("NGDIST_TIMEOUT", "").strip()
    if not raw:
        return 300.0
    try:
        value = float(raw)
    except ValueError:
        raise CommError(f"NGDIST_TIMEOUT={raw!r} is not a number of seconds; set it to e.g. "
                        "300 or unset it") from None
    if value <= 0:
        raise CommError(f"NGDIST_TIMEOUT={raw!r} must be a positive number of seconds")
    return value


class ReduceOp(str, enum.Enum):
    """How ``allreduce`` combines the ranks' elements. A ``str`` enum: ``op="mean"`` and
    ``ReduceOp.MEAN`` are the same op."""

    SUM = "sum"
    MEAN = "mean"  # the sum, then ``divide`` by the group's size
    MAX = "max"
    MIN = "min"

    @property
    def summed(self) -> bool:
        """Whether the ranks' elements are added (``sum`` and ``mean``)."""
        return self in (ReduceOp.SUM, ReduceOp.MEAN)

    @property
    def ufunc(self) -> np.ufunc:
        """The element-wise combination of two ranks' values."""
        return np.maximum if self is ReduceOp.MAX else np.minimum if self is ReduceOp.MIN \
            else np.add


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp, ...), or
    None when the process is gone or the file cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """False once the process has exited (gone, or a zombie its launcher has not reaped)."""
    fields = proc_stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def array_module(x: Any) -> Any:
    """The array module of ``x``: the namespace its ``__array_namespace__`` names (numpy for
    host arrays, cupy for CUDA ones), else numpy. Code over buffers calls ``xp.empty``,
    ``xp.multiply``, ... on it, and runs unchanged on either memory."""
    namespace = getattr(x, "__array_namespace__", None)
    return np if namespace is None else namespace()


def divide(buf: Any, n: int) -> None:
    """``buf /= n`` in place (floor division for integers): the mean of a sum over n ranks."""
    if n == 1:
        return
    xp = array_module(buf)
    if buf.dtype.kind == "f":
        xp.multiply(buf, buf.dtype.type(1.0 / n), out=buf) if n & (n - 1) == 0 else \
            xp.divide(buf, buf.dtype.type(n), out=buf)
    else:
        xp.floor_divide(buf, n, out=buf)


def describe(what: Any) -> str:
    """``ngdist.AllReduce 'name'`` for a comm node, ``'label'`` for anything else, and
    ``ngdist.AllReduce 'a', 'b'`` for a tuple of comm nodes (one call for several)."""
    if type(what) is tuple:  # (a named tuple with op_type and name is one thing)
        if len(what) == 1:
            return describe(what[0])
        op = getattr(what[0], "op_type", "") if what else ""
        names = ", ".join(f"'{_name(w)}'" for w in what)
        return f"{('ngdist.' + op + ' ') if op else ''}{names}"
    op = getattr(what, "op_type", "")
    return f"{('ngdist.' + op + ' ') if op else ''}'{_name(what)}'"


def _name(what: Any) -> str:
    """Its name, else its text (made only then: a comm node's text shows its state's arrays,
    which numpy formats at length)."""
    name = getattr(what, "name", None)
    return str(what) if name is None else name


class Work(abc.ABC):
    """A pending communication of one group."""

    def __init__(self, group: ProcessGroup, what: Any, peers: Sequence[int] | None) -> None:
        self.group = group
        self.what = what
        self.peers = None if peers is None else list(peers)

    @abc.abstractmethod
    def test(self) -> bool:
        """True once complete (never blocks)."""

    @abc.abstractmethod
    def _block(self) -> None:
        """Block until complete (the backend's own progress engine)."""

    def wait(self, gentle: bool = False) -> None:
        """Block until complete, bounded by the group's timeout.

        Default: the backend's blocking wait while the watchdog watches the deadline and the
        peers' processes; past the deadline it prints the CommTimeoutError message and aborts
        the job (a blocked MPI call cannot be interrupted). ``gentle`` (or ``NGDIST_WAIT=poll``)
        polls instead, sleeping between tests, and raises in this thread: for progress
        threads that must not spin a core the compute needs.
        """
        if self.test():
            return
        timeline = self.group.timeline
        if timeline is None:
            self._wait(gentle)
            return
        t0 = time.perf_counter()
        self._wait(gentle)
        timeline.record("wait", f"wait {describe(self.what)}", t0, time.perf_counter())

    def _wait(self, gentle: bool) -> None:
        if gentle or os.environ.get("NGDIST_WAIT", "watchdog") == "poll":
            self._poll(0.001 if gentle else 0.0002)
            return
        token = WATCHDOG.arm(self)
        try:
            self._block()
        finally:
            WATCHDOG.disarm(token)

    def _poll(self, sleep_s: float) -> None:
        start = time.monotonic()
        deadline = start + self.group.timeout
        spin_until = start + 0.002
        next_check, dead_since = start + DEAD_CHECK_AFTER_S, None
        while not self.test():
            now = time.monotonic()
            if now > deadline:
                raise CommTimeoutError(self.group.timeout_message(self.what, self.peers))
            if now > next_check:
                next_check = now + 0.5
                dead = self.group.gone(self.peers)
                dead_since = (dead_since or now) if dead else None
                if dead and now - dead_since >= DEAD_GRACE_S:
                    raise CommError(self.group.gone_message(self.what, dead))
            time.sleep(0 if now < spin_until else sleep_s)


class WorkList(Work):
    """Several Works of one group, waited for in the order given."""

    def __init__(self, group: ProcessGroup, works: Sequence[Work], what: Any) -> None:
        super().__init__(group, what, None)
        self.works = list(works)

    def test(self) -> bool:
        return all(w.test() for w in self.works)  # (stops at the first that is not complete)

    def _block(self) -> None:  # (not reached: wait is the parts' own)
        for w in self.works:
            w.wait()

    def wait(self, gentle: bool = False) -> None:
        for w in self.works:
            w.wait(gentle)


class DoneWork(Work):
    """A Work that completed when it was made (one rank, or nothing to send)."""

    def test(self) -> bool:
        return True

    def _block(self) -> None:
        return None


class ProcessGroup(abc.ABC):
    """Ranks ``0 .. size-1`` that communicate; see the module docstring."""

    rank: int
    size: int
    timeout: float
    memory = "host"
    backend = "abstract"

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = default_timeout() if timeout is None else float(timeout)
        # what this rank's calls put on the wire (step statistics), counted as nccl-tests'
        # algorithm bytes: an AllReduce its buffer; a ReduceScatter and an AllGather, each
        # one half of a (ring) AllReduce on the wire, half their whole buffer
        self.bytes_sent = 0
        self.local_size = 1  # ranks of this group on this host (threads per rank)
        self.local_rank = 0  # this rank's place among them (its GPU on a multi-GPU host)
        # groups derived from this one for a kernel's own messages (kernels.base.private_group)
        self.derived: dict[Any, Any] = {}
        # where waits that block are recorded when the job writes a timeline: any object with
        # record(cat, name, t0, t1) (runtime/timeline.py); groups derived later inherit it
        self.timeline: Any = None

    # ------------------------------------------------------------------ collectives
    @abc.abstractmethod
    def allreduce(self, buf: Any, what: Any, op: ReduceOp | str = ReduceOp.SUM,
                  peers: Sequence[int] | None = None, placed: Any = None) -> Work:
        """In place: ``buf`` becomes the element-wise ``op`` over the ranks: ``sum``, ``max``,
        ``min``, or ``mean`` (the sum, then ``divide`` by the group's size on every rank; a
        backend may fold the division into its reduction, with the same result bit for bit).
        ``placed``: where ``buf`` lies in memory the group made (:meth:`symmetric`; the
        handle its ``locate`` gives), which the group may reduce without a message."""

    def allreduce_coalesced(self, bufs: Sequence[Any], what: Any,
                            op: ReduceOp | str = ReduceOp.SUM, peers: Sequence[int] | None = None,
                            placed: Sequence[Any] | None = None) -> Work:
        """:meth:`allreduce` of every buffer of ``bufs`` (each in place, each on its own: no
        element of one meets another's), as one call whose Work completes when all have:
        a backend may share its synchronisation between them. ``what``: a tuple of the
        comm nodes, or a label; ``placed``: each buffer's ``placed`` (or None). Default: one
        ``allreduce`` each, all started, then waited."""
        where = list(placed) if placed is not None else [None] * len(bufs)
        return WorkList(self, [self.allreduce(b, what, op, peers, p)
                               for b, p in zip(bufs, where)], what)

    @abc.abstractmethod
    def broadcast(self, buf: Any, root: int, what: Any) -> Work:
        """In place: ``buf`` becomes ``root``'s."""

    @abc.abstractmethod
    def reduce(self, send: Any, recv: Any | None, root: int, what: Any) -> Work:
        """The sum of ``send`` over the ranks into ``recv`` on ``root`` (None elsewhere);
        ``send is recv`` on the root reduces in place."""

    @abc.abstractmethod
    def allgather(self, send: Any, recv: Any, what: Any) -> Work:
        """``recv`` (``size`` times ``send`` along axis 0) holds every rank's ``send``."""

    @abc.abstractmethod
    def gather(self, send: Any, recv: Any | None, root: int, what: Any) -> Work:
        """Every rank's ``send`` into the rows of ``recv`` on ``root``."""

    @abc.abstractmethod
    def reduce_scatter(self, send: Any, recv: Any, what: Any) -> Work:
        """Rank r gets the sum over the ranks of block r of ``send`` (axis 0)."""

    @abc.abstractmethod
    def exchange(self, sends: Sequence[tuple[Any, int]], recvs: Sequence[tuple[Any, int]],
                 tag: int, what: Any) -> Work:
        """Grouped point-to-point: every ``(buf, dst)`` sent, every ``(buf, src)`` received;
        one Work for all of them (its peers are every rank involved)."""

    @abc.abstractmethod
    def barrier(self, what: Any = "barrier") -> Work:
        """Completes once every rank has called it."""

    @abc.abstractmethod
    def split(self, color: int | None, key: int, what: Any) -> ProcessGroup | None:
        """Collective: the sub-group of the ranks that pass the same ``color`` (ordered by
        ``key``); ``None`` (color None) takes part without joining one."""

    @abc.abstractmethod
    def dup(self, what: Any) -> ProcessGroup:
        """Collective: the same ranks, messages of their own (never matching this group's)."""

    def close(self) -> None:
        """Frees what the group holds of its own (an NcclGroup: its communicator); the host
        groups hold nothing to free."""

    def symmetric(self, nbytes: int, what: Any) -> Any:
        """Collective: a buffer of ``nbytes`` per rank that every rank can read and write
        (comm/shared.py), or None where the group cannot make it (ranks on several hosts,
        one rank, ``NGDIST_SHM_ALLREDUCE=0``). ``allreduce`` of a buffer that lies in it,
        given its place (``placed=mem.locate(buf)``), reduces through the shared memory
        instead of sending messages."""
        return None

    def host_groups(self, what: Any, ranks_per_host: int = 0) -> tuple[ProcessGroup, ProcessGroup | None]:
        """Collective: (this host's ranks, the hosts' first ranks or None elsewhere);
        ``ranks_per_host=k`` groups consecutive ranks by k instead of by shared memory."""
        return self, (self if self.rank == 0 else None)

    def world_ranks(self) -> list[int]:
        """The job-wide rank of each member (for messages that name ranks)."""
        return list(range(self.size))

    # ------------------------------------------------------------------ failures
    def gone(self, peers: Sequence[int] | None) -> list[int]:
        """The members among ``peers`` (all when None) whose process is known to have exited."""
        return []

    def pid_of(self, world_rank: int) -> int | None:
        """The process id of a job-wide rank on this host, where the group knows it."""
        return None

    def gone_message(self, what: Any, dead: Sequence[int]) -> str:
        """Members ``dead`` have exited: named by job-wide rank, with their pid where known."""
        world = self.world_ranks()
        who = []
        for r in dead:
            rank = world[r] if r < len(world) else r
            pid = self.pid_of(rank)
            who.append(f"rank {rank}" + ("" if pid is None else f" (pid {pid})"))
        return (f"{describe(what)} cannot complete on rank {world[self.rank]}: the process of "
                f"{', '.join(who)} has exited. Look at that rank's output for why it stopped")

    def timeout_message(self, what: Any, peers: Sequence[int] | None = None) -> str:
        """Names job-wide ranks, also in a sub-group."""
        world = self.world_ranks()
        if peers is not None:
            who = f"peers {[world[p] for p in peers]}"
        elif world == list(range(self.size)):
            who = f"ranks 0..{self.size - 1}"
        else:
            who = f"ranks {world}"
        return (f"{describe(what)} did not complete within {self.timeout:g} s on rank "
                f"{world[self.rank]} (waiting for {who}); a rank has probably died or is running a "
                "different program. Check the other ranks' output; raise the limit with "
                "timeout= or NGDIST_TIMEOUT")

    def abort(self, message: str, code: int = 1) -> None:
        """Print ``message`` and end the whole job (never returns in a multi-rank job)."""
        raise CommError(message)

    # ------------------------------------------------------------------ start-up helpers
    def check_same(self, payload: bytes, what: str) -> None:
        """Every rank must hold the same ``payload`` (compared by SHA-256), else CommError."""
        if self.size == 1:
            return
        digest = np.frombuffer(hashlib.sha256(payload).digest(), dtype=np.uint8).copy()
        table = np.empty((self.size, digest.size), np.uint8)
        self.allgather(digest, table, f"start-up check of the {what}").wait()
        differ = [r for r in range(self.size) if not np.array_equal(table[r], table[0])]
        if differ:
            world = self.world_ranks()
            raise CommError(
                f"ranks {[world[r] for r in differ]} hold a different {what} than rank "
                f"{world[0]} (sha256 {table[0].tobytes().hex()[:12]} on rank {world[0]}, "
                f"{table[differ[0]].tobytes().hex()[:12]} on rank {world[differ[0]]}); start "
                "every rank with the same model and options")

    def broadcast_arrays(self, arrays: Sequence[np.ndarray], root: int = 0,
                         what: str = "initial broadcast of parameters") -> None:
        """In place, every array from ``root``: one message per array, no staging copy."""
        if self.size == 1:
            return
        works = [self.broadcast(a, root, what) for a in arrays if a.size]
        for work in works:
            work.wait()
