"""How a rank waits for its peers without starving them: spin, then sleep.

A wait that completes within ``SPIN_S`` (every collective of a healthy step) polls without
pause (``SPINS`` looks back to back, then giving the core up between looks (``sched_yield``: no delay when the core is free, the
peers' turn when ranks outnumber cores). A wait that lasts longer is waiting for a peer that
is late, slow or gone: it sleeps between looks, 1 ms at first, doubling up to ``SLEEP_MAX_S``,
so that a rank waiting for the collective timeout uses a small fraction of a core instead of
all of it. Used by every blocking wait of the comm layer (MPI requests in comm/mpi.py, the
flag barriers of comm/shared.py); the deadline and the dead-peer watch stay the watchdog's.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

SPINS = 64           # the first looks: not even a yield between them
SPIN_S = 0.02        # polls without sleeping this long
SLEEP_MIN_S = 0.001  # then sleeps this long between polls, doubling
SLEEP_MAX_S = 0.004  # up to this


class Backoff:
    """``pause()`` between two looks at something a peer will change (module docstring)."""

    __slots__ = ("_spins", "_spin_until", "_sleep")

    def __init__(self) -> None:
        self._spins = 0
        self._spin_until = time.monotonic() + SPIN_S
        self._sleep = SLEEP_MIN_S

    def pause(self) -> None:
        if self._spins < SPINS:
            self._spins += 1
            return
        if self._spin_until and time.monotonic() < self._spin_until:
            os.sched_yield()
            return
        self._spin_until = 0.0
        time.sleep(self._sleep)
        self._sleep = min(2 * self._sleep, SLEEP_MAX_S)


def wait_until(done: Callable[[], bool]) -> None:
    """Poll ``done()`` until it is true, pausing with a :class:`Backoff` between looks."""
    if done():
        return
    backoff = Backoff()
    while not done():
        backoff.pause()
