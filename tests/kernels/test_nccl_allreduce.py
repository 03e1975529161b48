"""The NCCL AllReduce entry (kernels/nccl_allreduce.py): device buffers on a group of device
memory. A stand-in device group (two ranks, the peer holding 10 more) records its calls."""
from __future__ import annotations

import numpy as np
import pytest

from ngdist.comm.group import DoneWork
from ngdist.errors import CommError
from ngdist.kernels import CommFacts, CommNode, get_kernel
from ngdist.kernels import allreduce as ar

from test_host_staged import TwoRanks


class DeviceTwoRanks(TwoRanks):
    """A group of device memory whose host group is a TwoRanks."""

    memory = "device"

    def __init__(self) -> None:
        super().__init__()
        self.host = TwoRanks()
        self.calls: list[int] = []

    def allreduce_coalesced(self, bufs, what, op="sum", peers=None, placed=None):
        self.calls.append(len(bufs))
        for b in bufs:
            self.allreduce(b, what, op)
        return DoneWork(self, what, peers)


def node(name: str = "b0", **attrs) -> CommNode:
    return CommNode("AllReduce", name, {"bucket": 0, **attrs}, ["g"], ["r"],
                    facts=CommFacts(donated=(True,), outputs_die=True, memory="device"))


def test_device_groups_take_nccl_host_groups_host_staged():
    assert ar.choose(node(), DeviceTwoRanks()).name == "nccl"
    assert ar.choose(node(), TwoRanks()).name == "host-staged"
    assert ar.choose(node(), None).name == "host-staged"  # (asked from the file alone)
    host_node = CommNode("AllReduce", "h", {"bucket": 0},
                         facts=CommFacts(donated=(True,), outputs_die=True))
    assert ar.choose(host_node, DeviceTwoRanks()).name == "shared-memory"
    assert sum(i.name == "nccl" for i in ar.IMPLEMENTATIONS) == 1


def test_plain_buckets_are_one_call_of_the_group_reduced_in_place():
    group = DeviceTwoRanks()
    xs = [np.arange(4, dtype=np.float32), np.ones(3, np.float32)]
    nodes = [node("b0", reduction="sum"), node("b1", reduction="sum")]
    outs = get_kernel("AllReduce").batch(group, nodes, [[xs[0]], [xs[1]]])
    assert group.calls == [2] and group.host.seen == []
    assert outs[0][0] is xs[0] and outs[1][0] is xs[1]
    np.testing.assert_array_equal(xs[0], 2 * np.arange(4) + 10)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "hierarchical"])
def test_algorithms_nccl_does_not_have_are_refused(algorithm):
    with pytest.raises(CommError) as info:
        get_kernel("AllReduce")(DeviceTwoRanks(), node(algorithm=algorithm),
                                [np.ones(4, np.float32)])
    assert str(info.value) == (
        f"ngdist.AllReduce 'b0': algorithm {algorithm!r} is ngdist's own, on host messages, "
        "and NCCL does not run it (NCCL picks its own ring or tree); use algorithm 'mpi' for "
        f"NCCL's AllReduce, or comm='host' to run {algorithm!r} through host memory")


@pytest.mark.parametrize("attrs", [{"compression": "fp16"}, {"algorithm": "exact"}])
def test_exact_and_compressed_are_staged_through_the_host_group(monkeypatch, attrs):
    from ngdist.kernels import host_staged

    seen = []

    def one(self, group, node, xs):
        seen.append((group, node.name, [x is y for x, y in zip(xs, inputs)]))
        return ["staged"]
    monkeypatch.setattr(host_staged.HostStagedAllReduce, "_one", one)
    group, inputs = DeviceTwoRanks(), [np.ones(4, np.float16)]
    assert get_kernel("AllReduce")(group, node(**attrs), inputs) == ["staged"]
    assert seen == [(group.host, "b0", [True])] and group.calls == []
