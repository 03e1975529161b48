"""The host-staged AllReduce (kernels/host_staged.py): device buffers copied to the host,
reduced by the implementation the host would take, copied back. numpy stands in for the
device array module: what must hold is that the group only ever sees host copies, and the
result lands in the device buffer (or a new one)."""
from __future__ import annotations

import numpy as np
import pytest

from ngdist.comm import LocalGroup
from ngdist.comm.group import DoneWork
from ngdist.kernels import CommFacts, CommNode, get_kernel
from ngdist.kernels import allreduce as ar
from ngdist.kernels.host_staged import HostStagedAllReduce


class TwoRanks(LocalGroup):
    """Rank 0 of two whose peer holds 10 more in every element; records the buffers."""

    size = 2

    def __init__(self) -> None:
        super().__init__(timeout=5)
        self.seen: list[np.ndarray] = []

    def allreduce(self, buf, what, op="sum", peers=None, placed=None):
        self.seen.append(buf)
        np.multiply(buf, 2, out=buf)
        np.add(buf, buf.dtype.type(10), out=buf)
        if op == "mean":
            np.divide(buf, buf.dtype.type(2), out=buf)
        return DoneWork(self, what, peers)


def device_node(donated: bool, **attrs) -> CommNode:
    return CommNode("AllReduce", "b0", {"bucket": 0, **attrs}, ["g"], ["r"],
                    facts=CommFacts(donated=(donated,), outputs_die=True, memory="device"))


def test_host_staged_goes_first_for_device_buffers_only():
    assert [i.name for i in ar.IMPLEMENTATIONS][0] == "host-staged"
    assert ar.choose(device_node(True), None).name == "host-staged"
    host = CommNode("AllReduce", "b0", {"bucket": 0},
                    facts=CommFacts(donated=(True,), outputs_die=True))
    assert ar.choose(host, None).name == "shared-memory"


@pytest.mark.parametrize("donated", [True, False])
@pytest.mark.parametrize("attrs, want", [({}, lambda x: (2 * x + 10) / 2),
                                         ({"reduction": "sum"}, lambda x: 2 * x + 10)])
def test_the_group_sees_host_copies_and_the_result_comes_back(donated, attrs, want):
    group = TwoRanks()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    original = x.copy()
    node = device_node(donated, **attrs)
    (out,) = get_kernel("AllReduce")(group, node, [x])
    assert node.state["implementation"].name == "host-staged"
    (seen,) = group.seen
    assert not np.shares_memory(seen, x)  # staged: the host collective never sees x
    np.testing.assert_array_equal(out, want(original))
    assert (out is x) is donated  # a donated device buffer takes the result in place
    if not donated:
        np.testing.assert_array_equal(x, original)


def test_the_host_side_is_chosen_as_for_a_host_node():
    group = TwoRanks()
    node = device_node(True, reduction="sum")
    staged = HostStagedAllReduce()
    assert staged.enabled(node, group)
    x = np.ones(4, np.float64)
    (out,) = staged.execute(group, [node], [[x]])[0]
    np.testing.assert_array_equal(out, np.full(4, 12.0))
    host_node = node.state["host_node"]
    assert host_node.facts.memory == "host" and host_node.facts.donated == (True,)
    assert ar.choose(host_node, group).name == "shared-memory"
    assert host_node.requests == ()  # this group has no symmetric memory to offer
    assert not group.memory == "device"


def test_an_implementation_of_the_same_name_is_refused():
    with pytest.raises(Exception, match="named 'host-staged' is registered already"):
        ar.register_implementation(HostStagedAllReduce())
