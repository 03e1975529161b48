"""AllReduce of buffers in device memory on a group that reduces host memory: each input is
copied to the host, reduced there by the implementation that would take the node on the host
(the rest of ``kernels.allreduce.IMPLEMENTATIONS``), and the result copied back into device
memory. Generic over the array module of the inputs (cupy's ``asnumpy``/``asarray``; any
module with ``asarray`` and array copies works, numpy included).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ngdist.comm.group import array_module
from ngdist.kernels.allreduce import AllReduceImpl, choose, register_implementation
from ngdist.kernels.base import CommNode, donated

if TYPE_CHECKING:
    from ngdist.comm.group import ProcessGroup


def to_host(x: Any) -> np.ndarray:
    """A host copy of device array ``x`` (contiguous, writable)."""
    xp = array_module(x)
    asnumpy = getattr(xp, "asnumpy", None)
    return np.ascontiguousarray(asnumpy(x)) if asnumpy is not None else np.array(x, order="C")


def to_device(host: np.ndarray, like: Any, into: Any | None = None) -> Any:
    """``host`` in the device memory of ``like``'s array module: written into ``into`` when
    given (a donated input of the same shape), else a new array."""
    xp = array_module(like)
    if into is not None:
        into[...] = xp.asarray(host).reshape(into.shape)
        return into
    return xp.asarray(host)


class HostStagedAllReduce(AllReduceImpl):
    name = "host-staged"
    when = ("inputs in device memory on a group of host memory: copied to the host, reduced "
            "by the implementation the host would take, copied back")

    def enabled(self, request: CommNode, group: ProcessGroup | None) -> bool:
        return request.facts.memory == "device" and (group is None or group.memory == "host")

    def execute(self, group: ProcessGroup, nodes: Sequence[CommNode],
                inputs: Sequence[Sequence[Any]]) -> list[list[Any]]:
        return [self._one(group, node, xs) for node, xs in zip(nodes, inputs)]

    def _one(self, group: ProcessGroup, node: CommNode, xs: Sequence[Any]) -> list[Any]:
        host_node = node.state.get("host_node")
        if host_node is None:  # the node as the host sees it: copies made for it alone
            facts = dataclasses.replace(node.facts, memory="host", donated=(True,) * len(xs))
            host_node = node.state["host_node"] = dataclasses.replace(
                node, facts=facts, state={})
        host = [to_host(x) for x in xs]
        inner = choose(host_node, group)
        outs = inner.execute(group, [host_node], [host])[0]
        return [to_device(h, x, x if donated(node, i) and h.shape == x.shape else None)
                for i, (h, x) in enumerate(zip(outs, xs))]


register_implementation(HostStagedAllReduce(), before="shared-memory")
