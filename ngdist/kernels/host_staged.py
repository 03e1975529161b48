"""AllReduce of buffers in device memory on a group that reduces host memory: each input is
copied to the host, reduced there by the implementation that would take the node on the host
(the rest of ``kernels.allreduce.IMPLEMENTATIONS``), and the result copied back into device
memory, with the copies of comm/staged.py (HostStagedGroup's). Generic over the array module
of the inputs (numpy included).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ngdist.comm.group import array_module
from ngdist.comm.staged import copy_back, host_copy
from ngdist.kernels.allreduce import AllReduceImpl, choose, register_implementation
from ngdist.kernels.base import CommNode, donated

if TYPE_CHECKING:
    from ngdist.comm.group import ProcessGroup


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
        host = [host_copy(x) for x in xs]
        inner = choose(host_node, group)
        outs = inner.execute(group, [host_node], [host])[0]
        return [_back(h, x, donated(node, i)) for i, (h, x) in enumerate(zip(outs, xs))]


def _back(host: Any, like: Any, into_input: bool) -> Any:
    """``host`` in device memory: written into the donated input ``like`` when the shapes
    agree, else a new array of ``like``'s array module."""
    if into_input and host.shape == like.shape:
        copy_back(like, host)
        return like
    return array_module(like).asarray(host)


register_implementation(HostStagedAllReduce(), before="shared-memory")
