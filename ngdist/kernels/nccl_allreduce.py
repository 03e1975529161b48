"""AllReduce of device buffers on a group of device memory (comm/nccl.py's NcclGroup).

Plain nodes (``mpi``, uncompressed) go to the group's own AllReduce, several in one call
(``allreduce_coalesced``: one NCCL group), reduced in place. ``exact`` and compressed nodes are
staged through the group's host group (kernels/host_staged.py, as on ``comm="host"``): the
exact sum is defined on host memory. ngdist's own ``ring``, ``recursive_doubling`` and
``hierarchical`` are messages between host buffers; NCCL runs its own ring or tree, so they
are refused, saying what to use instead.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ngdist.errors import CommError
from ngdist.kernels.allreduce import MpiAllReduce, plain, register_implementation
from ngdist.kernels.base import CommNode
from ngdist.kernels.host_staged import HostStagedAllReduce

if TYPE_CHECKING:
    from ngdist.comm.group import ProcessGroup

NOT_IN_NCCL = ("ring", "recursive_doubling", "hierarchical")


class NcclAllReduce(MpiAllReduce):
    name = "nccl"
    when = ("inputs in device memory on a group of device memory (NCCL): plain nodes by the "
            "group's AllReduce; exact and compressed staged through its host group; ngdist's "
            "own ring, recursive doubling and hierarchical refused")

    def enabled(self, request: CommNode, group: ProcessGroup | None) -> bool:
        return request.facts.memory == "device" and group is not None \
            and group.memory == "device"

    def execute(self, group: ProcessGroup, nodes: Sequence[CommNode],
                inputs: Sequence[Sequence[Any]]) -> list[list[Any]]:
        for node in nodes:
            algorithm = node.attributes["algorithm"]
            if algorithm in NOT_IN_NCCL:
                raise CommError(
                    f"ngdist.AllReduce '{node.name}': algorithm {algorithm!r} is ngdist's own, "
                    "on host messages, and NCCL does not run it (NCCL picks its own ring or "
                    "tree); use algorithm 'mpi' for NCCL's AllReduce, or comm='host' to run "
                    f"{algorithm!r} through host memory")
        on_nccl = [i for i, node in enumerate(nodes) if plain(node.attributes)]
        reduced = iter(super().execute(group, [nodes[i] for i in on_nccl],
                                       [inputs[i] for i in on_nccl]) if on_nccl else [])
        # (exact, compressed: defined on host memory)
        return [next(reduced) if i in on_nccl else
                HostStagedAllReduce()._one(group.host, node, xs)
                for i, (node, xs) in enumerate(zip(nodes, inputs))]


register_implementation(NcclAllReduce(), before="shared-memory")
