"""A rank that waits for a late peer backs off from spinning to sleeping (comm/backoff.py):
on real MPI ranks, 3 s at a barrier (MPI requests) and inside a training step (the step's
AllReduce, through shared memory where it runs there) cost the waiting rank a small fraction of
a core; before, it polled all the time (0.4 s of CPU per 3 s on a loaded 2-core machine, a
whole core on an idle one)."""
from __future__ import annotations

import re
import time

import pytest

from ngdist.comm import backoff

SCRIPT = r"""
import resource, time
import numpy as np
import ngdist
from ngdist.zoo import mlp


def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


rank = ngdist.rank()
ngdist.barrier(timeout=60)
t0, c0 = time.monotonic(), cpu()
if rank == 1:
    time.sleep(3)
ngdist.barrier(timeout=60)
if rank == 0:
    print(f"barrier {time.monotonic() - t0:.2f} {cpu() - c0:.3f}", flush=True)
trainer = ngdist.compile(mlp((64, 32, 10)), optimizer=ngdist.optim.SGD(lr=0.1), timeout=60)
x, y = np.ones((8, 64), np.float32), np.arange(8) % 10
for _ in range(3):
    trainer.step({"x": x, "y": y})
ngdist.barrier(timeout=60)
t0, c0 = time.monotonic(), cpu()
if rank == 1:
    time.sleep(3)
trainer.step({"x": x, "y": y})
if rank == 0:
    print(f"step {time.monotonic() - t0:.2f} {cpu() - c0:.3f}", flush=True)
"""


@pytest.mark.mpi
def test_a_rank_waiting_for_a_late_peer_sleeps(ranks):
    proc = ranks(2, SCRIPT, timeout=120)
    for what in ("barrier", "step"):
        match = re.search(rf"^{what} ([\d.]+) ([\d.]+)$", proc.stdout, re.M)
        assert match, proc.stdout
        waited, cpu = float(match.group(1)), float(match.group(2))
        assert waited >= 2.9, (what, waited)
        assert cpu < 0.25, (what, cpu)  # a few percent of the 3 s, not a spinning core


def test_backoff_spins_first_then_sleeps_up_to_its_longest_sleep(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(backoff.time, "sleep", slept.append)
    pause = backoff.Backoff()
    t0 = time.monotonic()
    while time.monotonic() - t0 < backoff.SPIN_S / 2:
        pause.pause()
    assert slept == []  # a short wait never sleeps
    deadline = time.monotonic() + backoff.SPIN_S
    while time.monotonic() < deadline:
        pause.pause()
    for _ in range(5):
        pause.pause()
    assert slept[:3] == [0.001, 0.002, 0.004]
    assert set(slept[3:]) == {backoff.SLEEP_MAX_S}


def test_wait_until_returns_at_once_when_done():
    calls = []
    backoff.wait_until(lambda: calls.append(1) or True)
    assert calls == [1]
