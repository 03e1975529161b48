"""LocalGroup: the ProcessGroup of one rank (no MPI): every collective is complete at once."""
from __future__ import annotations

import numpy as np

from ngdist.comm.group import DoneWork, ProcessGroup, ReduceOp
from ngdist.errors import CommError


class LocalGroup(ProcessGroup):
    """One rank: reductions and broadcasts leave the buffer as it is, gathers copy."""

    backend = "local"
    rank, size = 0, 1

    def allreduce(self, buf, what, op=ReduceOp.SUM, peers=None, placed=None):
        ReduceOp(op)  # (an unknown op is refused here as on every group)
        return DoneWork(self, what, peers)

    def broadcast(self, buf, root, what):
        return DoneWork(self, what, None)

    def reduce(self, send, recv, root, what):
        if recv is not None and recv is not send:
            np.copyto(recv, send)
        return DoneWork(self, what, None)

    def allgather(self, send, recv, what):
        np.copyto(recv, np.reshape(send, recv.shape))
        return DoneWork(self, what, None)

    def gather(self, send, recv, root, what):
        np.copyto(recv, np.reshape(send, recv.shape))
        return DoneWork(self, what, None)

    def reduce_scatter(self, send, recv, what):
        np.copyto(recv, np.reshape(send, recv.shape))
        return DoneWork(self, what, None)

    def exchange(self, sends, recvs, tag, what):
        if sends or recvs:
            raise CommError(f"a group of one rank has no peer to exchange messages with "
                            f"({what})")
        return DoneWork(self, what, None)

    def barrier(self, what="barrier"):
        return DoneWork(self, what, None)

    def split(self, color, key, what):
        return None if color is None else self

    def dup(self, what):
        group = LocalGroup(self.timeout)
        group.timeline = self.timeline
        return group
