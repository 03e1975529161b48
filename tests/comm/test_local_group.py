"""LocalGroup (comm/local.py), the group of one rank, and what comm/group.py gives every group:
Work.test/wait (including the poll loop's deadline and dead-peer check), describe(), the
failure messages, default_timeout() and the start-up helpers."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest

from ngdist.comm import LocalGroup, ProcessGroup, Work, default_timeout, describe, world_group
from ngdist.comm import group as group_module
from ngdist.comm.group import DoneWork
from ngdist.errors import CommError, CommTimeoutError

NODE = SimpleNamespace(op_type="AllReduce", name="ngdist/allreduce/bucket0")


@pytest.fixture
def g() -> LocalGroup:
    return LocalGroup(timeout=5)


def _done(work: Work, group: ProcessGroup, what: object) -> None:
    assert isinstance(work, DoneWork)
    assert work.group is group and work.what is what
    assert work.test() is True
    assert work.wait() is None
    assert work.wait(gentle=True) is None


# ---------------------------------------------------------------- default_timeout
def test_default_timeout_unset_is_300(monkeypatch):
    monkeypatch.delenv("NGDIST_TIMEOUT", raising=False)
    assert default_timeout() == 300.0
    assert LocalGroup().timeout == 300.0


def test_default_timeout_blank_is_300(monkeypatch):
    monkeypatch.setenv("NGDIST_TIMEOUT", "  ")
    assert default_timeout() == 300.0


def test_default_timeout_reads_seconds(monkeypatch):
    monkeypatch.setenv("NGDIST_TIMEOUT", "12.5")
    assert default_timeout() == 12.5
    assert LocalGroup().timeout == 12.5
    assert LocalGroup(timeout=3).timeout == 3.0  # an explicit timeout wins


def test_default_timeout_not_a_number(monkeypatch):
    monkeypatch.setenv("NGDIST_TIMEOUT", "abc")
    with pytest.raises(CommError) as info:
        default_timeout()
    assert str(info.value) == ("NGDIST_TIMEOUT='abc' is not a number of seconds; set it to "
                               "e.g. 300 or unset it")
    with pytest.raises(CommError, match="NGDIST_TIMEOUT='abc' is not a number"):
        LocalGroup()


@pytest.mark.parametrize("raw", ["-1", "0"])
def test_default_timeout_not_positive(monkeypatch, raw):
    monkeypatch.setenv("NGDIST_TIMEOUT", raw)
    with pytest.raises(CommError) as info:
        default_timeout()
    assert str(info.value) == f"NGDIST_TIMEOUT='{raw}' must be a positive number of seconds"


# ---------------------------------------------------------------- the group
def test_identity_of_a_group_of_one(g):
    assert (g.rank, g.size, g.backend, g.memory) == (0, 1, "local", "host")
    assert g.bytes_sent == 0 and g.local_size == 1
    assert g.world_ranks() == [0]
    assert g.gone(None) == [] and g.gone([0]) == []


def test_world_group_outside_mpiexec_is_local(monkeypatch):
    monkeypatch.delenv("NGDIST_TIMEOUT", raising=False)
    group = world_group(timeout=7)
    assert isinstance(group, LocalGroup) and group.timeout == 7.0


@pytest.mark.parametrize("op", ["sum", "max"])
def test_allreduce_leaves_the_buffer(g, op):
    buf = np.array([1.5, -2.0, 3.0], np.float32)
    before = buf.copy()
    work = g.allreduce(buf, NODE, op=op, peers=[0])
    _done(work, g, NODE)
    assert work.peers == [0]
    np.testing.assert_array_equal(buf, before)
    assert g.bytes_sent == 0


def test_broadcast_leaves_the_buffer(g):
    buf = np.arange(6, dtype=np.int64).reshape(2, 3)
    before = buf.copy()
    _done(g.broadcast(buf, 0, "params"), g, "params")
    np.testing.assert_array_equal(buf, before)


def test_reduce_copies_into_recv(g):
    send = np.array([1.0, 2.0, 3.0])
    recv = np.zeros(3)
    _done(g.reduce(send, recv, 0, "r"), g, "r")
    np.testing.assert_array_equal(recv, [1.0, 2.0, 3.0])
    assert recv is not send and not np.shares_memory(recv, send)


def test_reduce_in_place_and_without_recv(g):
    buf = np.array([4.0, 5.0])
    _done(g.reduce(buf, buf, 0, "r"), g, "r")  # send is recv: reduced in place
    np.testing.assert_array_equal(buf, [4.0, 5.0])
    _done(g.reduce(buf, None, 0, "r"), g, "r")  # no receive buffer: nothing to do
    np.testing.assert_array_equal(buf, [4.0, 5.0])


def test_allgather_copies(g):
    send = np.arange(6, dtype=np.float32).reshape(2, 3)
    recv = np.zeros((2, 3), np.float32)
    _done(g.allgather(send, recv, "ag"), g, "ag")
    np.testing.assert_array_equal(recv, send)
    assert not np.shares_memory(recv, send)


def test_allgather_reshapes_into_the_receive_layout(g):
    send = np.arange(4, dtype=np.int64)
    recv = np.zeros((1, 4), np.int64)
    g.allgather(send, recv, "ag").wait()
    np.testing.assert_array_equal(recv, [[0, 1, 2, 3]])


def test_gather_copies(g):
    send = np.array([7, 8, 9], np.int32)
    recv = np.zeros((1, 3), np.int32)
    _done(g.gather(send, recv, 0, "gather"), g, "gather")
    np.testing.assert_array_equal(recv, [[7, 8, 9]])


def test_reduce_scatter_copies(g):
    send = np.array([[1.0, 2.0]], np.float64)
    recv = np.zeros((1, 2), np.float64)
    _done(g.reduce_scatter(send, recv, "rs"), g, "rs")
    np.testing.assert_array_equal(recv, send)
    assert not np.shares_memory(recv, send)


def test_exchange_without_messages_is_done(g):
    _done(g.exchange([], [], 3, "nothing"), g, "nothing")


@pytest.mark.parametrize("side", ["send", "recv"])
def test_exchange_with_a_peer_is_refused(g, side):
    buf = np.zeros(2)
    sends, recvs = ([(buf, 0)], []) if side == "send" else ([], [(buf, 0)])
    with pytest.raises(CommError) as info:
        g.exchange(sends, recvs, 1, "gossip round 3")
    assert str(info.value) == ("a group of one rank has no peer to exchange messages with "
                               "(gossip round 3)")


def test_barrier(g):
    _done(g.barrier(), g, "barrier")
    _done(g.barrier("end of epoch"), g, "end of epoch")


def test_split(g):
    assert g.split(None, 0, "s") is None
    assert g.split(0, 0, "s") is g
    assert g.split(5, 3, "s") is g


def test_dup_is_a_new_group_with_the_same_timeout(g):
    d = g.dup("d")
    assert isinstance(d, LocalGroup) and d is not g
    assert (d.rank, d.size, d.timeout) == (0, 1, 5.0)
    d.bytes_sent = 9
    assert g.bytes_sent == 0


def test_host_groups(g):
    local, leaders = g.host_groups("hosts")
    assert local is g and leaders is g
    assert g.host_groups("hosts", ranks_per_host=2) == (g, g)


def test_check_same_is_a_no_op(g, monkeypatch):
    def no_comm(*args, **kwargs):
        raise AssertionError("a group of one rank must not communicate")

    monkeypatch.setattr(g, "allgather", no_comm)
    assert g.check_same(b"anything", "step graph") is None


def test_broadcast_arrays_is_a_no_op(g, monkeypatch):
    def no_comm(*args, **kwargs):
        raise AssertionError("a group of one rank must not communicate")

    monkeypatch.setattr(g, "broadcast", no_comm)
    arrays = [np.arange(3, dtype=np.float32), np.zeros((0,), np.int64)]
    assert g.broadcast_arrays(arrays, root=0) is None
    np.testing.assert_array_equal(arrays[0], [0, 1, 2])


# ---------------------------------------------------------------- messages
def test_describe():
    assert describe(NODE) == "ngdist.AllReduce 'ngdist/allreduce/bucket0'"
    assert describe("start-up exchange") == "'start-up exchange'"
    assert describe(SimpleNamespace(name="no op type")) == "'no op type'"
    other = SimpleNamespace(op_type="AllReduce", name="ngdist/allreduce/bucket1")
    assert describe((NODE, other)) == \
        "ngdist.AllReduce 'ngdist/allreduce/bucket0', 'ngdist/allreduce/bucket1'"
    assert describe((NODE,)) == describe(NODE)  # one node's call, as the node itself

    class Named(NamedTuple):  # a named tuple with a name is one thing, not several
        op_type: str
        name: str

    assert describe(Named("PSPushPull", "ps/0")) == "ngdist.PSPushPull 'ps/0'"

    class Costly:  # a comm node's text shows its state's arrays: never made for its name
        op_type, name = "AllReduce", "bucket0"

        def __str__(self) -> str:
            raise AssertionError("describe() made the text of a thing with a name")

    assert describe(Costly()) == "ngdist.AllReduce 'bucket0'"
    assert describe((Costly(), Costly())) == "ngdist.AllReduce 'bucket0', 'bucket0'"


def test_allreduce_coalesced_by_default_reduces_each_buffer_and_waits_for_all(g):
    bufs = [np.arange(4, dtype=np.float32), np.ones(2, np.float64)]
    work = g.allreduce_coalesced(bufs, (NODE, NODE), op="mean")
    assert [type(w) for w in work.works] == [DoneWork, DoneWork]
    assert work.test() is True and work.wait() is None
    np.testing.assert_array_equal(bufs[0], [0, 1, 2, 3])  # one rank: the mean is the value


def test_timeout_message(g):
    assert g.timeout_message(NODE) == (
        "ngdist.AllReduce 'ngdist/allreduce/bucket0' did not complete within 5 s on rank 0 "
        "(waiting for ranks 0..0); a rank has probably died or is running a different "
        "program. Check the other ranks' output; raise the limit with timeout= or "
        "NGDIST_TIMEOUT")
    assert "(waiting for peers [0])" in g.timeout_message("x", [0])
    assert "within 2.5 s" in LocalGroup(timeout=2.5).timeout_message("x")


def test_gone_message(g):
    assert g.gone_message("ring step", [1, 2]) == (
        "'ring step' cannot complete on rank 0: the process of rank 1, rank 2 has exited. "
        "Look at that rank's output for why it stopped")


def test_abort_of_a_local_group_raises(g):
    with pytest.raises(CommError) as info:
        g.abort("the job cannot go on")
    assert str(info.value) == "the job cannot go on"


# ---------------------------------------------------------------- Work.wait, poll mode
class _Pending(Work):
    """A Work that completes when ``done`` is set (never, unless a test sets it)."""

    def __init__(self, group, what, peers=None):
        super().__init__(group, what, peers)
        self.done = threading.Event()
        self.tests = 0

    def test(self) -> bool:
        self.tests += 1
        return self.done.is_set()

    def _block(self) -> None:
        self.done.wait()


class _GonePeer(LocalGroup):
    """A group of two whose rank 1 process is known to have exited."""

    size = 2

    def gone(self, peers):
        return [r for r in (range(self.size) if peers is None else peers) if r == 1]


def test_wait_returns_at_once_when_the_work_is_complete(g):
    work = _Pending(g, "w")
    work.done.set()
    work.wait()
    assert work.tests == 1


@pytest.mark.parametrize("how", ["gentle", "env"])
def test_poll_wait_raises_timeout_in_this_thread(monkeypatch, how):
    monkeypatch.setenv("NGDIST_WAIT", "poll" if how == "env" else "watchdog")
    group = LocalGroup(timeout=0.5)
    work = _Pending(group, NODE, peers=[0])
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        work.wait(gentle=how == "gentle")
    elapsed = time.monotonic() - start
    assert str(info.value) == group.timeout_message(NODE, [0])
    assert "did not complete within 0.5 s on rank 0 (waiting for peers [0])" in str(info.value)
    assert 0.5 <= elapsed < 1.5, elapsed
    assert work.tests > 2  # it polled


def test_poll_wait_returns_when_the_work_completes(monkeypatch):
    monkeypatch.setenv("NGDIST_WAIT", "poll")
    work = _Pending(LocalGroup(timeout=10), "late")
    threading.Timer(0.2, work.done.set).start()
    start = time.monotonic()
    work.wait()
    assert 0.15 < time.monotonic() - start < 5


def test_poll_wait_fails_on_a_dead_peer_before_the_timeout(monkeypatch):
    monkeypatch.setenv("NGDIST_WAIT", "poll")
    monkeypatch.setattr(group_module, "DEAD_CHECK_AFTER_S", 0.1)
    monkeypatch.setattr(group_module, "DEAD_GRACE_S", 0.2)
    group = _GonePeer(timeout=10)
    work = _Pending(group, NODE, peers=[1])
    start = time.monotonic()
    with pytest.raises(CommError) as info:
        work.wait()
    elapsed = time.monotonic() - start
    assert not isinstance(info.value, CommTimeoutError)
    assert str(info.value) == (
        "ngdist.AllReduce 'ngdist/allreduce/bucket0' cannot complete on rank 0: the process "
        "of rank 1 has exited. Look at that rank's output for why it stopped")
    assert elapsed < 5, elapsed


def test_poll_wait_ignores_peers_it_does_not_wait_for(monkeypatch):
    monkeypatch.setenv("NGDIST_WAIT", "poll")
    monkeypatch.setattr(group_module, "DEAD_CHECK_AFTER_S", 0.05)
    monkeypatch.setattr(group_module, "DEAD_GRACE_S", 0.05)
    work = _Pending(_GonePeer(timeout=0.8), "only rank 0", peers=[0])
    with pytest.raises(CommTimeoutError):  # rank 1 is gone, but this wait is not on it
        work.wait()
