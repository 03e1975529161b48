"""Where a step's time goes: the totals of a step (:class:`StepTimes`) and :func:`span`, the
one way the runtime times a piece of work (and records it on the job's timeline)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class StepTimes:
    """Seconds of one step spent computing, communicating, and waiting for communication."""

    compute: float = 0.0
    comm: float = 0.0
    wait: float = 0.0


class span:  # noqa: N801 - used as a function: ``with span(...) as args``
    """Times the block: appends the seconds to ``took`` and records the span on ``timeline``
    (any object with ``record(cat, name, t0, t1, args)``; None: not recorded) with ``args``,
    which the block may add to (the dict it gets). A block that raises is not recorded. A
    class rather than a generator: it is entered for every item of every step."""

    __slots__ = ("timeline", "cat", "name", "took", "args", "t0")

    def __init__(self, timeline: Any, cat: str, name: str, took: list[float] | None = None,
                 args: dict[str, Any] | None = None) -> None:
        self.timeline, self.cat, self.name, self.took = timeline, cat, name, took
        self.args = {} if args is None else args

    def __enter__(self) -> dict[str, Any]:
        self.t0 = time.perf_counter()
        return self.args

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is not None:
            return
        t1 = time.perf_counter()
        if self.took is not None:
            self.took.append(t1 - self.t0)
        if self.timeline is not None:
            self.timeline.record(self.cat, self.name, self.t0, t1, self.args)
