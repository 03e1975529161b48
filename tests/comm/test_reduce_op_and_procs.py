"""ReduceOp (the one table of reduction ops every group reads), proc_stat/alive (the one
parse of /proc/PID/stat) and gone_message with the pids a group knows."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from ngdist.comm import LocalGroup
from ngdist.comm.group import ReduceOp, alive, proc_stat


def test_reduce_op_is_the_string_it_names():
    assert ReduceOp("mean") is ReduceOp.MEAN and ReduceOp.MEAN == "mean"
    assert [op.value for op in ReduceOp] == ["sum", "mean", "max", "min"]
    with pytest.raises(ValueError):
        ReduceOp("avg")


@pytest.mark.parametrize("op, oracle", [("sum", np.add), ("mean", np.add),
                                        ("max", np.maximum), ("min", np.minimum)])
def test_reduce_op_combines_as_numpy_does(op, oracle):
    a, b = np.array([1.0, 5.0, -2.0]), np.array([3.0, -1.0, -2.5])
    assert np.array_equal(ReduceOp(op).ufunc(a, b), oracle(a, b))
    assert ReduceOp(op).summed is (op in ("sum", "mean"))


def test_a_local_group_refuses_an_unknown_op():
    with pytest.raises(ValueError, match="'avg' is not a valid ReduceOp"):
        LocalGroup(timeout=5).allreduce(np.zeros(2), "x", op="avg")


def test_proc_stat_of_this_process_and_of_no_process():
    fields = proc_stat(os.getpid())
    assert fields is not None and fields[0] in "RS" and int(fields[1]) == os.getppid()
    assert alive(os.getpid())
    assert proc_stat(2 ** 22 + 7) is None and not alive(2 ** 22 + 7)  # above pid_max


def test_a_zombie_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while proc_stat(child.pid)[0] != "Z":  # exited, not reaped yet
        assert time.monotonic() < deadline, proc_stat(child.pid)
        time.sleep(0.01)
    assert not alive(child.pid)
    child.wait()
    assert not alive(child.pid)


class _Known(LocalGroup):
    rank, size = 0, 3

    def pid_of(self, world_rank):
        return {2: 4242}.get(world_rank)


def test_gone_message_names_the_pid_where_the_group_knows_it():
    assert _Known(timeout=5).gone_message("ring step", [1, 2]) == (
        "'ring step' cannot complete on rank 0: the process of rank 1, rank 2 (pid 4242) "
        "has exited. Look at that rank's output for why it stopped")
