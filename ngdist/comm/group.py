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
import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ngdist.errors import CommError, CommTimeoutError

logger = logging.getLogger(__name__)

# a wait pending this long whose peer process on this host has been gone this long fails
DEAD_CHECK_AFTER_S = 1.0
DEAD_GRACE_S = 2.0


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


def divide(buf: np.ndarray, n: int) -> None:
    """``buf /= n`` in place (floor division for integers): the mean of a sum over n ranks."""
    if n == 1:
        return
    if buf.dtype.kind == "f":
        np.multiply(buf, buf.dtype.type(1.0 / n), out=buf) if n & (n - 1) == 0 else \
            np.divide(buf, buf.dtype.type(n), out=buf)
    else:
        np.floor_divide(buf, n, out=buf)


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
        self.bytes_sent = 0  # what this rank's calls put on the wire (step statistics)
        self.local_size = 1  # ranks of this group on this host (threads per rank)
        self.local_rank = 0  # this rank's place among them (its GPU on a multi-GPU host)
        # groups derived from this one for a kernel's own messages (kernels.base.private_group)
        self.derived: dict[Any, Any] = {}
        # where waits that block are recorded when the job writes a timeline: any object with
        # record(cat, name, t0, t1) (runtime/timeline.py); groups derived later inherit it
        self.timeline: Any = None

    # ------------------------------------------------------------------ collectives
    @abc.abstractmethod
    def allreduce(self, buf: Any, what: Any, op: str = "sum",
                  peers: Sequence[int] | None = None) -> Work:
        """In place: ``buf`` becomes the element-wise ``op`` over the ranks: ``sum``, ``max``,
        ``min``, or ``mean`` (the sum, then ``divide`` by the group's size on every rank; a
        backend may fold the division into its reduction, with the same result bit for bit)."""

    def allreduce_coalesced(self, bufs: Sequence[Any], what: Any, op: str = "sum") -> Work:
        """:meth:`allreduce` of every buffer of ``bufs`` (each in place, each on its own: no
        element of one meets another's), as one call whose Work completes when all have:
        a backend may share its synchronisation between them. ``what``: a tuple of the
        comm nodes, or a label. Default: one ``allreduce`` each, all started, then waited."""
        return WorkList(self, [self.allreduce(b, what, op) for b in bufs], what)

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

    def symmetric(self, nbytes: int, what: Any) -> Any:
        """Collective: a buffer of ``nbytes`` per rank that every rank can read and write
        (comm/shared.py), or None where the group cannot make it (ranks on several hosts,
        one rank, ``NGDIST_SHM_ALLREDUCE=0``). ``allreduce`` of a buffer that lies in it
        reduces through the shared memory instead of sending messages."""
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

    def gone_message(self, what: Any, dead: Sequence[int]) -> str:
        return (f"{describe(what)} cannot complete on rank {self.rank}: the process of "
                f"{', '.join(f'rank {r}' for r in dead)} has exited. Look at that rank's "
                "output for why it stopped")

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


class _Watchdog:
    """One daemon thread that aborts the job when an armed wait passes its deadline, or when
    a peer it waits for has exited."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, Work, float]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def arm(self, work: Work) -> int:
        with self._lock:
            self._next += 1
            now = time.monotonic()
            self._armed[self._next] = (now + work.group.timeout, work, now)
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
                work = expired[1]
                _abort(work, "CommTimeoutError",
                       work.group.timeout_message(work.what, work.peers))
            if now < next_check:
                continue
            next_check = now + 0.5
            for token in set(gone_since) - set(armed):
                del gone_since[token]
            for token, (_, work, start) in armed.items():
                dead = work.group.gone(work.peers) if now - start >= DEAD_CHECK_AFTER_S else []
                if not dead:
                    gone_since.pop(token, None)
                    continue
                with self._lock:
                    pending = token in self._armed  # not completed meanwhile
                if pending and now - gone_since.setdefault(token, now) >= DEAD_GRACE_S:
                    _abort(work, "CommError", work.group.gone_message(work.what, dead))


def _abort(work: Work, kind: str, message: str) -> None:
    rank = work.group.world_ranks()[work.group.rank]
    work.group.abort(f"ngdist: error on rank {rank}: {kind}: {message}\n")


WATCHDOG = _Watchdog()
