"""Symmetric host memory: buffers that every rank of a one-host group can read, and the
AllReduce that works on them without a message.

When all ranks of a group run on one machine, MPI's shared-memory AllReduce copies each
message into its own cells and out again. Here each rank owns a buffer in POSIX shared memory
(``/dev/shm``) that every other rank of the group maps too, as NCCL's and PyTorch's "symmetric
memory" do on a node. A value written straight into its rank's buffer (an onnxruntime output
bound there) is reduced with two barriers and no copy in or out:

1. barrier: every rank's input is written;
2. rank r reduces block r over every rank's buffer, into its own (``mean`` divides the block
   by the group's size there, while it is in the core's cache), and writes the result into
   block r of every other rank's buffer;
3. barrier: every buffer holds the whole result.

Every rank ends with the same bytes (each block is reduced once, by its owner, in a fixed
order). In step 2 rank r reads and writes only blocks r, so no two ranks touch the same bytes;
after step 3 no rank touches another's buffer, so a rank may write its buffer again (the next
step's gradients, or the update's results in place) as soon as it is past the call.

Several buffers reduced in one call (``allreduce_coalesced``) share the two barriers: step 2
runs over block r of each of them in turn.

The barriers are flags in symmetric memory (:class:`Signals`, on machines whose stores other
cores see in order: x86-64), else the group's own (``ProcessGroup.barrier``); either way they
are Works, so the deadline, the watchdog and the dead-peer check of every wait hold here too.
``NGDIST_SHM_ALLREDUCE=0`` turns the path off.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ngdist.comm.backoff import wait_until
from ngdist.comm.group import ReduceOp, Work, describe, divide
from ngdist.errors import CommError

if TYPE_CHECKING:
    from ngdist.comm.group import ProcessGroup

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: blocks never share a cache line
_counter = itertools.count()


def requested() -> bool:
    """``NGDIST_SHM_ALLREDUCE``: unset or ``1`` on, ``0`` off; another value is an error."""
    raw = os.environ.get("NGDIST_SHM_ALLREDUCE", "1").strip()
    if raw not in ("0", "1"):
        raise CommError(f"NGDIST_SHM_ALLREDUCE={raw!r}: use 1 (AllReduce through shared "
                        "memory when every rank runs on one host, the default) or 0 (always "
                        "MPI's own AllReduce)")
    return raw == "1"


class SymmetricMemory:
    """A buffer of ``nbytes`` per rank that every rank of the group maps; ``view(j)`` is rank
    j's (uint8).

    Made by :meth:`create` (collective); the mappings close when the object is collected, and
    the files are unlinked as soon as every rank has mapped them, so nothing outlives the
    processes."""

    def __init__(self, group: ProcessGroup, nbytes: int, maps: list[mmap.mmap]) -> None:
        self.group = group
        self.nbytes = nbytes
        self._maps = maps
        self._views = [np.frombuffer(m, np.uint8, nbytes) for m in maps]
        self._base = self._views[group.rank].__array_interface__["data"][0]
        self._parts: dict[tuple, list[np.ndarray]] = {}

    @classmethod
    def create(cls, group: ProcessGroup, nbytes: int, what: Any) -> SymmetricMemory | None:
        """Collective over ``group`` (whose ranks share one host): every rank makes its
        buffer and maps everyone's; None on every rank when any rank could not (too little
        space in /dev/shm, no /dev/shm), after logging why."""
        size, rank = group.size, group.rank
        ident = np.zeros(3, np.int64)  # ok, pid, counter
        ident[1], ident[2] = os.getpid(), next(_counter)
        path = _path(int(ident[1]), int(ident[2]))
        mine: mmap.mmap | None = None
        try:
            free = os.statvfs(SHM_DIR)
            # room for every rank's buffer twice over: never fill the tmpfs
            if free.f_bavail * free.f_frsize < 2 * size * nbytes:
                raise OSError(f"{SHM_DIR} has {free.f_bavail * free.f_frsize} bytes free, "
                              f"less than twice the {size * nbytes} needed")
            mine = _map(path, nbytes, create=True)
            ident[0] = 1
        except OSError as exc:
            logger.info("AllReduce through shared memory is off for %s: %s",
                        describe(what), exc)
        table = np.empty((size, 3), np.int64)
        group.allgather(ident, table, what).wait()
        maps: list[mmap.mmap] = []
        ok = np.zeros(1, np.int64)
        if table[:, 0].all():
            try:
                maps = [mine if j == rank else
                        _map(_path(int(table[j, 1]), int(table[j, 2])), nbytes)
                        for j in range(size)]
                ok[0] = 1
            except OSError as exc:
                logger.info("AllReduce through shared memory is off for %s: %s",
                            describe(what), exc)
        oks = np.empty(size, np.int64)  # also: every rank has mapped every file
        group.allgather(ok, oks, what).wait()
        if mine is not None:
            _unlink(path)
        if not oks.all():
            return None
        return cls(group, nbytes, maps)

    def view(self, rank: int) -> np.ndarray:
        return self._views[rank]

    def locate(self, buf: np.ndarray) -> Placed | None:
        """Where ``buf`` lies in this rank's buffer (the handle ``allreduce`` takes as
        ``placed``), else None."""
        start = buf.__array_interface__["data"][0]
        if self._base <= start and start + buf.nbytes <= self._base + self.nbytes:
            return Placed(self, start - self._base)
        return None

    def parts(self, offset: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """Block ``rank`` (:func:`blocks`) of every rank's ``count`` elements of ``dtype`` at
        byte ``offset``: what this rank reduces of such a buffer (views, made once)."""
        key = (offset, dtype, count)
        parts = self._parts.get(key)
        if parts is None:
            bounds = blocks(count, dtype.itemsize, self.group.size)
            lo, hi = bounds[self.group.rank], bounds[self.group.rank + 1]
            parts = self._parts[key] = [np.frombuffer(m, dtype, count, offset)[lo:hi]
                                        for m in self._maps]
        return parts


@dataclass(frozen=True)
class Placed:
    """A buffer's place in symmetric memory: the memory, and the buffer's byte offset there.
    Whoever made the memory hands it to ``allreduce`` with the buffer (``placed``)."""

    mem: SymmetricMemory
    offset: int


def _path(pid: int, counter: int) -> str:
    return os.path.join(SHM_DIR, f"ngdist-{pid}-{counter}")


def _map(path: str, nbytes: int, create: bool = False) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, nbytes)  # the pages exist now: no SIGBUS later
        return mmap.mmap(fd, nbytes)
    except OSError:
        if create:
            _unlink(path)
        raise
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def blocks(count: int, itemsize: int, size: int) -> list[int]:
    """Bounds of ``size`` blocks of ``count`` elements, each starting on an ALIGN-byte line."""
    step = max(1, ALIGN // itemsize)
    return [min(count, (count * j // size + step - 1) // step * step) for j in range(size)] + \
        [count]


FLAG_BYTES = 64  # a rank's flag: one cache line of its own
# where a store another core sees implies every earlier store of the same core (x86's total
# store order), so a flag can announce the data written before it without a fence
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


class Signals:
    """Barriers of a one-host group through flags in symmetric memory: one int64 per rank,
    each on a cache line of its own. Barrier number k: a rank writes k into its flag, then
    waits until every other rank's flag holds k or more. The ranks pass the barriers of these
    flags in the same order (the AllReduce calls of the group through symmetric memory), so the
    numbers agree. A rank that sees another's flag at k sees every write that rank made
    before it (``ORDERED_STORES``; elsewhere the group's own barrier serves). No message and
    no MPI request: the round trip of a line between the cores."""

    def __init__(self, group: ProcessGroup, mem: SymmetricMemory) -> None:
        self.group, self.mem = group, mem
        flags = [memoryview(mem.view(j)).cast("q") for j in range(group.size)]
        self.mine = flags[group.rank]
        self.others = [f for j, f in enumerate(flags) if j != group.rank]
        self.count = int(self.mine[0])

    @classmethod
    def create(cls, group: ProcessGroup, what: Any) -> Signals | None:
        """Collective, like :meth:`SymmetricMemory.create`; None where the memory could not
        be made or the machine's stores are not seen in order."""
        if not ORDERED_STORES:
            return None
        mem = SymmetricMemory.create(group, FLAG_BYTES, what)
        return None if mem is None else cls(group, mem)

    def barrier(self, what: Any) -> Work:
        self.count += 1
        self.mine[0] = self.count
        return FlagBarrierWork(self.group, self.others, self.count, what)


class FlagBarrierWork(Work):
    """Waits until every other rank's flag has reached ``count`` (:class:`Signals`): in
    ``wait`` it spins on the flags, then gives the core up between looks, then sleeps
    (comm/backoff.py: ranks may outnumber cores), under the deadline and the dead-peer watch
    of every wait."""

    def __init__(self, group: ProcessGroup, flags: list[memoryview], count: int,
                 what: Any) -> None:
        super().__init__(group, what, None)
        self.flags, self.count = flags, count

    def test(self) -> bool:
        count = self.count
        for flag in self.flags:
            if flag[0] < count:
                return False
        return True

    def _block(self) -> None:
        wait_until(self.test)


class SharedAllreduceWork(Work):
    """The AllReduce of buffers in symmetric memory (see the module docstring), all between
    one pair of barriers; it runs in ``wait``. ``entries``: (the memory, the buffer, its byte
    offset there) per buffer."""

    def __init__(self, group: ProcessGroup,
                 entries: Sequence[tuple[SymmetricMemory, np.ndarray, int]], what: Any,
                 op: ReduceOp | str, peers: Sequence[int] | None = None,
                 signals: Signals | None = None) -> None:
        """``signals``: the group's flags for the barriers, else its own ``barrier``."""
        super().__init__(group, what, peers)
        self.entries, self.op = entries, ReduceOp(op)
        self.barrier = group.barrier if signals is None else signals.barrier
        self.done = False

    def test(self) -> bool:
        return self.done

    def _block(self) -> None:
        self._run(False)

    def wait(self, gentle: bool = False) -> None:
        if not self.done:
            self._run(gentle)

    def _run(self, gentle: bool) -> None:
        group = self.group
        r, size = group.rank, group.size
        reduce = self.op.ufunc
        # per buffer: every rank's block r
        parts = [mem.parts(offset, buf.dtype, buf.size) for mem, buf, offset in self.entries]
        self.barrier(self.what).wait(gentle)  # every rank's inputs are written
        for part in parts:
            mine = part[r]
            for j in range(size):
                if j != r:
                    reduce(mine, part[j], out=mine)
            if self.op is ReduceOp.MEAN:  # the block only, while it is in this core's cache
                divide(mine, size)
            for j in range(size):
                if j != r:
                    part[j][...] = mine
        self.barrier(self.what).wait(gentle)  # every buffer holds the whole result
        self.done = True
