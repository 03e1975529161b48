"""The single-process backend: every collective over one rank is the identity."""
from __future__ import annotations

from ngdist.kernels.base import register_kernel
from ngdist.kernels.exact import exact_allreduce


def _identity(comm, node, inputs):
    return list(inputs)


for _op in ("Broadcast", "AllGather", "ReduceScatter"):  # PushSum: kernels/pushsum
    register_kernel(_op, "local")(_identity)


@register_kernel("AllReduce", "local")
def _allreduce(comm, node, inputs):
    """The identity, except for ``exact``, which also reduces this rank's micro-batches."""
    if node.attributes.get("algorithm") == "exact":
        return exact_allreduce(comm, node, inputs)
    return list(inputs)
