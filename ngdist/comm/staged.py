"""HostStagedGroup: the ProcessGroup of device buffers over a group of host memory.

Each call copies its device buffers to the host, runs the inner host group's call on the
copies, and once that completes copies the results back into the device buffers (``comm=
"host"``, and the fallback where NCCL is missing). It is generic over the array module of the
buffers (cupy's ``asnumpy``/``asarray``; numpy arrays are staged too, as copies), and it is
the reference NcclGroup is tested against (tests/comm/test_group_contract.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ngdist.comm.group import ProcessGroup, ReduceOp, Work, array_module


def host_copy(x: Any) -> np.ndarray:
    """A contiguous, writable host copy of array ``x`` (device or host; a cupy array's own
    ``get``, else its module's ``asnumpy``)."""
    if isinstance(x, np.ndarray):
        return np.array(x, order="C", copy=True)
    get = getattr(x, "get", None)
    return np.ascontiguousarray(get() if get is not None else array_module(x).asnumpy(x))


def copy_back(dst: Any, host: np.ndarray) -> None:
    """``dst[...] = host`` across memories (``dst``'s array module makes the device copy)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, host.reshape(dst.shape))
    elif hasattr(dst, "set"):  # cupy: one host-to-device copy into the array
        dst.set(np.ascontiguousarray(host.reshape(dst.shape)))
    else:
        dst[...] = array_module(dst).asarray(host).reshape(dst.shape)


class StagedWork(Work):
    """The inner group's Work; once complete, ``back`` copies the results to the device."""

    def __init__(self, group: ProcessGroup, inner: Work, back: Callable[[], None]) -> None:
        super().__init__(group, inner.what, inner.peers)
        self.inner, self._back = inner, back

    def _done(self) -> None:
        back, self._back = self._back, None
        if back is not None:
            back()

    def test(self) -> bool:
        if not self.inner.test():
            return False
        self._done()
        return True

    def _block(self) -> None:  # (not reached: wait is the inner Work's)
        self.inner._block()

    def wait(self, gentle: bool = False) -> None:
        self.inner.wait(gentle)
        self._done()


class OverHost(ProcessGroup):
    """A group of device memory over a host group (``host``, the control plane): its ranks,
    timeout, barriers and failures are the host group's."""

    memory = "device"

    def __init__(self, host: ProcessGroup) -> None:
        super().__init__(host.timeout)
        self.host = host
        self.rank, self.size = host.rank, host.size
        self.local_size, self.local_rank = host.local_size, host.local_rank
        self.timeline = host.timeline

    def barrier(self, what="barrier"):
        return self.host.barrier(what)

    def host_groups(self, what, ranks_per_host=0):
        return self.host.host_groups(what, ranks_per_host)

    def world_ranks(self):
        return self.host.world_ranks()

    def gone(self, peers):
        return self.host.gone(peers)

    def pid_of(self, world_rank):
        return self.host.pid_of(world_rank)

    def abort(self, message, code=1):
        self.host.abort(message, code)


class HostStagedGroup(OverHost):
    """Device buffers through ``host`` (module docstring)."""

    backend = "host-staged"

    def _staged(self, start: Callable[..., Work], ins: Sequence[Any], outs: Sequence[Any],
                *args: Any) -> Work:
        """``start(*host copies of ins, *args)``; afterwards host copies of ``outs`` (the
        same objects as some of ``ins`` for in-place calls) go back to the device."""
        copies = {id(x): host_copy(x) for x in (*ins, *outs) if x is not None}
        work = start(*[None if x is None else copies[id(x)] for x in ins], *args)

        def back() -> None:
            for x in outs:
                if x is not None:
                    copy_back(x, copies[id(x)])
            self.bytes_sent = self.host.bytes_sent
        return StagedWork(self, work, back)

    def allreduce(self, buf, what, op=ReduceOp.SUM, peers=None, placed=None):
        return self._staged(lambda b: self.host.allreduce(b, what, op, peers), [buf], [buf])

    def allreduce_coalesced(self, bufs, what, op=ReduceOp.SUM, peers=None, placed=None):
        return self._staged(lambda *bs: self.host.allreduce_coalesced(bs, what, op, peers),
                            bufs, bufs)

    def broadcast(self, buf, root, what):
        return self._staged(lambda b: self.host.broadcast(b, root, what), [buf], [buf])

    def reduce(self, send, recv, root, what):
        if send is recv:
            return self._staged(lambda b: self.host.reduce(b, b, root, what), [send], [send])
        return self._staged(lambda s, r: self.host.reduce(s, r, root, what), [send, recv],
                            [recv])

    def allgather(self, send, recv, what):
        return self._staged(lambda s, r: self.host.allgather(s, r, what), [send, recv], [recv])

    def gather(self, send, recv, root, what):
        return self._staged(lambda s, r: self.host.gather(s, r, root, what), [send, recv],
                            [recv])

    def reduce_scatter(self, send, recv, what):
        return self._staged(lambda s, r: self.host.reduce_scatter(s, r, what), [send, recv],
                            [recv])

    def exchange(self, sends, recvs, tag, what):
        bufs = [b for b, _ in sends] + [b for b, _ in recvs]
        n = len(sends)

        def start(*hosts: Any) -> Work:
            return self.host.exchange([(h, d) for h, (_, d) in zip(hosts[:n], sends)],
                                      [(h, s) for h, (_, s) in zip(hosts[n:], recvs)], tag, what)
        return self._staged(start, bufs, [b for b, _ in recvs])

    def split(self, color, key, what):
        sub = self.host.split(color, key, what)
        return None if sub is None else HostStagedGroup(sub)

    def dup(self, what):
        return HostStagedGroup(self.host.dup(what))
