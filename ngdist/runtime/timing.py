"""Where a step's time goes: the totals of a step (:class:`StepTimes`) and :func:`span`, the
one way the runtime times a piece of work (and records it on the job's timeline)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class StepTimes:
    """Seconds of one step spent computing, communicating, and waiting for communication."""

    compute: float = 0.0
    comm: float = 0.0
    wait: float = 0.0


@contextmanager
def span(timeline: Any, cat: str, name: str, took: list[float] | None = None,
         args: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Times the block: appends the seconds to ``took`` and records the span on ``timeline``
    (any object with ``record(cat, name, t0, t1, args)``; None: not recorded) with ``args``,
    which the block may add to (the dict it gets). A block that raises is not recorded."""
    args = {} if args is None else args
    t0 = time.perf_counter()
    yield args
    t1 = time.perf_counter()
    if took is not None:
        took.append(t1 - t0)
    if timeline is not None:
        timeline.record(cat, name, t0, t1, args)
